//! The snapshot's manifest (`index.json.blob`): the checksums a report names the backup's bytes by
//!
//! Read with `proxmox-backup-client restore <snapshot> index.json.blob -`, which prints the
//! manifest's decoded JSON, bounded in size and time like the source config.
//!
//! PBS writes the manifest with every snapshot (proxmox-backup `pbs-datastore/src/manifest.rs`,
//! `BackupManifest`): `backup-type`, `backup-id`, `backup-time`, and per file its `filename`,
//! `crypt-mode`, `size` and `csum`. A `.fidx`'s `csum` is the SHA-256 over the index's chunk
//! digests (`FixedIndexReader::compute_csum`), a `.blob`'s the SHA-256 of the blob file; the
//! client checks every index and blob it reads against it (`BackupReader::download_fixed_index`),
//! so a mapping serves exactly the chunks the manifest's `csum` names. A verify job stores its
//! result in the part no signature covers, `unprotected.verify_state` (`{state, upid}`).

use super::{context::NodeContext, tool_detail};
use crate::action::EncryptionKey;
use crate::executor::ExecError;
use crate::runs::RunGuard;
use certistack_core::grant::Grant;
use certistack_core::journal::{Op, Resource};
use certistack_core::untrusted;
use certistack_core::validate::{Secret, Snapshot};
use certistack_proto::v1 as pb;
use serde_json::json;
use sha2::{Digest, Sha256};

/// The manifest's name in a snapshot (`MANIFEST_BLOB_NAME`).
pub(crate) const MANIFEST_BLOB: &str = "index.json.blob";
/// The most of a manifest the node reads: a VM backup's is about a kilobyte; PBS's own reader
/// starts with a 64 KiB buffer for it (`download_manifest`).
pub const MAX_MANIFEST_BYTES: usize = 64 * 1024;
/// The most files a manifest may list: a VM has at most 31 SCSI + 16 VirtIO + 6 SATA + 4 IDE
/// disks, an EFI vars disk and a TPM state, and the config and log blobs.
pub const MAX_MANIFEST_FILES: usize = 128;
/// The longest UPID relayed: node (≤ 64) + 8 hex fields + worker type, id and auth id.
const MAX_UPID_CHARS: usize = 512;

const MANIFEST_OP: &Op = &Op::SourceManifest;
const MANIFEST_RESOURCE: &Resource = &Resource::SourceManifest;

/// Why a manifest is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("the manifest is larger than {MAX_MANIFEST_BYTES} bytes")]
    TooLarge,
    #[error("the manifest is not JSON: {0}")]
    NotJson(String),
    #[error("the manifest's {field} is missing or malformed: {reason}")]
    Malformed { field: String, reason: String },
    #[error("the manifest lists {0} files; at most {MAX_MANIFEST_FILES} are read")]
    TooManyFiles(usize),
    #[error("the manifest is of snapshot {found}, not of {expected}")]
    OtherSnapshot { found: String, expected: String },
}

fn malformed(field: impl Into<String>, reason: impl Into<String>) -> ManifestError {
    ManifestError::Malformed {
        field: field.into(),
        reason: reason.into(),
    }
}

/// `backup-time` of a snapshot path's `YYYY-MM-DDTHH:MM:SSZ`, seconds since the epoch (the
/// validator already checked its shape and calendar).
fn backup_time(snapshot: &Snapshot) -> Option<i64> {
    let time = snapshot.as_str().rsplit('/').next()?;
    let num = |r: std::ops::Range<usize>| time.get(r)?.parse::<u32>().ok();
    let date = time::Date::from_calendar_date(
        i32::try_from(num(0..4)?).ok()?,
        time::Month::try_from(u8::try_from(num(5..7)?).ok()?).ok()?,
        u8::try_from(num(8..10)?).ok()?,
    )
    .ok()?;
    let clock = time::Time::from_hms(
        u8::try_from(num(11..13)?).ok()?,
        u8::try_from(num(14..16)?).ok()?,
        u8::try_from(num(17..19)?).ok()?,
    )
    .ok()?;
    Some(
        time::PrimitiveDateTime::new(date, clock)
            .assume_utc()
            .unix_timestamp(),
    )
}

