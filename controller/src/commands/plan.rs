//! `plan check` and `plan show`: a plan checked completely without contacting any node, and
//! what would run where, briefly or spelled out.

use super::{load_config, load_plan};
use crate::exit::ExitStatus;
use time::OffsetDateTime;

pub fn plan_check(
    plan: &std::path::Path,
    config: &std::path::Path,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::plan;
    let config = load_config(config)?;
    let plan = load_plan(plan, &config, now)?;
    for validation in &plan.validations {
        println!("{}", plan::describe(validation));
    }
    println!(
        "plan {} accepted: {} validation(s); nothing was contacted",
        plan.path.display(),
        plan.validations.len()
    );
    Ok(())
}

pub fn plan_show(
    plan: &std::path::Path,
    config: &std::path::Path,
    json: bool,
    now: OffsetDateTime,
) -> Result<(), ExitStatus> {
    use crate::plan::show;
    let config = load_config(config)?;
    let plan = load_plan(plan, &config, now)?;
    // Written without panicking on a closed pipe (`plan show ... | head`).
    let text = if json {
        format!("{:#}", show::json(&plan))
    } else {
        format!(
            "{}{} validation(s); nothing was contacted",
            show::text(&plan),
            plan.validations.len()
        )
    };
    crate::runner::write_line(&text);
    Ok(())
}
