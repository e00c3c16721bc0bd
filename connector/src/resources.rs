//! What a run has on the node, as its journal says.
//!
//! Every side effect is journaled under a resource key (`backup:<archive>`,
//! `overlay:<vmid>:<archive>`, `dir:overlays`, ...), read as a typed [`Resource`] with its
//! [`Op`] (both in `certistack_core::journal`); the strings stay the journal's wire format. A resource is open when its last
//! record is not `undone`: an `intent` without an outcome (the daemon died in between), a
//! `done`, or a `failed` that may have left something behind. Cleanup reverses open resources
//! newest first.
//!
//! The node executor decides from this what to undo; the run registry decides from it whether a
//! run still holds something (it may not close, and still counts against the node's limits).

use crate::process::ToolIdentity;
use certistack_core::journal::{Op, OpClass, Phase, Record, Resource};
use certistack_proto::v1 as pb;
use std::collections::BTreeMap;

/// How cleanup left one resource, as its receipt says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndState {
    Unmapped,
    Deleted,
    Destroyed,
    /// A setting of the node put back to the value it had before the run.
    Restored,
    AlreadyGone,
    NeverCreated,
    NotOurs,
    /// Deliberately left in place: something above it could not be undone.
    Kept(String),
    Failed(String),
}

impl EndState {
    /// The receipt's `end_state` and the journal's `end_state` detail.
    pub fn wire(&self) -> String {
        match self {
            EndState::Unmapped => "unmapped".into(),
            EndState::Deleted => "deleted".into(),
            EndState::Destroyed => "destroyed".into(),
            EndState::Restored => "restored".into(),
            EndState::AlreadyGone => "already gone".into(),
            EndState::NeverCreated => "never created".into(),
            EndState::NotOurs => "not this run's, left untouched".into(),
            EndState::Kept(reason) => format!("failed: kept while {reason}"),
            EndState::Failed(reason) => format!("failed: {reason}"),
        }
    }

    pub fn is_failure(&self) -> bool {
        matches!(self, EndState::Kept(_) | EndState::Failed(_))
    }

    /// The receipt's typed `state`.
    pub fn kind(&self) -> pb::EndState {
        match self {
            EndState::Unmapped => pb::EndState::Unmapped,
            EndState::Deleted => pb::EndState::Deleted,
            EndState::Destroyed => pb::EndState::Destroyed,
            EndState::Restored => pb::EndState::Restored,
            EndState::AlreadyGone => pb::EndState::AlreadyGone,
            EndState::NeverCreated => pb::EndState::NeverCreated,
            EndState::NotOurs => pb::EndState::NotOurs,
            EndState::Kept(_) => pb::EndState::Kept,
            EndState::Failed(_) => pb::EndState::Failed,
        }
    }

    /// A receipt for `resource` in this state.
    pub fn receipt(&self, resource: String) -> pb::ResourceReceipt {
        pb::ResourceReceipt {
            resource,
            end_state: self.wire(),
            state: self.kind() as i32,
        }
    }
}

impl std::fmt::Display for EndState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.wire())
    }
}

/// Where a resource stands after its last record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// An `intent` without outcome: the daemon stopped during the step.
    Interrupted,
    Done,
    /// The step failed and said so: its effect is known.
    Failed,
    /// The step's tool was killed at its deadline or lost: it may have done its work.
    OutcomeUnknown,
    Undone,
}

/// The last record of one resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceState {
    pub key: String,
    pub resource: Resource,
    pub last: Record,
    /// The detail of the last `done` record of the creating operation, if any.
    pub done_detail: Option<serde_json::Value>,
    /// Every record of this resource, oldest first.
    pub history: Vec<Record>,
}

impl ResourceState {
    pub fn is_open(&self) -> bool {
        self.last.entry.phase != Phase::Undone
    }

    pub fn standing(&self) -> Standing {
        let entry = &self.last.entry;
        match entry.phase {
            Phase::Intent => Standing::Interrupted,
            Phase::Done => Standing::Done,
            Phase::Undone => Standing::Undone,
            Phase::Failed
                if entry
                    .detail
                    .get("outcome_unknown")
                    .and_then(serde_json::Value::as_bool)
                    == Some(true) =>
            {
                Standing::OutcomeUnknown
            }
            Phase::Failed => Standing::Failed,
        }
    }

