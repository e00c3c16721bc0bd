//! What a run puts on disk: files only in checked directories and never through links, and an
//! encryption key that reaches the backup client without touching disk.

use super::*;

#[tokio::test(flavor = "multi_thread")]
async fn run_files_are_created_only_in_checked_directories_and_never_through_links() {
    if !privileged(
        "run_files_are_created_only_in_checked_directories_and_never_through_links",
        &["losetup", "python3", "qemu-img"],
    ) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut run = Run::begin("perm", &[ARCHIVE]).await;
    run.client
        .map_backup(map_request(ARCHIVE, PBS_PASSWORD))
        .await
        .unwrap();
    let root = run.lab.root.join("overlays");
    let create = || pb::CreateOverlayRequest {
        vmid: VMID,
        archive: ARCHIVE.into(),
    };
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o775)).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::FailedPrecondition,
        "is writable by its group or others (mode 775); make it a directory owned by root",
    );
    assert!(!root.join(RUN_ID).exists());
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    // A link planted where the overlay will be: never followed, never written through.
    let dir = root.join(RUN_ID);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = run.lab.root.join("victim");
    let planted = dir.join(format!("{VMID}-drive-scsi0.qcow2"));
    std::os::unix::fs::symlink(&target, &planted).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::AlreadyExists,
        "already exists; it was not created by this call",
    );
    assert!(!target.exists(), "nothing was written through the link");
    std::fs::remove_file(&planted).unwrap();
    // A run directory others can write to is refused too.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
    assert_status(
        run.client.create_overlay(create()).await,
        Code::FailedPrecondition,
        "is writable by its group or others (mode 770)",
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    run.client.create_overlay(create()).await.unwrap();
    assert!(planted.is_file() && !planted.is_symlink());
    run.end().await;
}
#[tokio::test(flavor = "multi_thread")]
async fn an_encryption_key_reaches_the_client_without_touching_disk() {
    if !privileged(
        "an_encryption_key_reaches_the_client_without_touching_disk",
        &["losetup", "python3"],
    ) {
        return;
    }
    let mut run = Run::begin("keyfile", &[ARCHIVE]).await;
    let key =
        br#"{"kdf":null,"created":"2026-11-01T02:00:00Z","data":"c2VjcmV0LWtleS1tYXRlcmlhbA=="}"#
            .to_vec();
    let mut request = map_request(ARCHIVE, PBS_PASSWORD);
    request.encryption_key = key.clone();
    run.client.map_backup(request).await.unwrap();
    let calls = run.lab.calls();
    let map_call = calls.iter().find(|c| c["command"] == "map").unwrap();
    let argv: Vec<String> = serde_json::from_value(map_call["argv"].clone()).unwrap();
    assert_eq!(&argv[argv.len() - 2..], ["--keyfile", "/proc/self/fd/4"]);
    let result = calls.iter().find(|c| c.get("keyfile").is_some()).unwrap();
    assert_eq!(result["keyfile"]["size"], key.len(), "{result}");
    // Nothing under the lab or the node's state holds the key material.
    let needle = b"c2VjcmV0LWtleS1tYXRlcmlhbA";
    let mut found = Vec::new();
    for dir in [run.lab.root.clone()] {
        let mut stack = vec![dir];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                if entry.file_type().unwrap().is_dir() {
                    stack.push(path);
                } else if std::fs::read(&path)
                    .is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
                {
                    found.push(path);
                }
            }
        }
    }
    assert!(found.is_empty(), "key material on disk: {found:?}");
    run.stop().await;
}
