//! What a run has on the node, as its journal says.
//!
//! Every side effect is journaled under a resource key (`backup:<archive>`,
//! `overlay:<vmid>:<archive>`, `dir:overlays`, ...). A resource is open when its last record is
//! not `undone`: an `intent` without an outcome (the daemon died in between), a `done`, or a
//! `failed` that may have left something behind. Cleanup reverses open resources newest first.

use crate::journal::{Phase, Record};
use std::collections::BTreeMap;

/// The last record of one resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceState {
    pub key: String,
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

    /// Whether the last step's effect on the node is unknown: its `intent` has no outcome (the
    /// daemon died), or its tool was killed or lost before it reported (`outcome_unknown`).
    pub fn outcome_unknown(&self) -> bool {
        let entry = &self.last.entry;
        entry.phase == Phase::Intent
            || (entry.phase == Phase::Failed
                && entry
                    .detail
                    .get("outcome_unknown")
                    .and_then(serde_json::Value::as_bool)
                    == Some(true))
    }
}

/// Every resource the journal mentions, keyed by resource.
pub fn states(records: &[Record]) -> BTreeMap<String, ResourceState> {
    let mut states: BTreeMap<String, ResourceState> = BTreeMap::new();
    for record in records {
        // Run-level records and probes leave nothing on the node to undo.
        if record.entry.resource.starts_with("run:")
            || record.entry.op.starts_with("journal.")
            || record.entry.op.starts_with("probe.")
        {
            continue;
        }
        let state = states
            .entry(record.entry.resource.clone())
            .or_insert_with(|| ResourceState {
                key: record.entry.resource.clone(),
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
    use crate::journal::Journal;
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
        std::fs::remove_file(dir.join("x").join(crate::journal::FILE_NAME)).unwrap();
        assert!(
            !failed(json!({ "exit_code": 0 })).outcome_unknown(),
            "reported failure"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
