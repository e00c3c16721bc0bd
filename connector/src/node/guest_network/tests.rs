//! Tests of guest network recovery: the profiles per stack, device names, the guestfish
//! installation check, and the quoting and line limit of what is sent to guestfish.

use super::*;

use crate::process::ToolCall;

use certistack_core::validate::{IpInterface, RunId, Vmid};

use std::collections::BTreeSet;

use std::net::IpAddr;

use std::path::Path;
use std::time::Duration;

use super::plan::{inspection_evidence, recover};
use super::profiles::ifupdown_sources_directory;
use super::session::{Session, plain_mountable, plain_path, quote};
use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};
use certistack_core::validate::Validated;

fn nic() -> SandboxNic {
    SandboxNic {
        mac: "02:aa:bb:cc:dd:ee".into(),
        address: IpInterface::validate("198.51.100.10/24").unwrap(),
    }
}

#[test]
fn the_sandbox_mac_is_stable_local_and_unicast() {
    let run = RunId::validate("0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f").unwrap();
    let vmid = Vmid::parse("t", 9100).unwrap();
    let mac = sandbox_mac(&run, vmid, 0);
    assert_eq!(mac, sandbox_mac(&run, vmid, 0));
    assert_ne!(mac, sandbox_mac(&run, vmid, 1));
    assert_ne!(mac, sandbox_mac(&run, Vmid::parse("t", 9101).unwrap(), 0));
    assert!(mac.starts_with("02:"), "{mac}");
    assert_eq!(mac.len(), 17);
}

#[test]
fn profiles_bind_the_mac_and_name_no_gateway_or_dns() {
    let nic = nic();
    let profiles = [
        networkd_profile(&nic),
        networkmanager_keyfile(&nic, "00000000-0000-4000-8000-000000000000"),
        ifupdown_stanza(&nic),
        netplan_yaml(&nic),
        ifcfg_profile(&nic),
    ];
    for profile in &profiles {
        assert!(
            profile.to_lowercase().contains("02:aa:bb:cc:dd:ee"),
            "{profile}"
        );
        let lower = profile.to_lowercase();
        for forbidden in ["gateway", "\ndns=", "nameserver", "dhcp=yes", "routes:"] {
            assert!(!lower.contains(forbidden), "{forbidden} in {profile}");
        }
    }
    assert!(profiles[0].contains("[Match]\nMACAddress=02:aa:bb:cc:dd:ee\n"));
    assert!(profiles[0].contains("Address=198.51.100.10/24\n"));
    assert!(profiles[1].contains("mac-address=02:AA:BB:CC:DD:EE\n"));
    assert!(profiles[1].contains("never-default=true\n"));
    assert!(profiles[1].contains("address1=198.51.100.10/24\n"));
    assert!(profiles[2].contains("iface cssandbox0 inet static\n    address 198.51.100.10/24\n"));
    assert!(
        networkd_link(&nic).contains("MACAddress=02:aa:bb:cc:dd:ee\n\n[Link]\nName=cssandbox0\n")
    );
    assert!(profiles[3].contains("macaddress: \"02:aa:bb:cc:dd:ee\""));
    assert!(profiles[3].contains("- \"198.51.100.10/24\""));
    assert!(profiles[4].contains("HWADDR=02:AA:BB:CC:DD:EE\nBOOTPROTO=none\n"));
    assert!(profiles[4].contains("IPADDR=198.51.100.10\nPREFIX=24\n"));
    assert!(profiles[4].contains("DEFROUTE=no\n"));
    let v6 = SandboxNic {
        mac: nic.mac.clone(),
        address: IpInterface::validate("2001:db8::10/64").unwrap(),
    };
    assert!(
        networkmanager_keyfile(&v6, "u")
            .contains("[ipv6]\nmethod=manual\naddress1=2001:db8::10/64\n")
    );
    assert!(ifupdown_stanza(&v6).contains("inet6 static"));
    // `auto` and nothing else: busybox's ifupdown brings up nothing after an
    // `allow-hotplug` line that follows an `auto` one.
    let stanza = ifupdown_stanza(&v6);
    assert!(
        stanza.contains("\nauto cssandbox0\niface cssandbox0 inet6 static\n"),
        "{stanza}"
    );
    assert!(!stanza.contains("allow-"), "{stanza}");
}

