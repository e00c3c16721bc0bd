//! `certistack-ctl doctor --vnet` on a real bridge: the VNet, its legacy NAT, the LVM filter and
//! the firewall judged, and every check ok once the node is fixed.

use super::*;

/// `certistack-ctl doctor --vnet csbox1` on a node namespace with a real bridge, real
/// iptables-legacy and nftables, and the node's files as fixtures: warnings for what the next
/// `ifreload -a`, the LVM filter and the firewall will do (exit 0), failures for forwarding on
/// and a legacy NAT rule on the VNet (exit 1), and every new check ok once the node is fixed.
#[test]
fn doctor_judges_a_vnet_its_legacy_nat_the_lvm_filter_and_the_firewall() {
    if !privileged(
        "doctor_judges_a_vnet_its_legacy_nat_the_lvm_filter_and_the_firewall",
        &["ip", "nft", "iptables-legacy", "sysctl"],
    ) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    inside_node(Topology::new("doctor"), |topology| async move {
        let files = topology.dir.0.join("node-files");
        let sdn = files.join("interfaces.d/sdn");
        let lvm_conf = files.join("lvm.conf");
        let host_fw = files.join("nodes").join(NODE).join("host.fw");
        std::fs::create_dir_all(sdn.parent().unwrap()).unwrap();
        std::fs::create_dir_all(host_fw.parent().unwrap()).unwrap();
        // As SDN writes a Simple zone's VNet, and as PVE installs lvm.conf's filter.
        std::fs::write(
            &sdn,
            "#version:3\n\nauto csbox1\niface csbox1\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n",
        )
        .unwrap();
        std::fs::write(
            &lvm_conf,
            "devices {\n\t# global_filter = [ \"r|/dev/loop.*|\" ]\n}\ndevices {\n\tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\",\"r|/dev/nbd.*|\"]\n}\n",
        )
        .unwrap();
        std::fs::write(&host_fw, "[OPTIONS]\n\nnftables: 1\n").unwrap();
        let node = Node::start_with(|config| {
            config.pve.sdn_interfaces = sdn.clone();
            config.pve.lvm_conf = lvm_conf.clone();
            config.pve.nodes_dir = files.join("nodes");
        })
        .await;
        let (host, port) = node.address.rsplit_once(':').unwrap();
        let controller_config = topology.dir.0.join("controller.toml");
        std::fs::write(
            &controller_config,
            format!(
                "state_dir = {:?}\nreports_dir = {:?}\n[[nodes]]\nname = \"{NODE}\"\naddress = {host:?}\nport = {port}\n",
                node.authority.dir(),
                topology.dir.0.join("reports")
            ),
        )
        .unwrap();
        // The server runs on this thread's runtime: the CLI is awaited, never waited for.
        let ctl = binary("certistack-ctl");
        let doctor_with = |args: &[&str]| {
            let mut command = tokio::process::Command::new("ip");
            command
                .args(["netns", "exec", &topology.node])
                .arg(&ctl)
                .arg("doctor")
                .args(args)
                .args(["--config", controller_config.to_str().unwrap()]);
            async move {
                let out = command.output().await.unwrap();
                (
                    out.status.code().unwrap(),
                    String::from_utf8(out.stdout).unwrap(),
                )
            }
        };
        let doctor = || doctor_with(&[NODE, "--vnet", VNET]);
        let line = |out: &str, check: &str| -> String {
            out.lines()
                .find(|l| l.starts_with(&format!("{NODE} {check} ")))
                .unwrap_or_else(|| panic!("no {check} line in {out}"))
                .to_owned()
        };

        // Forwarding is off now, but the bare stanza turns it on at the next reload; the
        // loop devices pass PVE's filter; host.fw selects proxmox-firewall, but without
        // cluster.fw the datacenter firewall is off, so no tables is right. Warnings only: exit 0.
        let (code, out) = doctor().await;
        assert_eq!(code, 0, "{out}");
        assert!(
            line(&out, "vnet-forwarding").starts_with("pve1 vnet-forwarding warn ")
                && line(&out, "vnet-forwarding").ends_with(
                    "ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
                ),
            "{out}"
        );
        assert!(
            line(&out, "lvm-filter").starts_with("pve1 lvm-filter warn ")
                && line(&out, "lvm-filter").ends_with(
                    "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
                ),
            "{out}"
        );
        assert!(
            line(&out, "firewall").starts_with("pve1 firewall ok ")
                && line(&out, "firewall").contains("the datacenter firewall is off"),
            "{out}"
        );
        assert!(
            line(&out, "legacy-nat").starts_with("pve1 legacy-nat ok "),
            "{out}"
        );
        assert!(
            line(&out, "cgroup").starts_with("pve1 cgroup ok cgroup v2"),
            "{out}"
        );
        assert_eq!(
            line(&out, "qemu"),
            "pve1 qemu ok pve-qemu-kvm 10.0.2-4",
            "{out}"
        );

        // Forwarding on now, and SNAT on the VNet's subnet as SDN's Simple zone writes it: a
        // post-up line in the VNet's stanza, and a rule in iptables-legacy (where nftables does
        // not show it) that names the subnet and the uplink, never the VNet. Both fail, the
        // line and the rule are named. With the datacenter firewall on, proxmox-firewall's
        // missing tables are a warning. Exit 1.
        let snat_line = "iptables -t nat -A POSTROUTING -s '10.77.3.0/24' -o csup0 -j SNAT --to-source 192.0.2.10";
        std::fs::write(
            &sdn,
            format!(
                "#version:4\n\nauto csbox1\niface csbox1\n\taddress 10.77.3.1/24\n\tpost-up {snat_line}\n\tpost-down iptables -t nat -D POSTROUTING -s '10.77.3.0/24' -o csup0 -j SNAT --to-source 192.0.2.10\n\tpost-up iptables -t raw -I PREROUTING -i fwbr+ -j CT --zone 1\n\tpost-down iptables -t raw -D PREROUTING -i fwbr+ -j CT --zone 1\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n"
            ),
        )
        .unwrap();
        let cluster_fw = files.join("firewall").join("cluster.fw");
        std::fs::create_dir_all(cluster_fw.parent().unwrap()).unwrap();
        std::fs::write(&cluster_fw, "[OPTIONS]\n\nenable: 1\n").unwrap();
        let snat = [
            "POSTROUTING",
            "-s",
            "10.77.3.0/24",
            "-o",
            "csup0",
            "-j",
            "SNAT",
            "--to-source",
            "192.0.2.10",
        ];
        let rule = |op: &'static str| {
            let mut args = vec!["iptables-legacy", "-t", "nat", op];
            args.extend_from_slice(&snat);
            args
        };
        topology.node_sh(&rule("-A"));
        topology.node_sh(&["sysctl", "-qw", "net.ipv4.conf.csbox1.forwarding=1"]);
        let (code, out) = doctor().await;
        topology.node_sh(&rule("-D"));
        topology.node_sh(&["sysctl", "-qw", "net.ipv4.conf.csbox1.forwarding=0"]);
        assert_eq!(code, 1, "{out}");
        assert_eq!(
            line(&out, "legacy-nat"),
            format!(
                "pve1 legacy-nat fail SDN SNAT is configured on this VNet's subnet ({snat_line}), loaded in iptables-legacy as -A POSTROUTING -s 10.77.3.0/24 -o csup0 -j SNAT --to-source 192.0.2.10 (/usr/sbin/iptables-legacy-save -t nat): remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN"
            ),
            "{out}"
        );
        assert!(
            line(&out, "firewall").starts_with("pve1 firewall warn ")
                && line(&out, "firewall").contains("proxmox-firewall.service"),
            "{out}"
        );
        assert!(
            line(&out, "vnet-forwarding")
                .starts_with("pve1 vnet-forwarding fail net.ipv4.conf.csbox1.forwarding = 1 now"),
            "{out}"
        );

        // The node fixed: no SNAT, a stanza that keeps forwarding off (a method other than
        // dhcp or auto, no address), loop devices rejected, and proxmox-firewall's tables
        // loaded as cluster.fw and host.fw ask.
        std::fs::write(
            &sdn,
            "auto csbox1\niface csbox1 inet manual\n\tbridge_ports none\n\tbridge_stp off\n\tbridge_fd 0\n",
        )
        .unwrap();
        std::fs::write(
            &lvm_conf,
            "devices {\n\tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\",\"r|/dev/nbd.*|\",\"r|/dev/loop.*|\"]\n}\n",
        )
        .unwrap();
        topology.node_sh(&["nft", "add", "table", "inet", "proxmox-firewall"]);
        topology.node_sh(&["nft", "add", "table", "bridge", "proxmox-firewall-guests"]);
        let (code, out) = doctor().await;
        assert_eq!(code, 0, "{out}");
        for check in ["vnet-forwarding", "legacy-nat", "lvm-filter", "firewall"] {
            assert!(
                line(&out, check).starts_with(&format!("pve1 {check} ok ")),
                "{out}"
            );
        }
        assert!(
            line(&out, "firewall").contains("proxmox-firewall (nftables)")
                && line(&out, "firewall").contains("DROP policy"),
            "{out}"
        );
        assert!(
            line(&out, "legacy-nat").contains("0 legacy NAT rule(s), none touches csbox1"),
            "{out}"
        );

        // With a plan instead of --vnet, each node is checked with its validation's VNet.
        let secret = topology.dir.0.join("pbs-password");
        std::fs::write(&secret, "secret\n").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let plan = topology.dir.0.join("plan.yaml");
        std::fs::write(
            &plan,
            format!(
                "storage:\n  server: pbs.lab\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n  - name: web1\n    node: {NODE}\n    source_vmid: 100\n    snapshot: \"2026-11-01T02:00:00Z\"\n    archives: [{ARCHIVE}]\n    sandbox:\n      - vmid: 9101\n        cores: 1\n        memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: {VNET}\n      probe_source: {PROBE_SOURCE}\n    timeouts:\n      run_seconds: 600\n      guest_agent_seconds: 60\n    network_recovery:\n      mode: preserve\n",
                ["ab"; 32].join(":")
            ),
        )
        .unwrap();
        let (code, out) = doctor_with(&["--plan", plan.to_str().unwrap()]).await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            line(&out, "vnet-forwarding"),
            "pve1 vnet-forwarding ok forwarding is off on csbox1 and its stanza keeps it off (iface csbox1 inet manual without an address)",
            "{out}"
        );
        node.stop().await;
    });
}