    /// Whether the last step's effect on the node is unknown: its `intent` has no outcome (the
    /// daemon died), or its tool was killed or lost before it reported (`outcome_unknown`).
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self.standing(),
            Standing::Interrupted | Standing::OutcomeUnknown
        )
    }

    /// The tools the interrupted last step started (journaled with its `intent`).
    pub fn interrupted_tools(&self) -> Vec<ToolIdentity> {
        self.history
            .iter()
            .rev()
            .take_while(|r| r.entry.phase == Phase::Intent)
            .filter_map(|r| serde_json::from_value(r.entry.detail.get("tool")?.clone()).ok())
            .collect()
    }
}

/// A step whose `intent` has no outcome: the daemon died during it, and its tools may still
/// be running (for a guest network recovery, with the overlay open).
#[derive(Debug)]
pub struct InterruptedStep {
    pub op: Op,
    pub resource: Resource,
    pub tools: Vec<ToolIdentity>,
    /// Transient units the step started its tools in, (name, description), as its intents
    /// name them (`unit`, `unit_description`): killing the tools' client leaves a unit.
    pub units: Vec<(String, String)>,
}

/// The side steps (ops whose records [`states`] skips because deleting their resource undoes
/// them) that were interrupted: the last record of the op on its resource is an `intent`.
pub fn interrupted_side_steps(records: &[Record]) -> Vec<InterruptedStep> {
    // Keyed by the journal's strings, so steps settle in the order of their keys.
    let mut last: BTreeMap<(String, String), (Op, Resource, Vec<&Record>)> = BTreeMap::new();
    for record in records
        .iter()
        .filter(|r| r.entry.op.class() == OpClass::WritesInside)
    {
        let key = (
            record.entry.op.as_str().to_owned(),
            record.entry.resource.key(),
        );
        let (_, _, history) = last.entry(key).or_insert_with(|| {
            (
                record.entry.op.clone(),
                record.entry.resource.clone(),
                Vec::new(),
            )
        });
        if record.entry.phase != Phase::Intent {
            history.clear();
        }
        history.push(record);
    }
    last.into_values()
        .filter(|(_, _, history)| {
            history
                .last()
                .is_some_and(|r| r.entry.phase == Phase::Intent)
        })
        .map(|(op, resource, history)| InterruptedStep {
            op,
            resource,
            tools: history
                .iter()
                .filter_map(|r| serde_json::from_value(r.entry.detail.get("tool")?.clone()).ok())
                .collect(),
            units: history
                .iter()
                .filter_map(|r| {
                    let detail = &r.entry.detail;
                    Some((
                        detail.get("unit")?.as_str()?.to_owned(),
                        detail.get("unit_description")?.as_str()?.to_owned(),
                    ))
                })
                .collect(),
        })
        .collect()
}

/// Every resource the journal mentions, keyed (and ordered) by its journal key.
pub fn states(records: &[Record]) -> BTreeMap<String, ResourceState> {
    let mut states: BTreeMap<String, ResourceState> = BTreeMap::new();
    for record in records {
        // Run-level records, the journal's own, probes and reads leave nothing on the node to
        // undo; guest network recovery writes only inside an overlay: deleting it undoes all.
        let class = record.entry.op.class();
        if !class.tracks_a_resource() || !record.entry.resource.is_on_the_node() {
            continue;
        }
        let state = states
            .entry(record.entry.resource.key())
            .or_insert_with(|| ResourceState {
                key: record.entry.resource.key(),
                resource: record.entry.resource.clone(),
                last: record.clone(),
                done_detail: None,
                history: Vec::new(),
            });
        state.history.push(record.clone());
        if record.entry.phase == Phase::Done && class != OpClass::Undoes {
            state.done_detail = Some(record.entry.detail.clone());
        }
        state.last = record.clone();
    }
    states
}

/// The state of one resource, if the journal mentions it.
pub fn state_of(records: &[Record], resource: &Resource) -> Option<ResourceState> {
    states(records).remove(&resource.key())
}