#[test]
fn a_profile_bound_to_another_mac_is_kept() {
    let nic = nic();
    assert!(networkd_fights(
        "[Match]\nName=eth0\n[Network]\nDHCP=yes\n",
        &nic
    ));
    assert!(networkd_fights(
        "[Match]\nMACAddress=02:AA:BB:CC:DD:EE\n",
        &nic
    ));
    assert!(!networkd_fights(
        "[Match]\nMACAddress=52:54:00:00:00:09\n",
        &nic
    ));
    assert!(!networkd_fights("[Match]\nName=lo\n", &nic));
    assert!(netplan_fights(
        "network:\n  ethernets:\n    eth0:\n      dhcp4: true\n",
        &nic
    ));
    assert!(!netplan_fights(
        "network:\n  ethernets:\n    storage:\n      match:\n        macaddress: \"52:54:00:00:00:09\"\n",
        &nic
    ));
    assert!(!netplan_fights("network:\n  bridges: {}\n", &nic));
    assert!(networkmanager_fights(
        "[connection]\ntype=ethernet\ninterface-name=eth0\n",
        &nic
    ));
    assert!(!networkmanager_fights(
        "[connection]\ntype=ethernet\n[ethernet]\nmac-address=52:54:00:00:00:09\n",
        &nic
    ));
    assert!(!networkmanager_fights("[connection]\ntype=wifi\n", &nic));
    assert!(ifcfg_fights("DEVICE=eth0\nONBOOT=yes\n", &nic));
    assert!(!ifcfg_fights(
        "DEVICE=eth1\nHWADDR=52:54:00:00:00:09\n",
        &nic
    ));
    assert!(!ifcfg_fights("DEVICE=lo\n", &nic));
}

#[test]
fn disabling_keeps_the_rest_of_the_file() {
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    let nm = networkmanager_disable(
        b"[connection]\nid=prod\ntype=ethernet\nautoconnect=true\n\n[ipv4]\nmethod=manual\n",
    );
    assert_eq!(
        text(nm),
        "[connection]\nautoconnect=false\nid=prod\ntype=ethernet\n#certistack-disabled# autoconnect=true\n\n[ipv4]\nmethod=manual\n"
    );
    let nm = networkmanager_disable(b"[ipv4]\nmethod=auto\n");
    assert_eq!(
        text(nm),
        "[ipv4]\nmethod=auto\n[connection]\nautoconnect=false\n"
    );
    let ifcfg = ifcfg_disable(b"DEVICE=eth0\nONBOOT=yes\nIPADDR=10.0.0.5\n");
    assert_eq!(
        text(ifcfg),
        "DEVICE=eth0\n#certistack-disabled# ONBOOT=yes\nIPADDR=10.0.0.5\nONBOOT=no\n"
    );
    let interfaces = "source /etc/network/interfaces.d/*\n\nauto lo eth0\niface lo inet loopback\n\nallow-hotplug eth0\niface eth0 inet static\n    address 10.20.0.5/24\n    gateway 10.20.0.1\n\n";
    let disabled = ifupdown_disable(interfaces.as_bytes()).unwrap();
    assert_eq!(
        text(disabled),
        "source /etc/network/interfaces.d/*\n\n#certistack-disabled# auto lo eth0\nauto lo\niface lo inet loopback\n\n#certistack-disabled# allow-hotplug eth0\n#certistack-disabled# iface eth0 inet static\n#certistack-disabled#     address 10.20.0.5/24\n#certistack-disabled#     gateway 10.20.0.1\n\n"
    );
    assert_eq!(ifupdown_disable(b"auto lo\niface lo inet loopback\n"), None);
    assert!(ifupdown_sources_directory(interfaces));
    assert!(!ifupdown_sources_directory("auto lo\n"));
}

