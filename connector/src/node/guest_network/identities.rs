//! One identity per appliance: every confined appliance (a recovery's, or NodeChecks' boot)
//! runs as a user of `guest_network.appliance_users` that no other appliance on the node runs
//! as at the same time.
//!
//! Two appliances under one uid could reach each other: `ProtectProc=invisible` hides only
//! other users' processes, and the same user may read `/proc/<pid>/fd` of the other's QEMU,
//! and so open another run's overlay, or signal and trace its processes. Under distinct uids
//! the other appliance's processes are invisible, its overlay (handed to its own user, 0600)
//! and its libguestfs cache (`CacheDirectory=` of its own user, 0700) closed.
//!
//! A user is taken from the list in order, skipping the ones this daemon has lent and the
//! ones a loaded `certistack-guestnet-*` unit still runs as (a unit a previous daemon left,
//! or one that would not stop): systemd, not this daemon's memory, says who runs.

use super::confinement::ApplianceUser;
use crate::process::ToolCall;
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

/// The users this daemon has lent to an appliance that has not ended: the uids are the node's,
/// so the set is the process's.
static LENT: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Every appliance's unit: a recovery's (`certistack-guestnet-<run>-<vmid>`) and NodeChecks'
/// boot (`certistack-guestnet-check-<id>`).
pub const APPLIANCE_UNITS: &str = "certistack-guestnet-*";

pub use crate::config::MAX_APPLIANCE_USERS;

/// A user lent to one appliance; given back when dropped (after its unit has ended).
#[derive(Debug)]
pub struct IdentityLease {
    pub user: ApplianceUser,
}

impl Drop for IdentityLease {
    fn drop(&mut self) {
        if let Ok(mut lent) = LENT.lock() {
            lent.remove(&self.user.name);
        }
    }
}

/// Lends the first of `names` (looked up in `passwd`) that no appliance runs as: neither lent
/// by this daemon nor the user of a unit in `running` (what [`users_of_loaded_units`] found).
pub fn lease(
    names: &[String],
    passwd: &Path,
    running: &BTreeSet<String>,
) -> Result<IdentityLease, String> {
    let mut lent = LENT
        .lock()
        .map_err(|_| "the appliance identities' lock is poisoned; restart the connector")?;
    let Some(name) = names
        .iter()
        .find(|name| !lent.contains(*name) && !running.contains(*name))
    else {
        return Err(format!(
            "every appliance user of guest_network.appliance_users ({}) runs an appliance now: one appliance per user, so that no two can reach each other; retry when one has ended, or add users to the list (and to the package's sysusers.d file)",
            names.join(", ")
        ));
    };
    let user = ApplianceUser::lookup(passwd, name)?;
    lent.insert(name.clone());
    Ok(IdentityLease { user })
}

/// The users loaded units matching `pattern` (`certistack-guestnet-*`) run as, unless the unit
/// is inactive or failed (nothing of it runs).
pub async fn users_of_loaded_units(
    systemctl: &Path,
    pattern: &str,
    timeout: Duration,
) -> Result<BTreeSet<String>, String> {
    let output = crate::process::run(
        ToolCall::new(systemctl, timeout)
            .arg("show")
            .arg("--property=User,ActiveState")
            .arg("--")
            .arg(pattern),
    )
    .await
    .map_err(|e| format!("cannot ask systemd which appliances run ({e}); nothing was started"))?;
    if !output.success() {
        return Err(format!(
            "cannot ask systemd which appliances run (systemctl show {pattern}: {}); nothing was started",
            output.stderr_excerpt()
        ));
    }
    Ok(running_users(&output.stdout))
}

/// The users of `systemctl show --property=User,ActiveState` blocks (one per unit, separated
/// by an empty line) whose state is not `inactive` or `failed`.
pub fn running_users(show: &str) -> BTreeSet<String> {
    show.split("\n\n")
        .filter_map(|block| {
            let value = |key: &str| {
                block
                    .lines()
                    .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            };
            let state = value("ActiveState")?;
            let user = value("User")?;
            (!matches!(state, "inactive" | "failed") && !user.is_empty()).then(|| user.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_lent_once_until_given_back_and_one_a_unit_runs_as_is_skipped() {
        let dir = std::env::temp_dir().join(format!("identities-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        let passwd = dir.join("passwd");
        std::fs::write(
            &passwd,
            "lease-a:x:901:901::/nonexistent:/usr/sbin/nologin\nlease-b:x:902:902::/nonexistent:/usr/sbin/nologin\nlease-c:x:903:903::/nonexistent:/usr/sbin/nologin\n",
        )
        .unwrap();
        let names: Vec<String> = ["lease-a", "lease-b", "lease-c"].map(String::from).to_vec();
        let running =
            running_users("User=lease-b\nActiveState=active\n\nUser=lease-c\nActiveState=failed\n");
        assert_eq!(running, BTreeSet::from(["lease-b".to_owned()]));
        let first = lease(&names, &passwd, &running).unwrap();
        assert_eq!(first.user.uid, 901);
        let second = lease(&names, &passwd, &running).unwrap();
        assert_eq!(second.user.uid, 903, "lease-b runs in a unit");
        let none = lease(&names, &passwd, &running).unwrap_err();
        assert!(none.contains("retry when one has ended"), "{none}");
        drop(first);
        assert_eq!(lease(&names, &passwd, &running).unwrap().user.uid, 901);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
