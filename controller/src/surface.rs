//! The compiled RPC surface, as `certistack-ctl surface` prints it.

use certistack_proto::{SERVICE_NAME, SURFACE_DESCRIPTOR, SURFACE_DIGEST, SURFACE_PARTS};
use prost::Message;

/// One line per RPC (`/service/Method request -> reply`), one line per part the digest covers
/// (`part: <label> sha256:<hex of its content>`), then `digest: sha256:<hex>`.
pub fn describe() -> Result<String, prost::DecodeError> {
    let file = prost_types::FileDescriptorProto::decode(SURFACE_DESCRIPTOR)?;
    let mut out = String::new();
    for service in &file.service {
        for method in &service.method {
            let short = |t: &str| t.rsplit('.').next().unwrap_or(t).to_owned();
            let reply = if method.server_streaming() {
                format!("stream {}", short(method.output_type()))
            } else {
                short(method.output_type())
            };
            out.push_str(&format!(
                "/{SERVICE_NAME}/{} {} -> {reply}\n",
                method.name(),
                short(method.input_type())
            ));
        }
    }
    for (label, digest) in SURFACE_PARTS {
        out.push_str(&format!("part: {label} {digest}\n"));
    }
    out.push_str(&format!("digest: {SURFACE_DIGEST}\n"));
    Ok(out)
}
