//! The standard test run: its identifiers, its grant, its credentials and the client that
//! presents them.

use crate::{NODE, TestNode, client, now};
use certistack_controller::authority::Authority;
use certistack_controller::run::{self, RunCredentials};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use tonic::transport::Channel;

pub const RUN_ID: &str = "0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f";
pub const VMID: u32 = 9100;
pub const ARCHIVE: &str = "drive-scsi0.img";
pub const SNAPSHOT: &str = "vm/100/2026-11-01T02:00:00Z";
pub const VNET: &str = "csbox1";
pub const PROBE_SOURCE: &str = "198.51.100.2/24";
pub const TARGET: &str = "198.51.100.10";

/// A grant for one run on `node`, valid for the next hour.
pub fn grant(run_id: &str, node: &str) -> pb::RunGrant {
    let now = now().unix_timestamp();
    pb::RunGrant {
        version: 1,
        run_id: run_id.into(),
        node: node.into(),
        not_before_unix: now - 60,
        deadline_unix: now + 3600,
        repository: Some(pb::PbsRepository {
            server: "pbs.lab".into(),
            port: 8007,
            datastore: "store1".into(),
            namespace: String::new(),
            auth_id: "certistack@pbs!restore".into(),
            fingerprint: ["ab"; 32].join(":"),
        }),
        snapshot: SNAPSHOT.into(),
        archives: vec![ARCHIVE.into()],
        sandbox_vms: vec![pb::SandboxVm {
            vmid: VMID,
            max_cores: 2,
            max_memory_mib: 2048,
        }],
        vnet: VNET.into(),
        probe_source: PROBE_SOURCE.into(),
        probe_targets: vec![pb::ProbeTarget {
            kind: pb::ProbeKind::Tcp as i32,
            address: TARGET.into(),
            port: 22,
            expect: Some(pb::ProbeExpectation {
                banner_prefix: "SSH-2.0-".into(),
                ..Default::default()
            }),
        }],
        qga_assertions: vec![pb::QgaAssertion {
            id: "nginx-active".into(),
            program: "/usr/bin/systemctl".into(),
            args: vec!["is-active".into(), "nginx".into()],
            expect_exit_code: 0,
            expect_stdout_contains: String::new(),
            timeout_seconds: 30,
        }],
        network_recovery_modes: vec![pb::NetworkRecoveryMode::Rewrite as i32],
        guest_address: format!("{TARGET}/24"),
    }
}

pub fn mint(authority: &Authority, grant: &pb::RunGrant) -> RunCredentials {
    run::mint(authority, grant, now()).unwrap()
}

pub async fn run_client(
    authority: &Authority,
    node: &TestNode,
    credentials: &RunCredentials,
) -> ConnectorClient<Channel> {
    client(authority, &node.address, NODE, &credentials.certificate)
        .await
        .unwrap()
}

/// Mints run credentials for `wire`, connects to the node at `address` as that run and begins
/// the run: the client the test then calls the run's operations with.
pub async fn begun_run(
    authority: &Authority,
    address: &str,
    wire: &pb::RunGrant,
) -> ConnectorClient<Channel> {
    let credentials = mint(authority, wire);
    let mut run = client(authority, address, NODE, &credentials.certificate)
        .await
        .unwrap();
    run.begin_run(begin_request(&credentials)).await.unwrap();
    run
}

pub fn begin_request(credentials: &RunCredentials) -> pb::BeginRunRequest {
    pb::BeginRunRequest {
        grant: Some(credentials.signed_grant.clone()),
    }
}
