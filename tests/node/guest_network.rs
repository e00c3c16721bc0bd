//! Guest network recovery against real libguestfs: ext4 images made from directory trees that
//! libguestfs inspection takes for Debian (ifupdown), Ubuntu (netplan), Fedora
//! (NetworkManager, firewalld) and Arch (systemd-networkd), each served by the PBS double on a
//! real loop device, overlaid with qemu-img, recovered by the connector, then read back through
//! libguestfs. Each appliance boot costs tens of seconds under TCG: the four recoveries share
//! one run, and one read-back session reads all four overlays.

use super::*;
use certistack_connector::config::Config;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[path = "guest_network/refusals.rs"]
mod refusals;

pub(crate) const GUESTFS_TOOLS: &[&str] =
    &["losetup", "qemu-img", "guestfish", "mkfs.ext4", "python3"];
/// What the btrfs image needs besides: its root is a subvolume, made in a mount namespace of
/// the test's own.
const BTRFS_TOOLS: &[&str] = &["mkfs.btrfs", "btrfs", "unshare", "mount"];
/// MAC of a second production NIC: profiles bound to it must be kept.
const OTHER_MAC: &str = "52:54:00:00:00:09";
pub(crate) const IMAGE_BYTES: u64 = 64 << 20;
/// One appliance at a time: each takes a core under TCG and over a GiB. The recoveries run
/// beside the other node tests, whose loop devices, labs and runs are their own (every check
/// here filters by this lab's paths), so they need not wait for them.
static APPLIANCES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A directory tree as (path, content) pairs; paths ending in `/` are directories, contents
/// starting with `->` symlinks. Contents are written Latin-1: a character U+0080..U+00FF is
/// that one byte, so a tree can hold a guest file that is not UTF-8.
pub(crate) type Tree = &'static [(&'static str, &'static str)];

pub(crate) const BASE: Tree = &[
    ("bin/", ""),
    ("sbin/", ""),
    ("usr/bin/", ""),
    ("usr/sbin/", ""),
    ("usr/lib/", ""),
    ("var/", ""),
    ("tmp/", ""),
    ("root/", ""),
    ("etc/fstab", "/dev/sda / ext4 defaults 0 1\n"),
    ("etc/hostname", "restored\n"),
];

pub(crate) const DEBIAN: Tree = &[
    (
        "etc/os-release",
        "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\nVERSION_ID=\"12\"\nVERSION=\"12 (bookworm)\"\nID=debian\n",
    ),
    ("etc/debian_version", "12.5\n"),
    ("sbin/ifup", "#!/bin/sh\n"),
    ("etc/network/interfaces", DEBIAN_INTERFACES),
    // A NUL byte: guestfish reads it as a shorter text, so recovery must leave it alone.
    (
        "etc/network/interfaces.d/legacy",
        "auto eth1\niface eth1 inet dhcp\n\0# generated\n",
    ),
];

/// A Latin-1 comment (the byte 0xfc is not UTF-8) that must survive the edit byte for byte.
const DEBIAN_INTERFACES: &str = "# B\u{fc}ro-Netz\nsource /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n\nallow-hotplug eth0\niface eth0 inet static\n    address 10.20.0.5/24\n    gateway 10.20.0.1\n";

/// Root on the btrfs subvolume `@` (see [`store_image`]), and the subvolume `@srv` mounted on
/// `/srv`, which in `@` is a symlink to `/etc`: followed by the appliance's kernel, the mount
/// would land on the appliance's own `/etc`, outside the guest's tree.
const BTRFS: Tree = &[
    (
        "etc/fstab",
        "/dev/sda / btrfs subvol=@ 0 0\n/dev/sda /srv btrfs subvol=@srv 0 0\n",
    ),
    ("srv", "->/etc"),
];

/// A systemd-networkd guest with a name holding a line break: listed one path a line, it
/// would read as `/etc/systemd/network/25-lab` (a file networkd ignores) and `.network`.
const HOSTILE_NAME: Tree = &[
    ("etc/systemd/network/25-lab\n.network", "[Match]\nName=*\n"),
    ("etc/systemd/network/25-lab", "[Match]\nName=*\n"),
];

const UBUNTU: Tree = &[
    (
        "etc/os-release",
        "PRETTY_NAME=\"Ubuntu 24.04 LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"24.04\"\nVERSION=\"24.04 LTS (Noble Numbat)\"\nID=ubuntu\nID_LIKE=debian\n",
    ),
    ("etc/debian_version", "trixie/sid\n"),
    (
        "etc/netplan/50-cloud-init.yaml",
        "network:\n  version: 2\n  ethernets:\n    eth0:\n      addresses: [10.30.0.5/24]\n      routes:\n        - to: default\n          via: 10.30.0.1\n      nameservers:\n        addresses: [10.30.0.53]\n",
    ),
    (
        "etc/netplan/60-storage.yaml",
        "network:\n  version: 2\n  ethernets:\n    storage:\n      match:\n        macaddress: \"52:54:00:00:00:09\"\n      addresses: [10.99.0.5/24]\n",
    ),
];

