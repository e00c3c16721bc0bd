//! `certistack-ctl run`: every validation of a plan, driven on its node from grant to report.
//!
//! Each validation gets its own run id, grant and run certificate (valid until the grant's
//! deadline), its own connection and its own report. Validations on different nodes run
//! concurrently, bounded per node and in total; one node failing fails only its validations.
//!
//! The happy path is map → overlay → create VM → prepare sandbox → start → wait for the guest
//! agent → QMP/QGA facts → probes → assertions → stop → destroy → release sandbox → delete
//! overlays → unmap. Whatever happens before the end (a refused step, Ctrl-C, a lost connection,
//! the deadline), the run ends the same way: the node's `Cleanup` undoes what its journal
//! records (reconnecting first if the connection was lost), `EndRun` proves nothing is left, and
//! the journal is read back and its chain recomputed here for the report. A run whose cleanup
//! cannot be proven complete says so in its report and in the exit code.

use crate::authority::{Authority, IssuedCertificate};
use crate::client::{self, NodeError};
use crate::doctor;
use crate::operator;
use crate::plan::{self, Plan, Validation};
use crate::report::{self, StepResult, Verdict};
use crate::run as credentials;
use crate::screenshot;
use certistack_core::files;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use time::OffsetDateTime;
use tokio::sync::{Semaphore, watch};
use tonic::transport::Channel;
use zeroize::Zeroizing;

/// Validations running at once on one node, unless the command line says otherwise.
pub const DEFAULT_PER_NODE: usize = 2;
/// Validations running at once in total, unless the command line says otherwise.
pub const DEFAULT_TOTAL: usize = 8;
/// How long connecting and the TLS handshake may take before the node counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Between two attempts to reach a node again after the connection was lost.
const RECONNECT_PAUSE_MAX: Duration = Duration::from_secs(5);
/// Between two guest-agent pings while waiting for the guest.
const AGENT_POLL: Duration = Duration::from_secs(2);
/// How long a sandbox VM may take to stop before QEMU is killed.
const STOP_TIMEOUT_SECONDS: u32 = 30;
/// The operator name of the certificates `run` mints to read journals and clean up late.
const OPERATOR_NAME: &str = "certistack-run";
/// The most a PBS secret file may hold: a password or an API-token secret is one short line.
const MAX_SECRET_BYTES: usize = 4096;
/// The most an encryption key file may hold (PBS key files are a few hundred bytes of JSON).
const MAX_KEY_BYTES: usize = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Secrets.

/// The PBS credential and optional encryption key, read from their permission-checked files and
/// held only in memory; each reaches a node only inside the `MapBackup` that needs it.
pub struct Secrets {
    pbs_secret: Zeroizing<String>,
    encryption_key: Option<Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secrets { .. }")
    }
}

/// Why the secret files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    File(#[from] files::FileError),
    #[error("{0}")]
    Invalid(String),
}