#[test]
fn bytes_that_are_not_utf8_and_crlf_line_ends_survive_an_edit() {
    // A Latin-1 comment (0xfc, invalid UTF-8), CRLF line ends and no final newline.
    let interfaces: &[u8] =
        b"# B\xfcro\r\nauto lo\r\niface lo inet loopback\r\niface eth0 inet dhcp\r\n# \xff\xfe end";
    let disabled = ifupdown_disable(interfaces).unwrap();
    assert_eq!(
            disabled,
            b"# B\xfcro\r\nauto lo\r\niface lo inet loopback\r\n#certistack-disabled# iface eth0 inet dhcp\r\n#certistack-disabled# # \xff\xfe end"
        );
    let ifcfg = ifcfg_disable(b"NAME=\"B\xfcro\"\r\nONBOOT=yes");
    assert_eq!(
        ifcfg,
        b"NAME=\"B\xfcro\"\r\n#certistack-disabled# ONBOOT=yes\nONBOOT=no\n"
    );
    let nm = networkmanager_disable(b"[connection]\nid=B\xfcro\ntype=ethernet");
    assert_eq!(
        nm,
        b"[connection]\nautoconnect=false\nid=B\xfcro\ntype=ethernet"
    );
    let zone: &[u8] = b"<zone>\n  <short>B\xfcro</short>\n</zone>\n";
    let ports = BTreeSet::from([(80, "tcp")]);
    let source: IpAddr = "198.51.100.2".parse().unwrap();
    let out = firewalld_allow(zone, source, &ports).unwrap().unwrap();
    assert!(out.starts_with(b"<zone>\n  <short>B\xfcro</short>\n  <rule family=\"ipv4\">"));
    assert!(out.ends_with(b"  </rule>\n</zone>\n"));
}

#[test]
fn firewalld_gets_one_rich_rule_per_probe_port_and_keeps_its_own() {
    assert_eq!(
        firewalld_default_zone("# x\nDefaultZone=internal\n").unwrap(),
        "internal"
    );
    assert_eq!(firewalld_default_zone("").unwrap(), "public");
    assert!(firewalld_default_zone("DefaultZone=../../etc/passwd\n").is_err());
    let zone = "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<zone>\n  <short>Public</short>\n  <service name=\"ssh\"/>\n  <rule family=\"ipv4\">\n    <source address=\"10.0.0.0/8\"/>\n    <drop/>\n  </rule>\n</zone>\n";
    let ports = BTreeSet::from([(53, "udp"), (80, "tcp")]);
    let source: IpAddr = "198.51.100.2".parse().unwrap();
    let out = firewalld_allow(zone.as_bytes(), source, &ports)
        .unwrap()
        .unwrap();
    let out = String::from_utf8(out).unwrap();
    assert!(out.starts_with(zone.trim_end_matches("</zone>\n")), "{out}");
    assert!(out.contains("<service name=\"ssh\"/>"));
    assert!(out.contains("<source address=\"10.0.0.0/8\"/>\n    <drop/>"));
    assert!(out.contains("  <rule family=\"ipv4\">\n    <source address=\"198.51.100.2\"/>\n    <port port=\"80\" protocol=\"tcp\"/>\n    <accept/>\n  </rule>\n"));
    assert!(out.contains("<port port=\"53\" protocol=\"udp\"/>"));
    assert!(out.ends_with("</zone>\n"));
    assert_eq!(
        firewalld_allow(out.as_bytes(), source, &ports).unwrap(),
        None,
        "idempotent"
    );
    assert!(firewalld_allow(b"<zone/>", source, &ports).is_err());
}

#[test]
fn guest_device_names_are_plain_and_short() {
    assert!(plain_mountable("/dev/sda1"));
    assert!(plain_mountable("/dev/mapper/vg-root"));
    assert!(plain_mountable("/dev/vg0/lv_root"));
    assert!(!plain_mountable("/dev/sda1!touch${IFS}/x"));
    assert!(!plain_mountable("/dev/a b"));
    assert!(!plain_mountable(&format!("/dev/{}", "A".repeat(8180))));
    // btrfs subvolumes, as libguestfs names them.
    assert!(plain_mountable("btrfsvol:/dev/sda2/root"));
    assert!(plain_mountable("btrfsvol:/dev/sda/@"));
    assert!(plain_mountable("btrfsvol:/dev/sda/@/.snapshots/1/snapshot"));
    assert!(!plain_mountable("btrfsvol:/dev/sda"));
    assert!(!plain_mountable("btrfsvol:/dev/sda/../x"));
    assert!(!plain_mountable("btrfsvol:/dev/../x"));
    assert!(!plain_mountable("btrfsvol:/dev/./sda/@"));
    assert!(!plain_mountable("btrfsvol:/dev/sda/"));
    assert!(!plain_mountable("btrfsvol:/dev/sda//@"));
    assert!(!plain_mountable("btrfsvol:/dev/sda/@ x"));
    assert!(!plain_mountable("btrfsvol:/dev/sda/@\n!touch /x"));
    assert!(!plain_mountable("/dev/sda/@"));
}

