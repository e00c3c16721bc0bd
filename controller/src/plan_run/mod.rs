//! One run of a plan (`certistack-ctl run`), as phases in order: load (the configuration; the
//! plan, read in its three steps by `plan`: as written, resolved, granted; its secrets; the
//! keys) → validate (every validation on its node, through `runner`) → print (the table, or
//! JSON lines). Phases still to come (resolution that asks the PVE and PBS APIs, preflight,
//! networks, history, outputs, notifications) each go between these as a function of their
//! own, so the order of a night can be read here in one place; `runner` stays "drive
//! validations".

use crate::authority::Authority;
use crate::config::ControllerConfig;
use crate::exit::ExitStatus;
use crate::plan::Plan;
use crate::{interrupt, runner};
use certistack_core::instance_lock::{InstanceLock, LockError};
use std::path::PathBuf;
use std::sync::Arc;
use time::OffsetDateTime;

/// What the operator asked of this run.
#[derive(Debug, Clone)]
pub struct Options {
    pub plan: PathBuf,
    pub config: PathBuf,
    /// Validations at once on one node.
    pub per_node: usize,
    /// Validations at once in total.
    pub max_concurrent: usize,
    /// How progress and the summaries are printed.
    pub output: runner::ProgressMode,
}

/// Everything the run reads before it resolves anything: nothing is contacted.
#[allow(missing_debug_implementations)]
pub struct Loaded {
    pub config: ControllerConfig,
    pub plan: Plan,
    pub secrets: runner::Secrets,
    pub authority: Authority,
    /// Each `(node, vnet)`'s prerequisites as placement read them.
    pub checked: runner::Checked,
    /// The run history, opened before anything is asked of a node.
    pub history: Arc<crate::history::sqlite::SqliteStore>,
    /// Where notifications go (webhook, e-mail), each key, password and CA read before
    /// anything is asked of a node.
    pub channels: Vec<crate::notify::Channel>,
    /// Held from before the plan is resolved until the run's last output is written (`None`
    /// only when the state directory does not exist: the run cannot load its keys then).
    pub run_lock: Option<InstanceLock>,
}

/// The run lock's file in the state directory: one `run` at a time per controller.
pub const RUN_LOCK_FILE: &str = "run.lock";

/// Takes the state directory's run lock, so that two runs (the timer's and an operator's) never
/// pick the same sandbox VMIDs, lease the same names or interleave their history; the second
/// is refused (exit 75) before it asks anything of anyone.
pub fn lock_state_dir(
    state_dir: &std::path::Path,
    plan: &std::path::Path,
    now: OffsetDateTime,
) -> Result<InstanceLock, ExitStatus> {
    let since = now
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    // A state directory of another user (a run started as root on the packaged controller's)
    // is refused with its owner, before anything is created in it.
    certistack_core::files::check_private(state_dir).map_err(|error| {
        ExitStatus::new(
            crate::exit::file_exit_code(&error),
            format!("controller state directory refused: {error}"),
        )
    })?;
    let holder = format!(
        "pid {}, plan {}, since {since}",
        std::process::id(),
        plan.display()
    );
    InstanceLock::acquire(&state_dir.join(RUN_LOCK_FILE), &holder).map_err(|error| match error {
        LockError::Held { lock, holder } => ExitStatus::new(
            crate::exit::BUSY,
            format!(
                "another `certistack-ctl run` is running with this state directory ({holder}; it holds {}); this run asked nothing of anyone. Let it end (when the timer started it: systemctl status certistack-controller.service), then run again",
                lock.display()
            ),
        ),
        LockError::File(error) => ExitStatus::new(
            crate::exit::file_exit_code(&error),
            format!(
                "the run lock cannot be taken: {error}; the state directory must be writable by the user certistack-ctl runs as"
            ),
        ),
    })
}

