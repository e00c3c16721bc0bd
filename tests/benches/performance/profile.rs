//! `--profile [ROW]`: where one transport row's instructions go, both sides, in one command.
//!
//! The bench runs itself under `valgrind --tool=callgrind`: ROW's operation and its floor, each
//! [`ITERATIONS`] and then 2 × [`ITERATIONS`] times after a warm-up, everything (the
//! controller's client and the in-process connector, logging as the daemon does) on one thread
//! of a current-thread runtime, with collection switched on only inside [`profiled_iteration`]
//! and, on tokio's blocking threads, inside the blocking tasks the connector hands them. What
//! the set-up and the warm-up hand to blocking threads is collected too, alike in both runs: the
//! difference of the two runs, divided by [`ITERATIONS`], is the operation alone. It prints the instructions per
//! operation of each and their ratio, then the row's top functions by inclusive and by self
//! cost (`callgrind_annotate`), so the next regression is named in one run. Instruction counts
//! do not depend on what else the machine runs (valgrind hides ADX and BMI2, so ring's
//! portable P-256 code runs and signatures weigh more than on the metal).
//!
//! Rows: `new-connection` (Hello on a new connection as `client::connect` makes it, against the
//! echo on a new connection with a full handshake), `hello`, `list-runs`, `read-journal` (each on
//! an open connection, against the echo on an open mTLS connection), `set-up` (section 2's run
//! set-up with its EndRun, against a new connection, 4 echo calls and BeginRun's syncs; the
//! kernel's side of the syncs is not counted). Needs valgrind (`apt-get install valgrind`).

use super::*;
use std::future::Future;

/// The rows `--profile` knows, the first the default.
pub const ROWS: [&str; 5] = [
    "new-connection",
    "hello",
    "list-runs",
    "read-journal",
    "set-up",
];
/// Operations measured in the first run (twice as many in the second), after [`WARM_UP`]
/// unmeasured ones.
const ITERATIONS: usize = 20;
const WARM_UP: usize = 5;
/// Functions printed of each listing.
const TOP: usize = 20;
/// Set in the child valgrind runs: which operation it makes (`ROW` or `ROW/floor`), and how
/// many times.
const TARGET_ENV: &str = "CERTISTACK_BENCH_PROFILE_TARGET";
const ITERATIONS_ENV: &str = "CERTISTACK_BENCH_PROFILE_ITERATIONS";

