//! A run interrupted while it works: SIGINT, a connector killed and restarted, a node that stops
//! answering, a deadline during a step; each run still cleans up and its report says so.

use super::*;

/// SIGINT while the controller waits for a guest agent that never answers: the run stops after
/// that step, cleans up completely, and its report says it was interrupted.
#[test]
fn an_interrupted_run_cleans_up_and_its_report_says_interrupted() {
    if !privileged(
        "an_interrupted_run_cleans_up_and_its_report_says_interrupted",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("sigint", &[]);
    inside(&netns.name, || async {
        let fleet = Fleet::new("ctl-sigint", 1, false);
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan("wait.yaml", &[("web1", 1, 9101)], 300);
        let started = std::time::Instant::now();
        let (child, mut lines) = start_ctl(&mut fleet.ctl(&plan, &config));
        wait_for_step(&mut lines, "guest agent 9101");
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::INT,
        )
        .unwrap();
        let (code, summaries) = finish(child, lines);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(120),
            "the interrupt did not end the wait"
        );
        assert_eq!(code, 2);
        let s = summary(&summaries, "web1");
        assert_eq!(s["outcome"], "error", "{s}");
        assert_eq!(s["cleanup"], "complete", "{s}");
        let statement = fleet.report(s);
        let Verdict::Error { reasons } = &statement.predicate.verdict else {
            panic!("{:?}", statement.predicate.verdict);
        };
        assert!(reasons[0].contains("interrupted"), "{reasons:?}");
        assert!(statement.predicate.cleanup.complete);
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
        assert!(run_tables().is_empty(), "{:?}", run_tables());
    });
}

/// The connector killed (-9) while the guest runs and restarted: the controller reconnects,
/// cleans up within the deadline and says the validation could not complete; nothing is left.
#[test]
fn a_connector_killed_mid_run_is_reconnected_and_cleaned_up() {
    if !privileged(
        "a_connector_killed_mid_run_is_reconnected_and_cleaned_up",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("reconn", &[]);
    inside(&netns.name, || async {
        let mut fleet = Fleet::new("ctl-reconnect", 1, false);
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan("wait.yaml", &[("web1", 1, 9101)], 300);
        let (child, mut lines) = start_ctl(&mut fleet.ctl(&plan, &config));
        wait_for_step(&mut lines, "guest agent 9101");
        fleet.nodes[0].kill9();
        std::thread::sleep(std::time::Duration::from_secs(2));
        fleet.nodes[0].start();
        let (code, summaries) = finish(child, lines);
        assert_eq!(code, 2);
        let s = summary(&summaries, "web1");
        assert_eq!(s["outcome"], "error", "{s}");
        assert_eq!(s["cleanup"], "complete", "{s}");
        let statement = fleet.report(s);
        let p = &statement.predicate;
        assert!(p.cleanup.complete);
        let vm_destroyed = p
            .cleanup
            .receipts
            .iter()
            .any(|r| r.resource == "vm:9101" && r.end_state.contains("destroyed"));
        assert!(vm_destroyed, "{:?}", p.cleanup.receipts);
        assert_eq!(p.journal.records.last().unwrap().operation, "run.end");
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
        assert!(run_tables().is_empty(), "{:?}", run_tables());
    });
}

/// A node that stops answering (SIGSTOP) while the controller waits on it: the second interrupt
/// abandons the step in progress, the third the cleanup; the run ends at once, says cleanup is
/// unproven and names the command that finishes it, which then leaves nothing behind.
#[test]
fn interrupts_abandon_a_node_that_stopped_answering_and_say_what_to_run() {
    if !privileged(
        "interrupts_abandon_a_node_that_stopped_answering_and_say_what_to_run",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("stop", &[]);
    inside(&netns.name, || async {
        let fleet = Fleet::new("ctl-sigstop", 1, false);
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan("wait.yaml", &[("web1", 1, 9101)], 300);
        let (child, mut lines) = start_ctl(&mut fleet.ctl(&plan, &config));
        wait_for_step(&mut lines, "guest agent 9101");
        let daemon = rustix::process::Pid::from_child(fleet.nodes[0].daemon.as_ref().unwrap());
        rustix::process::kill_process(daemon, rustix::process::Signal::STOP).unwrap();
        let started = std::time::Instant::now();
        let ctl = rustix::process::Pid::from_child(&child);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(700));
            rustix::process::kill_process(ctl, rustix::process::Signal::INT).unwrap();
        }
        let (code, summaries) = finish(child, lines);
        let waited = started.elapsed();
        rustix::process::kill_process(daemon, rustix::process::Signal::CONT).unwrap();
        assert!(
            waited < std::time::Duration::from_secs(20),
            "the interrupts did not end the waits ({waited:?})"
        );
        assert_eq!(code, 2);
        let s = summary(&summaries, "web1");
        assert_eq!(s["outcome"], "error", "{s}");
        assert_eq!(s["cleanup"], "unproven", "{s}");
        let run_id = s["run_id"].as_str().unwrap().to_owned();
        let reasons = s["reasons"].to_string();
        assert!(
            reasons.contains(&format!("certistack-ctl cleanup pve1 {run_id}")),
            "{reasons}"
        );
        let statement = fleet.report(s);
        assert!(!statement.predicate.cleanup.complete);
        // What the summary says to do finishes the job.
        let mut operator = certistack_controller::operator::connect(
            &fleet.authority,
            "127.0.0.1:17441",
            "pve1",
            "alice",
            now(),
        )
        .await
        .unwrap();
        let reply = certistack_controller::operator::cleanup(&mut operator, &run_id)
            .await
            .unwrap();
        certistack_controller::operator::cleanup_complete(&reply).unwrap();
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
        assert!(run_tables().is_empty(), "{:?}", run_tables());
    });
}

