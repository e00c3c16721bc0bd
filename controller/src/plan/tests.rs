//! Plans accepted and refused, with the line and the key to change.

use super::*;

pub(crate) const PLAN: &str = r#"storage:
  server: pbs.example.net
  datastore: backups
  namespace: nightly
  auth_id: certistack@pbs!restore
  fingerprint: "ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89:ab:cd:ef:01:23:45:67:89"
  pbs_password_file: secrets/pbs-token
validations:
  - name: web01
    node: pve1
    source_vmid: 100
    snapshot: "2026-11-01T02:00:00Z"
    archives: [drive-scsi0.img]
    sandbox:
      - vmid: 9100
        cores: 2
        memory_mib: 2048
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    probes:
      - kind: tcp
        address: 10.99.0.10
        port: 22
        expect:
          banner_prefix: "SSH-2.0-"
    assertions:
      - id: nginx-active
        program: /usr/bin/systemctl
        args: [is-active, nginx]
        stdout_contains: active
        timeout_seconds: 30
  - name: db01
    node: pve1
    source_vmid: 101
    snapshot: "2026-11-01T02:10:00Z"
    archives: [drive-scsi0.img, drive-scsi1.img]
    sandbox:
      - vmid: 9101
        cores: 4
        memory_mib: 8192
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    network_recovery:
      mode: preserve
"#;

pub(super) fn config() -> ControllerConfig {
    ControllerConfig::parse(
        Path::new("controller.toml"),
        "state_dir = \"/s\"\nreports_dir = \"/r\"\n[[nodes]]\nname = \"pve1\"\naddress = \"192.0.2.11\"\nport = 7443\n",
    )
    .unwrap()
}

fn check(text: &str) -> Result<Plan, PlanError> {
    Plan::parse(
        Path::new("/plans/nightly.yaml"),
        text,
        &config(),
        1_800_000_000,
    )
}

fn refusal(text: &str) -> String {
    check(text).unwrap_err().to_string()
}

#[test]
fn a_good_plan_maps_onto_grants_the_node_accepts() {
    let plan = check(PLAN).unwrap();
    assert_eq!(
        plan.pbs_password_file,
        Path::new("/plans/secrets/pbs-token")
    );
    assert_eq!(plan.validations.len(), 2);
    let web = &plan.validations[0];
    assert_eq!(web.wire.snapshot, "vm/100/2026-11-01T02:00:00Z");
    assert_eq!(web.wire.repository.as_ref().unwrap().port, 8007);
    assert_eq!(
        web.wire.deadline_unix - web.wire.not_before_unix,
        3600 + NOT_BEFORE_SLACK_SECS
    );
    assert_eq!(web.grant.sandbox_vms.len(), 1);
    assert_eq!(web.endpoint, "192.0.2.11:7443");
    let line = describe(web);
    assert!(line.starts_with("web01: node pve1 (192.0.2.11:7443) source VM 100 snapshot vm/100/2026-11-01T02:00:00Z archives drive-scsi0.img sandbox 9100 (2 cores, 2048 MiB) vnet csnet1 (preprovisioned) probe source 10.99.0.1/24 probes tcp 10.99.0.10:22 assertions nginx-active"), "{line}");
    assert!(describe(&plan.validations[1]).contains("probes none assertions none"));
}

#[test]
fn syntax_errors_and_unknown_keys_carry_line_and_column() {
    let error = refusal(&PLAN.replace("    source_vmid: 101", "    source_vmdi: 101"));
    assert!(error.starts_with("/plans/nightly.yaml:36:5: "), "{error}");
    assert!(
        !error.contains("line 36"),
        "the position is printed once: {error}"
    );
    assert!(error.contains("source_vmdi"), "{error}");
    let error = refusal(&PLAN.replace("  datastore: backups", "  datastore: [backups"));
    assert!(error.starts_with("/plans/nightly.yaml:"), "{error}");
    assert!(!error.starts_with("/plans/nightly.yaml:?"), "{error}");
    let error = refusal(&PLAN.replace(
        "    source_vmid: 101",
        "    source_vmid: 101\n    source_vmid: 102",
    ));
    assert!(error.starts_with("/plans/nightly.yaml:37:"), "{error}");
    assert!(error.contains("source_vmid"), "{error}");
}

#[test]
fn an_inline_secret_is_refused_where_it_is_written() {
    let error = refusal(&PLAN.replace(
        "  pbs_password_file: secrets/pbs-token",
        "  pbs_password_file: secrets/pbs-token\n  pbs_password: hunter2",
    ));
    assert!(error.starts_with("/plans/nightly.yaml:8:"), "{error}");
    assert!(error.contains("secrets go in files"), "{error}");
    assert!(error.contains(SECRETS_DOC), "{error}");
    assert!(!error.contains("hunter2"), "{error}");
}

