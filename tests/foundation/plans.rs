//! `certistack-ctl plan check` and `plan show` against the documented example: what runs where,
//! every value with where it came from, and refusals that name what to change and contact no
//! node.

use super::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// The fenced blocks of `docs/plans.md` with the given info string, in order.
fn doc_blocks(info: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(workspace_root().join("docs/plans.md")).unwrap();
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in doc.lines() {
        match current.take() {
            None if line == format!("```{info}") => current = Some(String::new()),
            None => {}
            Some(block) if line == "```" => blocks.push(block),
            Some(mut block) => {
                block.push_str(line);
                block.push('\n');
                current = Some(block);
            }
        }
    }
    blocks
}

struct Setup {
    dir: TempDir,
    listeners: Vec<std::net::TcpListener>,
}

/// The documented configuration and plan in a fresh directory, the secret file 0600, and
/// the inventory's nodes pointed at listeners on loopback, so a contact would be seen.
fn setup() -> Setup {
    let dir = TempDir::new("plans");
    let mut config = doc_blocks("toml").into_iter().next().unwrap();
    let mut listeners = Vec::new();
    for address in ["192.0.2.11", "192.0.2.12"] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        config = config.replacen(
            &format!("address = \"{address}\"\nport = 7443"),
            &format!("address = \"127.0.0.1\"\nport = {port}"),
            1,
        );
        listeners.push(listener);
    }
    // Both inventory entries now point at the listeners (a port such as 37443 may hold 7443).
    assert!(!config.contains("port = 7443\n"), "{config}");
    std::fs::write(dir.0.join("controller.toml"), config).unwrap();
    let plan = doc_blocks("yaml").into_iter().next().unwrap();
    std::fs::write(dir.0.join("nightly.yaml"), plan).unwrap();
    std::fs::create_dir(dir.0.join("secrets")).unwrap();
    let secret = dir.0.join("secrets/pbs-token");
    std::fs::write(&secret, "token-secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    Setup { dir, listeners }
}

impl Setup {
    fn check(&self, plan: &str) -> (i32, String, String) {
        self.ctl(&["plan", "check", plan, "--config", "controller.toml"])
    }

    fn show(&self, plan: &str, extra: &[&str]) -> (i32, String, String) {
        let mut args = vec!["plan", "show", plan, "--config", "controller.toml"];
        args.extend_from_slice(extra);
        self.ctl(&args)
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

    fn edit(&self, name: &str, from: &str, to: &str) {
        let path = self.dir.0.join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{from:?} not in {name}");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    }

    fn assert_nothing_contacted(&self) {
        for listener in &self.listeners {
            let accepted = listener.accept();
            assert!(
                matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                "plan check contacted a node: {accepted:?}"
            );
        }
    }
}

#[test]
fn plan_check_accepts_the_documented_example_and_prints_what_runs_where() {
    let setup = setup();
    let (code, out, err) = setup.check("nightly.yaml");
    assert_eq!(code, 0, "{err}");
    // The documented output, with the inventory's addresses as this test points them.
    let mut expected = doc_blocks("text").into_iter().next().unwrap();
    for (address, listener) in ["192.0.2.11", "192.0.2.12"].iter().zip(&setup.listeners) {
        let port = listener.local_addr().unwrap().port();
        expected = expected.replace(&format!("{address}:7443"), &format!("127.0.0.1:{port}"));
    }
    assert_eq!(out, expected);
    setup.assert_nothing_contacted();
}

#[test]
fn plan_check_refusals_name_what_to_change_and_contact_nothing() {
    let setup = setup();
    let cases: [(&str, &str, &str, i32, &str); 5] = [
        (
            "  pbs_password_file: secrets/pbs-token",
            "  pbs_password_file: secrets/pbs-token\n  pbs_password: hunter2",
            "nightly.yaml:9:",
            65,
            "secrets go in files",
        ),
        (
            "vmid: 9110",
            "vmid: 42",
            "nightly.yaml:",
            65,
            "VMID 42 is outside 100..=999999999",
        ),
        (
            "node: pve2",
            "node: pve3",
            "validations[1] (dc01).node",
            65,
            "\"pve3\" is not in the controller's inventory (pve1, pve2)",
        ),
        (
            "address: 10.99.0.10\n        port: 22",
            "address: 10.97.0.10\n        port: 22",
            "validations[0] (web01)",
            65,
            "outside the probe network 10.99.0.1/24",
        ),
        (
            "lifecycle: preprovisioned",
            "lifecycle: ephemeral",
            "nightly.yaml:",
            65,
            "not yet supported, use preprovisioned",
        ),
    ];
    let original = std::fs::read_to_string(setup.dir.0.join("nightly.yaml")).unwrap();
    for (from, to, at, expected_code, reason) in cases {
        setup.edit("nightly.yaml", from, to);
        let (code, out, err) = setup.check("nightly.yaml");
        assert_eq!(code, expected_code, "{to}: {err}");
        assert!(out.is_empty(), "{out}");
        assert!(err.contains(at) && err.contains(reason), "{to}: {err}");
        assert!(!err.contains("hunter2"), "{err}");
        std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();
    }

    // The same sandbox VMID twice on one node.
    setup.edit("nightly.yaml", "node: pve2", "node: pve1");
    setup.edit("nightly.yaml", "vmid: 9110", "vmid: 9100");
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 65, "{err}");
    assert!(
        err.contains("sandbox VMID 9100 is also used by validation web01 on node pve1"),
        "{err}"
    );
    std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();

    // The same sandbox VMID on two nodes: PVE's VMIDs are unique across the cluster, so the
    // second `qm create` would fail mid-run. Both validations are named.
    setup.edit("nightly.yaml", "vmid: 9110", "vmid: 9100");
    let (code, out, err) = setup.check("nightly.yaml");
    assert_eq!(code, 65, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("validations[1] (dc01).sandbox: sandbox VMID 9100 is also used by validation web01 on node pve1"),
        "{err}"
    );
    std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();

    // A secret readable by others: the chmod to run.
    let secret = setup.dir.0.join("secrets/pbs-token");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 77, "{err}");
    assert!(err.contains("storage.pbs_password_file"), "{err}");
    assert!(err.contains("chmod 0600"), "{err}");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

