//! Compiles the connector surface with protox (no system `protoc`), derives the surface digest
//! over the proto and the policy files, and records the source commit.
//!
//! The surface digest is `sha256:` and the lower-case hex SHA-256 of the concatenation, in this
//! order, of one record per part:
//!
//! ```text
//! u32 big-endian length of the label || label (ASCII) || u64 big-endian length of the content || content
//! ```
//!
//! 1. label `proto/certistack/connector/v1/connector.proto#descriptor`: the prost encoding of the
//!    surface's `FileDescriptorProto` with `source_code_info` (comments, spans) removed. prost
//!    writes fields in field-number order, so the encoding is deterministic; it changes when a
//!    service, method, message, field, type, number or `json_name` changes, not when a comment
//!    does;
//! 2. to 6. labels `policy/rpc-surface.toml`, `policy/field-validators.toml`,
//!    `policy/qmp-allowlist.toml`, `policy/qga-allowlist.toml`, `policy/source-hardware.toml`:
//!    the exact file bytes, with each CR LF replaced by LF (so a checkout with Windows line
//!    endings hashes the same). Comments in the policy files are reviewed text and count.
//!
//! `docs/architecture.md` ("Surface digest") states the same for a second implementation.

use prost::Message;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

const SURFACE_FILE: &str = "certistack/connector/v1/connector.proto";
const DESCRIPTOR_LABEL: &str = "proto/certistack/connector/v1/connector.proto#descriptor";
/// The policy files the digest covers, in digest order, relative to the workspace root.
const POLICY_FILES: [&str; 5] = [
    "policy/rpc-surface.toml",
    "policy/field-validators.toml",
    "policy/qmp-allowlist.toml",
    "policy/qga-allowlist.toml",
    "policy/source-hardware.toml",
];
/// What goes into the binaries: a change here makes the tree dirty for the source report.
const SOURCE_PATHS: [&str; 6] = [
    "connector",
    "controller",
    "proto",
    "policy",
    "Cargo.toml",
    "Cargo.lock",
];

fn record(label: &str, content: &[u8]) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut out = Vec::with_capacity(12 + label.len() + content.len());
    out.extend_from_slice(&u32::try_from(label.len())?.to_be_bytes());
    out.extend_from_slice(label.as_bytes());
    out.extend_from_slice(&u64::try_from(content.len())?.to_be_bytes());
    out.extend_from_slice(content);
    Ok(out)
}

fn normalize_line_endings(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut iter = bytes.iter().peekable();
    while let Some(&byte) = iter.next() {
        if byte == b'\r' && iter.peek() == Some(&&b'\n') {
            continue;
        }
        out.push(byte);
    }
    out
}

fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The commit HEAD names and whether the sources of the binaries differ from it; a build from
/// a tarball sets `CERTISTACK_SOURCE_COMMIT` (and `CERTISTACK_SOURCE_DIRTY=1` if patched).
fn source(root: &Path) -> (String, bool) {
    println!("cargo:rerun-if-env-changed=CERTISTACK_SOURCE_COMMIT");
    println!("cargo:rerun-if-env-changed=CERTISTACK_SOURCE_DIRTY");
    if let Ok(commit) = std::env::var("CERTISTACK_SOURCE_COMMIT") {
        let dirty = std::env::var("CERTISTACK_SOURCE_DIRTY").is_ok_and(|v| v == "1");
        return (commit, dirty);
    }
    let Some(commit) = git(root, &["rev-parse", "HEAD"]) else {
        return ("unknown".into(), false);
    };
    // Rebuild the report when HEAD moves (checkout, commit) or a source changes.
    for dir in ["--git-dir", "--git-common-dir"] {
        if let Some(dir) = git(root, &["rev-parse", "--path-format=absolute", dir]) {
            let dir = PathBuf::from(dir);
            for watched in ["HEAD", "refs", "packed-refs"] {
                if dir.join(watched).exists() {
                    println!("cargo:rerun-if-changed={}", dir.join(watched).display());
                }
            }
        }
    }
    for path in SOURCE_PATHS {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
    // --no-optional-locks: status must not refresh the index, or the next build would run this
    // script again for nothing.
    let mut status = vec!["--no-optional-locks", "status", "--porcelain", "--"];
    status.extend(SOURCE_PATHS);
    let dirty = git(root, &status).is_none_or(|changes| !changes.is_empty());
    (commit, dirty)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir
        .parent()
        .ok_or("the proto crate has no parent directory")?
        .to_owned();
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

    let mut parts = vec![(DESCRIPTOR_LABEL.to_owned(), canonical.clone())];
    for policy in POLICY_FILES {
        let path = root.join(policy);
        println!("cargo:rerun-if-changed={}", path.display());
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        parts.push((policy.to_owned(), normalize_line_endings(&bytes)));
    }
    let mut hashed = Vec::new();
    let mut part_digests = String::from("&[\n");
    for (label, content) in &parts {
        hashed.extend(record(label, content)?);
        part_digests.push_str(&format!(
            "    ({label:?}, \"sha256:{}\"),\n",
            hex::encode(Sha256::digest(content))
        ));
    }
    part_digests.push(']');
    let digest = hex::encode(Sha256::digest(&hashed));

    let (commit, dirty) = source(&root);

    std::fs::write(out_dir.join("surface_descriptor.bin"), &canonical)?;
    std::fs::write(
        out_dir.join("surface_digest.txt"),
        format!("sha256:{digest}"),
    )?;
    std::fs::write(out_dir.join("surface_parts.rs"), part_digests)?;
    std::fs::write(out_dir.join("source_commit.txt"), commit)?;
    std::fs::write(out_dir.join("source_dirty.rs"), dirty.to_string())?;
    Ok(())
}