/// A catalog that lists what it was given, for resolution's rules (the PBS API double and
/// its client are tested in tests/foundation).
struct Listed(Vec<latest::CatalogSnapshot>);

impl BackupCatalog for Listed {
    fn vm_snapshots(
        &self,
        _storage: &ResolvedStorage,
        _vmid: Vmid,
    ) -> Result<Vec<latest::CatalogSnapshot>, latest::CatalogError> {
        Ok(self.0.clone())
    }

    fn blob(
        &self,
        _storage: &ResolvedStorage,
        _vmid: Vmid,
        _backup_time: i64,
        name: &str,
    ) -> Result<Vec<u8>, latest::CatalogError> {
        assert_eq!(name, "qemu-server.conf.blob");
        Ok(b"cores: 4\nsockets: 2\nmemory: 16384\nscsi0: local:100/vm-100-disk-0.raw\n".to_vec())
    }
}

/// A finished (or, without a size, unfinished) snapshot with a system disk, an EFI vars disk
/// and the config.
fn snapshot(backup_time: i64, size: Option<u64>) -> latest::CatalogSnapshot {
    let file = |name: &str, size: u64| latest::CatalogFile {
        name: name.into(),
        size: Some(size),
        crypt_mode: Some("none".into()),
    };
    latest::CatalogSnapshot {
        backup_time,
        size,
        files: vec![
            file("drive-scsi0.img.fidx", 4 << 20),
            file("drive-efidisk0.img.fidx", 528 << 10),
            file("qemu-server.conf.blob", 300),
            file("index.json.blob", 600),
        ],
    }
}

#[test]
fn latest_is_the_newest_finished_snapshot_and_says_it_came_from_pbs() {
    let text = PLAN.replace("\"2026-11-01T02:00:00Z\"", "latest");
    // Without a catalog (Plan::parse): refused where it is written, saying what reads it.
    let error = refusal(&text);
    assert!(
        error.contains("validations[0] (web01).snapshot: listing the VM's backups:"),
        "{error}"
    );
    assert!(
        error.contains("plan check or plan show without --offline, or run"),
        "{error}"
    );
    // 2026-11-30T02:00:00Z finished; a newer one still being written is skipped.
    let catalog = Listed(vec![
        snapshot(1_796_004_000, Some(10)),
        snapshot(1_796_090_400, None),
        snapshot(1_795_917_600, Some(9)),
    ]);
    let now = 1_796_011_200;
    let plan = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &text,
        &config(),
        now,
        &catalog,
    )
    .unwrap();
    let web = &plan.validations[0];
    assert_eq!(web.wire.snapshot, "vm/100/2026-11-30T02:00:00Z");
    assert_eq!(web.resolved.snapshot.source, Origin::Pbs);
    assert_eq!(
        web.resolved.latest,
        Some(latest::LatestFound {
            listed: 3,
            finished: 2,
            age_seconds: 7200,
            size_bytes: 10
        })
    );
    // An exact time is the plan's, with nothing looked up.
    assert_eq!(plan.validations[1].resolved.snapshot.source, Origin::Plan);
    assert_eq!(plan.validations[1].resolved.latest, None);
    // No finished backup: the validation fails before any node is asked (the plan is fine;
    // the backup job is not), saying how many were listed; the others still run.
    let none = Listed(vec![snapshot(1_796_090_400, None)]);
    let plan = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &text,
        &config(),
        now,
        &none,
    )
    .unwrap();
    assert_eq!(plan.validations.len(), 1);
    assert_eq!(plan.validations[0].index, 1);
    let failed = &plan.failed_before_run[0];
    assert_eq!(
        (failed.index, failed.why.listed, failed.why.finished),
        (0, 1, 0)
    );
    assert!(
        failed.why.reason.contains("VM 100 has no finished backup in datastore backups, namespace nightly (1 snapshot(s) listed, none finished)"),
        "{}",
        failed.why.reason
    );
    assert_eq!(
        plan.resolved_in_order()
            .iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>(),
        ["web01", "db01"]
    );
}

