//! Compiles the connector surface with protox (no system `protoc`) and derives its digest.
//!
//! The digest is SHA-256 over the prost encoding of the surface's `FileDescriptorProto` with the
//! source info (comments, spans) removed: it changes when a service, method, message, field,
//! type or number changes, and not when a comment does. prost encodes fields in field-number
//! order, so the encoding is deterministic for a given descriptor.

use prost::Message;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

const SURFACE_FILE: &str = "certistack/connector/v1/connector.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed={SURFACE_FILE}");

    let mut descriptors = protox::compile([SURFACE_FILE], ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors.clone())?;
    // The server is generated on its own so that it decodes requests with the codec that
    // answers an undecodable request INVALID_ARGUMENT; it reuses the messages generated above.
    let server_dir = out_dir.join("server");
    std::fs::create_dir_all(&server_dir)?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .codec_path("crate::codec::RequestCodec")
        .extern_path(".certistack.connector.v1", "crate::v1")
        .out_dir(&server_dir)
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors.clone())?;

    for file in &mut descriptors.file {
        file.source_code_info = None;
    }
    let surface = descriptors
        .file
        .iter()
        .find(|file| file.name() == SURFACE_FILE)
        .ok_or("the compiled descriptor set lacks the surface file")?;
    let canonical = surface.encode_to_vec();
    let digest = hex::encode(Sha256::digest(&canonical));

    std::fs::write(out_dir.join("surface_descriptor.bin"), &canonical)?;
    std::fs::write(
        out_dir.join("surface_digest.txt"),
        format!("sha256:{digest}"),
    )?;
    Ok(())
}
