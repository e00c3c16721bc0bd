//! Which VMs, which VMIDs, which node, read through the PVE API double
//! (`tests/doubles/pve-api`): `select` by pool and by tags, a pool member the token cannot
//! audit refused rather than skipped, sandbox VMIDs taken from `pve.sandbox_vmid_range` around
//! the VMIDs the cluster has (seen or not), a written VMID in use refused before any node is
//! contacted, a selection over the bound refused, and `node: auto` with no node ready leaving
//! the validation unplaced, saying why of each candidate.

use super::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const TOKEN_ID: &str = "certistack@pve!ctl";
const SECRET: &str = "0b1e5c1e-1111-4222-8333-944445555666";

/// The PVE API double with `guests`, `pools` and `permissions` for the token; stopped on drop.
struct Pve {
    ca_pem: String,
    api: ApiDouble,
}

impl Pve {
    fn start(settings: serde_json::Value) -> Self {
        let pki = api_server_pki(&["localhost"]);
        let root = TempDir::new("pve-select");
        let mut all = serde_json::json!({ "tokens": { TOKEN_ID: SECRET } });
        for (key, value) in settings.as_object().unwrap() {
            all[key] = value.clone();
        }
        std::fs::write(root.0.join("double.json"), all.to_string()).unwrap();
        let api = ApiDouble::start_in("pve-api", &pki, &[], "--root", root);
        Self {
            ca_pem: pki.ca_pem,
            api,
        }
    }

    fn calls_log(&self) -> String {
        std::fs::read_to_string(self.api.tls_dir().join("calls.log")).unwrap_or_default()
    }
}

/// Guests 201..=205 in pool `prod` (201 and 203 tagged `web;nightly`), 210 tagged `web`,
/// a container 206 in `prod`, and 9100, a guest the token may not audit.
fn cluster(permissions: serde_json::Value) -> serde_json::Value {
    let mut guests: Vec<serde_json::Value> = (201..=205)
        .map(|vmid| {
            serde_json::json!({
                "vmid": vmid, "type": "qemu", "node": "pve1", "name": format!("app{vmid}"),
                "pool": "prod",
                "tags": if vmid == 201 || vmid == 203 { "web;nightly" } else { "" },
            })
        })
        .collect();
    guests.push(serde_json::json!({"vmid": 206, "type": "lxc", "node": "pve1", "pool": "prod"}));
    guests.push(serde_json::json!({"vmid": 210, "type": "qemu", "node": "pve1", "tags": "web"}));
    guests
        .push(serde_json::json!({"vmid": 9100, "type": "qemu", "node": "pve1", "name": "hidden"}));
    serde_json::json!({
        "guests": guests,
        "pools": ["prod"],
        "permissions": { TOKEN_ID: permissions },
    })
}

/// VM.Audit on every VM but 9100, Pool.Audit on `prod`, Sys.Audit on the nodes.
fn auditor() -> serde_json::Value {
    let mut table = serde_json::json!({
        "/": {"Sys.Audit": 1},
        "/pool/prod": {"Pool.Audit": 1, "VM.Audit": 1},
        "/nodes": {"Sys.Audit": 1},
        "/sdn/zones": {"SDN.Audit": 1},
    });
    for vmid in [201, 202, 203, 204, 205, 206, 210] {
        table[format!("/vms/{vmid}")] = serde_json::json!({"VM.Audit": 0});
    }
    table
}

/// A controller configuration (`[pve]` at the double, `sandbox_vmid_range`) and a plan, in a
/// directory of their own; `pve1` is a listener nobody answers, so a contact would be seen.
struct Setup {
    dir: TempDir,
    listener: std::net::TcpListener,
}

