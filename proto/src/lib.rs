//! The fixed gRPC surface of the CertiStack connector.
//!
//! Both binaries compile this crate in, so both carry the same [`SURFACE_DIGEST`]; the daemon
//! returns it in `Hello` and the controller refuses a node whose digest differs from its own.
//! The digest covers the proto and the policy files (`build.rs` defines the exact bytes), so a
//! node's digest ties it to the surface and policy an auditor reviewed.

#![forbid(unsafe_code)]
#![allow(
    missing_debug_implementations,
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

/// Generated messages, client and server for `certistack.connector.v1`.
pub mod v1 {
    tonic::include_proto!("certistack.connector.v1");
    include!(concat!(
        env!("OUT_DIR"),
        "/server/certistack.connector.v1.rs"
    ));
}

pub mod codec;

/// `sha256:<hex>` over the canonical surface descriptor and the policy files (see `build.rs`).
pub const SURFACE_DIGEST: &str = include_str!(concat!(env!("OUT_DIR"), "/surface_digest.txt"));

/// Each part the digest covers, in digest order: its label and `sha256:<hex>` of its content.
pub const SURFACE_PARTS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/surface_parts.rs"));

/// The commit the binaries were built from (`git rev-parse HEAD`), or `unknown`.
pub const SOURCE_COMMIT: &str = include_str!(concat!(env!("OUT_DIR"), "/source_commit.txt"));

/// Whether the sources of the binaries differed from [`SOURCE_COMMIT`] when they were built.
pub const SOURCE_TREE_DIRTY: bool = include!(concat!(env!("OUT_DIR"), "/source_dirty.rs"));

/// The canonical (comment-free) encoded `FileDescriptorProto` the digest is computed over.
pub const SURFACE_DESCRIPTOR: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/surface_descriptor.bin"));

/// Fully qualified gRPC service name.
pub const SERVICE_NAME: &str = "certistack.connector.v1.Connector";

/// Domain separation prefix of the run-grant signature.
pub const GRANT_SIGNATURE_CONTEXT: &[u8] = b"certistack-run-grant-v1\0";
