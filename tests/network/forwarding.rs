//! Forwarding on the VNet: refused, or turned off for the run and restored, also after a crash.

use super::*;

/// The VNet's forwarding sysctls in the node namespace: (IPv4, IPv6).
fn vnet_forwarding(topology: &Topology) -> (String, String) {
    let read = |name: &str| {
        String::from_utf8(topology.node_sh(&["sysctl", "-n", name]).stdout)
            .unwrap()
            .trim()
            .to_owned()
    };
    (
        read("net.ipv4.conf.csbox1.forwarding"),
        read("net.ipv6.conf.csbox1.forwarding"),
    )
}

fn forwarding_on(topology: &Topology) {
    topology.node_sh(&[
        "sysctl",
        "-w",
        "net.ipv4.conf.csbox1.forwarding=1",
        "net.ipv6.conf.csbox1.forwarding=1",
    ]);
}

fn disable_for_run(config: &mut certistack_connector::config::Config) {
    config.sandbox.forwarding = certistack_connector::config::ForwardingPolicy::DisableForRun;
}

const FORWARDING_SET_FOR_RUN: &str = "net.ipv4.conf.csbox1.forwarding = 0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\", restored when the sandbox is released)\nnet.ipv6.conf.csbox1.forwarding = 0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\", restored when the sandbox is released)";

#[test]
fn forwarding_on_the_vnet_is_refused_or_turned_off_for_the_run() {
    if !privileged(
        "forwarding_on_the_vnet_is_refused_or_turned_off_for_the_run",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("fwd"), |topology| async move {
        // ifupdown2 leaves a bare VNet stanza forwarding.
        forwarding_on(&topology);

        // The default policy refuses the VNet and changes nothing.
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_refused_with_nothing_installed(
            &status,
            &topology,
            &[
                "IPv4 forwarding is on for csbox1",
                "IPv6 forwarding is on for csbox1",
                "or set sandbox.forwarding = \"disable-for-run\"",
            ],
        );
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;

        // "disable-for-run": 0 while the run holds the sandbox, the old value after release.
        let node = Node::start_with(disable_for_run).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.forwarding_sysctl, FORWARDING_SET_FOR_RUN);
        assert_eq!(vnet_forwarding(&topology), ("0".into(), "0".into()));
        let steps = journal_steps(&mut c, RUN_ID).await;
        for step in [
            "sandbox.forwarding fwd:csbox1 intent",
            "sandbox.forwarding fwd:csbox1 done",
        ] {
            assert!(steps.contains(&step.to_owned()), "{step} not in {steps:?}");
        }
        // A guest booting now is checked against the 0 the run set.
        c.release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await
            .unwrap();
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        let steps = journal_steps(&mut c, RUN_ID).await;
        assert!(
            steps.contains(&"sandbox.forwarding.restore fwd:csbox1 undone".to_owned()),
            "{steps:?}"
        );
        // Restored once: Cleanup finds nothing of the run's left to put back.
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(receipts.is_empty(), "{receipts:?}");
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;

        // A value someone else changed after the run set 0 is theirs: Cleanup leaves it.
        let node = Node::start_with(disable_for_run).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        c.prepare_sandbox(prepare()).await.unwrap();
        topology.node_sh(&["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=1"]);
        topology.node_sh(&["sysctl", "-w", "net.ipv6.conf.csbox1.forwarding=1"]);
        topology.node_sh(&["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=0"]);
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert_eq!(receipts[0], "fwd:csbox1 restored", "{receipts:?}");
        assert!(residue.is_empty(), "{residue:?}");
        // IPv4 was still the run's 0 and went back to 1; IPv6 was already 1 again.
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        node.stop().await;
    });
}

#[test]
fn crash_after_prepare_sandbox_restores_forwarding_after_recovery() {
    if !privileged(
        "crash_after_prepare_sandbox_restores_forwarding_after_recovery",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("fwdcrash"), |topology| async move {
        forwarding_on(&topology);
        let lab = Lab::new("netfwdcrash");
        let (_authority_dir, authority, mut config) =
            lab.controller_and_node_config("netfwdcrash-ctl");
        disable_for_run(&mut config);
        let port = free_local_port();
        let config_path = lab.root.join("node/connector.toml");
        write_config_file(&config_path, &config, port);
        let address = format!("127.0.0.1:{port}");
        let spawn = || {
            Command::new(binary("certistack-connector"))
                .args(["--config", config_path.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut wire = grant(RUN_ID, NODE);
        wire.probe_targets = targets(true);
        let credentials = mint(&authority, &wire);
        let operator = authority.issue_operator("recovery", now()).unwrap();

        let mut daemon = spawn();
        let mut c = client_when_up(&authority, &address, &credentials.certificate).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.forwarding_sysctl, FORWARDING_SET_FOR_RUN);
        daemon.kill().unwrap(); // SIGKILL
        daemon.wait().unwrap();
        assert_eq!(vnet_forwarding(&topology), ("0".into(), "0".into()));

        let mut daemon = spawn();
        let mut op = client_when_up(&authority, &address, &operator).await;
        let runs = op
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert!(
            runs[0]
                .open_resources
                .iter()
                .any(|r| r.contains("fwd:csbox1")),
            "{:?}",
            runs[0].open_resources
        );
        let (receipts, residue) = cleanup_receipts(&mut op, RUN_ID).await;
        assert_eq!(
            receipts,
            [
                "fwd:csbox1 restored",
                "addr:csbox1 deleted",
                "nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted"
            ]
        );
        assert!(residue.is_empty(), "{residue:?}");
        assert_eq!(vnet_forwarding(&topology), ("1".into(), "1".into()));
        // Idempotent: a second Cleanup restores nothing again.
        let (receipts, _) = cleanup_receipts(&mut op, RUN_ID).await;
        assert!(receipts.is_empty(), "{receipts:?}");
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    });
}