const FEDORA: Tree = &[
    (
        "etc/os-release",
        "NAME=\"Fedora Linux\"\nVERSION=\"40 (Server Edition)\"\nID=fedora\nVERSION_ID=40\nPRETTY_NAME=\"Fedora Linux 40 (Server Edition)\"\n",
    ),
    ("etc/redhat-release", "Fedora release 40 (Forty)\n"),
    ("usr/sbin/NetworkManager", "#!/bin/sh\n"),
    ("etc/NetworkManager/NetworkManager.conf", "[main]\n"),
    (
        "etc/NetworkManager/system-connections/prod.nmconnection",
        "[connection]\nid=prod\nuuid=5fb06bd0-0bb0-7ffb-45f1-d6edd65f3e03\ntype=ethernet\ninterface-name=eth0\n\n[ipv4]\nmethod=manual\naddress1=10.40.0.5/24,10.40.0.1\ndns=10.40.0.53;\n",
    ),
    (
        "etc/NetworkManager/system-connections/storage.nmconnection",
        "[connection]\nid=storage\ntype=ethernet\n\n[ethernet]\nmac-address=52:54:00:00:00:09\n\n[ipv4]\nmethod=manual\naddress1=10.99.0.5/24\n",
    ),
    (
        "etc/sysconfig/network-scripts/ifcfg-eth0",
        "DEVICE=eth0\nBOOTPROTO=none\nONBOOT=yes\nIPADDR=10.40.0.5\nPREFIX=24\nGATEWAY=10.40.0.1\n",
    ),
    (
        "etc/firewalld/firewalld.conf",
        "# firewalld config file\nDefaultZone=internal\n",
    ),
    (
        "etc/firewalld/zones/internal.xml",
        "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<zone>\n  <short>Internal</short>\n  <service name=\"ssh\"/>\n  <service name=\"mdns\"/>\n  <rule family=\"ipv4\">\n    <source address=\"10.0.0.0/8\"/>\n    <service name=\"http\"/>\n    <accept/>\n  </rule>\n</zone>\n",
    ),
];

const ARCH: Tree = &[
    (
        "etc/os-release",
        "NAME=\"Arch Linux\"\nPRETTY_NAME=\"Arch Linux\"\nID=arch\nBUILD_ID=rolling\n",
    ),
    ("etc/arch-release", ""),
    (
        "etc/systemd/network/20-wired.network",
        "[Match]\nName=en*\n\n[Network]\nAddress=10.50.0.5/24\nGateway=10.50.0.1\nDNS=10.50.0.53\n",
    ),
    (
        "etc/systemd/network/30-storage.network",
        "[Match]\nMACAddress=52:54:00:00:00:09\n\n[Network]\nAddress=10.99.0.5/24\n",
    ),
    (
        "etc/systemd/system/multi-user.target.wants/systemd-networkd.service",
        "->/usr/lib/systemd/system/systemd-networkd.service",
    ),
];

/// An os-release whose `PRETTY_NAME` (libguestfs's product name) carries terminal sequences
/// (cursor up, erase line, a clipboard write, a hyperlink) and runs far past a screen: it
/// must reach the evidence escaped and bounded. Laid over [`ARCH`]'s.
const HOSTILE_OS_RELEASE: Tree = &[(
    "etc/os-release",
    concat!(
        "NAME=\"Arch Linux\"\nID=arch\nBUILD_ID=rolling\n",
        "PRETTY_NAME=\"Arch Linux\u{1b}[1A\u{1b}[2Kverdict: passed\u{1b}]52;c;aGk=\u{7}\u{1b}]8;;http://x\u{7}link\u{1b}]8;;\u{7}",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "\"\n",
    ),
)];

/// A Debian without any network configuration recovery knows.
const BARE: Tree = &[(
    "etc/os-release",
    "NAME=\"Debian GNU/Linux\"\nVERSION_ID=\"12\"\nID=debian\n",
)];

fn write_tree(dir: &Path, trees: &[Tree]) {
    for tree in trees {
        for (path, content) in tree.iter() {
            let target = dir.join(path);
            if path.ends_with('/') {
                std::fs::create_dir_all(&target).unwrap();
                continue;
            }
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            if let Some(link) = content.strip_prefix("->") {
                std::os::unix::fs::symlink(link, &target).unwrap();
            } else {
                std::fs::write(&target, latin1(content)).unwrap();
            }
        }
    }
}

fn latin1(text: &str) -> Vec<u8> {
    text.chars()
        .map(|c| u8::try_from(u32::from(c)).expect("a tree holds Latin-1 text"))
        .collect()
}

