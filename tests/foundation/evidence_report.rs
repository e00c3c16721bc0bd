//! Evidence reports signed with the key `certistack-ctl ca init` made, checked by
//! `certistack-ctl report verify` and by the Python verifier printed in docs/report.md.

use super::*;
use certistack_controller::report::{self, *};
use certistack_core::journal::{Op, Resource};
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::process::Command;

const RUN: &str = "6a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
const SNAPSHOT: &str = "vm/100/2026-11-30T01:00:00Z";
const ARCHIVE: &str = "drive-scsi0.img";
/// A verify job as PBS records it in the manifest.
const VERIFY_UPID: &str =
    "UPID:pbs1:000004D2:0000162E:00000003:6749A1C0:verificationjob:store1\\x3av\\x2d1:root@pam:";

/// The snapshot's manifest as the PBS double serves it to `proxmox-backup-client restore
/// <snapshot> index.json.blob -`, the way the node reads it.
fn manifest_from_double(lab: &Lab) -> Vec<u8> {
    let out = Command::new(lab.root.join("bin/proxmox-backup-client"))
        .args([
            "restore",
            SNAPSHOT,
            "index.json.blob",
            "-",
            "--repository",
            "root@pam@pbs.example:8007:store1",
        ])
        .env("PBS_PASSWORD", PBS_PASSWORD)
        .env("PBS_FINGERPRINT", ["ab"; 32].join(":"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    out.stdout
}

fn run(program: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(program).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ctl(args: &[&str]) -> (i32, String, String) {
    run(&binary("certistack-ctl"), args)
}

/// A journal the connector wrote, as `ReadJournal` streams it.
fn journal_records(dir: &Path) -> Vec<JournalRecord> {
    use certistack_core::journal::{Journal, Phase};
    let journal_dir = dir.join("journal");
    std::fs::create_dir_all(&journal_dir).unwrap();
    let mut journal = Journal::create(&journal_dir, RUN).unwrap();
    let run = Resource::parse(&format!("run:{RUN}"));
    journal
        .append(
            1_000,
            &Op::RunBegin,
            &run,
            Phase::Done,
            serde_json::Value::Null,
        )
        .unwrap();
    journal
        .append(
            2_000,
            &Op::VmStart,
            &Resource::parse("vm:9100"),
            Phase::Intent,
            serde_json::Value::Null,
        )
        .unwrap();
    journal
        .append(
            3_000,
            &Op::VmStart,
            &Resource::parse("vm:9100"),
            Phase::Done,
            serde_json::json!({"pid": 42}),
        )
        .unwrap();
    journal
        .append(
            4_000,
            &Op::RunCleanup,
            &run,
            Phase::Done,
            serde_json::json!({"receipts": [{"end_state": "destroyed", "resource": "vm:9100"}], "residue": []}),
        )
        .unwrap();
    journal
        .records()
        .iter()
        .map(|r| JournalRecord::from(&r.to_wire()))
        .collect()
}

fn validation(dir: &Path) -> Validation {
    let records = journal_records(dir);
    let ruleset = "table inet certistack_sandbox { chain forward { type filter hook forward priority 0; policy drop; } }";
    Validation {
        run_id: RUN.into(),
        name: "web".into(),
        plan_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(b"plan"))),
        node: NODE.into(),
        connector: ConnectorVersion {
            version: env!("CARGO_PKG_VERSION").into(),
            surface_digest: certistack_proto::SURFACE_DIGEST.into(),
        },
        controller_version: env!("CARGO_PKG_VERSION").into(),
        snapshot: Snapshot {
            server: "pbs.example".into(),
            port: 8007,
            datastore: "store1".into(),
            namespace: String::new(),
            snapshot: SNAPSHOT.into(),
            archives: vec![Archive {
                name: ARCHIVE.into(),
                sha256: None,
                size: None,
                crypt_mode: None,
            }],
            manifest_sha256: None,
            verify_state: None,
            latest: None,
        },
        steps: vec![
            Step {
                name: "start".into(),
                started_unix_ms: 2_000,
                ended_unix_ms: 3_000,
                result: StepResult::Ok,
                detail: String::new(),
            },
            Step {
                name: "probes".into(),
                started_unix_ms: 3_000,
                ended_unix_ms: 3_500,
                result: StepResult::Failed,
                detail: "tcp://10.99.0.10:22 refused".into(),
            },
        ],
        guest: GuestFacts {
            status: "running".into(),
            os_info: serde_json::json!({"id": "debian", "version-id": "13"}),
            interfaces: serde_json::json!([{"name": "eth0", "ip-addresses": []}]),
        },
        probes: vec![ProbeResult {
            target: "tcp://10.99.0.10:22".into(),
            expected: "open".into(),
            outcome: "REFUSED".into(),
            origin: "worker_host".into(),
            passed: false,
            latency_us: 310,
            detail: String::new(),
            received_sha256: String::new(),
            tls_certificate_sha256: String::new(),
        }],
        isolation: Isolation {
            bridge_ports: vec!["tap9100i0".into()],
            bridge_addresses: vec!["10.99.0.2/24".into()],
            forwarding: [("net.ipv4.ip_forward".to_owned(), "0".to_owned())].into(),
            ruleset: ruleset.into(),
            ruleset_digest: format!("sha256:{}", hex::encode(sha2::Sha256::digest(ruleset))),
            nat_sources: Vec::new(),
        },
        assertions: vec![],
        cleanup: CleanupEvidence {
            receipts: vec![Receipt {
                resource: "vm:9100".into(),
                end_state: "destroyed".into(),
            }],
            residue: vec![],
            complete: true,
        },
        journal: JournalEvidence {
            head_sha256: report::recompute_journal_head(RUN, &records).unwrap(),
            records,
        },
        verdict: Verdict::Failed {
            reasons: vec!["probe tcp://10.99.0.10:22: refused, expected open".into()],
        },
        screenshot: Some(Screenshot {
            file: format!("20261130T202000Z-{NODE}-{RUN}.png"),
            sha256: hex::encode(sha2::Sha256::digest(b"png")),
        }),
        hardware: None,
        placement: None,
    }
}

/// The Python program of docs/report.md, written to `dir`.
pub(super) fn python_verifier(dir: &Path) -> PathBuf {
    let doc = std::fs::read_to_string(workspace_root().join("docs/report.md")).unwrap();
    let (_, after) = doc.split_once("```python\n").unwrap();
    let (program, _) = after.split_once("```").unwrap();
    let path = dir.join("verify-report.py");
    std::fs::write(&path, program).unwrap();
    path
}

pub(super) fn python(
    verifier: &Path,
    report: &Path,
    key: &Path,
    extra: &[&str],
) -> (i32, String, String) {
    let has_cryptography = Command::new("/usr/bin/python3")
        .args(["-c", "import cryptography"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_cryptography,
        "python3 with the `cryptography` module is needed to check the report format independently (Debian: apt-get install python3-cryptography)"
    );
    let mut args = vec![
        verifier.to_str().unwrap(),
        report.to_str().unwrap(),
        key.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(Path::new("/usr/bin/python3"), &args)
}

/// The envelope with one field's text changed by one byte, written beside `report`.
fn tampered(report: &Path, name: &str, change: impl FnOnce(&mut Envelope)) -> PathBuf {
    let mut envelope: Envelope = serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    change(&mut envelope);
    let path = report.with_file_name(name);
    std::fs::write(&path, serde_json::to_vec(&envelope).unwrap()).unwrap();
    path
}

type Change = Box<dyn FnOnce(&mut Envelope)>;

/// Replaces the character at `at` with another one that keeps base64 text decodable.
fn change_character(text: &mut String, at: usize) {
    let mut bytes = std::mem::take(text).into_bytes();
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    *text = String::from_utf8(bytes).unwrap();
}

#[test]
fn a_report_signed_with_the_ca_init_key_verifies_here_and_in_python_and_any_change_fails() {
    let dir = TempDir::new("report");
    let state = dir.0.join("ctl");
    let s = state.to_str().unwrap();
    let (code, _, err) = ctl(&["ca", "init", "--state-dir", s]);
    assert_eq!(code, 0, "{err}");
    let authority = certistack_controller::authority::Authority::load(&state).unwrap();
    let reports = dir.0.join("reports");
    // The snapshot as the PBS double stores it: a disk image of three chunks, the last short;
    // the node parses its manifest, the controller gives the report's subjects its digests.
    let lab = Lab::new("report-pbs");
    let image = lab.add_backup(
        SNAPSHOT,
        ARCHIVE,
        b"\xeb\x63\x90certistack",
        (9 << 20) + 513,
    );
    lab.settings(serde_json::json!({
        "manifest_verify_state": {"state": "ok", "upid": VERIFY_UPID}
    }));
    let manifest_bytes = manifest_from_double(&lab);
    let manifest_path = dir.0.join("index.json.blob");
    std::fs::write(&manifest_path, &manifest_bytes).unwrap();
    let manifest = certistack_connector::node::manifest::parse(
        &manifest_bytes,
        &certistack_core::validate::Snapshot::validate(SNAPSHOT).unwrap(),
    )
    .unwrap();
    let mut predicate = validation(&dir.0);
    predicate.snapshot.take_manifest(&manifest).unwrap();
    let statement = Statement::new(predicate);
    let path = report::write(&reports, &statement, authority.report_signing(), now()).unwrap();
    let p = path.to_str().unwrap();
    let public = state.join("report-signing.pub");
    let verifier = python_verifier(&dir.0);
    let screenshot = reports.join(format!("20261130T202000Z-{NODE}-{RUN}.png"));
    std::fs::write(&screenshot, b"png").unwrap();

    let (code, out, err) = ctl(&["report", "verify", p, "--state-dir", s]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("valid; signed by sha256:"), "{out}");
    assert!(out.contains("verdict failed"), "{out}");
    assert!(
        out.contains(&format!("screenshot {}: matches", screenshot.display())),
        "{out}"
    );
    assert!(
        out.contains(&statement.predicate.journal.head_sha256),
        "{out}"
    );
    let (code, out, err) = ctl(&["report", "verify", p, "--key", public.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = python(&verifier, &path, &public, &[]);
    assert_eq!(
        code, 0,
        "the independent verifier refused the report: {out}{err}"
    );
    assert_eq!(
        out,
        format!("valid: failed {NODE} {RUN} probe tcp://10.99.0.10:22: refused, expected open\n")
    );
    // The independent verifier's view of the subjects is the double's manifest: the snapshot by
    // the manifest's bytes, the archive by the checksum it recomputes from the image the double
    // stores, and both as the manifest lists them.
    let subject_digest = |name: &str| {
        statement
            .subject
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.digest.get("sha256"))
            .cloned()
    };
    assert_eq!(
        subject_digest(SNAPSHOT),
        Some(hex::encode(sha2::Sha256::digest(&manifest_bytes)))
    );
    let listed: serde_json::Value = serde_json::from_slice(&manifest_bytes).unwrap();
    assert_eq!(
        subject_digest(ARCHIVE).as_deref(),
        listed["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["filename"] == "drive-scsi0.img.fidx")
            .and_then(|f| f["csum"].as_str()),
    );
    let image_arg = format!("{ARCHIVE}={}", image.display());
    let manifest_arg = format!("index.json.blob={}", manifest_path.display());
    let (code, out, err) = python(&verifier, &path, &public, &[&image_arg, &manifest_arg]);
    assert_eq!(code, 0, "the verifier's subjects differ: {out}{err}");
    assert_eq!(
        statement
            .predicate
            .snapshot
            .verify_state
            .as_ref()
            .map(|v| (v.state.as_str(), v.started_unix_ms)),
        Some(("ok", 0x6749_A1C0 * 1000))
    );
    // Other bytes than the ones the report names: one changed byte in the last, short chunk of
    // the image, or a manifest PBS changed since (a verify job ran): both refused.
    let mut other_image = std::fs::read(&image).unwrap();
    *other_image.last_mut().unwrap() ^= 1;
    let other_image_path = dir.0.join("other.raw");
    std::fs::write(&other_image_path, &other_image).unwrap();
    let other_image_arg = format!("{ARCHIVE}={}", other_image_path.display());
    let (code, _, err) = python(&verifier, &path, &public, &[&other_image_arg]);
    assert_ne!(code, 0, "another image was accepted");
    assert!(
        err.contains("drive-scsi0.img: not the bytes the report names"),
        "{err}"
    );
    lab.settings(serde_json::json!({
        "manifest_verify_state": {"state": "failed", "upid": VERIFY_UPID}
    }));
    let later_path = dir.0.join("later.json.blob");
    std::fs::write(&later_path, manifest_from_double(&lab)).unwrap();
    let later_arg = format!("index.json.blob={}", later_path.display());
    let (code, _, err) = python(&verifier, &path, &public, &[&later_arg]);
    assert_ne!(code, 0, "another manifest was accepted");
    assert!(err.contains("another manifest"), "{err}");
    // A verdict about the backup without the digests that name it: refused by both.
    let mut unnamed = statement.clone();
    unnamed.predicate.snapshot.archives[0].sha256 = None;
    unnamed.subject = Statement::new(unnamed.predicate.clone()).subject;
    let unnamed_path = dir.0.join("unnamed.json");
    std::fs::write(
        &unnamed_path,
        serde_json::to_vec(&report::sign(&unnamed, authority.report_signing()).unwrap()).unwrap(),
    )
    .unwrap();
    let (code, _, err) = ctl(&[
        "report",
        "verify",
        unnamed_path.to_str().unwrap(),
        "--state-dir",
        s,
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("has no sha256 digest"), "{err}");
    let (code, _, err) = python(&verifier, &unnamed_path, &public, &[]);
    assert_ne!(
        code, 0,
        "the independent verifier accepted a report naming no bytes"
    );
    assert!(
        err.contains("subject drive-scsi0.img: no sha256 digest"),
        "{err}"
    );

    let (code, out, err) = ctl(&["report", "show", p, "--state-dir", s]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("verdict: FAILED: probe tcp://10.99.0.10:22: refused"),
        "{out}"
    );
    for expected in [
        format!("node: {NODE}"),
        "snapshot: vm/100/2026-11-30T01:00:00Z".to_owned(),
        "probes:".to_owned(),
        "tcp://10.99.0.10:22 REFUSED from worker_host".to_owned(),
        "cleanup: complete (1 resources)".to_owned(),
        format!(
            "journal: 4 records, head {}",
            statement.predicate.journal.head_sha256
        ),
        format!(
            "screenshot: {}",
            reports
                .join(format!("20261130T202000Z-{NODE}-{RUN}.png"))
                .display()
        ),
    ] {
        assert!(out.contains(&expected), "{expected:?} missing from:\n{out}");
    }

    // One changed byte in each field of the envelope: both verifiers refuse.
    let changes: [(&str, Change, &str); 4] = [
        (
            "payload.json",
            Box::new(|e| change_character(&mut e.payload, 200)),
            "does not verify",
        ),
        (
            "sig.json",
            Box::new(|e| change_character(&mut e.signatures[0].sig, 10)),
            "does not verify",
        ),
        (
            "type.json",
            Box::new(|e| e.payload_type.replace_range(0..1, "b")),
            "payloadType",
        ),
        (
            "keyid.json",
            Box::new(|e| change_character(&mut e.signatures[0].keyid, 7)),
            "keyid",
        ),
    ];
    for (name, change, reason) in changes {
        let bad = tampered(&path, name, change);
        let (code, out, err) = ctl(&["report", "verify", bad.to_str().unwrap(), "--state-dir", s]);
        assert_eq!(code, 1, "{name}: {out}{err}");
        assert!(
            err.contains("not valid") && err.contains(reason),
            "{name}: {err}"
        );
        let (code, out, err) = python(&verifier, &bad, &public, &[]);
        assert_ne!(
            code, 0,
            "{name}: the independent verifier accepted it: {out}{err}"
        );
    }

    // A journal that does not recompute, signed with the right key: refused by both.
    let mut broken = statement.clone();
    broken.predicate.journal.records[2].detail = r#"{"pid":43}"#.into();
    let forged = report::sign(&broken, authority.report_signing()).unwrap();
    let forged_path = dir.0.join("forged.json");
    std::fs::write(&forged_path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let (code, _, err) = ctl(&[
        "report",
        "verify",
        forged_path.to_str().unwrap(),
        "--state-dir",
        s,
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("journal") && err.contains("record 3"), "{err}");
    let (code, _, err) = python(&verifier, &forged_path, &public, &[]);
    assert_ne!(code, 0);
    assert!(err.contains("record 3 does not verify"), "{err}");

    // Another controller's key: refused by key id.
    let other = dir.0.join("other");
    let (code, _, err) = ctl(&["ca", "init", "--state-dir", other.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = ctl(&[
        "report",
        "verify",
        p,
        "--state-dir",
        other.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("keyid"), "{err}");

    // A replaced screenshot: refused by both.
    std::fs::write(&screenshot, b"another picture").unwrap();
    let (code, _, err) = ctl(&["report", "verify", p, "--state-dir", s]);
    assert_eq!(code, 1);
    assert!(err.contains("the image was replaced"), "{err}");
    let (code, _, err) = python(&verifier, &path, &public, &[]);
    assert_ne!(code, 0);
    assert!(err.contains("screenshot"), "{err}");
}