impl Secrets {
    /// Reads the plan's secret files. The password is the file's first line, as
    /// `PBS_PASSWORD_FILE` reads it.
    pub fn load(plan: &Plan) -> Result<Self, SecretError> {
        let text = files::read_private(&plan.pbs_password_file)?;
        if text.len() > MAX_SECRET_BYTES {
            return Err(SecretError::Invalid(format!(
                "{} holds {} bytes; a PBS password or token secret is one line",
                plan.pbs_password_file.display(),
                text.len()
            )));
        }
        let first = text.lines().next().unwrap_or_default();
        if first.is_empty() {
            return Err(SecretError::Invalid(format!(
                "{} is empty; write the PBS password or API-token secret on its first line",
                plan.pbs_password_file.display()
            )));
        }
        let pbs_secret = Zeroizing::new(first.to_owned());
        let encryption_key = match &plan.encryption_key_file {
            None => None,
            Some(path) => {
                let key = files::read_private(path)?;
                if key.len() > MAX_KEY_BYTES {
                    return Err(SecretError::Invalid(format!(
                        "{} holds {} bytes; a PBS encryption key file is at most {MAX_KEY_BYTES}",
                        path.display(),
                        key.len()
                    )));
                }
                Some(Zeroizing::new(key.as_bytes().to_vec()))
            }
        };
        Ok(Self {
            pbs_secret,
            encryption_key,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Progress.

/// How progress reaches a person or a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// One live line per validation (a terminal).
    Live,
    /// One plain line per step (not a terminal).
    Plain,
    /// One JSON object per step event, one per line.
    Json,
}

/// One step event of one validation.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub time_unix_ms: i64,
    pub validation: String,
    pub node: String,
    pub run_id: String,
    pub step: String,
    /// `started`, `ok`, `failed`, `skipped`.
    pub state: &'static str,
    pub elapsed_ms: u64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// Prints step events as the mode says; shared by every validation of a run.
#[allow(missing_debug_implementations)]
pub struct Progress {
    mode: ProgressMode,
    bars: indicatif::MultiProgress,
    lines: std::sync::Mutex<BTreeMap<String, indicatif::ProgressBar>>,
}

impl Progress {
    pub fn new(mode: ProgressMode) -> Self {
        let bars = indicatif::MultiProgress::new();
        if mode != ProgressMode::Live {
            bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        Self {
            mode,
            bars,
            lines: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn line(&self, validation: &str) -> Option<indicatif::ProgressBar> {
        let mut lines = self.lines.lock().ok()?;
        Some(
            lines
                .entry(validation.to_owned())
                .or_insert_with(|| {
                    let bar = self.bars.add(indicatif::ProgressBar::new_spinner());
                    if let Ok(style) =
                        indicatif::ProgressStyle::with_template("{spinner} [{elapsed:>4}] {msg}")
                    {
                        bar.set_style(style);
                    }
                    bar.enable_steady_tick(Duration::from_millis(250));
                    bar
                })
                .clone(),
        )
    }

    pub fn emit(&self, event: &Event) {
        match self.mode {
            ProgressMode::Json => {
                if let Ok(line) = serde_json::to_string(event) {
                    write_line(&line);
                }
            }
            ProgressMode::Plain => {
                let detail = if event.detail.is_empty() {
                    String::new()
                } else {
                    format!(": {}", for_terminal(&event.detail))
                };
                write_line(&format!(
                    "{} {} {} {} ({:.1}s){detail}",
                    event.validation,
                    event.node,
                    event.step,
                    event.state,
                    event.elapsed_ms as f64 / 1000.0
                ));
            }
            ProgressMode::Live => {
                if let Some(bar) = self.line(&event.validation) {
                    bar.set_message(format!(
                        "{} on {}: {} {}",
                        event.validation,
                        event.node,
                        for_terminal(&event.step),
                        event.state
                    ));
                }
            }
        }
    }

    /// Ends a validation's live line with its outcome.
    pub fn finish(&self, validation: &str, text: String) {
        if self.mode == ProgressMode::Live
            && let Some(bar) = self.line(validation)
        {
            bar.finish_with_message(text);
        }
    }

    /// Prints a line above the live lines (or plainly when there are none).
    pub fn println(&self, text: &str) {
        match self.mode {
            ProgressMode::Live => {
                let _ = self.bars.println(text);
            }
            ProgressMode::Plain => write_line(text),
            ProgressMode::Json => eprintln!("{text}"),
        }
    }
}

/// The longest node or guest text shown on one line of a terminal; the report keeps it whole.
const MAX_SHOWN_CHARS: usize = 200;

/// Text from a node or a guest (a banner, a tool's message) made safe for one terminal line:
/// control characters escaped, capped. The restored guest is not trusted.
fn for_terminal(text: &str) -> String {
    certistack_core::untrusted::printable(text.as_bytes(), MAX_SHOWN_CHARS)
}

/// One line on standard output; a closed pipe is not the run's failure, so errors are ignored.
pub fn write_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

// ---------------------------------------------------------------------------------------------
// Outcomes.

/// What a validation proved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The backup restored: every check held.
    Passed,
    /// The backup did not restore: a probe, an assertion or the guest said so.
    Failed,
    /// Nothing was proven about the backup: the node, the connection or the operator stopped it.
    Error,
}

/// Whether the node is proven to hold nothing of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CleanupState {
    /// The run never began on the node: nothing to clean.
    NotNeeded,
    /// Cleanup found nothing left and the run was ended.
    Complete,
    /// The node could not prove it holds nothing of the run; see the report and `runs NODE`.
    Unproven,
}

/// One validation's line in the closing summary.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub validation: String,
    pub node: String,
    pub run_id: String,
    pub outcome: Outcome,
    pub cleanup: CleanupState,
    pub reasons: Vec<String>,
    pub elapsed_ms: u64,
    pub report: Option<PathBuf>,
}

/// The exit code of a run: 0 every validation passed; 2 any infrastructure error, interruption
/// or unproven cleanup; otherwise 1 when a validation failed.
pub fn exit_code(summaries: &[Summary]) -> u8 {
    if summaries
        .iter()
        .any(|s| s.outcome == Outcome::Error || s.cleanup == CleanupState::Unproven)
    {
        2
    } else if summaries.iter().any(|s| s.outcome == Outcome::Failed) {
        1
    } else {
        0
    }
}

/// The closing table: one row per validation.
pub fn summary_table(summaries: &[Summary]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<12} {:<36} {:<7} {:<10} {:>8}  REASON / REPORT",
        "VALIDATION", "NODE", "RUN", "RESULT", "CLEANUP", "TIME"
    );
    for s in summaries {
        let outcome = match s.outcome {
            Outcome::Passed => "passed",
            Outcome::Failed => "FAILED",
            Outcome::Error => "ERROR",
        };
        let cleanup = match s.cleanup {
            CleanupState::NotNeeded => "none",
            CleanupState::Complete => "complete",
            CleanupState::Unproven => "UNPROVEN",
        };
        let tail = match (s.reasons.first(), &s.report) {
            (Some(reason), _) => for_terminal(reason),
            (None, Some(path)) => path.display().to_string(),
            (None, None) => String::new(),
        };
        let _ = writeln!(
            out,
            "{:<20} {:<12} {:<36} {:<7} {:<10} {:>7.1}s  {tail}",
            s.validation,
            s.node,
            s.run_id,
            outcome,
            cleanup,
            s.elapsed_ms as f64 / 1000.0
        );
        for reason in s.reasons.iter().skip(1) {
            let _ = writeln!(out, "{:<100}{}", "", for_terminal(reason));
        }
        if !s.reasons.is_empty()
            && let Some(path) = &s.report
        {
            let _ = writeln!(out, "{:<100}report {}", "", path.display());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Driving a plan.

/// Operator interruptions: 0 none, 1 stop after the current step and clean up, 2 also abandon
/// the step or wait in progress (cleanup still runs).
pub type Interrupts = watch::Receiver<u8>;

/// What every validation of one `run` shares.
#[allow(missing_debug_implementations)]
pub struct RunContext {
    pub authority: Arc<Authority>,
    /// The inventory: where each node listens, for its prerequisite checks.
    pub nodes: BTreeMap<String, crate::config::InventoryNode>,
    pub reports_dir: PathBuf,
    pub plan_digest: String,
    pub secrets: Arc<Secrets>,
    pub progress: Arc<Progress>,
    pub interrupts: Interrupts,
}

/// Runs every validation of `plan`, at most `per_node` at once on one node and `total` at once
/// overall, and returns their summaries in plan order.
pub async fn run_plan(
    context: Arc<RunContext>,
    plan: Plan,
    per_node: usize,
    total: usize,
) -> Vec<Summary> {
    let total = Arc::new(Semaphore::new(total.max(1)));
    let mut per_node_limits: BTreeMap<String, Arc<Semaphore>> = BTreeMap::new();
    let mut exclusive: BTreeMap<String, Arc<Semaphore>> = BTreeMap::new();
    // A node's prerequisites are checked once per run and sandbox VNet, by the first validation
    // using that VNet: part of the judgement (forwarding, SDN SNAT) is about the VNet itself.
    #[allow(clippy::type_complexity)]
    let mut prerequisites: BTreeMap<
        (String, String),
        Arc<tokio::sync::OnceCell<Vec<doctor::Check>>>,
    > = BTreeMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut names = Vec::with_capacity(plan.validations.len());
    for (index, validation) in plan.validations.into_iter().enumerate() {
        names.push((validation.name.clone(), validation.grant.node.to_string()));
        let node_limit = per_node_limits
            .entry(validation.grant.node.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(per_node.max(1))))
            .clone();
        // A node refuses a run whose VNet or archive another open run holds: validations that
        // share one on a node run one after the other. Locks are taken in one global order
        // (sorted keys, then the node's limit, then the total), so none waits in a cycle.
        let locks: Vec<Arc<Semaphore>> = exclusive_keys(&validation)
            .into_iter()
            .map(|key| {
                exclusive
                    .entry(key)
                    .or_insert_with(|| Arc::new(Semaphore::new(1)))
                    .clone()
            })
            .collect();
        let checked = prerequisites
            .entry((
                validation.grant.node.to_string(),
                validation.grant.vnet.to_string(),
            ))
            .or_default()
            .clone();
        let total = total.clone();
        let context = context.clone();
        tasks.spawn(async move {
            let mut held = Vec::with_capacity(locks.len());
            for lock in locks {
                held.push(lock.acquire_owned().await);
            }
            let _node = node_limit.acquire_owned().await;
            let _total = total.acquire_owned().await;
            (index, drive(&context, validation, &checked).await)
        });
    }
    let mut summaries: Vec<Option<Summary>> = names.iter().map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        if let Ok((index, summary)) = joined
            && let Some(slot) = summaries.get_mut(index)
        {
            *slot = Some(summary);
        }
    }
    // A validation whose task ended without a summary is not silently dropped.
    summaries
        .into_iter()
        .zip(names)
        .map(|(summary, (validation, node))| {
            summary.unwrap_or_else(|| Summary {
                validation,
                node,
                run_id: String::new(),
                outcome: Outcome::Error,
                cleanup: CleanupState::Unproven,
                reasons: vec![
                    "the validation's task ended unexpectedly; see `certistack-ctl runs NODE`"
                        .into(),
                ],
                elapsed_ms: 0,
                report: None,
            })
        })
        .collect()
}

/// What a validation holds exclusively on its node: its VNet and each archive of its snapshot.
fn exclusive_keys(validation: &Validation) -> Vec<String> {
    let grant = &validation.grant;
    let mut keys: Vec<String> = grant
        .archives
        .iter()
        .map(|archive| format!("{}\0archive\0{}\0{archive}", grant.node, grant.snapshot))
        .collect();
    keys.push(format!("{}\0vnet\0{}", grant.node, grant.vnet));
    keys.sort();
    keys
}

/// Why a step ended the happy path.
#[derive(Debug)]
enum Stop {
    /// The node refused or failed a step; nothing more is asked but cleanup.
    Refused(String),
    /// The connection to the node is gone; cleanup reconnects first.
    Lost(String),
    /// The operator interrupted the run.
    Interrupted(String),
    /// The run's deadline passed.
    Deadline(String),
}

impl Stop {
    fn reason(&self) -> &str {
        match self {
            Stop::Refused(text)
            | Stop::Lost(text)
            | Stop::Interrupted(text)
            | Stop::Deadline(text) => text,
        }
    }
}

/// Ends a validation that never began on its node: the step that stopped it (`name`, when it
/// started, its result), then the report, with nothing to clean up.
async fn not_begun(
    mut recorder: Recorder<'_>,
    evidence: Evidence,
    validation: &Validation,
    (name, at, result): (&str, i64, StepResult),
    stop: Stop,
) -> Summary {
    recorder.end(name, at, result, stop.reason().to_owned());
    finish(recorder, evidence, validation, Some(stop), None).await
}

/// A connection to the node as the run.
struct Session {
    endpoint: String,
    node: String,
    ca_pem: String,
    identity: Arc<IssuedCertificate>,
    /// The signed grant, presented again after a reconnect (BeginRun resumes an open run).
    grant: pb::SignedRunGrant,
    client: Option<ConnectorClient<Channel>>,
    /// The run's deadline: its certificate is void after it.
    deadline: Instant,
}

impl Session {
    async fn connect(&mut self) -> Result<pb::HelloReply, NodeError> {
        let connect = client::connect(&self.endpoint, &self.node, &self.ca_pem, &self.identity);
        let mut connection = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| NodeError::Status {
                code: tonic::Code::Unavailable,
                message: format!(
                    "no TLS session with {} within {} s",
                    self.endpoint,
                    CONNECT_TIMEOUT.as_secs()
                ),
            })??;
        let hello =
            tokio::time::timeout(CONNECT_TIMEOUT, client::hello(&mut connection, &self.node))
                .await
                .map_err(|_| NodeError::Status {
                    code: tonic::Code::Unavailable,
                    message: format!("no Hello answer within {} s", CONNECT_TIMEOUT.as_secs()),
                })??;
        self.client = Some(connection);
        Ok(hello)
    }

    /// Connects again and presents the grant: the node resumes the run it recovered from its
    /// journal (or, when the first BeginRun never arrived, begins it, with nothing to undo).
    async fn reconnect(&mut self) -> Result<(), NodeError> {
        self.connect().await?;
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        match client
            .begin_run(pb::BeginRunRequest {
                grant: Some(self.grant.clone()),
            })
            .await
        {
            Err(status) if connection_lost(&status) => Err(status.into()),
            // Any other answer: Cleanup's answer says what the node holds.
            _ => Ok(()),
        }
    }
}

/// Whether a failed call means the connection is gone (rather than a node's answer).
fn connection_lost(status: &tonic::Status) -> bool {
    // tonic reports a broken transport as UNAVAILABLE or UNKNOWN, and CANCELLED when the
    // stream was reset under the call. The node answers UNAVAILABLE itself only for a probe
    // address the node took away (an `ifreload`): the connection is fine, the run stops as an
    // infrastructure error.
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    ) && !node_removed_probe_address(status)
}

/// The node's own UNAVAILABLE for a probe address it no longer carries (protocol.md, Probe).
fn node_removed_probe_address(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
        && status
            .message()
            .starts_with("probe address removed by the node")
}

/// Whether a BeginRun error is the node's refusal, so no run exists: anything else (a reset
/// stream, an internal error, a timeout) may have left the run open.
fn definitely_not_begun(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::InvalidArgument
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::FailedPrecondition
            | tonic::Code::ResourceExhausted
            | tonic::Code::AlreadyExists
            | tonic::Code::OutOfRange
            | tonic::Code::Unimplemented
    )
}

fn describe_status(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// Collects what one validation did, for its events and its report.
struct Recorder<'a> {
    context: &'a RunContext,
    validation: String,
    node: String,
    run_id: String,
    started: Instant,
    steps: Vec<report::Step>,
}

impl Recorder<'_> {
    fn event(&self, step: &str, state: &'static str, detail: &str) {
        self.context.progress.emit(&Event {
            time_unix_ms: now_ms(),
            validation: self.validation.clone(),
            node: self.node.clone(),
            run_id: self.run_id.clone(),
            step: step.to_owned(),
            state,
            elapsed_ms: elapsed_ms(self.started),
            detail: detail.to_owned(),
        });
    }

    fn begin(&self, step: &str) -> i64 {
        self.event(step, "started", "");
        now_ms()
    }

    fn end(&mut self, step: &str, started_unix_ms: i64, result: StepResult, detail: String) {
        let state = match result {
            StepResult::Ok => "ok",
            StepResult::Failed => "failed",
            StepResult::Skipped => "skipped",
        };
        self.event(step, state, &detail);
        self.steps.push(report::Step {
            name: step.to_owned(),
            started_unix_ms,
            ended_unix_ms: now_ms(),
            result,
            detail,
        });
    }
}

