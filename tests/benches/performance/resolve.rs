//! Section `resolve`: what resolving an operator's plan costs against the API doubles
//! (`tests/doubles/pbs-api`, `pve-api`): a pool of 100 VMs selected, each one's newest backup
//! found (`snapshot: latest`: the listing, the config blob for its size), a sandbox VMID from
//! the range for each (`/cluster/nextid`), the preflight's privileges and the VNet's SDN view,
//! all through `certistack-ctl plan show --json` as an operator runs it. Printed: the time of a
//! whole resolution beside `plan show` of the same plan written out (no API asked), and the API
//! calls of one resolution by kind.
//!
//! Run: `cargo build --release --bins && cargo bench -p certistack-tests --bench performance -- resolve`

use super::{Samples, Settings, heading, ms, ratio};
use certistack_tests::*;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Instant;

const VMS: u32 = 100;
const FIRST_VMID: u32 = 1000;
const TOKEN_ID: &str = "certistack@pve!ctl";
const PVE_SECRET: &str = "0b1e5c1e-1111-4222-8333-944445555666";
const PBS_SECRET: &str = "bench-pbs-secret";
const SNAPSHOT: &str = "2026-12-01T02:00:00Z";

pub async fn resolve(settings: &Settings) {
    let dir = TempDir::new("bench-resolve");
    // The "PBS": one finished snapshot per VM, its disk and its config.
    let pbs_root = dir.0.join("pbs-root");
    for vmid in FIRST_VMID..FIRST_VMID + VMS {
        let snapshot = pbs_root.join(format!("pbs/bench/vm/{vmid}/{SNAPSHOT}"));
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::write(snapshot.join("drive-scsi0.img"), vec![0u8; 64 << 10]).unwrap();
        std::fs::write(
            snapshot.join("qemu-server.conf.blob"),
            "cores: 1\nmemory: 512\nscsi0: local:1/vm-1-disk-0.raw,size=64K\n",
        )
        .unwrap();
    }
    std::fs::write(
        pbs_root.join("double.json"),
        serde_json::json!({ "pbs_password": PBS_SECRET }).to_string(),
    )
    .unwrap();
    let pbs = ApiDouble::start(
        "pbs-api",
        &api_server_pki(&["localhost"]),
        &["--root".into(), pbs_root.clone().into_os_string()],
        "--tls-dir",
    );
    // The cluster: the 100 VMs in pool bench, a token that may audit everything.
    let pki = api_server_pki(&["localhost"]);
    let guests: Vec<serde_json::Value> = (FIRST_VMID..FIRST_VMID + VMS)
        .map(|vmid| {
            serde_json::json!({"vmid": vmid, "type": "qemu", "node": "pve1",
                "name": format!("app{vmid}"), "pool": "bench"})
        })
        .collect();
    let pve_root = TempDir::new("bench-pve");
    std::fs::write(
        pve_root.0.join("double.json"),
        serde_json::json!({
            "tokens": { TOKEN_ID: PVE_SECRET },
            "permissions": { TOKEN_ID: { "/": {
                "Sys.Audit": 1, "VM.Audit": 1, "Pool.Audit": 1, "SDN.Audit": 1 } } },
            "guests": guests,
            "pools": ["bench"],
        })
        .to_string(),
    )
    .unwrap();
    let pve = ApiDouble::start_in("pve-api", &pki, &[], "--root", pve_root);

    let secret = |name: &str, value: &str| {
        let path = dir.0.join(name);
        std::fs::write(&path, format!("{value}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    secret("pve-token", PVE_SECRET);
    secret("pbs-token", PBS_SECRET);
    std::fs::write(dir.0.join("pve-root-ca.pem"), &pki.ca_pem).unwrap();
    std::fs::write(
        dir.0.join("controller.toml"),
        format!(
            "state_dir = {:?}\nreports_dir = {:?}\n\n[pve]\napi_url = \"https://localhost:{}\"\ntoken_id = {TOKEN_ID:?}\ntoken_secret_file = \"pve-token\"\nca_file = \"pve-root-ca.pem\"\nsandbox_vmid_range = \"990000-990999\"\n\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = 7443\n",
            dir.0.join("state"),
            dir.0.join("reports"),
            pve.port
        ),
    )
    .unwrap();
    let storage = format!(
        "storage:\n  server: localhost\n  port: {}\n  datastore: bench\n  auth_id: \"certistack@pbs!restore\"\n  fingerprint: \"{}\"\n  pbs_password_file: pbs-token\n",
        pbs.port, pbs.fingerprint
    );
    let validation = "    network:\n      lifecycle: preprovisioned\n      vnet: csnet1\n      probe_source: 10.99.0.1/24\n    network_recovery:\n      mode: preserve\n";
    std::fs::write(
        dir.0.join("operator.yaml"),
        format!(
            "{storage}validations:\n  - name: app\n    node: pve1\n    select: {{pool: bench}}\n    snapshot: latest\n    max_age_hours: 8760\n    sandbox:\n      - {{}}\n{validation}"
        ),
    )
    .unwrap();
    // The same 100 validations written out: nothing to ask but the preflight and SDN.
    let mut written = format!("{storage}validations:\n");
    for (i, vmid) in (FIRST_VMID..FIRST_VMID + VMS).enumerate() {
        written.push_str(&format!(
            "  - name: app-{vmid}\n    node: pve1\n    source_vmid: {vmid}\n    snapshot: \"{SNAPSHOT}\"\n    archives: [drive-scsi0.img]\n    sandbox:\n      - vmid: {}\n        cores: 1\n        memory_mib: 512\n{validation}",
            990_000 + i
        ));
    }
    std::fs::write(dir.0.join("written.yaml"), written).unwrap();

    let show = |plan: &str| {
        let started = Instant::now();
        let out = Command::new(binary("certistack-ctl"))
            .args([
                "plan",
                "show",
                plan,
                "--config",
                "controller.toml",
                "--json",
            ])
            .current_dir(&dir.0)
            .output()
            .unwrap();
        let took = started.elapsed();
        assert!(
            out.status.success(),
            "{plan}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let document: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            document["validations"].as_array().unwrap().len(),
            VMS as usize
        );
        took
    };
    let iterations = if settings.short { 2 } else { 7 };
    // One resolution first, alone, to count its calls.
    let logs = [pbs_root.join("calls.log"), pve.tls_dir().join("calls.log")];
    let count_before = calls_by_kind(&logs);
    show("operator.yaml");
    let count_after = calls_by_kind(&logs);
    let mut operator = Samples::default();
    let mut explicit = Samples::default();
    for _ in 0..iterations {
        operator.push(show("operator.yaml"));
        explicit.push(show("written.yaml"));
    }

    heading(&format!(
        "resolve: plan show of a {VMS}-VM pool selection against the API doubles ({iterations} runs each)"
    ));
    println!("| plan | median | p99 | max | vs written out |");
    println!("|---|---|---|---|---|");
    println!(
        "| select pool, latest, VMIDs from the range | {} | {} | {} | {} |",
        ms(operator.median()),
        ms(operator.p99()),
        ms(operator.max()),
        ratio(operator.median(), explicit.median())
    );
    println!(
        "| the same {VMS} validations written out | {} | {} | {} | 1.0× |",
        ms(explicit.median()),
        ms(explicit.p99()),
        ms(explicit.max())
    );
    println!("\nAPI calls of one resolution, by kind:\n");
    println!("| call | count |");
    println!("|---|---|");
    for (kind, after) in &count_after {
        let n = after - count_before.get(kind).copied().unwrap_or(0);
        if n > 0 {
            println!("| {kind} | {n} |");
        }
    }
}

/// Each double's answered requests so far, by method and route (VMIDs and names folded).
fn calls_by_kind(logs: &[std::path::PathBuf]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut connections = std::collections::BTreeSet::new();
    for log in logs {
        for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
            let Ok(call) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let path = call["path"].as_str().unwrap_or("?");
            let query = call["query"].as_str().unwrap_or("");
            let route: String = path
                .split('/')
                .map(|part| {
                    if part.chars().all(|c| c.is_ascii_digit()) && !part.is_empty() {
                        "N"
                    } else {
                        part
                    }
                })
                .collect::<Vec<_>>()
                .join("/");
            let folded = if query.contains("backup-id") || query.contains("file-name") {
                format!("{route} (one VM)")
            } else if query.starts_with("path=") {
                format!("{route}?path=…")
            } else if query.starts_with("vmid=") {
                format!("{route}?vmid=N")
            } else if query.is_empty() {
                route
            } else {
                format!("{route}?{query}")
            };
            *out.entry(format!(
                "{} {}",
                call["method"].as_str().unwrap_or("?"),
                folded
            ))
            .or_insert(0) += 1;
            // The client's port: calls that share one came on one kept connection.
            if let Some(port) = call["connection"].as_u64() {
                connections.insert((call["tool"].as_str().unwrap_or("?").to_owned(), port));
            }
        }
    }
    out.insert(
        "connections opened (TCP and TLS handshakes)".into(),
        connections.len() as u64,
    );
    out
}
