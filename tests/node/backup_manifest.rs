//! The snapshot's manifest: `ReadSourceConfig` reads it through `proxmox-backup-client restore`
//! and answers every archive's checksum, which is the checksum of the bytes PBS stores; a
//! manifest outside the bounds is refused and nothing else is read.

use super::*;
use sha2::{Digest, Sha256};

const SECOND_ARCHIVE: &str = "drive-scsi1.img";
/// PVE's VM backups are cut into 4 MiB chunks.
const CHUNK: usize = 4 << 20;
const VERIFY_UPID: &str =
    "UPID:pbs1:000004D2:0000162E:00000003:6749A1C0:verificationjob:store1\\x3av\\x2d1:root@pam:";

/// PBS's checksum of a disk archive's index, computed here from the image the double stores:
/// SHA-256 over the SHA-256 of each chunk, the last one as long as what is left.
fn fixed_index_csum(image: &[u8]) -> String {
    let mut csum = Sha256::new();
    for chunk in image.chunks(CHUNK) {
        csum.update(Sha256::digest(chunk));
    }
    hex::encode(csum.finalize())
}

fn snapshot_dir(lab: &Lab) -> std::path::PathBuf {
    lab.root.join("pbs/store1").join(SNAPSHOT)
}

async fn read_source(run: &mut Run) -> Result<pb::ReadSourceConfigReply, tonic::Status> {
    run.client
        .read_source_config(pb::ReadSourceConfigRequest {
            snapshot: SNAPSHOT.into(),
            pbs_secret: PBS_PASSWORD.into(),
            encryption_key: vec![],
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The journal's records of the manifest read, with their details.
async fn manifest_records(run: &mut Run) -> Vec<pb::JournalRecord> {
    let mut stream = run
        .client
        .read_journal(pb::ReadJournalRequest {
            run_id: RUN_ID.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut records = Vec::new();
    while let Some(record) = stream.message().await.unwrap() {
        if record.operation == "source.manifest" {
            records.push(record);
        }
    }
    records
}

/// Each archive's checksum in the reply is the one computed from the bytes the double stores
/// (two images, one ending in a short chunk), the snapshot's digest is that of the manifest the
/// client prints, PBS's last verify job comes with its time, and the journal holds all of it.
#[tokio::test(flavor = "multi_thread")]
async fn the_manifest_names_each_archive_by_the_checksum_of_its_stored_bytes() {
    if !privileged(
        "the_manifest_names_each_archive_by_the_checksum_of_its_stored_bytes",
        &["python3"],
    ) {
        return;
    }
    let mut run = Run::begin_with(
        "manifest",
        &[ARCHIVE, SECOND_ARCHIVE],
        |lab| {
            // Nine chunks and a short tenth, each different.
            let image: Vec<u8> = (0..(9 * CHUNK + 4099))
                .map(|i| ((i / CHUNK) as u8).wrapping_mul(31) ^ (i as u8))
                .collect();
            std::fs::write(snapshot_dir(lab).join(SECOND_ARCHIVE), image).unwrap();
            lab.settings(serde_json::json!({
                "manifest_verify_state": {"state": "ok", "upid": VERIFY_UPID}
            }));
        },
        |_| {},
    )
    .await;
    let reply = read_source(&mut run).await.unwrap();
    let manifest = reply.manifest.expect("the reply carries the manifest");

    // The manifest as the client prints it, read here from the double directly.
    let printed = std::process::Command::new(run.lab.root.join("bin/proxmox-backup-client"))
        .args(["restore", SNAPSHOT, "index.json.blob", "-"])
        .args(["--repository", "root@pam@pbs.example:8007:store1"])
        .env("PBS_PASSWORD", PBS_PASSWORD)
        .env("PBS_FINGERPRINT", ["ab"; 32].join(":"))
        .output()
        .unwrap();
    assert!(printed.status.success(), "{printed:?}");
    assert_eq!(
        manifest.sha256,
        hex::encode(Sha256::digest(&printed.stdout))
    );

    for archive in [ARCHIVE, SECOND_ARCHIVE] {
        let image = std::fs::read(snapshot_dir(&run.lab).join(archive)).unwrap();
        let index = format!("{archive}.fidx");
        let file = manifest
            .files
            .iter()
            .find(|f| f.filename == index)
            .unwrap_or_else(|| panic!("{index} missing from {:?}", manifest.files));
        assert_eq!(file.csum, fixed_index_csum(&image), "{index}");
        assert_eq!(file.size, image.len() as u64, "{index}");
        assert_eq!(file.crypt_mode, "none");
    }
    let verify = manifest.verify_state.as_ref().expect("the last verify job");
    assert_eq!(
        (
            verify.state.as_str(),
            verify.upid.as_str(),
            verify.started_unix
        ),
        ("ok", VERIFY_UPID, 0x6749_A1C0)
    );

    // Journaled before the config, with the checksums the reply carries.
    let journal = run.journal().await;
    let manifest_done = journal
        .iter()
        .position(|s| s == "source.manifest source:index.json.blob done")
        .unwrap_or_else(|| panic!("{journal:?}"));
    let config_done = journal
        .iter()
        .position(|s| s == "source.config source:qemu-server.conf done")
        .unwrap();
    assert!(manifest_done < config_done, "{journal:?}");
    let records = manifest_records(&mut run).await;
    let done = records.iter().find(|r| r.phase == "done").unwrap();
    let detail: serde_json::Value = serde_json::from_str(&done.detail).unwrap();
    assert_eq!(detail["manifest_sha256"], manifest.sha256);
    for file in &manifest.files {
        assert!(
            detail["files"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["filename"] == file.filename && f["csum"] == file.csum),
            "{file:?} not journaled: {detail}"
        );
    }
    assert_eq!(detail["verify_state"]["started_unix"], 0x6749_A1C0);
    run.end().await;
}

/// A manifest that is oversized, not JSON, of another snapshot or with a malformed checksum is
/// refused with what is wrong, journaled `failed`; the config is then not read, so no sandbox
/// can be made from it, and the run leaves nothing behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_outside_the_bounds_is_refused_and_nothing_else_is_read() {
    if !privileged(
        "a_manifest_outside_the_bounds_is_refused_and_nothing_else_is_read",
        &["python3"],
    ) {
        return;
    }
    let mut run = Run::begin("manifestrefuse", &[ARCHIVE]).await;
    let good = |lab: &Lab| {
        let out = std::process::Command::new(lab.root.join("bin/proxmox-backup-client"))
            .args(["restore", SNAPSHOT, "index.json.blob", "-"])
            .args(["--repository", "root@pam@pbs.example:8007:store1"])
            .env("PBS_PASSWORD", PBS_PASSWORD)
            .env("PBS_FINGERPRINT", ["ab"; 32].join(":"))
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let mut other_snapshot = good(&run.lab);
    other_snapshot["backup-id"] = "101".into();
    let mut bad_csum = good(&run.lab);
    bad_csum["files"][0]["csum"] = "\u{1b}[2Jpassed".into();
    // The good manifest with one byte that is not UTF-8 in a note: read as text with the byte
    // replaced it would parse, and its digest would name other bytes than the file's.
    let mut latin1 = good(&run.lab);
    latin1["unprotected"]["notes"] = "caf\u{e9}".into();
    let latin1 = latin1
        .to_string()
        .replace("caf\u{e9}", "caf\u{fffd}")
        .into_bytes();
    let latin1: Vec<u8> = {
        let text = String::from_utf8(latin1).unwrap();
        let (before, after) = text.split_once('\u{fffd}').unwrap();
        [before.as_bytes(), &[0xe9], after.as_bytes()].concat()
    };
    let latin1_sha256 = hex::encode(sha2::Sha256::digest(&latin1));
    let cases: [(Vec<u8>, &str); 5] = [
        (
            format!("{{\"notes\": \"{}\"}}", "a".repeat(70 * 1024)).into_bytes(),
            "the manifest of vm/100/2026-11-01T02:00:00Z is refused: the manifest is larger than 65536 bytes",
        ),
        (
            b"{\"backup-type\": ".to_vec(),
            "the manifest of vm/100/2026-11-01T02:00:00Z is refused: the manifest is not JSON",
        ),
        (
            other_snapshot.to_string().into_bytes(),
            "the manifest is of snapshot \"vm\"/\"101\" at 1793498400, not of vm/100/2026-11-01T02:00:00Z",
        ),
        (
            bad_csum.to_string().into_bytes(),
            "the manifest's csum of drive-scsi0.img.fidx is missing or malformed: not 64 lower-case hex digits",
        ),
        (
            latin1,
            "the manifest of vm/100/2026-11-01T02:00:00Z is refused: the manifest is not JSON",
        ),
    ];
    let stored = snapshot_dir(&run.lab).join("index.json.blob");
    let calls_before = run.lab.calls().len();
    for (manifest, needle) in cases {
        std::fs::write(&stored, manifest).unwrap();
        assert_status(
            read_source(&mut run).await,
            Code::FailedPrecondition,
            needle,
        );
    }
    // Only the manifest was read; nothing was mirrored from a config never read.
    let archives: Vec<String> = run
        .lab
        .calls()
        .into_iter()
        .skip(calls_before)
        .filter(|c| c["command"] == "restore")
        .map(|c| c["archive"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(archives, ["index.json.blob"; 5]);
    let records = manifest_records(&mut run).await;
    let failed: Vec<&pb::JournalRecord> = records.iter().filter(|r| r.phase == "failed").collect();
    assert_eq!(failed.len(), 5, "{records:?}");
    assert!(failed.iter().all(|r| r.detail.contains("\"read_sha256\"")));
    // The digest journaled is of the bytes the client wrote, not of a decoding of them.
    assert!(
        failed[4].detail.contains(&latin1_sha256),
        "{}",
        failed[4].detail
    );
    let journal = run.journal().await;
    assert!(
        !journal.iter().any(|s| s.starts_with("source.config")),
        "{journal:?}"
    );
    run.end().await;
}
