//! Tests of the tool runner: argv and environment, secrets through descriptors, output caps,
//! timeouts and process groups, identities read from /proc, transient units.

use super::call::STDERR_EXCERPT_LINES;
use super::secrets::{Inherited, fill_pipe, prepare_secrets};
use super::spawn::install_descriptors;
use super::*;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use zeroize::Zeroizing;

fn map_call() -> ToolCall {
    ToolCall::new("/usr/bin/proxmox-backup-client", Duration::from_secs(5))
        .arg("map")
        .arg("vm/100/2026-01-01T00:00:00Z")
        .arg("drive-scsi0.img")
        .env("PBS_PASSWORD_FD", "3")
        .env("PBS_FINGERPRINT", "aa:bb")
        .secret(pipe_secret(3, b"hunter2-secret"))
}

#[test]
fn a_map_in_a_transient_unit_reads_its_secret_from_descriptor_3_never_stdin_argv_or_env() {
    let unit = transient_unit_name(
        TransientRole::MapHolder,
        "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f",
        "drive-scsi0.img",
    )
    .unwrap();
    assert_eq!(
        unit,
        "certistack-map-0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f-drive-scsi0.img.service"
    );
    let wrapped = in_transient_unit(
        map_call(),
        TransientRole::MapHolder,
        &unit,
        "CertiStack run x: backup mapping drive-scsi0.img",
        Path::new("/usr/bin/systemd-run"),
        Path::new("/usr/bin/systemctl"),
        Some("PBS_PASSWORD_FD"),
    )
    .unwrap();
    let argv: Vec<String> = wrapped
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert_eq!(wrapped.program, Path::new("/usr/bin/systemd-run"));
    for expected in [
        format!("--unit={unit}"),
        "--pipe".into(),
        "--collect".into(),
        "Type=oneshot".into(),
        "RemainAfterExit=yes".into(),
        "KillSignal=SIGINT".into(),
        "--setenv=PBS_PASSWORD_FD=3".into(),
        "--setenv=PBS_FINGERPRINT=aa:bb".into(),
    ] {
        assert!(argv.contains(&expected), "{expected} missing from {argv:?}");
    }
    assert!(
        argv.iter()
            .any(|a| a.starts_with("TimeoutStartSec=") && a.ends_with("ms")),
        "the unit's start is not bounded: {argv:?}"
    );
    // The holder must stay: systemd-run is not asked to wait for the unit to end.
    assert!(!argv.contains(&"--wait".to_owned()), "{argv:?}");
    let tool_at = argv.iter().position(|a| a == "--").unwrap();
    assert_eq!(argv[tool_at + 1..tool_at + 3], ["/bin/sh", "-c"]);
    assert_eq!(
        argv[tool_at + 4..],
        [
            "certistack-map",
            "/usr/bin/proxmox-backup-client",
            "map",
            "vm/100/2026-01-01T00:00:00Z",
            "drive-scsi0.img"
        ]
    );
    // What the unit runs, with systemd-run's stdin pipe: the tool finds the secret on
    // descriptor 3 and /dev/null on stdin, so a descriptor it opens after closing the
    // secret's never becomes stdin (which a daemonizing holder points at /dev/null).
    let probe = "read -r secret <&3; printf '%s|' \"$secret\"; readlink /proc/self/fd/0";
    let mut shell = std::process::Command::new(&argv[tool_at + 1])
        .args(&argv[tool_at + 2..tool_at + 5])
        .args(["/bin/sh", "-c", probe])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut shell.stdin.take().unwrap(), b"hunter2-secret\n").unwrap();
    let seen = shell.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&seen.stdout).trim(),
        "hunter2-secret|/dev/null"
    );
    assert!(!wrapped.display().contains("hunter2"));
    assert!(wrapped.env.is_empty() && wrapped.secrets.is_empty());
    assert_eq!(
        wrapped.stdin_secret.as_deref().map(Vec::as_slice),
        Some(&b"hunter2-secret"[..])
    );
    assert_eq!(wrapped.settles_with_unit.unwrap().unit, unit);

    // A key file cannot cross into a unit.
    let keyed = map_call().secret(SecretInput {
        child_fd: 4,
        bytes: Zeroizing::new(b"key".to_vec()),
        kind: SecretKind::Memfd,
    });
    assert!(
        in_transient_unit(
            keyed,
            TransientRole::MapHolder,
            &unit,
            "d",
            Path::new("/usr/bin/systemd-run"),
            Path::new("/usr/bin/systemctl"),
            Some("PBS_PASSWORD_FD"),
        )
        .is_err()
    );
}

