//! The packaged unit under a real systemd: a Debian root booted with systemd-nspawn (sharing
//! this machine's network, so the test's client reaches the connector on loopback), the
//! connector binary, unit, config and the Proxmox test doubles bound into it.

use super::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const UNIT: &str = "certistack-connector.service";

struct Container {
    nspawn: Child,
    leader: u32,
}

impl Container {
    /// Boots `root` (left unchanged: a tmpfs overlay takes every write) with `binds`
    /// (host path, container path; read-write when the paths are equal).
    fn boot(root: &Path, binds: &[(PathBuf, PathBuf)]) -> Self {
        let name = format!("cs-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let mut command = Command::new("systemd-nspawn");
        command
            .arg("-D")
            .arg(root)
            .args(["--volatile=overlay", "-b", "--register=no", "--keep-unit"])
            .args(["--console=passive", "-M", &name])
            // FUSE and loop devices for the PBS double's mappings.
            .args(["--bind=/dev/fuse", "--bind=/dev/loop-control"]);
        for (host, inside) in binds {
            let flag = if host == inside {
                "--bind"
            } else {
                "--bind-ro"
            };
            command.arg(format!("{flag}={}:{}", host.display(), inside.display()));
        }
        let nspawn = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The container's PID 1 is the child of systemd-nspawn once it has exec'd systemd.
        let mut leader = None;
        for _ in 0..300 {
            leader = std::fs::read_to_string(format!(
                "/proc/{}/task/{}/children",
                nspawn.id(),
                nspawn.id()
            ))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|pid| pid.parse::<u32>().ok())
            .find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|comm| comm.trim() == "systemd")
            });
            if leader.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let container = Self {
            nspawn,
            leader: leader.expect("systemd-nspawn started no container"),
        };
        // Until systemd has opened its socket, systemctl cannot reach it.
        let mut state = String::new();
        for _ in 0..300 {
            state = container.run(&["systemctl", "is-system-running", "--wait"]);
            if ["running", "degraded"].contains(&state.trim()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(
            ["running", "degraded"].contains(&state.trim()),
            "the container's systemd: {state}"
        );
        // The container's /dev is its own: make the loop nodes the kernel may hand out, as
        // udev leaves block devices on a node (systemd's 50-udev-default.rules:
        // `SUBSYSTEM=="block", GROUP="disk"`, mode 0660).
        container.run(&[
            "sh",
            "-c",
            "for i in $(seq 0 511); do [ -e /dev/loop$i ] || mknod -m 0660 /dev/loop$i b 7 $i; chgrp disk /dev/loop$i; done",
        ]);
        container
    }

    /// Runs `argv` inside the container; its stdout (stderr appended when it fails).
    fn run(&self, argv: &[&str]) -> String {
        let output = Command::new("nsenter")
            .args(["-t", &self.leader.to_string(), "-a", "--"])
            .args(argv)
            .output()
            .unwrap();
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() {
            text.push_str(&String::from_utf8_lossy(&output.stderr));
        }
        text
    }

    fn property(&self, unit: &str, property: &str) -> String {
        self.run(&["systemctl", "show", "--value", "-p", property, unit])
            .trim()
            .to_owned()
    }

    /// Loop devices backed by files below `dir`, as the container sees them (the FUSE
    /// mount behind a mapping lives in the container's mount namespace).
    fn loops_under(&self, dir: &Path) -> Vec<String> {
        let listing = self.run(&["losetup", "--list", "--noheadings", "-O", "NAME,BACK-FILE"]);
        let mut loops: Vec<String> = listing
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, back)| back.trim().starts_with(dir.to_str().unwrap()))
            .map(|(name, _)| name.to_owned())
            .collect();
        loops.sort();
        loops
    }

    /// SHA-256 of the first MiB of `device`, read with O_DIRECT: every read reaches the
    /// mapping's holder through the loop device, none is served from a cache. Fails (the
    /// error in the text) when the device cannot be read.
    fn device_digest(&self, device: &str) -> String {
        const READ: &str = "import hashlib, mmap, os, sys\n\
            fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n\
            buf = mmap.mmap(-1, 1 << 20)\n\
            n = os.readv(fd, [buf])\n\
            assert n == 1 << 20, 'short read: %d bytes' % n\n\
            print(hashlib.sha256(buf).hexdigest())\n";
        self.run(&["python3", "-c", READ, device]).trim().to_owned()
    }

    /// A process of the container as (state, start time): the start time tells a process
    /// from a later one given the same pid.
    fn process(&self, pid: &str) -> (String, String) {
        let stat = self.run(&["cat", &format!("/proc/{pid}/stat")]);
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        match (fields.first(), fields.get(19)) {
            (Some(state), Some(start)) => ((*state).to_owned(), (*start).to_owned()),
            _ => (format!("gone: {stat}"), String::new()),
        }
    }

    /// `/proc/<pid>/status` lines and mount namespace of a process in the container.
    fn confinement(&self, pid: &str) -> BTreeMap<String, String> {
        let status = self.run(&["cat", &format!("/proc/{pid}/status")]);
        let mut seen: BTreeMap<String, String> = status
            .lines()
            .filter_map(|l| l.split_once(':'))
            .filter(|(k, _)| ["NoNewPrivs", "Seccomp_filters", "CapBnd"].contains(k))
            .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
            .collect();
        seen.insert(
            "mnt".into(),
            self.run(&["readlink", &format!("/proc/{pid}/ns/mnt")])
                .trim()
                .to_owned(),
        );
        seen
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("nsenter")
            .args([
                "-t",
                &self.leader.to_string(),
                "-a",
                "systemctl",
                "poweroff",
            ])
            .status();
        for _ in 0..100 {
            if matches!(self.nspawn.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = self.nspawn.kill();
        let _ = self.nspawn.wait();
    }
}

use std::collections::BTreeMap;

#[path = "systemd_unit/appliance_identities.rs"]
mod appliance_identities;
#[path = "systemd_unit/confined_appliance.rs"]
mod confined_appliance;

/// Writes `config` (listening on `port`) into `dir` with a drop-in for the packaged unit, and
/// names what a container needs bound in to run the packaged connector as a service: `dir`
/// itself, the binary, the unit, the drop-in, the configuration and the node certificate.
fn packaged_connector(
    dir: &Path,
    config: &certistack_connector::config::Config,
    port: u16,
) -> Vec<(PathBuf, PathBuf)> {
    let config_path = dir.join("connector.toml");
    write_config_file(&config_path, config, port);
    // The test's directory sits below /tmp, which the unit's PrivateTmp hides and
    // ProtectSystem makes read-only: this drop-in opens exactly that directory.
    let dropin = dir.join("lab.conf");
    std::fs::write(
        &dropin,
        format!(
            "[Service]\nPrivateTmp=no\nReadWritePaths={}\n",
            dir.display()
        ),
    )
    .unwrap();
    vec![
        (dir.to_owned(), dir.to_owned()),
        (
            binary("certistack-connector"),
            "/usr/sbin/certistack-connector".into(),
        ),
        (
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../packaging")
                .join(UNIT),
            format!("/etc/systemd/system/{UNIT}").into(),
        ),
        (
            dropin,
            format!("/etc/systemd/system/{UNIT}.d/lab.conf").into(),
        ),
        (config_path, "/etc/certistack/connector.toml".into()),
        (
            config.tls.certificate.clone(),
            "/etc/certistack/node.crt".into(),
        ),
    ]
}

/// The root, built once per target directory by tests/systemd/container-root.sh.
fn container_root() -> PathBuf {
    let target = binary("certistack-connector")
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned();
    let root = target.join("nspawn/systemd-root");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/container-root.sh");
    let built = Command::new("bash")
        .arg(script)
        .arg(&root)
        .status()
        .unwrap();
    assert!(built.success(), "building the container root failed");
    root
}

/// Under the packaged, hardened unit started by systemd (Type=notify: `systemctl start`
/// returns once the connector is ready): MapBackup's holder runs in a transient unit of its
/// own, with none of the connector's restrictions (no NoNewPrivs, no seccomp filter beyond
/// the container's own, the full capability bounding set, the mount namespace of PID 1).
/// A `systemctl restart` of the connector, and a stop followed by a start (as an upgrade
/// does), leave the holder (same process), its loop device and the device's data (read
/// through the holder) as they were, and the run goes on under the new daemon; Cleanup
/// then removes the mapping and its unit.
#[tokio::test(flavor = "multi_thread")]
async fn the_map_holder_runs_outside_the_connectors_sandbox_and_outlives_its_restart() {
    if !privileged(
        "the_map_holder_runs_outside_the_connectors_sandbox_and_outlives_its_restart",
        &[
            "systemd-nspawn",
            "mmdebstrap",
            "nsenter",
            "losetup",
            "python3",
        ],
    ) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let root = container_root();
    let lab = Lab::new("systemd-unit");
    let image = lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
    // What the device must read: the backup's first MiB (the marker, then zeros).
    let backup_digest = {
        use sha2::Digest;
        let data = std::fs::read(&image).unwrap();
        hex::encode(sha2::Sha256::digest(&data[..1 << 20]))
    };
    let dir = lab.root.parent().unwrap().to_owned();
    let (_authority_dir, authority, mut config) =
        lab.controller_and_node_config("systemd-unit-ctl");
    config.process.transient_units = certistack_connector::config::TransientUnits::Auto;
    let port = free_local_port();
    let container = Container::boot(&root, &packaged_connector(&dir, &config, port));
    container.run(&["systemctl", "daemon-reload"]);
    // Type=notify: start returns once the connector said READY=1.
    let started = container.run(&["systemctl", "start", UNIT]);
    assert_eq!(
        container.property(UNIT, "ActiveState"),
        "active",
        "{started}{}",
        container.run(&["journalctl", "-u", UNIT, "--no-pager", "-n", "30"])
    );
    let address = format!("127.0.0.1:{port}");
    let mut wire = grant(RUN_ID, NODE);
    wire.archives = vec![ARCHIVE.to_owned()];
    let credentials = mint(&authority, &wire);
    let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    let map_unit = format!("certistack-map-{RUN_ID}-{ARCHIVE}.service");
    let mapped = match run.map_backup(map_request(ARCHIVE, PBS_PASSWORD)).await {
        Ok(reply) => reply.into_inner(),
        Err(status) => panic!(
            "{status:?}\n{}\n{}",
            container.run(&["systemctl", "status", "--no-pager", &map_unit]),
            container.run(&["journalctl", "--no-pager", "-n", "40"])
        ),
    };
    assert_eq!(container.property(&map_unit, "ActiveState"), "active");
    let loopdev_dir = lab.root.join("run/pbs-loopdev");
    let loops = container.loops_under(&loopdev_dir);
    assert_eq!(loops, std::slice::from_ref(&mapped.loop_device));
    // The holder's pid file, as the PBS client writes it (a pid of the container).
    let pid_file = std::fs::read_dir(lab.root.join("run/pbs-loopdev"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "pid"))
        .expect("no holder pid file");
    let holder_pid = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .to_owned();
    assert!(
        container
            .run(&["systemctl", "status", "--no-pager", &map_unit])
            .contains(&holder_pid),
        "the holder {holder_pid} is not in {map_unit}"
    );

    // The holder is outside the connector's sandbox.
    let connector_pid = container.property(UNIT, "MainPID");
    let connector = container.confinement(&connector_pid);
    let unconfined = container.confinement(&holder_pid);
    let init = container.confinement("1");
    eprintln!("connector {connector:?}\nholder {unconfined:?}");
    assert_eq!(connector["NoNewPrivs"], "1");
    assert_eq!(unconfined["NoNewPrivs"], "0");
    // systemd-nspawn filters system calls for the whole container: the holder has exactly
    // the container's filters, the connector its unit's SystemCallFilter on top.
    let filters =
        |seen: &BTreeMap<String, String>| -> u32 { seen["Seccomp_filters"].parse().unwrap() };
    assert_eq!(filters(&unconfined), filters(&init));
    assert!(
        filters(&connector) > filters(&init),
        "{connector:?} {init:?}"
    );
    assert_eq!(unconfined["CapBnd"], init["CapBnd"]);
    assert_ne!(connector["CapBnd"], init["CapBnd"]);
    assert_eq!(unconfined["mnt"], init["mnt"]);
    assert_ne!(connector["mnt"], init["mnt"]);

    // What a restart or an upgrade must leave alone: the holder (the same process, still
    // in the map unit's cgroup), its loop device, and the data read through it.
    let holder = container.process(&holder_pid);
    assert_ne!(holder.0, "Z", "{holder:?}");
    assert_eq!(
        container.device_digest(&mapped.loop_device),
        backup_digest,
        "the mapped device does not read as the backup"
    );
    let still_held = |when: &str| {
        assert_eq!(
            container.property(&map_unit, "ActiveState"),
            "active",
            "{when}"
        );
        let now = container.process(&holder_pid);
        assert!(
            now.1 == holder.1 && now.0 != "Z",
            "{when}: the holder was {holder:?}, is {now:?}"
        );
        let cgroup = container.run(&["cat", &format!("/proc/{holder_pid}/cgroup")]);
        assert!(cgroup.contains(&map_unit), "{when}: {cgroup}");
        assert_eq!(
            container.loops_under(&loopdev_dir),
            std::slice::from_ref(&mapped.loop_device),
            "{when}"
        );
        assert_eq!(
            container.device_digest(&mapped.loop_device),
            backup_digest,
            "{when}: the device's data"
        );
        eprintln!(
            "{when}: holder {holder_pid} {now:?} in {map_unit}, {} reads sha256 {backup_digest}",
            mapped.loop_device
        );
    };
    let map_step = format!("backup.map backup:{ARCHIVE} done");

    // A restart of the connector's unit; the run goes on under the new daemon, over a new
    // connection.
    drop(run);
    container.run(&["systemctl", "restart", UNIT]);
    assert_eq!(container.property(UNIT, "ActiveState"), "active");
    let restarted_pid = container.property(UNIT, "MainPID");
    assert_ne!(restarted_pid, connector_pid);
    still_held("after systemctl restart");
    let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
    let journal = journal_steps(&mut run, RUN_ID).await;
    assert!(journal.contains(&map_step), "{journal:?}");

    // An upgrade stops the old daemon and starts the new one.
    drop(run);
    container.run(&["systemctl", "stop", UNIT]);
    assert_eq!(container.property(UNIT, "ActiveState"), "inactive");
    still_held("with the connector stopped");
    container.run(&["systemctl", "start", UNIT]);
    assert_eq!(container.property(UNIT, "ActiveState"), "active");
    assert_ne!(container.property(UNIT, "MainPID"), restarted_pid);
    still_held("after systemctl stop and start");
    let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
    let journal = journal_steps(&mut run, RUN_ID).await;
    assert!(journal.contains(&map_step), "{journal:?}");

    // Cleanup unmaps (the holder ends) and removes the map unit.
    let (receipts, residue) = cleanup_receipts(&mut run, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert!(container.loops_under(&loopdev_dir).is_empty());
    assert!(
        container.process(&holder_pid).0.starts_with("gone"),
        "the holder {holder_pid} outlived its mapping"
    );
    assert_ne!(container.property(&map_unit, "LoadState"), "loaded");
    let left = container.run(&[
        "systemctl",
        "list-units",
        "--all",
        "--plain",
        "--no-legend",
        "certistack-map-*",
    ]);
    assert_eq!(left.trim(), "", "units left after Cleanup");
    run.end_run(pb::EndRunRequest {}).await.unwrap();
    container.run(&["systemctl", "stop", UNIT]);
}

/// A guest network recovery's session under systemd, started as the connector starts it
/// (`guestfish_call` with its unit), with a stand-in for guestfish: the session's commands
/// reach it on stdin and its answers come back on stdout (`--pipe`), it runs in
/// `certistack-guestnet-<run>-<vmid>.service` with the unit's `MemoryMax` and
/// `RuntimeMaxSec`, its exit status is the call's (`--wait`) and the unit is collected
/// after it, as the appliance user. A session that hangs is ended by systemd at
/// `RuntimeMaxSec`, its cgroup with it, without anyone killing `systemd-run`. (A real
/// appliance in that unit: `confined_appliance`.)
#[tokio::test(flavor = "multi_thread")]
async fn a_guest_network_session_runs_in_its_unit_with_the_callers_pipes_and_the_units_bounds() {
    if !privileged(
        "a_guest_network_session_runs_in_its_unit_with_the_callers_pipes_and_the_units_bounds",
        &["systemd-nspawn", "mmdebstrap", "nsenter"],
    ) {
        return;
    }
    use certistack_connector::node::guest_network;
    use certistack_core::validate::{RunId, Validated, Vmid};
    use std::io::Write;
    let _serial = SERIAL.lock().await;
    let root = container_root();
    let dir = TempDir::new("guestnet-unit");
    let run_id = RunId::validate(RUN_ID).unwrap();
    let unit =
        guest_network::guest_network_unit(&run_id, Vmid::parse("t", 9100).unwrap(), 512).unwrap();
    // Bound in at /usr/local/bin: the test's private directory is closed to the appliance user.
    let standin = dir.0.join("guestfish");
    std::fs::write(
        &standin,
        format!(
            "#!/bin/sh\nwhile read -r line; do\n  [ \"$line\" = hang ] && exec sleep 600\n  echo \"answer: $line\"\ndone\necho \"args: $*\"\necho \"env: $LIBGUESTFS_BACKEND $LIBGUESTFS_MEMSIZE\"\necho \"uid: $(id -u)\"\necho \"loop ioctl: $(printf 'import fcntl,os\\ntry:\\n  fcntl.ioctl(os.open(\"/dev/null\",0),0x4C01)\\n  print(\"allowed\")\\nexcept OSError as e:\\n  print(e.errno)\\n' | python3)\"\necho \"cgroup: $(cat /proc/self/cgroup)\"\nsystemctl show -p MemoryMax -p RuntimeMaxUSec {}\nexit 7\n",
            unit.name
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &standin,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let overlay = dir.0.join("9100-drive-scsi0.qcow2");
    std::fs::write(&overlay, b"").unwrap();
    let packaging = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging");
    let container = Container::boot(
        &root,
        &[
            (dir.0.clone(), dir.0.clone()),
            (standin, "/usr/local/bin/guestfish".into()),
            (
                binary("certistack-connector"),
                "/usr/local/bin/certistack-connector".into(),
            ),
            (
                packaging.join("certistack-connector.sysusers"),
                "/usr/lib/sysusers.d/certistack-connector.conf".into(),
            ),
        ],
    );
    container.run(&["systemd-sysusers", "certistack-connector.conf"]);
    let account = container.run(&["getent", "passwd", "certistack-guestnet-1"]);
    let field = |index: usize| -> u32 { account.split(':').nth(index).unwrap().parse().unwrap() };
    let confinement = guest_network::Confinement {
        user: guest_network::ApplianceUser {
            name: "certistack-guestnet-1".into(),
            uid: field(2),
            gid: field(3),
        },
        loop_device: "/dev/loop7".into(),
        kvm_device: "/dev/kvm".into(),
        launcher: "/usr/local/bin/certistack-connector".into(),
    };
    let session = |timeout: std::time::Duration, commands: &str| {
        let call = guest_network::guestfish_call(
            Path::new("/usr/local/bin/guestfish"),
            &overlay,
            &guest_network::Appliance {
                timeout,
                memory_mib: 512,
                accelerator: certistack_connector::config::ApplianceAccelerator::Auto,
            },
            Some((&unit, &confinement)),
            Path::new("/usr/bin/systemd-run"),
            Path::new("/usr/bin/systemctl"),
        )
        .unwrap();
        let mut child = Command::new("nsenter")
            .args(["-t", &container.leader.to_string(), "-a", "--"])
            .arg(&call.program)
            .args(&call.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(commands.as_bytes())
            .unwrap();
        let started = std::time::Instant::now();
        let output = child.wait_with_output().unwrap();
        (output, started.elapsed())
    };

    let (output, _) = session(std::time::Duration::from_secs(600), "run\ninspect-os\n");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(7),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for line in [
        "answer: run\nanswer: inspect-os\n",
        // The overlay as the unit binds it in; the appliance user, not root.
        &format!(
            "args: --format=qcow2 -a {}\n",
            guest_network::OVERLAY_IN_UNIT
        ),
        "env: direct 512\n",
        &format!("uid: {}\n", confinement.user.uid),
        // Started through the launcher: a loop ioctl fails with EPERM (1), not with the
        // ENOTTY (25) /dev/null gives without the filter.
        "loop ioctl: 1\n",
        // The unit's own cgroup (cgroup v2, or v1's name=systemd hierarchy).
        &format!(":/system.slice/{}\n", unit.name),
        // 512 MiB for the appliance, 1024 MiB around it and its 512 MiB tmpfs.
        "MemoryMax=2147483648\n",
        // The daemon's deadline, then the margin after which systemd ends it alone.
        "RuntimeMaxUSec=10min 30s\n",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from {stdout}");
    }
    assert_eq!(container.property(&unit.name, "LoadState"), "not-found");

    // A hung session: systemd stops the unit at RuntimeMaxSec (3 s and the margin), sleep
    // and all.
    let (output, took) = session(std::time::Duration::from_secs(3), "run\nhang\n");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        took < std::time::Duration::from_secs(3)
            + certistack_connector::process::GUEST_NETWORK_UNIT_MARGIN
            + std::time::Duration::from_secs(25),
        "took {took:?}"
    );
    assert_eq!(container.property(&unit.name, "LoadState"), "not-found");
    assert_eq!(
        container.run(&["pgrep", "-f", "sleep 600"]).trim(),
        "",
        "the hung session outlived its unit"
    );
}
