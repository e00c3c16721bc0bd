//! `hello`: connect to a node as an operator and print its Hello answer.

use super::{Failure, local};
use crate::{authority, client};
use certistack_connector::tls::ConnectError;
use std::path::PathBuf;
use time::OffsetDateTime;

#[derive(clap::Args, Debug)]
pub struct HelloArgs {
    #[arg(long)]
    pub state_dir: PathBuf,
    /// The connector's address, HOST:PORT.
    #[arg(long)]
    pub node: String,
    /// The node name its certificate must carry (defaults to HOST).
    #[arg(long)]
    pub name: Option<String>,
    /// The operator name in the short-lived client certificate minted for this call.
    #[arg(long, default_value = "ctl")]
    pub operator: String,
}

pub fn hello(args: HelloArgs, now: OffsetDateTime) -> Result<(), Failure> {
    let authority = authority::Authority::load(&args.state_dir).map_err(local)?;
    let identity = authority
        .issue_operator(&args.operator, now)
        .map_err(local)?;
    let host = args
        .node
        .rsplit_once(':')
        .map_or(args.node.as_str(), |(host, _)| host);
    let name = args
        .name
        .unwrap_or_else(|| host.trim_matches(['[', ']']).to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(local)?;
    let reply = runtime.block_on(async {
        let mut client = client::connect(&args.node, &name, authority.ca_pem(), &identity).await?;
        client::hello(&mut client, &name).await
    });
    let reply = reply.map_err(|error| match error {
        client::NodeError::SurfaceDigest { .. }
        | client::NodeError::NodeName { .. }
        | client::NodeError::Connect(
            ConnectError::WrongNode(..)
            | ConnectError::UnknownIssuer(_)
            | ConnectError::NotANode(..),
        ) => Failure::Mismatch(error.to_string()),
        client::NodeError::Tls(_) => Failure::Local(error.to_string()),
        _ => Failure::Unreachable(error.to_string()),
    })?;
    let skew_ms = reply.node_time_unix_ms - (now.unix_timestamp_nanos() / 1_000_000) as i64;
    println!("node: {}", reply.node_name);
    println!(
        "version: {} (source {}{})",
        reply.daemon_version,
        reply.source_commit,
        if reply.source_tree_dirty {
            ", with uncommitted changes"
        } else {
            ""
        }
    );
    println!("surface: {} (matches)", reply.surface_digest);
    println!("capabilities: {}", reply.capabilities.join(" "));
    println!(
        "node time: {} ms since the epoch ({skew_ms:+} ms from this host)",
        reply.node_time_unix_ms
    );
    println!("seen as: {}", reply.peer_identity);
    Ok(())
}