/// Runs the plan: every phase in order, on `runtime`. Returns the validations' summaries in
/// plan order; the caller turns them into the exit status.
pub fn run(
    options: &Options,
    now: OffsetDateTime,
    runtime: &tokio::runtime::Runtime,
) -> Result<Vec<crate::verdict::Summary>, ExitStatus> {
    let mut loaded = load(options, now)?;
    // Held until the table is printed: the run's last output.
    let run_lock = loaded.run_lock.take();
    let summaries = runtime.block_on(validate(options, loaded, now));
    print(options.output, &summaries);
    drop(run_lock);
    Ok(summaries)
}

/// Phase 1: the configuration, the plan (checked completely, offline), the secrets it names
/// and the controller's keys.
pub fn load(options: &Options, now: OffsetDateTime) -> Result<Loaded, ExitStatus> {
    let config = ControllerConfig::load(&options.config)?;
    // Without its state directory the run stops at its keys below, before any node is asked,
    // and the plan's own refusals (a missing privilege, a bad key) are said first.
    let run_lock = if config.state_dir.is_dir() {
        Some(lock_state_dir(&config.state_dir, &options.plan, now)?)
    } else {
        None
    };
    let catalog = crate::catalog::PbsCatalog::new();
    let cluster = crate::cluster::PveCluster::new(config.pve.as_ref());
    let rooms = crate::placer::NodeRooms::new(&config, &cluster, options.per_node);
    let plan = Plan::load_with(
        &options.plan,
        &config,
        now.unix_timestamp(),
        crate::plan::Resolvers {
            catalog: &catalog,
            cluster: &cluster,
            rooms: &rooms,
        },
    )
    .map_err(crate::exit::plan_refused)?;
    crate::exit::print_plan_warnings(&plan);
    // What placement asked the nodes is not asked again by the runner.
    let checked = rooms.into_checks();
    let secrets = runner::Secrets::load(&plan)?;
    let authority = Authority::load(&config.state_dir)?;
    let history = crate::history::sqlite::SqliteStore::open(
        &config.state_dir.join(crate::history::FILE_NAME),
        crate::history::sqlite::BUSY,
    )?;
    // The metrics file's directory is checked now, not found missing after the night's run.
    if let Some(path) = &config.metrics_textfile {
        let directory = path
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty());
        if directory.is_some_and(|directory| !directory.is_dir()) {
            return Err(ExitStatus::new(
                crate::exit::REFUSED_CONFIG,
                format!(
                    "outputs.metrics_textfile: {}: its directory does not exist; create it (node_exporter's textfile directory, e.g. /var/lib/prometheus/node-exporter) or fix the path",
                    path.display()
                ),
            ));
        }
    }
    let mut channels = Vec::new();
    if let Some(notify) = &config.notify {
        let refused = |reason| ExitStatus::new(crate::exit::REFUSED_CONFIG, reason);
        if let Some(webhook) = &notify.webhook {
            channels.push(crate::notify::Channel::Webhook(
                crate::notify::webhook::Webhook::new(webhook).map_err(refused)?,
            ));
        }
        if let Some(smtp) = &notify.smtp {
            channels.push(crate::notify::Channel::Email(
                crate::notify::email::Email::new(smtp).map_err(refused)?,
            ));
        }
    }
    Ok(Loaded {
        config,
        plan,
        secrets,
        authority,
        checked,
        history: Arc::new(history),
        channels,
        run_lock,
    })
}

