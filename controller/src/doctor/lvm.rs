//! Whether LVM's `global_filter` keeps the host from scanning the run's loop devices.

use super::{Judged, Level, UPGRADE_CONNECTOR};
use certistack_proto::v1 as pb;

/// The pattern that keeps LVM off every loop device and its partitions.
pub const LOOP_REJECT: &str = "r|/dev/loop.*|";
/// PVE's own `global_filter` (pve-manager's postinst `set_lvm_conf` writes it into lvm.conf's
/// `devices` section): ZFS zvols, Ceph RBDs and network block devices.
pub const PVE_GLOBAL_FILTER: [&str; 3] = ["r|/dev/zd.*|", "r|/dev/rbd.*|", "r|/dev/nbd.*|"];
/// Device names a backup mapping shows to LVM (the loop device and its scanned partitions).
pub(super) const LOOP_DEVICES: [&str; 3] = ["/dev/loop0", "/dev/loop3p1", "/dev/loop12p2"];

/// What one `global_filter` pattern does to `device`: `Some(true)` rejects, `Some(false)`
/// accepts, `None` does not match. `Err` for a pattern this release cannot read.
pub(super) fn filter_decision(pattern: &str, device: &str) -> Result<Option<bool>, String> {
    let mut chars = pattern.chars();
    let reject = match chars.next() {
        Some('r') => true,
        Some('a') => false,
        _ => return Err(format!("\"{pattern}\" starts with neither a nor r")),
    };
    let delimiter = chars
        .next()
        .ok_or_else(|| format!("\"{pattern}\" has no expression"))?;
    let body = chars.as_str();
    let expression = body
        .strip_suffix(delimiter)
        .ok_or_else(|| format!("\"{pattern}\" does not end with its delimiter {delimiter}"))?;
    let regex = regex::Regex::new(expression).map_err(|error| {
        format!("\"{pattern}\" is not a regular expression this release reads: {error}")
    })?;
    Ok(regex.is_match(device).then_some(reject))
}

/// Whether `patterns` (first match wins; no match accepts) reject every loop device name.
pub(super) fn rejects_loop_devices(patterns: &[String]) -> Result<bool, String> {
    for device in LOOP_DEVICES {
        let mut decided = None;
        for pattern in patterns {
            if let Some(reject) = filter_decision(pattern, device)? {
                decided = Some(reject);
                break;
            }
        }
        if decided != Some(true) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The `global_filter` line that keeps `patterns` and rejects loop devices: the loop reject
/// goes before the first pattern that would accept a loop device (first match wins).
pub fn filter_fix(patterns: &[String]) -> String {
    let mut fixed: Vec<String> = if patterns.is_empty() {
        PVE_GLOBAL_FILTER.iter().map(|p| (*p).to_owned()).collect()
    } else {
        patterns.to_vec()
    };
    let at = fixed
        .iter()
        .position(|pattern| {
            LOOP_DEVICES
                .iter()
                .any(|device| filter_decision(pattern, device) == Ok(Some(false)))
        })
        .unwrap_or(fixed.len());
    fixed.insert(at, LOOP_REJECT.to_owned());
    format!(
        "global_filter = [ {} ]",
        fixed
            .iter()
            .map(|p| format!("\"{p}\""))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

pub(super) fn judge_lvm_filter(lvm: Option<&pb::LvmFilterFacts>) -> Judged {
    const NAME: &str = "lvm-filter";
    let Some(lvm) = lvm else {
        return (NAME, Level::Warn, UPGRADE_CONNECTOR.to_owned());
    };
    let why = "backup mappings are scanned for partitions, so a guest's LVM volumes on /dev/loopNpM become the host's";
    if !lvm.error.is_empty() {
        return (
            NAME,
            Level::Warn,
            format!(
                "{}; {why}: make sure the devices section of lvm.conf has {}",
                lvm.error,
                filter_fix(&[])
            ),
        );
    }
    if !lvm.found {
        return (
            NAME,
            Level::Warn,
            format!(
                "{} sets no devices/global_filter, so LVM scans loop devices: {why}; put this line in its devices section: {}",
                lvm.path,
                filter_fix(&[])
            ),
        );
    }
    match rejects_loop_devices(&lvm.patterns) {
        Ok(true) => (
            NAME,
            Level::Ok,
            format!("{} global_filter rejects loop devices", lvm.path),
        ),
        Ok(false) => (
            NAME,
            Level::Warn,
            format!(
                "{} global_filter does not reject loop devices: {why}; replace it in the devices section with: {}",
                lvm.path,
                filter_fix(&lvm.patterns)
            ),
        ),
        Err(unreadable) => (
            NAME,
            Level::Warn,
            format!(
                "{} global_filter cannot be judged ({unreadable}); make sure it rejects /dev/loop* like: {}",
                lvm.path,
                filter_fix(&lvm.patterns)
            ),
        ),
    }
}