/// Replaces the backup `archive` of the lab's snapshot with an ext4 image of `trees`, or a
/// btrfs image whose subvolume `@` holds them when their fstab says so.
pub(crate) fn store_image(lab: &Lab, archive: &str, trees: &[Tree]) {
    let tree = lab.root.join(format!("tree-{archive}"));
    write_tree(&tree, trees);
    let image = lab.root.join("pbs/store1").join(SNAPSHOT).join(archive);
    let file = std::fs::File::create(&image).unwrap();
    file.set_len(IMAGE_BYTES).unwrap();
    drop(file);
    if std::fs::read_to_string(tree.join("etc/fstab"))
        .unwrap()
        .contains(" btrfs ")
    {
        let made = std::process::Command::new("mkfs.btrfs")
            .args(["-q", "-f", "--mixed"])
            .arg(&image)
            .output()
            .unwrap();
        assert!(made.status.success(), "{made:?}");
        // mkfs.btrfs of this btrfs-progs cannot make subvolumes: mounted once, in a mount
        // namespace of its own, by the test (never by the connector).
        let mount = lab.root.join(format!("mnt-{archive}"));
        std::fs::create_dir_all(&mount).unwrap();
        let filled = std::process::Command::new("unshare")
            .args(["-m", "sh", "-ec"])
            .arg("mount -o loop \"$1\" \"$2\"; btrfs -q subvolume create \"$2/@\"; btrfs -q subvolume create \"$2/@srv\"; cp -a \"$3/.\" \"$2/@/\"; umount \"$2\"")
            .arg("sh")
            .arg(&image)
            .arg(&mount)
            .arg(&tree)
            .output()
            .unwrap();
        assert!(filled.status.success(), "{filled:?}");
        return;
    }
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sha256_of(path: &str) -> String {
    let mut file = std::fs::File::open(path).unwrap();
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).unwrap();
    hex::encode(hasher.finalize())
}

/// A run over `archives` (one sandbox VM per archive, 9100 upwards), with the connector's
/// config adjusted by `configure`.
async fn begin(
    tag: &str,
    images: &[(&str, &[Tree])],
    configure: impl FnOnce(&Lab, &mut Config),
) -> Run {
    let serial = APPLIANCES.lock().await;
    let lab = Lab::new(tag);
    for (archive, trees) in images {
        lab.add_backup(SNAPSHOT, archive, b"", IMAGE_BYTES);
        store_image(&lab, archive, trees);
    }
    let (authority_dir, authority, mut config) =
        lab.controller_and_node_config(&format!("{tag}-ctl"));
    // Appliances boot under TCG on a machine other builds share: room for a slow boot.
    config.limits.guest_network_timeout_secs = 900;
    config.guest_network.accelerator = appliance_accelerator(&lab);
    configure(&lab, &mut config);
    let (address, shutdown, task) = serve_node(config).await;
    let mut wire = grant(RUN_ID, NODE);
    wire.archives = images.iter().map(|(a, _)| (*a).to_owned()).collect();
    wire.sandbox_vms = (0..images.len() as u32)
        .map(|i| pb::SandboxVm {
            vmid: 9100 + i,
            max_cores: 1,
            max_memory_mib: 256,
        })
        .collect();
    // The guest serves HTTP and DNS on the granted guest address; SSH is probed too.
    wire.probe_targets.extend([
        pb::ProbeTarget {
            kind: pb::ProbeKind::Http as i32,
            address: TARGET.into(),
            port: 80,
            expect: None,
        },
        pb::ProbeTarget {
            kind: pb::ProbeKind::Dns as i32,
            address: TARGET.into(),
            port: 53,
            expect: None,
        },
    ]);
    let client = begun_run(&authority, &address, &wire).await;
    Run {
        lab,
        client,
        address,
        shutdown: Some(shutdown),
        task: Some(task),
        _authority_dir: authority_dir,
        _serial: serial,
    }
}

impl Run {
    /// Maps `archive` and overlays it for `vmid`; the loop device's path.
    async fn map_and_overlay_archive(&mut self, archive: &str, vmid: u32) -> String {
        let device = self
            .client
            .map_backup(map_request(archive, PBS_PASSWORD))
            .await
            .unwrap()
            .into_inner()
            .loop_device;
        self.client
            .create_overlay(pb::CreateOverlayRequest {
                vmid,
                archive: archive.into(),
            })
            .await
            .unwrap();
        device
    }

    async fn recover(
        &mut self,
        vmid: u32,
        archive: &str,
        mode: pb::NetworkRecoveryMode,
    ) -> Result<pb::RecoverGuestNetworkReply, tonic::Status> {
        self.client
            .recover_guest_network(pb::RecoverGuestNetworkRequest {
                vmid,
                archive: archive.into(),
                mode: mode as i32,
            })
            .await
            .map(|r| r.into_inner())
    }

    fn overlay(&self, vmid: u32, archive: &str) -> PathBuf {
        let stem = archive.strip_suffix(".img").unwrap();
        self.lab
            .root
            .join("overlays")
            .join(RUN_ID)
            .join(format!("{vmid}-{stem}.qcow2"))
    }
}

