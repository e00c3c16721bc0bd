//! The binaries, as an operator runs them.

use super::*;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

/// `[tools]` and `[pve]` sections naming what exists here, so `check` passes.
fn present_tools_and_pve(dir: &std::path::Path) -> String {
    let pve = dir.join("pve");
    for sub in ["run", "conf", "cluster"] {
        std::fs::create_dir_all(pve.join(sub)).unwrap();
    }
    let p = pve.display();
    format!(
        "[tools]\nproxmox_backup_client = \"/bin/true\"\nqm = \"/bin/true\"\nqemu_img = \"/bin/true\"\nip = \"/bin/true\"\nnft = \"/bin/true\"\n[pve]\nqemu_server_run_dir = \"{p}/run\"\nvm_config_dir = \"{p}/conf\"\npbs_loopdev_dir = \"{p}/loopdev\"\npve_cluster_dir = \"{p}/cluster\"\n"
    )
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// A daemon the test started, killed if an assertion fails before the test stops it.
struct KillOnDrop(std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn enroll_serve_hello_and_refusals() {
    let dir = TempDir::new("cli");
    let state = dir.0.join("ctl");
    let s = state.to_str().unwrap();
    let (code, out, err) = run_binary("certistack-ctl", &["ca", "init", "--state-dir", s]);
    assert_eq!(code, 0, "{err}");
    let fingerprint = out
        .lines()
        .find_map(|l| l.strip_prefix("CA fingerprint: "))
        .unwrap()
        .to_owned();
    assert_eq!(mode(&state), 0o700);
    for key in ["ca.key", "run-authority.key", "report-signing.key"] {
        assert_eq!(mode(&state.join(key)), 0o600, "{key}");
    }
    let (code, _, err) = run_binary("certistack-ctl", &["ca", "init", "--state-dir", s]);
    assert_eq!(code, 1);
    assert!(err.contains("refusing to overwrite"), "{err}");

    // The node: config, key and CSR on the node.
    let node_dir = dir.0.join("node");
    std::fs::create_dir_all(&node_dir).unwrap();
    let port = free_local_port();
    let n = node_dir.display();
    let config_path = node_dir.join("connector.toml");
    std::fs::write(
        &config_path,
        format!(
            "node_name = \"pve1\"\nlisten = \"127.0.0.1:{port}\"\n[tls]\ncertificate = \"{n}/node.crt\"\nprivate_key = \"{n}/node.key\"\ncontroller_ca = \"{n}/ca.crt\"\nrun_authority_public_key = \"{n}/run-authority.pub\"\n[paths]\nstate_dir = \"{n}/state\"\noverlay_root = \"{n}/overlays\"\n{}",
            present_tools_and_pve(&node_dir)
        ),
    )
    .unwrap();
    let c = config_path.to_str().unwrap();
    let (code, csr, err) = run_binary("certistack-connector", &["--config", c, "enroll", "--csr"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        csr.starts_with("-----BEGIN CERTIFICATE REQUEST-----"),
        "{csr}"
    );
    assert_eq!(mode(&node_dir.join("node.key")), 0o600);
    let csr_path = dir.0.join("node.csr");
    std::fs::write(&csr_path, &csr).unwrap();

    let cert_path = dir.0.join("node.crt");
    let sign = [
        "node",
        "sign",
        "--state-dir",
        s,
        "--csr",
        csr_path.to_str().unwrap(),
        "--out",
        cert_path.to_str().unwrap(),
    ];
    let (code, _, err) = run_binary(
        "certistack-ctl",
        &[&sign[..4], &["--node", "pve2"], &sign[4..]].concat(),
    );
    assert_eq!(code, 1);
    assert!(err.contains("must name exactly [\"pve2\"]"), "{err}");
    let (code, out, err) = run_binary(
        "certistack-ctl",
        &[&sign[..4], &["--node", "pve1"], &sign[4..]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("enroll --install"), "{out}");

    let install = [
        "--config",
        c,
        "enroll",
        "--install",
        "--certificate",
        cert_path.to_str().unwrap(),
        "--ca",
        state.join("ca.crt").to_str().unwrap().to_owned().leak(),
        "--ca-fingerprint",
        fingerprint.clone().leak(),
        "--run-authority",
        state
            .join("run-authority.pub")
            .to_str()
            .unwrap()
            .to_owned()
            .leak(),
    ];
    let (code, _, err) = run_binary("certistack-connector", &install);
    assert_eq!(code, 0, "{err}");

    // An insecure key refuses to start, saying what to do.
    std::fs::set_permissions(
        node_dir.join("node.key"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let (code, _, err) = run_binary("certistack-connector", &["--config", c, "check"]);
    assert_eq!(code, 3);
    assert!(err.contains("chmod 0600"), "{err}");
    std::fs::set_permissions(
        node_dir.join("node.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let (code, out, err) = run_binary("certistack-connector", &["--config", c, "check"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("configuration ok"));

    let mut daemon = KillOnDrop(
        Command::new(binary("certistack-connector"))
            .args(["--config", c])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let address = format!("127.0.0.1:{port}");
    let mut hello = (1, String::new(), String::new());
    for _ in 0..50 {
        hello = run_binary(
            "certistack-ctl",
            &[
                "hello",
                "--state-dir",
                s,
                "--node",
                &address,
                "--name",
                "pve1",
            ],
        );
        if hello.0 == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(hello.0, 0, "{}", hello.2);
    assert!(hello.1.contains("node: pve1"), "{}", hello.1);
    assert!(
        hello.1.contains(&format!(
            "surface: {} (matches)",
            certistack_proto::SURFACE_DIGEST
        )),
        "{}",
        hello.1
    );
    assert!(hello.1.contains("seen as: operator:ctl"), "{}", hello.1);
    assert!(
        hello
            .1
            .contains(&format!("(source {}", certistack_proto::SOURCE_COMMIT)),
        "{}",
        hello.1
    );

    let (code, _, err) = run_binary(
        "certistack-ctl",
        &[
            "hello",
            "--state-dir",
            s,
            "--node",
            &address,
            "--name",
            "pve2",
        ],
    );
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("not the node asked for"), "{err}");

    // A group-readable controller key is refused.
    std::fs::set_permissions(state.join("ca.key"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let (code, _, err) = run_binary(
        "certistack-ctl",
        &[
            "hello",
            "--state-dir",
            s,
            "--node",
            &address,
            "--name",
            "pve1",
        ],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("ca.key") && err.contains("chmod 0600"),
        "{err}"
    );
    std::fs::set_permissions(state.join("ca.key"), std::fs::Permissions::from_mode(0o600)).unwrap();

    // SIGTERM drains and exits cleanly.
    Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    let status = daemon.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut log = String::new();
    std::io::Read::read_to_string(daemon.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(
        log.contains("SIGTERM: draining") && log.contains("stopped"),
        "{log}"
    );
    assert!(
        log.contains("TLS handshake refused"),
        "the refused hello is logged: {log}"
    );

    // Nothing listens any more.
    let (code, _, err) = run_binary(
        "certistack-ctl",
        &[
            "hello",
            "--state-dir",
            s,
            "--node",
            &address,
            "--name",
            "pve1",
        ],
    );
    assert_eq!(code, 3, "{err}");
}

#[test]
fn surface_verb_and_help() {
    let (code, out, _) = run_binary("certistack-ctl", &["surface"]);
    assert_eq!(code, 0);
    assert_eq!(out, certistack_controller::surface::describe().unwrap());
    for args in [
        &["--help"][..],
        &["ca", "init", "--help"],
        &["node", "sign", "--help"],
        &["surface", "--help"],
        &["hello", "--help"],
        &["run", "--help"],
        &["doctor", "--help"],
        &["runs", "--help"],
        &["journal", "--help"],
        &["cleanup", "--help"],
        &["report", "verify", "--help"],
        &["plan", "check", "--help"],
        &["plan", "show", "--help"],
        &["nodes", "audit", "--help"],
    ] {
        let (code, out, _) = run_binary("certistack-ctl", args);
        assert_eq!(code, 0, "{args:?}");
        assert!(out.contains("Exit codes:"), "{args:?}: {out}");
    }
    // A wrong command line is a usage error, 64, for every command.
    let (code, _, err) = run_binary("certistack-ctl", &["run"]);
    assert_eq!(code, 64, "{err}");
    let (code, out, _) = run_binary("certistack-connector", &["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Exit codes:"));
    let (code, _, err) = run_binary(
        "certistack-connector",
        &["--config", "/nonexistent/connector.toml", "check"],
    );
    assert_eq!(code, 3);
    assert!(err.contains("/nonexistent/connector.toml"), "{err}");
}