fn now_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(i64::MAX)
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Evidence gathered on the way, for the report.
#[derive(Default)]
struct Evidence {
    connector: report::ConnectorVersion,
    guest: Option<report::GuestFacts>,
    agent_answered: bool,
    probes: Vec<report::ProbeResult>,
    isolation: Option<report::Isolation>,
    assertions: Vec<report::AssertionResult>,
    failures: Vec<String>,
    /// Evidence that contradicts the sandbox's isolation: nothing is proven then.
    isolation_failures: Vec<String>,
    /// Every probe and assertion ran: an interrupt after this point keeps the verdict.
    checks_complete: bool,
    /// The console at verdict time.
    screenshot: Option<screenshot::Screenshot>,
    /// Each step's name and the journal head its reply named.
    heads: Vec<(String, String)>,
    /// The source hardware the sandbox VMs mirror, as the node read it.
    hardware: Option<report::SandboxHardware>,
}

/// Drives one validation to its summary; never panics, never leaves without trying cleanup once
/// the run began.
async fn drive(
    context: &RunContext,
    validation: Validation,
    prerequisites: &tokio::sync::OnceCell<Vec<doctor::Check>>,
) -> Summary {
    let run_id = uuid::Uuid::new_v4().to_string();
    let node = validation.grant.node.to_string();
    let mut recorder = Recorder {
        context,
        validation: validation.name.clone(),
        node: node.clone(),
        run_id: run_id.clone(),
        started: Instant::now(),
        steps: Vec::new(),
    };
    let mut evidence = Evidence::default();
    if *context.interrupts.borrow() >= 1 {
        let at = recorder.begin("credentials");
        return not_begun(
            recorder,
            evidence,
            &validation,
            ("credentials", at, StepResult::Skipped),
            Stop::Interrupted(
                "not started: interrupted by the operator before the validation began".into(),
            ),
        )
        .await;
    }
    // The node's prerequisites, as `certistack-ctl doctor` judges them: a failing one stops the
    // validation before anything is asked of the node.
    let at = recorder.begin("doctor");
    let checks = prerequisites
        .get_or_init(|| check_prerequisites(context, &node, &validation.grant.vnet))
        .await;
    let failing: Vec<String> = checks
        .iter()
        .filter(|c| c.level == doctor::Level::Fail)
        .map(|c| format!("{}: {}", c.check, c.detail))
        .collect();
    let warnings: Vec<String> = checks
        .iter()
        .filter(|c| c.level == doctor::Level::Warn)
        .map(|c| format!("{}: {}", c.check, c.detail))
        .collect();
    if !failing.is_empty() {
        let reason = format!(
            "node {node} fails its prerequisites (see `certistack-ctl doctor {node}`): {}",
            failing.join("; ")
        );
        return not_begun(
            recorder,
            evidence,
            &validation,
            ("doctor", at, StepResult::Failed),
            Stop::Refused(reason),
        )
        .await;
    }
    recorder.end(
        "doctor",
        at,
        StepResult::Ok,
        if warnings.is_empty() {
            format!("{} checks ok", checks.len())
        } else {
            format!("warnings: {}", warnings.join("; "))
        },
    );

    let now = OffsetDateTime::now_utc();
    let deadline_unix = now.unix_timestamp() + i64::from(validation.run_seconds);
    let deadline = Instant::now() + Duration::from_secs(u64::from(validation.run_seconds));
    // The steps stop early enough for cleanup to run with the run's own certificate.
    let reserve = plan::cleanup_reserve_secs(validation.run_seconds);
    let steps_deadline = deadline
        .checked_sub(Duration::from_secs(u64::from(reserve)))
        .unwrap_or(deadline);

    // Credentials: this run's grant and the certificate bound to it.
    let at = recorder.begin("credentials");
    let mut wire = validation.wire.clone();
    wire.run_id = run_id.clone();
    wire.not_before_unix = now.unix_timestamp() - plan::NOT_BEFORE_SLACK_SECS;
    wire.deadline_unix = deadline_unix;
    let minted = match credentials::mint(&context.authority, &wire, now) {
        Ok(minted) => minted,
        Err(error) => {
            let reason = format!("cannot mint the run's credentials: {error}");
            return not_begun(
                recorder,
                evidence,
                &validation,
                ("credentials", at, StepResult::Failed),
                Stop::Refused(reason),
            )
            .await;
        }
    };
    recorder.end(
        "credentials",
        at,
        StepResult::Ok,
        format!("grant sha256:{}", hex::encode(minted.grant_sha256)),
    );
    let mut session = Session {
        endpoint: validation.endpoint.clone(),
        node: node.clone(),
        ca_pem: context.authority.ca_pem().to_owned(),
        identity: Arc::new(minted.certificate),
        grant: minted.signed_grant.clone(),
        client: None,
        deadline,
    };

    // Connect, check the surface, begin.
    let at = recorder.begin("connect");
    match session.connect().await {
        Ok(hello) => {
            evidence.connector = report::ConnectorVersion {
                version: hello.daemon_version.clone(),
                surface_digest: hello.surface_digest.clone(),
            };
            recorder.end(
                "connect",
                at,
                StepResult::Ok,
                format!(
                    "connector {} surface {}",
                    hello.daemon_version, hello.surface_digest
                ),
            );
        }
        Err(error) => {
            let reason = format!("node {node} at {}: {error}", validation.endpoint);
            return not_begun(
                recorder,
                evidence,
                &validation,
                ("connect", at, StepResult::Failed),
                Stop::Refused(reason),
            )
            .await;
        }
    }
    let at = recorder.begin("begin");
    let begin = pb::BeginRunRequest {
        grant: Some(minted.signed_grant.clone()),
    };
    let Some(client) = session.client.as_mut() else {
        return not_begun(
            recorder,
            evidence,
            &validation,
            ("begin", at, StepResult::Failed),
            Stop::Refused("no connection".into()),
        )
        .await;
    };
    if *context.interrupts.borrow() >= 1 {
        return not_begun(
            recorder,
            evidence,
            &validation,
            ("begin", at, StepResult::Skipped),
            Stop::Interrupted("not started: interrupted by the operator before BeginRun".into()),
        )
        .await;
    }
    let answer = tokio::time::timeout(RUN_CALL_TIMEOUT, client.begin_run(begin))
        .await
        .unwrap_or_else(|_| {
            Err(tonic::Status::deadline_exceeded(format!(
                "no answer to BeginRun within {} s",
                RUN_CALL_TIMEOUT.as_secs()
            )))
        });
    match answer {
        Ok(reply) => {
            let reply = reply.into_inner();
            recorder.end(
                "begin",
                at,
                StepResult::Ok,
                format!("deadline {}", reply.deadline_unix),
            );
        }
        Err(status) if !definitely_not_begun(&status) => {
            // The run may have begun before the answer was lost: clean up after reconnecting.
            let reason = format!(
                "the connection was lost during BeginRun: {}",
                describe_status(&status)
            );
            recorder.end("begin", at, StepResult::Failed, reason.clone());
            return finish(
                recorder,
                evidence,
                &validation,
                Some(Stop::Lost(reason)),
                Some(session),
            )
            .await;
        }
        Err(status) => {
            let reason = format!("the node refused the run: {}", describe_status(&status));
            return not_begun(
                recorder,
                evidence,
                &validation,
                ("begin", at, StepResult::Failed),
                Stop::Refused(reason),
            )
            .await;
        }
    }

    let stop = steps(
        context,
        &mut recorder,
        &mut evidence,
        &mut session,
        &validation,
        steps_deadline,
    )
    .await;
    finish(recorder, evidence, &validation, stop, Some(session)).await
}

/// The node's prerequisites, asked as an operator, with the plan's sandbox VNet.
async fn check_prerequisites(
    context: &RunContext,
    node: &str,
    vnet: &certistack_core::validate::VnetName,
) -> Vec<doctor::Check> {
    let fail = |detail: String| {
        vec![doctor::Check {
            node: node.to_owned(),
            check: doctor::CONNECT,
            level: doctor::Level::Fail,
            detail,
        }]
    };
    let Some(inventory) = context.nodes.get(node) else {
        return fail(format!("{node} is not in the controller's inventory"));
    };
    match context
        .authority
        .issue_operator(OPERATOR_NAME, OffsetDateTime::now_utc())
    {
        Ok(identity) => {
            doctor::check_node(
                inventory,
                context.authority.ca_pem(),
                &identity,
                Some(vnet),
                None,
                doctor::DEFAULT_NODE_TIMEOUT,
            )
            .await
        }
        Err(error) => fail(format!("cannot mint an operator certificate: {error}")),
    }
}