/// Open resources, the most recently touched first: the order cleanup undoes them in.
pub fn open_newest_first(records: &[Record]) -> Vec<ResourceState> {
    let mut open: Vec<ResourceState> = states(records)
        .into_values()
        .filter(ResourceState::is_open)
        .collect();
    open.sort_by_key(|s| std::cmp::Reverse(s.last.entry.seq));
    open
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::journal::Journal;
    use serde_json::json;

    #[test]
    fn open_resources_follow_the_last_record() {
        let dir = std::env::temp_dir().join(format!("certistack-resources-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let run = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
        let mut j = Journal::create(&dir, run).unwrap();
        let mut records = Vec::new();
        let mut add = |op: &str, res: &str, phase, detail| {
            records.push(
                j.append(0, &Op::parse(op), &Resource::parse(res), phase, detail)
                    .unwrap(),
            )
        };
        add("run.begin", "run:x", Phase::Done, json!(null));
        add("backup.map", "backup:a.img", Phase::Intent, json!(null));
        add(
            "backup.map",
            "backup:a.img",
            Phase::Done,
            json!({"loop_device": "/dev/loop3"}),
        );
        add(
            "overlay.create",
            "overlay:9100:a.img",
            Phase::Intent,
            json!(null),
        );
        add(
            "overlay.create",
            "overlay:9100:a.img",
            Phase::Done,
            json!({}),
        );
        add("backup.map", "backup:b.img", Phase::Intent, json!(null));
        add(
            "overlay.delete",
            "overlay:9100:a.img",
            Phase::Intent,
            json!(null),
        );
        add(
            "overlay.delete",
            "overlay:9100:a.img",
            Phase::Undone,
            json!(null),
        );
        let open = open_newest_first(&records);
        let keys: Vec<&str> = open.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["backup:b.img", "backup:a.img"]);
        assert_eq!(
            open[1].done_detail,
            Some(json!({"loop_device": "/dev/loop3"}))
        );
        assert_eq!(
            open[0].done_detail, None,
            "an intent without outcome has no detail"
        );
        assert!(open[0].outcome_unknown(), "an intent without outcome");
        assert!(!open[1].outcome_unknown(), "a done map");
        let failed = |detail| {
            let mut j = Journal::create(&dir.join("x"), run).unwrap();
            let record = j
                .append(
                    0,
                    &Op::BackupMap,
                    &Resource::parse("backup:c.img"),
                    Phase::Failed,
                    detail,
                )
                .unwrap();
            states(&[record]).remove("backup:c.img").unwrap()
        };
        std::fs::create_dir_all(dir.join("x")).unwrap();
        assert!(
            failed(json!({ "outcome_unknown": true })).outcome_unknown(),
            "killed at its deadline"
        );
        std::fs::remove_file(dir.join("x").join(certistack_core::journal::FILE_NAME)).unwrap();
        assert!(
            !failed(json!({ "exit_code": 0 })).outcome_unknown(),
            "reported failure"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keys_parse_into_resources_and_back() {
        for key in [
            "backup:drive-scsi0.img",
            "dir:overlays",
            "overlay:9100:drive-scsi0.img",
            "vm:9100",
            "nft:certistack_0f0e",
            "addr:csbox1",
            "file:screendump:9100",
        ] {
            let resource = Resource::parse(key);
            assert!(
                !matches!(resource, Resource::Unrecognized(_)),
                "{key} not recognized"
            );
            assert_eq!(resource.key(), key);
        }
        assert_eq!(
            Resource::parse("overlay:12:x.img"),
            Resource::Unrecognized("overlay:12:x.img".into()),
            "a VMID below 100 is malformed"
        );
        assert_eq!(
            Resource::parse("backup:../x"),
            Resource::Unrecognized("backup:../x".into())
        );
    }

    #[test]
    fn an_interrupted_recovery_names_the_unit_its_appliance_runs_in() {
        let dir = std::env::temp_dir().join(format!(
            "certistack-side-steps-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let run = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
        let mut j = Journal::create(&dir, run).unwrap();
        let unit = format!("certistack-guestnet-{run}-9100.service");
        let description = format!("CertiStack run {run}: guest network recovery of 9100");
        let intent = json!({ "mode": "rewrite", "unit": unit, "unit_description": description });
        let tool = json!({ "tool": { "pid": 4242, "start_time": 7, "process_group": 4242 } });
        let records = vec![
            j.append(
                0,
                &Op::GuestNetworkRecover,
                &Resource::parse("overlay:9101:a.img"),
                Phase::Intent,
                json!({ "unit": null }),
            )
            .unwrap(),
            j.append(
                0,
                &Op::GuestNetworkRecover,
                &Resource::parse("overlay:9101:a.img"),
                Phase::Done,
                json!({}),
            )
            .unwrap(),
            j.append(
                0,
                &Op::GuestNetworkRecover,
                &Resource::parse("overlay:9100:a.img"),
                Phase::Intent,
                intent,
            )
            .unwrap(),
            j.append(
                0,
                &Op::GuestNetworkRecover,
                &Resource::parse("overlay:9100:a.img"),
                Phase::Intent,
                tool,
            )
            .unwrap(),
        ];
        let steps = interrupted_side_steps(&records);
        assert_eq!(steps.len(), 1, "{steps:?}");
        assert_eq!(steps[0].resource.key(), "overlay:9100:a.img");
        assert_eq!(steps[0].units, [(unit, description)]);
        assert_eq!(steps[0].tools.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
