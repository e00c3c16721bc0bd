//! `NodeChecks` and `certistack-ctl doctor`: a node's prerequisites judged, and the call refused
//! to a run.

use super::*;

/// `certistack-ctl doctor` against a node whose NodeChecks reads a dpkg status fixture, the
/// proxmox-backup-client double (4.x), this machine's real qemu-img and ip, a missing nft and
/// an overlay root on the same filesystem as its cluster directory; plus a node that is down.
#[tokio::test(flavor = "multi_thread")]
async fn doctor_judges_what_node_checks_reports_and_exits_by_the_worst() {
    use certistack_controller::doctor::{self, Level};
    let dir = TempDir::new("doctor");
    let authority = controller(&dir.0);
    let lab = Lab::new("doctor-lab");
    let node_dir = dir.0.join("pve1");
    let mut config = enroll(&authority, &node_dir, NODE);
    let dpkg = node_dir.join("dpkg-status");
    std::fs::write(
        &dpkg,
        "Package: pve-manager\nStatus: install ok installed\nVersion: 9.0.6\n\n\
         Package: qemu-server\nStatus: install ok installed\nVersion: 9.0.18\n",
    )
    .unwrap();
    config.pve.dpkg_status = dpkg;
    config.pve.pve_cluster_dir = node_dir.join("pve-cluster");
    std::fs::create_dir_all(&config.pve.pve_cluster_dir).unwrap();
    std::fs::create_dir_all(&config.paths.overlay_root).unwrap();
    config.tools.proxmox_backup_client = lab.root.join("bin/proxmox-backup-client");
    config.tools.nft = node_dir.join("no-nft-here");
    let node = TestNode::serve(
        node_dir.clone(),
        config,
        std::sync::Arc::new(RecordingExecutor::default()),
        std::sync::Arc::new(certistack_connector::clock::SystemClock),
    )
    .await;
    let down = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let inventory = inventory(&dir.0, &[(NODE, &node.address), ("pve3", &down)]);
    let identity = authority.issue_operator("doctor", now()).unwrap();

    // The library call `run` makes before a validation on a node.
    let checks = doctor::check_node(
        inventory.nodes.values().next().unwrap(),
        authority.ca_pem(),
        &identity,
        None,
        None,
        std::time::Duration::from_secs(20),
    )
    .await;
    let level = |name: &str| {
        checks
            .iter()
            .find(|c| c.check == name)
            .unwrap_or_else(|| panic!("{name} missing from {checks:#?}"))
    };
    assert_eq!(level("connect").level, Level::Ok);
    assert_eq!(level("surface").level, Level::Ok);
    assert_eq!(level("pve").level, Level::Ok, "{checks:#?}");
    assert_eq!(level("pve").detail, "Proxmox VE 9.0.6");
    assert_eq!(level("qemu-server").detail, "qemu-server 9.0.18");
    assert_eq!(level("pbs-client").level, Level::Ok, "{checks:#?}");
    assert_eq!(level("pbs-client").detail, "proxmox-backup-client 4.0.14");
    // This machine's qemu-img, run by the connector: judged by its real version.
    let real = std::process::Command::new("/usr/bin/qemu-img")
        .arg("--version")
        .output()
        .unwrap();
    let real = String::from_utf8_lossy(&real.stdout);
    let real = real.split_whitespace().nth(2).unwrap();
    let (major, _) = doctor::major_minor(real).unwrap();
    assert!(
        level("qemu-img")
            .detail
            .starts_with(&format!("qemu-img {real}"))
    );
    assert_eq!(
        level("qemu-img").level,
        if major >= 8 { Level::Ok } else { Level::Warn },
        "{checks:#?}"
    );
    assert_eq!(level("ip").level, Level::Ok, "{checks:#?}");
    assert_eq!(level("nft").level, Level::Fail);
    assert!(
        level("nft").detail.contains("no-nft-here") && level("nft").detail.contains("nftables"),
        "{checks:#?}"
    );
    assert_eq!(level("overlay-disk").level, Level::Warn, "{checks:#?}");
    assert!(matches!(
        level("overlay-space").level,
        Level::Ok | Level::Warn
    ));
    assert_eq!(level("clock").level, Level::Ok);
    assert!(!doctor::passes(&checks));
    // The double answered `version` with a cleared environment: no repository, no secret.
    let call = lab
        .calls()
        .into_iter()
        .find(|c| c["command"] == "version")
        .unwrap();
    assert_eq!(call["argv"], serde_json::json!(["version"]));

    // The CLI: one line per check, exit 1 on a failure, 2 with a node down.
    let config_path = dir.0.join("controller.toml");
    let (host, port) = node.address.rsplit_once(':').unwrap();
    let (down_host, down_port) = down.rsplit_once(':').unwrap();
    std::fs::write(
        &config_path,
        format!(
            "state_dir = {:?}\nreports_dir = {:?}\n[[nodes]]\nname = \"{NODE}\"\naddress = {host:?}\nport = {port}\n[[nodes]]\nname = \"pve3\"\naddress = {down_host:?}\nport = {down_port}\n",
            dir.0.join("ctl"),
            dir.0.join("reports")
        ),
    )
    .unwrap();
    let c = config_path.to_str().unwrap().to_owned();
    let ctl = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_binary("certistack-ctl", &args)
        })
    };
    let (code, out, err) = ctl(vec![
        "doctor".into(),
        NODE.into(),
        "--config".into(),
        c.clone(),
    ])
    .await
    .unwrap();
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("pve1 nft fail ") && l.contains("install nftables")),
        "{out}"
    );
    assert!(
        out.lines().any(|l| l == "pve1 pve ok Proxmox VE 9.0.6"),
        "{out}"
    );
    assert!(out.lines().all(|l| l.starts_with("pve1 ")), "{out}");
    // Without a VNet the forwarding check says how to ask for one; the dpkg fixture lists no
    // pve-qemu-kvm, which is a warning.
    assert!(
        out.lines()
            .any(|l| l.starts_with("pve1 vnet-forwarding ok not checked: no VNet named")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("pve1 qemu warn ") && l.contains("pve-qemu-kvm")),
        "{out}"
    );
    // A VNet name is validated on both sides: the CLI refuses it as a usage error, the node
    // as an invalid argument naming the field.
    let (code, out, err) = ctl(vec![
        "doctor".into(),
        NODE.into(),
        "--vnet".into(),
        "../eth0".into(),
        "--config".into(),
        c.clone(),
    ])
    .await
    .unwrap();
    assert_eq!(code, 64, "{out}{err}");
    assert!(err.contains("--vnet \"../eth0\""), "{err}");
    let mut operator_client = client(&authority, &node.address, NODE, &identity)
        .await
        .unwrap();
    assert_status(
        operator_client
            .node_checks(pb::NodeChecksRequest {
                vnet: "../eth0".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "NodeChecksRequest.vnet",
    );
    let (code, out, err) = ctl(vec!["doctor".into(), "--json".into(), "--config".into(), c])
        .await
        .unwrap();
    assert_eq!(code, 2, "{out}{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["node"] == "pve3" && l["check"] == "connect" && l["level"] == "fail"),
        "{out}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["node"] == "pve1" && l["check"] == "pbs-client" && l["level"] == "ok"),
        "{out}"
    );
}

/// NodeChecks is an operator call: a run certificate is refused before anything is read, with or
/// without a VNet to check.
#[tokio::test]
async fn node_checks_is_refused_to_a_run_identity() {
    let (_dir, authority, node) = started_node("node-checks-run").await;
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut client = run_client(&authority, &node, &credentials).await;
    assert_status(
        client.node_checks(pb::NodeChecksRequest::default()).await,
        Code::PermissionDenied,
        "may not call NodeChecks",
    );
    assert_status(
        client
            .node_checks(pb::NodeChecksRequest {
                vnet: VNET.into(),
                ..Default::default()
            })
            .await,
        Code::PermissionDenied,
        "may not call NodeChecks",
    );
}