/// A guest file read back: its SHA-256 (of every byte) and its text as guestfish prints it
/// (to its first NUL byte).
struct ReadBack {
    sha256: String,
    bytes: Vec<u8>,
}

/// Reads files of several overlays (each with the mountable of its root, `{disk}` standing
/// for its device) in one read-only libguestfs session: for each overlay, each path's content
/// (`None` when it is not a file).
/// The session boots its appliance as the connector's does here (`accelerator`): under TCG
/// where KVM cannot be trusted to run it.
fn read_back(
    overlays: &[(PathBuf, &str, &[&str])],
    accelerator: certistack_connector::config::ApplianceAccelerator,
) -> Vec<Vec<Option<ReadBack>>> {
    // Bounded, so that an appliance that never finishes fails the test instead of hanging it.
    let mut command = std::process::Command::new("timeout");
    command.args(["--kill-after=10", "900", "guestfish"]);
    command.env("LIBGUESTFS_BACKEND", "direct").arg("--ro");
    if accelerator == certistack_connector::config::ApplianceAccelerator::Tcg {
        command.env("LIBGUESTFS_BACKEND_SETTINGS", "force_tcg");
    }
    let mut script = String::from("run\n");
    for (i, (overlay, root, paths)) in overlays.iter().enumerate() {
        command.arg("--format=qcow2").arg("-a").arg(overlay);
        let device = format!("/dev/sd{}", char::from(b'a' + i as u8));
        script.push_str(&format!("mount-ro {} /\n", root.replace("{disk}", &device)));
        for (j, path) in paths.iter().enumerate() {
            script.push_str(&format!(
                "echo @@{i}-{j}@@\nis-file {path}\n-checksum sha256 {path}\n-cat {path}\n"
            ));
        }
        script.push_str("umount-all\n");
    }
    script.push_str("echo @@end@@\n");
    let mut child = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = out.stdout;
    let find =
        |haystack: &[u8], needle: &[u8]| haystack.windows(needle.len()).position(|w| w == needle);
    assert!(
        find(&stdout, b"@@end@@").is_some(),
        "guestfish read-back failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&stdout)
    );
    overlays
        .iter()
        .enumerate()
        .map(|(i, (_, _, paths))| {
            (0..paths.len())
                .map(|j| {
                    let marker = format!("@@{i}-{j}@@\n");
                    let start = find(&stdout, marker.as_bytes()).unwrap() + marker.len();
                    let rest = &stdout[start..];
                    let answer = &rest[..find(rest, b"@@").unwrap()];
                    let newline = find(answer, b"\n").unwrap();
                    if &answer[..newline] != b"true" {
                        return None;
                    }
                    let answer = &answer[newline + 1..];
                    let newline = find(answer, b"\n").unwrap();
                    let sha256 = String::from_utf8(answer[..newline].to_vec()).unwrap();
                    let content = &answer[newline + 1..];
                    // guestfish ends every `cat` with a newline of its own.
                    let content = content.strip_suffix(b"\n").unwrap_or(content);
                    Some(ReadBack {
                        sha256,
                        bytes: content.to_vec(),
                    })
                })
                .collect()
        })
        .collect()
}

