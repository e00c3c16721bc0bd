//! Grants for tests of both programs: a wire grant that sets every field, and its signature;
//! and the terminal sequences a hostile guest or node would send an operator's screen.
//! Compiled only into tests (`cfg(test)` here, the `fixtures` feature for the other crates' tests).

use certistack_proto::v1 as pb;

pub const RUN: &str = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";

/// A wire grant that sets every field, so the validator-usage test sees each of them.
pub fn full_wire_grant() -> pb::RunGrant {
    pb::RunGrant {
        version: 1,
        run_id: RUN.into(),
        node: "pve1".into(),
        not_before_unix: 1_000,
        deadline_unix: 4_600,
        repository: Some(pb::PbsRepository {
            server: "pbs.lab".into(),
            port: 8007,
            datastore: "store1".into(),
            namespace: "prod/web".into(),
            auth_id: "certistack@pbs!restore".into(),
            fingerprint: ["ab"; 32].join(":"),
        }),
        snapshot: "vm/100/2026-11-01T02:00:00Z".into(),
        archives: vec!["drive-scsi0.img".into(), "drive-scsi1.img".into()],
        sandbox_vms: vec![pb::SandboxVm {
            vmid: 9100,
            max_cores: 2,
            max_memory_mib: 2048,
        }],
        vnet: "csbox1".into(),
        probe_source: "198.51.100.2/24".into(),
        probe_targets: vec![pb::ProbeTarget {
            kind: pb::ProbeKind::Http as i32,
            address: "198.51.100.10".into(),
            port: 80,
            expect: Some(pb::ProbeExpectation {
                banner_prefix: "SSH-2.0-".into(),
                http_path: "/healthz".into(),
                http_status: 200,
                body_contains: "ok".into(),
                body_sha256: "a".repeat(64),
                dns_name: "www.example.test".into(),
                dns_type: pb::DnsRecordType::A as i32,
                dns_answers: vec!["198.51.100.10".into()],
                ldap_naming_context: "dc=example,dc=test".into(),
            }),
        }],
        qga_assertions: vec![pb::QgaAssertion {
            id: "nginx-active".into(),
            program: "/usr/bin/systemctl".into(),
            args: vec!["is-active".into(), "nginx".into()],
            expect_exit_code: 0,
            expect_stdout_contains: "active".into(),
            timeout_seconds: 30,
        }],
        network_recovery_modes: vec![pb::NetworkRecoveryMode::Rewrite as i32],
        guest_address: "198.51.100.10/24".into(),
    }
}

pub use crate::grant::sign;

/// Terminal sequences a guest or a node could put in text an operator reads: cursor up and
/// erase line (so what follows overwrites the verdict line above), a clipboard write (OSC 52,
/// ended by BEL), a hyperlink (OSC 8, ended by ESC `\`), the one-byte C1 CSI and a
/// right-to-left override.
pub const TERMINAL_SEQUENCES: &str = "\x1b[1A\x1b[2Kverdict: passed\x1b]52;c;aGk=\x07\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\u{9b}2J\u{202e}";

/// Whether `text` holds a character a terminal acts on rather than shows: a C0 or C1 control
/// (ESC, BEL, CSI, a line break included), DEL, or a bidirectional override, embedding or
/// isolate.
pub fn acts_on_a_terminal(text: &str) -> bool {
    text.chars().any(|c| {
        c.is_control()
            || ('\u{202a}'..='\u{202e}').contains(&c)
            || ('\u{2066}'..='\u{2069}').contains(&c)
    })
}
