//! Reports signed, verified, refused and described.

use super::*;
use certistack_core::journal::{Op, Resource};
use rand_core::OsRng;

const RUN: &str = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";

fn temp_dir(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("certistack-report-{tag}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Journal records as the node writes and streams them.
fn journal_records() -> Vec<JournalRecord> {
    let dir = temp_dir("journal");
    let mut journal = journal::Journal::create(&dir, RUN).unwrap();
    journal
        .append(
            1_000,
            &Op::parse("run.begin"),
            &Resource::parse(&format!("run:{RUN}")),
            journal::Phase::Done,
            serde_json::Value::Null,
        )
        .unwrap();
    journal
        .append(
            2_000,
            &Op::VmStart,
            &Resource::parse("vm:9100"),
            journal::Phase::Failed,
            serde_json::json!({"exit_code": 255, "error": "naïve \"quote\"\n"}),
        )
        .unwrap();
    let records = journal
        .records()
        .iter()
        .map(|r| JournalRecord::from(&r.to_wire()))
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    records
}

fn validation() -> Validation {
    let records = journal_records();
    Validation {
        run_id: RUN.into(),
        name: "web".into(),
        plan_digest: format!("sha256:{}", "ab".repeat(32)),
        node: "pve1".into(),
        connector: ConnectorVersion {
            version: "0.1.0".into(),
            surface_digest: format!("sha256:{}", "cd".repeat(32)),
        },
        controller_version: "0.1.0".into(),
        snapshot: Snapshot {
            server: "pbs.example".into(),
            port: 8007,
            datastore: "store1".into(),
            namespace: "prod".into(),
            snapshot: "vm/100/2026-11-30T01:00:00Z".into(),
            archives: vec![
                Archive {
                    name: "drive-scsi0.img".into(),
                    sha256: Some("ef".repeat(32)),
                    size: Some(8 << 20),
                    crypt_mode: Some("none".into()),
                },
                Archive {
                    name: "drive-scsi1.img".into(),
                    sha256: Some("01".repeat(32)),
                    size: Some(4 << 20),
                    crypt_mode: Some("encrypt".into()),
                },
            ],
            manifest_sha256: Some("9a".repeat(32)),
            verify_state: Some(VerifyState {
                state: "ok".into(),
                upid: "UPID:pbs1:000004D2:0000162E:00000003:6749A1C0:verificationjob:v1:root@pam:"
                    .into(),
                started_unix_ms: 1_732_878_784_000,
            }),
            latest: None,
        },
        steps: vec![Step {
            name: "start".into(),
            started_unix_ms: 1_000,
            ended_unix_ms: 2_500,
            result: StepResult::Ok,
            detail: String::new(),
        }],
        guest: GuestFacts {
            status: "running".into(),
            os_info: serde_json::json!({"id": "debian"}),
            interfaces: serde_json::json!([{"name": "eth0"}]),
        },
        probes: vec![ProbeResult {
            target: "tcp://10.99.0.10:22".into(),
            expected: "open".into(),
            outcome: "CONNECTED".into(),
            origin: "worker_host".into(),
            passed: true,
            latency_us: 420,
            detail: String::new(),
            received_sha256: String::new(),
            tls_certificate_sha256: String::new(),
        }],
        isolation: Isolation {
            bridge_ports: vec!["tap9100i0".into()],
            bridge_addresses: vec!["10.99.0.2/24".into()],
            forwarding: BTreeMap::from([("net.ipv4.ip_forward".into(), "0".into())]),
            ruleset: "table inet certistack {}".into(),
            ruleset_digest: sha256_text(b"table inet certistack {}"),
            nat_sources: Vec::new(),
        },
        assertions: vec![AssertionResult {
            name: "systemd running".into(),
            exit_code: 0,
            passed: true,
            detail: String::new(),
        }],
        cleanup: CleanupEvidence {
            receipts: vec![Receipt {
                resource: "vm:9100".into(),
                end_state: "destroyed".into(),
            }],
            residue: vec![],
            complete: true,
        },
        journal: JournalEvidence {
            head_sha256: recompute_journal_head(RUN, &records).unwrap(),
            records,
        },
        verdict: Verdict::Passed,
        screenshot: Some(Screenshot {
            file: "shot.png".into(),
            sha256: "12".repeat(32),
        }),
        hardware: Some(SandboxHardware {
            config_sha256: "ab".repeat(32),
            cpu: "x86-64-v2-AES".into(),
            bios: "ovmf".into(),
            machine: "q35".into(),
            disks: vec![
                "virtio0=drive-virtio0.img".into(),
                "ide2=cdrom (empty)".into(),
            ],
            efidisk: "efitype=4m,pre-enrolled-keys=1".into(),
            nics: vec!["net0=e1000".into()],
            boot_order: vec!["virtio0".into()],
            omitted: vec!["hostpci0: passthrough of a device".into()],
            changed: vec!["net0: rtl8139 -> e1000 (a legacy emulated NIC)".into()],
            ..SandboxHardware::default()
        }),
        placement: None,
    }
}

fn signed(key: &SigningKey) -> Vec<u8> {
    serde_json::to_vec(&sign(&Statement::new(validation()), key).unwrap()).unwrap()
}

#[test]
fn the_hardware_shows_what_the_sandbox_got_of_the_source() {
    let disk = |slot: &str, cdrom: bool| pb::SourceDisk {
        slot: slot.into(),
        archive: if cdrom {
            String::new()
        } else {
            format!("drive-{slot}.img")
        },
        cdrom,
    };
    let source = pb::SourceHardware {
        bios: "ovmf".into(),
        disks: vec![
            disk("scsi0", false),
            disk("scsi1", false),
            disk("ide2", true),
        ],
        efidisk: true,
        efitype: "4m".into(),
        pre_enrolled_keys: true,
        nics: vec![pb::SourceNic {
            index: 0,
            model: "virtio".into(),
        }],
        boot_order: vec!["scsi1".into(), "scsi0".into(), "ide2".into(), "net0".into()],
        changed: vec![pb::ChangedPart {
            key: "cpu".into(),
            original: "host".into(),
            replacement: "x86-64-v2-AES".into(),
            reason: "passes the node's CPU through".into(),
        }],
        ..pb::SourceHardware::default()
    };
    let all = SandboxHardware::from_wire(
        &source,
        "ab",
        &[
            "drive-scsi0.img".into(),
            "drive-scsi1.img".into(),
            EFIDISK_ARCHIVE.into(),
        ],
    );
    assert_eq!(all.efidisk, "efitype=4m,pre-enrolled-keys=1");
    assert_eq!(all.boot_order, ["scsi1", "scsi0", "ide2", "net0"]);
    assert!(all.omitted.is_empty(), "{:?}", all.omitted);
    assert_eq!(
        all.changed,
        ["cpu: host -> x86-64-v2-AES (passes the node's CPU through)"]
    );

    let some = SandboxHardware::from_wire(&source, "ab", &["drive-scsi0.img".into()]);
    assert_eq!(some.disks, ["scsi0=drive-scsi0.img", "ide2=cdrom (empty)"]);
    assert_eq!(
        some.efidisk, "",
        "an EFI disk the run does not restore is not the sandbox's"
    );
    assert_eq!(some.boot_order, ["scsi0", "ide2", "net0"]);
    assert!(
        some.omitted
            .iter()
            .any(|o| o.starts_with("scsi1: its archive drive-scsi1.img"))
    );
    assert!(
        some.omitted.iter().any(
            |o| o.starts_with("efidisk0: its archive drive-efidisk0.img")
                && o.contains("empty EFI variables")
        ),
        "{:?}",
        some.omitted
    );
}

#[test]
fn pae_matches_the_dsse_specification_example() {
    assert_eq!(
        pae("http://example.com/HelloWorld", b"hello world"),
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    );
    assert_eq!(pae("", b""), b"DSSEv1 0  0 ");
}

#[test]
fn a_signed_report_verifies_and_keeps_its_content() {
    let key = SigningKey::generate(&mut OsRng);
    let statement = verify(&signed(&key), &key.verifying_key()).unwrap();
    assert_eq!(statement, Statement::new(validation()));
    assert_eq!(statement.subject.len(), 3);
    assert_eq!(
        statement.subject[0].uri,
        "pbs://pbs.example:8007/store1/prod/vm/100/2026-11-30T01:00:00Z"
    );
    // Every subject carries its digest from the snapshot's manifest: the snapshot the
    // manifest's own, each archive its index checksum.
    let digests: Vec<(&str, Option<&String>)> = statement
        .subject
        .iter()
        .map(|s| (s.name.as_str(), s.digest.get("sha256")))
        .collect();
    assert_eq!(
        digests,
        [
            ("vm/100/2026-11-30T01:00:00Z", Some(&"9a".repeat(32))),
            ("drive-scsi0.img", Some(&"ef".repeat(32))),
            ("drive-scsi1.img", Some(&"01".repeat(32))),
        ]
    );
}

/// A change to a manifest the node answered.
type ManifestChange = dyn Fn(&mut pb::SnapshotManifest);

fn manifest_file(filename: &str, csum: &str) -> pb::ManifestFile {
    pb::ManifestFile {
        filename: filename.into(),
        csum: csum.into(),
        size: 8 << 20,
        crypt_mode: "none".into(),
    }
}

#[test]
fn the_manifest_gives_each_archive_its_checksum_and_the_snapshot_its_digest() {
    let mut snapshot = validation().snapshot;
    for archive in &mut snapshot.archives {
        (archive.sha256, archive.size, archive.crypt_mode) = (None, None, None);
    }
    snapshot.manifest_sha256 = None;
    snapshot.verify_state = None;
    let manifest = pb::SnapshotManifest {
        sha256: "5e".repeat(32),
        files: vec![
            manifest_file("qemu-server.conf.blob", &"11".repeat(32)),
            manifest_file("drive-scsi1.img.fidx", &"22".repeat(32)),
            manifest_file("drive-scsi0.img.fidx", &"33".repeat(32)),
        ],
        verify_state: Some(pb::ManifestVerifyState {
            state: "failed".into(),
            upid: "UPID:pbs1:00000001:00000002:00000003:6749A1C0:verify:store1:root@pam:".into(),
            started_unix: 1_732_878_784,
        }),
    };
    let mut taken = snapshot.clone();
    taken.take_manifest(&manifest).unwrap();
    assert_eq!(
        taken.manifest_sha256.as_deref(),
        Some("5e".repeat(32).as_str())
    );
    let sums: Vec<Option<&str>> = taken.archives.iter().map(|a| a.sha256.as_deref()).collect();
    assert_eq!(
        sums,
        [
            Some("33".repeat(32).as_str()),
            Some("22".repeat(32).as_str())
        ]
    );
    let verify = taken.verify_state.as_ref().unwrap();
    assert_eq!(
        (verify.state.as_str(), verify.started_unix_ms),
        ("failed", 1_732_878_784_000)
    );

    // The node's word is held to the form a report promises.
    let refused = |change: &ManifestChange| {
        let mut bad = manifest.clone();
        change(&mut bad);
        snapshot.clone().take_manifest(&bad).unwrap_err()
    };
    let cases: [(&ManifestChange, &str); 5] = [
        (
            &|m| drop(m.files.remove(1)),
            "does not list drive-scsi1.img.fidx",
        ),
        (&|m| m.sha256 = "5E".repeat(32), "manifest digest is not 64"),
        (
            &|m| m.files[2].csum = "\u{1b}[2J".into(),
            "csum of drive-scsi0.img.fidx",
        ),
        (
            &|m| m.files[2].crypt_mode = "x".into(),
            "crypt-mode of drive-scsi0.img.fidx",
        ),
        (
            &|m| m.verify_state.as_mut().unwrap().upid = "UPID:\u{1b}]52;c;x".into(),
            "verify_state.upid",
        ),
    ];
    for (change, expected) in cases {
        let error = refused(change);
        assert!(
            error.contains(expected),
            "{error:?} does not say {expected:?}"
        );
    }
}

#[test]
fn a_verdict_about_the_backup_must_name_its_bytes() {
    let key = SigningKey::generate(&mut OsRng);
    let error = signed_with(&key, |s| {
        s.predicate.snapshot.archives[1].sha256 = None;
        s.subject = Statement::new(s.predicate.clone()).subject;
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("subject \"drive-scsi1.img\" has no sha256 digest")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        s.predicate.snapshot.manifest_sha256 = Some("not hex".into());
        s.subject = Statement::new(s.predicate.clone()).subject;
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("not 64 lower-case hex")),
        "{error}"
    );
    // An error verdict may come before the manifest was read: it names no bytes.
    let mut early = validation();
    early.snapshot.manifest_sha256 = None;
    for archive in &mut early.snapshot.archives {
        archive.sha256 = None;
    }
    early.verdict = Verdict::Error {
        reasons: vec!["the node was unreachable".into()],
    };
    let bytes = serde_json::to_vec(&sign(&Statement::new(early), &key).unwrap()).unwrap();
    let statement = verify(&bytes, &key.verifying_key()).unwrap();
    assert!(statement.subject.iter().all(|s| s.digest.is_empty()));
}

#[test]
fn every_changed_byte_fails_verification() {
    let key = SigningKey::generate(&mut OsRng);
    let bytes = signed(&key);
    let text = std::str::from_utf8(&bytes).unwrap();
    let payload_start = text.find(r#""payload":""#).unwrap() + 11;
    let payload_end = payload_start + text[payload_start..].find('"').unwrap();
    // Inside the payload every change reaches the signature the same way, and a debug build
    // verifies slowly: its edges and every 16th byte stand for the rest.
    let inside_payload = |at: usize| {
        (payload_start + 8..payload_end.saturating_sub(8)).contains(&at)
            && !(at - payload_start).is_multiple_of(16)
    };
    for at in (0..bytes.len()).filter(|&at| !inside_payload(at)) {
        let mut changed = bytes.clone();
        changed[at] ^= 0x01;
        assert!(
            verify(&changed, &key.verifying_key()).is_err(),
            "byte {at} ({:?}) changed and the report still verifies",
            bytes[at] as char
        );
    }
}

#[test]
fn another_key_is_refused_by_key_id() {
    let key = SigningKey::generate(&mut OsRng);
    let other = SigningKey::generate(&mut OsRng);
    let error = verify(&signed(&key), &other.verifying_key()).unwrap_err();
    assert!(matches!(error, ReportError::KeyId { .. }), "{error}");
}

/// The statement is re-signed after each change, so only the statement checks can catch it.
fn signed_with(key: &SigningKey, change: impl FnOnce(&mut Statement)) -> ReportError {
    let mut statement = Statement::new(validation());
    change(&mut statement);
    let bytes = serde_json::to_vec(&sign(&statement, key).unwrap()).unwrap();
    verify(&bytes, &key.verifying_key()).unwrap_err()
}

#[test]
fn a_journal_that_does_not_recompute_is_refused_even_when_signed() {
    let key = SigningKey::generate(&mut OsRng);
    let error = signed_with(&key, |s| {
        s.predicate.journal.records[1].detail = r#"{"exit_code":0}"#.into()
    });
    assert!(
        matches!(&error, ReportError::Journal(m) if m.contains("record 2")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        s.predicate.journal.records.pop();
    });
    assert!(
        matches!(&error, ReportError::Journal(m) if m.contains("the records end at")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        s.predicate.run_id = "1f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into()
    });
    assert!(matches!(error, ReportError::Journal(_)), "{error}");
    let error = signed_with(&key, |s| s.predicate.journal.records.swap(0, 1));
    assert!(matches!(error, ReportError::Journal(_)), "{error}");
}

#[test]
fn statement_shape_is_checked_even_when_signed() {
    let key = SigningKey::generate(&mut OsRng);
    let error = signed_with(&key, |s| {
        s.predicate_type = "https://slsa.dev/provenance/v1".into()
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("predicateType")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        s.statement_type = "https://in-toto.io/Statement/v0.1".into()
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("_type")),
        "{error}"
    );
    let error = signed_with(&key, |s| s.subject.truncate(1));
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("subjects")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        s.predicate.verdict = Verdict::Failed { reasons: vec![] }
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("reason")),
        "{error}"
    );
    let error = signed_with(&key, |s| s.predicate.isolation.ruleset.push(' '));
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("ruleset_digest")),
        "{error}"
    );
    let error = signed_with(&key, |s| {
        if let Some(shot) = &mut s.predicate.screenshot {
            shot.file = "../../etc/passwd".into();
        }
    });
    assert!(
        matches!(&error, ReportError::Statement(m) if m.contains("screenshot.file")),
        "{error}"
    );
}

