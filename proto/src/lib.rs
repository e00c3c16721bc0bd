//! The fixed gRPC surface of the CertiStack connector.
//!
//! Both binaries compile this crate in, so both carry the same [`SURFACE_DIGEST`]; the daemon
//! returns it in `Hello` and the controller refuses a node whose digest differs from its own.

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

/// `sha256:<hex>` of the canonical encoding of the surface's file descriptor.
pub const SURFACE_DIGEST: &str = include_str!(concat!(env!("OUT_DIR"), "/surface_digest.txt"));

/// The canonical (comment-free) encoded `FileDescriptorProto` the digest is computed over.
pub const SURFACE_DESCRIPTOR: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/surface_descriptor.bin"));

/// Fully qualified gRPC service name.
pub const SERVICE_NAME: &str = "certistack.connector.v1.Connector";

/// Domain separation prefix of the run-grant signature.
pub const GRANT_SIGNATURE_CONTEXT: &[u8] = b"certistack-run-grant-v1\0";
