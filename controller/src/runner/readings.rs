//! How the node's answers are read as evidence for the report: a guest network recovery, the
//! guest's run state, a probe's label and expectation, and the sandbox's isolation checked
//! against the grant.

use crate::report;
use certistack_proto::v1 as pb;

/// The evidence of a guest network recovery, for its step in the report: what inspection
/// found, the MAC and address of the profile, each file written, changed or set aside with its
/// SHA-256, the firewalld zone, and the notes.
pub(super) fn guest_network_detail(reply: &pb::RecoverGuestNetworkReply) -> String {
    let Some(e) = &reply.evidence else {
        return String::new();
    };
    let files: Vec<String> = e
        .files
        .iter()
        .map(|f| {
            let renamed = if f.renamed_to.is_empty() {
                String::new()
            } else {
                format!(" -> {}", f.renamed_to)
            };
            format!("{} {}{renamed} sha256 {}", f.action, f.path, f.sha256)
        })
        .collect();
    let mut detail = format!(
        "{} {} {} ({}), stack {}; profile {} on {}; files: {}",
        e.os_type,
        e.distro,
        e.version,
        e.product_name,
        e.network_stack,
        e.guest_address,
        e.mac_address,
        files.join(", ")
    );
    if !e.firewalld_zone.is_empty() {
        detail.push_str(&format!(
            "; firewalld zone {} allows the probe source",
            e.firewalld_zone
        ));
    }
    for note in &e.notes {
        detail.push_str("; ");
        detail.push_str(note);
    }
    detail
}

/// What QMP's run state says about a restored guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GuestState {
    Running,
    /// The guest stopped on its own: `io-error`, `internal-error`, `guest-panicked`, `shutdown`,
    /// `watchdog`, `suspended`.
    Stopped,
    /// The node holds it (`paused`, `prelaunch`, migration states) or the state is unknown.
    NotJudged,
}

pub(super) fn guest_state(status: &str) -> GuestState {
    use certistack_proto::v1::VmState;
    match certistack_core::qemu::vm_state(status) {
        VmState::Running => GuestState::Running,
        VmState::GuestError | VmState::GuestShutdown | VmState::Suspended => GuestState::Stopped,
        VmState::Unspecified
        | VmState::Absent
        | VmState::Stopped
        | VmState::Paused
        | VmState::Prelaunch
        | VmState::Unrecognized => GuestState::NotJudged,
    }
}

/// `tcp://192.0.2.10:22`, `https://[2001:db8::10]:443`.
pub(super) fn probe_label(kind: pb::ProbeKind, address: &str, port: u32) -> String {
    let scheme = kind
        .as_str_name()
        .trim_start_matches("PROBE_KIND_")
        .to_ascii_lowercase();
    if address.contains(':') {
        format!("{scheme}://[{address}]:{port}")
    } else {
        format!("{scheme}://{address}:{port}")
    }
}

/// What a probe expected, as the plan said it: its non-empty fields.
pub(super) fn expectation_text(expect: &pb::ProbeExpectation) -> String {
    let mut parts = Vec::new();
    let mut text = |key: &str, value: &str| {
        if !value.is_empty() {
            parts.push(format!("{key} {value:?}"));
        }
    };
    text("banner_prefix", &expect.banner_prefix);
    text("http_path", &expect.http_path);
    text("body_contains", &expect.body_contains);
    text("body_sha256", &expect.body_sha256);
    text("dns_name", &expect.dns_name);
    text("ldap_naming_context", &expect.ldap_naming_context);
    if expect.http_status != 0 {
        parts.push(format!("http_status {}", expect.http_status));
    }
    if let Ok(kind) = pb::DnsRecordType::try_from(expect.dns_type)
        && kind != pb::DnsRecordType::Unspecified
    {
        parts.push(format!(
            "dns_type {}",
            kind.as_str_name().trim_start_matches("DNS_RECORD_TYPE_")
        ));
    }
    if !expect.dns_answers.is_empty() {
        parts.push(format!("dns_answers {:?}", expect.dns_answers));
    }
    if parts.is_empty() {
        "connects".to_owned()
    } else {
        parts.join(", ")
    }
}