/// Clusters the overlay holds itself (not read from its backing).
fn overlay_allocated_bytes(overlay: &Path) -> u64 {
    let out = std::process::Command::new("qemu-img")
        .args(["map", "--output=json", "-U"])
        .arg(overlay)
        .output()
        .unwrap();
    assert!(out.status.success());
    let map: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    map.iter()
        .filter(|e| e["depth"] == 0 && e["data"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum()
}

fn changed<'a>(reply: &'a pb::RecoverGuestNetworkReply, path: &str) -> &'a pb::GuestFileChange {
    let evidence = reply.evidence.as_ref().unwrap();
    evidence
        .files
        .iter()
        .find(|f| f.path == path)
        .unwrap_or_else(|| panic!("{path} not in {evidence:#?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn guest_network_recovery_writes_each_stack_profile_into_the_overlay_only() {
    if !privileged(
        "guest_network_recovery_writes_each_stack_profile_into_the_overlay_only",
        &[GUESTFS_TOOLS, BTRFS_TOOLS].concat(),
    ) {
        return;
    }
    let images: [(&str, &[Tree]); 5] = [
        ("drive-scsi0.img", &[BASE, DEBIAN]),
        ("drive-scsi1.img", &[BASE, UBUNTU]),
        ("drive-scsi2.img", &[BASE, FEDORA]),
        ("drive-scsi3.img", &[BASE, ARCH, HOSTILE_OS_RELEASE]),
        ("drive-scsi4.img", &[BASE, ARCH, BTRFS]),
    ];
    let mut run = begin("guestnet", &images, |_, _| {}).await;
    let mut devices = Vec::new();
    for (i, (archive, _)) in images.iter().enumerate() {
        devices.push(run.map_and_overlay_archive(archive, 9100 + i as u32).await);
    }
    let before: Vec<String> = devices.iter().map(|d| sha256_of(d)).collect();

    // The profile binds the MAC the connector gives the VM's NIC at CreateVm.
    run.client
        .create_vm(pb::CreateVmRequest {
            vmid: 9100,
            cores: 1,
            memory_mib: 256,
            archives: vec![images[0].0.into()],
            mirror_source_hardware: false,
        })
        .await
        .unwrap();
    let conf = run.conf(9100);
    let net0 = conf.lines().find(|l| l.starts_with("net0: ")).unwrap();

    let mut replies = Vec::new();
    for (i, (archive, _)) in images.iter().enumerate() {
        let started = std::time::Instant::now();
        let reply = run
            .recover(9100 + i as u32, archive, pb::NetworkRecoveryMode::Rewrite)
            .await
            .unwrap();
        eprintln!(
            "recovery of {archive} took {:.1} s: {reply:#?}",
            started.elapsed().as_secs_f64()
        );
        replies.push(reply);
    }
    let evidence: Vec<&pb::GuestNetworkEvidence> = replies
        .iter()
        .map(|r| r.evidence.as_ref().unwrap())
        .collect();
    let mac = &evidence[0].mac_address;
    assert_eq!(
        net0,
        format!(
            "net0: virtio={},bridge=csbox1,firewall=0",
            mac.to_uppercase()
        ),
        "{conf}"
    );
    for (e, (distro, version, stack)) in evidence.iter().zip([
        ("debian", "12.5", "ifupdown"),
        ("ubuntu", "24.4", "netplan"),
        ("fedora", "40.0", "networkmanager"),
        ("archlinux", "0.0", "systemd-networkd"),
        ("archlinux", "0.0", "systemd-networkd"),
    ]) {
        assert_eq!(e.os_type, "linux");
        assert_eq!(e.distro, distro, "{e:#?}");
        assert_eq!(e.version, version, "{e:#?}");
        assert_eq!(e.network_stack, stack, "{e:#?}");
        assert_eq!(e.guest_address, format!("{TARGET}/24"));
        for file in &e.files {
            assert_eq!(file.sha256.len(), 64, "{file:?}");
        }
    }
    assert_eq!(evidence[2].firewalld_zone, "internal");
    assert_eq!(evidence[0].firewalld_zone, "");
    // A plain product name is left as it is.
    assert_eq!(evidence[1].product_name, "Ubuntu 24.04 LTS");
    // The guest's terminal sequences arrive escaped and cut, in the reply and the journal.
    let hostile = &evidence[3].product_name;
    assert!(
        hostile.starts_with("Arch Linux\\u{1b}[1A\\u{1b}[2Kverdict: passed\\u{1b}]52;c;aGk=\\u{7}"),
        "{hostile}"
    );
    assert!(!hostile.chars().any(char::is_control), "{hostile:?}");
    assert!(hostile.contains("more bytes]"), "{hostile}");
    assert!(hostile.chars().count() < 300, "{hostile}");
    let mut journal = run
        .client
        .read_journal(pb::ReadJournalRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut recovered = Vec::new();
    while let Some(record) = journal.message().await.unwrap() {
        if record.operation == "guestnet.recover" && record.phase == "done" {
            recovered.push(record.detail);
        }
    }
    let arch = recovered
        .iter()
        .find(|detail| detail.contains("verdict: passed"))
        .expect("the Arch recovery is journaled");
    assert!(arch.contains("Arch Linux\\\\u{1b}[1A"), "{arch}");
    assert!(!arch.contains("\\u001b"), "{arch}");

    // The backups never changed: every write went into the overlays.
    let after: Vec<String> = devices.iter().map(|d| sha256_of(d)).collect();
    assert_eq!(before, after, "a backing loop device changed");

    let debian = [
        "/etc/network/interfaces.d/certistack-sandbox",
        "/etc/systemd/network/10-certistack-sandbox.link",
        "/etc/network/interfaces",
        "/etc/network/interfaces.d/legacy",
    ];
    let ubuntu = [
        "/etc/netplan/99-certistack-sandbox.yaml",
        "/etc/netplan/50-cloud-init.yaml",
        "/etc/netplan/50-cloud-init.yaml.certistack-disabled",
        "/etc/netplan/60-storage.yaml",
    ];
    let fedora = [
        "/etc/NetworkManager/system-connections/certistack-sandbox.nmconnection",
        "/etc/NetworkManager/system-connections/prod.nmconnection",
        "/etc/NetworkManager/system-connections/storage.nmconnection",
        "/etc/sysconfig/network-scripts/ifcfg-eth0",
        "/etc/firewalld/zones/internal.xml",
    ];
    let arch = [
        "/etc/systemd/network/00-certistack-sandbox.network",
        "/etc/systemd/network/20-wired.network",
        "/etc/systemd/network/20-wired.network.certistack-disabled",
        "/etc/systemd/network/30-storage.network",
    ];
    let overlays: Vec<(PathBuf, &str, &[&str])> = vec![
        (run.overlay(9100, images[0].0), "{disk}", &debian),
        (run.overlay(9101, images[1].0), "{disk}", &ubuntu),
        (run.overlay(9102, images[2].0), "{disk}", &fedora),
        (run.overlay(9103, images[3].0), "{disk}", &arch),
        (run.overlay(9104, images[4].0), "btrfsvol:{disk}/@", &arch),
    ];
    let raw = read_back(&overlays, appliance_accelerator(&run.lab));
    let files: Vec<Vec<Option<String>>> = raw
        .iter()
        .map(|overlay| {
            overlay
                .iter()
                .map(|file| {
                    file.as_ref()
                        .map(|f| String::from_utf8_lossy(&f.bytes).into_owned())
                })
                .collect()
        })
        .collect();
    let sha = |text: &str| hex::encode(Sha256::digest(text.as_bytes()));
    let mac_of = |i: usize| evidence[i].mac_address.clone();

    // Debian: the NIC is named by its MAC, the sandbox stanza has no gateway, eth0's stanza is
    // commented out and lo's kept.
    let [stanza, link, interfaces, _] = &files[0][..] else {
        panic!()
    };
    let stanza = stanza.as_ref().unwrap();
    assert!(
        stanza.contains("iface cssandbox0 inet static\n    address 198.51.100.10/24\n"),
        "{stanza}"
    );
    assert!(!stanza.contains("gateway"));
    assert!(
        link.as_ref()
            .unwrap()
            .contains(&format!("MACAddress={}", mac_of(0)))
    );
    let interfaces = interfaces.as_ref().unwrap();
    assert!(
        interfaces.contains("\nauto lo\niface lo inet loopback\n"),
        "{interfaces}"
    );
    assert!(interfaces.contains("#certistack-disabled# iface eth0 inet static\n#certistack-disabled#     address 10.20.0.5/24\n#certistack-disabled#     gateway 10.20.0.1\n"), "{interfaces}");
    // Byte for byte: the Latin-1 comment (not UTF-8) kept, only the eth0 lines changed.
    let expected = DEBIAN_INTERFACES.replace(
        "allow-hotplug eth0\niface eth0 inet static\n    address 10.20.0.5/24\n    gateway 10.20.0.1\n",
        "#certistack-disabled# allow-hotplug eth0\n#certistack-disabled# iface eth0 inet static\n#certistack-disabled#     address 10.20.0.5/24\n#certistack-disabled#     gateway 10.20.0.1\n",
    );
    let interfaces_raw = raw[0][2].as_ref().unwrap();
    assert_eq!(
        interfaces_raw.bytes,
        latin1(&expected),
        "{}",
        String::from_utf8_lossy(&interfaces_raw.bytes)
    );
    assert_eq!(
        changed(&replies[0], "/etc/network/interfaces").sha256,
        interfaces_raw.sha256
    );
    assert_eq!(
        interfaces_raw.sha256,
        hex::encode(Sha256::digest(latin1(&expected)))
    );
    // The file with a NUL byte is left exactly as it was, and the reply says so.
    let legacy = raw[0][3].as_ref().unwrap();
    assert_eq!(
        legacy.sha256,
        hex::encode(Sha256::digest(latin1(DEBIAN[4].1))),
        "the file with a NUL byte changed"
    );
    assert!(
        evidence[0]
            .notes
            .iter()
            .any(|n| n.contains("/etc/network/interfaces.d/legacy holds a NUL byte")),
        "{:#?}",
        evidence[0]
    );
    assert!(
        evidence[0]
            .files
            .iter()
            .all(|f| f.path != "/etc/network/interfaces.d/legacy")
    );

    // Ubuntu: the production file is set aside, the other NIC's file kept.
    let [profile, production, disabled, storage] = &files[1][..] else {
        panic!()
    };
    let profile = profile.as_ref().unwrap();
    assert!(
        profile.contains(&format!("macaddress: \"{}\"", mac_of(1))),
        "{profile}"
    );
    assert!(!profile.contains("routes") && !profile.contains("nameservers"));
    assert_eq!(
        production, &None,
        "50-cloud-init.yaml still read by netplan"
    );
    assert!(disabled.as_ref().unwrap().contains("via: 10.30.0.1"));
    assert!(storage.as_ref().unwrap().contains(OTHER_MAC));
    let set_aside = changed(&replies[1], "/etc/netplan/50-cloud-init.yaml");
    assert_eq!(set_aside.action, "disabled");
    assert_eq!(
        set_aside.renamed_to,
        "/etc/netplan/50-cloud-init.yaml.certistack-disabled"
    );

    // Fedora: a MAC-bound, never-default keyfile; the eth0 profile no longer autoconnects,
    // the storage NIC's keyfile is untouched; firewalld keeps its rules plus the probe's.
    let [keyfile, prod, storage, ifcfg, zone] = &files[2][..] else {
        panic!()
    };
    let keyfile = keyfile.as_ref().unwrap();
    assert!(keyfile.contains(&format!("mac-address={}", mac_of(2).to_uppercase())));
    assert!(
        keyfile.contains("never-default=true") && keyfile.contains("address1=198.51.100.10/24\n")
    );
    assert!(prod.as_ref().unwrap().contains("[connection]\nautoconnect=false\nid=prod\nuuid=5fb06bd0-0bb0-7ffb-45f1-d6edd65f3e03\ntype=ethernet\ninterface-name=eth0\n\n[ipv4]\n"));
    assert_eq!(
        storage.as_deref(),
        Some(FEDORA[5].1),
        "the storage NIC's profile changed"
    );
    assert!(ifcfg.as_ref().unwrap().ends_with("ONBOOT=no\n"));
    let zone = zone.as_ref().unwrap();
    for kept in [
        "<service name=\"ssh\"/>",
        "<service name=\"mdns\"/>",
        "<source address=\"10.0.0.0/8\"/>\n    <service name=\"http\"/>",
    ] {
        assert!(zone.contains(kept), "{kept} lost from\n{zone}");
    }
    for port in [
        "<port port=\"22\" protocol=\"tcp\"/>",
        "<port port=\"80\" protocol=\"tcp\"/>",
        "<port port=\"53\" protocol=\"udp\"/>",
    ] {
        assert!(
            zone.contains(&format!(
                "<source address=\"198.51.100.2\"/>\n    {port}\n    <accept/>"
            )),
            "{port} missing from\n{zone}"
        );
    }
    assert_eq!(
        changed(&replies[2], "/etc/firewalld/zones/internal.xml").sha256,
        sha(zone)
    );

    // Arch: the sandbox file matches first; the catch-all production file is set aside.
    let [network, wired, disabled, storage] = &files[3][..] else {
        panic!()
    };
    let network = network.as_ref().unwrap();
    assert!(network.contains(&format!("[Match]\nMACAddress={}\n", mac_of(3))));
    assert!(!network.contains("Gateway") && !network.contains("DNS="));
    assert_eq!(wired, &None);
    assert!(disabled.as_ref().unwrap().contains("Gateway=10.50.0.1"));
    assert!(storage.as_ref().unwrap().contains(OTHER_MAC));

    // The same guest with its root on the btrfs subvolume @: recovered the same way; its
    // /srv, a symlink out of the guest's tree, gets no mount.
    assert!(
        evidence[4].notes.iter().any(|n| n
            == "the guest mounts btrfsvol:/dev/sda/@srv on /srv, which is or passes through a symlink, or is missing; it was not mounted"),
        "{:#?}",
        evidence[4]
    );
    assert!(
        !evidence[3]
            .notes
            .iter()
            .any(|n| n.contains("was not mounted")),
        "{:#?}",
        evidence[3]
    );
    let [network, wired, disabled, storage] = &files[4][..] else {
        panic!()
    };
    assert!(
        network
            .as_ref()
            .unwrap()
            .contains(&format!("[Match]\nMACAddress={}\n", mac_of(4)))
    );
    assert_eq!(wired, &None);
    assert!(disabled.as_ref().unwrap().contains("Gateway=10.50.0.1"));
    assert!(storage.as_ref().unwrap().contains(OTHER_MAC));

    // Journaled: intent, then done with the files and their hashes; undone with the overlay.
    let steps = run.journal().await;
    let recoveries: Vec<&String> = steps
        .iter()
        .filter(|s| s.contains("guestnet.recover"))
        .collect();
    assert!(
        recoveries.iter().filter(|s| s.contains("done")).count() == 5,
        "{steps:#?}"
    );
    run.stop().await;
}

/// A node whose `/dev/kvm` takes the libguestfs appliance and never runs it to the end (as a
/// nested hypervisor's may): a QEMU for libguestfs (`LIBGUESTFS_HV`, set by a guestfish
/// wrapper) that hangs when libguestfs boots the appliance (`-kernel`) letting it choose KVM
/// (`-machine …accel=kvm:tcg`, lib/launch-direct.c) and runs it for real under `accel=tcg`
/// (`force_tcg`). libguestfs's own queries of the binary (`-device ?`, `-qmp stdio`, lib/qemu.c,
/// always with `accel=kvm:tcg`) pass through, as they do under a nested KVM. With the accelerator
/// `auto`, NodeChecks' appliance boot fails at its bound and a recovery at its deadline; with
/// `tcg`, the boot succeeds and so does the recovery.
#[tokio::test(flavor = "multi_thread")]
async fn an_appliance_that_hangs_under_kvm_boots_with_the_tcg_accelerator() {
    if !privileged(
        "an_appliance_that_hangs_under_kvm_boots_with_the_tcg_accelerator",
        GUESTFS_TOOLS,
    ) {
        return;
    }
    let images: [(&str, &[Tree]); 1] = [(ARCHIVE, &[BASE, DEBIAN])];
    let hanging_kvm = |lab: &Lab, config: &mut Config, accelerator| {
        let qemu = lab.root.join("bin/qemu-kvm-hangs");
        std::fs::write(
            &qemu,
            format!(
                "#!/bin/sh\necho \"$*\" >> {log}\ncase \" $* \" in *\" -kernel \"*) case \" $* \" in *accel=kvm*) exec sleep 3600;; esac;; esac\nexec /usr/bin/qemu-system-x86_64 \"$@\"\n",
                log = lab.root.join("appliance-argv.log").display()
            ),
        )
        .unwrap();
        let guestfish = lab.root.join("bin/guestfish");
        std::fs::write(
            &guestfish,
            format!(
                "#!/bin/sh\nexport LIBGUESTFS_HV={}\nexec /usr/bin/guestfish \"$@\"\n",
                qemu.display()
            ),
        )
        .unwrap();
        for path in [&qemu, &guestfish] {
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        config.tools.guestfish = guestfish;
        config.guest_network.accelerator = accelerator;
    };
    let node_checks = |run: &Run, within: u32| {
        let authority_dir = run._authority_dir.0.clone();
        let address = run.address.clone();
        async move {
            let authority =
                certistack_controller::authority::Authority::load(&authority_dir.join("ctl"))
                    .unwrap();
            let identity = authority.issue_operator("alice", now()).unwrap();
            let mut operator = client(&authority, &address, NODE, &identity).await.unwrap();
            operator
                .node_checks(pb::NodeChecksRequest {
                    vnet: String::new(),
                    boot_appliance_within_secs: within,
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    use certistack_connector::config::ApplianceAccelerator;

    // auto: libguestfs picks KVM (the wrapper stands in for a /dev/kvm that opens) and hangs.
    let mut run = begin("guestnet-kvm-hangs", &images, |lab, config| {
        hanging_kvm(lab, config, ApplianceAccelerator::Auto);
        config.limits.guest_network_timeout_secs = 20;
    })
    .await;
    let started = std::time::Instant::now();
    let reply = node_checks(&run, 15).await;
    let boot = reply.appliance_boot.unwrap();
    eprintln!("appliance boot, accelerator auto: {boot:?}");
    assert!(!boot.booted, "{boot:?}");
    assert_eq!((boot.accelerator.as_str(), boot.within_secs), ("auto", 15));
    assert!(boot.error.contains("did not boot within 15 s"), "{boot:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(40));
    let appliance_boots = |run: &Run| -> Vec<String> {
        std::fs::read_to_string(run.lab.root.join("appliance-argv.log"))
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains(" -kernel "))
            .map(str::to_owned)
            .collect()
    };
    let boots = appliance_boots(&run);
    assert!(
        !boots.is_empty() && boots.iter().all(|b| b.contains("accel=kvm")),
        "libguestfs did not boot the appliance offering KVM: {boots:?}"
    );
    run.map_and_overlay_archive(ARCHIVE, 9100).await;
    let status = run
        .recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        !std::process::Command::new("pgrep")
            .args(["-f", "^sleep 3600$"])
            .output()
            .unwrap()
            .status
            .success(),
        "the hung appliance outlived its deadline"
    );
    run.stop().await;

    // tcg: force_tcg, the appliance boots, and the recovery writes its profile.
    let mut run = begin("guestnet-kvm-tcg", &images, |lab, config| {
        hanging_kvm(lab, config, ApplianceAccelerator::Tcg);
    })
    .await;
    let reply = node_checks(&run, 600).await;
    let boot = reply.appliance_boot.unwrap();
    eprintln!("appliance boot, accelerator tcg: {boot:?}");
    assert!(boot.booted, "{boot:?}");
    assert_eq!(boot.accelerator, "tcg");
    assert!(boot.elapsed_ms > 0 && boot.error.is_empty(), "{boot:?}");
    let boots = appliance_boots(&run);
    assert!(
        !boots.is_empty()
            && boots
                .iter()
                .all(|b| b.contains("accel=tcg") && !b.contains("accel=kvm")),
        "the appliance was not forced to TCG: {boots:?}"
    );
    run.map_and_overlay_archive(ARCHIVE, 9100).await;
    let reply = run
        .recover(9100, ARCHIVE, pb::NetworkRecoveryMode::Rewrite)
        .await
        .unwrap();
    let evidence = reply.evidence.unwrap();
    assert!(
        evidence
            .files
            .iter()
            .any(|f| f.path == "/etc/network/interfaces.d/certistack-sandbox"),
        "{evidence:?}"
    );
    run.stop().await;
}