    // The encryption key is held to the same rules, and must exist.
    setup.edit(
        "nightly.yaml",
        "  pbs_password_file: secrets/pbs-token",
        "  pbs_password_file: secrets/pbs-token\n  encryption_key_file: secrets/backup.key",
    );
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 66, "{err}");
    assert!(
        err.contains("storage.encryption_key_file: cannot read secrets/backup.key"),
        "{err}"
    );
    let key = setup.dir.0.join("secrets/backup.key");
    std::fs::write(&key, "{}").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o604)).unwrap();
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 77, "{err}");
    assert!(err.contains("chmod 0600 secrets/backup.key"), "{err}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 0, "{err}");
    std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();

    // A plan others may write could send the PBS secret to a server of their choosing.
    let plan = setup.dir.0.join("nightly.yaml");
    std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 77, "{err}");
    assert!(err.contains("chmod 0644 nightly.yaml"), "{err}");
    std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o644)).unwrap();

    let config = setup.dir.0.join("controller.toml");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o664)).unwrap();
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 77, "{err}");
    assert!(err.contains("chmod 0644 controller.toml"), "{err}");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();

    // An unknown key in the controller configuration: the key, line and column.
    setup.edit("controller.toml", "reports_dir", "report_dir");
    let (code, _, err) = setup.check("nightly.yaml");
    assert_eq!(code, 78, "{err}");
    assert!(
        err.contains("controller.toml:2:1: unknown field `report_dir`"),
        "{err}"
    );

    setup.assert_nothing_contacted();
}

/// The documented text with the inventory's addresses as this test points them.
fn with_test_endpoints(setup: &Setup, text: &str) -> String {
    let mut text = text.to_owned();
    for (address, listener) in ["192.0.2.11", "192.0.2.12"].iter().zip(&setup.listeners) {
        let port = listener.local_addr().unwrap().port();
        text = text.replace(&format!("{address}:7443"), &format!("127.0.0.1:{port}"));
    }
    text
}