/// Checks the node's isolation evidence against the grant: only taps of the run's sandbox VMs
/// on the bridge (by the VM the node says each port belongs to, `owners`, one per port of
/// `isolation.bridge_ports`), only the probe address (and the bridge's IPv6 link-local
/// address) on it, every forwarding sysctl reported and 0.
pub(super) fn check_isolation(
    isolation: &report::Isolation,
    owners: &[pb::BridgePort],
    grant: &certistack_core::grant::Grant,
) -> Result<(), String> {
    let named: Vec<&str> = owners.iter().map(|owner| owner.name.as_str()).collect();
    if named != isolation.bridge_ports {
        return Err(format!(
            "the node named bridge ports {:?} but gave owners for {named:?}",
            isolation.bridge_ports
        ));
    }
    for port in owners {
        if !grant.sandbox_vms.keys().any(|v| v.get() == port.vmid) {
            return Err(format!(
                "bridge port {:?} is not a tap of this run's sandbox VMs",
                port.name
            ));
        }
    }
    for address in &isolation.bridge_addresses {
        let ip = address
            .split_once('/')
            .map_or(address.as_str(), |(ip, _)| ip)
            .parse::<std::net::IpAddr>()
            .map_err(|_| format!("bridge address {address:?} is not an address"))?;
        let link_local =
            matches!(ip, std::net::IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
        if ip != grant.probe_source.address.0 && !link_local {
            return Err(format!(
                "bridge address {address} is not the probe address {}",
                grant.probe_source
            ));
        }
    }
    if isolation.forwarding.is_empty() {
        return Err("the node reported no forwarding sysctl".into());
    }
    // A value may carry the node's note after it, e.g. `0 (was 1; set to 0 for this run ...)`.
    for (name, value) in &isolation.forwarding {
        if value.split_whitespace().next() != Some("0") {
            return Err(format!("{name} is {value}, not 0"));
        }
    }
    Ok(())
}

pub(super) fn isolation(reply: &pb::PrepareSandboxReply) -> report::Isolation {
    let forwarding = reply
        .forwarding_sysctl
        .lines()
        .filter_map(|line| {
            let (key, value) = line.split_once('=')?;
            Some((key.trim().to_owned(), value.trim().to_owned()))
        })
        .collect();
    report::Isolation {
        bridge_ports: reply.bridge_ports.clone(),
        bridge_addresses: reply.bridge_addresses.clone(),
        forwarding,
        ruleset: reply.ruleset_text.clone(),
        ruleset_digest: report::sha256_text(reply.ruleset_text.as_bytes()),
        nat_sources: reply.nat_sources.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_probe_is_labelled_by_its_scheme_with_ipv6_in_brackets() {
        assert_eq!(
            probe_label(pb::ProbeKind::Https, "2001:db8::10", 443),
            "https://[2001:db8::10]:443"
        );
        assert_eq!(
            probe_label(pb::ProbeKind::Tcp, "10.99.0.10", 22),
            "tcp://10.99.0.10:22"
        );
        let expect = pb::ProbeExpectation {
            http_path: "/health".into(),
            http_status: 200,
            ..Default::default()
        };
        assert_eq!(
            expectation_text(&expect),
            "http_path \"/health\", http_status 200"
        );
        assert_eq!(
            expectation_text(&pb::ProbeExpectation::default()),
            "connects"
        );
    }

    fn grant() -> certistack_core::grant::Grant {
        let wire = pb::RunGrant {
            version: 1,
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            node: "pve1".into(),
            not_before_unix: 1_700_000_000,
            deadline_unix: 1_700_003_600,
            repository: Some(pb::PbsRepository {
                server: "pbs.example.net".into(),
                port: 8007,
                datastore: "store1".into(),
                namespace: String::new(),
                auth_id: "certistack@pbs!restore".into(),
                fingerprint: ["ab"; 32].join(":"),
            }),
            snapshot: "vm/100/2026-11-01T02:00:00Z".into(),
            archives: vec!["drive-scsi0.img".into()],
            sandbox_vms: vec![pb::SandboxVm {
                vmid: 9100,
                max_cores: 1,
                max_memory_mib: 256,
            }],
            vnet: "csnet1".into(),
            probe_source: "10.99.0.1/24".into(),
            probe_targets: Vec::new(),
            qga_assertions: Vec::new(),
            network_recovery_modes: Vec::new(),
            guest_address: String::new(),
        };
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let signed = certistack_core::grant::sign(&key, &wire);
        certistack_core::grant::verify(&signed, &key.verifying_key()).unwrap()
    }

    #[test]
    fn isolation_evidence_that_contradicts_the_grant_is_refused() {
        let good = report::Isolation {
            bridge_ports: vec!["tap9100i0".into(), "tap9100i1".into()],
            bridge_addresses: vec!["fe80::1/64".into(), "10.99.0.1/24".into()],
            forwarding: BTreeMap::from([("net.ipv4.conf.csnet1.forwarding".into(), "0".into())]),
            ruleset: String::new(),
            ruleset_digest: String::new(),
            nat_sources: Vec::new(),
        };
        let grant = grant();
        // The owners as the node gives them: PVE's tap names read by VM and NIC.
        let owners = |isolation: &report::Isolation| -> Vec<pb::BridgePort> {
            isolation
                .bridge_ports
                .iter()
                .map(|name| {
                    let (vmid, nic) = certistack_core::net::pve_tap(name).unwrap_or((0, 0));
                    pb::BridgePort {
                        name: name.clone(),
                        vmid,
                        nic,
                    }
                })
                .collect()
        };
        check_isolation(&good, &owners(&good), &grant).unwrap();
        let refused = |change: &dyn Fn(&mut report::Isolation), needle: &str| {
            let mut isolation = good.clone();
            change(&mut isolation);
            let error = check_isolation(&isolation, &owners(&isolation), &grant).unwrap_err();
            assert!(error.contains(needle), "{error}");
        };
        let mut unowned = owners(&good);
        unowned.pop();
        let error = check_isolation(&good, &unowned, &grant).unwrap_err();
        assert!(error.contains("gave owners for"), "{error}");
        refused(&|i| i.bridge_ports.push("eno1".into()), "eno1");
        refused(&|i| i.bridge_ports.push("tap9200i0".into()), "tap9200i0");
        refused(&|i| i.bridge_ports.push("tap9100i".into()), "tap9100i");
        refused(
            &|i| i.bridge_addresses.push("10.99.0.254/24".into()),
            "10.99.0.254",
        );
        refused(
            &|i| {
                i.forwarding
                    .insert("net.ipv4.conf.csnet1.forwarding".into(), "1".into());
            },
            "is 1, not 0",
        );
        refused(&|i| i.forwarding.clear(), "no forwarding sysctl");
        let mut disabled = good.clone();
        disabled.forwarding.insert(
            "net.ipv6.conf.csnet1.forwarding".into(),
            "0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\")".into(),
        );
        check_isolation(&disabled, &owners(&disabled), &grant).unwrap();
    }

    #[test]
    fn a_guest_that_stopped_fails_and_one_the_node_holds_is_not_judged() {
        assert_eq!(guest_state("running"), GuestState::Running);
        for stopped in ["io-error", "internal-error", "guest-panicked", "shutdown"] {
            assert_eq!(guest_state(stopped), GuestState::Stopped, "{stopped}");
        }
        for held in ["paused", "prelaunch", "postmigrate", "unknown"] {
            assert_eq!(guest_state(held), GuestState::NotJudged, "{held}");
        }
    }
}