#[test]
fn qm_start_in_a_transient_unit_waits_for_qm_and_unit_names_are_checked() {
    let unit = transient_unit_name(TransientRole::QmStart, "run", "9100").unwrap();
    assert_eq!(unit, "certistack-qm-start-run-9100.service");
    let wrapped = in_transient_unit(
        ToolCall::new("/usr/sbin/qm", Duration::from_secs(5))
            .arg("start")
            .arg("9100"),
        TransientRole::QmStart,
        &unit,
        "d",
        Path::new("/usr/bin/systemd-run"),
        Path::new("/usr/bin/systemctl"),
        None,
    )
    .unwrap();
    let argv = wrapped.display();
    assert!(argv.contains(" --wait "), "{argv}");
    assert!(argv.ends_with(" -- /usr/sbin/qm start 9100"), "{argv}");
    assert!(wrapped.settles_with_unit.is_none() && wrapped.stdin_secret.is_none());
    for (run, object) in [
        ("run", "../x"),
        ("run", "a@b"),
        ("run", "a b"),
        ("", "9100"),
        ("run", ""),
    ] {
        assert!(
            transient_unit_name(TransientRole::MapHolder, run, object).is_err(),
            "{run:?} {object:?}"
        );
    }
    let long = "a".repeat(250);
    assert!(transient_unit_name(TransientRole::QmStart, "run", &long).is_err());
}

#[test]
fn a_guestfish_session_in_a_transient_unit_keeps_its_pipes_and_is_bounded_by_the_unit() {
    let run = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
    let role = TransientRole::GuestNetwork {
        memory_max_mib: 1536,
    };
    let unit = transient_unit_name(role, run, "9100").unwrap();
    assert_eq!(unit, format!("certistack-guestnet-{run}-9100.service"));
    let description = transient_unit_description(role, run, "9100");
    assert_eq!(
        description,
        format!("CertiStack run {run}: guest network recovery of 9100")
    );
    let wrapped = in_transient_unit(
        ToolCall::new("/usr/bin/guestfish", Duration::from_secs(300))
            .arg("--format=qcow2")
            .arg("-a")
            .arg("/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2")
            .env("LIBGUESTFS_BACKEND", "direct")
            .env("LIBGUESTFS_MEMSIZE", "512"),
        role,
        &unit,
        &description,
        Path::new("/usr/bin/systemd-run"),
        Path::new("/usr/bin/systemctl"),
        None,
    )
    .unwrap();
    let argv: Vec<String> = wrapped
        .args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let properties: Vec<&str> = argv
        .windows(2)
        .filter(|w| w[0] == "--property")
        .map(|w| w[1].as_str())
        .collect();
    assert_eq!(
        properties,
        [
            "Type=exec",
            "TimeoutStopSec=15s",
            "SendSIGKILL=yes",
            "RuntimeMaxSec=330000ms",
            "MemoryMax=1536M",
            "TimeoutStartSec=300000ms",
        ],
        "{argv:?}"
    );
    let tool_at = argv.iter().position(|a| a == "--").unwrap();
    // guestfish's commands and answers flow over the daemon's pipes (--pipe), and
    // systemd-run returns with guestfish's exit status once the unit is gone (--wait).
    assert_eq!(
        argv[..tool_at]
            .iter()
            .filter(|a| !a.starts_with("--property") && !a.contains('='))
            .collect::<Vec<_>>(),
        ["--quiet", "--collect", "--pipe", "--wait"],
        "{argv:?}"
    );
    assert!(argv.contains(&format!("--unit={unit}")));
    assert!(argv.contains(&format!("--description={description}")));
    assert!(argv.contains(&"--setenv=LIBGUESTFS_BACKEND=direct".to_owned()));
    assert!(argv.contains(&"--setenv=LIBGUESTFS_MEMSIZE=512".to_owned()));
    assert_eq!(
        argv[tool_at + 1..],
        [
            "/usr/bin/guestfish",
            "--format=qcow2",
            "-a",
            "/var/lib/certistack-overlays/run/9100-drive-scsi0.qcow2"
        ]
    );
    assert!(wrapped.settles_with_unit.is_none() && wrapped.env.is_empty());
}