/// The start time of a PBS task from its UPID,
/// `UPID:<node>:<pid>:<pstart>:<task id>:<starttime>:<type>:<id>:<auth id>:` with the numbers in
/// upper-case hex (proxmox-schema `upid.rs`, `Display for UPID`).
pub fn upid_start_time(upid: &str) -> Option<i64> {
    let fields: Vec<&str> = upid.split(':').collect();
    if fields.first() != Some(&"UPID") || fields.len() < 9 {
        return None;
    }
    let hex = fields.get(5)?;
    if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    i64::from_str_radix(hex, 16).ok()
}

/// Manifest text in a refusal: escaped and bounded, since PBS relays what the backup's writer sent.
fn quoted(bytes: &[u8], max_chars: usize) -> String {
    format!("\"{}\"", untrusted::printable(bytes, max_chars))
}

/// A member of a JSON object, `null` when absent (or when `value` is no object).
fn member<'a>(value: &'a serde_json::Value, key: &str) -> &'a serde_json::Value {
    static ABSENT: serde_json::Value = serde_json::Value::Null;
    value.get(key).unwrap_or(&ABSENT)
}

fn text<'a>(value: &'a serde_json::Value, field: &str) -> Result<&'a str, ManifestError> {
    value
        .as_str()
        .ok_or_else(|| malformed(field, "not a string"))
}

/// The file names PBS archives carry: an archive name and a `.fidx`, `.didx` or `.blob`
/// extension (`ArchiveType::from_path`).
fn check_filename(name: &str) -> Result<(), ManifestError> {
    let field = "files[].filename";
    let plain = !name.is_empty()
        && name.len() <= 160
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !plain {
        return Err(malformed(
            field,
            format!(
                "{} is not an archive file name",
                quoted(name.as_bytes(), 160)
            ),
        ));
    }
    if ![".fidx", ".didx", ".blob"]
        .iter()
        .any(|e| name.ends_with(e))
    {
        return Err(malformed(
            field,
            format!("{name} is not a .fidx, .didx or .blob"),
        ));
    }
    Ok(())
}

fn file(entry: &serde_json::Value) -> Result<pb::ManifestFile, ManifestError> {
    let filename = text(member(entry, "filename"), "files[].filename")?;
    check_filename(filename)?;
    let csum = text(member(entry, "csum"), "files[].csum")?;
    if csum.len() != 64 || !csum.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(malformed(
            format!("csum of {filename}"),
            "not 64 lower-case hex digits",
        ));
    }
    let size = member(entry, "size")
        .as_u64()
        .ok_or_else(|| malformed(format!("size of {filename}"), "not an unsigned integer"))?;
    // Manifests of backups before PBS 0.8 carry no crypt-mode: `none` (`crypt_mode_none`).
    let crypt_mode = match member(entry, "crypt-mode") {
        serde_json::Value::Null => "none",
        mode => text(mode, "files[].crypt-mode")?,
    };
    if !matches!(crypt_mode, "none" | "encrypt" | "sign-only") {
        return Err(malformed(
            format!("crypt-mode of {filename}"),
            "not none, encrypt or sign-only",
        ));
    }
    Ok(pb::ManifestFile {
        filename: filename.to_owned(),
        csum: csum.to_owned(),
        size,
        crypt_mode: crypt_mode.to_owned(),
    })
}

fn verify_state(
    value: &serde_json::Value,
) -> Result<Option<pb::ManifestVerifyState>, ManifestError> {
    if value.is_null() {
        return Ok(None);
    }
    let state = text(member(value, "state"), "unprotected.verify_state.state")?;
    if !matches!(state, "ok" | "failed") {
        return Err(malformed(
            "unprotected.verify_state.state",
            format!("{} is not ok or failed", quoted(state.as_bytes(), 32)),
        ));
    }
    let upid = text(member(value, "upid"), "unprotected.verify_state.upid")?;
    let printable = upid.len() <= MAX_UPID_CHARS && upid.bytes().all(|b| b.is_ascii_graphic());
    let started_unix = upid_start_time(upid).filter(|_| printable).ok_or_else(|| {
        malformed(
            "unprotected.verify_state.upid",
            format!("{} is not a UPID", quoted(upid.as_bytes(), 80)),
        )
    })?;
    Ok(Some(pb::ManifestVerifyState {
        state: state.to_owned(),
        upid: upid.to_owned(),
        started_unix,
    }))
}