impl Setup {
    fn new(pve: &Pve, extra_nodes: &str, validation: &str) -> Self {
        let dir = TempDir::new("pve-select-plan");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        std::fs::write(dir.0.join("pve-root-ca.pem"), &pve.ca_pem).unwrap();
        let secret = dir.0.join("pve-token");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let config = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n\n[pve]\napi_url = \"https://localhost:{}\"\ntoken_id = {TOKEN_ID:?}\ntoken_secret_file = \"pve-token\"\nca_file = \"pve-root-ca.pem\"\nsandbox_vmid_range = \"9100-9199\"\n\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = {}\n{extra_nodes}",
            dir.0.join("state"),
            dir.0.join("reports"),
            pve.api.port,
            listener.local_addr().unwrap().port()
        );
        std::fs::write(dir.0.join("controller.toml"), config).unwrap();
        std::fs::create_dir(dir.0.join("secrets")).unwrap();
        let pbs_secret = dir.0.join("secrets/pbs-token");
        std::fs::write(&pbs_secret, "pbs-secret\n").unwrap();
        std::fs::set_permissions(&pbs_secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let plan = format!(
            r#"storage:
  server: pbs.example.net
  datastore: backups
  auth_id: "certistack@pbs!restore"
  fingerprint: "{fingerprint}"
  pbs_password_file: secrets/pbs-token
validations:
  - name: app
{validation}    snapshot: "2026-12-01T02:00:00Z"
    archives: [drive-scsi0.img]
    sandbox:
      - cores: 2
        memory_mib: 2048
    network:
      lifecycle: preprovisioned
      vnet: csnet1
      probe_source: 10.99.0.1/24
    probes:
      - kind: tcp
        address: 10.99.0.10
        port: 22
"#,
            fingerprint = ["ab"; 32].join(":"),
        );
        std::fs::write(dir.0.join("nightly.yaml"), plan).unwrap();
        Self { dir, listener }
    }

    fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(binary("certistack-ctl"))
            .args(args)
            .args(["nightly.yaml", "--config", "controller.toml"])
            .current_dir(&self.dir.0)
            .env_remove("CERTISTACK_LOG")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `plan show --json`, parsed; panics with the output unless it exits 0.
    fn show(&self) -> serde_json::Value {
        let (code, out, err) = self.ctl(&["plan", "show", "--json"]);
        assert_eq!(code, 0, "plan show failed: {err}{out}");
        serde_json::from_str(&out).unwrap()
    }

    fn assert_no_node_contacted(&self) {
        let accepted = self.listener.accept();
        assert!(
            matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a node was contacted: {accepted:?}"
        );
    }
}

/// Each validation's (name, source_vmid, its source key, sandbox VMID, its source).
fn chosen(document: &serde_json::Value) -> Vec<(String, u64, String, u64, String)> {
    document["validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_owned(),
                v["source_vmid"]["value"].as_u64().unwrap(),
                v["source_vmid"]["key"].as_str().unwrap().to_owned(),
                v["sandbox"][0]["vmid"]["value"].as_u64().unwrap(),
                v["sandbox"][0]["vmid"]["source"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        })
        .collect()
}

#[test]
fn a_pool_expands_to_its_vms_with_free_sandbox_vmids_around_a_hidden_guest() {
    let pve = Pve::start(cluster(auditor()));
    let setup = Setup::new(&pve, "", "    node: pve1\n    select: {pool: prod}\n");
    let document = setup.show();
    // Five VMs, not the container; VMID 9100 is taken by a guest the token cannot see, so the
    // sandboxes start at 9101.
    let expected: Vec<_> = (201..=205)
        .zip(9101..)
        .map(|(vmid, sandbox)| {
            (
                format!("app-{vmid}"),
                vmid,
                "validations[0] (app).select.pool (prod)".to_owned(),
                sandbox,
                "pve".to_owned(),
            )
        })
        .collect();
    let got = chosen(&document);
    assert_eq!(
        got.iter()
            .map(|(n, v, _, s, src)| (n.clone(), *v, *s, src.clone()))
            .collect::<Vec<_>>(),
        expected
            .iter()
            .map(|(n, v, _, s, src)| (n.clone(), *v, *s, src.clone()))
            .collect::<Vec<_>>()
    );
    for (name, _, key, _, _) in &got {
        assert!(key.contains("select.pool (prod)"), "{name}: {key}");
    }
    let log = pve.calls_log();
    assert!(log.contains("\"query\": \"vmid=9100\"") || log.contains("\"query\":\"vmid=9100\""));
    assert!(log.contains("/api2/json/pools/prod"), "{log}");
    // The range's candidates are asked ahead, all at once, and each only once.
    let asked: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("/cluster/nextid"))
        .collect();
    let distinct: BTreeSet<&str> = asked
        .iter()
        .filter_map(|line| line.split("vmid=").nth(1)?.split('"').next())
        .collect();
    assert_eq!(asked.len(), distinct.len(), "a VMID was asked twice: {log}");
    assert!(asked.len() <= 5 + 1 + 8, "{log}");
    setup.assert_no_node_contacted();
    // plan check says the same in a line each.
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("app-203: node pve1"), "{out}");
    assert!(out.contains("sandbox 9103"), "{out}");
    assert!(
        out.ends_with("5 validation(s); no node was contacted\n"),
        "{out}"
    );
}

