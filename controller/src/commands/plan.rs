//! `plan check` and `plan show`: a plan checked completely without contacting any node, and
//! what would run where, briefly or spelled out.

use super::{load_config, load_plan};
use crate::exit::ExitStatus;
use time::OffsetDateTime;

/// How far `plan check` and `plan show` reach: the APIs and nodes (`online`, as `run` does)
/// or nothing, and the validations at once on one node that placement assumes.
#[derive(Debug, Clone, Copy)]
pub struct Reach {
    pub online: bool,
    pub per_node: usize,
}

/// [`load_plan`], or offline the plan as it reads with nothing asked.
fn load_plan_reaching(
    plan: &std::path::Path,
    config: &crate::config::ControllerConfig,
    reach: Reach,
    now: OffsetDateTime,
) -> Result<crate::plan::Plan, ExitStatus> {
    if reach.online {
        return load_plan(plan, config, reach.per_node, now);
    }
    crate::plan::Plan::load(plan, config, now.unix_timestamp()).map_err(crate::exit::plan_refused)
}

pub fn plan_check(
    plan: &std::path::Path,
    config: &std::path::Path,
    reach: Reach,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::plan;
    let config = load_config(config)?;
    let plan = load_plan_reaching(plan, &config, reach, now)?;
    let mut text = String::new();
    for validation in &plan.validations {
        text.push_str(&plan::describe(validation));
        text.push('\n');
    }
    for failed in &plan.failed_before_run {
        text.push_str(&format!(
            "{}: fails before any node is asked: {}\n",
            failed.resolved.name, failed.why.reason
        ));
    }
    for unplaced in &plan.unplaced {
        text.push_str(&format!(
            "{}: placed on no node: {}\n",
            unplaced.resolved.name,
            certistack_core::untrusted::printable(
                unplaced.why.as_bytes(),
                certistack_core::untrusted::MAX_VALUE_CHARS
            )
        ));
    }
    text.push_str(&format!(
        "plan {} accepted: {} validation(s); {}",
        certistack_core::untrusted::printable(
            plan.path.as_os_str().as_encoded_bytes(),
            certistack_core::untrusted::MAX_VALUE_CHARS
        ),
        plan.validations.len() + plan.failed_before_run.len() + plan.unplaced.len(),
        contacted(&plan)
    ));
    write_stdout(&text)?;
    // A pre-flight check must not pass what the night would report as errors.
    if plan.unplaced.is_empty() {
        Ok(())
    } else {
        Err(ExitStatus::new(
            crate::exit::INFRASTRUCTURE,
            format!(
                "{} validation(s) placed on no node (above): run would report them as errors; bring a node back or give the plan room, then check again",
                plan.unplaced.len()
            ),
        ))
    }
}

/// What checking the plan asked of the nodes: nothing, or (to place `node: auto`) only what
/// `doctor` asks.
fn contacted(plan: &crate::plan::Plan) -> &'static str {
    if plan.asked_nodes {
        "the nodes were asked only what placement needs (Hello, their prerequisites); nothing was created"
    } else {
        "no node was contacted"
    }
}

/// `text` and a newline on standard output: a closed pipe ends the command quietly, any other
/// write error is exit 74, so `plan show --json > tonight.json` on a full disk fails.
fn write_stdout(text: &str) -> Result<(), ExitStatus> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    ExitStatus::of_output(writeln!(out, "{text}").and_then(|()| out.flush()))
}

pub fn plan_show(
    plan: &std::path::Path,
    config: &std::path::Path,
    json: bool,
    reach: Reach,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::plan::show;
    let config = load_config(config)?;
    let plan = load_plan_reaching(plan, &config, reach, now)?;
    // Written without panicking on a closed pipe (`plan show ... | head`).
    let text = if json {
        show::json(&plan)
    } else {
        format!(
            "{}{} validation(s); {}",
            show::text(&plan),
            plan.validations.len() + plan.failed_before_run.len() + plan.unplaced.len(),
            contacted(&plan)
        )
    };
    write_stdout(&text)
}
