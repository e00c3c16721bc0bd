//! The metrics file: node_exporter's textfile format (`--collector.textfile.directory`), written
//! after each run, replaced atomically, so the Prometheus a Proxmox cluster already runs reads
//! when each VM last passed without the controller listening on any port.

use crate::history::{RowState, VmSummary};
use crate::verdict::{CleanupState, Outcome, Summary};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

/// The VMs written at most; beyond, `certistack_metrics_vms_left_out` says how many were not.
pub const MAX_VMS: usize = 10_000;

/// What one run adds to the file beside the history's per-VM record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunFacts {
    pub ended_unix_ms: i64,
    pub duration_ms: u64,
    pub passed: usize,
    pub failed: usize,
    pub errors: usize,
    pub cleanup_unproven: usize,
    pub history_write_failures: usize,
    pub notification_failures: usize,
}

impl RunFacts {
    /// The counts of `summaries`, a run that began at `started_unix_ms` and ended at
    /// `ended_unix_ms`.
    pub fn of(summaries: &[Summary], started_unix_ms: i64, ended_unix_ms: i64) -> Self {
        let count = |outcome| summaries.iter().filter(|s| s.outcome == outcome).count();
        Self {
            ended_unix_ms,
            duration_ms: u64::try_from(ended_unix_ms - started_unix_ms).unwrap_or(0),
            passed: count(Outcome::Passed),
            failed: count(Outcome::Failed),
            errors: count(Outcome::Error),
            cleanup_unproven: summaries
                .iter()
                .filter(|s| s.cleanup == CleanupState::Unproven)
                .count(),
            ..Self::default()
        }
    }
}

/// A label value in the text format: backslash, double quote and line feed escaped.
fn label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn seconds(ms: i64) -> String {
    format!("{:.3}", ms as f64 / 1000.0)
}

/// The file's text: one family per metric, HELP and TYPE first, the VMs in VMID order.
pub fn render(vms: &[VmSummary], run: &RunFacts) -> String {
    let mut out = String::new();
    let mut family = |name: &str, help: &str, samples: &mut dyn Iterator<Item = String>| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for sample in samples {
            let _ = writeln!(out, "{name}{sample}");
        }
    };
    let shown = vms.get(..MAX_VMS).unwrap_or(vms);
    let vm = |summary: &VmSummary| {
        format!(
            "vmid=\"{}\",validation=\"{}\"",
            summary.source_vmid,
            label(&summary.validation)
        )
    };
    family(
        "certistack_vm_last_pass_timestamp_seconds",
        "When the VM's newest passed validation ended (0: it never passed).",
        &mut shown.iter().map(|s| {
            format!(
                "{{{}}} {}",
                vm(s),
                s.last_passed_unix_ms.map_or("0".into(), seconds)
            )
        }),
    );
    family(
        "certistack_vm_last_validation_timestamp_seconds",
        "When the VM's newest validation began.",
        &mut shown
            .iter()
            .map(|s| format!("{{{}}} {}", vm(s), seconds(s.last_started_unix_ms))),
    );
    family(
        "certistack_vm_last_state",
        "The VM's newest validation's state (1 for the state it is in): passed, failed, error, running or interrupted.",
        &mut shown
            .iter()
            .map(|s| format!("{{{},state=\"{}\"}} 1", vm(s), s.last_state.as_str())),
    );
    family(
        "certistack_vm_streak",
        "How many of the VM's newest verdicts in a row were the one labelled.",
        &mut shown.iter().filter_map(|s| {
            s.streak.map(|streak| {
                format!(
                    "{{{},verdict=\"{}\"}} {}",
                    vm(s),
                    streak.verdict.as_str(),
                    streak.count
                )
            })
        }),
    );
    family(
        "certistack_vm_restore_seconds",
        "The restore time of the VM's newest pass: from mapping the backup to the guest's first sign of life.",
        &mut shown.iter().filter_map(|s| {
            s.last_restore_ms.map(|ms| {
                format!(
                    "{{{}}} {}",
                    vm(s),
                    seconds(i64::try_from(ms).unwrap_or(i64::MAX))
                )
            })
        }),
    );
    family(
        "certistack_metrics_vms_left_out",
        &format!("VMs of the history not written here (at most {MAX_VMS} are)."),
        &mut std::iter::once(format!(" {}", vms.len() - shown.len())),
    );
    family(
        "certistack_run_end_timestamp_seconds",
        "When the newest run of a plan ended.",
        &mut std::iter::once(format!(" {}", seconds(run.ended_unix_ms))),
    );
    family(
        "certistack_run_duration_seconds",
        "How long the newest run of a plan took.",
        &mut std::iter::once(format!(
            " {}",
            seconds(i64::try_from(run.duration_ms).unwrap_or(i64::MAX))
        )),
    );
    family(
        "certistack_run_validations",
        "The newest run's validations by verdict.",
        &mut [
            (RowState::Passed, run.passed),
            (RowState::Failed, run.failed),
            (RowState::Error, run.errors),
        ]
        .into_iter()
        .map(|(state, count)| format!("{{verdict=\"{}\"}} {count}", state.as_str())),
    );
    family(
        "certistack_run_cleanup_unproven",
        "The newest run's validations whose node could not prove it holds nothing of them.",
        &mut std::iter::once(format!(" {}", run.cleanup_unproven)),
    );
    family(
        "certistack_run_history_write_failures",
        "The newest run's writes to the run history that failed.",
        &mut std::iter::once(format!(" {}", run.history_write_failures)),
    );
    family(
        "certistack_run_notification_failures",
        "The newest run's notifications not delivered after every retry.",
        &mut std::iter::once(format!(" {}", run.notification_failures)),
    );
    out
}

