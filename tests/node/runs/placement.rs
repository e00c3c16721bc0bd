//! `select`, `snapshot: latest` and `node: auto` end to end: the PVE API double lists two VMs
//! carrying a tag and three nodes, the PBS API double their backups; the plan selects the VMs,
//! takes each one's newest finished backup, leaves the sandbox VMIDs to
//! `pve.sandbox_vmid_range` (one of which a container holds) and the node to placement, which
//! passes over the node whose connector is down and spreads the two validations over the two
//! simulated nodes that answer; each runs, is cleaned up and is reported with how it was placed.

use super::*;

/// Node figures (`/cluster/resources?type=node`): pve3 has the most room but its connector is
/// down; pve1 has a little more than pve2, so the first validation goes to pve1 and, with
/// 256 MiB of it taken, the second to pve2.
fn cluster_settings() -> serde_json::Value {
    let node = |name: &str, id: u32| {
        serde_json::json!({"type": "node", "id": format!("node/{name}"), "name": name,
            "nodeid": id, "ip": "127.0.0.1", "local": u32::from(id == 1), "online": 1, "level": ""})
    };
    let mib = |n: u64| n << 20;
    serde_json::json!({
        "tokens": { "certistack@pve!ctl": "0b1e5c1e-1111-4222-8333-944445555666" },
        "permissions": { "certistack@pve!ctl": {
            "/": { "Sys.Audit": 1, "VM.Audit": 1, "SDN.Audit": 1 }
        } },
        // The lab's VNet as PVE's SDN has it: a Simple zone, a subnet without gateway or SNAT.
        "sdn": {
            "zones": [{"zone": "cslab", "type": "simple"}],
            "vnets": [{"vnet": "csv1", "zone": "cslab", "type": "vnet"}],
            "subnets": [{"subnet": "cslab-10.77.1.0-24", "cidr": "10.77.1.0/24", "vnet": "csv1",
                         "zone": "cslab", "type": "subnet"}],
        },
        "cluster_status": [
            {"type": "cluster", "id": "cluster", "name": "lab", "nodes": 3, "version": 3,
             "quorate": 1},
            node("pve1", 1), node("pve2", 2), node("pve3", 3),
        ],
        "node_stats": {
            "pve1": {"maxcpu": 4, "cpu": 0.0, "maxmem": mib(1000), "mem": 0},
            "pve2": {"maxcpu": 4, "cpu": 0.0, "maxmem": mib(900), "mem": 0},
            "pve3": {"maxcpu": 64, "cpu": 0.0, "maxmem": mib(65536), "mem": 0},
        },
        "guests": [
            {"vmid": 100, "type": "qemu", "node": "pve1", "name": "web-a", "tags": "nightly"},
            {"vmid": 101, "type": "qemu", "node": "pve2", "name": "web-b", "tags": "nightly;db"},
            {"vmid": 102, "type": "qemu", "node": "pve2", "name": "other"},
            // A container holds the range's first VMID: no sandbox may take it.
            {"vmid": 9101, "type": "lxc", "node": "pve1", "name": "ct"},
        ],
    })
}

