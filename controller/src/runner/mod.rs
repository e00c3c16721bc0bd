//! The validation driver (for `certistack-ctl run`): every validation of a plan, driven on its
//! node from grant to report.
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

mod before_run;
mod evidence;
pub mod history_rows;
mod progress;
mod readings;
mod secrets;
mod session;
mod steps;
mod summary;
mod teardown;

use crate::verdict::{CleanupState, Outcome, Summary};
pub use before_run::{RESOLVE_STEP, report_failed_before_run, summarize_unplaced};
pub use progress::{Event, Progress, ProgressMode, write_line};
pub use secrets::{SecretError, Secrets};
pub use summary::{json_line as summary_json_line, summary_table};

use crate::authority::Authority;
use crate::doctor;
use crate::interrupt::{Interrupts, STOP_AFTER_STEP};
use crate::plan::{self, Plan, Validation};
use crate::report::{self, StepResult};
use crate::run as credentials;
use certistack_proto::v1 as pb;
use evidence::{Evidence, Recorder};
use session::{RUN_CALL_TIMEOUT, Session, definitely_not_begun, describe_status};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use teardown::finish;
use time::OffsetDateTime;
use tokio::sync::Semaphore;

/// Validations running at once on one node, unless the command line says otherwise.
pub const DEFAULT_PER_NODE: usize = 2;
/// Validations running at once in total, unless the command line says otherwise.
pub const DEFAULT_TOTAL: usize = 8;
/// The operator name of the certificates `run` mints to read journals and clean up late.
const OPERATOR_NAME: &str = "certistack-run";

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
    /// Where each validation's row goes, and this run's id there.
    pub history: Arc<dyn crate::verdict::HistoryWriter>,
    pub plan_run_id: String,
    /// History writes that failed (each said on the progress stream).
    pub history_failures: std::sync::atomic::AtomicUsize,
}

/// Each `(node, vnet)`'s prerequisite checks, already asked (by placement).
pub type Checked = BTreeMap<(String, String), Vec<doctor::Check>>;

/// Runs every validation of `plan`, at most `per_node` at once on one node and `total` at once
/// overall, and returns their summaries in plan order.
pub async fn run_plan(
    context: Arc<RunContext>,
    plan: Plan,
    checked: Checked,
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
    > = checked
        .into_iter()
        .map(|(key, checks)| (key, Arc::new(tokio::sync::OnceCell::new_with(Some(checks)))))
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    let mut names = Vec::with_capacity(plan.validations.len());
    // Each validation's running row, so a task that ends without a summary (a panic) still
    // gets its end in the history instead of reading interrupted later.
    let begun_rows: Arc<std::sync::Mutex<BTreeMap<usize, crate::verdict::ValidationStarted>>> =
        Arc::default();
    // Where placement found memory for fewer at once, the node runs fewer.
    let at_once = plan.at_once;
    for (index, validation) in plan.validations.into_iter().enumerate() {
        names.push((validation.name.clone(), validation.grant.node.to_string()));
        let node_limit = per_node_limits
            .entry(validation.grant.node.to_string())
            .or_insert_with(|| {
                let limit = at_once
                    .get(validation.grant.node.as_str())
                    .map_or(per_node, |&fits| fits.min(per_node));
                Arc::new(Semaphore::new(limit.max(1)))
            })
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
        let begun_rows = begun_rows.clone();
        tasks.spawn(async move {
            let mut held = Vec::with_capacity(locks.len());
            for lock in locks {
                held.push(lock.acquire_owned().await);
            }
            let _node = node_limit.acquire_owned().await;
            let _total = total.acquire_owned().await;
            // The row goes in before the grant is minted: a controller killed from here on
            // leaves a row that reads interrupted once its deadline passed.
            let run_id = uuid::Uuid::new_v4().to_string();
            let begun = history_rows::started(
                &context,
                &run_id,
                (&validation.name, validation.grant.node.as_str()),
                (
                    validation.source_vmid.get(),
                    format!(
                        "vm/{}/{}",
                        validation.source_vmid, validation.resolved.snapshot.value
                    ),
                ),
                validation.run_seconds,
            );
            if let Ok(mut rows) = begun_rows.lock() {
                rows.insert(index, begun.clone());
            }
            let row = begun.clone();
            history_rows::write(&context, move |history| history.validation_started(&row)).await;
            let summary = drive(&context, validation, &checked, run_id).await;
            // The report is read for its digest off the async threads too.
            let ended = summary.clone();
            history_rows::write(&context, move |history| {
                history.validation_ended(&history_rows::ended(begun, &ended))
            })
            .await;
            (index, summary)
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
    let mut out = Vec::with_capacity(summaries.len());
    for (index, (summary, (validation, node))) in summaries.into_iter().zip(names).enumerate() {
        if let Some(summary) = summary {
            out.push(summary);
            continue;
        }
        let begun = begun_rows
            .lock()
            .ok()
            .and_then(|mut rows| rows.remove(&index));
        let summary = Summary {
            validation,
            node,
            run_id: begun
                .as_ref()
                .map(|row| row.run_id.clone())
                .unwrap_or_default(),
            outcome: Outcome::Error,
            cleanup: CleanupState::Unproven,
            reasons: vec![
                "the validation's task ended unexpectedly; see `certistack-ctl runs NODE`".into(),
            ],
            elapsed_ms: 0,
            report: None,
            steps: Vec::new(),
        };
        if let Some(begun) = begun {
            let ended = summary.clone();
            history_rows::write(&context, move |history| {
                history.validation_ended(&history_rows::ended(begun, &ended))
            })
            .await;
        }
        out.push(summary);
    }
    out
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

/// Drives one validation to its summary; never panics, never leaves without trying cleanup once
/// the run began.
async fn drive(
    context: &RunContext,
    validation: Validation,
    prerequisites: &tokio::sync::OnceCell<Vec<doctor::Check>>,
    run_id: String,
) -> Summary {
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
    if *context.interrupts.borrow() >= STOP_AFTER_STEP {
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
    if *context.interrupts.borrow() >= STOP_AFTER_STEP {
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

    let stop = steps::steps(
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