/// Returns once the operator's interrupts reach `level` (never, if the sender is gone).
async fn interrupted_to(interrupts: &mut Interrupts, level: u8) {
    loop {
        if *interrupts.borrow_and_update() >= level {
            return;
        }
        if interrupts.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Runs `call` unless the operator abandons it or the deadline passes first.
async fn guarded<T>(
    interrupts: &mut Interrupts,
    deadline: Instant,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Stop> {
    if *interrupts.borrow() >= 2 {
        return Err(Stop::Interrupted("interrupted by the operator".into()));
    }
    let abandon = interrupted_to(interrupts, 2);
    tokio::select! {
        result = call => match result {
            Ok(response) => Ok(response.into_inner()),
            Err(status) if connection_lost(&status) => Err(Stop::Lost(describe_status(&status))),
            Err(status) => Err(Stop::Refused(describe_status(&status))),
        },
        () = abandon => Err(Stop::Interrupted(
            "interrupted by the operator (second interrupt: the step in progress was abandoned)".into(),
        )),
        () = tokio::time::sleep_until(deadline.into()) => Err(Stop::Deadline(
            "the run's deadline passed during the step".into(),
        )),
    }
}

/// The evidence of a guest network recovery, for its step in the report: what inspection
/// found, the MAC and address of the profile, each file written, changed or set aside with its
/// SHA-256, the firewalld zone, and the notes.
fn guest_network_detail(reply: &pb::RecoverGuestNetworkReply) -> String {
    let Some(e) = &reply.evidence else {
        return String::new();
    };
    let files: Vec<String> = e
        .files
        .iter()
        .map(|f| {
            let renamed = if f.renamed_to.is_empty() {
                String::new()
            } else {
                format!(" -> {}", f.renamed_to)
            };
            format!("{} {}{renamed} sha256 {}", f.action, f.path, f.sha256)
        })
        .collect();
    let mut detail = format!(
        "{} {} {} ({}), stack {}; profile {} on {}; files: {}",
        e.os_type,
        e.distro,
        e.version,
        e.product_name,
        e.network_stack,
        e.guest_address,
        e.mac_address,
        files.join(", ")
    );
    if !e.firewalld_zone.is_empty() {
        detail.push_str(&format!(
            "; firewalld zone {} allows the probe source",
            e.firewalld_zone
        ));
    }
    for note in &e.notes {
        detail.push_str("; ");
        detail.push_str(note);
    }
    detail
}

/// The happy path, step by step; `None` when it ran to the end (checks that failed are in
/// `evidence.failures`), otherwise why it stopped early.
async fn steps(
    context: &RunContext,
    recorder: &mut Recorder<'_>,
    evidence: &mut Evidence,
    session: &mut Session,
    validation: &Validation,
    deadline: Instant,
) -> Option<Stop> {
    let grant = &validation.grant;
    let mut interrupts = context.interrupts.clone();
    let Some(mut client) = session.client.clone() else {
        return Some(Stop::Lost("no connection".into()));
    };

    macro_rules! step {
        ($name:expr, $detail:expr, $call:expr) => {{
            if *interrupts.borrow() >= 1 {
                return Some(Stop::Interrupted(format!(
                    "interrupted by the operator before step {}",
                    $name
                )));
            }
            let at = recorder.begin($name);
            match guarded(&mut interrupts, deadline, $call).await {
                Ok(reply) => {
                    recorder.end($name, at, StepResult::Ok, $detail(&reply));
                    // Kept to check against the journal the node streams at the end.
                    evidence
                        .heads
                        .push(($name.to_string(), reply.journal_head.clone()));
                    reply
                }
                Err(stop) => {
                    recorder.end($name, at, StepResult::Failed, stop.reason().to_owned());
                    return Some(match stop {
                        Stop::Refused(t) => Stop::Refused(format!("step {}: {t}", $name)),
                        other => other,
                    });
                }
            }
        }};
    }

    let snapshot = grant.snapshot.to_string();
    for archive in &grant.archives {
        let name = format!("map {archive}");
        step!(
            name.as_str(),
            |r: &pb::MapBackupReply| format!("{} read-only", r.loop_device),
            client.map_backup(pb::MapBackupRequest {
                snapshot: snapshot.clone(),
                archive: archive.to_string(),
                pbs_secret: context.secrets.pbs_secret.to_string(),
                encryption_key: context
                    .secrets
                    .encryption_key
                    .as_ref()
                    .map(|k| k.to_vec())
                    .unwrap_or_default(),
            })
        );
    }
    for vmid in grant.sandbox_vms.keys() {
        for archive in &grant.archives {
            let name = format!("overlay {vmid} {archive}");
            step!(
                name.as_str(),
                |r: &pb::CreateOverlayReply| r.warnings.join("; "),
                client.create_overlay(pb::CreateOverlayRequest {
                    vmid: vmid.get(),
                    archive: archive.to_string(),
                })
            );
        }
    }
    // The sandbox gets the source VM's hardware: its CPU, firmware, disk buses and NIC models.
    // Passthrough and whatever reaches outside the sandbox are left out and reported.
    let source = step!(
        "read source config",
        |r: &pb::ReadSourceConfigReply| {
            let omitted = r.hardware.as_ref().map_or(0, |h| h.omitted.len());
            format!("config sha256 {}; {omitted} parts omitted", r.config_sha256)
        },
        client.read_source_config(pb::ReadSourceConfigRequest {
            snapshot: snapshot.clone(),
            pbs_secret: context.secrets.pbs_secret.to_string(),
            encryption_key: context
                .secrets
                .encryption_key
                .as_ref()
                .map(|k| k.to_vec())
                .unwrap_or_default(),
        })
    );
    evidence.hardware = source.hardware.as_ref().map(|h| {
        let archives: Vec<String> = grant.archives.iter().map(ToString::to_string).collect();
        report::SandboxHardware::from_wire(h, &source.config_sha256, &archives)
    });
    for (vmid, limits) in &grant.sandbox_vms {
        let name = format!("create {vmid}");
        step!(
            name.as_str(),
            |r: &pb::CreateVmReply| format!("smbios uuid {}", r.smbios_uuid),
            client.create_vm(pb::CreateVmRequest {
                vmid: vmid.get(),
                cores: limits.max_cores,
                memory_mib: limits.max_memory_mib,
                archives: grant.archives.iter().map(ToString::to_string).collect(),
                mirror_source_hardware: true,
            })
        );
    }
    // A guest whose own configuration names a production network gets a sandbox profile in
    // its overlay before its first start (docs/guest-network.md); `preserve` leaves it as is.
    if validation.network_recovery == crate::plan::NetworkRecoveryMode::Rewrite {
        // The guest's root filesystem is on a disk, not on its EFI vars or TPM state.
        let boot = grant
            .archives
            .iter()
            .find(|a| !a.as_str().contains("efidisk") && !a.as_str().contains("tpmstate"));
        if let Some(boot) = boot {
            for vmid in grant.sandbox_vms.keys() {
                let name = format!("recover network {vmid}");
                step!(
                    name.as_str(),
                    |r: &pb::RecoverGuestNetworkReply| guest_network_detail(r),
                    client.recover_guest_network(pb::RecoverGuestNetworkRequest {
                        vmid: vmid.get(),
                        archive: boot.to_string(),
                        mode: pb::NetworkRecoveryMode::Rewrite.into(),
                    })
                );
            }
        }
    }
    let sandbox = step!(
        "prepare sandbox",
        |r: &pb::PrepareSandboxReply| format!(
            "ports [{}] forwarding [{}]",
            r.bridge_ports.join(", "),
            r.forwarding_sysctl.replace('\n', ", ")
        ),
        client.prepare_sandbox(pb::PrepareSandboxRequest {
            vnet: grant.vnet.to_string(),
            probe_source: grant.probe_source.to_string(),
        })
    );
    let observed = isolation(&sandbox);
    let proven = check_isolation(&observed, grant);
    evidence.isolation = Some(observed);
    if let Err(reason) = proven {
        // The controller does not sign a restore whose containment it cannot show.
        return Some(Stop::Refused(format!(
            "isolation not proven by the node's evidence: {reason}"
        )));
    }
    for vmid in grant.sandbox_vms.keys() {
        let name = format!("start {vmid}");
        step!(
            name.as_str(),
            |_: &pb::VmReply| String::new(),
            client.start_vm(pb::VmRequest { vmid: vmid.get() })
        );
    }

    // Guest agent: bounded wait, then facts. A guest without an agent is reported, not failed:
    // probes still decide.
    for vmid in grant.sandbox_vms.keys() {
        let name = format!("guest agent {vmid}");
        let at = recorder.begin(&name);
        let wait = Duration::from_secs(u64::from(validation.guest_agent_seconds));
        let until = (Instant::now() + wait).min(deadline);
        let mut answered = false;
        let mut last = String::new();
        while Instant::now() < until {
            if *interrupts.borrow() >= 1 {
                recorder.end(&name, at, StepResult::Failed, "interrupted".into());
                return Some(Stop::Interrupted(format!(
                    "interrupted by the operator while waiting for the guest agent of {vmid}"
                )));
            }
            match guarded(
                &mut interrupts,
                until,
                client.qga(pb::QgaRequest {
                    vmid: vmid.get(),
                    call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping.into())),
                }),
            )
            .await
            {
                Ok(_) => {
                    answered = true;
                    break;
                }
                Err(Stop::Refused(text)) => last = text,
                Err(Stop::Deadline(_)) => break,
                Err(stop) => {
                    recorder.end(&name, at, StepResult::Failed, format!("{stop:?}"));
                    return Some(stop);
                }
            }
            let pause = tokio::time::sleep(AGENT_POLL);
            let mut abandon = interrupts.clone();
            tokio::select! {
                () = pause => {}
                _ = abandon.changed() => {}
            }
        }
        let detail = if answered {
            "answered".to_owned()
        } else {
            format!(
                "no answer within {} s ({last})",
                validation.guest_agent_seconds
            )
        };
        recorder.end(
            &name,
            at,
            if answered {
                StepResult::Ok
            } else {
                StepResult::Failed
            },
            detail,
        );
        evidence.agent_answered |= answered;
        let status = step!(
            format!("qmp status {vmid}").as_str(),
            |r: &pb::QmpReply| r.result_json.clone(),
            client.qmp(pb::QmpRequest {
                vmid: vmid.get(),
                command: pb::QmpCommand::QueryStatus.into(),
            })
        );
        let status = serde_json::from_str::<serde_json::Value>(&status.result_json)
            .ok()
            .and_then(|v| v.get("status").and_then(|s| s.as_str()).map(str::to_owned))
            .unwrap_or_else(|| "unknown".into());
        match guest_state(&status) {
            GuestState::Running => {}
            // The guest itself stopped on an error or shut down: evidence about the backup.
            GuestState::Stopped => evidence.failures.push(format!(
                "VM {vmid} is {status:?} after start: the restored guest stopped"
            )),
            // Paused, still launching, migrating: the node's state, not the backup's.
            GuestState::NotJudged => {
                return Some(Stop::Refused(format!(
                    "VM {vmid} is {status:?} after start: the node holds it, so the guest cannot be judged"
                )));
            }
        }
        let mut facts = report::GuestFacts {
            status,
            os_info: serde_json::Value::Null,
            interfaces: serde_json::Value::Null,
        };
        if answered {
            for (command, label, slot) in [
                (pb::QgaCommand::GetOsinfo, "guest-get-osinfo", 0),
                (
                    pb::QgaCommand::NetworkGetInterfaces,
                    "guest-network-get-interfaces",
                    1,
                ),
            ] {
                let name = format!("qga {label} {vmid}");
                let at = recorder.begin(&name);
                match guarded(
                    &mut interrupts,
                    deadline,
                    client.qga(pb::QgaRequest {
                        vmid: vmid.get(),
                        call: Some(pb::qga_request::Call::Command(command.into())),
                    }),
                )
                .await
                {
                    Ok(reply) => {
                        let value = serde_json::from_str(&reply.result_json)
                            .unwrap_or(serde_json::Value::String(reply.result_json));
                        if slot == 0 {
                            facts.os_info = value;
                        } else {
                            facts.interfaces = value;
                        }
                        recorder.end(&name, at, StepResult::Ok, String::new());
                    }
                    Err(Stop::Refused(text)) => {
                        recorder.end(&name, at, StepResult::Failed, text);
                    }
                    Err(stop) => {
                        recorder.end(&name, at, StepResult::Failed, format!("{stop:?}"));
                        return Some(stop);
                    }
                }
            }
        }
        if evidence.guest.is_none() {
            evidence.guest = Some(facts);
        }
    }

    // Probes, from the probe address on the VNet.
    for target in &validation.wire.probe_targets {
        let kind = pb::ProbeKind::try_from(target.kind).unwrap_or(pb::ProbeKind::Unspecified);
        let label = probe_label(kind, &target.address, target.port);
        let name = format!("probe {label}");
        let reply = step!(
            name.as_str(),
            |r: &pb::ProbeReply| r.detail.clone(),
            client.probe(pb::ProbeRequest {
                kind: target.kind,
                address: target.address.clone(),
                port: target.port,
            })
        );
        let passed = reply.outcome == i32::from(pb::ProbeOutcome::Passed);
        let expected_origin = format!("worker_host {}", grant.probe_source.address);
        if reply.origin != expected_origin {
            evidence.isolation_failures.push(format!(
                "probe {label} ran from {:?}, not from the probe address ({expected_origin})",
                reply.origin
            ));
        }
        if !passed {
            evidence
                .failures
                .push(format!("probe {label} failed: {}", reply.detail));
        }
        evidence.probes.push(report::ProbeResult {
            target: label,
            expected: target
                .expect
                .as_ref()
                .map(expectation_text)
                .unwrap_or_default(),
            outcome: pb::ProbeOutcome::try_from(reply.outcome)
                .map(|o| {
                    o.as_str_name()
                        .trim_start_matches("PROBE_OUTCOME_")
                        .to_owned()
                })
                .unwrap_or_else(|_| reply.outcome.to_string()),
            origin: reply.origin.clone(),
            passed,
            latency_us: reply.latency_us,
            detail: reply.detail.clone(),
            received_sha256: reply.received_sha256.clone(),
            tls_certificate_sha256: reply.tls_certificate_sha256.clone(),
        });
    }
    // QGA assertions, on the first sandbox VM (the grant names programs, not VMs).
    if let Some(vmid) = grant.sandbox_vms.keys().next() {
        for id in grant.qga_assertions.keys() {
            let name = format!("assertion {id}");
            let reply = step!(
                name.as_str(),
                |r: &pb::QgaReply| format!("exit {}", r.exit_code),
                client.qga(pb::QgaRequest {
                    vmid: vmid.get(),
                    call: Some(pb::qga_request::Call::AssertionId(id.to_string())),
                })
            );
            if !reply.assertion_passed {
                evidence.failures.push(format!(
                    "assertion {id} failed (exit code {})",
                    reply.exit_code
                ));
            }
            evidence.assertions.push(report::AssertionResult {
                name: id.to_string(),
                exit_code: reply.exit_code,
                passed: reply.assertion_passed,
                detail: reply.result_json.clone(),
            });
        }
    }
    evidence.checks_complete = true;
    // A picture of the guest's console at verdict time, for the person reading the report.
    if let Some(vmid) = grant.sandbox_vms.keys().next() {
        let name = format!("screenshot {vmid}");
        let at = recorder.begin(&name);
        match guarded(
            &mut interrupts,
            deadline,
            client.qmp(pb::QmpRequest {
                vmid: vmid.get(),
                command: pb::QmpCommand::Screendump.into(),
            }),
        )
        .await
        {
            Ok(reply) => match screenshot::screenshot_png(&reply) {
                Ok(shot) => {
                    recorder.end(
                        &name,
                        at,
                        StepResult::Ok,
                        format!(
                            "{}x{} PNG, {} bytes",
                            shot.width,
                            shot.height,
                            shot.png.len()
                        ),
                    );
                    evidence.screenshot = Some(shot);
                }
                Err(error) => recorder.end(&name, at, StepResult::Failed, error.to_string()),
            },
            Err(Stop::Refused(text)) => recorder.end(&name, at, StepResult::Failed, text),
            Err(stop) => {
                recorder.end(&name, at, StepResult::Failed, format!("{stop:?}"));
                return Some(stop);
            }
        }
    }
    if !evidence.agent_answered && grant.probe_targets.is_empty() {
        evidence.failures.push(format!(
            "the guest agent did not answer within {} s and no probe was planned: nothing shows the guest booted",
            validation.guest_agent_seconds
        ));
    }

    // Teardown of the happy path, newest first; anything it leaves, Cleanup finds.
    for vmid in grant.sandbox_vms.keys() {
        step!(
            format!("stop {vmid}").as_str(),
            |_: &pb::VmReply| String::new(),
            client.stop_vm(pb::StopVmRequest {
                vmid: vmid.get(),
                timeout_seconds: STOP_TIMEOUT_SECONDS,
            })
        );
        step!(
            format!("destroy {vmid}").as_str(),
            |_: &pb::VmReply| String::new(),
            client.destroy_vm(pb::VmRequest { vmid: vmid.get() })
        );
    }
    step!(
        "release sandbox",
        |_: &pb::ReleaseSandboxReply| String::new(),
        client.release_sandbox(pb::ReleaseSandboxRequest {
            vnet: grant.vnet.to_string(),
        })
    );
    for vmid in grant.sandbox_vms.keys() {
        for archive in &grant.archives {
            step!(
                format!("delete overlay {vmid} {archive}").as_str(),
                |_: &pb::DeleteOverlayReply| String::new(),
                client.delete_overlay(pb::DeleteOverlayRequest {
                    vmid: vmid.get(),
                    archive: archive.to_string(),
                })
            );
        }
    }
    for archive in &grant.archives {
        step!(
            format!("unmap {archive}").as_str(),
            |_: &pb::UnmapBackupReply| String::new(),
            client.unmap_backup(pb::UnmapBackupRequest {
                archive: archive.to_string(),
            })
        );
    }
    None
}

/// What QMP's run state says about a restored guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GuestState {
    Running,
    /// The guest stopped on its own: `io-error`, `internal-error`, `guest-panicked`, `shutdown`,
    /// `watchdog`, `suspended`.
    Stopped,
    /// The node holds it (`paused`, `prelaunch`, migration states) or the state is unknown.
    NotJudged,
}