/// Replaces `path` with `text` atomically: a temporary file beside it, synced, mode 0644 (the
/// exporter reads it as another user), renamed over it, the directory synced. A reader sees the
/// old file or the new one, never a part.
pub fn write(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let directory = path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    // node_exporter reads only `*.prom`: a name without the suffix is never read while written.
    // A name no other writer has (create_new refuses an existing file or a link), removed on
    // failure only once it is known to be ours.
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        uuid::Uuid::new_v4().simple()
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&temporary)?;
    let written = (|| {
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        std::fs::File::open(directory)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(vmid: u32, name: &str, passed: Option<i64>) -> VmSummary {
        VmSummary {
            source_vmid: vmid,
            validation: name.into(),
            last_state: if passed.is_some() {
                RowState::Passed
            } else {
                RowState::Failed
            },
            last_started_unix_ms: 1_796_000_000_000,
            last_passed_unix_ms: passed,
            last_failed_unix_ms: None,
            streak: Some(crate::history::Streak {
                verdict: RowState::Passed,
                count: 3,
            }),
            last_restore_ms: passed.map(|_| 9_800),
            restore_trend: None,
        }
    }

    #[test]
    fn label_values_are_escaped_and_a_vm_that_never_passed_reads_zero() {
        let text = render(
            &[
                vm(100, "web01", Some(1_796_000_035_000)),
                vm(101, "a\"b\\c\nd", None),
            ],
            &RunFacts::default(),
        );
        assert!(
            text.contains(
                "certistack_vm_last_pass_timestamp_seconds{vmid=\"100\",validation=\"web01\"} 1796000035.000\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "certistack_vm_last_pass_timestamp_seconds{vmid=\"101\",validation=\"a\\\"b\\\\c\\nd\"} 0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "certistack_vm_restore_seconds{vmid=\"100\",validation=\"web01\"} 9.800\n"
            )
        );
        assert!(
            !text.contains("certistack_vm_restore_seconds{vmid=\"101\""),
            "{text}"
        );
    }

    #[test]
    fn the_file_is_replaced_whole_and_nothing_else_is_left_beside_it() {
        let dir = std::env::temp_dir().join(format!("certistack-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("certistack.prom");
        write(&path, "first\n").unwrap();
        write(&path, "second\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "second\n");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, ["certistack.prom"]);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
