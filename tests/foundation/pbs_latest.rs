//! `snapshot: latest`, archives and sizes from the backup, read through the PBS API double
//! (`tests/doubles/pbs-api`) over the same on-disk "PBS" the `proxmox-backup-client` double
//! maps: the newest finished snapshot, never one in progress; every disk archive; the source's
//! cores and memory, capped; refusals before any node is contacted; the secret in no output.

use super::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const AUTH_ID: &str = "certistack@pbs!restore";
const SECRET: &str = "pbs-api-double-secret-7f3a";
const CONFIG: &str = "boot: order=scsi0\ncores: 2\nsockets: 2\nmemory: 4096\nscsi0: local:100/vm-100-disk-0.raw,size=4M\nefidisk0: local:100/vm-100-disk-1.raw,size=528K\n";

/// The "PBS" (the client double's tree) and the API double serving it; stopped on drop.
struct Pbs {
    root: TempDir,
    port: u16,
    fingerprint: String,
    _api: ApiDouble,
}

impl Pbs {
    fn start(settings: serde_json::Value) -> Self {
        let root = TempDir::new("pbs-api");
        std::fs::write(root.0.join("double.json"), settings.to_string()).unwrap();
        let group = root.0.join("pbs/backups/ns/nightly/vm/100");
        for (time, unfinished) in [
            ("2026-12-01T02:00:00Z", false),
            ("2026-12-02T02:00:00Z", false),
            ("2026-12-03T02:00:00Z", true),
        ] {
            let snapshot = group.join(time);
            std::fs::create_dir_all(&snapshot).unwrap();
            std::fs::write(snapshot.join("drive-scsi0.img"), vec![7u8; 4 << 20]).unwrap();
            std::fs::write(snapshot.join("drive-efidisk0.img"), vec![1u8; 528 << 10]).unwrap();
            std::fs::write(snapshot.join("qemu-server.conf.blob"), CONFIG).unwrap();
            if unfinished {
                std::fs::write(snapshot.join(".unfinished"), "").unwrap();
            }
        }
        // VM 101 only has a backup still being written.
        let lone = root
            .0
            .join("pbs/backups/ns/nightly/vm/101/2026-12-03T02:00:00Z");
        std::fs::create_dir_all(&lone).unwrap();
        std::fs::write(lone.join("drive-scsi0.img"), vec![0u8; 4096]).unwrap();
        std::fs::write(lone.join(".unfinished"), "").unwrap();
        let api = ApiDouble::start(
            "pbs-api",
            &api_server_pki(&["localhost"]),
            &["--root".into(), root.0.clone().into_os_string()],
            "--tls-dir",
        );
        Self {
            port: api.port,
            fingerprint: api.fingerprint.clone(),
            root,
            _api: api,
        }
    }

    fn calls_log(&self) -> String {
        std::fs::read_to_string(self.root.0.join("calls.log")).unwrap_or_default()
    }
}

fn settings() -> serde_json::Value {
    serde_json::json!({ "pbs_password": SECRET, "pbs_auth_id": AUTH_ID, "pbs_fingerprint": null })
}

/// A controller configuration with one node (a listener nobody answers, so a contact would be
/// seen) and a plan of one validation of VM 100 (`snapshot: latest`, no archives, no sizes).
struct Setup {
    dir: TempDir,
    listener: std::net::TcpListener,
}

