//! Guest network recovery under a real systemd, with real libguestfs: the connector, as the
//! packaged unit, runs the appliance in its confined `certistack-guestnet-…` unit (as the
//! package's appliance user, no capabilities, no network, two devices), and the recovery
//! writes its profile all the same. `systemd-analyze security` rates that unit while it runs;
//! its table is kept in `target/ci/guest-network-exposure.txt`, which CI prints.

use super::super::guest_network::{BASE, DEBIAN, GUESTFS_TOOLS, IMAGE_BYTES, store_image};
use super::*;

/// The exposure `systemd-analyze security` may give the appliance's unit (0 is fully
/// confined, 10 not at all).
const MAX_EXPOSURE: f64 = 3.0;

/// What was seen of the recovery's unit while it ran.
#[derive(Debug, Default)]
struct UnitSeen {
    security: String,
    main_uid: String,
    processes: String,
    /// The uid of every QEMU process of the container (only the appliance's runs there).
    qemu_uids: String,
}

/// Polls the container for `unit` until it is active, then reads what confines it.
fn watch_unit(
    leader: u32,
    unit: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Option<UnitSeen>> {
    std::thread::spawn(move || {
        let run = |argv: &[&str]| {
            let output = Command::new("nsenter")
                .args(["-t", &leader.to_string(), "-a", "--"])
                .args(argv)
                .output()
                .unwrap();
            String::from_utf8_lossy(&output.stdout).into_owned()
        };
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let state = run(&["systemctl", "show", "--value", "-p", "ActiveState", &unit]);
            let pid = run(&["systemctl", "show", "--value", "-p", "MainPID", &unit]);
            let pid = pid.trim();
            if state.trim() == "active" && pid != "0" && !pid.is_empty() {
                let status = run(&["cat", &format!("/proc/{pid}/status")]);
                let main_uid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .unwrap_or_default()
                    .trim()
                    .to_owned();
                let security = run(&["systemd-analyze", "security", "--no-pager", &unit]);
                // guestfish starts the appliance's QEMU once supermin has built it.
                let mut processes = String::new();
                while !stop.load(std::sync::atomic::Ordering::SeqCst)
                    && !processes.contains("qemu-system")
                {
                    processes = run(&["systemd-cgls", "--no-pager", "-u", &unit]);
                    std::thread::sleep(std::time::Duration::from_millis(500));
                }
                let qemu_uids = run(&["ps", "-o", "uid=", "-C", "qemu-system-x86_64"]);
                return Some(UnitSeen {
                    security,
                    main_uid,
                    processes,
                    qemu_uids,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        None
    })
}

/// A real recovery (a Debian guest with ifupdown, whose profile the recovery rewrites) by the
/// packaged connector under systemd: the appliance's unit runs as the unprivileged user the
/// package's sysusers.d file makes, rated at most [`MAX_EXPOSURE`] by `systemd-analyze
/// security`; the recovery writes its profile, the overlay goes back to root afterwards,
/// and Cleanup leaves no unit, mapping or overlay.
#[tokio::test(flavor = "multi_thread")]
async fn guest_network_recovery_runs_its_appliance_in_the_confined_unit() {
    if !privileged(
        "guest_network_recovery_runs_its_appliance_in_the_confined_unit",
        &[
            &["systemd-nspawn", "mmdebstrap", "nsenter"][..],
            GUESTFS_TOOLS,
        ]
        .concat(),
    ) {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let _serial = SERIAL.lock().await;
    let root = container_root();
    let lab = Lab::new("systemd-appliance");
    lab.add_backup(SNAPSHOT, ARCHIVE, b"", IMAGE_BYTES);
    store_image(&lab, ARCHIVE, &[BASE, DEBIAN]);
    let dir = lab.root.parent().unwrap().to_owned();
    let (_authority_dir, authority, mut config) =
        lab.controller_and_node_config("systemd-appliance-ctl");
    config.process.transient_units = certistack_connector::config::TransientUnits::Auto;
    config.limits.guest_network_timeout_secs = 900;
    config.guest_network.accelerator = appliance_accelerator(&lab);
    config.pve.kvm_device = "/dev/kvm".into();
    let port = free_local_port();
    let packaging = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging");
    let mut binds = packaged_connector(&dir, &config, port);
    binds.extend([
        (
            packaging.join("certistack-connector.sysusers"),
            "/usr/lib/sysusers.d/certistack-connector.conf".into(),
        ),
        // The appliance boots the machine's own kernel, with its modules.
        ("/boot".into(), "/boot".into()),
        ("/lib/modules".into(), "/usr/lib/modules".into()),
    ]);
    if Path::new("/dev/kvm").exists() {
        binds.push(("/dev/kvm".into(), "/dev/kvm".into()));
    }
    let container = Container::boot(&root, &binds);
    // As the package's postinst does.
    let sysusers = container.run(&["systemd-sysusers", "certistack-connector.conf"]);
    // Nothing else runs an appliance: the recovery gets the first user of the list.
    let account = container.run(&["getent", "passwd", "certistack-guestnet-1"]);
    assert!(
        account.ends_with(":/nonexistent:/usr/sbin/nologin\n"),
        "{sysusers}{account}"
    );
    let appliance_uid = account.split(':').nth(2).unwrap().to_owned();
    container.run(&["systemctl", "daemon-reload"]);
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
    wire.sandbox_vms = vec![pb::SandboxVm {
        vmid: 9100,
        max_cores: 1,
        max_memory_mib: 256,
    }];
    let credentials = mint(&authority, &wire);
    let mut run = client_when_up(&authority, &address, &credentials.certificate).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    run.map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    run.create_overlay(pb::CreateOverlayRequest {
        vmid: 9100,
        archive: ARCHIVE.into(),
    })
    .await
    .unwrap();
    let overlay = std::fs::read_dir(&config.paths.overlay_root)
        .unwrap()
        .flatten()
        .flat_map(|run_dir| std::fs::read_dir(run_dir.path()).unwrap().flatten())
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|x| x == "qcow2"))
        .expect("no overlay");
    let owner = |path: &Path| {
        let meta = std::fs::metadata(path).unwrap();
        (meta.uid(), meta.gid())
    };
    let overlay_owner = owner(&overlay);

    let unit = format!("certistack-guestnet-{RUN_ID}-9100.service");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_unit(container.leader, unit.clone(), stop.clone());
    let recovered = run
        .recover_guest_network(pb::RecoverGuestNetworkRequest {
            vmid: 9100,
            archive: ARCHIVE.into(),
            mode: pb::NetworkRecoveryMode::Rewrite as i32,
        })
        .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    let reply = match recovered {
        Ok(reply) => reply.into_inner(),
        Err(status) => panic!(
            "{status:?}\n{}",
            container.run(&["journalctl", "--no-pager", "-n", "60"])
        ),
    };
    let evidence = reply.evidence.unwrap();
    assert_eq!(evidence.distro, "debian", "{evidence:?}");
    assert!(
        evidence
            .files
            .iter()
            .any(|f| f.action == "written" && f.path.contains("certistack-sandbox")),
        "{evidence:?}"
    );
    assert_eq!(
        owner(&overlay),
        overlay_owner,
        "the overlay was not given back"
    );

    // What confined the appliance while it ran.
    let seen = seen.expect("the recovery's unit was never seen running");
    eprintln!("{}\n{}", seen.security, seen.processes);
    let exposure: f64 = seen
        .security
        .lines()
        .find_map(|l| {
            l.split_once("Overall exposure level for ")?
                .1
                .split_once(": ")
        })
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in {}", seen.security));
    let target = binary("certistack-connector")
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned();
    std::fs::create_dir_all(target.join("ci")).unwrap();
    std::fs::write(
        target.join("ci/guest-network-exposure.txt"),
        format!("{unit}\n{}", seen.security),
    )
    .unwrap();
    assert!(
        exposure <= MAX_EXPOSURE,
        "exposure {exposure} above {MAX_EXPOSURE}:\n{}",
        seen.security
    );
    // Real, effective and saved uid: the appliance user's, not root's.
    assert!(
        seen.main_uid
            .split_whitespace()
            .take(3)
            .all(|uid| uid == appliance_uid),
        "guestfish ran as {:?}, not {appliance_uid}",
        seen.main_uid
    );
    assert!(
        seen.processes.contains("qemu-system"),
        "the appliance's QEMU is not in the unit: {}",
        seen.processes
    );
    let qemu_uids: Vec<&str> = seen.qemu_uids.split_whitespace().collect();
    assert!(
        !qemu_uids.is_empty() && qemu_uids.iter().all(|uid| *uid == appliance_uid),
        "the appliance's QEMU ran as {qemu_uids:?}, not {appliance_uid}"
    );

    let (receipts, residue) = cleanup_receipts(&mut run, RUN_ID).await;
    assert!(residue.is_empty(), "{receipts:?} {residue:?}");
    assert_ne!(container.property(&unit, "LoadState"), "loaded");
    assert!(!overlay.exists(), "{} left", overlay.display());
    run.end_run(pb::EndRunRequest {}).await.unwrap();
    container.run(&["systemctl", "stop", UNIT]);
}
