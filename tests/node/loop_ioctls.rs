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
/// `clear`) `LOOP_CLR_FD`, as a broken-out appliance would; prints each outcome (`ok` or the
/// errno).
const ATTACK: &str = r#"
import fcntl, os, sys
device = os.open(sys.argv[1], os.O_RDONLY)
other = os.open(sys.argv[2], os.O_RDONLY)
tries = [("change", 0x4C06, other)]
if sys.argv[3] == "clear":
    tries.append(("clear", 0x4C01, 0))
for name, request, argument in tries:
    try:
        fcntl.ioctl(device, request, argument)
        print(name, "ok")
    except OSError as error:
        print(name, error.errno)
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
        "change 1\nclear 1\n",
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
}