#[test]
fn the_screenshot_beside_a_report_must_be_the_one_signed() {
    let dir = temp_dir("screenshot");
    let report_path = dir.join("report.json");
    let mut statement = Statement::new(validation());
    let png = b"\x89PNG\r\n\x1a\n the guest's console";
    statement.predicate.screenshot = Some(Screenshot {
        file: "shot.png".into(),
        sha256: hex::encode(Sha256::digest(png)),
    });
    assert_eq!(
        check_screenshot(&statement, &report_path).unwrap(),
        ScreenshotCheck::Absent(dir.join("shot.png"))
    );
    std::fs::write(dir.join("shot.png"), png).unwrap();
    assert_eq!(
        check_screenshot(&statement, &report_path).unwrap(),
        ScreenshotCheck::Matches(dir.join("shot.png"))
    );
    std::fs::write(dir.join("shot.png"), b"another image").unwrap();
    let error = check_screenshot(&statement, &report_path).unwrap_err();
    assert!(matches!(error, ReportError::Screenshot { .. }), "{error}");
    statement.predicate.screenshot = None;
    assert_eq!(
        check_screenshot(&statement, &report_path).unwrap(),
        ScreenshotCheck::NotTaken
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reports_are_written_atomically_private_and_named_by_time_node_and_run() {
    let key = SigningKey::generate(&mut OsRng);
    let dir = temp_dir("write").join("reports");
    let at = OffsetDateTime::from_unix_timestamp(1_796_070_000).unwrap();
    let path = write(&dir, &Statement::new(validation()), &key, at).unwrap();
    assert_eq!(
        path.file_name().unwrap().to_str().unwrap(),
        format!("20261130T202000Z-pve1-{RUN}.json")
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "no temporary file is left"
    );
    verify(&read(&path).unwrap(), &key.verifying_key()).unwrap();
    let shown = describe(
        &verify(&read(&path).unwrap(), &key.verifying_key()).unwrap(),
        &path,
    );
    assert!(shown.starts_with("verdict: passed\n"), "{shown}");
    assert!(
        shown.contains(&format!(
            "  manifest: sha256 {}\n  last PBS verify: ok (task started 2024-11-29 11:13:04.0 +00:00:00, UPID:pbs1:000004D2:0000162E:00000003:6749A1C0:verificationjob:v1:root@pam:)\n  archive: drive-scsi0.img (sha256 {})\n",
            "9a".repeat(32),
            "ef".repeat(32)
        )),
        "{shown}"
    );
    assert!(
        shown.contains("hardware: cpu x86-64-v2-AES bios ovmf (efidisk efitype=4m,pre-enrolled-keys=1) machine q35 ostype default scsihw default; disks [virtio0=drive-virtio0.img, ide2=cdrom (empty)]; nics [net0=e1000]; boot [virtio0]\n  changed net0: rtl8139 -> e1000 (a legacy emulated NIC)\n  omitted hostpci0: passthrough of a device\n"),
        "{shown}"
    );
    assert!(
        shown.contains(&format!("screenshot: {}", dir.join("shot.png").display())),
        "{shown}"
    );
    let error = file_name(at, "../etc", RUN).unwrap_err();
    assert!(matches!(error, ReportError::Name(_)), "{error}");
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

/// Every text of a report that is the node's or the guest's word, carrying terminal sequences
/// and far longer than a screen: the verdict's reasons (a node's error message), the node's
/// version, a step's detail (the guest's os-release name), the guest's status, the probes, the
/// assertions, the hardware (its omissions) and the cleanup.
fn hostile_validation() -> Validation {
    use certistack_core::fixtures::TERMINAL_SEQUENCES;
    let hostile = |label: &str| format!("{label}{TERMINAL_SEQUENCES}{}", "A".repeat(100_000));
    let mut validation = validation();
    validation.verdict = Verdict::Failed {
        reasons: vec![hostile("recovery refused: "), hostile("probe: ")],
    };
    validation.connector.version = hostile("0.1.0");
    validation.connector.surface_digest = hostile("sha256:");
    validation.steps[0].detail = hostile("linux archlinux 0.0 (Arch Linux");
    validation.steps[0].name = hostile("recover");
    validation.guest.status = hostile("running");
    validation.probes[0].target = hostile("tcp://");
    validation.probes[0].outcome = hostile("CONNECTED");
    validation.probes[0].origin = hostile("worker_host");
    validation.probes[0].expected = hostile("banner_prefix ");
    validation.assertions[0].name = hostile("systemd");
    if let Some(hardware) = validation.hardware.as_mut() {
        hardware.cpu = hostile("host");
        hardware.nics = vec![hostile("net0=")];
        hardware.omitted = vec![hostile("hostpci0: "), hostile("usb0: ")];
        hardware.changed = vec![hostile("net0: ")];
    }
    validation.cleanup.receipts[0].resource = hostile("vm:");
    validation.cleanup.residue = vec![hostile("vm:9100 ")];
    validation
}

#[test]
fn report_show_prints_no_terminal_sequence_of_the_node_or_guest_and_stays_bounded() {
    use certistack_core::fixtures::acts_on_a_terminal;
    let key = SigningKey::generate(&mut OsRng);
    let dir = temp_dir("hostile");
    let statement = Statement::new(hostile_validation());
    let path = write(
        &dir.join("reports"),
        &statement,
        &key,
        OffsetDateTime::from_unix_timestamp(1_796_070_000).unwrap(),
    )
    .unwrap();
    let shown = describe(
        &verify(&read(&path).unwrap(), &key.verifying_key()).unwrap(),
        &path,
    );
    for line in shown.lines() {
        assert!(!acts_on_a_terminal(line), "{line:?}");
    }
    assert!(!shown.contains(['\x1b', '\x07', '\u{9b}']), "{shown:?}");
    let first = shown.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("verdict: FAILED: recovery refused: \\u{1b}[1A"),
        "{first}"
    );
    assert!(
        !shown
            .lines()
            .any(|line| line.starts_with("verdict: passed")),
        "{shown}"
    );
    // Bounded: each value is cut to a line's worth, whatever the node sent.
    assert!(shown.len() < 32 * 1024, "{} bytes", shown.len());
    assert!(
        shown.lines().all(|line| line.chars().count() <= 8 * 1024),
        "a line longer than 8 KiB"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_a_failed_verdict_about_a_missing_backup_may_name_no_digest() {
    let mut missing = validation();
    missing.snapshot.snapshot = "vm/100".into();
    missing.snapshot.archives.clear();
    missing.snapshot.manifest_sha256 = None;
    missing.snapshot.verify_state = None;
    missing.verdict = Verdict::Failed {
        reasons: vec!["VM 100 has no finished backup".into()],
    };
    // Without the listing's word that nothing was finished, a failed verdict must name bytes.
    assert!(Statement::new(missing.clone()).check().is_err());
    missing.snapshot.latest = Some(LatestEvidence {
        listed: 1,
        finished: 0,
        age_seconds: None,
        max_age_hours: Some(30),
    });
    Statement::new(missing.clone()).check().unwrap();
    // A finished backup exists: its digest is required again.
    missing.snapshot.latest = Some(LatestEvidence {
        listed: 2,
        finished: 1,
        age_seconds: Some(200_000),
        max_age_hours: Some(30),
    });
    assert!(Statement::new(missing.clone()).check().is_err());
    // A passed verdict never goes without.
    missing.snapshot.latest = Some(LatestEvidence {
        listed: 1,
        finished: 0,
        age_seconds: None,
        max_age_hours: None,
    });
    missing.verdict = Verdict::Passed;
    assert!(Statement::new(missing).check().is_err());
}
