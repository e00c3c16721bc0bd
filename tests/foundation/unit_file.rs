//! The packaged units (the connector's, the controller's service and timer) against their
//! reviewed relaxations, and systemd's own checks of them.

use super::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const UNIT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../packaging/certistack-connector.service"
);
const CONTROLLER_UNIT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../packaging/controller/certistack-controller.service"
);
const CONTROLLER_TIMER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../packaging/controller/certistack-controller.timer"
);
const RELAXATIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../policy/unit-hardening.toml");

/// The strictest value of every hardening directive `systemd-analyze security` weighs for
/// a network daemon; the unit sets each of these or the policy file says why not.
pub const STRICT_BASELINE: &[(&str, &str)] = &[
    ("NoNewPrivileges", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("PrivateDevices", "yes"),
    ("PrivateNetwork", "yes"),
    ("PrivateUsers", "yes"),
    ("PrivateMounts", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelModules", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectClock", "yes"),
    ("ProtectHostname", "yes"),
    ("ProtectProc", "invisible"),
    ("ProcSubset", "pid"),
    ("RestrictNamespaces", "yes"),
    ("RestrictRealtime", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("LockPersonality", "yes"),
    ("MemoryDenyWriteExecute", "yes"),
    ("SystemCallArchitectures", "native"),
    ("SystemCallFilter", "@system-service"),
    ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ("CapabilityBoundingSet", ""),
    ("UMask", "0077"),
    ("KeyringMode", "private"),
    ("RemoveIPC", "yes"),
    ("DevicePolicy", "closed"),
    ("IPAddressDeny", "any"),
    ("NotifyAccess", "main"),
];

/// Values stricter still than the baseline's: a oneshot that sends no notification at all.
const STRICTER: &[(&str, &str)] = &[("NotifyAccess", "none")];

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Relaxations {
    relaxation: Vec<Relaxation>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Relaxation {
    service: String,
    directive: String,
    unit: String,
    needs: String,
}

/// The `[Service]` settings of a unit file (the last assignment wins, as systemd reads
/// single-valued settings).
fn service_settings(text: &str) -> BTreeMap<String, String> {
    let mut section = "";
    let mut settings = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            section = line;
            continue;
        }
        if section == "[Service]"
            && let Some((key, value)) = line.split_once('=')
        {
            settings.insert(key.trim().to_owned(), value.trim().to_owned());
        }
    }
    settings
}

/// Which baseline directives `unit` (the service `service`) sets weaker than strict, and
/// whether `relaxations` accounts for exactly those: the problems found, empty when they agree.
fn disagreements(service: &str, unit: &str, relaxations: &str) -> Vec<String> {
    let settings = service_settings(unit);
    let relaxations: Relaxations = toml::from_str(relaxations).unwrap();
    let mut problems = Vec::new();
    let mut listed = BTreeMap::new();
    for entry in &relaxations.relaxation {
        if ![
            "certistack-connector.service",
            "certistack-controller.service",
        ]
        .contains(&entry.service.as_str())
        {
            problems.push(format!(
                "{}: `service` {:?} is not a packaged service",
                entry.directive, entry.service
            ));
        }
        if entry.service != service {
            continue;
        }
        if entry.needs.trim().len() < 20 {
            problems.push(format!(
                "{}: `needs` does not say which operation",
                entry.directive
            ));
        }
        if listed.insert(entry.directive.clone(), entry).is_some() {
            problems.push(format!("{}: listed twice", entry.directive));
        }
        if !STRICT_BASELINE.iter().any(|(d, _)| *d == entry.directive) {
            problems.push(format!(
                "{}: not a hardening directive of the baseline",
                entry.directive
            ));
        }
    }
    for (directive, strict) in STRICT_BASELINE {
        let actual = settings.get(*directive).map(String::as_str);
        let is_strict = actual == Some(*strict)
            || STRICTER
                .iter()
                .any(|(d, value)| d == directive && actual == Some(*value));
        match (is_strict, listed.get(*directive)) {
            (true, Some(_)) => problems.push(format!(
                "{directive}: the unit sets the strict value {strict:?}; the relaxation entry is stale"
            )),
            (false, None) => problems.push(format!(
                "{directive}: the unit sets {:?} instead of {strict:?} and policy/unit-hardening.toml does not say why",
                actual.unwrap_or("nothing")
            )),
            (false, Some(entry)) if entry.unit != actual.unwrap_or("") => problems.push(format!(
                "{directive}: the unit sets {:?}, the relaxation entry says {:?}",
                actual.unwrap_or(""),
                entry.unit
            )),
            _ => {}
        }
    }
    problems
}

#[test]
fn the_unit_and_its_relaxations_agree() {
    let unit = std::fs::read_to_string(UNIT).unwrap();
    let relaxations = std::fs::read_to_string(RELAXATIONS).unwrap();
    let problems = disagreements("certistack-connector.service", &unit, &relaxations);
    assert!(problems.is_empty(), "{problems:#?}");
    let settings = service_settings(&unit);
    for (key, value) in [
        ("Type", "notify"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("WatchdogSec", "30s"),
    ] {
        assert_eq!(settings.get(key).map(String::as_str), Some(value), "{key}");
    }
    assert!(settings["ExecCondition"].contains("/etc/certistack/node.crt"));
    assert!(settings["ExecCondition"].contains("enroll --csr"));

    // Loosening a directive without an entry, an entry for a strict directive, an entry
    // that is not a hardening directive, and an entry that misquotes the unit all fail.
    let loosened = unit.replace("MemoryDenyWriteExecute=yes\n", "");
    assert!(
        disagreements("certistack-connector.service", &loosened, &relaxations)
            .iter()
            .any(|p| p.starts_with("MemoryDenyWriteExecute: the unit sets \"nothing\"")),
    );
    let stale = format!(
        "{relaxations}\n[[relaxation]]\nservice = \"certistack-connector.service\"\ndirective = \"NoNewPrivileges\"\nunit = \"\"\nneeds = \"nothing needs this any more, but the entry stayed\"\n"
    );
    assert!(
        disagreements("certistack-connector.service", &unit, &stale)
            .iter()
            .any(|p| p.starts_with("NoNewPrivileges: the unit sets the strict value"))
    );
    let unknown = format!(
        "{relaxations}\n[[relaxation]]\nservice = \"certistack-connector.service\"\ndirective = \"Nice\"\nunit = \"\"\nneeds = \"an entry with no hardening directive behind it\"\n"
    );
    assert!(
        disagreements("certistack-connector.service", &unit, &unknown)
            .iter()
            .any(|p| p.starts_with("Nice: not a hardening directive"))
    );
    let widened = unit.replace("AF_INET6 AF_NETLINK", "AF_INET6 AF_NETLINK AF_PACKET");
    assert!(
        disagreements("certistack-connector.service", &widened, &relaxations)
            .iter()
            .any(|p| p.starts_with("RestrictAddressFamilies: the unit sets"))
    );
}

/// `systemd-analyze verify` finds nothing, and `security --offline` scores the unit; the
/// score is printed (docs/systemd.md quotes it) and may not get worse than 4.0.
#[test]
fn systemd_analyze_verifies_and_scores_the_unit() {
    if !privileged(
        "systemd_analyze_verifies_and_scores_the_unit",
        &["systemd-analyze"],
    ) {
        return;
    }
    let dir = TempDir::new("unit-verify");
    // The unit as installed, with ExecStart naming the binary this build made.
    let unit = std::fs::read_to_string(UNIT).unwrap().replace(
        "/usr/sbin/certistack-connector",
        binary("certistack-connector").to_str().unwrap(),
    );
    let path = dir.0.join("certistack-connector.service");
    std::fs::write(&path, unit).unwrap();
    let score = verified_exposure(&[&path], Path::new(UNIT), "certistack-connector.service");
    assert!(score <= 4.0, "exposure {score}");
}

/// `systemd-analyze verify` of `files` finds nothing; the exposure `security --offline` gives
/// `unit` (named `name`), printed and returned.
fn verified_exposure(files: &[&Path], unit: &Path, name: &str) -> f64 {
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .args(files)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(verify.status.success() && said.trim().is_empty(), "{said}");
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(unit)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&security.stdout);
    let marker = format!("Overall exposure level for {name}: ");
    let score: f64 = report
        .lines()
        .find_map(|l| l.split_once(marker.as_str()))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no score in {report}"));
    eprintln!("systemd-analyze security --offline=true {name}: exposure {score}\n{report}");
    score
}

/// The controller's service: a oneshot of `certistack-ctl run` of the configured plan, as its
/// own user, with only the network relaxed (both entries in the policy file); its timer runs it
/// nightly, spread and caught up after downtime.
#[test]
fn the_controller_unit_and_timer_run_the_plan_nightly_as_its_user_with_its_relaxations() {
    let unit = std::fs::read_to_string(CONTROLLER_UNIT).unwrap();
    let relaxations = std::fs::read_to_string(RELAXATIONS).unwrap();
    let service = "certistack-controller.service";
    let problems = disagreements(service, &unit, &relaxations);
    assert!(problems.is_empty(), "{problems:#?}");
    let settings = service_settings(&unit);
    for (key, value) in [
        ("Type", "oneshot"),
        ("User", "certistack-ctl"),
        ("Group", "certistack-ctl"),
        (
            "ExecStart",
            "/usr/bin/certistack-ctl run --config /etc/certistack/controller.toml /var/lib/certistack-ctl/plan.yaml",
        ),
        ("StateDirectory", "certistack-ctl"),
        ("StateDirectoryMode", "0700"),
        ("CapabilityBoundingSet", ""),
        ("PrivateUsers", "yes"),
    ] {
        assert_eq!(settings.get(key).map(String::as_str), Some(value), "{key}");
    }
    // The controller's entries are the controller's: loosening it is caught, and the
    // connector's reasons do not cover it.
    let loosened = unit.replace("PrivateDevices=yes\n", "");
    assert!(
        disagreements(service, &loosened, &relaxations)
            .iter()
            .any(|p| p.starts_with("PrivateDevices: the unit sets \"nothing\"")),
    );
    let widened = unit.replace(
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6\n",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK\n",
    );
    assert!(
        disagreements(service, &widened, &relaxations)
            .iter()
            .any(|p| p.starts_with("RestrictAddressFamilies: the unit sets")),
        "the connector's AF_NETLINK entry must not cover the controller"
    );

    let timer = std::fs::read_to_string(CONTROLLER_TIMER).unwrap();
    let lines: Vec<&str> = timer.lines().map(str::trim).collect();
    for line in [
        "OnCalendar=*-*-* 04:00:00",
        "RandomizedDelaySec=30min",
        "Persistent=true",
        "Unit=certistack-controller.service",
        "WantedBy=timers.target",
    ] {
        assert!(lines.contains(&line), "the timer lacks {line}");
    }
}

/// `systemd-analyze verify` finds nothing in the controller's service and timer, and `security
/// --offline` scores the service at most 2.5; the score is printed.
#[test]
fn systemd_analyze_verifies_the_controller_units_and_scores_the_service() {
    if !privileged(
        "systemd_analyze_verifies_the_controller_units_and_scores_the_service",
        &["systemd-analyze"],
    ) {
        return;
    }
    let dir = TempDir::new("controller-unit-verify");
    let unit = std::fs::read_to_string(CONTROLLER_UNIT).unwrap().replace(
        "/usr/bin/certistack-ctl",
        binary("certistack-ctl").to_str().unwrap(),
    );
    let service = dir.0.join("certistack-controller.service");
    std::fs::write(&service, unit).unwrap();
    let timer = dir.0.join("certistack-controller.timer");
    std::fs::copy(CONTROLLER_TIMER, &timer).unwrap();
    let score = verified_exposure(
        &[&service, &timer],
        Path::new(CONTROLLER_UNIT),
        "certistack-controller.service",
    );
    assert!(score <= 2.5, "exposure {score}");
}