#[test]
fn stderr_excerpts_keep_the_last_lines_escaped_and_capped() {
    let mut stderr = String::new();
    for n in 0..20 {
        stderr.push_str(&format!("line {n}\n"));
    }
    stderr.push_str("forged\u{1b}[31m \u{202e}");
    stderr.push('\n');
    stderr.push_str(&"x".repeat(4096));
    let output = ToolOutput {
        exit_code: Some(1),
        stdout: String::new(),
        stdout_bytes: Vec::new(),
        stderr,
        elapsed: std::time::Duration::ZERO,
        truncated: false,
    };
    let excerpt = output.stderr_excerpt();
    let lines: Vec<&str> = excerpt.lines().collect();
    assert_eq!(lines.len(), STDERR_EXCERPT_LINES, "{excerpt}");
    assert_eq!(lines.first(), Some(&"line 14"));
    assert!(excerpt.contains("forged\\u{1b}[31m \\u{202e}"), "{excerpt}");
    assert!(!excerpt.contains('\u{1b}'));
    assert!(
        lines.last().unwrap().ends_with("…[3584 more bytes]"),
        "{excerpt}"
    );
}

fn sh(script: &str) -> ToolCall {
    ToolCall::new("/bin/sh", Duration::from_secs(5))
        .arg("-c")
        .arg(script)
}