impl Setup {
    fn new(pbs: &Pbs) -> Self {
        let dir = TempDir::new("pbs-plan");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let config = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = {}\n",
            dir.0.join("state"),
            dir.0.join("reports"),
            listener.local_addr().unwrap().port()
        );
        std::fs::write(dir.0.join("controller.toml"), config).unwrap();
        std::fs::create_dir(dir.0.join("secrets")).unwrap();
        let secret = dir.0.join("secrets/pbs-token");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let plan = format!(
            r#"storage:
  server: localhost
  port: {port}
  datastore: backups
  namespace: nightly
  auth_id: "{AUTH_ID}"
  fingerprint: "{fingerprint}"
  pbs_password_file: secrets/pbs-token
validations:
  - name: web01
    node: pve1
    source_vmid: 100
    snapshot: latest
    sandbox:
      - vmid: 9100
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    probes:
      - kind: tcp
        address: 10.99.0.10
        port: 22
"#,
            port = pbs.port,
            fingerprint = pbs.fingerprint
        );
        std::fs::write(dir.0.join("nightly.yaml"), plan).unwrap();
        Self { dir, listener }
    }

    fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(binary("certistack-ctl"))
            .args(args)
            .current_dir(&self.dir.0)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn plan_check(&self) -> (i32, String, String) {
        self.ctl(&[
            "plan",
            "check",
            "nightly.yaml",
            "--config",
            "controller.toml",
        ])
    }

    fn show_json(&self) -> (i32, String, String) {
        self.ctl(&[
            "plan",
            "show",
            "nightly.yaml",
            "--config",
            "controller.toml",
            "--json",
        ])
    }

    fn edit(&self, from: &str, to: &str) {
        let path = self.dir.0.join("nightly.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{from:?} not in the plan");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    }

    fn assert_no_node_contacted(&self) {
        let accepted = self.listener.accept();
        assert!(
            matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a node was contacted: {accepted:?}"
        );
    }
}

#[test]
fn latest_archives_and_sizes_come_from_the_pbs_api() {
    let pbs = Pbs::start(settings());
    let setup = Setup::new(&pbs);
    let mut outputs = Vec::new();

    let (code, out, err) = setup.show_json();
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    let web = &document["validations"][0];
    // The newest finished snapshot: the one of 12-03 is still being written.
    assert_eq!(web["snapshot"]["value"], "2026-12-02T02:00:00Z");
    assert_eq!(web["snapshot"]["source"], "pbs");
    assert_eq!(web["latest"]["listed"], 3);
    assert_eq!(web["latest"]["finished"], 2);
    // Every disk archive, the EFI vars disk included, with its size.
    assert_eq!(
        web["archives"]["value"],
        serde_json::json!(["drive-efidisk0.img", "drive-scsi0.img"])
    );
    assert_eq!(web["archives"]["source"], "pbs");
    assert_eq!(web["archive_sizes"]["drive-scsi0.img"], 4 << 20);
    // 2 cores × 2 sockets = 4 (the default cap is 4), 4096 MiB (under the default 8192).
    let vm = &web["sandbox"][0];
    assert_eq!(
        (
            vm["cores"]["value"].as_u64(),
            vm["cores"]["source"].as_str()
        ),
        (Some(4), Some("pbs"))
    );
    assert_eq!(
        (
            vm["memory_mib"]["value"].as_u64(),
            vm["memory_mib"]["source"].as_str()
        ),
        (Some(4096), Some("pbs"))
    );
    outputs.push(out + &err);

    // The text says the same, and plan check accepts the plan with the resolved time.
    let (code, out, err) = setup.ctl(&[
        "plan",
        "show",
        "nightly.yaml",
        "--config",
        "controller.toml",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("  snapshot                        pbs           2026-12-02T02:00:00Z"),
        "{out}"
    );
    assert!(
        out.contains("the newest of 2 finished snapshot(s) (3 listed)"),
        "{out}"
    );
    assert!(out.contains("drive-scsi0.img, 4194304 bytes"), "{out}");
    outputs.push(out + &err);
    let (code, out, err) = setup.plan_check();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("snapshot vm/100/2026-12-02T02:00:00Z archives drive-efidisk0.img,drive-scsi0.img sandbox 9100 (4 cores, 4096 MiB)"), "{out}");
    outputs.push(out + &err);

    // Capped by the plan.
    setup.edit(
        "      - vmid: 9100\n",
        "      - vmid: 9100\n        max_cores: 2\n        max_memory_mib: 2048\n",
    );
    let (code, out, err) = setup.show_json();
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    let vm = &document["validations"][0]["sandbox"][0];
    assert_eq!(
        (
            vm["cores"]["value"].as_u64(),
            vm["memory_mib"]["value"].as_u64()
        ),
        (Some(2), Some(2048))
    );
    outputs.push(out + &err);

    // Refusals, each before any node. The plan's own (65): an archive the snapshot lacks, a
    // snapshot in progress named, a password login, a datastore name no grant accepts (refused
    // before the token is sent). The infrastructure's (2): a wrong fingerprint, a PBS down.
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_port = down.local_addr().unwrap().port();
    drop(down);
    let cases: Vec<(String, String, i32, &str)> = vec![
        (
            "    snapshot: latest\n".into(),
            "    snapshot: latest\n    archives: [drive-scsi1.img]\n".into(),
            65,
            "the snapshot has no archive drive-scsi1.img; its disk archives are drive-efidisk0.img, drive-scsi0.img",
        ),
        (
            "snapshot: latest".into(),
            "snapshot: \"2026-12-03T02:00:00Z\"".into(),
            65,
            "is not finished",
        ),
        (
            format!("auth_id: \"{AUTH_ID}\""),
            "auth_id: \"certistack@pbs\"".into(),
            65,
            "API token only",
        ),
        (
            "datastore: backups".into(),
            "datastore: \"../../version\"".into(),
            65,
            "storage.datastore",
        ),
        (
            format!("fingerprint: \"{}\"", pbs.fingerprint),
            format!("fingerprint: \"{}\"", ["ab"; 32].join(":")),
            2,
            "not the pinned AB:AB",
        ),
        (
            format!("port: {}", pbs.port),
            format!("port: {down_port}"),
            2,
            "cannot reach https://localhost:",
        ),
    ];
    for (from, to, expected, reason) in cases {
        let original = std::fs::read_to_string(setup.dir.0.join("nightly.yaml")).unwrap();
        let requests_before = pbs.calls_log().lines().count();
        setup.edit(&from, &to);
        let (code, out, err) = setup.show_json();
        assert_eq!(code, expected, "{to}: {out}{err}");
        assert!(out.is_empty(), "{out}");
        assert!(
            err.contains("validations[0] (web01)") && err.contains(reason),
            "{to}: {err}"
        );
        if to.contains("datastore") {
            assert_eq!(
                pbs.calls_log().lines().count(),
                requests_before,
                "the token was sent"
            );
        }
        outputs.push(out + &err);
        std::fs::write(setup.dir.0.join("nightly.yaml"), original).unwrap();
    }

    // A secret file others can read: refused with the chmod, before the API is asked.
    let requests_before = pbs.calls_log().lines().count();
    let secret = setup.dir.0.join("secrets/pbs-token");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, out, err) = setup.show_json();
    assert_eq!(code, 77, "{out}{err}");
    assert!(err.contains("chmod 0600"), "{err}");
    assert_eq!(
        pbs.calls_log().lines().count(),
        requests_before,
        "the API was asked"
    );
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

    setup.assert_no_node_contacted();
    for output in &outputs {
        assert!(!output.contains(SECRET), "{output}");
    }
    let log = pbs.calls_log();
    assert!(!log.contains(SECRET), "{log}");
    assert!(log.contains("\"tool\": \"pbs-api\""), "{log}");
}