#[test]
fn tags_select_the_vms_that_carry_all_of_them() {
    let pve = Pve::start(cluster(auditor()));
    let setup = Setup::new(
        &pve,
        "",
        "    node: pve1\n    select: {tags: [web, nightly]}\n",
    );
    let got: Vec<(String, u64)> = chosen(&setup.show())
        .into_iter()
        .map(|(name, vmid, ..)| (name, vmid))
        .collect();
    assert_eq!(
        got,
        [("app-201".to_owned(), 201), ("app-203".to_owned(), 203)]
    );
}

#[test]
fn a_pool_member_the_token_cannot_audit_refuses_the_plan_naming_it() {
    // PVEAuditor on /, and NoAccess on one member of the pool: the listing leaves it out.
    let mut settings = cluster(serde_json::json!({}));
    settings["users"] = serde_json::json!({"certistack@pve": {"tokens": {"ctl": {"privsep": 0}}}});
    settings["acl"] = serde_json::json!([
        {"path": "/", "roles": ["PVEAuditor"], "users": ["certistack@pve"], "propagate": 1},
        {"path": "/vms/204", "roles": ["NoAccess"], "users": ["certistack@pve"], "propagate": 1},
    ]);
    let pve = Pve::start(settings);
    let setup = Setup::new(&pve, "", "    node: pve1\n    select: {pool: prod}\n");
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 65, "{out}{err}");
    assert!(err.contains("204"), "{err}");
    assert!(err.contains("VM.Audit on /pool/prod"), "{err}");
    assert!(out.is_empty(), "{out}");
    setup.assert_no_node_contacted();
}

#[test]
fn a_written_sandbox_vmid_the_cluster_has_is_refused_before_any_node() {
    let pve = Pve::start(cluster(auditor()));
    let setup = Setup::new(&pve, "", "    node: pve1\n    source_vmid: 201\n");
    let plan = setup.dir.0.join("nightly.yaml");
    let text = std::fs::read_to_string(&plan).unwrap();
    std::fs::write(
        &plan,
        text.replace("      - cores: 2", "      - vmid: 9100\n        cores: 2"),
    )
    .unwrap();
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 65, "{out}{err}");
    assert!(err.contains("9100"), "{err}");
    assert!(err.contains("already"), "{err}");
    setup.assert_no_node_contacted();
}

#[test]
fn a_selection_over_the_bound_is_refused() {
    let mut settings =
        cluster(serde_json::json!({"/": {"Sys.Audit": 1, "VM.Audit": 1, "SDN.Audit": 1}}));
    let guests = settings["guests"].as_array_mut().unwrap();
    for vmid in 1000..1300 {
        guests.push(
            serde_json::json!({"vmid": vmid, "type": "qemu", "node": "pve1", "tags": "bulk"}),
        );
    }
    let pve = Pve::start(settings);
    let setup = Setup::new(&pve, "", "    node: pve1\n    select: {tags: [bulk]}\n");
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 65, "{out}{err}");
    assert!(err.contains("256"), "{err}");
    assert!(err.contains("300"), "{err}");
    setup.assert_no_node_contacted();
}