#[test]
fn archives_cores_and_memory_left_out_come_from_the_backup_capped() {
    let catalog = Listed(vec![snapshot(1_796_004_000, Some(10))]);
    let text = PLAN
        .replacen("\"2026-11-01T02:00:00Z\"", "\"2026-11-30T02:00:00Z\"", 1)
        .replacen("    archives: [drive-scsi0.img]\n", "", 1)
        .replacen(
            "        cores: 2\n        memory_mib: 2048\n",
            "        max_memory_mib: 12288\n",
            1,
        );
    let plan = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &text,
        &config(),
        1_796_011_200,
        &catalog,
    )
    .unwrap();
    let web = &plan.validations[0];
    // Every disk archive, the EFI vars disk included, in name order.
    assert_eq!(
        web.resolved.archives.value,
        ["drive-efidisk0.img", "drive-scsi0.img"]
    );
    assert_eq!(web.resolved.archives.source, Origin::Pbs);
    assert_eq!(web.wire.archives, ["drive-efidisk0.img", "drive-scsi0.img"]);
    // 4 cores × 2 sockets capped at the default 4; 16384 MiB capped at the plan's 12288.
    let vm = &web.resolved.sandbox[0];
    assert_eq!((vm.cores.value, vm.cores.source), (4, Origin::Pbs));
    assert_eq!(
        (vm.memory_mib.value, vm.memory_mib.source),
        (12288, Origin::Pbs)
    );
    assert!(
        vm.cores
            .key
            .contains("cores 4 × sockets 2, at most max_cores 4"),
        "{}",
        vm.cores.key
    );
    assert_eq!(
        (
            web.wire.sandbox_vms[0].max_cores,
            web.wire.sandbox_vms[0].max_memory_mib
        ),
        (4, 12288)
    );
    // The snapshot named must exist, and be finished.
    let unknown = text.replacen("\"2026-11-30T02:00:00Z\"", "\"2026-11-29T02:00:00Z\"", 1);
    let error = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &unknown,
        &config(),
        1_796_011_200,
        &catalog,
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("VM 100 has no snapshot 2026-11-29T02:00:00Z"),
        "{error}"
    );
    // Encrypted disks and no key in the plan: refused before any node would fail to map them.
    let mut encrypted_disks = snapshot(1_796_004_000, Some(10));
    encrypted_disks.files[0].crypt_mode = Some("encrypt".into());
    let error = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &text,
        &config(),
        1_796_011_200,
        &Listed(vec![encrypted_disks]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("drive-scsi0.img of the snapshot is encrypted and the plan names no key: write storage.encryption_key_file"),
        "{error}"
    );
    // An encrypted config: the sizes must be written.
    let mut encrypted = snapshot(1_796_004_000, Some(10));
    for file in &mut encrypted.files {
        if file.name == "qemu-server.conf.blob" {
            file.crypt_mode = Some("encrypt".into());
        }
    }
    let error = Plan::parse_with(
        Path::new("/plans/nightly.yaml"),
        &text,
        &config(),
        1_796_011_200,
        &Listed(vec![encrypted]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("qemu-server.conf is encrypted")
            && error.contains("write cores and memory_mib"),
        "{error}"
    );
}

#[test]
fn vmids_out_of_range_are_refused() {
    let error = refusal(&PLAN.replace("vmid: 9100", "vmid: 99"));
    assert!(error.starts_with("/plans/nightly.yaml:15:"), "{error}");
    assert!(
        error.contains("VMID 99 is outside 100..=999999999"),
        "{error}"
    );
    let error = refusal(&PLAN.replace("source_vmid: 100", "source_vmid: 1000000000"));
    assert!(error.contains("VMID 1000000000 is outside"), "{error}");
}

#[test]
fn the_same_sandbox_vmid_twice_on_one_node_is_refused() {
    let error = refusal(&PLAN.replace("vmid: 9101", "vmid: 9100"));
    assert!(error.contains("validations[1] (db01).sandbox"), "{error}");
    assert!(
        error.contains("sandbox VMID 9100 is also used by validation web01 on node pve1"),
        "{error}"
    );
}

