//! `hello`: connect to a node as an operator and print its Hello answer.

use super::{Threads, runtime};
use crate::exit::ExitStatus;
use crate::{authority, client};
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

pub fn hello(args: HelloArgs, now: OffsetDateTime) -> Result<(), ExitStatus> {
    let authority = authority::Authority::load(&args.state_dir).map_err(ExitStatus::local)?;
    let identity = authority
        .issue_operator(&args.operator, now)
        .map_err(ExitStatus::local)?;
    let host = args
        .node
        .rsplit_once(':')
        .map_or(args.node.as_str(), |(host, _)| host);
    let name = args
        .name
        .unwrap_or_else(|| host.trim_matches(['[', ']']).to_owned());
    let runtime = runtime(Threads::One).map_err(ExitStatus::local)?;
    let reply = runtime.block_on(async {
        let mut client = client::connect(&args.node, &name, authority.ca_pem(), &identity).await?;
        client::hello(&mut client, &name).await
    });
    let reply = reply?;
    let skew_ms = reply.node_time_unix_ms - (now.unix_timestamp_nanos() / 1_000_000) as i64;
    println!("{}", client::describe_hello(&reply, skew_ms));
    Ok(())
}
