//! Clients of the Proxmox APIs: HTTPS over hyper with the API trust profile of
//! `certistack_core::tls` (`https`), and the Proxmox VE API on it (`pve`). They import only
//! `core`, never `plan` or `runner`: resolvers and preflight checks call them, not the other
//! way round.

pub mod https;
pub mod pve;