#[test]
fn a_sandbox_vmid_is_unique_across_the_plan_not_only_per_node() {
    // PVE's VMIDs are cluster-wide: the same VMID on two nodes is refused, naming both.
    let mut two_nodes = config();
    let pve2 = ControllerConfig::parse(
        Path::new("controller.toml"),
        "state_dir = \"/s\"\nreports_dir = \"/r\"\n[[nodes]]\nname = \"pve2\"\naddress = \"192.0.2.12\"\nport = 7443\n",
    )
    .unwrap();
    two_nodes.nodes.extend(pve2.nodes);
    let check = |text: &str| {
        Plan::parse(
            Path::new("/plans/nightly.yaml"),
            text,
            &two_nodes,
            1_800_000_000,
        )
    };
    let refusal = |text: &str| check(text).unwrap_err().to_string();
    let other_node = PLAN.replacen(
        "    node: pve1\n    source_vmid: 101",
        "    node: pve2\n    source_vmid: 101",
        1,
    );
    assert!(check(&other_node).is_ok());
    let error = refusal(&other_node.replace("vmid: 9101", "vmid: 9100"));
    assert!(error.contains("validations[1] (db01).sandbox"), "{error}");
    assert!(
        error.contains("sandbox VMID 9100 is also used by validation web01 on node pve1"),
        "{error}"
    );
    assert!(
        error.contains("unique across a Proxmox VE cluster"),
        "{error}"
    );
    // Twice in one validation.
    let error = refusal(&PLAN.replace(
        "      - vmid: 9101\n        cores: 4\n        memory_mib: 8192\n",
        "      - vmid: 9101\n        cores: 4\n        memory_mib: 8192\n      - vmid: 9101\n        cores: 1\n        memory_mib: 512\n",
    ));
    assert!(
        error.contains(
            "validations[1] (db01).sandbox: sandbox VMID 9101 is written twice in this validation"
        ),
        "{error}"
    );
}

#[test]
fn a_sandbox_vm_may_not_take_the_vmid_of_a_source_vm_of_the_plan() {
    let error = refusal(&PLAN.replace("vmid: 9101", "vmid: 100"));
    assert!(error.contains("validations[1] (db01).sandbox"), "{error}");
    assert!(
        error.contains("sandbox VMID 100 is the source VM of validation web01"),
        "{error}"
    );
    let error = refusal(&PLAN.replace("vmid: 9101", "vmid: 101"));
    assert!(
        error.contains("sandbox VMID 101 is the source VM of validation db01"),
        "{error}"
    );
}

#[test]
fn rewrite_is_the_default_and_preserve_the_explicit_opt_out() {
    let plan = check(PLAN).unwrap();
    let web = &plan.validations[0];
    assert_eq!(web.network_recovery, NetworkRecoveryMode::Rewrite);
    assert_eq!(
        web.wire.network_recovery_modes,
        [pb::NetworkRecoveryMode::Rewrite as i32],
        "a validation without network_recovery rewrites"
    );
    // The one address the probes target, with the probe network's prefix.
    assert_eq!(web.wire.guest_address, "10.99.0.10/24");
    assert_eq!(
        plan.validations[1].wire.network_recovery_modes,
        [pb::NetworkRecoveryMode::Preserve as i32],
        "preserve, written, is the opt-out"
    );
    assert!(plan.validations[1].wire.guest_address.is_empty());

    // Without probes there is no address to take: the error names the field, says the
    // mode came by default, and what to write instead.
    let preserve = "    network_recovery:\n      mode: preserve\n";
    let error = refusal(&PLAN.replace(preserve, ""));
    for part in [
        "validations[1] (db01).network_recovery.guest_address",
        "network_recovery.mode is rewrite (the default)",
        "they target 0",
        "`network_recovery: {guest_address: <address>/<prefix>}`",
        "inside network.probe_source 10.99.0.1/24",
        "`network_recovery: {mode: preserve}`",
    ] {
        assert!(error.contains(part), "{part}: {error}");
    }
    let error = refusal(&PLAN.replace("mode: preserve", "mode: rewrite"));
    assert!(
        error.contains("network_recovery.mode is rewrite and needs"),
        "{error}"
    );
    let named = check(&PLAN.replace(
        "mode: preserve\n",
        "mode: rewrite\n      guest_address: 10.99.0.20/24\n",
    ))
    .unwrap();
    assert_eq!(named.validations[1].wire.guest_address, "10.99.0.20/24");
    let defaulted =
        check(&PLAN.replace("mode: preserve\n", "guest_address: 10.99.0.20/24\n")).unwrap();
    assert_eq!(
        defaulted.validations[1].network_recovery,
        NetworkRecoveryMode::Rewrite
    );
    // The node's rule, in the plan's words: inside the probe network.
    let error = refusal(&PLAN.replace(
        "mode: preserve\n",
        "mode: rewrite\n      guest_address: 10.98.0.20/24\n",
    ));
    assert!(error.contains("not in the probe network"), "{error}");
}

#[test]
fn a_probe_target_outside_the_probe_network_is_refused() {
    let error = refusal(&PLAN.replace("address: 10.99.0.10", "address: 10.98.0.10"));
    assert!(error.contains("validations[0] (web01)"), "{error}");
    assert!(
        error.contains("outside the probe network 10.99.0.1/24"),
        "{error}"
    );
}

#[test]
fn a_node_not_in_the_inventory_is_refused() {
    let error = refusal(&PLAN.replace(
        "node: pve1\n    source_vmid: 101",
        "node: pve9\n    source_vmid: 101",
    ));
    assert!(error.contains("validations[1] (db01).node"), "{error}");
    assert!(
        error.contains("\"pve9\" is not in the controller's inventory (pve1)"),
        "{error}"
    );
}