#[test]
fn node_auto_with_no_node_ready_leaves_the_validation_unplaced_saying_why() {
    // pve1's connector is down (a closed port); pve2 is offline in PVE; pve3 is not in the
    // cluster at all.
    let mut settings = cluster(auditor());
    settings["cluster_status"] = serde_json::json!([
        {"type": "cluster", "id": "cluster", "name": "lab", "nodes": 3, "version": 3, "quorate": 1},
        {"type": "node", "id": "node/pve1", "name": "pve1", "nodeid": 1, "ip": "127.0.0.1",
         "local": 1, "online": 1, "level": ""},
        {"type": "node", "id": "node/pve2", "name": "pve2", "nodeid": 2, "ip": "127.0.0.2",
         "local": 0, "online": 0, "level": ""},
    ]);
    settings["node_stats"] = serde_json::json!({
        "pve1": {"maxcpu": 8, "cpu": 0.0, "maxmem": 17179869184u64, "mem": 0},
        "pve2": {"maxcpu": 8, "cpu": 0.0, "maxmem": 17179869184u64, "mem": 0},
    });
    let pve = Pve::start(settings);
    let closed = free_local_port();
    let extra = format!(
        "\n[[nodes]]\nname = \"pve2\"\naddress = \"127.0.0.1\"\nport = {closed}\n\n[[nodes]]\nname = \"pve3\"\naddress = \"127.0.0.1\"\nport = {closed}\n"
    );
    let setup = Setup::new(&pve, &extra, "    node: auto\n    source_vmid: 201\n");
    // pve1 must refuse rather than hang: close the listener so its port is closed too.
    let config = setup.dir.0.join("controller.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let pve1_port = setup.listener.local_addr().unwrap().port();
    std::fs::write(
        &config,
        text.replace(
            &format!("port = {pve1_port}\n"),
            &format!("port = {closed}\n"),
        ),
    )
    .unwrap();
    // Placement asks the nodes as an operator would, with the controller's keys.
    let state = setup.dir.0.join("state");
    let (code, _, err) = run_binary(
        "certistack-ctl",
        &["ca", "init", "--state-dir", state.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    let document = setup.show();
    let app = &document["validations"][0];
    let why = app["unplaced"].as_str().expect("unplaced");
    assert!(
        why.starts_with("node auto: no candidate node can take it"),
        "{why}"
    );
    assert!(why.contains("pve2: offline in PVE"), "{why}");
    assert!(
        why.contains("pve3: not in the PVE API's node list"),
        "{why}"
    );
    assert!(
        why.contains("pve1: ") && why.contains("doctor pve1 --vnet csnet1"),
        "{why}"
    );
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("1 validation(s) placed on no node"), "{err}");
    assert!(out.contains("app: placed on no node: node auto:"), "{out}");
    assert!(
        out.contains("the nodes were asked only what placement needs"),
        "{out}"
    );
}

#[test]
fn missing_privileges_are_listed_at_once_before_anything_is_asked() {
    // VM.Audit on every VM, but neither Pool.Audit on the pool nor Sys.Audit on the node.
    let mut permissions = auditor();
    permissions["/pool/prod"] = serde_json::json!({});
    permissions["/nodes"] = serde_json::json!({});
    permissions["/"] = serde_json::json!({});
    let pve = Pve::start(cluster(permissions));
    let setup = Setup::new(&pve, "", "    node: auto\n    select: {pool: prod}\n");
    for command in [
        &["plan", "check"][..],
        &["plan", "show"],
        &["run"],
        &["doctor", "--plan"],
    ] {
        let (code, out, err) = setup.ctl(command);
        assert_eq!(code, 77, "{command:?}: {out}{err}");
        for line in [
            "missing Pool.Audit on /pool/prod: validations[0] (app).select.pool",
            "missing VM.Audit on /pool/prod: validations[0] (app).select.pool",
            "missing Sys.Audit on /nodes/pve1: validations[0] (app).node",
            "grant them with",
            "  pveum role add CertiStackPoolAudit --privs Pool.Audit",
            "  pveum role add CertiStackSysAudit --privs Sys.Audit",
            "  pveum role add CertiStackVMAudit --privs VM.Audit",
            "  pveum acl modify /nodes/pve1 --roles CertiStackSysAudit --users certistack@pve --tokens 'certistack@pve!ctl'",
            "  pveum acl modify /pool/prod --roles CertiStackPoolAudit,CertiStackVMAudit --users certistack@pve --tokens 'certistack@pve!ctl'",
            "lacks 3 privilege(s) the plan needs",
        ] {
            assert!(err.contains(line), "{command:?}: {line:?} not in {err}");
        }
    }
    // Only the privileges were asked: no listing, no pool, no node.
    let log = pve.calls_log();
    assert!(!log.contains("/cluster/resources"), "{log}");
    assert!(!log.contains("/pools/"), "{log}");
    assert!(log.contains("/access/permissions"), "{log}");
    setup.assert_no_node_contacted();
}

/// Applies `pveum role add NAME --privs P` and `pveum acl modify PATH --roles R,.. [--users
/// 'U'] [--tokens 'T']` lines to the double's user.cfg model (`roles`, `acl`), as pveum writes
/// user.cfg (pve-access-control `PVE/CLI/pveum.pm`: `acl modify` propagates by default).
fn apply_pveum(settings: &mut serde_json::Value, lines: &[&str]) {
    for line in lines {
        let words: Vec<String> = line
            .split_whitespace()
            .map(|w| w.trim_matches('\'').to_owned())
            .collect();
        let value = |flag: &str| {
            words
                .iter()
                .position(|w| w == flag)
                .and_then(|at| words.get(at + 1).cloned())
        };
        match (
            words.get(1).map(String::as_str),
            words.get(2).map(String::as_str),
        ) {
            (Some("role"), Some("add")) => {
                settings["roles"][&words[3]] =
                    serde_json::json!(value("--privs").unwrap().split(',').collect::<Vec<_>>());
            }
            (Some("acl"), Some("modify")) => {
                let mut entry = serde_json::json!({
                    "path": words[3],
                    "roles": value("--roles").unwrap().split(',').collect::<Vec<_>>(),
                    "propagate": 1,
                });
                for kind in ["users", "tokens"] {
                    if let Some(who) = value(&format!("--{kind}")) {
                        entry[kind] = serde_json::json!([who]);
                    }
                }
                settings["acl"].as_array_mut().unwrap().push(entry);
            }
            _ => panic!("not a pveum line this test applies: {line}"),
        }
    }
}

#[test]
fn privilege_separation_is_seen_and_the_printed_grants_make_the_preflight_pass() {
    // The user may audit everything (PVEAuditor on / through its group); its token, with
    // privilege separation, was granted nothing of its own.
    let mut settings = cluster(serde_json::json!({}));
    settings["users"] = serde_json::json!({
        "certistack@pve": {"groups": ["auditors"], "tokens": {"ctl": {"privsep": 1}}}
    });
    settings["acl"] = serde_json::json!([
        {"path": "/", "roles": ["PVEAuditor"], "groups": ["auditors"], "propagate": 1}
    ]);
    let pve = Pve::start(settings.clone());
    let write = |settings: &serde_json::Value| {
        let mut all = settings.clone();
        all["tokens"] = serde_json::json!({ TOKEN_ID: SECRET });
        let path = pve.api.tls_dir().join("double.json");
        let staged = pve.api.tls_dir().join("double.json.tmp");
        std::fs::write(&staged, all.to_string()).unwrap();
        std::fs::rename(&staged, path).unwrap();
    };
    let setup = Setup::new(&pve, "", "    node: pve1\n    select: {pool: prod}\n");
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 77, "{out}{err}");
    assert!(err.contains("missing Pool.Audit on /pool/prod"), "{err}");
    assert!(err.contains("missing VM.Audit on /pool/prod"), "{err}");
    assert!(err.contains("missing SDN.Audit on /sdn/zones"), "{err}");
    let grants: Vec<&str> = err
        .lines()
        .filter_map(|line| line.strip_prefix("  "))
        .filter(|line| line.starts_with("pveum "))
        .collect();
    assert_eq!(grants.len(), 5, "{err}");

    // The lines it printed, applied as pveum would: the plan resolves.
    apply_pveum(&mut settings, &grants);
    write(&settings);
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("5 validation(s)"), "{out}");

    // Without privilege separation the token has its user's privileges, and needs no grant.
    settings["acl"] = serde_json::json!([
        {"path": "/", "roles": ["PVEAuditor"], "groups": ["auditors"], "propagate": 1}
    ]);
    settings["users"]["certistack@pve"]["tokens"]["ctl"]["privsep"] = serde_json::json!(0);
    write(&settings);
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 0, "{out}{err}");
    setup.assert_no_node_contacted();
}

