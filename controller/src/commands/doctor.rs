//! The `doctor` command: which inventory nodes to ask, then the verdicts of `crate::doctor`
//! printed and turned into the exit status.

use super::target::inventory_lookup;
use super::{Threads, load_authority, load_config, load_plan, runtime};
use crate::exit::{self, ExitStatus};
use std::path::PathBuf;
use time::OffsetDateTime;

#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// Inventory names of the nodes to check; every node of the inventory when none is given.
    pub nodes: Vec<String>,
    /// The controller configuration (its state directory and node inventory).
    #[arg(long, default_value = crate::config::DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// One JSON object per check, one per line.
    #[arg(long)]
    pub json: bool,
    /// The sandbox VNet to check on every node checked (its forwarding, its SDN stanza, the
    /// legacy NAT rules that touch it).
    #[arg(long, conflicts_with = "plan")]
    pub vnet: Option<String>,
    /// A plan: each node is checked with the VNet of the plan's first validation on it.
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Also boot the libguestfs appliance once on each node, as a guest network recovery
    /// would (its unit, its accelerator), for at most this many seconds (the node's
    /// limits.guest_network_timeout_secs caps it), and report how long it took.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, require_equals = true,
          default_missing_value = "300", value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub boot_appliance: Option<u32>,
}

pub fn doctor(args: &DoctorArgs, now: OffsetDateTime) -> Result<(), ExitStatus> {
    use crate::doctor;
    let config = load_config(&args.config)?;
    let nodes = if args.nodes.is_empty() {
        config.nodes.values().collect::<Vec<_>>()
    } else {
        args.nodes
            .iter()
            .map(|name| inventory_lookup(&config, name, &args.config))
            .collect::<Result<Vec<_>, _>>()?
    };
    let mut vnets = doctor::VnetsByNode::new();
    if let Some(vnet) = &args.vnet {
        use certistack_core::validate::{Validated, VnetName};
        let vnet = VnetName::validate(vnet)
            .map_err(|reason| ExitStatus::usage(format!("--vnet {vnet:?}: {reason}")))?;
        for node in &nodes {
            vnets.insert(node.name.to_string(), vnet.clone());
        }
    }
    if let Some(plan) = &args.plan {
        for validation in
            load_plan(plan, &config, crate::runner::DEFAULT_PER_NODE, now)?.validations
        {
            vnets
                .entry(validation.grant.node.to_string())
                .or_insert(validation.grant.vnet);
        }
    }
    // The controller's keys are checked before anything is contacted; a configuration with
    // `[pve]` and no nodes yet is checked without them.
    let node_identity = if nodes.is_empty() && config.pve.is_some() {
        None
    } else {
        let authority = load_authority(&config.state_dir)?;
        let identity = authority
            .issue_operator("doctor", now)
            .map_err(|e| ExitStatus::new(exit::REFUSED_CONFIG, e.to_string()))?;
        Some((authority, identity))
    };
    let runtime = runtime(Threads::Two).map_err(ExitStatus::runtime_refused)?;
    // The cluster's lines first: nodes are judged against a cluster that answers.
    let cluster = match &config.pve {
        Some(settings) => runtime.block_on(doctor::check_cluster(
            settings,
            crate::api::https::Limits::default(),
        )),
        None => Vec::new(),
    };
    let node_checks = match node_identity {
        None => Vec::new(),
        Some((authority, identity)) => runtime.block_on(doctor::check_fleet(
            nodes,
            authority.ca_pem(),
            std::sync::Arc::new(identity),
            std::sync::Arc::new(vnets),
            args.boot_appliance
                .map(|secs| std::time::Duration::from_secs(u64::from(secs))),
            crate::audit::DEFAULT_CONCURRENCY,
            doctor::DEFAULT_NODE_TIMEOUT,
        )),
    };
    let checks: Vec<Vec<doctor::Check>> = std::iter::once(cluster).chain(node_checks).collect();
    for check in checks.iter().flatten() {
        if args.json {
            println!("{}", check.to_json());
        } else {
            println!("{}", check.line());
        }
    }
    ExitStatus::of_doctor(checks.iter().flatten())
}
