//! The run's overlay directory (`dir:overlays`), its qcow2 overlays
//! (`overlay:<vmid>:<archive>`) and its screendumps (`file:screendump:<vmid>`).
//!
//! Everything lives in `<overlay root>/<run id>`, a path derived from the run id only. Before
//! anything is created there, the overlay root and the run directory are checked: a real
//! directory (not a symlink), owned by root or the daemon's user, writable by no group and no
//! other user; a directory that fails is refused with what to fix. Files are created with
//! `openat(O_CREAT | O_EXCL | O_NOFOLLOW)` on the checked directory, so a planted link is never
//! followed; tools (`qemu-img`, QEMU's screendump) then get the path of the file just created
//! in a directory nobody else can write to.

use super::backup::Backups;
use super::context::NodeContext;
use super::{tool_detail, tool_result};
use crate::executor::{ExecError, Outcome};
use crate::process::ToolCall;
use crate::resources::EndState;
use crate::runs::{RunGuard, RunHandle};
use certistack_core::grant::Grant;
use certistack_core::journal::{Op, Resource};
use certistack_core::validate::{ArchiveName, Vmid};
use certistack_proto::v1 as pb;
use rustix::fs::{AtFlags, Mode, OFlags};
use serde_json::json;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Refuses a directory that another user could change under the daemon.
fn check_directory(
    what: &str,
    path: &Path,
    stat: &rustix::fs::Stat,
    fix: &str,
) -> Result<(), ExecError> {
    let mode = stat.st_mode;
    let is_dir = rustix::fs::FileType::from_raw_mode(mode) == rustix::fs::FileType::Directory;
    if !is_dir {
        return Err(ExecError::FailedPrecondition(format!(
            "the {what} {} is not a directory (a symlink is refused); {fix}",
            path.display()
        )));
    }
    let daemon = rustix::process::geteuid().as_raw();
    if stat.st_uid != 0 && stat.st_uid != daemon {
        return Err(ExecError::FailedPrecondition(format!(
            "the {what} {} is owned by uid {}, not by root or the connector's user; {fix}",
            path.display(),
            stat.st_uid
        )));
    }
    if mode & 0o022 != 0 {
        return Err(ExecError::FailedPrecondition(format!(
            "the {what} {} is writable by its group or others (mode {:o}); {fix}",
            path.display(),
            mode & 0o7777
        )));
    }
    Ok(())
}

const DIRECTORY_FLAGS: OFlags = OFlags::DIRECTORY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC)
    .union(OFlags::RDONLY);

fn io_refusal(what: &str, path: &Path, error: impl std::fmt::Display) -> ExecError {
    ExecError::FailedPrecondition(format!(
        "cannot open the {what} {}: {error}",
        path.display()
    ))
}

/// The executor of overlays: creates and deletes the copy-on-write overlays VMs boot from,
/// and the run directory under the overlay root that holds them and the run's files.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Overlays<'a> {
    ctx: &'a NodeContext,
}

impl NodeContext {
    pub(in crate::node) fn overlays(&self) -> Overlays<'_> {
        Overlays { ctx: self }
    }
}