#[test]
fn the_api_listing_and_the_client_manifest_agree_on_every_file() {
    let pbs = Pbs::start(settings());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fingerprint = certistack_core::tls::parse_fingerprint(&pbs.fingerprint).unwrap();
    let client = certistack_controller::api::pbs::PbsClient::new(
        certistack_controller::api::pbs::PbsEndpoint {
            host: "localhost",
            port: pbs.port,
            auth_id: AUTH_ID,
            secret: zeroize::Zeroizing::new(SECRET.to_owned()),
            fingerprint,
        },
        certistack_controller::api::https::Limits::default(),
    )
    .unwrap();
    let listed = runtime
        .block_on(client.vm_snapshots("backups", "nightly", 100))
        .unwrap();
    let snapshot = listed
        .iter()
        .find(|item| item.backup_time == 1_796_176_800)
        .expect("the snapshot of 2026-12-02T02:00:00Z is listed");
    // The manifest the client double prints for the same snapshot (what the node reads).
    let bin = pbs.root.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let client_double = bin.join("proxmox-backup-client");
    std::fs::copy(
        workspace_root().join("tests/doubles/proxmox-backup-client"),
        &client_double,
    )
    .unwrap();
    let out = Command::new(&client_double)
        .args([
            "restore",
            "vm/100/2026-12-02T02:00:00Z",
            "index.json.blob",
            "-",
            "--ns",
            "nightly",
        ])
        .env("PBS_REPOSITORY", format!("{AUTH_ID}@localhost:backups"))
        .env("PBS_PASSWORD", SECRET)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files = manifest["files"].as_array().unwrap();
    assert!(files.len() >= 3, "{manifest}");
    for file in files {
        let name = file["filename"].as_str().unwrap();
        let listed_file = snapshot
            .files
            .iter()
            .find(|listed| listed.filename == name)
            .unwrap_or_else(|| panic!("{name} is in the manifest, not in the listing"));
        assert_eq!(listed_file.size, file["size"].as_u64(), "{name}");
        assert_eq!(
            listed_file.crypt_mode.as_deref(),
            file["crypt-mode"].as_str(),
            "{name}"
        );
    }
    // The unfinished snapshot is listed without a size.
    let unfinished = listed
        .iter()
        .find(|item| item.backup_time == 1_796_263_200)
        .expect("the snapshot in progress is listed");
    assert_eq!(unfinished.size, None);
    // The config read through the API is the one stored.
    let config = runtime
        .block_on(client.download_blob(
            "backups",
            "nightly",
            100,
            1_796_176_800,
            "qemu-server.conf.blob",
        ))
        .unwrap();
    assert_eq!(config, CONFIG.as_bytes());
}