fn guest_state(status: &str) -> GuestState {
    match status {
        "running" => GuestState::Running,
        "io-error" | "internal-error" | "guest-panicked" | "shutdown" | "watchdog"
        | "suspended" => GuestState::Stopped,
        _ => GuestState::NotJudged,
    }
}

/// `tcp://192.0.2.10:22`, `https://[2001:db8::10]:443`.
fn probe_label(kind: pb::ProbeKind, address: &str, port: u32) -> String {
    let scheme = kind
        .as_str_name()
        .trim_start_matches("PROBE_KIND_")
        .to_ascii_lowercase();
    if address.contains(':') {
        format!("{scheme}://[{address}]:{port}")
    } else {
        format!("{scheme}://{address}:{port}")
    }
}

/// What a probe expected, as the plan said it: its non-empty fields.
fn expectation_text(expect: &pb::ProbeExpectation) -> String {
    let mut parts = Vec::new();
    let mut text = |key: &str, value: &str| {
        if !value.is_empty() {
            parts.push(format!("{key} {value:?}"));
        }
    };
    text("banner_prefix", &expect.banner_prefix);
    text("http_path", &expect.http_path);
    text("body_contains", &expect.body_contains);
    text("body_sha256", &expect.body_sha256);
    text("dns_name", &expect.dns_name);
    text("ldap_naming_context", &expect.ldap_naming_context);
    if expect.http_status != 0 {
        parts.push(format!("http_status {}", expect.http_status));
    }
    if let Ok(kind) = pb::DnsRecordType::try_from(expect.dns_type)
        && kind != pb::DnsRecordType::Unspecified
    {
        parts.push(format!(
            "dns_type {}",
            kind.as_str_name().trim_start_matches("DNS_RECORD_TYPE_")
        ));
    }
    if !expect.dns_answers.is_empty() {
        parts.push(format!("dns_answers {:?}", expect.dns_answers));
    }
    if parts.is_empty() {
        "connects".to_owned()
    } else {
        parts.join(", ")
    }
}