/// Phase 2: the validations that fail before any node is asked (`latest` found no finished
/// backup, or one too old) get their signed failed reports; every other validation is driven
/// on its node, bounded per node and in total, with the operator's interrupts heard
/// throughout.
pub async fn validate(
    options: &Options,
    loaded: Loaded,
    now: OffsetDateTime,
) -> Vec<crate::verdict::Summary> {
    let Loaded {
        config,
        mut plan,
        secrets,
        authority,
        checked,
        history,
        channels,
        run_lock,
    } = loaded;
    // Whoever calls this phase alone (not `run`) holds the lock until it returns.
    let _run_lock = run_lock;
    let progress = Arc::new(runner::Progress::new(options.output));
    let announced = progress.clone();
    let interrupts = interrupt::listen(move |line| announced.println(line));
    let context = Arc::new(runner::RunContext {
        authority: Arc::new(authority),
        nodes: config
            .nodes
            .iter()
            .map(|(name, node)| (name.to_string(), node.clone()))
            .collect(),
        reports_dir: config.reports_dir.clone(),
        plan_digest: plan.digest.clone(),
        secrets: Arc::new(secrets),
        progress,
        interrupts,
        history: history.clone(),
        plan_run_id: uuid::Uuid::new_v4().hyphenated().to_string(),
        history_failures: std::sync::atomic::AtomicUsize::new(0),
    });
    let run_started = runner::history_rows::now_ms();
    let metrics_textfile = config.metrics_textfile.clone();
    let plan_sha256 = plan.digest.clone();
    let plan_row = crate::verdict::PlanRunStarted {
        plan_run_id: context.plan_run_id.clone(),
        plan: options.plan.display().to_string(),
        plan_sha256: plan.digest.clone(),
        started_unix_ms: runner::history_rows::now_ms(),
    };
    runner::history_rows::write(&context, move |history| history.plan_started(&plan_row)).await;
    // What fails before any node is asked is reported first, then the rest runs; the
    // summaries come back in plan order.
    let mut summaries: Vec<(usize, crate::verdict::Summary)> = Vec::new();
    for failed in std::mem::take(&mut plan.failed_before_run) {
        let summary = runner::report_failed_before_run(&context, &plan.storage, &failed, now);
        let resolved = &failed.resolved;
        runner::history_rows::ended_before_run(
            &context,
            &summary,
            resolved.source_vmid.value.get(),
            format!("vm/{}", resolved.source_vmid.value),
        )
        .await;
        summaries.push((failed.index, summary));
    }
    // A validation placement put on no node is an error of the run: nothing was created.
    for unplaced in std::mem::take(&mut plan.unplaced) {
        let summary = runner::summarize_unplaced(&context, &unplaced);
        let resolved = &unplaced.resolved;
        runner::history_rows::ended_before_run(
            &context,
            &summary,
            resolved.source_vmid.value.get(),
            format!(
                "vm/{}/{}",
                resolved.source_vmid.value, resolved.snapshot.value
            ),
        )
        .await;
        summaries.push((unplaced.index, summary));
    }
    let order: Vec<usize> = plan.validations.iter().map(|v| v.index).collect();
    let ran = runner::run_plan(
        context.clone(),
        plan,
        checked,
        options.per_node,
        options.max_concurrent,
    )
    .await;
    summaries.extend(order.into_iter().zip(ran));
    let plan_run_id = context.plan_run_id.clone();
    let ended = runner::history_rows::now_ms();
    runner::history_rows::write(&context, move |history| {
        history.plan_ended(&plan_run_id, ended)
    })
    .await;
    let failures = context
        .history_failures
        .load(std::sync::atomic::Ordering::Relaxed);
    if failures > 0 {
        context.progress.println(&format!(
            "history: {failures} write(s) failed (above); `certistack-ctl history` lacks them"
        ));
    }
    let notification_failures = match &config.notify {
        Some(notify) if !channels.is_empty() => {
            let facts = crate::notify::PlanRunFacts {
                plan_run_id: context.plan_run_id.clone(),
                plan: options.plan.display().to_string(),
                plan_sha256: plan_sha256.clone(),
                started_unix_ms: run_started,
                ended_unix_ms: ended,
            };
            let ran: Vec<crate::verdict::Summary> =
                summaries.iter().map(|(_, s)| s.clone()).collect();
            notify_after_run(&context, &history, &channels, notify.on, &facts, &ran).await
        }
        _ => 0,
    };
    if let Some(path) = metrics_textfile {
        let mut facts = crate::metrics::RunFacts::of(
            &summaries.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>(),
            run_started,
            ended,
        );
        facts.history_write_failures = failures;
        facts.notification_failures = notification_failures;
        let written = tokio::task::spawn_blocking(move || {
            use crate::history::RunStore;
            let vms = history
                .vm_summaries(ended)
                .map_err(|error| error.to_string())?;
            crate::metrics::write(&path, &crate::metrics::render(&vms, &facts))
                .map_err(|error| format!("{}: {error}", path.display()))
        })
        .await
        .unwrap_or_else(|error| Err(error.to_string()));
        // Like the history, the metrics never change a verdict or the exit code.
        if let Err(error) = written {
            context.progress.println(&format!(
                "metrics: not written: {error}; check that outputs.metrics_textfile's directory exists and is writable"
            ));
        }
    }
    summaries.sort_by_key(|(index, _)| *index);
    summaries.into_iter().map(|(_, summary)| summary).collect()
}