#[test]
fn a_vnet_the_sdn_configuration_does_not_keep_on_the_node_is_refused_before_any_node() {
    let cases: [(&str, serde_json::Value, &str); 6] = [
        (
            "gateway",
            serde_json::json!({"subnets": [{"subnet": "csbox-10.99.0.0-24", "cidr": "10.99.0.0/24",
                "vnet": "csnet1", "gateway": "10.99.0.1"}]}),
            "its subnet 10.99.0.0/24 has gateway 10.99.0.1",
        ),
        (
            "snat",
            serde_json::json!({"subnets": [{"subnet": "csbox-10.99.0.0-24", "cidr": "10.99.0.0/24",
                "vnet": "csnet1", "snat": 1}]}),
            "has SNAT on",
        ),
        (
            "vlan",
            serde_json::json!({"zones": [{"zone": "csbox", "type": "vlan", "bridge": "vmbr0"}]}),
            "of type vlan, which carries the VNet off the node",
        ),
        (
            "other nodes",
            serde_json::json!({"zones": [{"zone": "csbox", "type": "simple", "nodes": "pve2,pve3"}]}),
            "is not on node pve1 (nodes pve2,pve3)",
        ),
        (
            "pending",
            serde_json::json!({"subnets": [{"subnet": "csbox-10.99.0.0-24", "cidr": "10.99.0.0/24",
                "vnet": "csnet1", "state": "changed", "pending": {"gateway": "10.99.0.1"}}]}),
            "subnet 10.99.0.0/24 (changed: gateway) is pending",
        ),
        (
            "absent",
            serde_json::json!({"vnets": []}),
            "VNet csnet1 is not in the cluster's SDN configuration",
        ),
    ];
    for (case, patch, expected) in cases {
        let mut settings = cluster(auditor());
        let mut sdn = serde_json::json!({
            "zones": [{"zone": "csbox", "type": "simple"}],
            "vnets": [{"vnet": "csnet1", "zone": "csbox"}],
            "subnets": [{"subnet": "csbox-10.99.0.0-24", "cidr": "10.99.0.0/24", "vnet": "csnet1"}],
        });
        for (key, value) in patch.as_object().unwrap() {
            sdn[key] = value.clone();
        }
        settings["sdn"] = sdn;
        let pve = Pve::start(settings);
        let setup = Setup::new(&pve, "", "    node: pve1\n    source_vmid: 201\n");
        let (code, out, err) = setup.ctl(&["plan", "check"]);
        assert_eq!(code, 65, "{case}: {out}{err}");
        assert!(
            err.contains("validations[0] (app).network.vnet"),
            "{case}: {err}"
        );
        assert!(err.contains(expected), "{case}: {expected:?} not in {err}");
        setup.assert_no_node_contacted();
        // Read, never written.
        let log = pve.calls_log();
        assert!(
            log.lines().all(|line| line.contains("\"method\": \"GET\"")),
            "{case}: {log}"
        );
    }
    // With node: auto the VNet is judged before placement asks any node.
    let mut settings = cluster(auditor());
    settings["sdn"] = serde_json::json!({
        "zones": [{"zone": "csbox", "type": "vxlan"}],
        "vnets": [{"vnet": "csnet1", "zone": "csbox"}],
        "subnets": [],
    });
    let pve = Pve::start(settings);
    let setup = Setup::new(&pve, "", "    node: auto\n    source_vmid: 201\n");
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 65, "{out}{err}");
    assert!(err.contains("of type vxlan"), "{err}");
    setup.assert_no_node_contacted();
}

