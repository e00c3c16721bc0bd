//! The lab's cases: real guests booted by the `qm` double under TCG from copy-on-write overlays
//! of "backups" (lab guest disks on read-only loop devices), driven by `certistack-ctl run`
//! against the shipped connector, in a node network namespace holding the sandbox VNets. Each
//! guest reads a marker from its disk and serves it (TCP banner, HTTP page); qemu-ga answers on
//! the agent port unless its disk says otherwise.

use super::runs::{Fleet, RUN_TOOLS, run_tables, split_output, start_ctl, summary, wait_for_step};
use super::*;
use certistack_controller::report::{StepResult, Verdict};
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SNAPSHOT_TIME: &str = "2026-11-01T02:00:00Z";

fn lab_tools() -> Vec<&'static str> {
    RUN_TOOLS.iter().chain(GUEST_ASSET_TOOLS).copied().collect()
}

/// One validation of the lab plan: validation `name` restores VM `100 + index`'s disk into
/// sandbox `9100 + index` on VNet `csv<index>` (probe network 10.77.<index>.0/24, guest at
/// .10) and expects the guest to serve `expected_marker`.
struct Case<'a> {
    name: &'a str,
    index: u8,
    disk: GuestDisk<'a>,
    expected_marker: &'a str,
    agent_seconds: u32,
}

impl Case<'_> {
    fn vmid(&self) -> u32 {
        9100 + u32::from(self.index)
    }

    fn snapshot(&self) -> String {
        format!("vm/{}/{SNAPSHOT_TIME}", 100 + u32::from(self.index))
    }

    fn guest(&self) -> String {
        format!("10.77.{}.10", self.index)
    }

    fn expected_body(&self) -> String {
        format!("certistack lab guest: marker {}\n", self.expected_marker)
    }

    /// The lab's guests take the address the lab gives them: each entry names its
    /// `network_recovery` mode rather than relying on the default.
    fn plan_entry(&self) -> String {
        let index = self.index;
        let guest = self.guest();
        let marker = self.expected_marker;
        let body_sha256 = hex::encode(sha2::Sha256::digest(self.expected_body()));
        format!(
            "  - name: {name}\n    node: pve1\n    source_vmid: {source}\n    snapshot: \"{SNAPSHOT_TIME}\"\n    archives: [{ARCHIVE}]\n    sandbox:\n      - vmid: {vmid}\n        cores: 1\n        memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: csv{index}\n      probe_source: 10.77.{index}.2/24\n    probes:\n      - kind: tcp\n        address: {guest}\n        port: 22\n        expect:\n          banner_prefix: \"CERTISTACK-LAB {marker}\"\n      - kind: http\n        address: {guest}\n        port: 80\n        expect:\n          http_path: /\n          body_contains: \"{marker}\"\n          body_sha256: \"{body_sha256}\"\n    network_recovery:\n      mode: preserve\n    timeouts:\n      run_seconds: 900\n      guest_agent_seconds: {agent}\n",
            name = self.name,
            source = 100 + u32::from(index),
            vmid = self.vmid(),
            agent = self.agent_seconds,
        )
    }
}

