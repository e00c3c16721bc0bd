//! QMP and guest-agent exchanges with a sandbox VM, over the sockets qemu-server creates.
//!
//! Each call connects, negotiates, runs exactly one allowlisted command, and disconnects: a
//! chardev socket serves one client at a time. A granted `guest-exec` assertion holds the
//! agent's socket only per exchange (see [`qga_exec`]), so PVE's own agent calls get through
//! while the program runs.
//! Everything runs under a deadline, because an agent-less guest never answers: the caller gets
//! `DEADLINE_EXCEEDED`, never a hang.
//!
//! - QMP: greeting, `qmp_capabilities`, the command; asynchronous events are skipped.
//! - QGA: `guest-sync-delimited` with a random id (the reply follows a 0xFF byte, which also
//!   flushes whatever a previous client left in the channel), then the command.

use super::context::NodeContext;
use crate::action::{QgaCall, QgaCommand, QmpCommand};
use crate::executor::{ExecError, Outcome};
use crate::resources::{self};
use crate::runs::{RunGuard, RunHandle};
use base64::Engine;
use certistack_core::grant::{Grant, QgaAssertion};
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::Vmid;
use certistack_proto::v1 as pb;
use serde_json::{Value, json};
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Largest reply line accepted from QEMU or the agent.
const MAX_REPLY: usize = 1024 * 1024;
/// The image format the connector asks QEMU's screendump for, and names in its reply.
pub const SCREENDUMP_FORMAT: &str = "png";
/// How often `guest-exec-status` is polled while a granted program runs.
const EXEC_POLL: Duration = Duration::from_millis(200);
/// Bytes of an assertion's stdout kept in the reply.
const STDOUT_KEPT: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("cannot connect to {path}: {error}")]
    Connect { path: String, error: std::io::Error },
    #[error("{0}")]
    Protocol(String),
    #[error("the {what} returned an error: {class}: {desc}")]
    Command {
        what: &'static str,
        class: String,
        desc: String,
    },
    #[error("no answer from {path} within {timeout:?}; {hint}")]
    Timeout {
        path: String,
        timeout: Duration,
        hint: &'static str,
    },
}

impl From<GuestError> for ExecError {
    fn from(error: GuestError) -> Self {
        match error {
            GuestError::Timeout { .. } => ExecError::DeadlineExceeded(error.to_string()),
            GuestError::Connect { .. } => ExecError::FailedPrecondition(error.to_string()),
            GuestError::Command { .. } | GuestError::Protocol(_) => {
                ExecError::FailedPrecondition(error.to_string())
            }
        }
    }
}

struct Channel {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
}

impl Channel {
    async fn connect(path: &Path) -> Result<Self, GuestError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|error| GuestError::Connect {
                path: path.display().to_string(),
                error,
            })?;
        let (read, write) = stream.into_split();
        Ok(Self {
            reader: BufReader::new(read),
            writer: write,
        })
    }

    async fn send(&mut self, message: &Value) -> Result<(), GuestError> {
        let mut line = message.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .await
            .map_err(|e| GuestError::Protocol(format!("write failed: {e}")))
    }

    async fn line(&mut self) -> Result<Value, GuestError> {
        let mut buffer = Vec::new();
        let read = (&mut self.reader)
            .take(MAX_REPLY as u64)
            .read_until(b'\n', &mut buffer)
            .await
            .map_err(|e| GuestError::Protocol(format!("read failed: {e}")))?;
        if read == 0 {
            return Err(GuestError::Protocol(
                "the socket closed without an answer".into(),
            ));
        }
        serde_json::from_slice(&buffer).map_err(|e| GuestError::Protocol(format!("not JSON: {e}")))
    }

    /// The next reply (`return` or `error`), skipping QMP events.
    async fn reply(&mut self, what: &'static str) -> Result<Value, GuestError> {
        loop {
            let message = self.line().await?;
            if let Some(value) = message.get("return") {
                return Ok(value.clone());
            }
            if let Some(error) = message.get("error") {
                return Err(GuestError::Command {
                    what,
                    class: bounded(
                        error
                            .get("class")
                            .and_then(Value::as_str)
                            .unwrap_or("Error"),
                    ),
                    desc: bounded(
                        error
                            .get("desc")
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                    ),
                });
            }
            if message.get("event").is_none() {
                return Err(GuestError::Protocol(format!(
                    "unexpected message: {}",
                    bounded(&message.to_string())
                )));
            }
        }
    }

    /// Discards bytes up to the 0xFF delimiter `guest-sync-delimited` sends before its reply.
    async fn skip_to_delimiter(&mut self) -> Result<(), GuestError> {
        let mut skipped = 0usize;
        loop {
            let byte = self
                .reader
                .read_u8()
                .await
                .map_err(|e| GuestError::Protocol(format!("read failed: {e}")))?;
            if byte == 0xFF {
                return Ok(());
            }
            skipped += 1;
            if skipped > MAX_REPLY {
                return Err(GuestError::Protocol("no guest-sync delimiter".into()));
            }
        }
    }
}