#[test]
fn the_grant_block_in_the_install_guide_makes_the_preflight_pass() {
    let guide = std::fs::read_to_string(workspace_root().join("docs/install.md")).unwrap();
    let (_, after) = guide
        .split_once("The exact grant for a nightly plan")
        .expect("the grant block in docs/install.md");
    let block: Vec<&str> = after
        .lines()
        .skip_while(|line| !line.starts_with("    pveum "))
        .take_while(|line| line.starts_with("    pveum "))
        .map(str::trim)
        .collect();
    assert!(block.len() >= 5, "{block:?}");
    // A token with privilege separation whose user was granted nothing either.
    let mut settings = cluster(serde_json::json!({}));
    settings["users"] = serde_json::json!({
        "certistack@pve": {"tokens": {"ctl": {"privsep": 1}}}
    });
    settings["acl"] = serde_json::json!([]);
    let pve = Pve::start(settings.clone());
    let setup = Setup::new(&pve, "", "    node: auto\n    select: {pool: prod}\n");
    let (code, _, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 77, "{err}");
    // Placement asks the node (here a closed port) with the controller's keys.
    let state = setup.dir.0.join("state");
    let (code, _, err) = run_binary(
        "certistack-ctl",
        &["ca", "init", "--state-dir", state.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    let config = setup.dir.0.join("controller.toml");
    let port = setup.listener.local_addr().unwrap().port();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            &format!("port = {port}\n"),
            &format!("port = {}\n", free_local_port()),
        ),
    )
    .unwrap();
    apply_pveum(&mut settings, &block);
    settings["tokens"] = serde_json::json!({ TOKEN_ID: SECRET });
    let path = pve.api.tls_dir().join("double.json");
    std::fs::write(path.with_extension("tmp"), settings.to_string()).unwrap();
    std::fs::rename(path.with_extension("tmp"), &path).unwrap();
    // The preflight passes, the pool resolves; the node's connector is down here, so the
    // validations are unplaced (exit 2), which is not a privilege.
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert!(!err.contains("missing "), "{err}");
    assert!(out.contains("app-205: placed on no node"), "{out}{err}");
    assert_eq!(code, 2, "{out}{err}");
}

