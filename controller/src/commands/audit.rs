//! `nodes audit`: every node of the inventory greeted concurrently, drift and warnings shown.

use super::{Threads, load_authority, load_config, runtime};
use crate::exit::ExitStatus;
use time::OffsetDateTime;

pub fn nodes_audit(
    config: &std::path::Path,
    json: bool,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::audit;
    let config = load_config(config)?;
    let authority = load_authority(&config.state_dir)?;
    let identity = authority
        .issue_operator("audit", now)
        .map_err(ExitStatus::local)?;
    let runtime = runtime(Threads::Two).map_err(ExitStatus::local)?;
    let rows = runtime.block_on(audit::audit_fleet(
        config.nodes.values(),
        authority.ca_pem(),
        std::sync::Arc::new(identity),
        audit::DEFAULT_CONCURRENCY,
        audit::DEFAULT_NODE_TIMEOUT,
    ));
    if json {
        for row in &rows {
            println!("{}", row.to_json());
        }
    } else {
        print!("{}", audit::table(&rows));
    }
    ExitStatus::of_audit(&rows)
}
