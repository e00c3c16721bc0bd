//! The bodies of the `certistack-ctl` commands: what each one reads, asks and prints. The
//! binary parses the command line and dispatches here.
#![allow(clippy::print_stdout)]

pub mod audit;
pub mod ca;
pub mod doctor;
pub mod hello;
pub mod history;
pub mod operator;
pub mod package;
pub mod plan;
pub mod report;
pub mod run;
pub mod surface;
pub mod target;

use crate::authority;
use crate::exit::ExitStatus;
use time::OffsetDateTime;

/// The runtime a command's calls run on: one thread for one node, two workers for a fleet or
/// a plan (the calls wait on the network, not the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    One,
    Two,
}

/// Builds the tokio runtime of a command.
pub fn runtime(threads: Threads) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        Threads::One => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        Threads::Two => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build(),
    }
}

/// Loads the controller's state directory (CA and keys); its failures exit as
/// `From<AuthorityError> for ExitStatus` says.
pub fn load_authority(state_dir: &std::path::Path) -> Result<authority::Authority, ExitStatus> {
    Ok(authority::Authority::load(state_dir)?)
}

/// Loads the controller configuration; its failures exit as `From<ConfigError>` says.
pub fn load_config(
    config: &std::path::Path,
) -> Result<crate::config::ControllerConfig, ExitStatus> {
    Ok(crate::config::ControllerConfig::load(config)?)
}

/// Loads and checks a plan, asking the PBS API where it says `snapshot: latest` and the PVE API
/// where it says `select` or leaves sandbox VMIDs out, and placing `node: auto` as `per_node`
/// validations at once on one node would run; its failures exit as `From<PlanError>` says.
pub fn load_plan(
    plan: &std::path::Path,
    config: &crate::config::ControllerConfig,
    per_node: usize,
    now: OffsetDateTime,
) -> Result<crate::plan::Plan, ExitStatus> {
    let catalog = crate::catalog::PbsCatalog::new();
    let cluster = crate::cluster::PveCluster::new(config.pve.as_ref());
    let rooms = crate::placer::NodeRooms::new(config, &cluster, per_node);
    let plan = crate::plan::Plan::load_with(
        plan,
        config,
        now.unix_timestamp(),
        crate::plan::Resolvers {
            catalog: &catalog,
            cluster: &cluster,
            rooms: &rooms,
        },
    )
    .map_err(crate::exit::plan_refused)?;
    crate::exit::print_plan_warnings(&plan);
    Ok(plan)
}
