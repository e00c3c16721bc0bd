//! What the controller's PVE API token needs for a plan, read from the plan as written, before
//! anything is asked: each privilege on each path the plan makes the controller read, and why.
//! The nodes create, start and destroy the sandboxes themselves (through `qm` as root), so the
//! token only ever audits: VMs and pools for `select`, nodes for `node: auto`.

use super::cluster::ClusterError;
pub use super::cluster::Privileges;
use super::file::{NodeFile, PlanFile};
use crate::config::ControllerConfig;
use std::collections::{BTreeMap, BTreeSet};

/// One privilege the plan needs on one path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Need {
    /// The ACL path, e.g. `/pool/prod`, `/vms/201`, `/nodes/pve1`.
    pub path: String,
    /// The privilege, e.g. `VM.Audit`.
    pub privilege: &'static str,
    /// Whether it must hold below the path too (granted with propagate): `/vms` for every VM,
    /// `/sdn/zones` for every zone and VNet.
    pub below: bool,
    /// What lacks it: refused, or worked around with a warning.
    pub level: NeedLevel,
    /// The plan key that needs it and what the privilege is used for.
    pub why: String,
}

/// Whether a plan can go on without the privilege.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum NeedLevel {
    /// Without it the plan cannot be resolved as written: `run` refuses before any node call.
    Required,
    /// Without it the plan still runs, on less than it says (a tag selection misses the VMs
    /// the token may not audit): a warning.
    WorkedAround,
}

/// The privileges `file` needs, in plan order, each `(path, privilege)` once (the first key
/// that needs it says why).
pub(super) fn needs(file: &PlanFile, config: &ControllerConfig) -> Vec<Need> {
    let mut out: Vec<Need> = Vec::new();
    let mut add = |path: String, privilege: &'static str, level: NeedLevel, why: String| match out
        .iter_mut()
        .find(|n| n.path == path && n.privilege == privilege)
    {
        Some(known) => known.level = known.level.min(level),
        None => out.push(Need {
            below: path == "/vms" || path == "/sdn/zones",
            path,
            privilege,
            level,
            why,
        }),
    };
    for (index, v) in file.validations.iter().enumerate() {
        // Read before the plan's names are checked: shown escaped.
        let at = format!(
            "validations[{index}] ({})",
            certistack_core::untrusted::printable(
                v.name.as_bytes(),
                certistack_core::untrusted::MAX_VALUE_CHARS
            )
        );
        if let Some(select) = &v.select {
            for vmid in select.vmids.iter().flatten() {
                add(
                    format!("/vms/{}", vmid.0),
                    "VM.Audit",
                    NeedLevel::Required,
                    format!(
                        "{at}.select.vmids: GET /cluster/resources lists VM {} only to a token that may audit it",
                        vmid.0
                    ),
                );
            }
            // A pool name resolution would refuse is not a path to ask about (it refuses it).
            if let Some(pool) = select
                .pool
                .as_ref()
                .filter(|pool| super::cluster::is_pool_name(pool))
            {
                add(
                    format!("/pool/{pool}"),
                    "Pool.Audit",
                    NeedLevel::Required,
                    format!("{at}.select.pool: GET /pools/{pool} reads the pool's members"),
                );
                add(
                    format!("/pool/{pool}"),
                    "VM.Audit",
                    NeedLevel::Required,
                    format!(
                        "{at}.select.pool: GET /cluster/resources lists the pool's VMs only to a token that may audit them (granted on the pool, it holds for every member)"
                    ),
                );
            }
            if select.tags.is_some() {
                add(
                    "/vms".into(),
                    "VM.Audit",
                    NeedLevel::WorkedAround,
                    format!(
                        "{at}.select.tags: a tagged VM the token may not audit is not listed, so not validated; with VM.Audit on /vms every VM is seen"
                    ),
                );
            }
        }
        add(
            "/sdn/zones".into(),
            "SDN.Audit",
            NeedLevel::Required,
            format!(
                "{at}.network.vnet: the VNet, its zone and its subnets are read from the SDN configuration (GET /cluster/sdn/zones, /cluster/sdn/vnets/<vnet> and its subnets) and checked before any node is asked"
            ),
        );
        // Only the inventory's names (checked when the configuration was read) become paths:
        // any other is refused by resolution, saying so.
        let candidates: Vec<&str> = match &v.node {
            NodeFile::Named(_) => Vec::new(),
            NodeFile::Among(names) => names
                .iter()
                .map(String::as_str)
                .filter(|name| config.nodes.keys().any(|known| known.as_str() == *name))
                .collect(),
            NodeFile::Auto => config.nodes.keys().map(|name| name.as_str()).collect(),
        };
        for node in candidates {
            add(
                format!("/nodes/{node}"),
                "Sys.Audit",
                NeedLevel::Required,
                format!(
                    "{at}.node: placement reads what node {node} has free (GET /cluster/resources?type=node shows it only with this privilege)"
                ),
            );
        }
    }
    out
}

