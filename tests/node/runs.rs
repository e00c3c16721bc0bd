//! `certistack-ctl run` end to end: the shipped controller binary drives the shipped connector
//! binary on several simulated nodes (the doubles, real loop devices, qemu-img, QEMU, qemu-ga,
//! nftables) in one network namespace. Each node has its own VNet with a guest service behind
//! it, reached through a veth standing in for the sandbox VM's second NIC.

use super::*;
use certistack_controller::authority::{self, Authority};
use certistack_controller::report::{self, Verdict};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[path = "runs/interruptions.rs"]
mod interruptions;
#[path = "runs/latest.rs"]
mod latest;
#[path = "runs/node_conditions.rs"]
mod node_conditions;
#[path = "runs/placement.rs"]
mod placement;

pub(crate) const RUN_TOOLS: &[&str] = &[
    "losetup",
    "qemu-img",
    "qemu-system-x86_64",
    "qemu-ga",
    "python3",
    "ip",
    "nft",
];

/// One simulated node: its doubles, its enrolled config and its daemon.
pub(crate) struct SimNode {
    pub(crate) name: String,
    pub(crate) index: u8,
    pub(crate) lab: Lab,
    pub(crate) config: PathBuf,
    pub(crate) port: u16,
    pub(crate) log: PathBuf,
    daemon: Option<Child>,
}

impl SimNode {
    fn vnet(&self) -> String {
        format!("csv{}", self.index)
    }