impl Overlays<'_> {
    /// `<overlay root>/<run id>`: the only directory overlays are created in.
    pub(super) fn overlay_dir(&self, grant: &Grant) -> PathBuf {
        self.ctx
            .config
            .paths
            .overlay_root
            .join(grant.run_id.as_str())
    }

    /// The one path an overlay of `archive` for `vmid` can have.
    pub(super) fn overlay_path(&self, grant: &Grant, vmid: Vmid, archive: &ArchiveName) -> PathBuf {
        self.overlay_dir(grant)
            .join(overlay_file_name(vmid, archive))
    }

    pub(super) fn screendump_path(&self, grant: &Grant, vmid: Vmid) -> PathBuf {
        self.overlay_dir(grant).join(screendump_file_name(vmid))
    }

    /// Opens the checked overlay root, then the run's directory in it (created 0700 when
    /// `create`), checked the same way; never through a symlink.
    pub(super) fn open_run_dir(&self, grant: &Grant, create: bool) -> Result<OwnedFd, ExecError> {
        let root_path = &self.ctx.config.paths.overlay_root;
        let root = self.open_overlay_root()?;
        let name = grant.run_id.as_str();
        let dir_path = root_path.join(name);
        if create {
            match rustix::fs::mkdirat(&root, name, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => {
                    return Err(ExecError::FailedPrecondition(format!(
                        "cannot create {}: {e}",
                        dir_path.display()
                    )));
                }
            }
        }
        let dir = rustix::fs::openat(&root, name, DIRECTORY_FLAGS, Mode::empty())
            .map_err(|e| io_refusal("run directory", &dir_path, e))?;
        let stat =
            rustix::fs::fstat(&dir).map_err(|e| io_refusal("run directory", &dir_path, e))?;
        check_directory(
            "run directory",
            &dir_path,
            &stat,
            &format!(
                "it was not made by this connector: inspect and remove {}, then retry",
                dir_path.display()
            ),
        )?;
        Ok(dir)
    }

    /// Reads the run file `name` from the run's checked directory, never through a link:
    /// `Ok(None)` when it holds more than `max_bytes` (nothing of it is read into memory).
    pub(super) fn read_run_file(
        &self,
        grant: &Grant,
        name: &str,
        max_bytes: usize,
    ) -> Result<Option<Vec<u8>>, ExecError> {
        use std::io::Read;
        let dir = self.open_run_dir(grant, false)?;
        let path = self.overlay_dir(grant).join(name);
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let file = rustix::fs::openat(&dir, name, flags, Mode::empty())
            .map_err(|e| ExecError::Failed(format!("cannot open {}: {e}", path.display())))?;
        let stat = rustix::fs::fstat(&file)
            .map_err(|e| ExecError::Failed(format!("cannot stat {}: {e}", path.display())))?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(ExecError::Failed(format!(
                "{} is not a regular file; it was not written by QEMU for this run",
                path.display()
            )));
        }
        let limit = u64::try_from(max_bytes).unwrap_or(u64::MAX);
        let mut bytes = Vec::new();
        std::fs::File::from(file)
            .take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|e| ExecError::Failed(format!("cannot read {}: {e}", path.display())))?;
        if bytes.len() > max_bytes {
            return Ok(None);
        }
        Ok(Some(bytes))
    }

    /// Creates an empty file `name` in the run's checked directory, never following a link
    /// and never reusing a file that exists. `replace` first removes a previous file of the
    /// run's (a link is removed, not followed).
    pub(super) fn create_run_file(
        &self,
        grant: &Grant,
        name: &str,
        replace: bool,
    ) -> Result<PathBuf, ExecError> {
        let dir = self.open_run_dir(grant, false)?;
        let path = self.overlay_dir(grant).join(name);
        if replace {
            match rustix::fs::unlinkat(&dir, name, AtFlags::empty()) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => {
                    return Err(ExecError::Failed(format!(
                        "cannot remove the previous {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        let flags =
            OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::WRONLY;
        match rustix::fs::openat(&dir, name, flags, Mode::from_raw_mode(0o600)) {
            Ok(_file) => Ok(path),
            Err(rustix::io::Errno::EXIST) => Err(ExecError::AlreadyExists(format!(
                "{} already exists; it was not created by this call",
                path.display()
            ))),
            Err(e) => Err(ExecError::FailedPrecondition(format!(
                "cannot create {}: {e}",
                path.display()
            ))),
        }
    }

    pub(super) async fn create(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let states = crate::resources::states(&guard.records());
        let backup = Resource::Backup(archive.clone());
        let device = Backups::mapped_device(states.get(&backup.key())).ok_or_else(|| {
            ExecError::FailedPrecondition(format!(
                "{archive} is not mapped by this run; call MapBackup first"
            ))
        })?;
        self.ctx.backups().check_mapping(grant, &archive, &device)?;
        let resource = Resource::Overlay {
            vmid,
            archive: archive.clone(),
        };
        if states.get(&resource.key()).is_some_and(|s| s.is_open()) {
            return Err(ExecError::AlreadyExists(format!(
                "the overlay of {archive} for VM {vmid} already exists"
            )));
        }
        let dir = self.overlay_dir(grant);
        let dir_key = Resource::OverlayDir;
        let dir_op = &Op::OverlayDir;
        if states.get(&dir_key.key()).is_none_or(|s| !s.is_open()) {
            // The root is checked before the directory's intent is journaled: a refused root
            // leaves nothing to clean up.
            self.open_overlay_root()?;
            guard
                .intent(
                    self.ctx.now_ms(),
                    dir_op,
                    &dir_key,
                    json!({ "path": dir.display().to_string() }),
                )
                .await?;
            if let Err(error) = self.open_run_dir(grant, true) {
                return Err(self
                    .ctx
                    .journal_step_error(&mut guard, dir_op, &dir_key, error)
                    .await);
            }
            guard
                .done(
                    self.ctx.now_ms(),
                    dir_op,
                    &dir_key,
                    json!({ "path": dir.display().to_string() }),
                )
                .await?;
        }
        let op = &Op::OverlayCreate;
        let path = self.overlay_path(grant, vmid, &archive);
        let name = overlay_file_name(vmid, &archive);
        // Checked before the intent: an existing file is not this call's to clean up.
        let dir_fd = self.open_run_dir(grant, false)?;
        if rustix::fs::statat(&dir_fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW).is_ok() {
            return Err(ExecError::AlreadyExists(format!(
                "{} already exists; it was not created by this call",
                path.display()
            )));
        }
        drop(dir_fd);
        let call = ToolCall::new(&self.ctx.config.tools.qemu_img, self.ctx.tool_timeout())
            .arg("create")
            .arg("-f")
            .arg("qcow2")
            .arg("-b")
            .arg(&device)
            .arg("-F")
            .arg("raw")
            .arg(&path);
        guard.intent(self.ctx.now_ms(), op, &resource, json!({ "path": path.display().to_string(), "backing": device, "command": call.display() })).await?;
        if let Err(error) = self.create_run_file(grant, &name, false) {
            return Err(self
                .ctx
                .journal_step_error(&mut guard, op, &resource, error)
                .await);
        }
        let output = self.ctx.run_step(&mut guard, op, &resource, call).await?;
        if !output.success() || !path.is_file() {
            self.ctx
                .journal_tool_failed(&mut guard, op, &resource, &output, &[])
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "qemu-img create failed (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let warnings = self
            .shared_filesystem_warning(&dir)
            .into_iter()
            .collect::<Vec<_>>();
        for warning in &warnings {
            tracing::warn!(run_id = %grant.run_id, "{warning}");
        }
        let detail = tool_detail(
            &output,
            &[
                ("path", json!(path.display().to_string())),
                ("backing", json!(device)),
            ],
        );
        guard.done(self.ctx.now_ms(), op, &resource, detail).await?;
        Ok(Outcome::CreateOverlay(pb::CreateOverlayReply {
            tool: Some(tool_result("qemu-img create", &output)),
            warnings,
            journal_head: guard.head_hex(),
        }))
    }

    /// Opens the overlay root, checked (the run directory may not exist yet). A missing root
    /// is created, private to the connector.
    fn open_overlay_root(&self) -> Result<OwnedFd, ExecError> {
        let root_path = &self.ctx.config.paths.overlay_root;
        let root = match rustix::fs::open(root_path, DIRECTORY_FLAGS, Mode::empty()) {
            Err(rustix::io::Errno::NOENT) => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(root_path)
                    .map_err(|e| io_refusal("overlay root", root_path, e))?;
                rustix::fs::open(root_path, DIRECTORY_FLAGS, Mode::empty())
            }
            opened => opened,
        }
        .map_err(|e| io_refusal("overlay root", root_path, e))?;
        let stat =
            rustix::fs::fstat(&root).map_err(|e| io_refusal("overlay root", root_path, e))?;
        check_directory(
            "overlay root",
            root_path,
            &stat,
            &format!(
                "make it a directory owned by root with no group or other write permission (chown root: {0}; chmod go-w {0})",
                root_path.display()
            ),
        )?;
        Ok(root)
    }

    /// Overlays growing on the filesystem of the cluster database can fill it and stall the
    /// whole cluster.
    fn shared_filesystem_warning(&self, overlay_dir: &Path) -> Option<String> {
        let cluster = &self.ctx.config.pve.pve_cluster_dir;
        let overlay_dev = std::fs::metadata(overlay_dir).ok()?.dev();
        let cluster_dev = std::fs::metadata(cluster).ok()?.dev();
        (overlay_dev == cluster_dev).then(|| {
            format!(
                "the overlay root {} is on the same filesystem as {}: a guest filling its overlay can fill the cluster database's disk; move overlay_root",
                self.ctx.config.paths.overlay_root.display(),
                cluster.display()
            )
        })
    }

    pub(super) async fn delete(
        &self,
        run: &RunHandle,
        vmid: Vmid,
        archive: ArchiveName,
    ) -> Result<Outcome, ExecError> {
        let grant = &run.grant;
        let mut guard = self.ctx.lock_open(run).await?;
        let resource = Resource::Overlay {
            vmid,
            archive: archive.clone(),
        };
        let states = crate::resources::states(&guard.records());
        if states.get(&resource.key()).is_none_or(|s| !s.is_open()) {
            return Err(ExecError::NotFound(format!(
                "this run has no overlay of {archive} for VM {vmid}"
            )));
        }
        if states
            .get(&Resource::Vm(vmid).key())
            .is_some_and(|s| s.is_open())
        {
            return Err(ExecError::FailedPrecondition(format!(
                "VM {vmid} still uses the overlay of {archive}; destroy it first"
            )));
        }
        self.ctx
            .guest_network()
            .release_recovery_unit(grant, vmid)
            .await?;
        let path = self.overlay_path(grant, vmid, &archive);
        self.remove_path(&mut guard, Op::OverlayDelete, &resource, &path)
            .await?;
        Ok(Outcome::DeleteOverlay(pb::DeleteOverlayReply {
            journal_head: guard.head_hex(),
        }))
    }

    /// Removes one run-scoped file (or empty directory), journaled `intent` then `undone` with
    /// its end state, or `failed`. A path that is already gone is recorded as such; a link is
    /// removed, never followed.
    pub(super) async fn remove_path(
        &self,
        guard: &mut RunGuard<'_>,
        op: Op,
        resource: &Resource,
        path: &Path,
    ) -> Result<EndState, ExecError> {
        let op = &op;
        let shown = path.display().to_string();
        guard
            .intent(self.ctx.now_ms(), op, resource, json!({ "path": shown }))
            .await?;
        let is_dir = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
        let removed = if is_dir {
            std::fs::remove_dir(path)
        } else {
            std::fs::remove_file(path)
        };
        let end_state = match removed {
            Ok(()) => EndState::Deleted,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => EndState::AlreadyGone,
            Err(error) => {
                guard
                    .failed(
                        self.ctx.now_ms(),
                        op,
                        resource,
                        json!({ "path": shown, "error": error.to_string() }),
                    )
                    .await?;
                return Err(ExecError::Failed(format!("cannot remove {shown}: {error}")));
            }
        };
        guard
            .undone(
                self.ctx.now_ms(),
                op,
                resource,
                json!({ "path": shown, "end_state": end_state.wire() }),
            )
            .await?;
        Ok(end_state)
    }
}

pub(super) fn overlay_file_name(vmid: Vmid, archive: &ArchiveName) -> String {
    format!("{vmid}-{}.qcow2", archive.stem())
}

pub(super) fn screendump_file_name(vmid: Vmid) -> String {
    format!("{vmid}-screen.png")
}
