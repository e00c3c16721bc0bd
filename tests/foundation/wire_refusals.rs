//! What the gRPC layer refuses before the service sees the request (undecodable, compressed,
//! oversized), and that each refusal is logged.

use super::connections::*;
use super::*;
use std::time::Duration;

/// Invalid UTF-8 in a string field is the caller's error; a compressed request is refused
/// as unimplemented (the node enables no compression); an oversized one is out of range;
/// and each of these refusals, answered by the gRPC layer before the service sees the
/// request, is logged.
#[tokio::test(flavor = "multi_thread")]
async fn undecodable_compressed_and_oversized_requests_are_refused_and_logged() {
    let dir = TempDir::new("wire");
    let authority = controller(&dir.0);
    let node_dir = dir.0.join("node");
    let config = enroll(&authority, &node_dir, NODE);
    let daemon = Daemon::start(&node_dir, &config, 1024);
    let operator = authority.issue_operator("alice", now()).unwrap();
    let mut c = client_when_up(&authority, &daemon.address, &operator).await;
    let tls = raw_client_config(&authority, &[&rustls::version::TLS13], Some(&operator));

    // MapBackupRequest { snapshot (field 1, string) = 0xff 0xfe }.
    let status = raw_call(
        &daemon.address,
        tls.clone(),
        MAP_BACKUP_PATH,
        &[],
        &[0x0a, 0x02, 0xff, 0xfe],
        false,
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("MapBackupRequest") && status.message().contains("snapshot"),
        "{status:?}"
    );

    // HelloRequest {} gzip-compressed (the 20-byte gzip of nothing).
    const GZIP_EMPTY: &[u8] = &[
        0x1f, 0x8b, 0x08, 0, 0, 0, 0, 0, 0, 0x03, 0x03, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let status = raw_call(
        &daemon.address,
        tls.clone(),
        HELLO_PATH,
        &[("grpc-encoding", "gzip")],
        GZIP_EMPTY,
        true,
    )
    .await;
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("gzip"), "{status:?}");

    let oversized = pb::MapBackupRequest {
        snapshot: SNAPSHOT.into(),
        archive: ARCHIVE.into(),
        pbs_secret: "pw".into(),
        encryption_key: vec![7; 100 * 1024],
    };
    let status = c.map_backup(oversized).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // A call whose client goes away before sending its request is logged too (tonic
    // reports the broken request body as UNKNOWN).
    {
        let tls = tls_connect(&daemon.address, tls.clone()).await.unwrap();
        let (send, connection) = h2::client::handshake(tls).await.unwrap();
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut send = send.ready().await.unwrap();
        let request = http::Request::post(format!("http://{NODE}{HELLO_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (_response, _body) = send.send_request(request, false).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        connection.abort();
    }

    let mut log = String::new();
    for _ in 0..50 {
        log = daemon.log();
        if log.contains("code=OutOfRange") && log.contains("code=Unknown") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (rpc, code) in [
        ("MapBackup", "InvalidArgument"),
        ("Hello", "Unimplemented"),
        ("MapBackup", "OutOfRange"),
        ("Hello", "Unknown"),
    ] {
        assert!(
            log.lines()
                .any(|l| (l.contains("refused") || l.contains("failed"))
                    && l.contains(&format!("rpc={rpc}"))
                    && l.contains(&format!("code={code}"))
                    && l.contains("id=operator:alice")),
            "no refusal of {rpc} with {code} in:\n{log}"
        );
    }
    // A successful call is one short line.
    let ok = log
        .lines()
        .find(|l| l.contains(" ok rpc=Hello"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(ok.len() <= 120, "{} B: {ok}", ok.len());
}