#[test]
fn a_selection_placed_by_node_auto_runs_on_two_nodes_end_to_end() {
    if !privileged(
        "a_selection_placed_by_node_auto_runs_on_two_nodes_end_to_end",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("placement", &[]);
    inside(&netns.name, || async {
        let mut fleet = Fleet::empty("ctl-placement");
        run_ip(&["link", "add", "csv1", "type", "bridge"]);
        run_ip(&["link", "set", "csv1", "up"]);
        for index in 1..=2u8 {
            let settings = serde_json::json!({
                "node": format!("pve{index}"),
                "agent_mode": "host-qemu-ga",
                "qga_allow_rpcs": ["guest-sync-delimited", "guest-ping", "guest-info",
                    "guest-get-osinfo", "guest-get-host-name", "guest-network-get-interfaces"],
            });
            fleet.add_sim_node(index, settings, |lab| {
                for vmid in [100, 101] {
                    lab.add_backup(
                        &format!("vm/{vmid}/2026-11-01T02:00:00Z"),
                        ARCHIVE,
                        MARKER,
                        8 << 20,
                    );
                }
            });
        }
        // One PBS for both nodes: the API double lists pve1's copy, which pve2's holds too.
        let pbs = ApiDouble::start(
            "pbs-api",
            &api_server_pki(&["localhost"]),
            &[
                "--root".into(),
                fleet.nodes[0].lab.root.clone().into_os_string(),
            ],
            "--tls-dir",
        );
        for node in &fleet.nodes {
            node.lab
                .settings(serde_json::json!({ "pbs_fingerprint": pbs.fingerprint }));
        }
        let pki = api_server_pki(&["localhost"]);
        let api = ApiDouble::start_in(
            "pve-api",
            &pki,
            &[],
            "--root",
            TempDir::new("pve-placement"),
        );
        std::fs::write(
            api.tls_dir().join("double.json"),
            cluster_settings().to_string(),
        )
        .unwrap();
        let dir = &fleet.dir.0;
        std::fs::write(dir.join("pve-root-ca.pem"), &pki.ca_pem).unwrap();
        let token = dir.join("pve-token");
        std::fs::write(&token, "0b1e5c1e-1111-4222-8333-944445555666\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        let secret = dir.join("pbs-password");
        std::fs::write(&secret, format!("{PBS_PASSWORD}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        // pve3 is in the inventory and online in PVE, but nothing listens on its port.
        let config = dir.join("controller.toml");
        let mut text = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n\n[pve]\napi_url = \"https://localhost:{}\"\ntoken_id = \"certistack@pve!ctl\"\ntoken_secret_file = \"pve-token\"\nca_file = \"pve-root-ca.pem\"\nsandbox_vmid_range = \"9101-9199\"\n",
            fleet.authority.dir(),
            fleet.reports_dir(),
            api.port
        );
        for (name, port) in [("pve1", 17441), ("pve2", 17442), ("pve3", 17443)] {
            text.push_str(&format!(
                "\n[[nodes]]\nname = \"{name}\"\naddress = \"127.0.0.1\"\nport = {port}\n"
            ));
        }
        std::fs::write(&config, text).unwrap();
        let plan = dir.join("nightly.yaml");
        std::fs::write(
            &plan,
            format!(
                "storage:\n  server: localhost\n  port: {}\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n  - name: web\n    node: auto\n    select: {{tags: [nightly]}}\n    snapshot: latest\n    sandbox:\n      - cores: 1\n        memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: csv1\n      probe_source: 10.77.1.2/24\n    network_recovery:\n      mode: preserve\n    timeouts:\n      run_seconds: 600\n      guest_agent_seconds: 60\n",
                pbs.port, pbs.fingerprint
            ),
        )
        .unwrap();

        // What the operator reads before the night: where each goes, and why.
        let shown = tokio::process::Command::new(binary("certistack-ctl"))
            .args(["plan", "show", plan.to_str().unwrap(), "--config"])
            .arg(&config)
            .output()
            .await
            .unwrap();
        let shown_text = String::from_utf8_lossy(&shown.stdout).into_owned();
        eprintln!("{shown_text}{}", String::from_utf8_lossy(&shown.stderr));
        assert!(shown.status.success());
        assert!(
            shown_text.contains("the nodes were asked only what placement needs"),
            "{shown_text}"
        );

        // Both nodes share the lab's one VNet bridge, so the two run one after the other.
        let mut command = fleet.ctl(&plan, &config);
        command.args(["--max-concurrent", "1"]);
        let out = tokio::process::Command::from(command)
            .output()
            .await
            .unwrap();
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        let (summaries, _) = split_output(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(out.status.code(), Some(0), "{summaries:?}");
        for (validation, node, vmid) in [("web-100", "pve1", "9102"), ("web-101", "pve2", "9103")] {
            let s = summary(&summaries, validation);
            assert_eq!(s["outcome"], "passed", "{s}");
            assert_eq!(s["node"], node, "{s}");
            assert_eq!(s["cleanup"], "complete", "{s}");
            let statement = fleet.report(s);
            let placement = statement
                .predicate
                .placement
                .as_deref()
                .expect("the report says how the node was chosen");
            assert!(placement.starts_with("node auto: "), "{placement}");
            assert!(
                placement.contains("the soonest start and most room of 2 ready"),
                "{placement}"
            );
            assert!(
                placement.contains("passed over: pve3: ")
                    && placement.contains("doctor pve3 --vnet csv1"),
                "{placement}"
            );
            assert!(
                statement
                    .predicate
                    .snapshot
                    .snapshot
                    .starts_with(&format!("vm/{}/", &validation[4..])),
                "{:?}",
                statement.predicate.snapshot
            );
            // The sandbox took the VMID the range had free, on the node placement chose.
            let lab = &fleet.nodes.iter().find(|n| n.name == node).unwrap().lab;
            let creates: Vec<serde_json::Value> = lab
                .calls()
                .into_iter()
                .filter(|call| call["tool"] == "qm" && call["argv"][0] == "create")
                .collect();
            assert_eq!(creates.len(), 1, "{creates:?}");
            assert_eq!(creates[0]["argv"][1], vmid, "{creates:?}");
        }
        // The API doubles are the test's, not the run's: stopped before the nodes are looked at.
        drop((pbs, api));
        assert!(run_tables().is_empty(), "{:?}", run_tables());
        for node in &fleet.nodes {
            assert!(
                node.residue().is_empty(),
                "{}: {:?}",
                node.name,
                node.residue()
            );
        }
    });
}