#[test]
fn an_encrypted_config_asks_for_the_sizes() {
    let mut encrypted = settings();
    encrypted["encrypted_blobs"] = serde_json::json!(["qemu-server.conf.blob"]);
    let pbs = Pbs::start(encrypted);
    let setup = Setup::new(&pbs);
    let (code, out, err) = setup.show_json();
    assert_eq!(code, 65, "{out}{err}");
    assert!(
        err.contains("validations[0] (web01).sandbox: the backup's qemu-server.conf is encrypted"),
        "{err}"
    );
    setup.edit(
        "      - vmid: 9100\n",
        "      - vmid: 9100\n        cores: 2\n        memory_mib: 2048\n",
    );
    let (code, _, err) = setup.show_json();
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_backup_too_old_or_missing_fails_its_validation_with_a_signed_report_and_no_node() {
    let pbs = Pbs::start(settings());
    let setup = Setup::new(&pbs);
    let (code, _, err) = setup.ctl(&["ca", "init", "--state-dir", "state"]);
    assert_eq!(code, 0, "{err}");
    // The newest finished backup is 2026-12-02T02:00:00Z, more than an hour ago.
    setup.edit(
        "    snapshot: latest\n",
        "    snapshot: latest\n    max_age_hours: 1\n",
    );
    let (code, out, err) = setup.plan_check();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("web01: fails before any node is asked: the newest finished backup of VM 100 (2026-12-02T02:00:00Z) is "), "{out}");
    assert!(
        out.contains("older than max_age_hours 1: check its backup job"),
        "{out}"
    );
    let (code, out, err) = setup.show_json();
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        document["validations"][0]["fails_before_run"]["finished"],
        2
    );
    assert_eq!(document["validations"][0]["max_age_hours"]["value"], 1);

    let verifier = evidence_report::python_verifier(&setup.dir.0);
    let public = setup.dir.0.join("state/report-signing.pub");
    let mut reasons = Vec::new();
    for (case, vmid) in [("stale", "100"), ("none finished", "101")] {
        let original = std::fs::read_to_string(setup.dir.0.join("nightly.yaml")).unwrap();
        setup.edit("source_vmid: 100", &format!("source_vmid: {vmid}"));
        let (code, out, err) = setup.ctl(&["run", "nightly.yaml", "--config", "controller.toml"]);
        assert_eq!(
            code, 1,
            "{case}: a backup that cannot be proven fails the run: {out}{err}"
        );
        assert!(out.contains("FAILED"), "{case}: {out}");
        assert!(!out.contains(SECRET) && !err.contains(SECRET), "{case}");
        let reports: Vec<_> = std::fs::read_dir(setup.dir.0.join("reports"))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
            .collect();
        let report = reports.last().expect("a signed report").clone();
        let (code, out, err) = setup.ctl(&[
            "report",
            "verify",
            report.to_str().unwrap(),
            "--state-dir",
            "state",
        ]);
        assert_eq!(code, 0, "{case}: {out}{err}");
        assert!(out.contains("verdict failed"), "{case}: {out}");
        let (code, out, err) = evidence_report::python(&verifier, &report, &public, &[]);
        assert_eq!(
            code, 0,
            "{case}: the independent verifier refused it: {out}{err}"
        );
        assert!(out.starts_with("valid: failed pve1 "), "{case}: {out}");
        let key = certistack_controller::report::load_public_key(&public).unwrap();
        let statement =
            certistack_controller::report::verify(&std::fs::read(&report).unwrap(), &key).unwrap();
        let statement = serde_json::to_value(&statement).unwrap();
        let predicate = &statement["predicate"];
        assert_eq!(predicate["steps"][0]["name"], "resolve backup", "{case}");
        assert_eq!(
            predicate["journal"]["records"],
            serde_json::json!([]),
            "{case}"
        );
        assert_eq!(
            predicate["snapshot"]["latest"]["max_age_hours"], 1,
            "{case}"
        );
        if vmid == "100" {
            // The stale backup is named by its manifest's digests.
            assert_eq!(
                predicate["snapshot"]["snapshot"],
                "vm/100/2026-12-02T02:00:00Z"
            );
            assert!(
                statement["subject"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|s| s["digest"]["sha256"].is_string()),
                "{statement}"
            );
            assert!(
                predicate["snapshot"]["latest"]["age_seconds"]
                    .as_i64()
                    .unwrap()
                    > 3600
            );
        } else {
            assert_eq!(predicate["snapshot"]["snapshot"], "vm/101");
            assert_eq!(predicate["snapshot"]["latest"]["finished"], 0);
        }
        reasons.push(
            predicate["verdict"]["reasons"][0]
                .as_str()
                .unwrap()
                .to_owned(),
        );
        for path in reports {
            std::fs::remove_file(path).unwrap();
        }
        std::fs::write(setup.dir.0.join("nightly.yaml"), original).unwrap();
    }
    assert!(
        reasons[1].contains("VM 101 has no finished backup"),
        "{reasons:?}"
    );
    setup.assert_no_node_contacted();

    // max_age_hours without latest is refused.
    setup.edit("snapshot: latest", "snapshot: \"2026-12-02T02:00:00Z\"");
    let (code, _, err) = setup.show_json();
    assert_eq!(code, 65, "{err}");
    assert!(err.contains("validations[0] (web01).max_age_hours: max_age_hours checks the newest backup, so it needs snapshot: latest"), "{err}");
}

