//! What a run has on the node, as its journal says.
//!
//! Every side effect is journaled under a resource key (`backup:<archive>`,
//! `overlay:<vmid>:<archive>`, `dir:overlays`, ...). Keys are parsed once, here, into
//! [`Resource`]; the strings stay the journal's wire format. A resource is open when its last
//! record is not `undone`: an `intent` without an outcome (the daemon died in between), a
//! `done`, or a `failed` that may have left something behind. Cleanup reverses open resources
//! newest first.
//!
//! The node executor decides from this what to undo; the run registry decides from it whether a
//! run still holds something (it may not close, and still counts against the node's limits).

use crate::process::ToolIdentity;
use certistack_core::journal::{Phase, Record};
use certistack_core::validate::{ArchiveName, Validated, Vmid, VnetName};
use certistack_proto::v1 as pb;
use std::collections::BTreeMap;
use std::fmt;

/// One thing a run can leave on the node, named as its journal key names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    /// `backup:<archive>`: a read-only loop device mapped by `proxmox-backup-client map`.
    Backup(ArchiveName),
    /// `dir:overlays`: the run's directory under the overlay root.
    OverlayDir,
    /// `overlay:<vmid>:<archive>`: a qcow2 overlay on a mapping.
    Overlay { vmid: Vmid, archive: ArchiveName },
    /// `vm:<vmid>`: a sandbox VM.
    Vm(Vmid),
    /// `nft:<table>`: the run's nftables table.
    NftTable(String),
    /// `addr:<vnet>`: the probe address on the VNet.
    ProbeAddress(VnetName),
    /// `fwd:<vnet>`: the VNet's forwarding sysctls, set to 0 for the run
    /// (`sandbox.forwarding = "disable-for-run"`).
    Forwarding(VnetName),
    /// `file:screendump:<vmid>`: a screendump in the run's directory.
    Screendump(Vmid),
    /// A key this connector does not know (a journal written by a newer version).
    Unrecognized(String),
}

fn vmid(text: &str) -> Option<Vmid> {
    Vmid::parse("journal", text.parse().ok()?).ok()
}

impl Resource {
    /// Parses a journal key; unknown or malformed keys stay [`Resource::Unrecognized`].
    pub fn parse(key: &str) -> Self {
        let parsed = if let Some(archive) = key.strip_prefix("backup:") {
            ArchiveName::validate(archive).ok().map(Resource::Backup)
        } else if key == "dir:overlays" {
            Some(Resource::OverlayDir)
        } else if let Some(rest) = key.strip_prefix("overlay:") {
            rest.split_once(':').and_then(|(v, a)| {
                Some(Resource::Overlay {
                    vmid: vmid(v)?,
                    archive: ArchiveName::validate(a).ok()?,
                })
            })
        } else if let Some(v) = key.strip_prefix("vm:") {
            vmid(v).map(Resource::Vm)
        } else if let Some(table) = key.strip_prefix("nft:") {
            Some(Resource::NftTable(table.to_owned()))
        } else if let Some(vnet) = key.strip_prefix("addr:") {
            VnetName::validate(vnet).ok().map(Resource::ProbeAddress)
        } else if let Some(vnet) = key.strip_prefix("fwd:") {
            VnetName::validate(vnet).ok().map(Resource::Forwarding)
        } else if let Some(v) = key.strip_prefix("file:screendump:") {
            vmid(v).map(Resource::Screendump)
        } else {
            None
        };
        parsed.unwrap_or_else(|| Resource::Unrecognized(key.to_owned()))
    }

    /// The journal key.
    pub fn key(&self) -> String {
        self.to_string()
    }

    /// Whether undoing this resource touches the sandbox network.
    pub fn is_network(&self) -> bool {
        matches!(
            self,
            Resource::NftTable(_) | Resource::ProbeAddress(_) | Resource::Forwarding(_)
        )
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resource::Backup(archive) => write!(f, "backup:{archive}"),
            Resource::OverlayDir => f.write_str("dir:overlays"),
            Resource::Overlay { vmid, archive } => write!(f, "overlay:{vmid}:{archive}"),
            Resource::Vm(vmid) => write!(f, "vm:{vmid}"),
            Resource::NftTable(table) => write!(f, "nft:{table}"),
            Resource::ProbeAddress(vnet) => write!(f, "addr:{vnet}"),
            Resource::Forwarding(vnet) => write!(f, "fwd:{vnet}"),
            Resource::Screendump(vmid) => write!(f, "file:screendump:{vmid}"),
            Resource::Unrecognized(key) => f.write_str(key),
        }
    }
}