/// A stand-in `systemctl` answering `show` from `$STATE` (`gone`, `ours`, `theirs`) and
/// logging every verb to `calls`.
fn fake_systemctl(dir: &Path, state: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(format!("systemctl-{state}"));
    let script = format!(
        "#!/bin/sh\necho \"$1\" >>{calls}\ncase \"$1:{state}\" in\n  show:gone) echo LoadState=not-found; echo Description= ;;\n  show:ours) echo LoadState=loaded; echo 'Description=CertiStack run r1: guest network recovery of 9100' ;;\n  show:theirs) echo LoadState=loaded; echo 'Description=someone else' ;;\nesac\n",
        calls = dir.join("calls").display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[tokio::test]
async fn releasing_a_unit_says_whether_it_stopped_one_and_leaves_anothers_alone() {
    let dir = std::env::temp_dir().join(format!("release-unit-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&dir).unwrap();
    let ours = "CertiStack run r1: guest network recovery of 9100";
    let release = |state: &'static str| {
        let systemctl = fake_systemctl(&dir, state);
        async move {
            release_transient_unit(
                &systemctl,
                "certistack-guestnet-r1-9100.service",
                ours,
                Duration::from_secs(5),
            )
            .await
        }
    };
    let calls = || std::fs::read_to_string(dir.join("calls")).unwrap_or_default();
    assert_eq!(release("gone").await, Ok(UnitRelease::Gone));
    assert_eq!(calls(), "show\n", "a unit that is gone is not stopped");
    std::fs::remove_file(dir.join("calls")).unwrap();
    assert_eq!(release("ours").await, Ok(UnitRelease::Stopped));
    assert_eq!(calls(), "show\nstop\nreset-failed\n");
    std::fs::remove_file(dir.join("calls")).unwrap();
    let refused = release("theirs").await.unwrap_err();
    assert!(refused.contains("left alone"), "{refused}");
    assert_eq!(calls(), "show\n", "another's unit is never stopped");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn environment_is_cleared() {
    let out = run(sh("env").env("PBS_FINGERPRINT", "ab")).await.unwrap();
    let mut lines: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| !l.starts_with("PWD=") && !l.starts_with("SHLVL=") && !l.starts_with("_="))
        .collect();
    lines.sort();
    assert_eq!(
        lines,
        ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "PBS_FINGERPRINT=ab"]
    );
}

#[tokio::test]
async fn secrets_arrive_on_the_named_descriptors_only() {
    let call = sh("ls -l /proc/$$/fd; printf '|'; cat <&3; printf '|'; cat /proc/self/fd/4")
        .secret(SecretInput {
            child_fd: 3,
            bytes: Zeroizing::new(b"hunter2".to_vec()),
            kind: SecretKind::Pipe,
        })
        .secret(SecretInput {
            child_fd: 4,
            bytes: Zeroizing::new(b"{\"kdf\":null}".to_vec()),
            kind: SecretKind::Memfd,
        });
    let shown = call.display();
    assert!(!shown.contains("hunter2"));
    let out = run(call).await.unwrap();
    let parts: Vec<&str> = out.stdout.trim().split('|').collect();
    assert_eq!(parts[1], "hunter2");
    assert_eq!(parts[2], "{\"kdf\":null}");
    // The shell holds stdin, stdout, stderr and fds 3 and 4, and nothing else leaked in.
    let fds: Vec<&str> = parts[0].lines().filter(|l| l.contains(" -> ")).collect();
    let numbers: Vec<&str> = fds
        .iter()
        .filter_map(|l| l.split(" -> ").next()?.rsplit(' ').next())
        .collect();
    assert_eq!(
        numbers,
        ["0", "1", "2", "3", "4"],
        "descriptors in the child: {fds:?}"
    );
}

fn pipe_secret(child_fd: RawFd, bytes: &[u8]) -> SecretInput {
    SecretInput {
        child_fd,
        bytes: Zeroizing::new(bytes.to_vec()),
        kind: SecretKind::Pipe,
    }
}

/// The shell's descriptors (`ls /proc/$$/fd`), sorted numerically.
fn listed_fds(listing: &str) -> Vec<RawFd> {
    let mut fds: Vec<RawFd> = listing
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    fds.sort_unstable();
    fds
}

#[tokio::test]
async fn inheritable_descriptors_below_the_highest_target_do_not_leak() {
    // Descriptors the daemon holds without close-on-exec, as a library or an inherited
    // jobserver might leave them. Their numbers lie below the highest target.
    let null = std::fs::File::open("/dev/null").unwrap();
    let leaky_a = rustix::io::dup(&null).unwrap();
    let leaky_b = rustix::io::dup(&null).unwrap();
    let highest_leaky = leaky_a.as_raw_fd().max(leaky_b.as_raw_fd());
    let (first, second) = (highest_leaky + 1, highest_leaky + 3);
    let call = sh(&format!(
            "ls /proc/$$/fd; printf '|'; cat /proc/self/fd/{first}; printf '|'; cat /proc/self/fd/{second}"
        ))
        .secret(pipe_secret(first, b"hunter2"))
        .secret(SecretInput {
            child_fd: second,
            bytes: Zeroizing::new(b"key".to_vec()),
            kind: SecretKind::Memfd,
        });
    let out = run(call).await.unwrap();
    let parts: Vec<&str> = out.stdout.split('|').collect();
    assert_eq!(parts[1], "hunter2", "{}", out.stderr);
    assert_eq!(parts[2], "key");
    assert_eq!(
        listed_fds(parts[0]),
        [0, 1, 2, first, second],
        "{} and {} were open in the parent without close-on-exec",
        leaky_a.as_raw_fd(),
        leaky_b.as_raw_fd()
    );
}

#[tokio::test]
#[allow(unsafe_code)]
async fn descriptors_are_placed_under_a_low_open_file_limit() {
    let secrets = [pipe_secret(3, b"hunter2"), pipe_secret(5, b"second")];
    let inherited = prepare_secrets(&secrets).unwrap();
    let mut command = tokio::process::Command::new("/bin/sh");
    command
        .arg("-c")
        .arg("ls /proc/$$/fd; printf '|'; cat <&3; printf '|'; cat <&5")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit(2) is async-signal-safe and the closure allocates nothing. It runs
    // before the descriptor moves registered below, so they happen under a limit of 64
    // open files, as in a daemon started with `LimitNOFILE=64`.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 64,
                rlim_max: 64,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    install_descriptors(&mut command, &inherited).unwrap();
    let out = command.output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let parts: Vec<&str> = stdout.split('|').collect();
    assert_eq!(listed_fds(parts[0]), [0, 1, 2, 3, 5]);
    assert_eq!((parts[1], parts[2]), ("hunter2", "second"));
}

#[test]
fn targets_are_checked_before_any_descriptor_is_made() {
    let nine: Vec<SecretInput> = (3..12).map(|fd| pipe_secret(fd, b"x")).collect();
    let error = prepare_secrets(&nine).err().unwrap();
    assert!(error.to_string().contains("at most 8"), "{error}");
    let error = prepare_secrets(&[pipe_secret(1, b"x")]).err().unwrap();
    assert!(error.to_string().contains("stdio"), "{error}");
    let error = prepare_secrets(&[pipe_secret(3, b"x"), pipe_secret(3, b"y")])
        .err()
        .unwrap();
    assert!(error.to_string().contains("two secrets"), "{error}");
    // The move list itself refuses a ninth descriptor instead of dropping it.
    let inherited: Vec<Inherited> = (3..12)
        .map(|child_fd| Inherited {
            fd: rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .unwrap()
                .0,
            child_fd,
        })
        .collect();
    let mut command = tokio::process::Command::new("/bin/true");
    assert!(install_descriptors(&mut command, &inherited).is_err());
}

#[test]
fn a_secret_the_pipe_cannot_hold_is_an_error_not_a_short_write() {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    // The smallest pipe the kernel makes: one page, as under fs.pipe-user-pages-soft.
    rustix::pipe::fcntl_setpipe_size(&write, 4096).unwrap();
    let capacity = rustix::pipe::fcntl_getpipe_size(&write).unwrap();
    let error = fill_pipe(&write, &vec![b'x'; capacity + 1]).unwrap_err();
    assert!(
        error.to_string().contains(&format!(
            "took {capacity} of the secret's {} bytes",
            capacity + 1
        )),
        "{error}"
    );
    drop(read);
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    fill_pipe(&write, b"hunter2").unwrap();
    drop(write);
    let mut buffer = [0u8; 16];
    let n = rustix::io::read(&read, &mut buffer).unwrap();
    assert_eq!(&buffer[..n], b"hunter2");
}

#[tokio::test]
async fn without_secrets_only_stdio_is_inherited() {
    let out = run(sh("ls /proc/$$/fd")).await.unwrap();
    let mut fds: Vec<&str> = out.stdout.split_whitespace().collect();
    fds.sort();
    assert_eq!(fds, ["0", "1", "2"]);
}

#[tokio::test]
async fn exit_codes_and_capped_output() {
    let out = run(sh("echo out; echo err >&2; exit 7")).await.unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_str(), out.stderr.as_str()),
        (Some(7), "out\n", "err\n")
    );
    let out = run(sh("head -c 200000 /dev/zero")).await.unwrap();
    assert_eq!(out.stdout.len(), OUTPUT_CAP);
    assert!(out.truncated);
    assert!(out.success());
    // A caller that reads more sets its own cap, still a bound.
    let wide = sh("head -c 200000 /dev/zero").output_cap(300_000);
    let out = run(wide).await.unwrap();
    assert_eq!((out.stdout.len(), out.truncated), (200_000, false));
    let out = run(sh("head -c 200000 /dev/zero").output_cap(100_000))
        .await
        .unwrap();
    assert_eq!((out.stdout.len(), out.truncated), (100_000, true));
}

