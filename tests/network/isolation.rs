//! VNet isolation checked before anything is installed: each violated property refused by name
//! (links stacked on the VNet, legacy NAT rules, missing tools) with nothing installed, the table
//! listing `PrepareSandbox` needs, and rulesets read past 64 KiB up to the configured limit.

use super::*;

#[test]
fn isolation_refusals_name_each_property_and_install_nothing() {
    if !privileged(
        "isolation_refusals_name_each_property_and_install_nothing",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let topology = Topology::new("iso");
    let node_ns = topology.node.clone();
    let t = std::sync::Arc::new(topology);
    let topology = t.clone();
    inside(&node_ns, move || async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        type Breach = (
            &'static [&'static str],
            &'static [&'static str],
            &'static str,
        );
        let breaches: [Breach; 4] = [
            (
                &[
                    "sh",
                    "-c",
                    "ip link add eno9 type veth peer name eno9p && ip link set eno9 master csbox1 up",
                ],
                &["ip", "link", "del", "eno9"],
                "port eno9 is not a tap of this run's sandbox VMs",
            ),
            (
                &["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=1"],
                &["sysctl", "-w", "net.ipv4.conf.csbox1.forwarding=0"],
                "IPv4 forwarding is on for csbox1",
            ),
            (
                &["ip", "address", "add", "198.51.100.1/24", "dev", "csbox1"],
                &["ip", "address", "del", "198.51.100.1/24", "dev", "csbox1"],
                "csbox1 carries address 198.51.100.1/24 (a gateway)",
            ),
            (
                &[
                    "nft",
                    "add table ip snat_test; add chain ip snat_test post { type nat hook postrouting priority 100; }; add rule ip snat_test post ip saddr 198.51.100.0/24 oifname \"uplink0\" masquerade",
                ],
                &["nft", "delete table ip snat_test"],
                "a NAT rule references csbox1",
            ),
        ];
        for (make, undo, reason) in breaches {
            topology.node_sh(make);
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            assert_refused_with_nothing_installed(
                &status,
                &topology,
                &["VNet csbox1 is not isolated", reason],
            );
            topology.node_sh(undo);
        }
        // The bridge missing altogether.
        let mut other = pb::PrepareSandboxRequest {
            vnet: VNET.into(),
            probe_source: PROBE_SOURCE.into(),
        };
        other.vnet = VNET.into();
        topology.node_sh(&["ip", "link", "set", "csbox1", "name", "csboxz"]);
        let status = c.prepare_sandbox(other).await.unwrap_err();
        assert!(
            status.message().contains("bridge csbox1 does not exist"),
            "{}",
            status.message()
        );
        topology.node_sh(&["ip", "link", "set", "csboxz", "name", "csbox1"]);
        let reply = c
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            reply.resources.is_empty(),
            "nothing was done, so nothing is undone: {reply:?}"
        );
        node.stop().await;
    });
    drop(t);
}
/// Creates `name` stacked on `lower` in the node namespace: a VLAN where the kernel has 802.1Q,
/// else a macvtap (the check reads the lower device, which every stacked kind reports).
fn add_vlan_upper(topology: &Topology, lower: &str, name: &str) -> &'static str {
    let vlan = topology
        .in_ns(
            &topology.node,
            &[
                "ip", "link", "add", "link", lower, "name", name, "type", "vlan", "id", "50",
            ],
        )
        .output()
        .unwrap();
    if vlan.status.success() {
        return "vlan";
    }
    let reason = String::from_utf8_lossy(&vlan.stderr);
    assert!(
        reason.contains("Unknown device type"),
        "ip link add type vlan: {reason}"
    );
    eprintln!(
        "NOTE: this kernel has no 802.1Q (CONFIG_VLAN_8021Q); {name} is a macvtap on {lower} instead"
    );
    topology.node_sh(&[
        "ip", "link", "add", "link", lower, "name", name, "type", "macvtap",
    ]);
    "macvtap"
}