/// The example plan the controller package ships (`packaging/controller/plan.yaml`) is
/// accepted by `plan check` as written, once its server, fingerprint and namespace are this
/// PBS's: its `latest` finds the newest finished backup, and its `max_age_hours: 26` fails
/// that backup (days old here) before any node is asked, as a stopped backup job would be.
#[test]
fn the_packaged_example_plan_is_accepted_and_judges_the_backups_age() {
    let pbs = Pbs::start(settings());
    let setup = Setup::new(&pbs);
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../packaging/controller/plan.yaml"
    ))
    .unwrap();
    let mut plan = example.clone();
    for (from, to) in [
        (
            "server: pbs.example.net\n",
            "server: localhost\n".to_owned(),
        ),
        ("port: 8007\n", format!("port: {}\n", pbs.port)),
        (
            "datastore: backups\n",
            "datastore: backups\n  namespace: nightly\n".to_owned(),
        ),
        (
            "\"ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89\"",
            format!("\"{}\"", pbs.fingerprint),
        ),
        (
            "pbs_password_file: pbs-token\n",
            "pbs_password_file: secrets/pbs-token\n".to_owned(),
        ),
    ] {
        assert!(
            plan.contains(from),
            "the example plan no longer says {from:?}"
        );
        plan = plan.replacen(from, &to, 1);
    }
    std::fs::write(setup.dir.0.join("nightly.yaml"), plan).unwrap();
    let (code, out, err) = setup.plan_check();
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("web01: fails before any node is asked: the newest finished backup of VM 100 (2026-12-02T02:00:00Z) is ")
            && out.contains("older than max_age_hours 26: check its backup job"),
        "{out}"
    );
    setup.assert_no_node_contacted();
}