#[test]
fn plan_show_spells_out_every_validation_of_the_documented_example_and_contacts_nothing() {
    let setup = setup();
    let (code, out, err) = setup.show("nightly.yaml", &[]);
    assert_eq!(code, 0, "{err}");
    // The second text block of docs/plans.md is `plan show`'s output for the example.
    let documented = doc_blocks("text").into_iter().nth(1).unwrap();
    assert!(
        documented.starts_with("plan nightly.yaml (sha256:"),
        "{documented}"
    );
    assert_eq!(out, with_test_endpoints(&setup, &documented));
    for name in [
        "validation web01 (validations[0])",
        "validation dc01 (validations[1])",
    ] {
        assert!(out.contains(name), "{out}");
    }
    setup.assert_nothing_contacted();
}

#[test]
fn plan_show_json_is_one_document_whose_every_value_carries_its_source() {
    let setup = setup();
    let (code, out, err) = setup.show("nightly.yaml", &["--json"]);
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(document["format"], 1);
    assert_eq!(document["plan"], "nightly.yaml");
    assert!(document["digest"].as_str().unwrap().starts_with("sha256:"));
    assert_eq!(document["storage"]["port"]["value"], 8007);
    assert_eq!(document["storage"]["port"]["source"], "plan");
    assert_eq!(
        document["storage"]["encryption_key_file"],
        serde_json::json!({"value": null, "source": "default", "key": "storage.encryption_key_file"})
    );
    let validations = document["validations"].as_array().unwrap();
    assert_eq!(validations.len(), 2);
    let (web, dc) = (&validations[0], &validations[1]);
    assert_eq!(web["name"], "web01");
    assert_eq!(dc["name"], "dc01");

    // Every sourced value in the document says where it came from, with one of the documented
    // words and a key; a value without a source is a defect.
    fn sourced_values<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        match value {
            serde_json::Value::Object(map) if map.contains_key("source") => out.push(value),
            serde_json::Value::Object(map) => map.values().for_each(|v| sourced_values(v, out)),
            serde_json::Value::Array(items) => items.iter().for_each(|v| sourced_values(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    sourced_values(&document["validations"], &mut all);
    sourced_values(&document["storage"], &mut all);
    // Per validation: node, endpoint, source_vmid, snapshot, max_age_hours, archives (6); 5
    // per sandbox VM;
    // network (3); 12 per probe (kind, address, port, 9 expectations); 6 per assertion;
    // timeouts (2); recovery (2). web01: 2 probes, 1 assertion; dc01: 2 probes, none.
    // Storage: 8.
    assert_eq!(
        all.len(),
        (6 + 5 + 3 + 24 + 6 + 4) + (6 + 5 + 3 + 24 + 4) + 8,
        "{document:#}"
    );
    for value in &all {
        let source = value["source"].as_str().unwrap();
        assert!(
            ["plan", "default", "derived", "configuration", "pbs"].contains(&source),
            "{value}"
        );
        assert!(!value["key"].as_str().unwrap().is_empty(), "{value}");
        assert_eq!(value.as_object().unwrap().len(), 3, "{value}");
    }
    for (key, source) in [
        ("/node", "plan"),
        ("/endpoint", "configuration"),
        ("/sandbox/0/vmid", "plan"),
        ("/timeouts/run_seconds", "default"),
        ("/network_recovery/mode", "plan"),
    ] {
        assert_eq!(dc.pointer(key).unwrap()["source"], source, "dc01{key}");
    }
    assert_eq!(dc.pointer("/sandbox/0/vmid/value").unwrap(), 9110);
    assert_eq!(
        dc.pointer("/sandbox/0/vmid/key").unwrap(),
        "validations[1].sandbox[0].vmid"
    );
    assert_eq!(
        web.pointer("/probes/0/expect/banner_prefix/value").unwrap(),
        "SSH-2.0-"
    );
    // An expectation the plan does not set is there, by default, checking nothing.
    assert_eq!(
        web.pointer("/probes/0/expect/http_status").unwrap(),
        &serde_json::json!({"value": 0, "source": "default", "key": "validations[0].probes[0].expect.http_status"})
    );
    assert_eq!(
        web.pointer("/assertions/0/exit_code/source").unwrap(),
        "plan"
    );
    assert_eq!(
        web.pointer("/timeouts/run_seconds/source").unwrap(),
        "plan",
        "web01 writes its timeouts"
    );
    let endpoint = with_test_endpoints(&setup, "192.0.2.11:7443");
    assert_eq!(web.pointer("/endpoint/value").unwrap(), endpoint.as_str());

    // Under rewrite (the default) the guest address is derived from the probes.
    setup.edit(
        "nightly.yaml",
        "    network_recovery:\n      mode: preserve\n",
        "",
    );
    let (code, out, err) = setup.show("nightly.yaml", &["--json"]);
    assert_eq!(code, 0, "{err}");
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    let web = &document["validations"][0];
    assert_eq!(
        web.pointer("/network_recovery/mode/source").unwrap(),
        "default"
    );
    assert_eq!(
        web.pointer("/network_recovery/guest_address").unwrap()["value"],
        "10.99.0.10/24"
    );
    assert_eq!(
        web.pointer("/network_recovery/guest_address").unwrap()["source"],
        "derived"
    );
    setup.assert_nothing_contacted();
}

#[test]
fn plan_show_refuses_what_plan_check_refuses_and_escapes_what_it_prints() {
    let setup = setup();
    let original = std::fs::read_to_string(setup.dir.0.join("nightly.yaml")).unwrap();
    // A refused plan prints nothing on stdout, in either form.
    setup.edit("nightly.yaml", "vmid: 9110", "vmid: 9100");
    for extra in [&[][..], &["--json"][..]] {
        let (code, out, err) = setup.show("nightly.yaml", extra);
        assert_eq!(code, 65, "{err}");
        assert!(out.is_empty(), "{out}");
        assert!(
            err.contains("validations[1] (dc01).sandbox: sandbox VMID 9100 is also used by validation web01 on node pve1"),
            "{err}"
        );
    }
    std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();

    // What the grant does not validate (the secret file's name is never sent) can carry
    // terminal sequences; they reach the screen escaped.
    let hostile = "pbs\u{1b}[2J\u{1b}]52;c;aGk=\u{7}";
    let secret = setup.dir.0.join("secrets").join(hostile);
    std::fs::write(&secret, "token-secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    setup.edit(
        "nightly.yaml",
        "pbs_password_file: secrets/pbs-token",
        "pbs_password_file: \"secrets/pbs\\e[2J\\e]52;c;aGk=\\a\"",
    );
    let (code, out, err) = setup.show("nightly.yaml", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
    assert!(
        out.contains("secrets/pbs\\u{1b}[2J\\u{1b}]52;c;aGk=\\u{7}"),
        "{out}"
    );
    std::fs::write(setup.dir.0.join("nightly.yaml"), &original).unwrap();

    // A right-to-left override in an argument (the grant accepts it): escaped once, on its own
    // line, in the text; a `\u202e` escape in the JSON, which still reads back to the value.
    setup.edit(
        "nightly.yaml",
        "args: [is-active, nginx]",
        "args: [is-active, \"ngi\\u202enx\"]",
    );
    let (code, out, err) = setup.show("nightly.yaml", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains('\u{202e}'), "{out:?}");
    assert!(
        out.lines()
            .any(|line| line.starts_with("  assertions[0].args[1] ")
                && line.ends_with(" ngi\\u{202e}nx")),
        "{out}"
    );
    let (code, out, err) = setup.show("nightly.yaml", &["--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains('\u{202e}') && out.contains("ngi\\u202enx"),
        "{out}"
    );
    let document: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        document
            .pointer("/validations/0/assertions/0/args/value/1")
            .unwrap(),
        "ngi\u{202e}nx"
    );
    setup.assert_nothing_contacted();
}

#[test]
fn plan_output_to_a_closed_pipe_is_quiet_and_to_a_full_disk_fails_with_74() {
    let setup = setup();
    for args in [
        &[
            "plan",
            "check",
            "nightly.yaml",
            "--config",
            "controller.toml",
        ][..],
        &[
            "plan",
            "show",
            "nightly.yaml",
            "--config",
            "controller.toml",
        ][..],
        &[
            "plan",
            "show",
            "nightly.yaml",
            "--config",
            "controller.toml",
            "--json",
        ][..],
    ] {
        // The reader is gone before anything is written: no panic, exit 0.
        let mut child = Command::new(binary("certistack-ctl"))
            .args(args)
            .current_dir(&setup.dir.0)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");

        // A full disk: exit 74, saying so.
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = Command::new(binary("certistack-ctl"))
            .args(args)
            .current_dir(&setup.dir.0)
            .stdout(full)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(74), "{args:?}: {err}");
        assert!(err.contains("cannot write the output"), "{args:?}: {err}");
    }
}
