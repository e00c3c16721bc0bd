//! The fleet audit: drift and unreachable nodes, as a table or JSON, and its exit codes.

use super::*;

#[tokio::test]
async fn nodes_audit_reports_drift_and_unreachable_nodes_and_exits_2() {
    use certistack_controller::audit;
    let dir = TempDir::new("audit");
    let authority = controller(&dir.0);
    let healthy = TestNode::start(&authority, &dir.0.join("pve2"), "pve2").await;
    let drifted = serve_drifted(&authority, &dir.0.join("pve1"), NODE).await;
    // A port nobody listens on: bound, read, released.
    let down = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let config = inventory(
        &dir.0,
        &[
            (NODE, &drifted),
            ("pve2", &healthy.address),
            ("pve3", &down),
        ],
    );
    let identity = std::sync::Arc::new(authority.issue_operator("auditor", now()).unwrap());
    let timeout = std::time::Duration::from_secs(10);
    let rows = audit::audit_fleet(
        config.nodes.values(),
        authority.ca_pem(),
        identity.clone(),
        2,
        timeout,
    )
    .await;

    let status: Vec<(&str, &str)> = rows.iter().map(|r| (r.node.as_str(), r.status())).collect();
    assert_eq!(
        status,
        [(NODE, "DRIFT"), ("pve2", "ok"), ("pve3", "UNREACHABLE")],
        "{rows:#?}"
    );
    let drift = rows[0].answer.as_ref().unwrap();
    assert!(!drift.surface_matches);
    assert_eq!(drift.surface_digest, format!("sha256:{}", "0".repeat(64)));
    let ok = rows[1].answer.as_ref().unwrap();
    assert_eq!(ok.surface_digest, certistack_proto::SURFACE_DIGEST);
    assert_eq!(ok.version, env!("CARGO_PKG_VERSION"));
    assert!(ok.capabilities > 0, "{ok:?}");
    assert!(ok.clock_skew_ms.abs() < audit::MAX_CLOCK_SKEW_MS, "{ok:?}");
    assert_eq!((ok.open_runs, ok.quarantined_runs), (Some(0), Some(0)));
    // The node certificate, read from the handshake: issued now, so well beyond the warning.
    let not_after = ok.certificate_not_after_unix.unwrap();
    assert!(
        not_after > now().unix_timestamp() + audit::CERTIFICATE_WARNING_SECS,
        "{ok:?}"
    );
    assert!(
        !rows[2].reachable && rows[2].error.is_some(),
        "{:?}",
        rows[2]
    );
    assert_eq!(
        certistack_controller::exit::audit_exit_code(&rows),
        certistack_controller::exit::AUDIT_UNREACHABLE
    );

    let table = audit::table(&rows);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("NODE"), "{table}");
    assert!(
        lines[1].starts_with(NODE) && lines[1].contains("DRIFT sha256:000000000000"),
        "{table}"
    );
    let healthy_digest: String = certistack_proto::SURFACE_DIGEST.chars().take(19).collect();
    assert!(
        lines[2].starts_with("pve2")
            && lines[2].contains(" ok ")
            && lines[2].contains(&healthy_digest),
        "{table}"
    );
    assert!(
        lines[3].starts_with("pve3")
            && lines[3].contains("UNREACHABLE")
            && lines[3].contains(" no "),
        "{table}"
    );
    assert!(
        table.contains(&format!("pve3: unreachable at {down}")),
        "{table}"
    );
    assert!(
        table.contains("install the same certistack release"),
        "{table}"
    );

    let json: Vec<serde_json::Value> = rows.iter().map(audit::NodeAudit::to_json).collect();
    assert_eq!(json[0]["status"], "DRIFT");
    assert_eq!(json[0]["surface_matches"], false);
    assert_eq!(json[1]["status"], "ok");
    assert_eq!(json[1]["open_runs"], 0);
    assert_eq!(json[2]["reachable"], false);

    // Drift alone is exit 1; the matching node alone is exit 0.
    let without_down: Vec<_> = rows[..2].to_vec();
    assert_eq!(
        certistack_controller::exit::audit_exit_code(&without_down),
        certistack_controller::exit::AUDIT_DRIFT_OR_WARNING
    );
    let matching = inventory(&dir.0, &[("pve2", &healthy.address)]);
    let rows = audit::audit_fleet(
        matching.nodes.values(),
        authority.ca_pem(),
        identity,
        2,
        timeout,
    )
    .await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].status(), "ok", "{rows:?}");
    assert_eq!(
        certistack_controller::exit::audit_exit_code(&rows),
        certistack_controller::exit::AUDIT_MATCHES
    );
}

#[tokio::test]
async fn ctl_nodes_audit_prints_the_table_or_json_and_exits_2_then_0() {
    let dir = TempDir::new("audit-cli");
    let authority = controller(&dir.0);
    let healthy = TestNode::start(&authority, &dir.0.join("pve2"), "pve2").await;
    let drifted = serve_drifted(&authority, &dir.0.join("pve1"), NODE).await;
    let down = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let write_inventory = |file: &str, nodes: &[(&str, &str)]| {
        let mut text = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n",
            dir.0.join("ctl"),
            dir.0.join("reports")
        );
        for (name, address) in nodes {
            let (host, port) = address.rsplit_once(':').unwrap();
            text.push_str(&format!(
                "[[nodes]]\nname = {name:?}\naddress = {host:?}\nport = {port}\n"
            ));
        }
        let path = dir.0.join(file);
        std::fs::write(&path, text).unwrap();
        path
    };
    let fleet = write_inventory(
        "fleet.toml",
        &[
            (NODE, &drifted),
            ("pve2", &healthy.address),
            ("pve3", &down),
        ],
    );
    let matching = write_inventory("matching.toml", &[("pve2", &healthy.address)]);
    // The nodes are served by this test's runtime, so the CLI runs without blocking it.
    let audit = |config: std::path::PathBuf, json: bool| async move {
        let mut command = tokio::process::Command::new(binary("certistack-ctl"));
        command.args(["nodes", "audit", "--config"]).arg(&config);
        if json {
            command.arg("--json");
        }
        let out = command.output().await.unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, table, err) = audit(fleet.clone(), false).await;
    assert_eq!(code, 2, "{table}{err}");
    assert!(err.contains("unreachable"), "{err}");
    let rows: Vec<&str> = table.lines().collect();
    assert!(
        rows[0].starts_with("NODE")
            && rows[0].contains("SURFACE")
            && rows[0].contains("CERT EXPIRES"),
        "{table}"
    );
    assert!(
        rows[1].starts_with(NODE) && rows[1].contains("DRIFT"),
        "{table}"
    );
    assert!(
        rows[2].starts_with("pve2") && rows[2].contains(" ok "),
        "{table}"
    );
    assert!(
        rows[3].starts_with("pve3") && rows[3].contains("UNREACHABLE"),
        "{table}"
    );

    let (code, lines, err) = audit(fleet, true).await;
    assert_eq!(code, 2, "{lines}{err}");
    let objects: Vec<serde_json::Value> = lines
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let status: Vec<&str> = objects
        .iter()
        .map(|o| o["status"].as_str().unwrap())
        .collect();
    assert_eq!(status, ["DRIFT", "ok", "UNREACHABLE"], "{lines}");
    assert_eq!(
        objects[1]["surface_digest"],
        certistack_proto::SURFACE_DIGEST
    );

    let (code, table, err) = audit(matching, false).await;
    assert_eq!(code, 0, "{table}{err}");
    assert_eq!(table.lines().count(), 3, "{table}");
}