/// A node `pve1` holding every case's backup, its controller configuration and the plan.
fn lab_node(tag: &str, cases: &[Case]) -> (Fleet, PathBuf, PathBuf) {
    let mut fleet = Fleet::empty(tag);
    fleet.add_sim_node(1, serde_json::json!({ "node": "pve1" }), |lab| {
        for case in cases {
            lab.add_guest_backup(&case.snapshot(), ARCHIVE, &case.disk);
        }
    });
    let config = fleet.controller_config(&[("pve1", 17441)]);
    let secret = fleet.dir.0.join("pbs-password");
    std::fs::write(&secret, format!("{PBS_PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut plan = format!(
        "storage:\n  server: pbs.lab\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n",
        ["ab"; 32].join(":")
    );
    for case in cases {
        plan.push_str(&case.plan_entry());
    }
    let plan_path = fleet.dir.0.join("lab.yaml");
    std::fs::write(&plan_path, plan).unwrap();
    (fleet, config, plan_path)
}

/// Nothing of the lab is left: no loop device, QEMU, agent or VM config of the node, no
/// address on any VNet, no run table.
fn assert_no_residue(fleet: &Fleet, vnets: u8) {
    let mut residue = fleet.nodes[0].residue();
    for index in 1..=vnets {
        let out = Command::new("ip")
            .args(["-o", "-4", "address", "show", "dev", &format!("csv{index}")])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        residue.extend(text.lines().map(|l| format!("address {l}")));
    }
    residue.extend(run_tables());
    residue.extend(
        std::fs::read_dir(fleet.nodes[0].lab.root.join("overlays"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| format!("overlay {}", e.path().display())),
    );
    assert!(residue.is_empty(), "residue: {residue:?}");
}

fn step<'a>(
    statement: &'a certistack_controller::report::Statement,
    name: &str,
) -> &'a certistack_controller::report::Step {
    statement
        .predicate
        .steps
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no step {name}: {:?}", statement.predicate.steps))
}

