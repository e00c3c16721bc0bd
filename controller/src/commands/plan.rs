//! `plan check`: a plan checked completely without contacting any node.

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
