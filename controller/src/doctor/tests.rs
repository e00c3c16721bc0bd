//! The doctor's judgements, check by check.

use super::lvm::judge_lvm_filter;
use super::network::judge_firewall;
use super::*;

fn healthy() -> pb::NodeChecksReply {
    let tool = |path: &str| pb::ToolPresence {
        path: path.into(),
        executable: true,
        error: String::new(),
    };
    pb::NodeChecksReply {
        pve_manager_version: "9.0.6".into(),
        qemu_server_version: "9.0.18".into(),
        qemu_img_version: "10.0.2".into(),
        pbs_client_version: "4.0.14".into(),
        nft: Some(tool("/usr/sbin/nft")),
        ip: Some(tool("/usr/sbin/ip")),
        overlay_free_bytes: 100_000_000_000,
        qemu_version: "10.0.2-4".into(),
        cgroup: Some(pb::CgroupFacts {
            sys_fs_cgroup_type: "cgroup2".into(),
            error: String::new(),
        }),
        forwarding_policy: "refuse".into(),
        sandbox_cpu_units: 10,
        vnet: Some(pb::VnetFacts {
            name: "csbox1".into(),
            ipv4_forwarding: "0".into(),
            ipv6_forwarding: "0".into(),
            stanza_file: "/etc/network/interfaces.d/sdn".into(),
            ..Default::default()
        }),
        legacy_nat: Some(pb::LegacyNatFacts {
            sources: vec!["/usr/sbin/iptables-legacy-save -t nat: 120 bytes read".into()],
            rule_count: 1,
            ..Default::default()
        }),
        lvm_filter: Some(pb::LvmFilterFacts {
            path: "/etc/lvm/lvm.conf".into(),
            found: true,
            patterns: vec![
                "r|/dev/zd.*|".into(),
                "r|/dev/rbd.*|".into(),
                "r|/dev/loop.*|".into(),
            ],
            error: String::new(),
        }),
        firewall: Some(pb::FirewallFacts::default()),
        virtualization: Some(pb::VirtualizationFacts {
            kvm_device: "/dev/kvm".into(),
            kvm_device_opens: true,
            cpu_virtualization_flag: "vmx".into(),
            dmi_sys_vendor: "Supermicro".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn kvm_is_judged_as_qemu_server_and_a_nested_node_need_it() {
    let (level, detail) = detail_of(&healthy(), "kvm");
    assert_eq!(level, Level::Ok, "{detail}");
    // A nested node whose outer hypervisor passes vmx through: it may still stop guests.
    let mut facts = healthy();
    let virt = facts.virtualization.as_mut().unwrap();
    virt.cpu_hypervisor_flag = true;
    virt.dmi_sys_vendor = "QEMU".into();
    virt.dmi_product_name = "Standard PC (Q35 + ICH9, 2009)".into();
    let (level, detail) = detail_of(&facts, "kvm");
    assert_eq!(level, Level::Warn, "{detail}");
    assert!(detail.contains("QEMU Standard PC"), "{detail}");
    assert!(
        detail.contains("--boot-appliance") && detail.contains("accelerator = \"tcg\""),
        "{detail}"
    );
    // A /dev/kvm from a paravirtual layer (no vmx/svm): qemu-server refuses kvm: 1.
    facts
        .virtualization
        .as_mut()
        .unwrap()
        .cpu_virtualization_flag = String::new();
    let (level, detail) = detail_of(&facts, "kvm");
    assert_eq!(level, Level::Fail, "{detail}");
    assert!(
        detail.contains("KVM virtualisation configured, but not available"),
        "{detail}"
    );
    assert!(detail.contains("opens all the same"), "{detail}");
    // Hardware virtualization but no device.
    let mut facts = healthy();
    let virt = facts.virtualization.as_mut().unwrap();
    virt.kvm_device_opens = false;
    virt.kvm_device_error = "No such file or directory (os error 2)".into();
    let (level, detail) = detail_of(&facts, "kvm");
    assert_eq!(level, Level::Fail, "{detail}");
    assert!(detail.contains("modprobe"), "{detail}");
    // A hypervisor that hides the CPU flag still names itself in the firmware.
    let mut facts = healthy();
    let virt = facts.virtualization.as_mut().unwrap();
    virt.dmi_sys_vendor = "VMware, Inc.".into();
    virt.dmi_product_name = "VMware7,1".into();
    let (level, detail) = detail_of(&facts, "kvm");
    assert_eq!(level, Level::Warn, "{detail}");
    assert!(
        detail.contains("hides the CPU's hypervisor flag"),
        "{detail}"
    );
    // Already set to TCG: the advice is the validation, not the setting.
    facts.virtualization.as_mut().unwrap().appliance_accelerator = "tcg".into();
    let (_, detail) = detail_of(&facts, "kvm");
    assert!(detail.contains("runs under TCG"), "{detail}");
    assert!(!detail.contains("--boot-appliance"), "{detail}");
    // An older connector reports nothing.
    let mut facts = healthy();
    facts.virtualization = None;
    assert_eq!(detail_of(&facts, "kvm").0, Level::Warn);
}

#[test]
fn the_appliance_boot_is_judged_against_what_a_recovery_gets() {
    assert!(
        judge(&healthy(), 0)
            .iter()
            .all(|(name, _, _)| *name != "appliance"),
        "a boot nobody asked for is no check"
    );
    let boot = |booted: bool, elapsed_ms: u64, within_secs: u32| {
        let mut facts = healthy();
        facts.appliance_boot = Some(pb::ApplianceBootFacts {
            accelerator: "auto".into(),
            within_secs,
            recovery_timeout_secs: 300,
            booted,
            elapsed_ms,
            error: if booted {
                String::new()
            } else {
                format!("the appliance did not boot within {within_secs} s and was killed")
            },
            outcome: if booted {
                pb::ApplianceBootOutcome::Booted
            } else {
                pb::ApplianceBootOutcome::TimedOut
            } as i32,
        });
        detail_of(&facts, "appliance")
    };
    let mut busy = healthy();
    busy.appliance_boot = Some(pb::ApplianceBootFacts {
        accelerator: "auto".into(),
        within_secs: 300,
        recovery_timeout_secs: 300,
        error: "another appliance boot is running on this node (one at a time)".into(),
        outcome: pb::ApplianceBootOutcome::Busy as i32,
        ..Default::default()
    });
    let (level, detail) = detail_of(&busy, "appliance");
    assert_eq!(level, Level::Fail, "{detail}");
    assert!(
        detail.contains("ask again once that boot has ended") && !detail.contains("install"),
        "{detail}"
    );
    let (level, detail) = boot(true, 11_900, 300);
    assert_eq!(level, Level::Ok, "{detail}");
    assert!(
        detail.contains("11.9 s") && detail.contains("300 s"),
        "{detail}"
    );
    // Slow against the recovery's 300 s, whatever bound was asked for.
    assert_eq!(boot(true, 150_001, 300).0, Level::Warn);
    assert_eq!(boot(true, 20_000, 30).0, Level::Ok);
    let (level, detail) = boot(false, 300_000, 300);
    assert_eq!(level, Level::Fail);
    assert!(
        detail.contains("would fail at its 300 s deadline")
            && detail.contains("accelerator = \"tcg\""),
        "{detail}"
    );
    // A short bound that passed says nothing about the recovery's.
    let (level, detail) = boot(false, 30_000, 30);
    assert_eq!(level, Level::Fail);
    assert!(!detail.contains("would fail"), "{detail}");
    assert!(detail.contains("--boot-appliance=300"), "{detail}");
}

fn detail_of(facts: &pb::NodeChecksReply, name: &str) -> (Level, String) {
    judge(facts, 0)
        .into_iter()
        .find(|(check, _, _)| *check == name)
        .map(|(_, level, detail)| (level, detail))
        .unwrap()
}

#[test]
fn qemu_and_cgroup_are_judged_for_pve_9() {
    let mut facts = healthy();
    facts.qemu_version = "9.2.0-7".into();
    assert_eq!(level_of(&facts, 0, "qemu"), Level::Warn);
    facts.qemu_version = String::new();
    facts.qemu_error = "package pve-qemu-kvm is not installed".into();
    assert_eq!(level_of(&facts, 0, "qemu"), Level::Warn);
    let mut facts = healthy();
    facts.cgroup = Some(pb::CgroupFacts {
        sys_fs_cgroup_type: "tmpfs".into(),
        error: String::new(),
    });
    let (level, detail) = detail_of(&facts, "cgroup");
    assert_eq!(level, Level::Fail);
    assert!(detail.contains("PVE 9 runs on cgroup v2 only"), "{detail}");
    // Nothing mounted there is the connector's view, not the node's cgroup version.
    facts.cgroup = Some(pb::CgroupFacts::default());
    let (level, detail) = detail_of(&facts, "cgroup");
    assert_eq!(level, Level::Warn);
    assert!(detail.contains("another mount namespace"), "{detail}");
    let mut facts = healthy();
    facts.sandbox_cpu_units = 100;
    let (level, detail) = detail_of(&facts, "cgroup");
    assert_eq!(level, Level::Warn);
    assert!(detail.contains("limits.sandbox_cpu_units"), "{detail}");
}

#[test]
fn forwarding_is_judged_now_and_after_ifreload_by_the_policy() {
    let with_vnet = |edit: &dyn Fn(&mut pb::VnetFacts), policy: &str| {
        let mut facts = healthy();
        facts.forwarding_policy = policy.into();
        edit(facts.vnet.as_mut().unwrap());
        detail_of(&facts, "vnet-forwarding")
    };
    // Off, no SDN stanza: nothing will turn it on.
    assert_eq!(with_vnet(&|_| {}, "refuse").0, Level::Ok);
    // Off now, but a bare stanza: ifupdown2 turns it on at the next reload.
    let bare = |v: &mut pb::VnetFacts| v.stanza_found = true;
    let (level, detail) = with_vnet(&bare, "refuse");
    assert_eq!(level, Level::Warn);
    assert!(
        detail.contains(
            "ifupdown2 sets forwarding=1 on reload; set sandbox.forwarding = \"disable-for-run\""
        ),
        "{detail}"
    );
    assert_eq!(with_vnet(&bare, "disable-for-run").0, Level::Ok);
    // ifupdown2's rule for what a reload writes: 0 only with a method other than dhcp or
    // auto and no address; `ip-forward off` does not keep it off on a bridge.
    let stanza = |method: &'static str, address: bool, ip_forward: &'static str| {
        move |v: &mut pb::VnetFacts| {
            v.stanza_found = true;
            v.address_method = method.into();
            v.address_present = address;
            v.ip_forward = ip_forward.into();
            v.ip6_forward = ip_forward.into();
        }
    };
    for (method, address, ip_forward, reason) in [
        ("", false, "off", "has no address method"),
        ("inet static", true, "", "has an address"),
        ("inet manual", true, "off", "has an address"),
        ("inet dhcp", false, "", "uses the dhcp method"),
        ("inet6 auto", false, "off", "uses the auto method"),
    ] {
        let (level, detail) = with_vnet(&stanza(method, address, ip_forward), "refuse");
        assert_eq!(level, Level::Warn, "{method} {address} {detail}");
        assert!(
            detail.contains(&format!(
                "iface csbox1 in /etc/network/interfaces.d/sdn {reason}: ifupdown2 sets forwarding=1 on reload"
            )),
            "{detail}"
        );
        assert_eq!(
            with_vnet(&stanza(method, address, ip_forward), "disable-for-run").0,
            Level::Ok
        );
    }
    for method in ["inet manual", "inet static", "inet6 manual"] {
        let (level, detail) = with_vnet(&stanza(method, false, ""), "refuse");
        assert_eq!(level, Level::Ok, "{detail}");
        assert_eq!(
            detail,
            format!(
                "forwarding is off on csbox1 and its stanza keeps it off (iface csbox1 {method} without an address)"
            )
        );
    }
    // On now: refused under "refuse", handled under "disable-for-run".
    let on = |v: &mut pb::VnetFacts| v.ipv6_forwarding = "1".into();
    let (level, detail) = with_vnet(&on, "refuse");
    assert_eq!(level, Level::Fail);
    assert!(
        detail.contains("net.ipv6.conf.csbox1.forwarding = 1"),
        "{detail}"
    );
    assert_eq!(with_vnet(&on, "disable-for-run").0, Level::Ok);
    // No such VNet on the node.
    let absent = |v: &mut pb::VnetFacts| {
        v.ipv4_forwarding.clear();
        v.ipv6_forwarding.clear();
    };
    assert_eq!(with_vnet(&absent, "refuse").0, Level::Fail);
    let unreadable = |v: &mut pb::VnetFacts| v.stanza_error = "cannot read".into();
    assert_eq!(with_vnet(&unreadable, "refuse").0, Level::Warn);
    // Without a VNet the check says how to ask for it.
    let mut facts = healthy();
    facts.vnet = None;
    let (level, detail) = detail_of(&facts, "vnet-forwarding");
    assert_eq!(level, Level::Ok);
    assert!(detail.contains("--vnet"), "{detail}");
}

#[test]
fn a_legacy_nat_rule_on_the_vnet_fails_with_the_rule() {
    let mut facts = healthy();
    facts.legacy_nat.as_mut().unwrap().vnet_rules = vec![
        "-A POSTROUTING -o csbox1 -j MASQUERADE (/usr/sbin/iptables-legacy-save -t nat)".into(),
    ];
    let (level, detail) = detail_of(&facts, "legacy-nat");
    assert_eq!(level, Level::Fail);
    assert!(
        detail.contains("-A POSTROUTING -o csbox1 -j MASQUERADE"),
        "{detail}"
    );
    let mut facts = healthy();
    facts.legacy_nat.as_mut().unwrap().error = "iptables-legacy-save failed".into();
    assert_eq!(level_of(&facts, 0, "legacy-nat"), Level::Fail);
    // SDN's SNAT names the subnet, not the VNet: the stanza's post-up line says so, and the
    // rule found by its subnet is named with it.
    let snat =
        "iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10";
    let mut facts = healthy();
    facts.vnet.as_mut().unwrap().snat_lines = vec![snat.into()];
    let (level, detail) = detail_of(&facts, "legacy-nat");
    assert_eq!(level, Level::Fail);
    assert_eq!(
        detail,
        format!(
            "SDN SNAT is configured on this VNet's subnet ({snat}): remove `snat` from the subnet in Datacenter → SDN → VNets, then apply SDN"
        )
    );
    let loaded = "-A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10 (/usr/sbin/iptables-legacy-save -t nat)";
    facts.legacy_nat.as_mut().unwrap().vnet_rules = vec![loaded.into()];
    let (level, detail) = detail_of(&facts, "legacy-nat");
    assert_eq!(level, Level::Fail);
    assert!(
        detail.contains(&format!(
            "({snat}), loaded in iptables-legacy as {loaded}: remove"
        )),
        "{detail}"
    );
    let (level, detail) = detail_of(&healthy(), "legacy-nat");
    assert_eq!(level, Level::Ok);
    assert!(
        detail.starts_with("1 legacy NAT rule(s), none touches csbox1"),
        "{detail}"
    );
}

#[test]
fn the_lvm_filter_must_reject_loop_devices_and_the_fix_is_printed() {
    let judged = |patterns: &[&str]| {
        judge_lvm_filter(Some(&pb::LvmFilterFacts {
            path: "/etc/lvm/lvm.conf".into(),
            found: true,
            patterns: patterns.iter().map(|p| (*p).to_owned()).collect(),
            error: String::new(),
        }))
    };
    for rejecting in [
        &["r|/dev/zd.*|", "r|/dev/rbd.*|", "r|/dev/loop.*|"][..],
        &["r|^/dev/loop|"],
        &["r/loop/"],
        &["a|/dev/sda|", "r|.*|"],
    ] {
        assert_eq!(judged(rejecting).1, Level::Ok, "{rejecting:?}");
    }
    // PVE's own filter: loop devices pass; the fix keeps its patterns.
    let (_, level, detail) = judged(&PVE_GLOBAL_FILTER);
    assert_eq!(level, Level::Warn);
    assert!(
        detail.ends_with(
            "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
        ),
        "{detail}"
    );
    // An accept-all before the reject wins (first match): the fix goes before it.
    let (_, level, detail) = judged(&["a|.*|", "r|/dev/loop.*|"]);
    assert_eq!(level, Level::Warn);
    assert!(
        detail.ends_with("global_filter = [ \"r|/dev/loop.*|\", \"a|.*|\", \"r|/dev/loop.*|\" ]"),
        "{detail}"
    );
    // Only whole loop devices rejected, not their partitions.
    assert_eq!(judged(&["r|/dev/loop[0-9]+$|"]).1, Level::Warn);
    assert_eq!(judged(&["x|foo|"]).1, Level::Warn);
    let (_, level, detail) = judge_lvm_filter(Some(&pb::LvmFilterFacts {
        path: "/etc/lvm/lvm.conf".into(),
        ..Default::default()
    }));
    assert_eq!(level, Level::Warn);
    // Without a filter, the fix is PVE's own filter (with nbd) plus the loop reject.
    assert!(
        detail.ends_with(
            "global_filter = [ \"r|/dev/zd.*|\", \"r|/dev/rbd.*|\", \"r|/dev/nbd.*|\", \"r|/dev/loop.*|\" ]"
        ),
        "{detail}"
    );
}

#[test]
fn the_firewall_in_use_is_named_with_what_it_means_for_probes() {
    let judged_with = |datacenter: &str, option: &str, table: bool| {
        judge_firewall(Some(&pb::FirewallFacts {
            host_fw: "/etc/pve/nodes/pve1/host.fw".into(),
            nftables_option: option.into(),
            proxmox_firewall_table: table,
            proxmox_firewall_guests_table: table,
            cluster_fw: "/etc/pve/firewall/cluster.fw".into(),
            datacenter_enable_option: datacenter.into(),
            ..Default::default()
        }))
    };
    let judged = |option: &str, table: bool| judged_with("1", option, table);
    let (_, level, detail) = judged("1", true);
    assert_eq!(level, Level::Ok);
    assert!(
        detail.starts_with("proxmox-firewall (nftables)")
            && detail.contains(
                "inet proxmox-firewall hooks at priorities filter-1, filter and filter+1 and its table bridge proxmox-firewall-guests at 0"
            )
            && detail.contains("DROP policy"),
        "{detail}"
    );
    let (_, level, detail) = judged("", false);
    assert_eq!(level, Level::Ok);
    assert!(
        detail.starts_with("pve-firewall (iptables-legacy)"),
        "{detail}"
    );
    let (_, level, detail) = judged("1", false);
    assert_eq!(level, Level::Warn);
    assert!(detail.contains("proxmox-firewall.service"), "{detail}");
    assert_eq!(judged("0", true).1, Level::Warn);
    // With the datacenter firewall off proxmox-firewall removes its tables: none is right.
    for datacenter in ["", "0"] {
        let (_, level, detail) = judged_with(datacenter, "1", false);
        assert_eq!(level, Level::Ok, "{detail}");
        assert!(
            detail.contains("the datacenter firewall is off (/etc/pve/firewall/cluster.fw has no enable: 1), so proxmox-firewall loads no tables"),
            "{detail}"
        );
        let (_, level, detail) = judged_with(datacenter, "1", true);
        assert_eq!(level, Level::Warn);
        assert!(detail.contains("leftovers"), "{detail}");
    }
    let (_, level, _) = judge_firewall(Some(&pb::FirewallFacts {
        cluster_fw_error: "cannot read /etc/pve/firewall/cluster.fw: permission denied".into(),
        ..Default::default()
    }));
    assert_eq!(level, Level::Warn);
    let (_, level, _) = judge_firewall(Some(&pb::FirewallFacts {
        nft_error: "nft: not found".into(),
        ..Default::default()
    }));
    assert_eq!(level, Level::Warn);
}

fn level_of(facts: &pb::NodeChecksReply, skew: i64, name: &str) -> Level {
    judge(facts, skew)
        .into_iter()
        .find(|(check, _, _)| *check == name)
        .map(|(_, level, _)| level)
        .unwrap()
}

#[test]
fn versions_are_read_by_major_and_minor() {
    assert_eq!(major_minor("9.0.6"), Some((9, 0)));
    assert_eq!(major_minor("1:7.2+dfsg-7"), Some((7, 2)));
    assert_eq!(major_minor("10"), Some((10, 0)));
    assert_eq!(major_minor(""), None);
}

#[test]
fn a_healthy_node_passes_every_check() {
    let checks = judge(&healthy(), 120);
    assert!(
        checks.iter().all(|(_, level, _)| *level == Level::Ok),
        "{checks:?}"
    );
}

#[test]
fn each_rule_fails_or_warns_as_documented() {
    let mut facts = healthy();
    facts.pve_manager_version = "8.4.1".into();
    assert_eq!(level_of(&facts, 0, "pve"), Level::Fail);
    let mut facts = healthy();
    facts.qemu_img_version = "7.2.22".into();
    assert_eq!(level_of(&facts, 0, "qemu-img"), Level::Warn);
    assert_eq!(level_of(&facts, 6_000, "clock"), Level::Warn);
    assert_eq!(level_of(&facts, -61_000, "clock"), Level::Fail);
    let mut facts = healthy();
    facts.pbs_client_version = "3.4.1".into();
    assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Fail);
    facts.pbs_client_version = "5.0.0".into();
    assert_eq!(level_of(&facts, 0, "pbs-client"), Level::Warn);
    let mut facts = healthy();
    facts.nft = Some(pb::ToolPresence {
        path: "/usr/sbin/nft".into(),
        executable: false,
        error: "/usr/sbin/nft: No such file or directory".into(),
    });
    assert_eq!(level_of(&facts, 0, "nft"), Level::Fail);
    let mut facts = healthy();
    facts.overlay_free_bytes = 19_999_999_999;
    facts.overlay_shares_pve_cluster_fs = true;
    assert_eq!(level_of(&facts, 0, "overlay-space"), Level::Warn);
    assert_eq!(level_of(&facts, 0, "overlay-disk"), Level::Warn);
    assert_eq!(level_of(&healthy(), 5_001, "clock"), Level::Warn);
    assert_eq!(level_of(&healthy(), -5_000, "clock"), Level::Ok);
}

/// A node's reply whose every text carries terminal sequences and runs far past a screen:
/// versions, tool errors, VNet and firewall facts, the machine's names.
fn hostile_facts() -> pb::NodeChecksReply {
    use certistack_core::fixtures::TERMINAL_SEQUENCES;
    let hostile = |label: &str| format!("{label}{TERMINAL_SEQUENCES}{}", "A".repeat(100_000));
    let mut facts = healthy();
    facts.pve_manager_version = hostile("9.0.6");
    facts.qemu_server_version = hostile("9.0.18");
    facts.qemu_img_version = hostile("10.0.2");
    facts.pbs_client_version = String::new();
    facts.pbs_client_error = hostile("cannot run proxmox-backup-client: ");
    facts.qemu_version = hostile("10.0.2-4");
    if let Some(nft) = facts.nft.as_mut() {
        nft.executable = false;
        nft.error = hostile("not found: ");
    }
    if let Some(vnet) = facts.vnet.as_mut() {
        vnet.ipv4_forwarding = hostile("1");
        vnet.stanza_file = hostile("/etc/network/interfaces.d/");
    }
    if let Some(lvm) = facts.lvm_filter.as_mut() {
        lvm.patterns = vec![hostile("a|")];
    }
    if let Some(virt) = facts.virtualization.as_mut() {
        virt.dmi_sys_vendor = hostile("QEMU");
        virt.cpu_virtualization_flag = hostile("vmx");
    }
    facts
}

#[test]
fn doctor_prints_no_terminal_sequence_of_the_node_and_stays_bounded() {
    use certistack_core::fixtures::acts_on_a_terminal;
    let checks: Vec<Check> = judge(&hostile_facts(), 0)
        .into_iter()
        .map(|(check, level, detail)| Check {
            node: "pve1".into(),
            check,
            level,
            detail,
        })
        .collect();
    let raw: usize = checks.iter().map(|check| check.detail.len()).sum();
    assert!(
        raw > 500_000,
        "the node's text reached the checks ({raw} bytes)"
    );
    for check in &checks {
        let line = check.line();
        assert!(!acts_on_a_terminal(&line), "{line:?}");
        assert!(line.len() < 16 * 1024, "{} bytes: {line}", line.len());
        assert!(
            line.starts_with(&format!("pve1 {} ", check.check)),
            "{line}"
        );
        let json = check.to_json().to_string();
        assert!(!acts_on_a_terminal(&json), "{json:?}");
        assert!(!json.contains("\\u001b"), "{json}");
        assert!(json.len() < 16 * 1024, "{} bytes", json.len());
    }
}