/// Parses the manifest of `snapshot` as `restore … index.json.blob -` printed it: every file's
/// name, checksum, size and crypt mode, and the last verify job's result. Refuses a manifest of
/// another snapshot, a malformed one and one over the bounds; what the report does not use
/// (`notes`, `key-fingerprint`, upload statistics) is not read.
pub fn parse(bytes: &[u8], snapshot: &Snapshot) -> Result<pb::SnapshotManifest, ManifestError> {
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge);
    }
    let json: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| ManifestError::NotJson(e.to_string()))?;
    if !json.is_object() {
        return Err(ManifestError::NotJson("not an object".into()));
    }
    let mut parts = snapshot.as_str().splitn(3, '/');
    let (kind, id) = (parts.next(), parts.next());
    let found_kind = text(member(&json, "backup-type"), "backup-type")?;
    let found_id = text(member(&json, "backup-id"), "backup-id")?;
    let found_time = member(&json, "backup-time")
        .as_i64()
        .ok_or_else(|| malformed("backup-time", "not an integer"))?;
    if Some(found_kind) != kind || Some(found_id) != id || Some(found_time) != backup_time(snapshot)
    {
        return Err(ManifestError::OtherSnapshot {
            found: format!(
                "{}/{} at {found_time}",
                quoted(found_kind.as_bytes(), 16),
                quoted(found_id.as_bytes(), 80)
            ),
            expected: snapshot.to_string(),
        });
    }
    let entries = member(&json, "files")
        .as_array()
        .ok_or_else(|| malformed("files", "not a list"))?;
    if entries.len() > MAX_MANIFEST_FILES {
        return Err(ManifestError::TooManyFiles(entries.len()));
    }
    let files = entries.iter().map(file).collect::<Result<Vec<_>, _>>()?;
    let mut names = std::collections::BTreeSet::new();
    if let Some(twice) = files.iter().find(|f| !names.insert(f.filename.as_str())) {
        return Err(malformed(
            "files",
            format!("{} is listed twice", twice.filename),
        ));
    }
    Ok(pb::SnapshotManifest {
        sha256: hex::encode(Sha256::digest(bytes)),
        files,
        verify_state: verify_state(member(member(&json, "unprotected"), "verify_state"))?,
    })
}

/// The manifest's journal detail: what the report's subjects carry, so the journal holds it.
fn journaled(manifest: &pb::SnapshotManifest) -> serde_json::Value {
    let files: Vec<serde_json::Value> = manifest
        .files
        .iter()
        .map(|f| json!({ "filename": f.filename, "csum": f.csum, "size": f.size, "crypt_mode": f.crypt_mode }))
        .collect();
    let verify = manifest
        .verify_state
        .as_ref()
        .map(|v| json!({ "state": v.state, "upid": v.upid, "started_unix": v.started_unix }));
    json!({ "manifest_sha256": manifest.sha256, "files": files, "verify_state": verify })
}

