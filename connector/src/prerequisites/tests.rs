//! Tests of NodeChecks: dpkg versions, the cgroup mount, the VNet stanza and its SNAT, the
//! firewall files, the LVM filter, bounded file reads.

use super::firewall::{firewall_file_facts, host_fw_option};
use super::lvm::{lvm_filter_facts, lvm_global_filter};
use super::versions::version_token;
use super::vnet::{Stanza, interface_stanza, snat_source};
use super::*;
use crate::node::sandbox;
use certistack_core::validate::VnetName;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[test]
fn dpkg_status_gives_installed_versions_only() {
    let dir = std::env::temp_dir().join(format!("certistack-dpkg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("status");
    std::fs::write(
            &path,
            "Package: pve-manager\nStatus: install ok installed\nPriority: optional\nVersion: 9.0.6\nDescription: x\n continued\n\n\
             Package: qemu-server\nStatus: deinstall ok config-files\nVersion: 8.0.1\n\n\
             Package: other\nStatus: install ok installed\nVersion: 1.0\n",
        )
        .unwrap();
    let found = installed_versions(&path, &["pve-manager", "qemu-server"]).unwrap();
    assert_eq!(found, [("pve-manager".to_owned(), "9.0.6".to_owned())]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cgroup_version_is_what_is_mounted_on_sys_fs_cgroup() {
    let v2 = "sysfs /sys sysfs rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n";
    assert_eq!(sys_fs_cgroup_type(v2), Some("cgroup2"));
    // Hybrid: a tmpfs with v1 controllers below it and v2 only at .../unified.
    let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw,mode=755 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
    assert_eq!(sys_fs_cgroup_type(hybrid), Some("tmpfs"));
    // A later mount covers an earlier one.
    let stacked = format!("{hybrid}cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
    assert_eq!(sys_fs_cgroup_type(&stacked), Some("cgroup2"));
    assert_eq!(sys_fs_cgroup_type("proc /proc proc rw 0 0\n"), None);
}

/// SDN writes VNets as bare stanzas; a gateway or an address method changes what
/// ifupdown2 does with forwarding.
#[test]
fn the_vnet_stanza_gives_its_address_method_and_forwarding_attributes() {
    let sdn = "#version:7\n\n\
                   auto csbox1\n\
                   iface csbox1\n\
                   \tbridge_ports none\n\
                   \tbridge_stp off\n\
                   \tbridge_fd 0\n\
                   \tmtu 1500\n\n\
                   auto csnet2\n\
                   iface csnet2 inet static\n\
                   \taddress 10.0.0.1/24\n\
                   \tip-forward on\n\n\
                   auto csnet3\n\
                   iface csnet3\n\
                   \tbridge_ports none\n\
                   \tip-forward off\n\
                   \t# ip6-forward on\n\
                   \tip6-forward off\n";
    assert_eq!(
        interface_stanza(sdn, "csbox1"),
        Some(Stanza::default()),
        "a bare stanza has no method"
    );
    assert_eq!(
        interface_stanza(sdn, "csnet2"),
        Some(Stanza {
            address_method: "inet static".into(),
            ip_forward: "on".into(),
            address_present: true,
            ..Default::default()
        })
    );
    assert_eq!(
        interface_stanza(sdn, "csnet3"),
        Some(Stanza {
            ip_forward: "off".into(),
            ip6_forward: "off".into(),
            ..Default::default()
        })
    );
    // A name that only prefixes another, or appears in an attribute, is no stanza.
    assert_eq!(interface_stanza(sdn, "csbox"), None);
    assert_eq!(interface_stanza("#iface csbox1\n", "csbox1"), None);
    // The attributes of the next interface do not leak into the previous one.
    let two = "iface a\nauto b\niface b\n ip-forward on\n";
    assert_eq!(interface_stanza(two, "a"), Some(Stanza::default()));
}

/// pve-network's Simple zone writes a subnet's `snat` into the VNet's stanza; the rule names
/// the subnet and the uplink, never the VNet.
#[test]
fn the_snat_sdn_writes_into_a_vnet_stanza_is_found_with_its_subnet() {
    let sdn = "auto csbox1\n\
                   iface csbox1\n\
                   \taddress 10.7.3.1/24\n\
                   \tpost-up iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                   \tpost-down iptables -t nat -D POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                   \tpost-up iptables -t raw -I PREROUTING -i fwbr+ -j CT --zone 1\n\
                   \tpost-down iptables -t raw -D PREROUTING -i fwbr+ -j CT --zone 1\n\
                   \tbridge_ports none\n";
    let stanza = interface_stanza(sdn, "csbox1").unwrap();
    assert!(stanza.address_present);
    assert_eq!(
        stanza.snat_lines,
        ["iptables -t nat -A POSTROUTING -s '10.7.3.0/24' -o vmbr0 -j SNAT --to-source 192.0.2.10"]
    );
    assert_eq!(
        snat_source(&stanza.snat_lines[0]).as_deref(),
        Some("10.7.3.0/24")
    );
    assert_eq!(
        snat_source("iptables -t nat -A POSTROUTING -o vmbr0 -j MASQUERADE"),
        None
    );
    let listing = "*nat\n\
                       -A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10\n\
                       -A POSTROUTING -s 10.9.0.0/24 -o vmbr0 -j MASQUERADE\nCOMMIT\n";
    let vnet = <VnetName as certistack_core::validate::Validated>::validate("csbox1").unwrap();
    assert_eq!(
        sandbox::legacy_nat_rules(listing, &vnet, Some("10.7.3.0/24")),
        ["-A POSTROUTING -s 10.7.3.0/24 -o vmbr0 -j SNAT --to-source 192.0.2.10"]
    );
}

#[test]
fn the_datacenter_firewall_switch_is_read_from_cluster_fw() {
    let dir = std::env::temp_dir().join(format!("certistack-fw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (host_fw, cluster_fw) = (dir.join("host.fw"), dir.join("cluster.fw"));
    std::fs::write(&host_fw, "[OPTIONS]\nnftables: 1\n").unwrap();
    let facts = firewall_file_facts(&host_fw, &cluster_fw);
    assert_eq!(facts.nftables_option, "1");
    assert_eq!(facts.datacenter_enable_option, "");
    assert!(facts.cluster_fw_error.is_empty(), "{facts:?}");
    std::fs::write(
        &cluster_fw,
        "[OPTIONS]\n\nenable: 1\n\n[RULES]\nIN ACCEPT\n",
    )
    .unwrap();
    let facts = firewall_file_facts(&host_fw, &cluster_fw);
    assert_eq!(facts.datacenter_enable_option, "1");
    assert_eq!(facts.cluster_fw, cluster_fw.display().to_string());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_lvm_global_filter_is_read_from_the_devices_section_only() {
    let pve = "# This is an example configuration file for the LVM2 system.\n\
                   config {\n  checks = 1\n}\n\
                   devices {\n\
                   \t# global_filter = [ \"a|.*|\" ]\n\
                   \tdir = \"/dev\"\n\
                   \t# added by pve-manager to avoid scanning ZFS zvols and Ceph rbds\n\
                   \tglobal_filter=[\"r|/dev/zd.*|\",\"r|/dev/rbd.*|\"]\n\
                   }\n";
    assert_eq!(
        lvm_global_filter(pve),
        Some(vec!["r|/dev/zd.*|".to_owned(), "r|/dev/rbd.*|".to_owned()])
    );
    // Over several lines, a `#` inside a pattern is not a comment, the last setting wins.
    let multi = "devices {\n global_filter = [ \"a|/dev/sda#1|\" ]\n global_filter = [\n   \"r|/dev/loop.*|\", # loops\n   \"a|.*|\"\n ]\n}\n";
    assert_eq!(
        lvm_global_filter(multi),
        Some(vec!["r|/dev/loop.*|".to_owned(), "a|.*|".to_owned()])
    );
    // Commented out, or in another section: not set.
    assert_eq!(
        lvm_global_filter("devices {\n# global_filter = [ \"r|/dev/loop.*|\" ]\n}\n"),
        None
    );
    assert_eq!(
        lvm_global_filter("activation {\n global_filter = [ \"r|.*|\" ]\n}\n"),
        None
    );
    assert_eq!(
        lvm_global_filter("devices {\n filter = [ \"r|/dev/loop.*|\" ]\n}\n"),
        None
    );
}

#[test]
fn host_fw_options_select_the_firewall() {
    let host_fw = "[OPTIONS]\n\n# nftables: 0\nnftables: 1\nenable: 1\n\n[RULES]\n\nIN ACCEPT -p tcp -dport 22\n";
    assert_eq!(host_fw_option(host_fw, "nftables").as_deref(), Some("1"));
    assert_eq!(host_fw_option(host_fw, "enable").as_deref(), Some("1"));
    // An option in another section, or commented out, is not set.
    assert_eq!(
        host_fw_option(
            "[RULES]\nnftables: 1\n[options]\n#nftables: 1\n",
            "nftables"
        ),
        None
    );
    assert_eq!(
        parse_nft_tables(
            "table inet filter\ntable inet proxmox-firewall\ntable bridge proxmox-firewall-guests\n"
        ),
        [
            "inet filter",
            "inet proxmox-firewall",
            "bridge proxmox-firewall-guests"
        ]
    );
}

#[test]
fn a_config_file_past_its_bound_is_refused_not_cut() {
    let dir = std::env::temp_dir().join(format!("certistack-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lvm.conf");
    std::fs::write(&path, vec![b' '; MAX_CONFIG_FILE_BYTES as usize + 1]).unwrap();
    let facts = lvm_filter_facts(&path);
    assert!(!facts.found);
    assert!(facts.error.contains("larger than"), "{facts:?}");
    std::fs::write(&path, "devices { global_filter = [ \"r|.*|\" ] }").unwrap();
    assert_eq!(lvm_filter_facts(&path).patterns, ["r|.*|"]);
    assert!(
        firewall_file_facts(&dir.join("absent.fw"), &dir.join("absent-cluster.fw"))
            .host_fw_error
            .is_empty()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_version_with_foreign_characters_is_not_one() {
    assert_eq!(version_token("9.2.0 (pve)"), Some("9.2.0".into()));
    assert_eq!(version_token("1:7.2+dfsg-7"), Some("1:7.2+dfsg-7".into()));
    assert_eq!(version_token("9.0\u{1b}[31m"), None);
    assert_eq!(version_token(""), None);
}

#[tokio::test]
async fn a_hung_file_read_is_bounded_and_strands_one_thread_at_most() {
    // A FIFO without a writer blocks its reader in open(2), as a hung pmxcfs would.
    let dir = std::env::temp_dir().join(format!("certistack-hung-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("host.fw");
    let _ = std::fs::remove_file(&fifo);
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    let in_flight = Arc::new(AtomicBool::new(false));
    let bound = Duration::from_millis(300);
    let read = |in_flight: Arc<AtomicBool>, fifo: PathBuf, cluster: PathBuf| async move {
        bounded_read(&in_flight, "host.fw", bound, move || {
            firewall_file_facts(&fifo, &cluster)
        })
        .await
    };
    let started = std::time::Instant::now();
    let first = read(in_flight.clone(), fifo.clone(), dir.join("cluster.fw")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let error = first.unwrap_err();
    assert!(error.contains("did not finish within 0.3 s"), "{error}");
    // The stranded reader is still in open(2): no second thread joins it.
    let second = read(in_flight.clone(), fifo.clone(), dir.join("cluster.fw")).await;
    assert!(second.unwrap_err().contains("has not returned yet"));
    // A writer releases it; reads work again once it has returned.
    let writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    drop(writer);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while in_flight.load(Ordering::Acquire) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::remove_file(&fifo).unwrap();
    std::fs::write(&fifo, "[OPTIONS]\nnftables: 1\n").unwrap();
    let third = read(in_flight, fifo, dir.join("cluster.fw")).await.unwrap();
    assert!(third.host_fw_error.is_empty(), "{third:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