#[test]
fn placement_that_asks_no_node_says_no_node_was_contacted() {
    // pve1, the only node, is offline in PVE: placement has no node to ask.
    let mut settings = cluster(auditor());
    settings["cluster_status"] = serde_json::json!([
        {"type": "cluster", "id": "cluster", "name": "lab", "nodes": 1, "version": 1, "quorate": 0},
        {"type": "node", "id": "node/pve1", "name": "pve1", "nodeid": 1, "ip": "127.0.0.1",
         "local": 1, "online": 0, "level": ""},
    ]);
    let pve = Pve::start(settings);
    let setup = Setup::new(&pve, "", "    node: auto\n    source_vmid: 201\n");
    let (code, out, err) = setup.ctl(&["plan", "check"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        out.contains("app: placed on no node: node auto: no candidate node can take it"),
        "{out}"
    );
    assert!(out.contains("pve1: offline in PVE"), "{out}");
    assert!(
        out.ends_with("1 validation(s); no node was contacted\n"),
        "{out}"
    );
    setup.assert_no_node_contacted();
}

#[test]
fn offline_asks_nothing_and_refuses_what_needs_an_api() {
    let pve = Pve::start(cluster(auditor()));
    // A plan that leaves the selection to the API: refused offline, saying so.
    let setup = Setup::new(&pve, "", "    node: pve1\n    select: {pool: prod}\n");
    let (code, out, err) = setup.ctl(&["plan", "check", "--offline"]);
    assert_eq!(code, 65, "{out}{err}");
    assert!(err.contains("select"), "{err}");
    assert!(err.contains("without --offline"), "{err}");
    // One written out is accepted offline, the API never asked.
    let written = Setup::new(&pve, "", "    node: pve1\n    source_vmid: 201\n");
    let plan = written.dir.0.join("nightly.yaml");
    let text = std::fs::read_to_string(&plan).unwrap();
    std::fs::write(
        &plan,
        text.replace("      - cores: 2", "      - vmid: 9150\n        cores: 2"),
    )
    .unwrap();
    let (code, out, err) = written.ctl(&["plan", "show", "--offline"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.ends_with("1 validation(s); no node was contacted\n"),
        "{out}"
    );
    assert!(pve.calls_log().is_empty(), "{}", pve.calls_log());
    // --online is the default, said explicitly.
    let (code, _, err) = written.ctl(&["plan", "check", "--online"]);
    assert_eq!(code, 0, "{err}");
    assert!(pve.calls_log().contains("/access/permissions"));
    let (code, _, err) = written.ctl(&["plan", "check", "--online", "--offline"]);
    assert_eq!(code, 64, "{err}");
}