impl NodeContext {
    /// `proxmox-backup-client restore <snapshot> index.json.blob -`, bounded like the config
    /// read, journaled `source.manifest source:index.json.blob`: `done` with every file's
    /// checksum, or `failed` with why the manifest is refused (nothing on the node changes).
    pub(in crate::node) async fn read_manifest(
        &self,
        guard: &mut RunGuard<'_>,
        grant: &Grant,
        snapshot: &Snapshot,
        secret: Secret,
        key: Option<EncryptionKey>,
    ) -> Result<pb::SnapshotManifest, ExecError> {
        let call = self
            .backups()
            .pbs_call(
                grant,
                &["restore", snapshot.as_str(), MANIFEST_BLOB, "-"],
                self.tool_timeout(),
                secret,
                key,
            )
            // One byte over the limit tells an oversized manifest from one that fits.
            .output_cap(MAX_MANIFEST_BYTES.saturating_add(1));
        guard
            .intent(
                self.now_ms(),
                MANIFEST_OP,
                MANIFEST_RESOURCE,
                json!({ "snapshot": snapshot.as_str(), "command": call.display() }),
            )
            .await?;
        let output = self
            .run_step(guard, MANIFEST_OP, MANIFEST_RESOURCE, call)
            .await?;
        if !output.success() {
            self.journal_tool_failed(guard, MANIFEST_OP, MANIFEST_RESOURCE, &output, &[])
                .await?;
            return Err(ExecError::FailedPrecondition(format!(
                "proxmox-backup-client could not read {MANIFEST_BLOB} of {snapshot} (exit {:?}): {}",
                output.exit_code,
                output.stderr_excerpt()
            )));
        }
        let parsed = if output.truncated {
            Err(ManifestError::TooLarge)
        } else {
            // The bytes as the client wrote them: the digest names the manifest, not a
            // decoding of it.
            parse(&output.stdout_bytes, snapshot)
        };
        let manifest = match parsed {
            Ok(manifest) => manifest,
            Err(error) => {
                let reason = error.to_string();
                let read_sha256 = hex::encode(Sha256::digest(&output.stdout_bytes));
                self.journal_tool_failed(
                    guard,
                    MANIFEST_OP,
                    MANIFEST_RESOURCE,
                    &output,
                    &[
                        ("reason", json!(reason)),
                        ("read_sha256", json!(read_sha256)),
                    ],
                )
                .await?;
                return Err(ExecError::FailedPrecondition(format!(
                    "the manifest of {snapshot} is refused: {reason}; the report could not name the backup's bytes, so nothing was done with it"
                )));
            }
        };
        let mut detail = tool_detail(&output, &[]);
        if let (Some(map), serde_json::Value::Object(extra)) =
            (detail.as_object_mut(), journaled(&manifest))
        {
            map.extend(extra);
        }
        guard
            .done(self.now_ms(), MANIFEST_OP, MANIFEST_RESOURCE, detail)
            .await?;
        Ok(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use certistack_core::validate::Validated;

    const SNAPSHOT: &str = "vm/100/2026-11-30T01:00:00Z";
    /// 2026-11-30T01:00:00Z.
    const TIME: i64 = 1_796_000_400;

    fn snapshot() -> Snapshot {
        Snapshot::validate(SNAPSHOT).unwrap()
    }

    fn manifest(patch: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut value = json!({
            "backup-type": "vm",
            "backup-id": "100",
            "backup-time": TIME,
            "files": [
                {"filename": "qemu-server.conf.blob", "crypt-mode": "none", "size": 412,
                 "csum": "a".repeat(64)},
                {"filename": "drive-scsi0.img.fidx", "crypt-mode": "none", "size": 8_388_608,
                 "csum": "0123456789abcdef".repeat(4)},
            ],
            "unprotected": {
                "notes": "\u{1b}[2Jnot read",
                "verify_state": {"state": "ok",
                                 "upid": "UPID:pbs1:000004D2:0000162E:00000003:6749A1C0:verificationjob:store1\\x3av\\x2d1:root@pam:"},
            },
            "signature": null,
        });
        patch(&mut value);
        serde_json::to_vec_pretty(&value).unwrap()
    }

    #[test]
    fn the_backup_time_of_a_snapshot_path_is_its_utc_epoch() {
        assert_eq!(backup_time(&snapshot()), Some(TIME));
        assert_eq!(
            backup_time(&Snapshot::validate("ct/1/1970-01-01T00:00:00Z").unwrap()),
            Some(0)
        );
    }

    #[test]
    fn a_manifest_gives_each_file_its_checksum_and_the_last_verify_job() {
        let bytes = manifest(|_| {});
        let parsed = parse(&bytes, &snapshot()).unwrap();
        assert_eq!(parsed.sha256, hex::encode(Sha256::digest(&bytes)));
        let disk = parsed
            .files
            .iter()
            .find(|f| f.filename == "drive-scsi0.img.fidx")
            .unwrap();
        assert_eq!(
            (disk.csum.as_str(), disk.size, disk.crypt_mode.as_str()),
            (
                "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                8_388_608,
                "none"
            )
        );
        let verify = parsed.verify_state.unwrap();
        assert_eq!(verify.state, "ok");
        // 0x6749A1C0 = 1732878784 = 2024-11-29T11:13:04Z.
        assert_eq!(verify.started_unix, 1_732_878_784);
        // Never verified: no state; before PBS 0.8: no crypt mode, read as none.
        let plain = parse(
            &manifest(|m| {
                m["unprotected"] = json!({});
                m["files"][1].as_object_mut().unwrap().remove("crypt-mode");
            }),
            &snapshot(),
        )
        .unwrap();
        assert_eq!(plain.verify_state, None);
        assert_eq!(plain.files[1].crypt_mode, "none");
    }

    #[test]
    fn a_malformed_oversized_or_foreign_manifest_is_refused_with_what_is_wrong() {
        let refused = |bytes: Vec<u8>| parse(&bytes, &snapshot()).unwrap_err().to_string();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                vec![b' '; MAX_MANIFEST_BYTES + 1],
                "larger than 65536 bytes",
            ),
            (b"{\"files\": [".to_vec(), "not JSON"),
            (b"[]".to_vec(), "not JSON: not an object"),
            (
                manifest(|m| m["backup-id"] = json!("101")),
                "is of snapshot \"vm\"/\"101\" at 1796000400, not of vm/100/2026-11-30T01:00:00Z",
            ),
            (
                manifest(|m| m["backup-time"] = json!(TIME + 1)),
                "not of vm/100/2026-11-30T01:00:00Z",
            ),
            (
                manifest(|m| m["files"][1]["csum"] = json!("ABCD")),
                "csum of drive-scsi0.img.fidx is missing or malformed: not 64 lower-case hex digits",
            ),
            (
                manifest(|m| m["files"][1]["filename"] = json!("../x.fidx")),
                "is not an archive file name",
            ),
            (
                manifest(|m| m["files"][1]["filename"] = json!("drive\u{1b}[1A.fidx")),
                "\"drive\\u{1b}[1A.fidx\" is not an archive file name",
            ),
            (
                manifest(|m| m["files"][1]["filename"] = json!("drive-scsi0.img")),
                "drive-scsi0.img is not a .fidx, .didx or .blob",
            ),
            (
                manifest(|m| m["files"][1]["size"] = json!(-1)),
                "size of drive-scsi0.img.fidx is missing or malformed",
            ),
            (
                manifest(|m| m["files"][1]["crypt-mode"] = json!("rot13")),
                "crypt-mode of drive-scsi0.img.fidx",
            ),
            (
                manifest(|m| m["files"][1]["filename"] = json!("qemu-server.conf.blob")),
                "qemu-server.conf.blob is listed twice",
            ),
            (
                manifest(|m| {
                    let entry = m["files"][1].clone();
                    m["files"] = json!(vec![entry; MAX_MANIFEST_FILES + 1]);
                }),
                "lists 129 files",
            ),
            (
                manifest(|m| m["unprotected"]["verify_state"]["state"] = json!("maybe")),
                "verify_state.state is missing or malformed",
            ),
            (
                manifest(|m| m["unprotected"]["verify_state"]["upid"] = json!("UPID:x y")),
                "verify_state.upid is missing or malformed",
            ),
        ];
        for (bytes, expected) in cases {
            let error = refused(bytes);
            assert!(
                error.contains(expected),
                "{error:?} does not say {expected:?}"
            );
        }
    }

    #[test]
    fn a_upid_gives_its_task_start_time() {
        assert_eq!(
            upid_start_time("UPID:pbs:00000001:00000002:00000003:00000010:verify:x:root@pam:"),
            Some(16)
        );
        // pstart may be longer than 8 digits after 497 days of uptime.
        assert_eq!(
            upid_start_time("UPID:pbs:00000001:1000000002:00000003:6749A1C0:verify::root@pam:"),
            Some(0x6749_A1C0)
        );
        for bad in [
            "",
            "UPID:pbs",
            "PID:a:b:c:d:10:e:f:g:",
            "UPID:a:b:c:d:zz:e:f:g:",
        ] {
            assert_eq!(upid_start_time(bad), None, "{bad}");
        }
    }
}
