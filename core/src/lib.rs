//! What the CertiStack connector and controller share, and nothing either keeps to itself:
//! the validated names and values of the wire ([`validate`], [`net`]), the run grant's codec and
//! verification ([`grant`], [`known_fields`]), certificate identities ([`identity`]), the
//! journal's format and its verification ([`journal`]), file checks ([`files`]), one process at a time on a directory
//! ([`instance_lock`]), escaping of
//! untrusted text ([`untrusted`]), the TLS profiles ([`tls`]), QEMU's run states ([`qemu`]) and
//! the bounds both sides rely on ([`limits`]).
//!
//! The controller depends on this crate and on `certistack-proto`, never on the daemon.

#![forbid(unsafe_code)]

pub mod files;
/// Grants for tests, never in a shipped build: `cfg(test)` here, the `fixtures` feature
/// (a dev-dependency feature) for the other crates' tests.
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod grant;
pub mod identity;
pub mod instance_lock;
pub mod journal;
pub mod known_fields;
pub mod limits;
pub mod net;
pub mod qemu;
pub mod tls;
pub mod untrusted;
pub mod validate;
