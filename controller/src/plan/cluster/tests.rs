//! `select` and sandbox VMIDs from `[pve] sandbox_vmid_range`, resolved against a cluster that
//! lists what it was given (the PVE API double and the client are tested in tests/foundation).

use super::*;
use crate::plan::tests::{PLAN, config};
use crate::plan::{Plan, PlanError, Resolvers};
use std::cell::RefCell;

#[derive(Default)]
struct Listed {
    vms: Vec<ClusterVm>,
    pools: BTreeMap<String, Vec<u32>>,
    /// VMIDs the cluster has, listed or not.
    in_use: BTreeSet<u32>,
    range: Option<(u32, u32)>,
    asked_nextid: RefCell<Vec<u32>>,
}

fn vm(vmid: u32, pool: Option<&str>, tags: &[&str]) -> ClusterVm {
    ClusterVm {
        vmid: Vmid::parse("vmid", vmid).unwrap(),
        name: format!("vm{vmid}"),
        node: "pve1".into(),
        template: false,
        pool: pool.map(str::to_owned),
        tags: tags.iter().map(|t| (*t).to_owned()).collect(),
    }
}

impl crate::plan::needs::Privileges for Listed {
    fn privileges(&self, _path: &str) -> Result<Option<BTreeMap<String, bool>>, ClusterError> {
        Ok(None)
    }
    fn token_id(&self) -> Option<String> {
        None
    }
}

impl Cluster for Listed {
    fn vms(&self) -> Result<Vec<ClusterVm>, ClusterError> {
        Ok(self.vms.clone())
    }
    fn pool_members(&self, pool: &str) -> Result<Vec<Vmid>, ClusterError> {
        self.pools
            .get(pool)
            .map(|m| m.iter().map(|v| Vmid::parse("vmid", *v).unwrap()).collect())
            .ok_or_else(|| ClusterError::Refused(format!("pool '{pool}' does not exist")))
    }
    fn vmid_in_use(&self, vmid: Vmid) -> Result<bool, ClusterError> {
        self.asked_nextid.borrow_mut().push(vmid.get());
        Ok(self.in_use.contains(&vmid.get()) || self.vms.iter().any(|vm| vm.vmid == vmid))
    }
    fn sandbox_vmid_range(&self) -> Option<(Vmid, Vmid)> {
        self.range.map(|(low, high)| {
            (
                Vmid::parse("low", low).unwrap(),
                Vmid::parse("high", high).unwrap(),
            )
        })
    }
}

/// The plan's first validation selecting with `select` (its sandbox VMID left out), the second
/// as written.
fn selecting(select: &str) -> String {
    PLAN.replace("    source_vmid: 100\n", &format!("    select: {select}\n"))
        .replacen(
            "      - vmid: 9100\n        cores: 2",
            "      - cores: 2",
            1,
        )
}

fn resolve(text: &str, cluster: &Listed) -> Result<Plan, PlanError> {
    Plan::parse_resolving(
        Path::new("/plans/nightly.yaml"),
        text,
        &config(),
        1_800_000_000,
        Resolvers {
            catalog: &NoCatalog,
            cluster,
            rooms: &crate::plan::placement::NoRooms,
        },
    )
}

fn pool_of_five() -> Listed {
    let mut template = vm(205, Some("prod"), &[]);
    template.template = true;
    Listed {
        vms: vec![
            vm(201, Some("prod"), &["web"]),
            vm(202, Some("prod"), &["web", "nightly"]),
            vm(203, Some("prod"), &["db"]),
            vm(204, Some("prod"), &[]),
            template,
            vm(206, Some("prod"), &["nightly"]),
            vm(300, Some("test"), &["web", "nightly"]),
        ],
        pools: BTreeMap::from([("prod".to_owned(), vec![201, 202, 203, 204, 205, 206])]),
        // 990001 is held by a guest the token cannot see.
        in_use: BTreeSet::from([990_001]),
        range: Some((990_000, 990_999)),
        ..Listed::default()
    }
}