/// Text that came from the guest, made safe for errors, logs and the journal. The guest is
/// untrusted.
fn bounded(text: &str) -> String {
    certistack_core::untrusted::printable(
        text.as_bytes(),
        certistack_core::untrusted::MAX_VALUE_CHARS,
    )
}

async fn with_deadline<T>(
    path: &Path,
    timeout: Duration,
    hint: &'static str,
    work: impl std::future::Future<Output = Result<T, GuestError>>,
) -> Result<T, GuestError> {
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| GuestError::Timeout {
            path: path.display().to_string(),
            timeout,
            hint,
        })?
}

/// One QMP command on `path`.
pub async fn qmp(
    path: &Path,
    execute: &str,
    arguments: Option<Value>,
    timeout: Duration,
) -> Result<Value, GuestError> {
    with_deadline(path, timeout, "is the VM running?", async {
        let mut channel = Channel::connect(path).await?;
        let greeting = channel.line().await?;
        if greeting.get("QMP").is_none() {
            return Err(GuestError::Protocol(format!(
                "not a QMP greeting: {}",
                bounded(&greeting.to_string())
            )));
        }
        channel
            .send(&json!({ "execute": "qmp_capabilities" }))
            .await?;
        channel.reply("QMP negotiation").await?;
        let command = match arguments {
            Some(arguments) => json!({ "execute": execute, "arguments": arguments }),
            None => json!({ "execute": execute }),
        };
        channel.send(&command).await?;
        channel.reply("QMP command").await
    })
    .await
}

/// A synchronized guest-agent channel.
async fn qga_channel(path: &Path) -> Result<Channel, GuestError> {
    let mut channel = Channel::connect(path).await?;
    let id = u64::from(rand_id());
    channel
        .send(&json!({ "execute": "guest-sync-delimited", "arguments": { "id": id } }))
        .await?;
    channel.skip_to_delimiter().await?;
    let answer = channel.reply("guest agent").await?;
    if answer.as_u64() != Some(id) {
        return Err(GuestError::Protocol(format!(
            "guest-sync answered {}, expected {id}",
            bounded(&answer.to_string())
        )));
    }
    Ok(channel)
}

fn rand_id() -> u32 {
    let [a, b, c, d, ..] = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([a, b, c, d]) & 0x7fff_ffff
}

const AGENT_HINT: &str =
    "the guest agent is not running in the guest (or the guest has not booted)";

/// One allowlisted guest-agent command.
pub async fn qga(path: &Path, execute: &str, timeout: Duration) -> Result<Value, GuestError> {
    with_deadline(path, timeout, AGENT_HINT, async {
        let mut channel = qga_channel(path).await?;
        channel.send(&json!({ "execute": execute })).await?;
        channel.reply("guest agent").await
    })
    .await
}

/// What a granted program did in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    pub exit_code: i64,
    pub stdout: String,
    pub stderr: String,
}