/// Sends what the run's notifications say of the validations the history holds for it;
/// each delivery recorded there and said on the progress stream. The number not delivered.
async fn notify_after_run(
    context: &Arc<runner::RunContext>,
    history: &Arc<crate::history::sqlite::SqliteStore>,
    channels: &[crate::notify::Channel],
    on: crate::notify::settings::Triggers,
    facts: &crate::notify::PlanRunFacts,
    summaries: &[crate::verdict::Summary],
) -> usize {
    use crate::history::RunStore;
    let store = history.clone();
    let plan_run_id = facts.plan_run_id.clone();
    let ended = facts.ended_unix_ms;
    let rows =
        tokio::task::spawn_blocking(move || store.validations_of_plan_run(&plan_run_id, ended))
            .await
            .map_err(|error| error.to_string())
            .and_then(|read| read.map_err(|error| error.to_string()));
    // A storage problem must not hide a failure: what the history lacks, the summaries tell.
    let mut rows = rows.unwrap_or_else(|error| {
        context.progress.println(&format!(
            "notify: the run's validations could not be read back from the history ({error}); the messages name what the summaries know"
        ));
        Vec::new()
    });
    for summary in summaries {
        let known =
            !summary.run_id.is_empty() && rows.iter().any(|row| row.run_id == summary.run_id);
        let placed_nowhere = summary.run_id.is_empty()
            && rows.iter().any(|row| row.validation == summary.validation);
        if !known && !placed_nowhere {
            rows.push(crate::notify::row_of_summary(summary, &facts.plan_run_id));
        }
    }
    let mut failures = 0;
    for message in crate::notify::messages(on, facts, &rows) {
        for channel in channels {
            let delivery = crate::notify::deliver(
                channel,
                &message,
                &facts.plan_run_id,
                || OffsetDateTime::now_utc().unix_timestamp(),
                || *context.interrupts.borrow() > 0,
            )
            .await;
            context.progress.println(&if delivery.delivered {
                format!(
                    "notify: {} {} delivered to {} ({} tr{})",
                    delivery.channel,
                    delivery.kind,
                    channel.target(),
                    delivery.attempts,
                    if delivery.attempts == 1 { "y" } else { "ies" }
                )
            } else {
                failures += 1;
                format!(
                    "notify: {} {} NOT delivered to {} after {} tries: {}",
                    delivery.channel,
                    delivery.kind,
                    channel.target(),
                    delivery.attempts,
                    delivery.last_error.as_deref().unwrap_or("")
                )
            });
            runner::history_rows::write(context, move |history| history.delivery(&delivery)).await;
        }
    }
    failures
}

/// Phase 3: the summaries, written without panicking on a closed pipe (`run ... | head`): the
/// exit code still says how the run went.
pub fn print(output: runner::ProgressMode, summaries: &[crate::verdict::Summary]) {
    if output == runner::ProgressMode::Json {
        for summary in summaries {
            if let Some(line) = runner::summary_json_line(summary) {
                runner::write_line(&line);
            }
        }
    } else {
        runner::write_line(runner::summary_table(summaries).trim_end());
    }
}