#[test]
fn a_pool_of_five_vms_gives_five_validations_with_free_sandbox_vmids_from_the_range() {
    let cluster = pool_of_five();
    let plan = resolve(&selecting("{pool: prod}"), &cluster).unwrap();
    let names: Vec<&str> = plan.validations.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "web01-201",
            "web01-202",
            "web01-203",
            "web01-204",
            "web01-206",
            "db01"
        ]
    );
    let first = &plan.validations[0].resolved;
    assert_eq!(first.source_vmid.source, Origin::Pve);
    assert_eq!(first.source_vmid.key, "select.pool (prod)");
    let sandboxes: Vec<u32> = plan
        .validations
        .iter()
        .map(|v| v.resolved.sandbox[0].vmid.value.get())
        .collect();
    // 990001 is skipped: the cluster has it though the token cannot see it.
    assert_eq!(
        sandboxes,
        [990_000, 990_002, 990_003, 990_004, 990_005, 9101]
    );
    assert_eq!(
        plan.validations[0].resolved.sandbox[0].vmid.source,
        Origin::Pve
    );
    assert_eq!(
        plan.validations[0].wire.snapshot,
        "vm/201/2026-11-01T02:00:00Z"
    );
    // The written VMID 9101 was checked free too.
    assert!(cluster.asked_nextid.borrow().contains(&9101));
}