/// Checks the node's isolation evidence against the grant: only taps of the run's sandbox VMs
/// on the bridge, only the probe address (and the bridge's IPv6 link-local address) on it,
/// every forwarding sysctl reported and 0.
fn check_isolation(
    isolation: &report::Isolation,
    grant: &certistack_core::grant::Grant,
) -> Result<(), String> {
    for port in &isolation.bridge_ports {
        let vmid = port
            .strip_prefix("tap")
            .and_then(|rest| rest.split_once('i'))
            .filter(|(_, nic)| !nic.is_empty() && nic.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|(vmid, _)| vmid.parse::<u32>().ok());
        if !vmid.is_some_and(|vmid| grant.sandbox_vms.keys().any(|v| v.get() == vmid)) {
            return Err(format!(
                "bridge port {port:?} is not a tap of this run's sandbox VMs"
            ));
        }
    }
    for address in &isolation.bridge_addresses {
        let ip = address
            .split_once('/')
            .map_or(address.as_str(), |(ip, _)| ip)
            .parse::<std::net::IpAddr>()
            .map_err(|_| format!("bridge address {address:?} is not an address"))?;
        let link_local =
            matches!(ip, std::net::IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
        if ip != grant.probe_source.address.0 && !link_local {
            return Err(format!(
                "bridge address {address} is not the probe address {}",
                grant.probe_source
            ));
        }
    }
    if isolation.forwarding.is_empty() {
        return Err("the node reported no forwarding sysctl".into());
    }
    // A value may carry the node's note after it, e.g. `0 (was 1; set to 0 for this run ...)`.
    for (name, value) in &isolation.forwarding {
        if value.split_whitespace().next() != Some("0") {
            return Err(format!("{name} is {value}, not 0"));
        }
    }
    Ok(())
}

fn isolation(reply: &pb::PrepareSandboxReply) -> report::Isolation {
    let forwarding = reply
        .forwarding_sysctl
        .lines()
        .filter_map(|line| {
            let (key, value) = line.split_once('=')?;
            Some((key.trim().to_owned(), value.trim().to_owned()))
        })
        .collect();
    report::Isolation {
        bridge_ports: reply.bridge_ports.clone(),
        bridge_addresses: reply.bridge_addresses.clone(),
        forwarding,
        ruleset: reply.ruleset_text.clone(),
        ruleset_digest: report::sha256_text(reply.ruleset_text.as_bytes()),
        nat_sources: reply.nat_sources.clone(),
    }
}

/// Ends a validation whatever happened: cleanup (reconnecting when the connection was lost),
/// EndRun, the journal read back and verified, the report signed and written.
async fn finish(
    mut recorder: Recorder<'_>,
    evidence: Evidence,
    validation: &Validation,
    stop: Option<Stop>,
    session: Option<Session>,
) -> Summary {
    let context = recorder.context;
    let mut reasons: Vec<String> = Vec::new();
    let mut outcome = Outcome::Passed;
    match &stop {
        None => {}
        // Interrupted during teardown: every check had run; the verdict stands on them and
        // cleanup still decides whether the run is proven clean.
        Some(Stop::Interrupted(_)) if evidence.checks_complete => {}
        Some(stop) => {
            outcome = Outcome::Error;
            reasons.push(stop.reason().to_owned());
        }
    }
    if !evidence.isolation_failures.is_empty() {
        outcome = Outcome::Error;
        reasons.extend(evidence.isolation_failures.iter().cloned());
    }
    if !evidence.failures.is_empty() {
        if outcome == Outcome::Passed {
            outcome = Outcome::Failed;
        }
        reasons.extend(evidence.failures.iter().cloned());
    }

    let cleaned = match session {
        None => CleanedUp {
            state: CleanupState::NotNeeded,
            evidence: report::CleanupEvidence {
                receipts: Vec::new(),
                residue: Vec::new(),
                complete: true,
            },
            journal: empty_journal(&recorder.run_id),
            journal_problem: None,
            closed_by_reaper: false,
        },
        Some(session) => {
            let lost = matches!(stop, Some(Stop::Lost(_)));
            clean_up(&mut recorder, session, lost).await
        }
    };
    let cleanup_state = cleaned.state;
    let (cleanup, journal) = (cleaned.evidence, cleaned.journal);
    if cleanup_state == CleanupState::Unproven {
        reasons.push(format!(
            "cleanup could not be proven complete; run `certistack-ctl cleanup {} {}`, then `certistack-ctl runs {}`",
            recorder.node, recorder.run_id, recorder.node
        ));
        if outcome == Outcome::Passed {
            outcome = Outcome::Error;
        }
    }
    if cleaned.closed_by_reaper {
        reasons.push(
            "cleaned up as an operator after the deadline; the node's reaper closes the run".into(),
        );
    }
    let journal_problem = cleaned
        .journal_problem
        .or_else(|| heads_in_journal(&evidence.heads, &journal.records).err());
    if let Some(problem) = journal_problem {
        // The report would vouch for a journal the controller did not verify.
        reasons.push(problem);
        outcome = Outcome::Error;
    }

    // The picture is saved before the report is signed, so a failure to save it is a step of
    // the signed report too.
    let at = OffsetDateTime::now_utc();
    let saved_screenshot = match &evidence.screenshot {
        None => None,
        Some(shot) => {
            let started = recorder.begin("save screenshot");
            match save_screenshot(context, shot, at, &recorder.node, &recorder.run_id) {
                Ok(saved) => {
                    recorder.end(
                        "save screenshot",
                        started,
                        StepResult::Ok,
                        saved.file.clone(),
                    );
                    Some(saved)
                }
                Err(error) => {
                    recorder.end(
                        "save screenshot",
                        started,
                        StepResult::Failed,
                        error.clone(),
                    );
                    reasons.push(format!("the screenshot could not be saved: {error}"));
                    None
                }
            }
        }
    };
    let verdict = match outcome {
        Outcome::Passed => Verdict::Passed,
        Outcome::Failed => Verdict::Failed {
            reasons: reasons.clone(),
        },
        Outcome::Error => Verdict::Error {
            reasons: reasons.clone(),
        },
    };
    let grant = &validation.grant;
    let predicate = report::Validation {
        run_id: recorder.run_id.clone(),
        name: validation.name.clone(),
        plan_digest: context.plan_digest.clone(),
        node: recorder.node.clone(),
        connector: evidence.connector.clone(),
        controller_version: env!("CARGO_PKG_VERSION").to_owned(),
        snapshot: report::Snapshot {
            server: grant.repository.server.to_string(),
            port: grant.repository.port,
            datastore: grant.repository.datastore.to_string(),
            namespace: grant.repository.namespace.to_string(),
            snapshot: grant.snapshot.to_string(),
            archives: grant
                .archives
                .iter()
                .map(|a| report::Archive {
                    name: a.to_string(),
                    sha256: None,
                })
                .collect(),
        },
        steps: std::mem::take(&mut recorder.steps),
        guest: evidence.guest.clone().unwrap_or(report::GuestFacts {
            status: "not started".into(),
            os_info: serde_json::Value::Null,
            interfaces: serde_json::Value::Null,
        }),
        probes: evidence.probes.clone(),
        isolation: evidence
            .isolation
            .clone()
            .unwrap_or_else(|| report::Isolation {
                bridge_ports: Vec::new(),
                bridge_addresses: Vec::new(),
                forwarding: BTreeMap::new(),
                ruleset: String::new(),
                ruleset_digest: report::sha256_text(b""),
                nat_sources: Vec::new(),
            }),
        assertions: evidence.assertions.clone(),
        cleanup,
        journal,
        verdict,
        screenshot: saved_screenshot,
        hardware: evidence.hardware.clone(),
    };
    let statement = report::Statement::new(predicate);
    let report_path = match report::write(
        &context.reports_dir,
        &statement,
        context.authority.report_signing(),
        at,
    ) {
        Ok(path) => Some(path),
        Err(error) => {
            reasons.push(format!("the report could not be written: {error}"));
            outcome = Outcome::Error;
            None
        }
    };
    let summary = Summary {
        validation: recorder.validation.clone(),
        node: recorder.node.clone(),
        run_id: recorder.run_id.clone(),
        outcome,
        cleanup: cleanup_state,
        reasons,
        elapsed_ms: elapsed_ms(recorder.started),
        report: report_path,
    };
    context.progress.finish(
        &summary.validation,
        format!(
            "{} on {}: {:?}, cleanup {:?}",
            summary.validation, summary.node, summary.outcome, summary.cleanup
        ),
    );
    summary
}

/// How a call outside the steps ended without an answer.
#[derive(Debug)]
enum CallError {
    /// The connection is gone (reconnecting may help).
    Lost(String),
    /// The node answered with a refusal.
    Refused(String),
    /// No answer within the time allowed.
    TimedOut(String),
    /// The operator's interrupts reached the level that abandons this wait.
    Abandoned,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Lost(text) | CallError::Refused(text) | CallError::TimedOut(text) => {
                f.write_str(text)
            }
            CallError::Abandoned => f.write_str("abandoned by the operator"),
        }
    }
}

/// The interrupt level that abandons waits in cleanup: the third Ctrl-C. (The second abandons
/// only reconnecting to a node that is gone: cleanup needs the node.)
const ABANDON_CLEANUP: u8 = 3;
/// How long an operator call (Cleanup after the deadline, the journal) may take.
const OPERATOR_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long BeginRun and EndRun may take: the node answers them without running a tool.
const RUN_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The most of a run's journal the controller puts into a report: the report must stay under
/// `report::MAX_REPORT_BYTES`; a node's default caps (10,000 records, 16 MiB) are below.
const RUN_JOURNAL_BOUNDS: operator::JournalBounds = operator::JournalBounds {
    records: 100_000,
    bytes: 32 * 1024 * 1024,
};