/// The paths one plan's preflight reads at most: each is an API call.
pub const MAX_PATHS_CHECKED: usize = 1024;

/// What the preflight found: the needs the token lacks, each with its grant.
#[derive(Debug, Default)]
pub struct Lacking {
    /// Needs without which the plan cannot run as written.
    pub required: Vec<Need>,
    /// Needs the plan works around (on less than it says).
    pub worked_around: Vec<Need>,
    /// `pveum` lines that grant exactly what is missing (both kinds).
    pub grant: Vec<String>,
}

/// Reads the token's privileges on every path of `needs` and returns what it lacks.
pub fn lacking(needs: &[Need], privileges: &dyn Privileges) -> Result<Lacking, ClusterError> {
    let paths: BTreeSet<&str> = needs.iter().map(|n| n.path.as_str()).collect();
    if paths.len() > MAX_PATHS_CHECKED {
        return Err(ClusterError::Refused(format!(
            "the plan makes the controller read {} ACL paths, more than {MAX_PATHS_CHECKED}: select by pool or tags rather than by many VMIDs, or split the plan",
            paths.len()
        )));
    }
    let mut held: BTreeMap<&str, BTreeMap<String, bool>> = BTreeMap::new();
    for path in paths {
        match privileges.privileges(path)? {
            Some(privileges) => {
                held.insert(path, privileges);
            }
            None => return Ok(Lacking::default()),
        }
    }
    let mut out = Lacking::default();
    for need in needs {
        if held
            .get(need.path.as_str())
            .and_then(|p| p.get(need.privilege))
            .is_some_and(|propagates| *propagates || !need.below)
        {
            continue;
        }
        match need.level {
            NeedLevel::Required => out.required.push(need.clone()),
            NeedLevel::WorkedAround => out.worked_around.push(need.clone()),
        }
    }
    let all: Vec<&Need> = out.required.iter().chain(&out.worked_around).collect();
    out.grant = grant_lines(&all, privileges.token_id().as_deref());
    Ok(out)
}

/// The role that holds exactly `privilege`, for the grant lines: one role per privilege, so
/// each path gets what it needs and no more. (Role ids starting with `PVE` are upstream's.)
pub fn role_of(privilege: &str) -> String {
    format!("CertiStack{}", privilege.replace('.', ""))
}

/// `pveum` lines that grant `needs` to the token and its user (with privilege separation, the
/// default, a token has only what both are granted): the roles first, then one ACL line per
/// path.
pub fn grant_lines(needs: &[&Need], token_id: Option<&str>) -> Vec<String> {
    if needs.is_empty() {
        return Vec::new();
    }
    let token = token_id.unwrap_or("USER@REALM!TOKEN");
    let user = token.split_once('!').map_or(token, |(user, _)| user);
    let (token, user) = (shell_word(token), shell_word(user));
    let privileges: BTreeSet<&str> = needs.iter().map(|n| n.privilege).collect();
    let mut lines: Vec<String> = privileges
        .iter()
        .map(|privilege| format!("pveum role add {} --privs {privilege}", role_of(privilege)))
        .collect();
    let mut by_path: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for need in needs {
        by_path
            .entry(need.path.as_str())
            .or_default()
            .insert(need.privilege);
    }
    for (path, privileges) in by_path {
        let roles: Vec<String> = privileges.iter().map(|p| role_of(p)).collect();
        lines.push(format!(
            "pveum acl modify {} --roles {} --users {user} --tokens {token}",
            shell_word(path),
            shell_word(&roles.join(","))
        ));
    }
    lines
}

/// `word` as one shell word: as it is when it holds only characters no shell treats
/// specially, else in single quotes (a quote inside written `'\''`). The lines are pasted into
/// a root shell: nothing in them may be more than the word it stands for.
pub fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "@%+=:,./_-".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests;
