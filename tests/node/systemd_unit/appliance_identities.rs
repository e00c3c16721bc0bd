//! One identity per appliance: two appliances running at once under two users of the
//! package's list cannot see each other's processes (and so cannot open each other's overlay
//! through `/proc/<pid>/fd`, or signal or trace them). The control: a second appliance under
//! the first one's user sees it.

use super::*;
use std::io::Write;

/// Answers one line: `hang` sleeps (an appliance at work); anything else prints the unit's
/// uid and how many `sleep 600` processes it can see.
const STANDIN: &str = "#!/bin/sh\nread -r line\n[ \"$line\" = hang ] && exec sleep 600\necho \"uid: $(id -u)\"\necho \"sleepers: $(pgrep -c -f 'sleep 600')\"\n";

#[tokio::test(flavor = "multi_thread")]
async fn two_appliances_at_once_run_as_two_users_and_cannot_see_each_other() {
    if !privileged(
        "two_appliances_at_once_run_as_two_users_and_cannot_see_each_other",
        &["systemd-nspawn", "mmdebstrap", "nsenter"],
    ) {
        return;
    }
    use certistack_connector::node::guest_network;
    use certistack_core::validate::{RunId, Validated, Vmid};
    let _serial = SERIAL.lock().await;
    let root = container_root();
    let dir = TempDir::new("appliance-identities");
    let standin = dir.0.join("guestfish");
    std::fs::write(&standin, STANDIN).unwrap();
    std::fs::set_permissions(
        &standin,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
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
    let user = |name: &str| {
        let account = container.run(&["getent", "passwd", name]);
        let field = |index: usize| -> u32 {
            account
                .split(':')
                .nth(index)
                .unwrap_or_else(|| panic!("no user {name}: {account:?}"))
                .parse()
                .unwrap()
        };
        guest_network::ApplianceUser {
            name: name.to_owned(),
            uid: field(2),
            gid: field(3),
        }
    };
    let (first, second) = (user("certistack-guestnet-1"), user("certistack-guestnet-2"));
    assert_ne!(first.uid, second.uid);
    let run_id = RunId::validate(RUN_ID).unwrap();
    let start = |vmid: u32, user: &guest_network::ApplianceUser, line: &str| {
        let unit = guest_network::guest_network_unit(&run_id, Vmid::parse("t", vmid).unwrap(), 512)
            .unwrap();
        let overlay = dir.0.join(format!("{vmid}.qcow2"));
        std::fs::write(&overlay, b"").unwrap();
        let confinement = guest_network::Confinement {
            user: user.clone(),
            loop_device: "/dev/loop7".into(),
            kvm_device: "/dev/kvm".into(),
            launcher: "/usr/local/bin/certistack-connector".into(),
        };
        let call = guest_network::guestfish_call(
            Path::new("/usr/local/bin/guestfish"),
            &overlay,
            &guest_network::Appliance {
                timeout: std::time::Duration::from_secs(120),
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
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        (child, unit.name)
    };
    let ask = |vmid: u32, user: &guest_network::ApplianceUser| {
        let (child, _) = start(vmid, user, "probe");
        let output = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr)
    };

    // The first appliance at work, as certistack-guestnet-1.
    let (mut working, working_unit) = start(9101, &first, "hang");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while container
        .run(&["pgrep", "-u", &first.uid.to_string(), "-f", "sleep 600"])
        .trim()
        .is_empty()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the first appliance never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    let other = ask(9102, &second);
    assert!(other.contains(&format!("uid: {}\n", second.uid)), "{other}");
    assert!(
        other.contains("sleepers: 0\n"),
        "an appliance under another user saw the first one's processes: {other}"
    );
    let same = ask(9103, &first);
    assert!(
        same.contains("sleepers: 1\n"),
        "the control failed: under the same user the first appliance should be visible: {same}"
    );

    container.run(&["systemctl", "stop", &working_unit]);
    let _ = working.kill();
    let _ = working.wait();
}
