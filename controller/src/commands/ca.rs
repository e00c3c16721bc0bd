//! `ca init` and `node sign`: the controller's own keys, and the node certificates they issue.

use crate::authority;
use crate::exit::ExitStatus;
use std::path::{Path, PathBuf};
use time::OffsetDateTime;

/// `ca init`: the CA, run-authority and report-signing keys in a new state directory.
pub fn ca_init(state_dir: &Path, now: OffsetDateTime) -> Result<(), ExitStatus> {
    let fingerprint = authority::init(state_dir, now).map_err(ExitStatus::local)?;
    println!(
        "created CA, run-authority and report-signing keys in {}",
        state_dir.display()
    );
    println!("CA fingerprint: {fingerprint}");
    Ok(())
}

/// `node sign`: a node certificate for the CSR, written to `out` with the command that installs
/// it, or printed.
pub fn node_sign(
    state_dir: &Path,
    node: &str,
    csr: &Path,
    out: Option<PathBuf>,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    let authority = authority::Authority::load(state_dir).map_err(ExitStatus::local)?;
    let csr = std::fs::read_to_string(csr)
        .map_err(|e| ExitStatus::local(format!("cannot read {}: {e}", csr.display())))?;
    let certificate = authority
        .sign_node_csr(&csr, node, now)
        .map_err(ExitStatus::local)?;
    let fingerprint = authority.ca_fingerprint().map_err(ExitStatus::local)?;
    match out {
        Some(path) => {
            std::fs::write(&path, certificate)
                .map_err(|e| ExitStatus::local(format!("cannot write {}: {e}", path.display())))?;
            println!(
                "issued {} for node {node}; install it on the node with\n  certistack-connector enroll --install --certificate {} --ca {} --ca-fingerprint {fingerprint} --run-authority {}",
                path.display(),
                path.display(),
                state_dir.join(authority::CA_CERT).display(),
                state_dir.join(authority::RUN_AUTHORITY_PUB).display()
            );
        }
        None => {
            print!("{certificate}");
            eprintln!("CA fingerprint: {fingerprint}");
        }
    }
    Ok(())
}