/// `--profile [ROW]` from the command line, or the child's part under valgrind.
pub fn profile(args: &[String]) {
    if let Ok(target) = std::env::var(TARGET_ENV) {
        run_target(&target);
        return;
    }
    let row = args
        .iter()
        .skip_while(|a| *a != "--profile")
        .nth(1)
        .filter(|a| !a.starts_with("--"))
        .map(String::as_str)
        .unwrap_or(ROWS[0]);
    if !ROWS.contains(&row) {
        eprintln!("--profile {row}: not a row; one of {}", ROWS.join(", "));
        std::process::exit(64);
    }
    for tool in ["valgrind", "callgrind_annotate"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("--profile needs {tool}: apt-get install valgrind");
            std::process::exit(69);
        }
    }
    // Kept for the reader (the callgrind files, and a failed child's log): never removed.
    let dir = {
        let made = TempDir::new("bench-profile");
        let path = made.0.clone();
        std::mem::forget(made);
        path
    };
    let run = |target: &str, iterations: usize| -> PathBuf {
        let name = format!("{}-{iterations}", target.replace('/', "-"));
        let out = dir.join(format!("callgrind.{name}"));
        let log = dir.join(format!("valgrind.{name}.log"));
        let status = Command::new("valgrind")
            .args([
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=*profiled_iteration*",
                // What the connector hands to tokio's blocking threads (BeginRun's and
                // EndRun's files, a journal's appends) runs there, outside the toggled
                // function: every thread but the main one is collected from its start
                // (glibc's `start_thread`; collection is switched per thread). In this child
                // the only other threads are tokio's blocking pool. A toggle on tokio's
                // `BlockingTask::poll` would miss the tasks whose poll the optimizer inlined.
                "--toggle-collect=start_thread",
            ])
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(format!("--log-file={}", log.display()))
            .arg(std::env::current_exe().unwrap())
            .arg("--profile")
            .env(TARGET_ENV, target)
            .env(ITERATIONS_ENV, iterations.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        if !status.success() {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = said.lines().rev().take(30).collect();
            panic!(
                "valgrind of {target} ({iterations} operations): {status}; the end of {}:\n{}",
                log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        out
    };
    // The operation alone: what 2N operations collect beyond N (the set-up, the warm-up and
    // anything else collected once cancel out).
    let per_operation = |target: &str| -> (PathBuf, u64) {
        let once = total_instructions(&run(target, ITERATIONS));
        let twice_file = run(target, 2 * ITERATIONS);
        let twice = total_instructions(&twice_file);
        // The blocking threads are collected whatever the main thread does, so more
        // instructions alone no longer show that the operations were.
        assert!(
            annotate(&twice_file, true, usize::MAX)
                .iter()
                .any(|line| line.contains("profiled_iteration")),
            "{target}: profiled_iteration was not collected (renamed or inlined?)"
        );
        assert!(
            twice > once,
            "{target}: {twice} instructions for {} operations, {once} for {ITERATIONS}: the toggled functions were not collected (renamed or inlined?)",
            2 * ITERATIONS
        );
        (twice_file, (twice - once) / ITERATIONS as u64)
    };
    let (row_file, row_ir) = per_operation(row);
    let (_, floor_ir) = per_operation(&format!("{row}/floor"));
    // The blocking work must be among what was collected, or the count leaves it out silently
    // (ListRuns and ReadJournal answer on the async worker since they need not wait).
    let expected = match row {
        "set-up" => Some("create_run"),
        _ => None,
    };
    if let Some(function) = expected {
        let listed = annotate(&row_file, true, usize::MAX);
        assert!(
            listed.iter().any(|line| line.contains(function)),
            "{row}: {function} (run on a blocking thread) was not collected: the start_thread toggle no longer matches (are libc's symbols readable?)"
        );
    }
    heading(&format!("Profile of `{row}` (callgrind, instructions)"));
    println!(
        "Instructions of {} operations less those of {ITERATIONS}, after {WARM_UP} of warm-up, divided by {ITERATIONS}; client and connector (logging as the daemon does, to nowhere) on one thread; the floor: {}.\n",
        2 * ITERATIONS,
        floor_name(row)
    );
    println!("| operation | instructions per operation | ÷ floor |");
    println!("|---|---:|---:|");
    println!(
        "| {row} | {} | {:.2}× |",
        thousands(row_ir),
        row_ir as f64 / floor_ir as f64
    );
    println!(
        "| floor: {} | {} | 1.00× |",
        floor_name(row),
        thousands(floor_ir)
    );
    for (inclusive, title) in [(true, "inclusive"), (false, "self")] {
        println!(
            "\nTop {TOP} functions of `{row}` by {title} cost ({} operations, with the set-up's blocking tasks):\n",
            2 * ITERATIONS
        );
        for line in annotate(&row_file, inclusive, TOP) {
            println!("    {line}");
        }
    }
    println!(
        "\nThe callgrind files are kept in {} for callgrind_annotate or kcachegrind.",
        dir.display()
    );
}

fn floor_name(row: &str) -> &'static str {
    match row {
        "new-connection" => {
            "the echo on a new connection with a full TLS 1.3 handshake (a configuration of its own)"
        }
        "set-up" => {
            "a new connection with a full handshake, 4 echo calls and BeginRun's syncs (the set-up row: mint, connect, Hello, BeginRun, VmStatus and EndRun)"
        }
        _ => "the echo on an open mTLS connection",
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The `summary:` (or `totals:`) line of a callgrind file: every instruction collected.
fn total_instructions(file: &Path) -> u64 {
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .find_map(|line| {
            line.strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
        })
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{}: no summary line", file.display()))
}

/// The top `most` functions `callgrind_annotate` lists, by inclusive or self cost.
fn annotate(file: &Path, inclusive: bool, most: usize) -> Vec<String> {
    let output = Command::new("callgrind_annotate")
        .arg(format!(
            "--inclusive={}",
            if inclusive { "yes" } else { "no" }
        ))
        .arg("--threshold=100")
        .arg(file)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "callgrind_annotate {}: {}",
        file.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .filter(|line| {
            let line = line.trim_start();
            line.chars().next().is_some_and(|c| c.is_ascii_digit()) && line.contains(':')
        })
        .filter(|line| !line.contains("PROGRAM TOTALS"))
        .map(|line| line.trim_end().chars().take(200).collect())
        .take(most)
        .collect()
}

/// Everything collection sees runs inside this function: the caller's operation and, on the
/// same current-thread runtime, the connector's side of it.
#[inline(never)]
fn profiled_iteration<F: Future>(runtime: &tokio::runtime::Runtime, operation: F) -> F::Output {
    runtime.block_on(operation)
}

/// The child under valgrind: the operations of `target` (`ROW` or `ROW/floor`), as many as
/// the parent asks.
fn run_target(target: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (row, floor) = match target.split_once('/') {
        Some((row, "floor")) => (row, true),
        _ => (target, false),
    };
    let dir = TempDir::new("bench-profile-target");
    let authority = controller(&dir.0);
    let node = runtime.block_on(TestNode::start(&authority, &dir.0.join("node"), NODE));
    let operator = authority.issue_operator("bench", now()).unwrap();
    let mtls_address = runtime.block_on(serve_echo_mtls(&authority, &node.config));
    let payload = vec![0x5a; 64];
    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let (mut run, mut op, echo_channel) = runtime.block_on(async {
        let mut run = run_client(&authority, &node, &credentials).await;
        run.begin_run(begin_request(&credentials)).await.unwrap();
        run.vm_status(pb::VmRequest { vmid: VMID }).await.unwrap();
        let op = client(&authority, &node.address, NODE, &operator)
            .await
            .unwrap();
        let config = controller_tls(&authority, &operator);
        let channel = certistack_controller::connect::connect(mtls_address.clone(), NODE, config)
            .await
            .unwrap();
        (run, op, channel)
    });
    if row == "set-up" {
        // Each set-up begins a run with the same VMID, VNet and archives: no other may be open.
        runtime.block_on(run.end_run(pb::EndRunRequest {})).unwrap();
    }
    // Beside the connector's state directory, as section 2's floor makes its syncs.
    let sync_dir = node
        .config
        .paths
        .state_dir
        .with_file_name("bench-sync-floor");
    std::fs::create_dir_all(&sync_dir).unwrap();
    let iterations: usize = std::env::var(ITERATIONS_ENV)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(ITERATIONS);
    runtime.block_on(async {
        tokio::task::spawn_blocking(|| ()).await.unwrap();
    });
    for i in 0..WARM_UP + iterations {
        let operation = async {
            match (row, floor) {
                ("new-connection", true) => {
                    let config = controller_tls(&authority, &operator);
                    let channel =
                        certistack_controller::connect::connect(mtls_address.clone(), NODE, config)
                            .await
                            .unwrap();
                    echo::call(&channel, &payload).await;
                }
                ("new-connection", false) => {
                    let mut c = client(&authority, &node.address, NODE, &operator)
                        .await
                        .unwrap();
                    c.hello(pb::HelloRequest {}).await.unwrap();
                }
                ("set-up", true) => {
                    let config = controller_tls(&authority, &operator);
                    let channel =
                        certistack_controller::connect::connect(mtls_address.clone(), NODE, config)
                            .await
                            .unwrap();
                    for call in 0..4 {
                        if call == 2 {
                            let dir = sync_dir.join(format!("{i}"));
                            tokio::task::spawn_blocking(move || syncs_of_begin_run(&dir))
                                .await
                                .unwrap();
                        }
                        echo::call(&channel, &payload).await;
                    }
                }
                (_, true) => echo::call(&echo_channel, &payload).await,
                ("hello", false) => {
                    run.hello(pb::HelloRequest {}).await.unwrap();
                }
                ("list-runs", false) => {
                    op.list_runs(pb::ListRunsRequest::default()).await.unwrap();
                }
                ("read-journal", false) => read_whole_journal(&mut run).await,
                ("set-up", false) => {
                    let credentials =
                        mint(&authority, &grant(&uuid::Uuid::new_v4().to_string(), NODE));
                    let mut c = client(&authority, &node.address, NODE, &credentials.certificate)
                        .await
                        .unwrap();
                    certistack_controller::client::hello(&mut c, NODE)
                        .await
                        .unwrap();
                    c.begin_run(begin_request(&credentials)).await.unwrap();
                    c.vm_status(pb::VmRequest { vmid: VMID }).await.unwrap();
                    c.end_run(pb::EndRunRequest {}).await.unwrap();
                }
                (other, _) => panic!("unknown profile row {other}"),
            }
        };
        if i < WARM_UP {
            runtime.block_on(operation);
        } else {
            profiled_iteration(&runtime, operation);
        }
    }
}
