//! Clients of the Proxmox APIs: HTTPS over hyper with the API trust profile of
//! `certistack_core::tls` (`https`), and on it the Proxmox VE API (`pve`) and the Proxmox Backup
//! Server API (`pbs`). They import only
//! `core`, never `plan` or `runner`: resolvers and preflight checks call them, not the other
//! way round.

pub mod https;
pub mod pbs;
pub mod pve;
