//! Test support: a PKI made with the controller's own code, connectors served in-process on
#![forbid(unsafe_code)]
//! loopback with a recording executor, and clients with chosen TLS identities.
//!
//! Everything here is a test double and lives only in this crate, which is never packaged.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_debug_implementations
)]

mod api_doubles;
mod assertions;
mod daemon_process;
pub mod drifted;
mod grants;
mod guest_assets;
mod in_process_node;
mod lab;
mod netns;
mod pki;
mod recording_executor;
mod skips;
mod temp_dir;

pub use api_doubles::*;
pub use assertions::*;
pub use daemon_process::*;
pub use drifted::{node_tls_server_config, serve_drifted};
pub use grants::*;
pub use guest_assets::*;
pub use in_process_node::*;
pub use lab::*;
pub use netns::*;
pub use pki::*;
pub use recording_executor::*;
pub use skips::*;
pub use temp_dir::*;
