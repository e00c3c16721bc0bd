//! The CertiStack node connector: a fixed gRPC surface over mTLS, authorized per run.
//!
//! Request path: [`connection`] and [`tls`] (who is connecting, within the connection limits)
//! → [`service`] (authenticate, parse into an [`action::Action`], [`action::authorize`] against
//! the run's [`certistack_core::grant::Grant`]) → [`executor::Executor`] (the side effect).
//! Policy data lives in `policy/` and is compiled in ([`policy`]). What the controller shares
//! with the daemon is in `certistack-core`; this library is the node's alone.

#![deny(unsafe_code)]

pub mod action;
pub mod call_log;
pub mod check;
pub mod clock;
pub mod config;
pub mod connection;
pub mod enroll;
pub mod executor;
pub mod log_line;
pub mod node;
pub mod policy;
pub mod prerequisites;
pub mod process;
pub mod refusal_log;
pub mod resources;
pub mod runs;
pub mod server;
pub mod service;
pub mod source_hardware;
pub mod success_lines;
pub mod systemd;
pub mod tls;
pub mod virtualization;