#[test]
fn tags_select_the_vms_carrying_every_tag_and_vmids_name_them() {
    let cluster = pool_of_five();
    let plan = resolve(&selecting("{tags: [web, nightly]}"), &cluster).unwrap();
    let sources: Vec<u32> = plan
        .validations
        .iter()
        .map(|v| v.source_vmid.get())
        .collect();
    assert_eq!(sources, [202, 300, 101]);
    let plan = resolve(&selecting("{vmids: [203, 201]}"), &cluster).unwrap();
    assert_eq!(plan.validations[0].name, "web01-201");
    assert_eq!(plan.validations[1].name, "web01-203");
    let error = resolve(&selecting("{vmids: [205]}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(error.contains("is a template"), "{error}");
}

#[test]
fn a_vm_the_token_cannot_audit_is_reported_with_the_privilege() {
    let mut cluster = pool_of_five();
    // 207 is in the pool, but /cluster/resources leaves it out (no VM.Audit).
    cluster.pools.get_mut("prod").unwrap().push(207);
    let error = resolve(&selecting("{pool: prod}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("validations[0] (web01).select.pool: pool prod has 1 QEMU VM(s) the token may not audit (207)"),
        "{error}"
    );
    assert!(error.contains("VM.Audit on /pool/prod"), "{error}");
    let error = resolve(&selecting("{vmids: [207]}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(error.contains("VM.Audit on /vms/207"), "{error}");
    let error = resolve(&selecting("{tags: [nosuchtag]}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(error.contains("VM.Audit"), "{error}");
}

#[test]
fn a_written_sandbox_vmid_the_cluster_has_is_refused_before_any_node() {
    let mut cluster = pool_of_five();
    cluster.in_use.insert(9101);
    let error = resolve(PLAN, &cluster).unwrap_err().to_string();
    assert!(
        error.contains(
            "validations[1] (db01).sandbox: sandbox VMID 9101 is already used in the cluster"
        ),
        "{error}"
    );
    // Without [pve] nothing is asked, as before.
    assert!(check_offline(PLAN).is_ok());
}

fn check_offline(text: &str) -> Result<Plan, PlanError> {
    Plan::parse(
        Path::new("/plans/nightly.yaml"),
        text,
        &config(),
        1_800_000_000,
    )
}

#[test]
fn select_without_the_api_or_the_range_and_too_wide_a_selection_are_refused() {
    let error = check_offline(&selecting("{pool: prod}"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("configure [pve]"), "{error}");
    let mut cluster = pool_of_five();
    cluster.range = None;
    let error = resolve(&selecting("{pool: prod}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(error.contains("sandbox_vmid_range is not set"), "{error}");
    // A written sandbox VMID cannot serve every VM a selection expands to.
    let error = resolve(
        &PLAN.replace("    source_vmid: 100\n", "    select: {pool: prod}\n"),
        &pool_of_five(),
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("leave the sandbox vmid out"), "{error}");
    // Over the bound.
    let mut wide = pool_of_five();
    wide.vms = (1000..1300).map(|n| vm(n, Some("big"), &[])).collect();
    wide.pools
        .insert("big".into(), (1000..1300).collect::<Vec<u32>>());
    let error = resolve(&selecting("{pool: big}"), &wide)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("it selects 300 VMs, which would make 300 validations, more than the 256"),
        "{error}"
    );
    let error = resolve(&selecting("{pool: prod, tags: [web]}"), &pool_of_five())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("exactly one of vmids, pool or tags"),
        "{error}"
    );
    let error = resolve(&PLAN.replace("    source_vmid: 100\n", ""), &pool_of_five())
        .unwrap_err()
        .to_string();
    assert!(error.contains("either source_vmid"), "{error}");
}

#[test]
fn a_range_with_too_few_free_vmids_says_how_many_it_has() {
    let mut cluster = pool_of_five();
    cluster.range = Some((990_000, 990_002));
    let error = resolve(&selecting("{pool: prod}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(
            "sandbox_vmid_range 990000-990002 has 2 free VMID(s) for the 5 sandbox VM(s)"
        ),
        "{error}"
    );
}

#[test]
fn a_range_full_of_leftovers_is_refused_after_a_bounded_walk() {
    let mut cluster = pool_of_five();
    cluster.range = Some((990_000, 990_999));
    cluster.in_use = (990_000..990_500).collect();
    let error = resolve(&selecting("{pool: prod}"), &cluster)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("more than 256 of its VMIDs below 990257 are in use"),
        "{error}"
    );
    assert!(error.contains("certistack-ctl cleanup"), "{error}");
    // The range's VMIDs asked: 257, no more (the plan's written VMID is asked too).
    let asked = cluster.asked_nextid.borrow();
    assert_eq!(
        asked.iter().filter(|v| **v >= 990_000).count(),
        257,
        "{asked:?}"
    );
}

#[test]
fn placement_over_too_many_node_and_vnet_pairs_is_refused_before_any_is_asked() {
    use crate::plan::placement::{NodeRoom, Rooms, RoomsError};
    struct Counting(RefCell<usize>);
    impl Rooms for Counting {
        fn rooms(
            &self,
            pairs: &BTreeSet<(String, String)>,
        ) -> Result<BTreeMap<(String, String), NodeRoom>, RoomsError> {
            *self.0.borrow_mut() += pairs.len();
            Err(RoomsError::Refused("asked".into()))
        }
        fn per_node(&self) -> usize {
            2
        }
    }
    // 600 nodes, and two validations on two VNets: 1,200 pairs.
    let mut text = "state_dir = \"/s\"\nreports_dir = \"/r\"\n".to_owned();
    for i in 0..600 {
        text.push_str(&format!(
            "[[nodes]]\nname = \"pve{i}\"\naddress = \"192.0.2.11\"\nport = {}\n",
            7000 + i
        ));
    }
    let config =
        crate::config::ControllerConfig::parse(std::path::Path::new("controller.toml"), &text)
            .unwrap();
    let plan = PLAN
        .replace("    node: pve1\n", "    node: auto\n")
        .replacen("      vnet: csnet1\n", "      vnet: csnet2\n", 1);
    let rooms = Counting(RefCell::new(0));
    let error = Plan::parse_resolving(
        Path::new("/plans/nightly.yaml"),
        &plan,
        &config,
        1_800_000_000,
        Resolvers {
            catalog: &NoCatalog,
            cluster: &NoCluster,
            rooms: &rooms,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("placement would check 1200 (node, VNet) pairs, more than 1024"),
        "{error}"
    );
    assert_eq!(*rooms.0.borrow(), 0);
}