/// Runs exactly the granted program with exactly the granted arguments and waits for it.
///
/// The agent's socket serves one client at a time and qemu-server's own agent calls give up
/// after a few seconds, so the socket is held only per exchange: `guest-exec` on one
/// connection, then each `guest-exec-status` on a fresh, freshly synchronized connection, with
/// the socket released between polls. The agent keeps a started program's status (and its
/// captured output) until a status call sees it exited, whichever connection asks.
pub async fn qga_exec(
    path: &Path,
    assertion: &QgaAssertion,
    exchange_timeout: Duration,
) -> Result<ExecResult, GuestError> {
    let budget = exchange_timeout + Duration::from_secs(u64::from(assertion.timeout_secs));
    with_deadline(path, budget, AGENT_HINT, async {
        let args: Vec<&str> = assertion.args.iter().map(|a| a.as_str()).collect();
        let exec = json!({
            "execute": "guest-exec",
            "arguments": { "path": assertion.program.as_str(), "arg": args, "capture-output": true }
        });
        let started = qga_exchange(path, &exec, "guest-exec", exchange_timeout).await?;
        let pid = started.get("pid").and_then(Value::as_i64).ok_or_else(|| {
            GuestError::Protocol(format!(
                "guest-exec gave no pid: {}",
                bounded(&started.to_string())
            ))
        })?;
        let poll = json!({ "execute": "guest-exec-status", "arguments": { "pid": pid } });
        loop {
            tokio::time::sleep(EXEC_POLL).await;
            let status = qga_exchange(path, &poll, "guest-exec-status", exchange_timeout).await?;
            if status.get("exited").and_then(Value::as_bool) == Some(true) {
                let decode = |key: &str| {
                    let data = status.get(key).and_then(Value::as_str).unwrap_or_default();
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .unwrap_or_default();
                    String::from_utf8_lossy(&bytes).into_owned()
                };
                return Ok(ExecResult {
                    exit_code: status.get("exitcode").and_then(Value::as_i64).unwrap_or(-1),
                    stdout: decode("out-data"),
                    stderr: decode("err-data"),
                });
            }
        }
    })
    .await
}

/// One command on a connection of its own: connect, synchronize, ask, disconnect.
async fn qga_exchange(
    path: &Path,
    command: &Value,
    what: &'static str,
    timeout: Duration,
) -> Result<Value, GuestError> {
    with_deadline(path, timeout, AGENT_HINT, async {
        let mut channel = qga_channel(path).await?;
        channel.send(command).await?;
        channel.reply(what).await
    })
    .await
}

fn truncated(text: &str) -> String {
    if text.len() <= STDOUT_KEPT {
        return text.to_owned();
    }
    let mut end = STDOUT_KEPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default().to_owned()
}

/// The executor of guest calls: QMP and guest-agent commands to a run's VM over its sockets,
/// and the screendumps QMP writes to the run directory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guests<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn guests(&self) -> Guests<'_> {
        Guests { ctx: self }
    }
}