/// Cases 1 to 5 of the lab in one plan on one node, validated at once: a good backup passes
/// with the guest agent's facts, the banner and the HTTP body digest of its marker; a backup
/// with another marker fails on that evidence; a backup that does not boot fails after the
/// bounded guest-agent wait with its probes failing; a guest without an agent has no facts,
/// says so, and passes on its probes. Nothing is left on the machine afterwards.
#[test]
fn lab_good_wrong_unbootable_and_agentless_backups_are_validated_at_once_on_one_node() {
    let tools = lab_tools();
    if !privileged(
        "lab_good_wrong_unbootable_and_agentless_backups_are_validated_at_once_on_one_node",
        &tools,
    ) {
        return;
    }
    guest_assets();
    let netns = Netns::new("lab", &["csv1", "csv2", "csv3", "csv4"]);
    inside(&netns.name, || async {
        let cases = [
            Case {
                name: "lab-good",
                index: 1,
                disk: GuestDisk {
                    marker: "good-5d1e",
                    address: "10.77.1.10/24",
                    agent: true,
                    boots: true,
                },
                expected_marker: "good-5d1e",
                agent_seconds: 300,
            },
            Case {
                name: "lab-wrong",
                index: 2,
                disk: GuestDisk {
                    marker: "stale-0000",
                    address: "10.77.2.10/24",
                    agent: true,
                    boots: true,
                },
                expected_marker: "fresh-7a3c",
                agent_seconds: 300,
            },
            Case {
                name: "lab-panic",
                index: 3,
                disk: GuestDisk {
                    marker: "panic-9b2f",
                    address: "10.77.3.10/24",
                    agent: true,
                    boots: false,
                },
                expected_marker: "panic-9b2f",
                agent_seconds: 45,
            },
            Case {
                name: "lab-agentless",
                index: 4,
                disk: GuestDisk {
                    marker: "quiet-41c8",
                    address: "10.77.4.10/24",
                    agent: false,
                    boots: true,
                },
                expected_marker: "quiet-41c8",
                agent_seconds: 90,
            },
        ];
        let (fleet, config, plan) = lab_node("lab-cases", &cases);
        let started = Instant::now();
        let mut command = fleet.ctl(&plan, &config);
        command.args(["--per-node", "4"]);
        let out = tokio::process::Command::from(command)
            .output()
            .await
            .unwrap();
        eprintln!(
            "four lab validations in {:?}\n{}",
            started.elapsed(),
            String::from_utf8_lossy(&out.stderr)
        );
        let (summaries, events) = split_output(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(out.status.code(), Some(1), "{summaries:?}");

        // 1. A good backup.
        let good = summary(&summaries, "lab-good");
        assert_eq!(good["outcome"], "passed", "{good}");
        assert_eq!(good["cleanup"], "complete", "{good}");
        let statement = fleet.report(good);
        let p = &statement.predicate;
        assert_eq!(p.verdict, Verdict::Passed);
        assert_eq!(p.guest.status, "running");
        assert_eq!(
            p.guest.os_info["id"], "certistack-lab",
            "{:?}",
            p.guest.os_info
        );
        assert!(
            p.guest.os_info["kernel-release"]
                .as_str()
                .is_some_and(|k| k.ends_with("-amd64")),
            "{:?}",
            p.guest.os_info
        );
        assert!(
            p.guest.interfaces.to_string().contains("10.77.1.10"),
            "{}",
            p.guest.interfaces
        );
        let tcp = &p.probes[0];
        assert_eq!(tcp.target, "tcp://10.77.1.10:22");
        assert!(tcp.passed, "{tcp:?}");
        assert!(tcp.detail.contains("CERTISTACK-LAB good-5d1e"), "{tcp:?}");
        let http = &p.probes[1];
        assert_eq!(http.target, "http://10.77.1.10:80");
        assert!(http.passed, "{http:?}");
        let digest = hex::encode(sha2::Sha256::digest(cases[0].disk.http_body()));
        assert!(http.expected.contains(&digest), "{http:?}");
        // What the guest actually served, as the node hashed it, not what the plan expected.
        assert_eq!(http.received_sha256, digest, "{http:?}");
        assert_eq!(tcp.received_sha256.len(), 64, "{tcp:?}");
        assert_eq!(step(&statement, "guest agent 9101").result, StepResult::Ok);

        // 2. The disk holds another marker: the guest boots and answers, the probes say why
        // the backup is not what was expected.
        let wrong = summary(&summaries, "lab-wrong");
        assert_eq!(wrong["outcome"], "failed", "{wrong}");
        assert_eq!(wrong["cleanup"], "complete", "{wrong}");
        let statement = fleet.report(wrong);
        let p = &statement.predicate;
        let Verdict::Failed { reasons } = &p.verdict else {
            panic!("{:?}", p.verdict);
        };
        assert_eq!(p.guest.os_info["id"], "certistack-lab");
        assert!(
            reasons[0].starts_with("probe tcp://10.77.2.10:22 failed")
                && reasons[0].contains("CERTISTACK-LAB stale-0000"),
            "{reasons:?}"
        );
        let served = hex::encode(sha2::Sha256::digest(cases[1].disk.http_body()));
        let expected = hex::encode(sha2::Sha256::digest(cases[1].expected_body()));
        assert!(
            reasons[1].starts_with("probe http://10.77.2.10:80 failed")
                && reasons[1].contains(&format!("body SHA-256 {served} is not {expected}")),
            "{reasons:?}"
        );
        assert!(p.probes.iter().all(|probe| !probe.passed));

        // 3. A disk that does not boot: the guest agent wait ends at its bound, the probes
        // fail, and everything is cleaned up.
        let panic = summary(&summaries, "lab-panic");
        assert_eq!(panic["outcome"], "failed", "{panic}");
        assert_eq!(panic["cleanup"], "complete", "{panic}");
        let statement = fleet.report(panic);
        let p = &statement.predicate;
        let agent = step(&statement, "guest agent 9103");
        assert_eq!(agent.result, StepResult::Failed, "{agent:?}");
        let waited = agent.ended_unix_ms - agent.started_unix_ms;
        assert!(
            (44_000..90_000).contains(&waited),
            "the agent wait took {waited} ms, bound 45 s"
        );
        assert_eq!(p.guest.os_info, serde_json::Value::Null);
        assert!(p.probes.iter().all(|probe| !probe.passed), "{:?}", p.probes);
        let Verdict::Failed { reasons } = &p.verdict else {
            panic!("{:?}", p.verdict);
        };
        assert!(
            reasons[0].starts_with("probe tcp://10.77.3.10:22 failed"),
            "{reasons:?}"
        );
        assert!(p.cleanup.complete && p.cleanup.residue.is_empty());

        // 4. No agent in the guest: no facts, reported, and the probes decide.
        let agentless = summary(&summaries, "lab-agentless");
        assert_eq!(agentless["outcome"], "passed", "{agentless}");
        let statement = fleet.report(agentless);
        let p = &statement.predicate;
        assert_eq!(p.verdict, Verdict::Passed);
        let agent = step(&statement, "guest agent 9104");
        assert_eq!(agent.result, StepResult::Failed, "{agent:?}");
        assert_eq!(p.guest.os_info, serde_json::Value::Null);
        assert!(p.probes.iter().all(|probe| probe.passed), "{:?}", p.probes);

        // 5. The validations ran at once on the node: every VM started before any stopped,
        // each in a run of its own.
        let first_stop = events
            .iter()
            .position(|e| {
                e["step"].as_str().is_some_and(|s| s.starts_with("stop "))
                    && e["state"] == "started"
            })
            .unwrap();
        for case in &cases {
            let started = events
                .iter()
                .position(|e| e["step"] == format!("start {}", case.vmid()) && e["state"] == "ok")
                .unwrap_or_else(|| panic!("{} never started", case.name));
            assert!(
                started < first_stop,
                "{} started after a VM stopped",
                case.name
            );
        }
        let mut runs: Vec<&str> = summaries
            .iter()
            .map(|s| s["run_id"].as_str().unwrap())
            .collect();
        runs.sort_unstable();
        runs.dedup();
        assert_eq!(runs.len(), 4);

        assert_no_residue(&fleet, 4);
    });
}

/// Case 6: the connector is killed (-9) while the guest runs, and so is the controller driving it;
/// the restarted connector recovers the run from its journal, `certistack-ctl cleanup` as an
/// operator stops and destroys the VM, deletes the overlay, unmaps the backup and releases the
/// sandbox, and the journal tells the whole story.
#[test]
fn lab_connector_killed_while_the_guest_runs_is_cleaned_up_by_the_operator() {
    let tools = lab_tools();
    if !privileged(
        "lab_connector_killed_while_the_guest_runs_is_cleaned_up_by_the_operator",
        &tools,
    ) {
        return;
    }
    guest_assets();
    let netns = Netns::new("labk", &["csv1"]);
    inside(&netns.name, || async {
        let cases = [Case {
            name: "lab-killed",
            index: 1,
            disk: GuestDisk {
                marker: "kill-63aa",
                address: "10.77.1.10/24",
                agent: false,
                boots: true,
            },
            expected_marker: "kill-63aa",
            agent_seconds: 600,
        }];
        let (mut fleet, config, plan) = lab_node("lab-kill", &cases);
        let (mut ctl, mut lines) = start_ctl(&mut fleet.ctl(&plan, &config));
        let seen = wait_for_step(&mut lines, "guest agent 9101");
        let run_id = seen
            .iter()
            .find_map(|l| {
                let event: serde_json::Value = serde_json::from_str(l).unwrap();
                event["run_id"].as_str().map(str::to_owned)
            })
            .unwrap();
        // The guest runs: its service answers on the VNet (the run's probe address is there).
        let deadline = Instant::now() + Duration::from_secs(300);
        let banner = loop {
            let answer = std::net::TcpStream::connect_timeout(
                &"10.77.1.10:22".parse().unwrap(),
                Duration::from_secs(2),
            )
            .and_then(|mut stream| {
                stream.set_read_timeout(Some(Duration::from_secs(5)))?;
                let mut text = String::new();
                std::io::Read::read_to_string(&mut stream, &mut text)?;
                Ok(text)
            });
            match answer {
                Ok(text) if !text.is_empty() => break text,
                _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_secs(1)).await,
                other => panic!("the guest never served its banner: {other:?}"),
            }
        };
        assert!(banner.starts_with("CERTISTACK-LAB kill-63aa"), "{banner}");

        ctl.kill().unwrap();
        ctl.wait().unwrap();
        drop(lines);
        fleet.nodes[0].kill9();
        let qemu_running = fleet.nodes[0]
            .residue()
            .iter()
            .any(|r| r.contains("qemu-system-x86_64"));
        assert!(qemu_running, "{:?}", fleet.nodes[0].residue());
        fleet.nodes[0].start();

        let operator = |args: &[&str]| {
            let out = Command::new(binary("certistack-ctl"))
                .args(args)
                .args([
                    "--state-dir",
                    fleet.authority.dir().to_str().unwrap(),
                    "--node",
                    "127.0.0.1:17441",
                    "--name",
                    "pve1",
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "{args:?}: {out:?}");
            text
        };
        let runs = operator(&["runs"]);
        assert!(runs.contains(&run_id), "{runs}");
        let cleanup = operator(&["cleanup", &run_id]);
        eprintln!("{cleanup}");
        assert!(cleanup.contains("vm:9101"), "{cleanup}");
        assert_no_residue(&fleet, 1);

        let journal = operator(&["journal", &run_id]);
        eprintln!("{journal}");
        assert!(journal.contains("chain verified here"), "{journal}");
        // Operations are the third column of each record: the run, the backup mapped, the VM
        // created and started, the agent polled while the guest booted; then (after the
        // restart) the operator's cleanup undoing each of them in reverse order.
        let position = |operation: &str| {
            journal
                .find(&format!(" {operation} "))
                .unwrap_or_else(|| panic!("{operation} missing from the journal:\n{journal}"))
        };
        let story = [
            "run.begin",
            "backup.map",
            "overlay.create",
            "vm.create",
            "sandbox.address",
            "vm.start",
            "guest.qga",
            "vm.stop",
            "vm.destroy",
            "overlay.delete",
            "backup.unmap",
            "run.cleanup",
        ];
        for pair in story.windows(2) {
            assert!(
                position(pair[0]) < position(pair[1]),
                "{} should come before {}:\n{journal}",
                pair[0],
                pair[1]
            );
        }
        let closing = journal
            .lines()
            .find(|l| l.contains(" run.cleanup "))
            .unwrap();
        assert!(
            closing.contains(r#"{"end_state":"destroyed","resource":"vm:9101"}"#),
            "{closing}"
        );
    });
}

/// The last `qemu-start` record of the `qm` double's call log.
fn last_qemu_start(lab: &Lab) -> serde_json::Value {
    std::fs::read_to_string(lab.root.join("calls.log"))
        .unwrap()
        .lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|record| record["event"] == "qemu-start")
        .expect("qm start logged no qemu-start record")
}

/// The reason the double's record of a start gives for its accelerator.
fn why(start: &serde_json::Value) -> &str {
    start["accel_why"].as_str().unwrap()
}

/// Starts and stops VM 9150 (no disk: only the accelerator matters here) and returns the
/// double's record of the start.
fn start_and_stop(lab: &Lab) -> serde_json::Value {
    for args in [
        &["start", "9150"][..],
        &["stop", "9150", "--timeout", "5"][..],
    ] {
        let out = lab.qm(args);
        assert!(
            out.status.success(),
            "qm {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    last_qemu_start(lab)
}

/// The three machines this project's tests and lab meet, and a fourth that hangs: the `qm`
/// double chooses KVM only where the lab's own guest (SeaBIOS, SYSLINUX, the lab kernel
/// reaching its init) boots under it, and TCG otherwise.
#[test]
fn the_qm_double_runs_guests_under_kvm_only_where_the_lab_guest_boots_under_it() {
    if !privileged(
        "the_qm_double_runs_guests_under_kvm_only_where_the_lab_guest_boots_under_it",
        &[QEMU_TOOLS, GUEST_ASSET_TOOLS].concat(),
    ) {
        return;
    }
    let probe_disk = guest_assets().probe.clone();
    let lab = Lab::new("accel");
    let out = lab.qm(&["create", "9150", "--memory", "64"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let argv_log = lab.root.join("qemu-argv.log");
    let wrapper = |name: &str, on_kvm: &str| {
        let path = lab.root.join(name);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"$*\" >> {log}\ncase \" $* \" in *\" -accel kvm \"*) {on_kvm};; esac\nexec qemu-system-x86_64 \"$@\"\n",
                log = argv_log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        path
    };
    let kvm_probes = || {
        std::fs::read_to_string(&argv_log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("-accel kvm") && line.contains("disk-probe.img"))
            .count()
    };
    // Each machine gets a verdict of its own: a fresh cache, a device that opens.
    let machine = |name: &str, qemu: &Path, probe_seconds: u32| {
        lab.settings(serde_json::json!({
            "accel_cache": lab.root.join(format!("var/lib/qm-accel-{name}.json")),
            "accel_probe_disk": probe_disk,
            "kvm_device": "/dev/null",
            "qemu": qemu,
            "accel_probe_seconds": probe_seconds,
        }));
    };

    // 1. No /dev/kvm: TCG, and the reason names the device.
    lab.settings(serde_json::json!({ "kvm_device": lab.root.join("no-kvm") }));
    let start = start_and_stop(&lab);
    assert_eq!(start["accel"], "tcg");
    assert!(why(&start).contains("no-kvm"), "{start}");
    assert_eq!(start["argv_qemu"][1], "-accel");
    assert_eq!(start["argv_qemu"][2], "tcg");

    // 2. A /dev/kvm that runs a small probe but stops real guests (a nested hypervisor's):
    // under KVM, a 512-byte boot sector exiting through isa-debug-exit runs, while anything
    // else makes QEMU print KVM's internal error and pause the guest, as QEMU does.
    let nested = wrapper(
        "qemu-kvm-nested",
        "case \" $* \" in *isa-debug-exit*) set -- $(echo \" $* \" | sed 's/ -accel kvm / -accel tcg /');; \
         *) echo 'KVM internal error. Suberror: 1' >&2; echo 'emulation failure' >&2; exec sleep 59.125;; esac",
    );
    machine("nested", &nested, 30);
    let probing = Instant::now();
    let start = start_and_stop(&lab);
    assert!(
        probing.elapsed() < Duration::from_secs(20),
        "the internal error was not seen at once: {:?}",
        probing.elapsed()
    );
    assert_eq!(start["accel"], "tcg", "{start}");
    assert!(why(&start).contains("internal error"), "{start}");
    assert_eq!(start["argv_qemu"][2], "tcg", "{start}");
    let start = start_and_stop(&lab);
    assert!(why(&start).ends_with("(cached)"), "{start}");
    assert_eq!(kvm_probes(), 1, "the verdict was not cached");
    let stopped_guest = Command::new("pgrep")
        .args(["-f", "^sleep 59.125$"])
        .output()
        .unwrap();
    assert!(
        stopped_guest.stdout.is_empty(),
        "the stopped probe guest was left running"
    );

    // 3. KVM that accepts a guest and never runs it: the probe gives up at its bound.
    let hangs = wrapper("qemu-kvm-hangs", "exec sleep 59.125");
    machine("hangs", &hangs, 3);
    let probing = Instant::now();
    let start = start_and_stop(&lab);
    assert!(
        probing.elapsed() < Duration::from_secs(30),
        "the probe was not bounded"
    );
    assert_eq!(start["accel"], "tcg", "{start}");
    assert!(
        why(&start).contains("did not reach its init under KVM within 3 s"),
        "{start}"
    );

    // 4. KVM under which the lab guest really boots (here the wrapper lets QEMU emulate it):
    // the VM is started with KVM.
    let runs = wrapper(
        "qemu-kvm-runs",
        "set -- $(echo \" $* \" | sed 's/ -accel kvm / -accel tcg /')",
    );
    machine("runs", &runs, 60);
    let start = start_and_stop(&lab);
    assert_eq!(start["accel"], "kvm", "{start}");
    assert!(
        why(&start).contains("reached its init under KVM"),
        "{start}"
    );
    assert_eq!(start["argv_qemu"][2], "kvm");

    // 5. Told: CERTISTACK_LAB_ACCEL as the lab and Lab::new pass it on.
    lab.settings(serde_json::json!({ "accel": "tcg" }));
    let start = start_and_stop(&lab);
    assert_eq!(start["accel"], "tcg", "{start}");
    assert!(why(&start).contains("CERTISTACK_LAB_ACCEL=tcg"), "{start}");
    assert_eq!(lab.qm(&["destroy", "9150"]).status.code(), Some(0));
}