/// Awaits `call` for at most `limit`, unless the interrupts reach `abandon_at` first.
async fn within<T, E: std::fmt::Display>(
    interrupts: &mut Interrupts,
    abandon_at: u8,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, E>>,
    lost: impl Fn(&E) -> bool,
) -> Result<T, CallError> {
    if *interrupts.borrow() >= abandon_at {
        return Err(CallError::Abandoned);
    }
    let abandon = interrupted_to(interrupts, abandon_at);
    tokio::select! {
        result = tokio::time::timeout(limit, call) => match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) if lost(&error) => Err(CallError::Lost(error.to_string())),
            Ok(Err(error)) => Err(CallError::Refused(error.to_string())),
            Err(_) => Err(CallError::TimedOut(format!("no answer within {} s", limit.as_secs()))),
        },
        () = abandon => Err(CallError::Abandoned),
    }
}

fn node_error_lost(error: &NodeError) -> bool {
    match error {
        NodeError::Status { code, .. } => matches!(
            code,
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
        ),
        NodeError::Connect(_) => true,
        _ => false,
    }
}

/// Sleeps `pause` (or until the deadline, or until the interrupts change).
async fn pause_before_retry(interrupts: &mut Interrupts, pause: Duration, deadline: Instant) {
    let wait = tokio::time::sleep_until((Instant::now() + pause).min(deadline).into());
    tokio::select! {
        () = wait => {}
        _ = interrupts.changed() => {}
    }
}

/// What cleanup proved, for the summary and the report.
struct CleanedUp {
    state: CleanupState,
    evidence: report::CleanupEvidence,
    journal: report::JournalEvidence,
    /// Why the report's journal is not the verified record of the run, when it is not.
    journal_problem: Option<String>,
    /// Cleanup was asked as an operator after the deadline: the node's reaper closes the run.
    closed_by_reaper: bool,
}

/// Checks that the journal heads the node answered step by step are records of the journal it
/// streamed at the end, in order: a node that kept one journal for its answers and streams
/// another is caught here.
fn heads_in_journal(
    heads: &[(String, String)],
    records: &[report::JournalRecord],
) -> Result<(), String> {
    let mut from = 0usize;
    for (step, head) in heads {
        let found = records
            .iter()
            .enumerate()
            .skip(from)
            .find(|(_, record)| record.record_sha256 == *head);
        match found {
            Some((index, _)) => from = index,
            None => {
                return Err(format!(
                    "the node's journal does not hold, in order, the head {head} it answered at step {step}"
                ));
            }
        }
    }
    Ok(())
}

/// Writes the console picture beside the report it belongs to (the report's name with `.png`),
/// atomically and 0600, and returns what the report signs of it.
fn save_screenshot(
    context: &RunContext,
    shot: &screenshot::Screenshot,
    at: OffsetDateTime,
    node: &str,
    run_id: &str,
) -> Result<report::Screenshot, String> {
    let name = report::file_name(at, node, run_id).map_err(|e| e.to_string())?;
    let file = format!("{}.png", name.trim_end_matches(".json"));
    files::create_private_dir(&context.reports_dir).map_err(|e| e.to_string())?;
    files::write_atomic(&context.reports_dir.join(&file), &shot.png, 0o600)
        .map_err(|e| e.to_string())?;
    Ok(report::Screenshot {
        file,
        sha256: shot.sha256.clone(),
    })
}

/// Cleanup, EndRun and the journal. Reconnects (until the run's deadline) when the connection
/// was lost; past the deadline the run's certificate is void, so Cleanup is asked as an
/// operator. The journal is read as an operator, so the closed run's last record is included.
/// Every wait is bounded; the third interrupt abandons them (cleanup is then unproven).
async fn clean_up(recorder: &mut Recorder<'_>, mut session: Session, mut lost: bool) -> CleanedUp {
    let context = recorder.context;
    let run_id = recorder.run_id.clone();
    let mut interrupts = context.interrupts.clone();
    let mut evidence = report::CleanupEvidence {
        receipts: Vec::new(),
        residue: Vec::new(),
        complete: false,
    };
    let at = recorder.begin("cleanup");
    let mut reply = None;
    let mut as_run = true;
    let mut abandoned = false;
    let mut last_error = String::new();
    let mut pause = Duration::from_millis(500);
    // As the run, while its certificate is valid; reconnecting when the node went away (it may
    // be restarting: its journal keeps the run open).
    while reply.is_none() && Instant::now() < session.deadline {
        let level = *interrupts.borrow_and_update();
        if level >= ABANDON_CLEANUP || (level >= 2 && lost) {
            last_error = format!("the operator stopped waiting for the node ({last_error})");
            abandoned = true;
            break;
        }
        if lost || session.client.is_none() {
            match within(
                &mut interrupts,
                2,
                CONNECT_TIMEOUT * 3,
                session.reconnect(),
                node_error_lost,
            )
            .await
            {
                Ok(()) => lost = false,
                Err(error) => {
                    last_error = error.to_string();
                    recorder.event("cleanup", "started", &format!("reconnecting: {error}"));
                    pause_before_retry(&mut interrupts, pause, session.deadline).await;
                    pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
                    continue;
                }
            }
        }
        let Some(client) = session.client.as_mut() else {
            break;
        };
        let remaining = session.deadline.saturating_duration_since(Instant::now());
        match within(
            &mut interrupts,
            ABANDON_CLEANUP,
            remaining,
            client.cleanup(pb::CleanupRequest {
                run_id: run_id.clone(),
            }),
            connection_lost,
        )
        .await
        {
            Ok(answer) => reply = Some(answer.into_inner()),
            Err(CallError::Lost(text)) => {
                last_error = text;
                lost = true;
                // A node that drops every Cleanup is not hammered: the pause grows each time.
                pause_before_retry(&mut interrupts, pause, session.deadline).await;
                pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
            }
            Err(CallError::Abandoned) => {
                last_error = "the operator abandoned the cleanup".into();
                abandoned = true;
                break;
            }
            Err(error) => {
                last_error = error.to_string();
                break;
            }
        }
    }
    // Past the deadline: as an operator, once.
    if reply.is_none() && !abandoned && Instant::now() >= session.deadline {
        as_run = false;
        match operator_cleanup(context, &session, &run_id, &mut interrupts).await {
            Ok(answer) => reply = Some(answer),
            Err(error) => last_error = error,
        }
    }
    let mut state = CleanupState::Unproven;
    let mut ended = false;
    match reply {
        None => recorder.end("cleanup", at, StepResult::Failed, last_error),
        Some(reply) => {
            evidence.receipts = reply
                .resources
                .iter()
                .map(|r| report::Receipt {
                    resource: r.resource.clone(),
                    end_state: r.end_state.clone(),
                })
                .collect();
            evidence.residue = reply.residue.clone();
            match operator::cleanup_complete(&reply) {
                Err(reason) => recorder.end("cleanup", at, StepResult::Failed, reason),
                Ok(()) => {
                    recorder.end(
                        "cleanup",
                        at,
                        StepResult::Ok,
                        format!("{} receipts, no residue", reply.resources.len()),
                    );
                    if as_run {
                        let at = recorder.begin("end");
                        let answer = match session.client.as_mut() {
                            Some(client) => within(
                                &mut interrupts,
                                ABANDON_CLEANUP,
                                RUN_CALL_TIMEOUT,
                                client.end_run(pb::EndRunRequest {}),
                                connection_lost,
                            )
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string()),
                            None => Err("no connection".to_owned()),
                        };
                        match answer {
                            Ok(()) => {
                                evidence.complete = true;
                                state = CleanupState::Complete;
                                ended = true;
                                recorder.end("end", at, StepResult::Ok, String::new());
                            }
                            Err(reason) => recorder.end("end", at, StepResult::Failed, reason),
                        }
                    } else {
                        evidence.complete = true;
                        state = CleanupState::Complete;
                    }
                }
            }
        }
    }

    let at = recorder.begin("journal");
    let read = read_journal(context, &session, &run_id, &mut interrupts).await;
    let checked = read.and_then(|journal| {
        // An empty journal "verifies" to the genesis: a run that began has records, and one
        // that ended has `run.end` last.
        match journal.records.last() {
            None => Err("the node returned no journal record for a run it began".to_owned()),
            Some(last) if ended && last.operation != "run.end" => Err(format!(
                "the run was ended but its journal's last record is {} {}",
                last.operation, last.phase
            )),
            Some(_) => Ok(journal),
        }
    });
    let (journal, journal_problem) = match checked {
        Ok(journal) => {
            recorder.end(
                "journal",
                at,
                StepResult::Ok,
                format!(
                    "{} records verified here, head {}",
                    journal.records.len(),
                    journal.head_sha256
                ),
            );
            (journal, None)
        }
        Err(reason) => {
            recorder.end("journal", at, StepResult::Failed, reason.clone());
            (empty_journal(&run_id), Some(reason))
        }
    };
    CleanedUp {
        state,
        evidence,
        journal,
        journal_problem,
        closed_by_reaper: state == CleanupState::Complete && !as_run,
    }
}

async fn operator_cleanup(
    context: &RunContext,
    session: &Session,
    run_id: &str,
    interrupts: &mut Interrupts,
) -> Result<pb::CleanupReply, String> {
    let work = async {
        let mut connection = operator::connect(
            &context.authority,
            &session.endpoint,
            &session.node,
            OPERATOR_NAME,
            OffsetDateTime::now_utc(),
        )
        .await?;
        operator::cleanup(&mut connection, run_id).await
    };
    within(
        interrupts,
        ABANDON_CLEANUP,
        OPERATOR_CALL_TIMEOUT,
        work,
        |_| false,
    )
    .await
    .map_err(|e| format!("Cleanup as an operator after the deadline: {e}"))
}

fn empty_journal(run_id: &str) -> report::JournalEvidence {
    report::JournalEvidence {
        head_sha256: hex::encode(certistack_core::journal::genesis(run_id)),
        records: Vec::new(),
    }
}

