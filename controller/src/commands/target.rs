//! Which node an operator command addresses: an inventory name, or a state directory and
//! address given directly; and a call made there as an operator.

use super::{Threads, load_authority, load_config, runtime};
use crate::exit::ExitStatus;
use std::path::PathBuf;
use time::OffsetDateTime;

/// A node addressed by its inventory name, or directly by state directory and address.
#[derive(clap::Args, Debug)]
pub struct NodeTarget {
    /// The controller configuration whose inventory names the node.
    #[arg(long, default_value = crate::config::DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Direct form: the controller's state directory (with --node HOST:PORT).
    #[arg(long, requires = "node")]
    pub state_dir: Option<PathBuf>,
    /// Direct form: the connector's address, HOST:PORT (with --state-dir).
    #[arg(long, requires = "state_dir")]
    pub node: Option<String>,
    /// Direct form: the node name its certificate must carry (defaults to HOST).
    #[arg(long, requires = "node")]
    pub name: Option<String>,
    /// The operator name in the short-lived client certificate minted for this call.
    #[arg(long, default_value = "ctl")]
    pub operator: String,
}

#[derive(clap::Args, Debug)]
pub struct OperatorArgs {
    /// The node's inventory name (omit with --node).
    #[arg(required_unless_present = "node", conflicts_with = "node")]
    pub inventory_node: Option<String>,
    #[command(flatten)]
    pub target: NodeTarget,
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// NODE RUN: the node's inventory name and the run id; RUN alone with --node.
    #[arg(value_names = ["NODE", "RUN"], num_args = 1..=2, required = true)]
    pub positionals: Vec<String>,
    #[command(flatten)]
    pub target: NodeTarget,
}

/// Where an operator command connects: state directory, address and expected node name.
#[derive(Debug)]
pub struct ResolvedNode {
    pub state_dir: PathBuf,
    pub address: String,
    pub name: String,
    pub operator: String,
}

/// The node `inventory_node` names in `--config`, or the direct `--state-dir`/`--node` form.
pub fn resolve_node(
    target: &NodeTarget,
    inventory_node: Option<&str>,
) -> Result<ResolvedNode, ExitStatus> {
    if let (Some(state_dir), Some(address)) = (&target.state_dir, &target.node) {
        let host = address
            .rsplit_once(':')
            .map_or(address.as_str(), |(host, _)| host);
        return Ok(ResolvedNode {
            state_dir: state_dir.clone(),
            address: address.clone(),
            name: target
                .name
                .clone()
                .unwrap_or_else(|| host.trim_matches(['[', ']']).to_owned()),
            operator: target.operator.clone(),
        });
    }
    let Some(wanted) = inventory_node else {
        return Err(ExitStatus::usage(
            "name an inventory node, or give --state-dir and --node",
        ));
    };
    let config = load_config(&target.config)?;
    let node = inventory_lookup(&config, wanted, &target.config)?;
    Ok(ResolvedNode {
        state_dir: config.state_dir.clone(),
        address: node.endpoint(),
        name: node.name.to_string(),
        operator: target.operator.clone(),
    })
}

pub fn inventory_lookup<'a>(
    config: &'a crate::config::ControllerConfig,
    wanted: &str,
    path: &std::path::Path,
) -> Result<&'a crate::config::InventoryNode, ExitStatus> {
    config
        .nodes
        .values()
        .find(|node| node.name.to_string() == wanted)
        .ok_or_else(|| {
            let names: Vec<String> = config.nodes.keys().map(ToString::to_string).collect();
            ExitStatus::usage(format!(
                "node {wanted:?} is not in the inventory of {}; it names: {}",
                path.display(),
                if names.is_empty() {
                    "no node".to_owned()
                } else {
                    names.join(", ")
                }
            ))
        })
}

pub fn resolve_run_args(args: &RunArgs) -> Result<(ResolvedNode, String), ExitStatus> {
    match (args.positionals.as_slice(), &args.target.node) {
        ([run], Some(_)) => Ok((resolve_node(&args.target, None)?, run.clone())),
        ([node, run], None) => Ok((resolve_node(&args.target, Some(node))?, run.clone())),
        _ => Err(ExitStatus::usage(
            "give NODE RUN (an inventory name and a run id), or RUN with --state-dir and --node",
        )),
    }
}

/// Runs `call` on a connection to `node`, as an operator.
pub fn with_operator<T>(
    node: &ResolvedNode,
    now: OffsetDateTime,
    call: impl AsyncFnOnce(
        &mut certistack_proto::v1::connector_client::ConnectorClient<tonic::transport::Channel>,
    ) -> Result<T, crate::operator::OperatorError>,
) -> Result<T, ExitStatus> {
    let authority = load_authority(&node.state_dir)?;
    let runtime = runtime(Threads::One).map_err(ExitStatus::local)?;
    runtime
        .block_on(async {
            let mut connection = crate::operator::connect(
                &authority,
                &node.address,
                &node.name,
                &node.operator,
                now,
            )
            .await?;
            call(&mut connection).await
        })
        .map_err(ExitStatus::from)
}