/// The journaled operations of the node executor, as their `op` strings are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    BackupMap,
    BackupUnmap,
    OverlayDir,
    OverlayDirDelete,
    OverlayCreate,
    OverlayDelete,
    FileScreendump,
    FileDelete,
    VmCreate,
    VmStart,
    VmStop,
    VmDestroy,
    /// `qm unlock`: drops the `lock: create` a `qm create` cut short left behind.
    VmUnlock,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::BackupMap => "backup.map",
            Op::BackupUnmap => "backup.unmap",
            Op::OverlayDir => "overlay.dir",
            Op::OverlayDirDelete => "overlay.dir.delete",
            Op::OverlayCreate => "overlay.create",
            Op::OverlayDelete => "overlay.delete",
            Op::FileScreendump => "file.screendump",
            Op::FileDelete => "file.delete",
            Op::VmCreate => "vm.create",
            Op::VmStart => "vm.start",
            Op::VmStop => "vm.stop",
            Op::VmDestroy => "vm.destroy",
            Op::VmUnlock => "vm.unlock",
        }
    }
}

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
    pub op: String,
    pub key: String,
    pub tools: Vec<ToolIdentity>,
    /// Transient units the step started its tools in, (name, description), as its intents
    /// name them (`unit`, `unit_description`): killing the tools' client leaves a unit.
    pub units: Vec<(String, String)>,
}

/// The side steps (ops whose records [`states`] skips because deleting their resource undoes
/// them) that were interrupted: the last record of the op on its resource is an `intent`.
pub fn interrupted_side_steps(records: &[Record]) -> Vec<InterruptedStep> {
    let mut last: BTreeMap<(String, String), Vec<&Record>> = BTreeMap::new();
    for record in records
        .iter()
        .filter(|r| r.entry.op.starts_with("guestnet."))
    {
        let key = (record.entry.op.clone(), record.entry.resource.clone());
        let history = last.entry(key).or_default();
        if record.entry.phase != Phase::Intent {
            history.clear();
        }
        history.push(record);
    }
    last.into_iter()
        .filter(|(_, history)| {
            history
                .last()
                .is_some_and(|r| r.entry.phase == Phase::Intent)
        })
        .map(|((op, key), history)| InterruptedStep {
            op,
            key,
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

/// Every resource the journal mentions, keyed by resource.
pub fn states(records: &[Record]) -> BTreeMap<String, ResourceState> {
    let mut states: BTreeMap<String, ResourceState> = BTreeMap::new();
    for record in records {
        // Run-level records and probes leave nothing on the node to undo.
        if record.entry.resource.starts_with("run:")
            || record.entry.op.starts_with("journal.")
            || record.entry.op.starts_with("probe.")
            || record.entry.op.starts_with("source.")
            // Guest network recovery writes only inside an overlay: deleting it undoes all.
            || record.entry.op.starts_with("guestnet.")
        {
            continue;
        }
        let state = states
            .entry(record.entry.resource.clone())
            .or_insert_with(|| ResourceState {
                key: record.entry.resource.clone(),
                resource: Resource::parse(&record.entry.resource),
                last: record.clone(),
                done_detail: None,
                history: Vec::new(),
            });
        state.history.push(record.clone());
        if record.entry.phase == Phase::Done
            && !record.entry.op.ends_with(".delete")
            && !record.entry.op.ends_with(".unmap")
        {
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
            records.push(j.append(0, op, res, phase, detail).unwrap())
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
                .append(0, "backup.map", "backup:c.img", Phase::Failed, detail)
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
                "guestnet.recover",
                "overlay:9101:a.img",
                Phase::Intent,
                json!({ "unit": null }),
            )
            .unwrap(),
            j.append(
                0,
                "guestnet.recover",
                "overlay:9101:a.img",
                Phase::Done,
                json!({}),
            )
            .unwrap(),
            j.append(
                0,
                "guestnet.recover",
                "overlay:9100:a.img",
                Phase::Intent,
                intent,
            )
            .unwrap(),
            j.append(
                0,
                "guestnet.recover",
                "overlay:9100:a.img",
                Phase::Intent,
                tool,
            )
            .unwrap(),
        ];
        let steps = interrupted_side_steps(&records);
        assert_eq!(steps.len(), 1, "{steps:?}");
        assert_eq!(steps[0].key, "overlay:9100:a.img");
        assert_eq!(steps[0].units, [(unit, description)]);
        assert_eq!(steps[0].tools.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
