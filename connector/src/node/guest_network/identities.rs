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

/// A user lent to one appliance; given back when dropped (after its unit has ended), unless
/// [`IdentityLease::keep`] kept it lent.
#[derive(Debug)]
pub struct IdentityLease {
    pub user: ApplianceUser,
    kept: bool,
}

impl IdentityLease {
    /// Keeps the user lent for the rest of this daemon's life: its appliance's unit may still
    /// run (its stop failed, or could not be asked). After a restart, systemd says who runs.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for IdentityLease {
    fn drop(&mut self) {
        if !self.kept {
            // A poisoned lock still holds the set: a panic elsewhere must not lend a user twice
            // or never again.
            LENT.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&self.user.name);
        }
    }
}

/// A lease tied to the transient unit its appliance runs in: the user stays lent until the
/// unit is known to have ended. [`UnitLease::stop`] stops the unit, [`UnitLease::give_back`]
/// then frees the user (or keeps it lent when the stop failed); dropped on any other path (an
/// early return, a panic), it stops the unit on the runtime and frees the user only if that
/// worked.
#[derive(Debug)]
pub struct UnitLease {
    lease: Option<IdentityLease>,
    systemctl: std::path::PathBuf,
    unit: String,
    description: String,
    timeout: Duration,
    stopped: bool,
}

impl UnitLease {
    pub fn new(
        lease: IdentityLease,
        systemctl: &Path,
        unit: &str,
        description: &str,
        timeout: Duration,
    ) -> Self {
        Self {
            lease: Some(lease),
            systemctl: systemctl.to_owned(),
            unit: unit.to_owned(),
            description: description.to_owned(),
            timeout,
            stopped: false,
        }
    }

    /// Stops the unit (its whole cgroup, the appliance's QEMU included); one that ended by
    /// itself was collected already.
    pub async fn stop(&mut self) -> Result<(), String> {
        crate::process::release_transient_unit(
            &self.systemctl,
            &self.unit,
            &self.description,
            self.timeout,
        )
        .await?;
        self.stopped = true;
        Ok(())
    }

    /// Frees the user if the unit was stopped; keeps it lent otherwise.
    pub fn give_back(mut self) {
        if let Some(lease) = self.lease.take()
            && !self.stopped
        {
            lease.keep();
        }
    }
}

impl Drop for UnitLease {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        if self.stopped {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            lease.keep();
            return;
        };
        let (systemctl, unit, description, timeout) = (
            self.systemctl.clone(),
            self.unit.clone(),
            self.description.clone(),
            self.timeout,
        );
        runtime.spawn(async move {
            match crate::process::release_transient_unit(&systemctl, &unit, &description, timeout)
                .await
            {
                Ok(_) => drop(lease),
                Err(reason) => {
                    tracing::warn!(%unit, %reason, "an appliance's unit could not be stopped: its user stays lent until the connector restarts");
                    lease.keep();
                }
            }
        });
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
        .unwrap_or_else(std::sync::PoisonError::into_inner);
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
    // Two names of one uid would be one identity: the appliances could reach each other.
    for other in names.iter().filter(|other| *other != name) {
        if let Ok(same) = ApplianceUser::lookup(passwd, other)
            && same.uid == user.uid
        {
            return Err(format!(
                "appliance users {name} and {other} of guest_network.appliance_users share uid {}: each appliance needs a uid of its own; give each user its own uid (the package's sysusers.d file does)",
                user.uid
            ));
        }
    }
    lent.insert(name.clone());
    Ok(IdentityLease { user, kept: false })
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

    fn passwd_of(lines: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("identities-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        let passwd = dir.join("passwd");
        std::fs::write(&passwd, lines).unwrap();
        (dir, passwd)
    }

    #[test]
    fn two_names_of_one_uid_are_refused() {
        let (dir, passwd) = passwd_of(
            "same-a:x:921:921::/nonexistent:/usr/sbin/nologin\nsame-b:x:921:921::/nonexistent:/usr/sbin/nologin\n",
        );
        let names: Vec<String> = ["same-a", "same-b"].map(String::from).to_vec();
        let refused = lease(&names, &passwd, &BTreeSet::new()).unwrap_err();
        assert!(refused.contains("share uid 921"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `systemctl` for one loaded unit described as "desc", whose stop fails unless `ok`.
    fn systemctl(dir: &Path, ok: bool) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(if ok {
            "systemctl-ok"
        } else {
            "systemctl-stuck"
        });
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\ncase \"$1\" in\n  show) printf 'LoadState=loaded\\nDescription=desc\\n' ;;\n  stop) exit {} ;;\nesac\nexit 0\n",
                if ok { 0 } else { 1 }
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn a_unit_lease_frees_its_user_only_once_its_unit_has_ended() {
        let (dir, passwd) = passwd_of(
            "unit-a:x:931:931::/nonexistent:/usr/sbin/nologin\nunit-b:x:932:932::/nonexistent:/usr/sbin/nologin\n",
        );
        let timeout = Duration::from_secs(10);
        let none = BTreeSet::new();
        // A unit that would not stop keeps its user lent.
        let stuck = vec!["unit-a".to_owned()];
        let mut held = UnitLease::new(
            lease(&stuck, &passwd, &none).unwrap(),
            &systemctl(&dir, false),
            "certistack-guestnet-t-1",
            "desc",
            timeout,
        );
        assert!(held.stop().await.is_err());
        held.give_back();
        assert!(lease(&stuck, &passwd, &none).is_err(), "unit-a stays lent");
        // Dropped on an early return: the unit is stopped on the runtime, then the user freed.
        let early = vec!["unit-b".to_owned()];
        let dropped = UnitLease::new(
            lease(&early, &passwd, &none).unwrap(),
            &systemctl(&dir, true),
            "certistack-guestnet-t-2",
            "desc",
            timeout,
        );
        assert!(lease(&early, &passwd, &none).is_err(), "unit-b is lent");
        drop(dropped);
        let mut again = None;
        for _ in 0..100 {
            if let Ok(lent) = lease(&early, &passwd, &none) {
                again = Some(lent);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            again.is_some(),
            "unit-b was not given back after its unit stopped"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