#[tokio::test]
async fn timeout_kills_the_process_group() {
    let marker = std::env::temp_dir().join(format!("certistack-timeout-{}", std::process::id()));
    let script = format!("(sleep 30; touch {}) & sleep 30", marker.display());
    let call = ToolCall::new("/bin/sh", Duration::from_millis(300))
        .arg("-c")
        .arg(script);
    let started = Instant::now();
    assert!(matches!(run(call).await, Err(ToolError::Timeout { .. })));
    assert!(started.elapsed() < Duration::from_secs(5));
    // The grandchild was in the same process group and died with it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let needle = marker.display().to_string();
    let survivors: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect();
    assert!(survivors.is_empty(), "left behind: {survivors:?}");
    assert!(!marker.exists());
}

fn processes_mentioning(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(needle))
        .collect()
}

#[tokio::test]
async fn a_tools_processes_are_killed_even_after_they_left_its_group() {
    // Like a map's holder: a child that starts a session of its own.
    let needle = format!("certistack-reap-{}", std::process::id());
    let script = format!("setsid sh -c 'sleep 30; : {needle}' & sleep 30");
    let call = ToolCall::new("/bin/sh", Duration::from_millis(500))
        .arg("-c")
        .arg(&script);
    let tool = start(call).unwrap();
    let identity = tool.identity().unwrap();
    assert_eq!(identity.process_group, identity.pid);
    assert!(identity.start_time > 0);
    assert!(matches!(tool.wait().await, Err(ToolError::Timeout { .. })));
    let left = processes_mentioning(&needle);
    assert!(left.is_empty(), "left behind at the timeout: {left:?}");

    // The same, from the journaled identity alone (a daemon that restarted mid-step).
    let call = ToolCall::new("/bin/sh", Duration::from_secs(60))
        .arg("-c")
        .arg(&script);
    let tool = start(call).unwrap();
    let identity = tool.identity().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        processes_mentioning(&needle).len(),
        2,
        "sh -c and its setsid child"
    );
    let killed = identity.reap(Duration::from_secs(5)).await.unwrap();
    assert!(killed >= 2, "{killed}");
    let left = processes_mentioning(&needle);
    assert!(left.is_empty(), "left behind by reap: {left:?}");
    drop(tool);
    // A pid that is now another process (different start time) is never touched.
    let stranger = ToolIdentity {
        start_time: identity.start_time.saturating_add(1),
        ..ToolIdentity::of(std::process::id() as i32).unwrap()
    };
    assert_eq!(stranger.reap(Duration::from_secs(1)).await, Ok(0));
}

#[tokio::test]
async fn a_daemon_holding_the_pipes_does_not_hang_the_call() {
    // Like `proxmox-backup-client map`: the parent prints and exits, a forked child keeps
    // stderr open.
    let call = sh("echo mapped >&2; (sleep 3) & exit 0");
    let started = Instant::now();
    let out = run(call).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(out.stderr, "mapped\n");
}

#[tokio::test]
async fn missing_program_is_a_spawn_error() {
    let err = run(ToolCall::new("/nonexistent/qm", Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("check the tool path"), "{err}");
}
