//! Section `node-ops`: what the connector adds over the tools it runs, measured in one run and
//! printed as a table.
//!
//! For each operation: the median time of the tool alone (the same program and argv, run
//! through the same process runner), the median client-observed time of the RPC that runs it
//! (mTLS, authentication, authorization, journal fsyncs, ownership checks), and the difference.
//! Uses the lab's test doubles for `proxmox-backup-client` and `qm`, real `qemu-img`, real
//! loop devices and real QEMU; needs root.
//!
//! Run: `cargo bench -p certistack-tests --bench performance -- node-ops`

use certistack_connector::process::{self, SecretInput, SecretKind, ToolCall};
use certistack_proto::v1 as pb;
use certistack_tests::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const ROUNDS: usize = 7;
const VMID: u32 = 9100;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

async fn tool(call: ToolCall) -> (Duration, process::ToolOutput) {
    let started = Instant::now();
    let out = process::run(call).await.unwrap();
    (started.elapsed(), out)
}

/// Runs on a thread of its own moved into a network namespace, so the caller blocks until the
/// table is printed.
pub fn node_ops() {
    if !privileged(
        "performance bench: node-ops",
        &[
            "losetup",
            "qemu-img",
            "qemu-system-x86_64",
            "python3",
            "ip",
            "nft",
        ],
    ) {
        return;
    }
    // VMs boot only on a prepared sandbox: measure inside a namespace with the VNet's bridge.
    let netns = Netns::new("bench", &["csbox1"]);
    super::heading("Each node operation against its tool alone");
    inside(&netns.name, || async {
        let lab = Lab::new("bench");
        lab.add_backup(SNAPSHOT, ARCHIVE, b"BENCH", 8 << 20);
        let authority_dir = TempDir::new("bench-ctl");
        let authority = controller(&authority_dir.0);
        let config = lab.node_config(&authority, &lab.root.join("node"));
        let (address, _shutdown, _task) = serve_node(config.clone()).await;
        let repository = "certistack@pbs!restore@pbs.lab:8007:store1";
        let t = Duration::from_secs(60);
        let pbs = || ToolCall::new(&config.tools.proxmox_backup_client, t);
        let qm = |args: &[&str]| {
            let mut call = ToolCall::new(&config.tools.qm, t);
            for a in args {
                call = call.arg(*a);
            }
            call
        };

        // The tools alone.
        let mut alone: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
        let overlay = lab.root.join("bench-direct.qcow2");
        for _ in 0..ROUNDS {
            let map = pbs()
                .arg("map")
                .arg(SNAPSHOT)
                .arg(ARCHIVE)
                .arg("--repository")
                .arg(repository)
                .env("PBS_PASSWORD_FD", "3")
                .env("PBS_FINGERPRINT", ["ab"; 32].join(":"))
                .secret(SecretInput {
                    child_fd: 3,
                    bytes: zeroize::Zeroizing::new(PBS_PASSWORD.as_bytes().to_vec()),
                    kind: SecretKind::Pipe,
                });
            let (d, out) = tool(map).await;
            alone.entry("MapBackup").or_default().push(d);
            let device = certistack_connector::node::loopdev::parse_mapped_on(&out.stderr).unwrap();
            let create = ToolCall::new("/usr/bin/qemu-img", t)
                .arg("create")
                .arg("-f")
                .arg("qcow2")
                .arg("-b")
                .arg(&device)
                .arg("-F")
                .arg("raw")
                .arg(&overlay);
            alone
                .entry("CreateOverlay")
                .or_default()
                .push(tool(create).await.0);
            let disk = format!("{},format=qcow2,backup=0", overlay.display());
            let create_vm = qm(&[
                "create",
                "9200",
                "--name",
                "bench",
                "--memory",
                "256",
                "--cores",
                "1",
                "--scsi0",
                &disk,
                "--agent",
                "1",
                "--tags",
                "certistack",
            ]);
            alone
                .entry("CreateVm")
                .or_default()
                .push(tool(create_vm).await.0);
            alone
                .entry("StartVm")
                .or_default()
                .push(tool(qm(&["start", "9200"])).await.0);
            alone
                .entry("VmStatus")
                .or_default()
                .push(tool(qm(&["status", "9200"])).await.0);
            let socket = lab.root.join("var/run/qemu-server/9200.qmp");
            let started = Instant::now();
            certistack_connector::node::guest::qmp(&socket, "query-status", None, t)
                .await
                .unwrap();
            alone
                .entry("Qmp query-status")
                .or_default()
                .push(started.elapsed());
            alone
                .entry("StopVm")
                .or_default()
                .push(tool(qm(&["stop", "9200"])).await.0);
            alone
                .entry("DestroyVm")
                .or_default()
                .push(tool(qm(&["destroy", "9200", "--purge", "1"])).await.0);
            let started = Instant::now();
            std::fs::remove_file(&overlay).unwrap();
            alone
                .entry("DeleteOverlay")
                .or_default()
                .push(started.elapsed());
            alone
                .entry("UnmapBackup")
                .or_default()
                .push(tool(pbs().arg("unmap").arg(&device)).await.0);
        }

        // The same through the connector, one run per round.
        let mut via: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
        // Per call: the RPC's latency minus the tool time the connector itself measured.
        let mut within: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for round in 0..ROUNDS {
            let mut wire = grant(
                &format!("0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e{round:02}"),
                NODE,
            );
            wire.sandbox_vms = vec![pb::SandboxVm {
                vmid: VMID,
                max_cores: 1,
                max_memory_mib: 256,
            }];
            let credentials = mint(&authority, &wire);
            let mut c = client(&authority, &address, NODE, &credentials.certificate)
                .await
                .unwrap();
            c.begin_run(begin_request(&credentials)).await.unwrap();
            c.prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await
            .unwrap();
            macro_rules! timed {
                ($name:expr, $call:expr, |$reply:ident| $tool_ms:expr) => {{
                    let started = Instant::now();
                    let $reply = $call.await.unwrap().into_inner();
                    let elapsed = started.elapsed();
                    via.entry($name).or_default().push(elapsed);
                    let tool_ms: u64 = $tool_ms;
                    within
                        .entry($name)
                        .or_default()
                        .push(elapsed.as_secs_f64() * 1000.0 - tool_ms as f64);
                }};
            }
            let tool_ms = |tool: &Option<pb::ToolResult>| tool.as_ref().map_or(0, |t| t.elapsed_ms);
            timed!(
                "MapBackup",
                c.map_backup(pb::MapBackupRequest {
                    snapshot: SNAPSHOT.into(),
                    archive: ARCHIVE.into(),
                    pbs_secret: PBS_PASSWORD.into(),
                    encryption_key: vec![]
                }),
                |r| tool_ms(&r.tool)
            );
            timed!(
                "CreateOverlay",
                c.create_overlay(pb::CreateOverlayRequest {
                    vmid: VMID,
                    archive: ARCHIVE.into()
                }),
                |r| tool_ms(&r.tool)
            );
            timed!(
                "CreateVm",
                c.create_vm(pb::CreateVmRequest {
                    vmid: VMID,
                    cores: 1,
                    memory_mib: 256,
                    archives: vec![ARCHIVE.into()],
                    mirror_source_hardware: false,
                }),
                |r| tool_ms(&r.tool)
            );
            timed!("StartVm", c.start_vm(pb::VmRequest { vmid: VMID }), |r| {
                tool_ms(&r.tool)
            });
            timed!("VmStatus", c.vm_status(pb::VmRequest { vmid: VMID }), |r| {
                tool_ms(&r.tool)
            });
            timed!(
                "Qmp query-status",
                c.qmp(pb::QmpRequest {
                    vmid: VMID,
                    command: pb::QmpCommand::QueryStatus as i32
                }),
                |r| r.elapsed_ms
            );
            timed!(
                "StopVm",
                c.stop_vm(pb::StopVmRequest {
                    vmid: VMID,
                    timeout_seconds: 0
                }),
                |r| tool_ms(&r.tool)
            );
            timed!(
                "DestroyVm",
                c.destroy_vm(pb::VmRequest { vmid: VMID }),
                |r| tool_ms(&r.tool)
            );
            timed!(
                "DeleteOverlay",
                c.delete_overlay(pb::DeleteOverlayRequest {
                    vmid: VMID,
                    archive: ARCHIVE.into()
                }),
                |_r| 0
            );
            timed!(
                "UnmapBackup",
                c.unmap_backup(pb::UnmapBackupRequest {
                    archive: ARCHIVE.into()
                }),
                |r| tool_ms(&r.tool)
            );
            c.cleanup(pb::CleanupRequest {
                run_id: wire.run_id.clone(),
            })
            .await
            .unwrap();
            c.end_run(pb::EndRunRequest {}).await.unwrap();
        }

        println!(
            "| operation | tool alone (median of {ROUNDS}) | via the connector (median of {ROUNDS}) | overhead within a call (median; RPC time − tool time the connector measured, ±0.5 ms) |"
        );
        println!("|---|---:|---:|---:|");
        for (name, samples) in &via {
            let rpc = median(samples.clone());
            let direct = median(alone[name].clone());
            let mut own = within[name].clone();
            own.sort_by(f64::total_cmp);
            println!(
                "| {name} | {:.1} ms | {:.1} ms | {:.1} ms |",
                direct.as_secs_f64() * 1000.0,
                rpc.as_secs_f64() * 1000.0,
                own[own.len() / 2]
            );
        }
    });
}