    pub(crate) fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(binary("certistack-connector"))
            .args(["--config", self.config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let address = format!("127.0.0.1:{}", self.port);
        let up = (0..100).any(|_| {
            let ok = std::net::TcpStream::connect(&address).is_ok();
            if !ok {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            ok
        });
        assert!(
            up,
            "connector {} did not come up: {}",
            self.name,
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// What the node still holds of any run: loop devices of its doubles, QEMU or agent
    /// processes, VM configs, run tables, addresses on its VNet.
    pub(crate) fn residue(&self) -> Vec<String> {
        let mut found: Vec<String> = loops_under(&self.lab.root)
            .into_iter()
            .map(|(device, file)| format!("{device} ({})", file.display()))
            .collect();
        let root = self.lab.root.display().to_string();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                if cmdline.contains(&root) && !cmdline.contains("certistack-connector") {
                    found.push(format!("process {cmdline}"));
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(self.lab.root.join("etc/pve/qemu-server")) {
            for entry in entries.flatten() {
                found.push(format!("vm config {}", entry.path().display()));
            }
        }
        let addresses = Command::new("ip")
            .args(["-o", "address", "show", "dev", &self.vnet()])
            .output()
            .unwrap();
        for line in String::from_utf8_lossy(&addresses.stdout).lines() {
            if line.contains(" inet ") {
                found.push(format!("address {line}"));
            }
        }
        found
    }
}

/// The nodes, the controller's state and configuration, the guests' namespaces and services.
pub(crate) struct Fleet {
    pub(crate) dir: TempDir,
    pub(crate) authority: Authority,
    pub(crate) nodes: Vec<SimNode>,
    guests: Vec<String>,
    services: Vec<Child>,
    /// Everything the controller printed in this test, to look for secrets in.
    outputs: std::sync::Mutex<String>,
}

impl Fleet {
    /// Nodes `pve1..=pveN`, each with VNet `csv<i>` (probe network 10.77.<i>.0/24), a backup,
    /// and a guest service at 10.77.<i>.10:22 answering `SSH-2.0-CertiStack-<i>`. Runs in the
    /// current network namespace (see [`inside`]).
    fn new(tag: &str, count: u8, agent_answers: bool) -> Self {
        let mut fleet = Self::empty(tag);
        for index in 1..=count {
            fleet.add_node(index, agent_answers, true);
        }
        fleet
    }

    /// A controller authority and state, no node yet.
    pub(crate) fn empty(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let authority = controller(&dir.0);
        Self {
            dir,
            authority,
            nodes: Vec::new(),
            guests: Vec::new(),
            services: Vec::new(),
            outputs: std::sync::Mutex::new(String::new()),
        }
    }

    /// Adds node `pve<index>`; with `service`, a guest service behind its VNet.
    fn add_node(&mut self, index: u8, agent_answers: bool, service: bool) {
        let vnet = format!("csv{index}");
        run_ip(&["link", "add", &vnet, "type", "bridge"]);
        run_ip(&["link", "set", &vnet, "up"]);
        if service {
            self.add_service(index);
        }
        self.add_daemon(index, agent_answers);
    }

    fn add_service(&mut self, index: u8) {
        let vmid = 9100 + u32::from(index);
        let vnet = format!("csv{index}");
        // The guest service sits behind `tap<vmid>i1`, a port the connector admits as the
        // sandbox VM's second NIC; QEMU brings `tap<vmid>i0`.
        let guest = format!(
            "csg{index}{}",
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        let tap = format!("tap{vmid}i1");
        let ok = |out: std::process::Output| {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ok(Command::new("ip")
            .args(["netns", "add", &guest])
            .output()
            .unwrap());
        self.guests.push(guest.clone());
        run_ip(&[
            "link", "add", &tap, "type", "veth", "peer", "name", "eth0", "netns", &guest,
        ]);
        run_ip(&["link", "set", &tap, "master", &vnet, "up"]);
        let address = format!("10.77.{index}.10/24");
        for args in [
            vec!["-n", &guest, "link", "set", "lo", "up"],
            vec!["-n", &guest, "address", "add", &address, "dev", "eth0"],
            vec!["-n", &guest, "link", "set", "eth0", "up"],
        ] {
            ok(Command::new("ip").args(&args).output().unwrap());
        }
        let banner = format!(
            "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('10.77.{index}.10',22));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'SSH-2.0-CertiStack-{index}\\r\\n');c.close()"
        );
        self.services.push(
            Command::new("ip")
                .args(["netns", "exec", &guest, "python3", "-c", &banner])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }

    fn add_daemon(&mut self, index: u8, agent_answers: bool) {
        let name = format!("pve{index}");
        let mut settings = serde_json::json!({ "node": name });
        if agent_answers {
            settings["agent_mode"] = "host-qemu-ga".into();
            settings["qga_allow_rpcs"] = serde_json::json!([
                "guest-sync-delimited",
                "guest-ping",
                "guest-info",
                "guest-get-osinfo",
                "guest-get-host-name",
                "guest-network-get-interfaces"
            ]);
        }
        self.add_sim_node(index, settings, |lab| {
            lab.add_backup(SNAPSHOT, ARCHIVE, MARKER, 8 << 20);
        });
    }

    /// Node `pve<index>` with the doubles configured by `settings` (`double.json`), the backups
    /// `backups` stores, enrolled and its daemon started on 127.0.0.1:17440+index.
    pub(crate) fn add_sim_node(
        &mut self,
        index: u8,
        settings: serde_json::Value,
        backups: impl FnOnce(&Lab),
    ) {
        let name = format!("pve{index}");
        let lab = Lab::new(&format!("run{index}"));
        lab.settings(settings);
        backups(&lab);
        let node_dir = self.dir.0.join(&name);
        let mut config = enroll(&self.authority, &node_dir, &name);
        config.tools.proxmox_backup_client = lab.root.join("bin/proxmox-backup-client");
        config.tools.qm = lab.root.join("bin/qm");
        config.pve.qemu_server_run_dir = lab.root.join("var/run/qemu-server");
        config.pve.vm_config_dir = lab.root.join("etc/pve/qemu-server");
        config.pve.pbs_loopdev_dir = lab.root.join("run/pbs-loopdev");
        config.pve.pve_cluster_dir = lab.root.join("var/lib/pve-cluster");
        config.pve.dpkg_status = lab.root.join("var/lib/dpkg/status");
        config.paths.overlay_root = lab.root.join("overlays");
        let port = 17440 + u16::from(index);
        let config_path = node_dir.join("connector.toml");
        write_config_file(&config_path, &config, port);
        let mut node = SimNode {
            name,
            index,
            lab,
            config: config_path,
            port,
            log: node_dir.join("connector.log"),
            daemon: None,
        };
        node.start();
        self.nodes.push(node);
    }

    pub(crate) fn node(&mut self, name: &str) -> &mut SimNode {
        self.nodes.iter_mut().find(|n| n.name == name).unwrap()
    }

    /// The controller configuration naming `nodes` (name, port).
    pub(crate) fn controller_config(&self, nodes: &[(&str, u16)]) -> PathBuf {
        let mut text = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n",
            self.authority.dir(),
            self.reports_dir()
        );
        for (name, port) in nodes {
            text.push_str(&format!(
                "\n[[nodes]]\nname = \"{name}\"\naddress = \"127.0.0.1\"\nport = {port}\n"
            ));
        }
        let path = self.dir.0.join("controller.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    pub(crate) fn reports_dir(&self) -> PathBuf {
        self.dir.0.join("reports")
    }

    /// A plan with one validation per `(name, node index, vmid)`.
    fn plan(&self, file: &str, validations: &[(&str, u8, u32)], agent_seconds: u32) -> PathBuf {
        self.plan_with(file, validations, agent_seconds, true)
    }

    /// A plan; without `probes`, the guest agent alone shows the guest booted.
    fn plan_with(
        &self,
        file: &str,
        validations: &[(&str, u8, u32)],
        agent_seconds: u32,
        probes: bool,
    ) -> PathBuf {
        let secret = self.dir.0.join("pbs-password");
        std::fs::write(&secret, format!("{PBS_PASSWORD}\n")).unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let mut text = format!(
            "storage:\n  server: pbs.lab\n  datastore: store1\n  auth_id: certistack@pbs!restore\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-password\nvalidations:\n",
            ["ab"; 32].join(":")
        );
        for (name, index, vmid) in validations {
            text.push_str(&format!(
                "  - name: {name}\n    node: pve{index}\n    source_vmid: 100\n    snapshot: \"2026-11-01T02:00:00Z\"\n    archives: [{ARCHIVE}]\n    sandbox:\n      - vmid: {vmid}\n        cores: 1\n        memory_mib: 256\n    network:\n      lifecycle: preprovisioned\n      vnet: csv{index}\n      probe_source: 10.77.{index}.2/24\n"
            ));
            if probes {
                text.push_str(&format!(
                    "    probes:\n      - kind: tcp\n        address: 10.77.{index}.10\n        port: 22\n        expect:\n          banner_prefix: \"SSH-2.0-CertiStack-{index}\"\n"
                ));
            }
            // The busybox guest is no distribution libguestfs recognises: its network stays.
            text.push_str(&format!(
                "    network_recovery:\n      mode: preserve\n    timeouts:\n      run_seconds: 600\n      guest_agent_seconds: {agent_seconds}\n"
            ));
        }
        let path = self.dir.0.join(file);
        std::fs::write(&path, text).unwrap();
        path
    }

    pub(crate) fn ctl(&self, plan: &Path, config: &Path) -> Command {
        let mut command = self.ctl_plain(plan, config);
        command.arg("--json");
        command
    }

    /// `certistack-ctl run` without `--json`: plain lines, as when not on a terminal.
    fn ctl_plain(&self, plan: &Path, config: &Path) -> Command {
        let mut command = Command::new(binary("certistack-ctl"));
        command.args([
            "run",
            plan.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ]);
        command
    }

    /// Runs the plan to its end: the exit code, the step events and the summaries. Awaits the
    /// controller, so servers of this test's runtime keep answering meanwhile.
    pub(crate) async fn run(
        &self,
        plan: &Path,
        config: &Path,
    ) -> (i32, Vec<serde_json::Value>, Vec<serde_json::Value>) {
        let out = tokio::process::Command::from(self.ctl(plan, config))
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{stderr}");
        if let Ok(mut outputs) = self.outputs.lock() {
            outputs.push_str(&stdout);
            outputs.push_str(&stderr);
        }
        let (summaries, events) = split_output(&stdout);
        (out.status.code().unwrap_or(-1), events, summaries)
    }

    /// Verifies the report of `summary` with the report-signing key and returns its statement.
    pub(crate) fn report(&self, summary: &serde_json::Value) -> report::Statement {
        let path = summary["report"].as_str().expect("a report was written");
        let key =
            report::load_public_key(&self.authority.dir().join(authority::REPORT_PUB)).unwrap();
        let statement = report::verify(&report::read(Path::new(path)).unwrap(), &key).unwrap();
        assert_eq!(
            std::fs::metadata(path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        statement
    }
}

use std::os::unix::fs::PermissionsExt;

impl Drop for Fleet {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill9();
        }
        for child in &mut self.services {
            let _ = child.kill();
            let _ = child.wait();
        }
        for guest in &self.guests {
            let _ = Command::new("ip").args(["netns", "del", guest]).status();
        }
    }
}

pub(crate) fn split_output(stdout: &str) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let mut summaries = Vec::new();
    let mut events = Vec::new();
    for line in stdout.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line: {line:?}: {e}"));
        match value.get("summary") {
            Some(summary) => summaries.push(summary.clone()),
            None => events.push(value),
        }
    }
    (summaries, events)
}

pub(crate) fn summary<'a>(
    summaries: &'a [serde_json::Value],
    validation: &str,
) -> &'a serde_json::Value {
    summaries
        .iter()
        .find(|s| s["validation"] == validation)
        .unwrap_or_else(|| panic!("no summary for {validation}: {summaries:?}"))
}

/// No nft table of any run is left in the node namespace.
pub(crate) fn run_tables() -> Vec<String> {
    let out = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("certistack_"))
        .map(str::to_owned)
        .collect()
}

/// Runs the Python verifier printed in docs/report.md on `report`, with `extra` arguments.
fn python_verifier(fleet: &Fleet, report: &str, extra: &[String]) -> std::process::Output {
    let doc = std::fs::read_to_string(workspace_root().join("docs/report.md")).unwrap();
    let (_, after) = doc.split_once("```python\n").unwrap();
    let (program, _) = after.split_once("```").unwrap();
    let path = fleet.dir.0.join("verify-report.py");
    std::fs::write(&path, program).unwrap();
    Command::new("/usr/bin/python3")
        .arg(&path)
        .arg(report)
        .arg(fleet.authority.dir().join(authority::REPORT_PUB))
        .args(extra)
        .output()
        .unwrap()
}

/// The independent verifier's view of a report's subjects is the PBS double's: every subject
/// has a digest, the archive's is recomputed from the image the double stores, and the
/// snapshot's and the archive's are those of the manifest the double serves.
fn assert_subjects_are_the_doubles_manifest(fleet: &Fleet, summary: &serde_json::Value, index: u8) {
    let lab = &fleet.nodes.iter().find(|n| n.index == index).unwrap().lab;
    let printed = Command::new(lab.root.join("bin/proxmox-backup-client"))
        .args(["restore", SNAPSHOT, "index.json.blob", "-"])
        .args(["--repository", "root@pam@pbs.example:8007:store1"])
        .env("PBS_PASSWORD", PBS_PASSWORD)
        .env("PBS_FINGERPRINT", ["ab"; 32].join(":"))
        .output()
        .unwrap();
    assert!(printed.status.success(), "{printed:?}");
    let manifest = fleet.dir.0.join(format!("pve{index}-index.json.blob"));
    std::fs::write(&manifest, &printed.stdout).unwrap();
    let image = lab.root.join("pbs/store1").join(SNAPSHOT).join(ARCHIVE);
    let out = python_verifier(
        fleet,
        summary["report"].as_str().unwrap(),
        &[
            format!("{ARCHIVE}={}", image.display()),
            format!("index.json.blob={}", manifest.display()),
        ],
    );
    assert!(
        out.status.success(),
        "the independent verifier's subjects differ from the double's manifest: {out:?}"
    );
}

fn assert_passed_with_evidence(fleet: &Fleet, summary: &serde_json::Value, index: u8) {
    assert_eq!(summary["outcome"], "passed", "{summary}");
    assert_eq!(summary["cleanup"], "complete", "{summary}");
    assert_subjects_are_the_doubles_manifest(fleet, summary, index);
    let statement = fleet.report(summary);
    let p = &statement.predicate;
    assert_eq!(p.verdict, Verdict::Passed);
    assert_eq!(p.node, format!("pve{index}"));
    assert_eq!(p.guest.status, "running");
    assert!(
        p.guest.os_info.get("id").is_some(),
        "QGA facts: {:?}",
        p.guest.os_info
    );
    assert_eq!(p.probes.len(), 1);
    assert!(p.probes[0].passed, "{:?}", p.probes[0]);
    assert_eq!(p.probes[0].target, format!("tcp://10.77.{index}.10:22"));
    assert_eq!(p.probes[0].origin, format!("worker_host 10.77.{index}.2"));
    // The probe address and the bridge's own IPv6 link-local address, nothing else.
    let probe_address = format!("10.77.{index}.2/24");
    assert!(
        p.isolation
            .bridge_addresses
            .iter()
            .all(|a| *a == probe_address || a.starts_with("fe80:")),
        "{:?}",
        p.isolation.bridge_addresses
    );
    assert!(p.isolation.bridge_addresses.contains(&probe_address));
    assert_eq!(
        p.isolation
            .forwarding
            .get(&format!("net.ipv4.conf.csv{index}.forwarding"))
            .map(String::as_str),
        Some("0"),
        "{:?}",
        p.isolation.forwarding
    );
    assert!(
        p.isolation.ruleset.contains("table"),
        "{}",
        p.isolation.ruleset
    );
    assert!(p.cleanup.complete && p.cleanup.residue.is_empty());
    // The sandbox mirrored the source VM's config; the source's bridge is reported as omitted.
    let hardware = p.hardware.as_ref().expect("the mirrored source hardware");
    assert_eq!(
        (hardware.machine.as_str(), hardware.scsihw.as_str()),
        ("q35", "virtio-scsi-pci")
    );
    assert_eq!(
        hardware.disks,
        ["ide2=cdrom (empty)", "scsi0=drive-scsi0.img"]
    );
    assert_eq!(hardware.nics, ["net0=virtio"]);
    assert_eq!(hardware.config_sha256.len(), 64);
    assert!(
        hardware.omitted.iter().any(|o| o.starts_with("net0: ")),
        "{:?}",
        hardware.omitted
    );
    // The journal in the report was recomputed by the controller and ends with the run's end.
    let last = p.journal.records.last().unwrap();
    assert_eq!(last.operation, "run.end", "{last:?}");
    assert_eq!(last.record_sha256, p.journal.head_sha256);
    let names: Vec<&str> = p.steps.iter().map(|s| s.name.as_str()).collect();
    // The console at verdict time, beside the report, its digest signed.
    let shot = p.screenshot.as_ref().expect("a screenshot");
    let report_path = PathBuf::from(summary["report"].as_str().unwrap());
    assert_eq!(
        shot.file,
        report_path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .replace(".json", ".png")
    );
    assert!(matches!(
        report::check_screenshot(&statement, &report_path).unwrap(),
        report::ScreenshotCheck::Matches(_)
    ));
    for step in [
        "doctor",
        "credentials",
        "connect",
        "begin",
        "map drive-scsi0.img",
        "read source config",
        "prepare sandbox",
        &format!("screenshot {}", 9100 + u32::from(index)),
        "release sandbox",
        "unmap drive-scsi0.img",
        "cleanup",
        "end",
        "journal",
    ] {
        assert!(names.contains(&step), "{step} missing from {names:?}");
    }
}

/// Three nodes validated at once pass; then, with one daemon stopped, one serving another
/// surface, and one pinning another run authority, those three fail cleanly on their own
/// while the healthy node passes again. A refused plan contacts no node at all.
/// After three runs of VM 100 (three passed, one failed, then one passed and three errors, the
/// plan refused before them leaving nothing), `history` answers from the store: every
/// validation once, each with its report's digest, and the VM's record.
fn assert_history_of_three_runs(config: &Path) {
    let history = |args: &[&str]| {
        let out = Command::new(binary("certistack-ctl"))
            .arg("history")
            .args(args)
            .args(["--config", config.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let page = history(&["100", "--limit", "50"]);
    let rows = page["validations"].as_array().unwrap();
    let count = |state: &str| rows.iter().filter(|row| row["state"] == state).count();
    assert_eq!(
        (rows.len(), count("passed"), count("failed"), count("error")),
        (8, 4, 1, 3),
        "{page:#}"
    );
    for row in rows {
        let report = row["report"].as_str().unwrap_or_else(|| panic!("{row}"));
        let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            std::fs::read(report).unwrap(),
        ));
        assert_eq!(row["report_sha256"], digest.as_str(), "{row}");
        assert!(row["ended_unix_ms"].is_i64(), "{row}");
        if row["state"] == "passed" {
            assert!(row["restore_ms"].as_u64().unwrap() > 0, "{row}");
        }
    }
    let vms = history(&[]);
    // One line per validation of the VM: web1 passed, failed (wrong banner), passed again.
    let vm = vms["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|vm| vm["validation"] == "web1")
        .unwrap_or_else(|| panic!("{vms:#}"));
    assert_eq!(vm["source_vmid"], 100, "{vms:#}");
    assert_eq!(
        vm["streak"],
        serde_json::json!({"verdict": "passed", "count": 1}),
        "{vm}"
    );
    assert!(
        vm["last_failed_unix_ms"].is_i64() && vm["last_passed_unix_ms"].is_i64(),
        "{vm}"
    );
    assert!(vm["last_restore_ms"].as_u64().unwrap() > 0, "{vm}");
    eprintln!("history --json:\n{vms:#}");
}

#[test]
fn a_plan_runs_on_several_nodes_at_once_and_a_failing_node_fails_only_its_validations() {
    if !privileged(
        "a_plan_runs_on_several_nodes_at_once_and_a_failing_node_fails_only_its_validations",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("ctl", &[]);
    inside(&netns.name, || async {
        let mut fleet = Fleet::new("ctl-fleet", 3, true);
        let config = fleet.controller_config(&[("pve1", 17441), ("pve2", 17442), ("pve3", 17443)]);

        // A plan refused before any node is contacted: the daemons log no call.
        let refused = fleet.plan("refused.yaml", &[("web1", 1, 9101)], 60);
        let text = std::fs::read_to_string(&refused)
            .unwrap()
            .replace("vmid: 9101", "vmid: 42");
        std::fs::write(&refused, text).unwrap();
        let out = fleet.ctl(&refused, &config).output().unwrap();
        assert_eq!(out.status.code(), Some(65), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("VMID 42 is outside 100..=999999999"),
            "{out:?}"
        );
        for node in &fleet.nodes {
            let log = std::fs::read_to_string(&node.log).unwrap_or_default();
            assert!(!log.contains("rpc="), "{} was contacted: {log}", node.name);
        }

        // Three nodes at once.
        let plan = fleet.plan(
            "three.yaml",
            &[("web1", 1, 9101), ("web2", 2, 9102), ("web3", 3, 9103)],
            60,
        );
        let started = std::time::Instant::now();
        let (code, events, summaries) = fleet.run(&plan, &config).await;
        eprintln!("three validations in {:?}", started.elapsed());
        assert_eq!(code, 0, "{summaries:?}");
        for index in 1..=3u8 {
            assert_passed_with_evidence(&fleet, summary(&summaries, &format!("web{index}")), index);
        }
        // They ran at once: every validation started before any finished.
        let first_end = events
            .iter()
            .position(|e| e["step"] == "end" && e["state"] == "ok")
            .unwrap();
        for index in 1..=3 {
            let begun = events
                .iter()
                .position(|e| e["validation"] == format!("web{index}") && e["step"] == "begin")
                .unwrap();
            assert!(begun < first_end, "web{index} began after another ended");
        }
        // Each validation had its own run.
        let mut runs: Vec<&str> = summaries
            .iter()
            .map(|s| s["run_id"].as_str().unwrap())
            .collect();
        runs.sort_unstable();
        runs.dedup();
        assert_eq!(runs.len(), 3);
        // The CLI verifies a run's report and shows it to a person.
        let web1 = summary(&summaries, "web1")["report"]
            .as_str()
            .unwrap()
            .to_owned();
        let state_dir = fleet.authority.dir().to_str().unwrap().to_owned();
        let verify = Command::new(binary("certistack-ctl"))
            .args(["report", "verify", &web1, "--state-dir", &state_dir])
            .output()
            .unwrap();
        let verified = String::from_utf8_lossy(&verify.stdout).to_string();
        assert_eq!(verify.status.code(), Some(0), "{verify:?}");
        assert!(verified.contains("passed"), "{verified}");
        let show = Command::new(binary("certistack-ctl"))
            .args(["report", "show", &web1, "--state-dir", &state_dir])
            .output()
            .unwrap();
        let shown = String::from_utf8_lossy(&show.stdout).to_string();
        assert_eq!(show.status.code(), Some(0), "{show:?}");
        for needle in [
            "verdict: passed",
            "tcp://10.77.1.10:22",
            "screenshot",
            "doctor",
        ] {
            assert!(shown.contains(needle), "{needle} not in {shown}");
        }
        eprintln!("report verify:\n{verified}\nreport show:\n{shown}");
        for node in &fleet.nodes {
            assert!(
                node.residue().is_empty(),
                "{}: {:?}",
                node.name,
                node.residue()
            );
            // The same log that showed no call for the refused plan shows this run's calls.
            let log = std::fs::read_to_string(&node.log).unwrap();
            assert!(log.contains("rpc=") && log.contains("MapBackup"), "{log}");
        }
        assert!(run_tables().is_empty(), "{:?}", run_tables());

        // A guest whose service answers with another banner: the backup did not restore.
        let wrong = fleet.plan("wrong.yaml", &[("web1", 1, 9101)], 60);
        let text = std::fs::read_to_string(&wrong)
            .unwrap()
            .replace("SSH-2.0-CertiStack-1", "SSH-2.0-OpenSSH");
        std::fs::write(&wrong, text).unwrap();
        // Not a terminal and no --json: a plain line per step, then the summary table.
        let plain = tokio::process::Command::from(fleet.ctl_plain(&wrong, &config))
            .output()
            .await
            .unwrap();
        assert_eq!(plain.status.code(), Some(1), "{plain:?}");
        let stdout = String::from_utf8_lossy(&plain.stdout);
        eprintln!("{stdout}");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("web1 pve1 probe tcp://10.77.1.10:22 ok")),
            "{stdout}"
        );
        let row = stdout
            .lines()
            .find(|l| l.starts_with("web1 ") && l.contains("FAILED"))
            .unwrap_or_else(|| panic!("no summary row: {stdout}"));
        assert!(
            row.contains("complete") && row.contains("probe tcp://10.77.1.10:22 failed"),
            "{row}"
        );
        let report_path = stdout
            .lines()
            .find_map(|l| l.trim_start().strip_prefix("report "))
            .unwrap_or_else(|| panic!("no report line: {stdout}"));
        let statement = fleet.report(&serde_json::json!({ "report": report_path }));
        let Verdict::Failed { reasons } = &statement.predicate.verdict else {
            panic!("{:?}", statement.predicate.verdict);
        };
        assert!(
            reasons[0].starts_with("probe tcp://10.77.1.10:22 failed"),
            "{reasons:?}"
        );
        assert!(!statement.predicate.probes[0].passed);
        assert!(fleet.nodes[0].residue().is_empty());

        // pve2 down, pve3 pinned to another run authority, pve4 serving another surface.
        fleet.node("pve2").kill9();
        let other = controller(&fleet.dir.0.join("other-authority"));
        let pve3 = fleet.node("pve3");
        pve3.kill9();
        let pinned = fleet.dir.0.join("pve3/run-authority.pub");
        std::fs::copy(other.dir().join(authority::RUN_AUTHORITY_PUB), &pinned).unwrap();
        fleet.node("pve3").start();
        let drifted = serve_drifted(&fleet.authority, &fleet.dir.0.join("pve4"), "pve4").await;
        let drifted_port: u16 = drifted.rsplit_once(':').unwrap().1.parse().unwrap();
        let config = fleet.controller_config(&[
            ("pve1", 17441),
            ("pve2", 17442),
            ("pve3", 17443),
            ("pve4", drifted_port),
        ]);
        let plan = fleet.plan(
            "mixed.yaml",
            &[
                ("web1", 1, 9101),
                ("web2", 2, 9102),
                ("web3", 3, 9103),
                ("web4", 4, 9104),
            ],
            60,
        );
        let (code, _, summaries) = fleet.run(&plan, &config).await;
        assert_eq!(code, 2, "{summaries:?}");
        assert_passed_with_evidence(&fleet, summary(&summaries, "web1"), 1);
        // The fleet audit sees the same fleet: pve2 down (exit 2), pve4 drifted.
        let audit = tokio::process::Command::new(binary("certistack-ctl"))
            .args(["nodes", "audit", "--config", config.to_str().unwrap()])
            .output()
            .await
            .unwrap();
        let table = String::from_utf8_lossy(&audit.stdout).to_string();
        assert_eq!(audit.status.code(), Some(2), "{audit:?}");
        let row = |node: &str| {
            table
                .lines()
                .find(|l| l.starts_with(node))
                .unwrap_or_else(|| panic!("no row for {node}: {table}"))
                .to_owned()
        };
        let status = |node: &str| row(node).split_whitespace().nth(1).unwrap().to_owned();
        assert_eq!(status("pve1"), "ok", "{table}");
        assert_eq!(status("pve2"), "UNREACHABLE", "{table}");
        assert_eq!(status("pve4"), "DRIFT", "{table}");
        eprintln!("nodes audit:\n{table}");
        for (validation, reason) in [
            (
                "web2",
                "node pve2 fails its prerequisites (see `certistack-ctl doctor pve2`): connect: 127.0.0.1:17442",
            ),
            ("web3", "the node refused the run"),
            (
                "web4",
                "node pve4 fails its prerequisites (see `certistack-ctl doctor pve4`): surface:",
            ),
        ] {
            let s = summary(&summaries, validation);
            assert_eq!(s["outcome"], "error", "{s}");
            assert_eq!(s["cleanup"], "notneeded", "{s}");
            let reasons = s["reasons"].to_string();
            assert!(reasons.contains(reason), "{validation}: {reasons}");
            let statement = fleet.report(s);
            assert!(matches!(statement.predicate.verdict, Verdict::Error { .. }));
        }
        let web3 = summary(&summaries, "web3")["reasons"].to_string();
        assert!(web3.contains("run-authority"), "{web3}");
        for node in &fleet.nodes {
            assert!(
                node.residue().is_empty(),
                "{}: {:?}",
                node.name,
                node.residue()
            );
        }
        assert!(run_tables().is_empty(), "{:?}", run_tables());
        assert_history_of_three_runs(&config);

        // Two validations on one node sharing its VNet and the snapshot's archive: the node
        // would refuse the second while the first holds them, so they run one after the other
        // (and both pass) even with room for two at once.
        fleet.add_node(5, true, false);
        let config = fleet.controller_config(&[("pve5", 17445)]);
        let shared = fleet.plan_with(
            "shared.yaml",
            &[("db1", 5, 9151), ("db2", 5, 9152)],
            60,
            false,
        );
        let (code, events, summaries) = fleet.run(&shared, &config).await;
        assert_eq!(code, 0, "{summaries:?}");
        for name in ["db1", "db2"] {
            let s = summary(&summaries, name);
            assert_eq!(s["outcome"], "passed", "{s}");
            fleet.report(s);
        }
        let at = |validation: &str, step: &str, state: &str| {
            events
                .iter()
                .position(|e| {
                    e["validation"] == validation && e["step"] == step && e["state"] == state
                })
                .unwrap_or_else(|| panic!("no {step} {state} for {validation}"))
        };
        let (first, second) = if at("db1", "begin", "started") < at("db2", "begin", "started") {
            ("db1", "db2")
        } else {
            ("db2", "db1")
        };
        assert!(
            at(first, "end", "ok") < at(second, "begin", "started"),
            "{second} began before {first} ended"
        );
        assert!(fleet.node("pve5").residue().is_empty());

        // The PBS secret went only into MapBackup: not on any output, report or log.
        let mut places = vec![fleet.reports_dir()];
        places.extend(fleet.nodes.iter().map(|n| n.log.clone()));
        let mut found = Vec::new();
        for place in &places {
            let files: Vec<PathBuf> = if place.is_dir() {
                std::fs::read_dir(place)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .collect()
            } else {
                vec![place.clone()]
            };
            for file in files {
                let bytes = std::fs::read(&file).unwrap();
                if bytes
                    .windows(PBS_PASSWORD.len())
                    .any(|w| w == PBS_PASSWORD.as_bytes())
                {
                    found.push(file);
                }
            }
        }
        assert!(found.is_empty(), "the PBS secret was written to {found:?}");
        assert!(
            !fleet.outputs.lock().unwrap().contains(PBS_PASSWORD),
            "the PBS secret reached the controller's output"
        );
    });
}

/// Starts `certistack-ctl run` with its JSON events on a pipe; [`wait_for_step`] reads them up
/// to a step, the caller acts, and [`finish`] collects the rest.
pub(crate) fn start_ctl(
    command: &mut Command,
) -> (
    Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    (child, std::io::BufReader::new(stdout).lines())
}

/// Reads events until one for `step` in state `started` arrives (bounded).
pub(crate) fn wait_for_step(
    lines: &mut std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    step: &str,
) -> Vec<String> {
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        if event["step"] == step && event["state"] == "started" {
            return seen;
        }
    }
    panic!("the run ended before step {step}: {seen:?}");
}

pub(crate) fn finish(
    mut child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
) -> (i32, Vec<serde_json::Value>) {
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let status = child.wait().unwrap();
    let (summaries, _) = split_output(&rest.join("\n"));
    (status.code().unwrap_or(-1), summaries)
}