/// The deadline passing during a step: the validation stops there and cleans up with the time
/// the plan keeps for it; when the node is still busy at the deadline (the run certificate is
/// then void), Cleanup is asked as an operator. Both leave nothing behind.
#[test]
fn a_deadline_during_a_step_ends_the_validation_and_cleanup_still_completes() {
    if !privileged(
        "a_deadline_during_a_step_ends_the_validation_and_cleanup_still_completes",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("dead", &[]);
    inside(&netns.name, || async {
        let fleet = Fleet::new("ctl-deadline", 2, false);
        // 40 s runs keep 30 s for cleanup: the steps stop at 10 s. `qm start` takes 15 s on
        // pve1 (cleanup waits for it, then succeeds as the run) and 45 s on pve2 (still busy
        // at the deadline: cleanup as an operator).
        fleet.nodes[0]
            .lab
            .settings(serde_json::json!({ "delays": { "start": 15.0 } }));
        fleet.nodes[1]
            .lab
            .settings(serde_json::json!({ "delays": { "start": 45.0 } }));
        let config = fleet.controller_config(&[("pve1", 17441), ("pve2", 17442)]);
        let plan = fleet.plan("short.yaml", &[("web1", 1, 9101), ("web2", 2, 9102)], 5);
        let text = std::fs::read_to_string(&plan)
            .unwrap()
            .replace("run_seconds: 600", "run_seconds: 40");
        std::fs::write(&plan, text).unwrap();
        let (code, _, summaries) = fleet.run(&plan, &config).await;
        assert_eq!(code, 2, "{summaries:?}");
        for name in ["web1", "web2"] {
            let s = summary(&summaries, name);
            assert_eq!(s["outcome"], "error", "{s}");
            assert_eq!(s["cleanup"], "complete", "{s}");
            let reasons = s["reasons"].to_string();
            assert!(reasons.contains("deadline passed"), "{reasons}");
            let statement = fleet.report(s);
            assert!(statement.predicate.cleanup.complete);
        }
        let late = summary(&summaries, "web2")["reasons"].to_string();
        assert!(
            late.contains("cleaned up as an operator after the deadline"),
            "{late}"
        );
        for node in &fleet.nodes {
            assert!(
                node.residue().is_empty(),
                "{}: {:?}",
                node.name,
                node.residue()
            );
        }
        assert!(run_tables().is_empty(), "{:?}", run_tables());
    });
}
