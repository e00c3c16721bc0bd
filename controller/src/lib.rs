//! The CertiStack controller: holds every secret (CA, run authority, report signing), enrolls
//! nodes, mints per-run credentials and talks to connectors.

#![forbid(unsafe_code)]

pub mod api;
pub mod audit;
pub mod authority;
pub mod catalog;
pub mod client;
pub mod cluster;
pub mod commands;
pub mod config;
pub mod connect;
pub mod doctor;
pub mod exit;
pub mod history;
pub mod interrupt;
pub mod metrics;
pub mod notify;
pub mod operator;
pub mod package;
pub mod placer;
pub mod plan;
pub mod plan_run;
pub mod report;
pub mod run;
pub mod runner;
pub mod screenshot;
pub mod surface;
pub mod verdict;
