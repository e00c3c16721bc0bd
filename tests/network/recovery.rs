//! A daemon killed after `PrepareSandbox` leaves nothing once recovered.

use super::*;

#[test]
fn crash_after_prepare_sandbox_leaves_nothing_after_recovery() {
    if !privileged(
        "crash_after_prepare_sandbox_leaves_nothing_after_recovery",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("crash"), |topology| async move {
        let lab = Lab::new("netcrash");
        let (_authority_dir, authority, config) = lab.controller_and_node_config("netcrash-ctl");
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
        c.prepare_sandbox(prepare()).await.unwrap();
        daemon.kill().unwrap(); // SIGKILL
        daemon.wait().unwrap();
        assert!(tables(&topology).contains("certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f"));
        assert!(bridge_addresses(&topology).contains("198.51.100.2"));

        let mut daemon = spawn();
        let mut op = client_when_up(&authority, &address, &operator).await;
        let runs = op
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs;
        assert_eq!(
            runs[0].open_resources.len(),
            2,
            "{:?}",
            runs[0].open_resources
        );
        let reply = op
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.residue.is_empty(), "{:?}", reply.residue);
        assert!(
            !tables(&topology).contains("certistack_"),
            "{}",
            tables(&topology)
        );
        assert!(
            !bridge_addresses(&topology).contains("198.51.100.2"),
            "{}",
            bridge_addresses(&topology)
        );
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    });
}
