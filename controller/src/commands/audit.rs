//! `nodes audit`: every node of the inventory greeted concurrently, drift and warnings shown.

use super::{Failure, load_authority, local};
use time::OffsetDateTime;

pub fn nodes_audit(
    config: &std::path::Path,
    json: bool,
    now: OffsetDateTime,
) -> Result<(), Failure> {
    use crate::audit;
    use crate::config::{ConfigError, ControllerConfig};
    use certistack_connector::files::FileError;
    let config = ControllerConfig::load(config).map_err(|error| {
        let code = match &error {
            ConfigError::File(FileError::Insecure { .. } | FileError::WrongOwner { .. }) => 77,
            ConfigError::File(_) => 66,
            _ => 78,
        };
        Failure::Coded(code, format!("controller configuration refused: {error}"))
    })?;
    let authority = load_authority(&config.state_dir)?;
    let identity = authority.issue_operator("audit", now).map_err(local)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(local)?;
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
    match audit::exit_code(&rows) {
        audit::EXIT_MATCHES => Ok(()),
        audit::EXIT_UNREACHABLE => Err(Failure::Coded(
            audit::EXIT_UNREACHABLE,
            "a node of the inventory is unreachable".to_owned(),
        )),
        code => Err(Failure::Coded(
            code,
            "the fleet does not match: drift or warnings above".to_owned(),
        )),
    }
}