/// Streams the run's journal as an operator, bounded in records, bytes and time, and
/// recomputes its hash chain here.
async fn read_journal(
    context: &RunContext,
    session: &Session,
    run_id: &str,
    interrupts: &mut Interrupts,
) -> Result<report::JournalEvidence, String> {
    let work = async {
        let mut connection = operator::connect(
            &context.authority,
            &session.endpoint,
            &session.node,
            OPERATOR_NAME,
            OffsetDateTime::now_utc(),
        )
        .await?;
        operator::read_journal_within(&mut connection, run_id, RUN_JOURNAL_BOUNDS, |_| {}).await
    };
    let records = within(
        interrupts,
        ABANDON_CLEANUP,
        OPERATOR_CALL_TIMEOUT,
        work,
        |_| false,
    )
    .await
    .map_err(|e| format!("the journal could not be read: {e}"))?;
    let head = operator::verify_journal(run_id, &records)
        .map_err(|e| format!("the node's journal does not verify here: {e}"))?;
    Ok(report::JournalEvidence {
        head_sha256: head,
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(outcome: Outcome, cleanup: CleanupState) -> Summary {
        Summary {
            validation: "web01".into(),
            node: "pve1".into(),
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            outcome,
            cleanup,
            reasons: Vec::new(),
            elapsed_ms: 61_500,
            report: Some(PathBuf::from("/var/lib/certistack/reports/r.json")),
        }
    }

    #[test]
    fn the_exit_code_puts_infrastructure_before_a_failed_backup() {
        use CleanupState::{Complete, NotNeeded, Unproven};
        assert_eq!(exit_code(&[summary(Outcome::Passed, Complete)]), 0);
        assert_eq!(
            exit_code(&[
                summary(Outcome::Passed, Complete),
                summary(Outcome::Failed, Complete)
            ]),
            1
        );
        assert_eq!(
            exit_code(&[
                summary(Outcome::Failed, Complete),
                summary(Outcome::Error, NotNeeded)
            ]),
            2
        );
        // A passed backup whose cleanup is unproven still needs an operator.
        assert_eq!(exit_code(&[summary(Outcome::Passed, Unproven)]), 2);
    }

    #[test]
    fn the_summary_table_has_a_row_per_validation_with_its_reason_or_report() {
        let mut failed = summary(Outcome::Failed, CleanupState::Complete);
        failed.validation = "db01".into();
        failed.reasons = vec![
            "probe tcp://10.99.0.10:5432 failed: connection refused".into(),
            "assertion pg-ready failed (exit code 2)".into(),
        ];
        let table = summary_table(&[summary(Outcome::Passed, CleanupState::Complete), failed]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("VALIDATION"), "{table}");
        assert!(
            lines[1].contains("web01")
                && lines[1].contains("passed")
                && lines[1].contains("complete")
                && lines[1].contains("61.5s")
                && lines[1].ends_with("/var/lib/certistack/reports/r.json"),
            "{table}"
        );
        assert!(
            lines[2].contains("FAILED") && lines[2].ends_with("connection refused"),
            "{table}"
        );
        assert!(
            lines[3].trim_start() == "assertion pg-ready failed (exit code 2)",
            "{table}"
        );
        assert!(
            lines[4].trim_start().starts_with("report /var/lib"),
            "{table}"
        );
    }

    #[test]
    fn a_probe_is_labelled_by_its_scheme_with_ipv6_in_brackets() {
        assert_eq!(
            probe_label(pb::ProbeKind::Https, "2001:db8::10", 443),
            "https://[2001:db8::10]:443"
        );
        assert_eq!(
            probe_label(pb::ProbeKind::Tcp, "10.99.0.10", 22),
            "tcp://10.99.0.10:22"
        );
        let expect = pb::ProbeExpectation {
            http_path: "/health".into(),
            http_status: 200,
            ..Default::default()
        };
        assert_eq!(
            expectation_text(&expect),
            "http_path \"/health\", http_status 200"
        );
        assert_eq!(
            expectation_text(&pb::ProbeExpectation::default()),
            "connects"
        );
    }

    #[test]
    fn a_probe_address_the_node_removed_is_not_a_lost_connection() {
        assert!(connection_lost(&tonic::Status::unavailable(
            "error trying to connect: tcp connect error"
        )));
        assert!(!connection_lost(&tonic::Status::unavailable(
            "probe address removed by the node (ifreload?): 10.99.0.1/24 is no longer on csnet1"
        )));
    }

    #[test]
    fn only_a_refusal_means_begin_run_left_nothing_to_clean() {
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::PermissionDenied,
            tonic::Code::FailedPrecondition,
            tonic::Code::ResourceExhausted,
        ] {
            assert!(definitely_not_begun(&tonic::Status::new(code, "refused")));
        }
        // A reset stream, an internal error or a timeout may have left the run open.
        for code in [
            tonic::Code::Internal,
            tonic::Code::Unavailable,
            tonic::Code::Unknown,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Cancelled,
        ] {
            assert!(!definitely_not_begun(&tonic::Status::new(code, "lost")));
        }
    }

    fn grant() -> certistack_core::grant::Grant {
        let wire = pb::RunGrant {
            version: 1,
            run_id: "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f".into(),
            node: "pve1".into(),
            not_before_unix: 1_700_000_000,
            deadline_unix: 1_700_003_600,
            repository: Some(pb::PbsRepository {
                server: "pbs.example.net".into(),
                port: 8007,
                datastore: "store1".into(),
                namespace: String::new(),
                auth_id: "certistack@pbs!restore".into(),
                fingerprint: ["ab"; 32].join(":"),
            }),
            snapshot: "vm/100/2026-11-01T02:00:00Z".into(),
            archives: vec!["drive-scsi0.img".into()],
            sandbox_vms: vec![pb::SandboxVm {
                vmid: 9100,
                max_cores: 1,
                max_memory_mib: 256,
            }],
            vnet: "csnet1".into(),
            probe_source: "10.99.0.1/24".into(),
            probe_targets: Vec::new(),
            qga_assertions: Vec::new(),
            network_recovery_modes: Vec::new(),
            guest_address: String::new(),
        };
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let signed = crate::run::sign_grant(&key, &wire);
        certistack_core::grant::verify(&signed, &key.verifying_key()).unwrap()
    }

    #[test]
    fn isolation_evidence_that_contradicts_the_grant_is_refused() {
        let good = report::Isolation {
            bridge_ports: vec!["tap9100i0".into(), "tap9100i1".into()],
            bridge_addresses: vec!["fe80::1/64".into(), "10.99.0.1/24".into()],
            forwarding: BTreeMap::from([("net.ipv4.conf.csnet1.forwarding".into(), "0".into())]),
            ruleset: String::new(),
            ruleset_digest: String::new(),
            nat_sources: Vec::new(),
        };
        let grant = grant();
        check_isolation(&good, &grant).unwrap();
        let refused = |change: &dyn Fn(&mut report::Isolation), needle: &str| {
            let mut isolation = good.clone();
            change(&mut isolation);
            let error = check_isolation(&isolation, &grant).unwrap_err();
            assert!(error.contains(needle), "{error}");
        };
        refused(&|i| i.bridge_ports.push("eno1".into()), "eno1");
        refused(&|i| i.bridge_ports.push("tap9200i0".into()), "tap9200i0");
        refused(&|i| i.bridge_ports.push("tap9100i".into()), "tap9100i");
        refused(
            &|i| i.bridge_addresses.push("10.99.0.254/24".into()),
            "10.99.0.254",
        );
        refused(
            &|i| {
                i.forwarding
                    .insert("net.ipv4.conf.csnet1.forwarding".into(), "1".into());
            },
            "is 1, not 0",
        );
        refused(&|i| i.forwarding.clear(), "no forwarding sysctl");
        let mut disabled = good.clone();
        disabled.forwarding.insert(
            "net.ipv6.conf.csnet1.forwarding".into(),
            "0 (was 1; set to 0 for this run by sandbox.forwarding = \"disable-for-run\")".into(),
        );
        check_isolation(&disabled, &grant).unwrap();
    }

    fn record(sequence: u64, hash: &str) -> report::JournalRecord {
        report::JournalRecord {
            sequence,
            time_unix_ms: 0,
            operation: "op".into(),
            resource: "r".into(),
            phase: "done".into(),
            previous_sha256: String::new(),
            record_sha256: hash.into(),
            detail: String::new(),
        }
    }

    #[test]
    fn the_heads_a_node_answered_must_be_in_the_journal_it_streams_in_order() {
        let records = [record(1, "aa"), record(2, "bb"), record(3, "cc")];
        let heads = |list: &[&str]| -> Vec<(String, String)> {
            list.iter()
                .map(|h| (format!("step {h}"), (*h).to_owned()))
                .collect()
        };
        heads_in_journal(&heads(&["aa", "cc"]), &records).unwrap();
        heads_in_journal(&heads(&["bb", "bb", "cc"]), &records).unwrap();
        let error = heads_in_journal(&heads(&["aa", "dd"]), &records).unwrap_err();
        assert!(
            error.contains("head dd it answered at step step dd"),
            "{error}"
        );
        assert!(heads_in_journal(&heads(&["cc", "aa"]), &records).is_err());
    }

    #[test]
    fn a_guest_that_stopped_fails_and_one_the_node_holds_is_not_judged() {
        assert_eq!(guest_state("running"), GuestState::Running);
        for stopped in ["io-error", "internal-error", "guest-panicked", "shutdown"] {
            assert_eq!(guest_state(stopped), GuestState::Stopped, "{stopped}");
        }
        for held in ["paused", "prelaunch", "postmigrate", "unknown"] {
            assert_eq!(guest_state(held), GuestState::NotJudged, "{held}");
        }
    }
}