#[test]
fn an_ephemeral_network_is_not_yet_supported() {
    let error = refusal(&PLAN.replacen("lifecycle: preprovisioned", "lifecycle: ephemeral", 1));
    assert!(
        error.starts_with("/plans/nightly.yaml:19:18: `ephemeral`"),
        "{error}"
    );
    assert!(
        error.contains("not yet supported, use preprovisioned"),
        "{error}"
    );
}

#[test]
fn what_the_node_validates_is_refused_in_the_plan_words() {
    let error = refusal(&PLAN.replace("vnet: csnet1", "vnet: \"cs net\""));
    assert!(error.contains("network.vnet:"), "{error}");
    assert!(error.contains("a node would refuse this grant"), "{error}");
    let error = refusal(&PLAN.replace("cores: 2", "cores: 65"));
    assert!(error.contains("max_cores must be 1..=64"), "{error}");
    let error = refusal(&PLAN.replace("run_seconds", "x").replace(
        "  - name: db01",
        "    timeouts:\n      run_seconds: 90000\n  - name: db01",
    ));
    assert!(error.contains("timeouts.run_seconds"), "{error}");
}

#[test]
fn every_resolved_value_says_where_it_came_from() {
    let plan = check(PLAN).unwrap();
    let storage = &plan.storage;
    assert_eq!(
        (storage.port.value, storage.port.source),
        (DEFAULT_PBS_PORT, Origin::Default),
        "port is not written in PLAN"
    );
    assert_eq!(storage.port.key, "storage.port");
    assert_eq!(
        (storage.namespace.value.as_str(), storage.namespace.source),
        ("nightly", Origin::Plan)
    );
    let web = &plan.validations[0].resolved;
    assert_eq!(web.key, "validations[0]");
    assert_eq!(
        (web.node.source, web.node.key.as_str()),
        (Origin::Plan, "validations[0].node")
    );
    assert_eq!(
        (web.endpoint.value.as_str(), web.endpoint.source),
        ("192.0.2.11:7443", Origin::Configuration)
    );
    assert_eq!(web.sandbox[0].vmid.key, "validations[0].sandbox[0].vmid");
    assert_eq!(
        web.probes[0].address.key,
        "validations[0].probes[0].address"
    );
    assert_eq!(
        web.probes[0].expect.banner_prefix.source,
        Origin::Plan,
        "written in PLAN"
    );
    assert_eq!(
        (
            web.probes[0].expect.http_status.value,
            web.probes[0].expect.http_status.source
        ),
        (0, Origin::Default)
    );
    assert_eq!(
        web.assertions[0].program.key,
        "validations[0].assertions[0].program"
    );
    assert_eq!(
        (
            web.assertions[0].exit_code.value,
            web.assertions[0].exit_code.source
        ),
        (0, Origin::Default),
        "exit_code is not written in PLAN"
    );
    assert_eq!(web.assertions[0].args.source, Origin::Plan);
    assert_eq!(plan.storage.encryption_key_file.source, Origin::Default);
    assert_eq!(
        (
            web.timeouts.run_seconds.value,
            web.timeouts.run_seconds.source
        ),
        (DEFAULT_RUN_SECONDS, Origin::Default)
    );
    // Rewrite by default, its address worked out from the probes and the probe network.
    assert_eq!(web.network_recovery.mode.source, Origin::Default);
    assert_eq!(
        (
            web.network_recovery.guest_address.value.as_str(),
            web.network_recovery.guest_address.source
        ),
        ("10.99.0.10/24", Origin::Derived)
    );
    let db = &plan.validations[1].resolved;
    assert_eq!(
        (
            db.network_recovery.mode.value,
            db.network_recovery.mode.source
        ),
        (NetworkRecoveryMode::Preserve, Origin::Plan)
    );
    // A written timeout is the plan's, and is what the grant carries.
    let written = check(&PLAN.replace(
        "    network_recovery:\n      mode: preserve\n",
        "    network_recovery:\n      mode: preserve\n    timeouts:\n      run_seconds: 1800\n",
    ))
    .unwrap();
    let db = &written.validations[1];
    assert_eq!(
        (
            db.resolved.timeouts.run_seconds.value,
            db.resolved.timeouts.run_seconds.source
        ),
        (1800, Origin::Plan)
    );
    assert_eq!(
        db.wire.deadline_unix - db.wire.not_before_unix,
        1800 + NOT_BEFORE_SLACK_SECS
    );
}