#[test]
fn a_missing_or_non_executable_guestfish_is_named_with_what_to_install() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("guestfish-check-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    let missing = dir.join("guestfish");
    let error = guestfish_installed(&missing).unwrap_err();
    assert!(error.contains("install libguestfs-tools"), "{error}");
    assert!(error.contains("nothing was written"), "{error}");
    std::fs::write(&missing, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&missing, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(
        guestfish_installed(&missing)
            .unwrap_err()
            .contains("not an executable file")
    );
    std::fs::set_permissions(&missing, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(guestfish_installed(&missing), Ok(()));
    assert!(guestfish_installed(&dir).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_command_sent_to_guestfish_comes_near_its_line_limit() {
    // The largest guest file recovery writes, of the bytes that quote the longest.
    let content = vec![0xffu8; MAX_GUEST_FILE_BYTES as usize];
    let path = format!("/{}", "a".repeat(255));
    for chunk in content.chunks(WRITE_CHUNK_BYTES) {
        let line = format!("write-append {} {}", quote(path.as_bytes()), quote(chunk));
        assert!(line.len() <= MAX_COMMAND_BYTES, "{}", line.len());
    }
}

#[tokio::test]
async fn a_command_guestfish_would_split_is_never_sent() {
    let mut session =
        Session::start(ToolCall::new("/bin/cat", Duration::from_secs(5))).expect("cat starts");
    for command in [
        format!("-mount-ro \"/dev/{}!touch /x\" \"/srv\"", "A".repeat(8180)),
        "is-file /etc\n!touch /x".to_owned(),
        "is-file /etc\r!touch /x".to_owned(),
    ] {
        match session.ask(&[command]).await {
            Err(RecoveryError::Tool(why)) => assert!(why.contains("would split it"), "{why}"),
            other => panic!("sent: {other:?}"),
        }
    }
}

#[test]
fn guest_text_never_leaves_its_quoted_argument() {
    assert_eq!(
        quote(b"a\"b\\c\nd\te\x01\xff"),
        "\"a\\\"b\\\\c\\nd\\te\\x01\\xff\""
    );
    assert!(plain_path("/etc/netplan/50-cloud-init.yaml"));
    assert!(!plain_path("/etc/netplan/a b.yaml"));
    assert!(!plain_path("/etc/netplan/a\nb.yaml"));
    assert!(!plain_path("etc/x"));
    assert!(!plain_path("/etc/../root"));
}

#[test]
fn a_mountpoint_that_climbs_or_stays_put_is_not_plain() {
    assert!(plain_path("/"));
    assert!(plain_path("/var/lib"));
    assert!(plain_path("/srv/.hidden"));
    for climbing in [
        "/..",
        "/etc/..",
        "/.",
        "/etc/.",
        "/./etc",
        "/var/../..",
        "/var/./lib",
    ] {
        assert!(!plain_path(climbing), "{climbing} passed");
    }
}

/// guestfish (and the appliance's QEMU, which inherits what guestfish has) gets stdio and
/// nothing else of the daemon's: a descriptor the daemon holds without close-on-exec does
/// not reach it.
#[tokio::test]
async fn guestfish_inherits_no_descriptor_of_the_daemon() {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open("/dev/null").expect("/dev/null");
    let leaked = rustix::io::dup(&file).expect("dup");
    rustix::io::fcntl_setfd(&leaked, rustix::io::FdFlags::empty()).expect("clear cloexec");
    let mut session = Session::start(
        ToolCall::new("/bin/sh", Duration::from_secs(5))
            .arg("-c")
            .arg("while read -r line; do eval \"$line\"; done"),
    )
    .expect("sh starts");
    let answers = session
        .ask_text(&["ls /proc/self/fd | tr '\\n' ' '; echo".into()])
        .await
        .expect("answers");
    let open: Vec<i32> = answers[0]
        .split_whitespace()
        .filter_map(|fd| fd.parse().ok())
        .collect();
    // ls itself opens one descriptor (the directory it lists) above stdio: 3.
    assert!(leaked.as_raw_fd() > 3, "{}", leaked.as_raw_fd());
    assert!(
        !open.contains(&leaked.as_raw_fd()),
        "descriptor {} reached the tool: {open:?}",
        leaked.as_raw_fd()
    );
    assert!(open.iter().all(|fd| *fd <= 3), "{open:?}");
    drop(leaked);
}

#[test]
fn the_confined_unit_runs_the_appliance_unprivileged_with_two_devices_and_the_overlay_bound_in() {
    use super::confinement::{ApplianceUser, OVERLAY_IN_UNIT, session_properties};
    let dir = std::env::temp_dir().join(format!("appliance-user-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    let passwd = dir.join("passwd");
    std::fs::write(
        &passwd,
        "root:x:0:0:root:/root:/bin/bash\ncertistack-guestnet:x:995:993::/nonexistent:/usr/sbin/nologin\nbadroot:x:0:5::/:/bin/sh\n",
    )
    .unwrap();
    let user = ApplianceUser::lookup(&passwd, "certistack-guestnet").unwrap();
    assert_eq!((user.uid, user.gid), (995, 993));
    assert!(
        ApplianceUser::lookup(&passwd, "badroot")
            .unwrap_err()
            .contains("must run unprivileged")
    );
    assert!(
        ApplianceUser::lookup(&passwd, "nobody-here")
            .unwrap_err()
            .contains("systemd-sysusers")
    );
    let overlay = Path::new("/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2");
    let appliance = Appliance {
        timeout: Duration::from_secs(60),
        memory_mib: 512,
        accelerator: crate::config::ApplianceAccelerator::Auto,
    };
    let unit = guest_network_unit(
        &certistack_core::validate::RunId::validate("5a1c2f00-0000-4000-8000-000000000001")
            .unwrap(),
        Vmid::parse("t", 9100).unwrap(),
        512,
    )
    .unwrap();
    let confined = Confinement {
        user: user.clone(),
        loop_device: "/dev/loop7".into(),
        kvm_device: "/dev/kvm".into(),
        launcher: "/usr/bin/certistack-connector".into(),
    };
    let call = guestfish_call(
        Path::new("/usr/bin/guestfish"),
        overlay,
        &appliance,
        Some((&unit, &confined)),
        Path::new("/usr/bin/systemd-run"),
        Path::new("/usr/bin/systemctl"),
    )
    .unwrap();
    let args: Vec<String> = call
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let properties: Vec<&str> = args
        .windows(2)
        .filter(|w| w[0] == "--property")
        .map(|w| w[1].as_str())
        .collect();
    for wanted in [
        "User=certistack-guestnet",
        "CapabilityBoundingSet=",
        "NoNewPrivileges=yes",
        "PrivateNetwork=yes",
        "IPAddressDeny=any",
        "PrivateDevices=yes",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/loop7 r",
        "DeviceAllow=/dev/kvm rw",
        "ProtectSystem=strict",
        "SystemCallFilter=@system-service",
        "TemporaryFileSystem=/tmp:size=512M,mode=1777",
        "BindPaths=/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2:/tmp/disk.qcow2",
    ] {
        assert!(
            properties.contains(&wanted),
            "{wanted} missing: {properties:?}"
        );
    }
    // Nothing makes the loop device writable, and guestfish sees only the bound overlay.
    assert!(
        !properties
            .iter()
            .any(|p| p.starts_with("DeviceAllow=/dev/loop7 rw"))
    );
    let guestfish_args = &args[args.iter().position(|a| a == "--").unwrap() + 1..];
    // The launcher that forbids loop ioctls starts guestfish.
    assert_eq!(
        guestfish_args,
        [
            "/usr/bin/certistack-connector",
            "appliance-exec",
            "/usr/bin/guestfish",
            "--format=qcow2",
            "-a",
            OVERLAY_IN_UNIT
        ]
    );
    // An appliance boot without a disk (doctor's check) has neither of the disk's devices.
    let diskless = session_properties(&user, None, Path::new("/dev/kvm"));
    assert!(
        !diskless
            .iter()
            .any(|p| p.contains("/dev/loop") || p.contains(OVERLAY_IN_UNIT))
    );
    assert!(diskless.contains(&"User=certistack-guestnet".to_owned()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_overlay_goes_to_the_appliance_user_and_back() {
    use super::confinement::{ApplianceUser, OverlayHandover};
    use std::os::unix::fs::MetadataExt;
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED the_overlay_goes_to_the_appliance_user_and_back: needs root (chown)");
        assert!(std::env::var_os("CERTISTACK_REQUIRE_PRIVILEGED_TESTS").is_none());
        return;
    }
    let dir = std::env::temp_dir().join(format!("handover-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    let overlay = dir.join("overlay.qcow2");
    std::fs::write(&overlay, b"qcow2").unwrap();
    let owner = |p: &Path| {
        let meta = std::fs::metadata(p).unwrap();
        (meta.uid(), meta.gid())
    };
    let before = owner(&overlay);
    let user = ApplianceUser {
        name: "appliance".into(),
        uid: 64123,
        gid: 64124,
    };
    let handover = OverlayHandover::give(&overlay, &user).unwrap();
    assert_eq!(owner(&overlay), (64123, 64124));
    handover.give_back().unwrap();
    assert_eq!(owner(&overlay), before);
    // Dropped without give_back (a failed session): given back all the same.
    drop(OverlayHandover::give(&overlay, &user).unwrap());
    assert_eq!(owner(&overlay), before);
    // A symlink is not handed over.
    let link = dir.join("link.qcow2");
    std::os::unix::fs::symlink(&overlay, &link).unwrap();
    assert!(OverlayHandover::give(&link, &user).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_guests_product_name_reaches_the_evidence_escaped_and_bounded() {
    let product = format!("Arch Linux{TERMINAL_SEQUENCES}{}", "A".repeat(100_000));
    let answers: Vec<String> = ["linux", "archlinux", "0", "0", product.as_str()]
        .map(|answer| format!("{answer}\n"))
        .to_vec();
    let evidence = inspection_evidence(&answers);
    assert!(
        !acts_on_a_terminal(&evidence.product_name),
        "{:?}",
        evidence.product_name
    );
    assert!(
        evidence
            .product_name
            .starts_with("Arch Linux\\u{1b}[1A\\u{1b}[2Kverdict: passed"),
        "{}",
        evidence.product_name
    );
    assert!(
        evidence.product_name.chars().count() < certistack_core::untrusted::MAX_VALUE_CHARS + 32,
        "{} characters",
        evidence.product_name.chars().count()
    );
    assert_eq!(
        (
            evidence.os_type.as_str(),
            evidence.distro.as_str(),
            evidence.version.as_str()
        ),
        ("linux", "archlinux", "0.0")
    );
    // The journal and the reply carry the evidence as JSON and protobuf: nothing to unescape.
    let journaled = serde_json::to_string(&evidence).unwrap();
    assert!(!journaled.contains("\\u001b"), "{journaled}");
}

/// guestfish as recovery drives it, for the answers of its first batches: `echo` prints its
/// argument (guestfish(1) "echo"), `inspect-os` one root a line (guestfish(1)
/// "inspect-os"), here two roots, one a btrfs subvolume whose name is the guest's choice.
const TWO_HOSTILE_ROOTS: &str = r#"while IFS= read -r line; do
  case "$line" in
    "echo "*) printf '%s\n' "${line#echo }" ;;
    inspect-os) printf 'btrfsvol:/dev/sda/\033[1A\033[2Kverdict: passed\033]52;c;aGk=\007\302\233\342\200\256%0800d\n/dev/sdb1\n' 0 ;;
  esac
done"#;

#[tokio::test]
async fn the_guests_root_names_reach_a_refusal_escaped_and_bounded() {
    let call = ToolCall::new("/bin/sh", Duration::from_secs(10))
        .arg("-c")
        .arg(TWO_HOSTILE_ROOTS);
    let mut session = Session::start(call).expect("sh starts");
    let source: IpAddr = "198.51.100.2".parse().unwrap();
    let error = recover(&mut session, &nic(), "u", source, &BTreeSet::new())
        .await
        .unwrap_err();
    let RecoveryError::Unrecognized(reason) = &error else {
        panic!("{error:?}");
    };
    assert!(reason.contains("2 operating systems"), "{reason}");
    assert!(
        reason.contains("btrfsvol:/dev/sda/\\u{1b}[1A\\u{1b}[2Kverdict: passed"),
        "{reason}"
    );
    assert!(!acts_on_a_terminal(reason), "{reason:?}");
    assert!(reason.len() < 1024, "{} bytes: {reason}", reason.len());
}