impl Guests<'_> {
    fn socket(&self, vmid: Vmid, suffix: &str) -> PathBuf {
        self.ctx
            .config
            .pve
            .qemu_server_run_dir
            .join(format!("{vmid}.{suffix}"))
    }

    fn guest_timeout(&self) -> Duration {
        Duration::from_secs(self.ctx.config.limits.guest_timeout_secs)
    }

    pub(super) async fn qmp(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        command: QmpCommand,
    ) -> Result<Outcome, ExecError> {
        let mut guard = self.ctx.lock_open(run).await?;
        self.ctx.vms().require_ours(&guard, &run.grant, vmid)?;
        let resource = Resource::Vm(vmid);
        let mut arguments = None;
        if command == QmpCommand::Screendump {
            let path = self.ctx.overlays().screendump_path(&run.grant, vmid);
            let key = Resource::Screendump(vmid);
            if !resources::state_of(&guard.records(), &Resource::OverlayDir)
                .is_some_and(|s| s.is_open())
            {
                return Err(ExecError::FailedPrecondition(
                    "the run has no directory for a screendump yet".into(),
                ));
            }
            guard
                .intent(
                    self.ctx.now_ms(),
                    &Op::FileScreendump,
                    &key,
                    json!({ "path": path.display().to_string() }),
                )
                .await?;
            // QEMU opens the path it is given and follows links: it gets a file created here,
            // without following any, in the run's checked directory (a previous screendump of
            // the run is replaced).
            if let Err(error) = self.ctx.overlays().create_run_file(
                &run.grant,
                &super::overlay::screendump_file_name(vmid),
                true,
            ) {
                return Err(self
                    .ctx
                    .journal_step_error(&mut guard, &Op::FileScreendump, &key, error)
                    .await);
            }
            // PNG (QEMU 7.1 and later; PVE 9 ships 10.x): a tenth of the PPM's size, and the
            // format the report keeps.
            arguments = Some(json!({ "filename": path.display().to_string(), "format": "png" }));
        }
        let started = Instant::now();
        guard
            .intent(
                self.ctx.now_ms(),
                &Op::GuestQmp,
                &resource,
                json!({ "command": command.wire_name() }),
            )
            .await?;
        let result = qmp(
            &self.socket(vmid, "qmp"),
            command.wire_name(),
            arguments,
            self.guest_timeout(),
        )
        .await;
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match result {
            Ok(value) => {
                guard.done(self.ctx.now_ms(), &Op::GuestQmp, &resource, json!({ "command": command.wire_name(), "return": value, "elapsed_ms": elapsed_ms })).await?;
                let mut image = Vec::new();
                if command == QmpCommand::Screendump {
                    image = self.take_screendump(&mut guard, &run.grant, vmid).await?;
                }
                Ok(Outcome::Qmp(pb::QmpReply {
                    result_json: value.to_string(),
                    elapsed_ms,
                    journal_head: guard.head_hex(),
                    image_format: if image.is_empty() {
                        String::new()
                    } else {
                        SCREENDUMP_FORMAT.to_owned()
                    },
                    image,
                }))
            }
            Err(error) => {
                guard.failed(self.ctx.now_ms(), &Op::GuestQmp, &resource, json!({ "command": command.wire_name(), "error": error.to_string(), "elapsed_ms": elapsed_ms })).await?;
                Err(error.into())
            }
        }
    }

    /// Reads the screendump QEMU just wrote and journals it `done` with its size and SHA-256.
    /// One over `limits.max_screendump_bytes` is removed (journaled) and refused with
    /// RESOURCE_EXHAUSTED.
    async fn take_screendump(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        vmid: Vmid,
    ) -> Result<Vec<u8>, ExecError> {
        let path = self.ctx.overlays().screendump_path(grant, vmid);
        let key = Resource::Screendump(vmid);
        let max = self.ctx.config.limits.max_screendump_bytes;
        let name = super::overlay::screendump_file_name(vmid);
        let read = {
            let ctx = self.ctx.clone();
            let grant = grant.clone();
            tokio::task::spawn_blocking(move || ctx.overlays().read_run_file(&grant, &name, max))
                .await
                .map_err(|error| {
                    ExecError::Failed(format!("reading the screendump stopped: {error}"))
                })
                .and_then(|read| read)
        };
        let image = match read {
            Ok(Some(image)) => image,
            Ok(None) => {
                let detail = json!({ "path": path.display().to_string(), "error": format!("larger than {max} bytes") });
                guard
                    .failed(self.ctx.now_ms(), &Op::FileScreendump, &key, detail)
                    .await?;
                self.ctx
                    .overlays()
                    .remove_path(guard, Op::FileDelete, &key, &path)
                    .await?;
                return Err(ExecError::ResourceExhausted(format!(
                    "the screendump of VM {vmid} is larger than {max} bytes (limits.max_screendump_bytes); it was removed: raise the limit or lower the guest's display resolution"
                )));
            }
            Err(error) => {
                return Err(self
                    .ctx
                    .journal_step_error(guard, &Op::FileScreendump, &key, error)
                    .await);
            }
        };
        let sha256 = hex::encode(sha2::Sha256::digest(&image));
        guard
            .done(
                self.ctx.now_ms(),
                &Op::FileScreendump,
                &key,
                json!({ "path": path.display().to_string(), "bytes": image.len(), "format": SCREENDUMP_FORMAT, "sha256": sha256 }),
            )
            .await?;
        Ok(image)
    }

    pub(super) async fn qga(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        call: QgaCall,
    ) -> Result<Outcome, ExecError> {
        let mut guard = self.ctx.lock_open(run).await?;
        self.ctx.vms().require_ours(&guard, &run.grant, vmid)?;
        let resource = Resource::Vm(vmid);
        let path = self.socket(vmid, "qga");
        let started = Instant::now();
        match call {
            QgaCall::Command(command) => {
                guard
                    .intent(
                        self.ctx.now_ms(),
                        &Op::GuestQga,
                        &resource,
                        json!({ "command": command.wire_name() }),
                    )
                    .await?;
                let result = qga(&path, command.wire_name(), self.guest_timeout()).await;
                self.finish_qga(&mut guard, &resource, command, result, started)
                    .await
            }
            QgaCall::Assertion(id) => {
                let assertion = run.grant.qga_assertions.get(&id).ok_or_else(|| {
                    ExecError::FailedPrecondition(format!("assertion {id} is not in the grant"))
                })?;
                let argv: Vec<&str> = assertion.args.iter().map(|a| a.as_str()).collect();
                guard.intent(
                    self.ctx.now_ms(),
                    &Op::GuestExec,
                    &resource,
                    json!({ "assertion": id.as_str(), "program": assertion.program.as_str(), "args": argv }),
                ).await?;
                let result = qga_exec(&path, assertion, self.guest_timeout()).await;
                let elapsed_ms = started.elapsed().as_millis() as u64;
                match result {
                    Ok(exec) => {
                        let exit_ok = exec.exit_code == i64::from(assertion.expect_exit_code);
                        let stdout_ok = assertion
                            .expect_stdout_contains
                            .as_ref()
                            .is_none_or(|e| exec.stdout.contains(e.as_str()));
                        let passed = exit_ok && stdout_ok;
                        let stdout = truncated(&exec.stdout);
                        guard.done(
                            self.ctx.now_ms(),
                            &Op::GuestExec,
                            &resource,
                            json!({ "assertion": id.as_str(), "exit_code": exec.exit_code, "passed": passed, "stdout": stdout, "elapsed_ms": elapsed_ms }),
                        ).await?;
                        Ok(Outcome::Qga(pb::QgaReply {
                            result_json: json!({ "exitcode": exec.exit_code, "stdout": stdout, "stderr": truncated(&exec.stderr) }).to_string(),
                            exit_code: i32::try_from(exec.exit_code).unwrap_or(i32::MIN),
                            assertion_passed: passed,
                            elapsed_ms,
                            journal_head: guard.head_hex(),
                        }))
                    }
                    Err(error) => {
                        guard.failed(self.ctx.now_ms(), &Op::GuestExec, &resource, json!({ "assertion": id.as_str(), "error": error.to_string(), "elapsed_ms": elapsed_ms })).await?;
                        Err(error.into())
                    }
                }
            }
        }
    }

    async fn finish_qga(
        &self,
        guard: &mut crate::runs::RunGuard<'_>,
        resource: &Resource,
        command: QgaCommand,
        result: Result<Value, GuestError>,
        started: Instant,
    ) -> Result<Outcome, ExecError> {
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match result {
            Ok(value) => {
                guard
                    .done(
                        self.ctx.now_ms(),
                        &Op::GuestQga,
                        resource,
                        json!({ "command": command.wire_name(), "elapsed_ms": elapsed_ms }),
                    )
                    .await?;
                Ok(Outcome::Qga(pb::QgaReply {
                    result_json: value.to_string(),
                    exit_code: 0,
                    assertion_passed: false,
                    elapsed_ms,
                    journal_head: guard.head_hex(),
                }))
            }
            Err(error) => {
                guard.failed(self.ctx.now_ms(), &Op::GuestQga, resource, json!({ "command": command.wire_name(), "error": error.to_string(), "elapsed_ms": elapsed_ms })).await?;
                Err(error.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bounded;

    #[test]
    fn guest_text_is_bounded_and_escaped() {
        assert_eq!(bounded("fine"), "fine");
        assert_eq!(
            bounded("a\nforged: log line\u{1b}[31m"),
            "a\\nforged: log line\\u{1b}[31m"
        );
        let long = "x".repeat(5000);
        assert!(
            bounded(&long).starts_with(&"x".repeat(certistack_core::untrusted::MAX_VALUE_CHARS))
        );
        assert!(bounded(&long).ends_with("…[4744 more bytes]"));
    }
}
