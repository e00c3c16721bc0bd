//! What the node does under a run: a probe address it removes is an infrastructure error, and the
//! prerequisites are judged with each validation's own VNet.

use super::*;

/// The node takes the probe address away mid-run (as `ifreload -a` does): the validation ends
/// as an infrastructure error naming it, not as a failed backup, and cleanup completes over the
/// same connection.
#[test]
fn a_probe_address_the_node_removed_is_an_infrastructure_error() {
    if !privileged(
        "a_probe_address_the_node_removed_is_an_infrastructure_error",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("purge", &[]);
    inside(&netns.name, || async {
        let fleet = Fleet::new("ctl-purge", 1, false);
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan("purge.yaml", &[("web1", 1, 9101)], 6);
        let (child, mut lines) = start_ctl(&mut fleet.ctl(&plan, &config));
        wait_for_step(&mut lines, "guest agent 9101");
        run_ip(&["address", "del", "10.77.1.2/24", "dev", "csv1"]);
        let (code, summaries) = finish(child, lines);
        assert_eq!(code, 2);
        let s = summary(&summaries, "web1");
        assert_eq!(s["outcome"], "error", "{s}");
        assert_eq!(s["cleanup"], "complete", "{s}");
        let reasons = s["reasons"].to_string();
        assert!(
            reasons.contains("probe address removed by the node"),
            "{reasons}"
        );
        assert!(!reasons.contains("connection was lost"), "{reasons}");
        let statement = fleet.report(s);
        let steps: Vec<&str> = statement
            .predicate
            .steps
            .iter()
            .map(|step| step.name.as_str())
            .collect();
        assert!(
            !steps.contains(&"screenshot 9101"),
            "the run went on after the probe: {steps:?}"
        );
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
        assert!(run_tables().is_empty(), "{:?}", run_tables());
    });
}

/// `run` checks the prerequisites with the plan's VNet: forwarding on it (under the default
/// `sandbox.forwarding = "refuse"`) stops the validation before the run begins, naming the
/// sysctl, instead of failing later at PrepareSandbox.
#[test]
fn run_checks_the_plans_vnet_among_the_prerequisites() {
    if !privileged(
        "run_checks_the_plans_vnet_among_the_prerequisites",
        RUN_TOOLS,
    ) {
        return;
    }
    let netns = Netns::new("fwd", &[]);
    inside(&netns.name, || async {
        let mut fleet = Fleet::empty("ctl-forwarding");
        fleet.add_node(1, true, false);
        std::fs::write("/proc/sys/net/ipv4/conf/csv1/forwarding", "1").unwrap();
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan_with("forwarding.yaml", &[("web1", 1, 9101)], 60, false);
        let (code, _, summaries) = fleet.run(&plan, &config).await;
        assert_eq!(code, 2, "{summaries:?}");
        let s = summary(&summaries, "web1");
        assert_eq!(s["outcome"], "error", "{s}");
        assert_eq!(s["cleanup"], "notneeded", "{s}");
        let reasons = s["reasons"].to_string();
        assert!(
            reasons.contains(
                "node pve1 fails its prerequisites (see `certistack-ctl doctor pve1`): vnet-forwarding: net.ipv4.conf.csv1.forwarding = 1 now"
            ),
            "{reasons}"
        );
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
    });
}

/// Two validations on one node, each on its own VNet: each validation's prerequisites are
/// judged with its own VNet. Forwarding on the first one's VNet must stop that validation at
/// its `doctor` step, naming that VNet, and must not stop (or be blamed on) the other one.
#[test]
fn each_validation_is_checked_with_its_own_vnet() {
    if !privileged("each_validation_is_checked_with_its_own_vnet", RUN_TOOLS) {
        return;
    }
    let netns = Netns::new("fwd2", &[]);
    inside(&netns.name, || async {
        let mut fleet = Fleet::empty("ctl-forwarding-two");
        fleet.add_node(1, true, false);
        run_ip(&["link", "add", "csv9", "type", "bridge"]);
        run_ip(&["link", "set", "csv9", "up"]);
        std::fs::write("/proc/sys/net/ipv4/conf/csv9/forwarding", "1").unwrap();
        let config = fleet.controller_config(&[("pve1", 17441)]);
        let plan = fleet.plan_with(
            "two-vnets.yaml",
            &[("onfwd", 1, 9101), ("clean", 1, 9102)],
            60,
            false,
        );
        let text = std::fs::read_to_string(&plan)
            .unwrap()
            .replacen("vnet: csv1", "vnet: csv9", 1);
        std::fs::write(&plan, text).unwrap();
        let (_, _, summaries) = fleet.run(&plan, &config).await;
        let forwarding = summary(&summaries, "onfwd");
        let forwarding_reasons = forwarding["reasons"].to_string();
        assert!(
            forwarding_reasons.contains("fails its prerequisites")
                && forwarding_reasons.contains("net.ipv4.conf.csv9.forwarding = 1"),
            "{forwarding}"
        );
        let clean = summary(&summaries, "clean");
        assert!(
            !clean["reasons"].to_string().contains("csv9"),
            "the validation on csv1 was judged by csv9: {clean}"
        );
        assert!(
            fleet.nodes[0].residue().is_empty(),
            "{:?}",
            fleet.nodes[0].residue()
        );
    });
}