#[test]
fn links_stacked_on_the_vnet_are_refused_by_name() {
    if !privileged("links_stacked_on_the_vnet_are_refused_by_name", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("upper"), |topology| async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let kind = add_vlan_upper(&topology, "csbox1", "csbox1.50");
        topology.node_sh(&["ip", "address", "add", "192.0.2.50/24", "dev", "csbox1.50"]);
        topology.node_sh(&["ip", "link", "set", "csbox1.50", "up"]);
        let stacked: [(&str, &[&str]); 2] = [
            ("csbox1.50", &[]),
            (
                "mvl0",
                &[
                    "ip", "link", "add", "link", "csbox1", "name", "mvl0", "type", "macvlan",
                    "mode", "bridge",
                ],
            ),
        ];
        for (name, make) in stacked {
            if !make.is_empty() {
                topology.node_sh(make);
            }
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            let needle = format!("link {name} (on csbox1) is stacked on the VNet");
            assert!(
                status.message().contains(&needle),
                "{name} ({kind}): {:?} lacks {needle:?}",
                status.message()
            );
            assert_refused_with_nothing_installed(&status, &topology, &[]);
            topology.node_sh(&["ip", "link", "del", name]);
        }
        // Control: with both gone the same VNet passes.
        c.prepare_sandbox(prepare()).await.unwrap();
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
#[test]
fn prepare_sandbox_fails_without_the_table_listing() {
    if !privileged("prepare_sandbox_fails_without_the_table_listing", TOOLS) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("list"), |topology| async move {
        let real_nft = String::from_utf8(sh(&["sh", "-c", "command -v nft"]).stdout).unwrap();
        let flag = topology.dir.0.join("fail-list");
        let wrapper = topology.dir.0.join("nft");
        // Fails `nft list table` of a table that exists while the flag file is there.
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nif [ \"$1\" = list ] && [ \"$2\" = table ] && [ -e {flag} ] && {nft} list table \"$3\" \"$4\" >/dev/null 2>&1; then\n echo 'Error: cannot list (simulated)' >&2; exit 1\nfi\nexec {nft} \"$@\"\n",
                flag = flag.display(),
                nft = real_nft.trim()
            ),
        )
        .unwrap();
        sh(&["chmod", "755", wrapper.to_str().unwrap()]);
        std::fs::write(&flag, "").unwrap();

        let lab = Lab::new("netlist");
        let (_authority_dir, authority, mut config) = lab.controller_and_node_config("netlist-ctl");
        config.tools.nft = wrapper.clone();
        let (address, shutdown, task) = serve_node(config).await;
        let mut wire = grant(RUN_ID, NODE);
        wire.probe_targets = targets(true);
        let mut c = begun_run(&authority, &address, &wire).await;

        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{}", status.message());
        assert!(
            status.message().contains(
                "nft list table inet certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f failed, so the containment evidence cannot be produced: Error: cannot list (simulated)"
            ),
            "{}",
            status.message()
        );
        // The probe address was never added: the table comes first and the step failed there.
        assert!(
            !bridge_addresses(&topology).contains("198.51.100.2"),
            "{}",
            bridge_addresses(&topology)
        );
        let steps = journal_steps(&mut c, RUN_ID).await;
        assert!(
            !steps.iter().any(|s| s.starts_with("sandbox.address ")),
            "{steps:?}"
        );
        // The listing works again: Cleanup removes the table the failed step left.
        std::fs::remove_file(&flag).unwrap();
        let (receipts, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert_eq!(
            receipts,
            ["nft:certistack_0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f deleted"]
        );
        assert!(residue.is_empty(), "{residue:?}");
        assert!(
            !tables(&topology).contains("certistack_"),
            "{}",
            tables(&topology)
        );
        let _ = shutdown.send(());
        task.await.unwrap();
    });
}
#[test]
fn legacy_nat_rules_refuse_the_vnet_and_missing_tools_are_named() {
    if !privileged(
        "legacy_nat_rules_refuse_the_vnet_and_missing_tools_are_named",
        &[
            "ip",
            "nft",
            "python3",
            "iptables-legacy",
            "ip6tables-legacy",
        ],
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("legacy"), |topology| async move {
        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        // SDN's SNAT (by subnet, through iptables-legacy) and a masquerade out of the VNet.
        let rules: [(&str, &[&str]); 2] = [
            (
                "iptables-legacy",
                &[
                    "POSTROUTING",
                    "-s",
                    "198.51.100.0/24",
                    "-o",
                    "uplink0",
                    "-j",
                    "SNAT",
                    "--to-source",
                    "203.0.113.1",
                ],
            ),
            (
                "ip6tables-legacy",
                &["POSTROUTING", "-o", "csbox1", "-j", "MASQUERADE"],
            ),
        ];
        for (tool, rule) in rules {
            let mut add = vec![tool, "-t", "nat", "-A"];
            add.extend_from_slice(rule);
            topology.node_sh(&add);
            let status = c.prepare_sandbox(prepare()).await.unwrap_err();
            let named = format!(
                "a NAT rule references csbox1: -A {} (/usr/sbin/{tool}-save -t nat)",
                rule.join(" ")
            );
            assert_refused_with_nothing_installed(
                &status,
                &topology,
                &["VNet csbox1 is not isolated", &named],
            );
            // The same rule is invisible to nftables.
            let ruleset =
                String::from_utf8(topology.node_sh(&["nft", "list", "ruleset"]).stdout).unwrap();
            assert!(!ruleset.contains("csbox1") && !ruleset.contains("198.51.100.0/24"));
            add[3] = "-D";
            topology.node_sh(&add);
        }
        // Without them the VNet passes, and the evidence names every source read.
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(evidence.nat_sources.len(), 3, "{:?}", evidence.nat_sources);
        assert!(evidence.nat_sources[0].starts_with("nft list ruleset: "));
        for (source, tool) in evidence.nat_sources[1..]
            .iter()
            .zip(["iptables", "ip6tables"])
        {
            assert!(
                source.starts_with(&format!("/usr/sbin/{tool}-legacy-save -t nat: "))
                    && source.ends_with(" bytes read"),
                "{source}"
            );
        }
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;

        // Where the legacy tools are not installed, the check is skipped and says so.
        let node = Node::start_with(|config| {
            config.tools.iptables_legacy_save = "/nonexistent/iptables-legacy-save".into();
            config.tools.ip6tables_legacy_save = "/nonexistent/ip6tables-legacy-save".into();
        })
        .await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        assert_eq!(
            evidence.nat_sources[1..],
            [
                "/nonexistent/iptables-legacy-save: not installed",
                "/nonexistent/ip6tables-legacy-save: not installed"
            ]
        );
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;
    });
}
#[test]
fn rulesets_past_64_kib_are_read_up_to_the_configured_limit() {
    if !privileged(
        "rulesets_past_64_kib_are_read_up_to_the_configured_limit",
        TOOLS,
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("big"), |topology| async move {
        // A busy node: a table of its own with 3,000 rules in a chain no hook reaches.
        let mut script =
            String::from("add table inet bulk_test\nadd chain inet bulk_test filler\n");
        for n in 0..3000 {
            script.push_str(&format!(
                "add rule inet bulk_test filler ip saddr 10.{}.{}.1 tcp dport {} counter accept\n",
                n / 256,
                n % 256,
                1000 + n
            ));
        }
        let file = topology.dir.0.join("bulk.nft");
        std::fs::write(&file, script).unwrap();
        topology.node_sh(&["nft", "-f", file.to_str().unwrap()]);
        let size = topology.node_sh(&["nft", "list", "ruleset"]).stdout.len();
        assert!(size > 64 * 1024, "{size}");

        let node = Node::start(3).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let started = std::time::Instant::now();
        let evidence = c.prepare_sandbox(prepare()).await.unwrap().into_inner();
        eprintln!(
            "PrepareSandbox with a {size}-byte ruleset: {} ms; {:?}",
            started.elapsed().as_millis(),
            evidence.nat_sources
        );
        let (_, residue) = cleanup_receipts(&mut c, RUN_ID).await;
        assert!(residue.is_empty(), "{residue:?}");
        node.stop().await;

        // Past the configured limit the check cannot be completed: refused, saying why.
        let node = Node::start_with(|config| config.limits.max_ruleset_bytes = 64 * 1024).await;
        let mut c = node.run(RUN_ID, targets(true)).await;
        let status = c.prepare_sandbox(prepare()).await.unwrap_err();
        assert_refused_with_nothing_installed(
            &status,
            &topology,
            &[
                "the node's nftables ruleset is larger than the connector reads (65536 bytes, limits.max_ruleset_bytes), so the NAT check cannot be completed",
            ],
        );
        node.stop().await;
    });
}
