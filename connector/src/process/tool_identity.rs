//! What identifies a started tool's processes across a restart of the daemon, read from
//! `/proc`: the leader's pid with its start time, and its process group.

use std::time::{Duration, Instant};

/// What identifies a started tool's processes on this node, across a restart of the daemon:
/// the leader's pid with its start time (`/proc/<pid>/stat` field 22, clock ticks since boot),
/// so a reused pid is never mistaken for it, and its process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ToolIdentity {
    pub pid: i32,
    pub start_time: u64,
    pub process_group: i32,
}

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    pid: i32,
    parent: i32,
    process_group: i32,
    start_time: u64,
    /// A zombie (or dead) process can no longer act: it counts as gone.
    exited: bool,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may itself contain ") ": the fields
    // after it start at the last ')'.
    let rest = text.get(text.rfind(')')?.saturating_add(1)..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): field N is at index N - 3.
    let state = fields.first()?;
    Some(ProcStat {
        pid,
        parent: fields.get(1)?.parse().ok()?,
        process_group: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
        exited: matches!(*state, "Z" | "X" | "x"),
    })
}

fn all_processes() -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_stat)
        .collect()
}

impl ToolIdentity {
    pub(crate) fn of(pid: i32) -> Option<Self> {
        let stat = proc_stat(pid)?;
        Some(Self {
            pid,
            start_time: stat.start_time,
            process_group: stat.process_group,
        })
    }

    /// The live processes that belong to this tool: its leader while it is still the same
    /// process, the leader's descendants (a child that left the group with `setsid`, as a
    /// map's holder does, is still a descendant while the leader lives), and every member of
    /// its process group that started no earlier than the leader. A process group id cannot be
    /// reused while any member lives, so members are the tool's unless the leader's pid now
    /// names a different process.
    fn survivors(&self) -> Vec<(i32, u64)> {
        let processes = all_processes();
        let leader = processes.iter().find(|p| p.pid == self.pid);
        if leader.is_some_and(|l| l.start_time != self.start_time) {
            return Vec::new();
        }
        let mut ours: Vec<ProcStat> = processes
            .iter()
            .filter(|p| p.process_group == self.process_group && p.start_time >= self.start_time)
            .copied()
            .collect();
        if leader.is_some() {
            let mut frontier = vec![self.pid];
            while let Some(parent) = frontier.pop() {
                for child in processes.iter().filter(|p| p.parent == parent) {
                    if !ours.iter().any(|o| o.pid == child.pid) {
                        ours.push(*child);
                    }
                    if ours.len() < 4096 {
                        frontier.push(child.pid);
                    }
                }
            }
        }
        ours.iter()
            .filter(|p| !p.exited)
            .map(|p| (p.pid, p.start_time))
            .collect()
    }

    /// Kills every surviving process of the tool and waits until none is left, for at most
    /// `within`. Returns how many processes were killed, or what is still running.
    pub async fn reap(&self, within: Duration) -> Result<usize, String> {
        let started = Instant::now();
        let mut killed = 0usize;
        loop {
            let survivors = self.survivors();
            if survivors.is_empty() {
                return Ok(killed);
            }
            if started.elapsed() >= within {
                return Err(format!(
                    "processes {:?} of the tool started as pid {} (group {}) are still running {:?} after SIGKILL",
                    survivors.iter().map(|(pid, _)| pid).collect::<Vec<_>>(),
                    self.pid,
                    self.process_group,
                    within
                ));
            }
            for (pid, start_time) in survivors {
                // Re-check just before the signal: the pid must still be the same process.
                if proc_stat(pid).is_some_and(|p| p.start_time == start_time)
                    && let Some(pid) = rustix::process::Pid::from_raw(pid)
                    && rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok()
                {
                    killed = killed.saturating_add(1);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// How long a killed tool's processes get to disappear before the kill is reported as failed.
pub const REAP_WITHIN: Duration = Duration::from_secs(10);
