//! A confined appliance holds a descriptor of the backup's loop device, and the loop driver
//! checks no capability for `LOOP_CHANGE_FD` or `LOOP_CLR_FD`. Started through the
//! connector's `appliance-exec` launcher (as every confined appliance is), both fail with
//! EPERM and the device keeps reading the mapping; started without it, the same program swaps
//! the backing, and the backing check by device and inode (`LOOP_GET_STATUS64`) sees it,
//! whatever the path.

use super::*;
use certistack_connector::node::loopdev::{BackingIdentity, backing_identity};
use std::path::Path;
use std::process::Command;

/// Tries, on the loop device argv[1], `LOOP_CHANGE_FD` to the file argv[2] and (with argv[3]
/// `clear`) `LOOP_CLR_FD`, `LOOP_SET_STATUS64` (which could move the window it shows),
/// `LOOP_CONFIGURE`, `LOOP_CLR_FD` with high bits set in the command register (the kernel
/// reads 32 bits), and `BLKGETSIZE64`, a block-layer ioctl the launcher leaves alone, as a
/// broken-out appliance would; prints each outcome (`ok` or the errno).
const ATTACK: &str = r#"
import ctypes, fcntl, os, sys
device = os.open(sys.argv[1], os.O_RDONLY)
other = os.open(sys.argv[2], os.O_RDONLY)
tries = [("change", 0x4C06, other)]
if sys.argv[3] == "clear":
    tries = [("size", 0x80081272, bytes(8))] + tries + [
        ("status", 0x4C04, bytes(232)),
        ("configure", 0x4C0A, bytes(304)),
        ("clear", 0x4C01, 0),
    ]
for name, request, argument in tries:
    try:
        fcntl.ioctl(device, request, argument)
        print(name, "ok")
    except OSError as error:
        print(name, error.errno)
if sys.argv[3] == "clear":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(16), ctypes.c_long(device),
                          ctypes.c_ulong(0x100004C01), ctypes.c_long(0))
    print("highbits", "ok" if result == 0 else ctypes.get_errno())
"#;

/// A read-only loop device over `file`, detached on drop.
struct LoopDevice(String);

impl LoopDevice {
    fn attach(file: &Path) -> Self {
        let output = Command::new("losetup")
            .args(["--find", "--show", "--read-only"])
            .arg(file)
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        Self(String::from_utf8(output.stdout).unwrap().trim().to_owned())
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[tokio::test]
async fn a_loop_ioctl_from_the_appliance_launcher_fails_and_a_swap_without_it_is_seen() {
    if !privileged(
        "a_loop_ioctl_from_the_appliance_launcher_fails_and_a_swap_without_it_is_seen",
        &["losetup", "python3"],
    ) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new("loop-ioctls");
    let mapping = dir.0.join("mapping.img");
    let attacker = dir.0.join("attacker.img");
    std::fs::write(&mapping, vec![0x11; 1 << 20]).unwrap();
    std::fs::write(&attacker, vec![0x22; 1 << 20]).unwrap();
    let device = LoopDevice::attach(&mapping);
    let held = || backing_identity(Path::new(&device.0)).unwrap();
    let ours = BackingIdentity::of_file(&mapping).unwrap();
    assert_eq!(held(), ours);

    let confined = Command::new(binary("certistack-connector"))
        .args([
            "appliance-exec",
            "/usr/bin/python3",
            "-c",
            ATTACK,
            &device.0,
        ])
        .arg(&attacker)
        .arg("clear")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&confined.stdout),
        "size ok\nchange 1\nstatus 1\nconfigure 1\nclear 1\nhighbits 1\n",
        "{confined:?}"
    );
    assert_eq!(held(), ours, "the launcher let the backing change");
    let first = std::fs::read(&device.0).unwrap();
    assert!(first.iter().all(|byte| *byte == 0x11));

    // The control: the same program, not launched confined, swaps the backing (the loop
    // driver asks no capability), and the identity check tells, though sysfs still shows a
    // path.
    let unconfined = Command::new("/usr/bin/python3")
        .args(["-c", ATTACK, &device.0])
        .arg(&attacker)
        .arg("keep")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&unconfined.stdout),
        "change ok\n",
        "{unconfined:?}"
    );
    let now = held();
    assert_ne!(now, ours, "a swapped backing was not seen");
    assert_eq!(now, BackingIdentity::of_file(&attacker).unwrap());

    // Moving the window the device shows (LOOP_SET_STATUS64's offset) is seen too.
    let moved = Command::new("/usr/bin/python3")
        .args(["-c", MOVE_WINDOW, &device.0])
        .output()
        .unwrap();
    assert!(moved.status.success(), "{moved:?}");
    let now = held();
    assert_eq!(now.offset, 4096, "{now}");
    assert_ne!(now, BackingIdentity::of_file(&attacker).unwrap());
}

/// Sets the loop device argv[1]'s offset to 4096 (`LOOP_GET_STATUS64`, then
/// `LOOP_SET_STATUS64` with `lo_offset`, at byte 24 of `struct loop_info64`, changed).
const MOVE_WINDOW: &str = r#"
import fcntl, os, struct, sys
device = os.open(sys.argv[1], os.O_RDONLY)
info = bytearray(232)
fcntl.ioctl(device, 0x4C05, info)
struct.pack_into("=Q", info, 24, 4096)
fcntl.ioctl(device, 0x4C04, bytes(info))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn start_vm_refuses_a_mapping_whose_backing_was_swapped() {
    if !privileged(
        "start_vm_refuses_a_mapping_whose_backing_was_swapped",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    let mut run = Run::begin_with("swapped", &[ARCHIVE], |_| {}, sandbox_grant).await;
    map_overlay_and_vm(&mut run.client, 9100).await;
    let loops = run.loops();
    assert_eq!(loops.len(), 1, "{loops:?}");
    let device = &loops[0].0;
    // A file of the mapping's size (LOOP_CHANGE_FD wants one), swapped in as an opener of the
    // device could without the launcher.
    let other = run.lab.root.join("other.img");
    std::fs::write(&other, vec![0x33; 8 << 20]).unwrap();
    let swapped = Command::new("/usr/bin/python3")
        .args(["-c", ATTACK, device])
        .arg(&other)
        .arg("keep")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&swapped.stdout),
        "change ok\n",
        "{swapped:?}"
    );
    // sysfs names the new file, so the path check refuses first; a swap to a file at the
    // mapping's own path is the identity check's (the test above).
    assert_status(
        run.client.start_vm(pb::VmRequest { vmid: 9100 }).await,
        Code::FailedPrecondition,
        "is no longer this run's read-only mapping of drive-scsi0.img",
    );
    run.stop().await;
}
