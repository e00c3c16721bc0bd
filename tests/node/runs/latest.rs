//! `snapshot: latest` on a simulated node: the PBS API double lists the node's "PBS" (the tree
//! the `proxmox-backup-client` double maps), the controller resolves the newest finished backup,
//! its disk archives and the sandbox's size from it, and the validation runs end to end.

use super::*;

/// The PBS API double over a lab's "PBS", whose client double expects the same certificate.
fn pbs_api(lab: &Lab) -> ApiDouble {
    let api = ApiDouble::start(
        "pbs-api",
        &api_server_pki(&["localhost"]),
        &["--root".into(), lab.root.clone().into_os_string()],
        "--tls-dir",
    );
    lab.settings(serde_json::json!({ "pbs_fingerprint": api.fingerprint }));
    api
}

#[test]
fn a_validation_of_the_latest_backup_runs_end_to_end() {
    if !privileged(
        "a_validation_of_the_latest_backup_runs_end_to_end",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("latest", &[]);
    inside(&netns.name, || async {
        let fleet = Fleet::new("ctl-latest", 1, true);
        let lab = &fleet.nodes[0].lab;
        // An older backup of the VM, and a newer one still being written: latest is neither.
        let older = lab.add_backup("vm/100/2026-10-31T02:00:00Z", ARCHIVE, MARKER, 8 << 20);
        let newer = lab.add_backup("vm/100/2026-11-02T02:00:00Z", ARCHIVE, MARKER, 8 << 20);
        std::fs::write(newer.parent().unwrap().join(".unfinished"), "").unwrap();
        assert!(older.exists());
        let api = pbs_api(lab);
        let secret = fleet.dir.0.join("pbs-password");
        std::fs::write(&secret, format!("{PBS_PASSWORD}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        // No snapshot time, no archives, no cores or memory: all from the backup.
        let plan = fleet.dir.0.join("latest.yaml");
        std::fs::write(
            &plan,
            format!(
                "storage:\n  server: localhost\n  port: {}\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n  - name: web1\n    node: pve1\n    source_vmid: 100\n    snapshot: latest\n    max_age_hours: 8760\n    sandbox:\n      - vmid: 9101\n        max_memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: csv1\n      probe_source: 10.77.1.2/24\n    probes:\n      - kind: tcp\n        address: 10.77.1.10\n        port: 22\n        expect:\n          banner_prefix: \"SSH-2.0-CertiStack-1\"\n    network_recovery:\n      mode: preserve\n    timeouts:\n      run_seconds: 600\n      guest_agent_seconds: 60\n",
                api.port, api.fingerprint
            ),
        )
        .unwrap();
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let (code, _, summaries) = fleet.run(&plan, &config).await;
        let s = summary(&summaries, "web1");
        assert_eq!(code, 0, "{s}");
        assert_eq!(s["outcome"], "passed", "{s}");
        assert_eq!(s["cleanup"], "complete", "{s}");
        let statement = fleet.report(s);
        let snapshot = &statement.predicate.snapshot;
        assert_eq!(snapshot.snapshot, SNAPSHOT, "the newest finished backup");
        let latest = snapshot.latest.as_ref().expect("the report records latest");
        assert_eq!((latest.listed, latest.finished), (3, 2));
        assert_eq!(latest.max_age_hours, Some(8760));
        assert!(latest.age_seconds.is_some_and(|age| age > 0));
        // Every disk archive of the snapshot, named by the manifest's digest.
        let archives: Vec<&str> = snapshot.archives.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(archives, [ARCHIVE]);
        assert!(snapshot.archives[0].sha256.is_some());
        // The sandbox's size: the source's 1 core and 512 MiB, capped at the plan's 256 MiB.
        let creates: Vec<Vec<String>> = lab
            .calls()
            .iter()
            .filter(|call| call["tool"] == "qm" && call["argv"][0] == "create")
            .map(|call| serde_json::from_value(call["argv"].clone()).unwrap())
            .collect();
        let option = |argv: &[String], name: &str| {
            argv.iter()
                .position(|arg| arg == name)
                .and_then(|at| argv.get(at + 1).cloned())
        };
        assert_eq!(creates.len(), 1, "{creates:?}");
        assert_eq!(
            option(&creates[0], "--memory").as_deref(),
            Some("256"),
            "{creates:?}"
        );
        assert_eq!(
            option(&creates[0], "--cores").as_deref(),
            Some("1"),
            "{creates:?}"
        );
        assert!(
            lab.calls().iter().any(|call| call["tool"] == "pbs-api"),
            "the API double was not asked"
        );
        let outputs = fleet.outputs.lock().unwrap().clone();
        assert!(
            !outputs.contains(PBS_PASSWORD),
            "the PBS secret was printed"
        );
    });
}
