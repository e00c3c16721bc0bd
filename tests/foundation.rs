//! The connector's surface, mTLS and per-run authorization, over real TLS on loopback with
//! certificates issued by the controller's own code.
//!
//! Every refusal case checks the gRPC status and message and that the recording executor was
//! not reached: a refused call changes nothing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use certistack_controller::client::{NodeError, check_hello};
use certistack_core::grant::sign as sign_grant;
use certistack_core::identity::Identity;
use certistack_core::validate::{NodeName, RunId, Validated};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use certistack_tests::*;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};
use tonic::Code;
use tonic::transport::Channel;

#[path = "foundation/accepted_calls.rs"]
mod accepted_calls;
#[path = "foundation/certificate_profile.rs"]
mod certificate_profile;
#[path = "foundation/cli.rs"]
mod cli;
#[path = "foundation/connection_limits.rs"]
mod connection_limits;
#[path = "foundation/connections.rs"]
mod connections;
#[path = "foundation/controller_checks.rs"]
mod controller_checks;
#[path = "foundation/descriptor_reserve.rs"]
mod descriptor_reserve;
#[path = "foundation/documented_cli.rs"]
mod documented_cli;
#[path = "foundation/enrollment.rs"]
mod enrollment;
#[path = "foundation/evidence_report.rs"]
mod evidence_report;
#[path = "foundation/fleet_audit.rs"]
mod fleet_audit;
#[path = "foundation/handshake_churn.rs"]
mod handshake_churn;
#[path = "foundation/history_command.rs"]
mod history_command;
#[path = "foundation/history_store.rs"]
mod history_store;
#[path = "foundation/idle_with_a_silent_stream.rs"]
mod idle_with_a_silent_stream;
#[path = "foundation/node_checks.rs"]
mod node_checks;
#[path = "foundation/notifications.rs"]
mod notifications;
#[path = "foundation/operator_commands.rs"]
mod operator_commands;
#[path = "foundation/pbs_latest.rs"]
mod pbs_latest;
#[path = "foundation/plans.rs"]
mod plans;
#[path = "foundation/pve_api.rs"]
mod pve_api;
#[path = "foundation/pve_selection.rs"]
mod pve_selection;
#[path = "foundation/request_refusals.rs"]
mod request_refusals;
#[path = "foundation/run_authorization.rs"]
mod run_authorization;
#[path = "foundation/state_dir.rs"]
mod state_dir;
#[path = "foundation/surface_audit.rs"]
mod surface_audit;
#[path = "foundation/tls_layer.rs"]
mod tls_layer;
#[path = "foundation/unit_file.rs"]
mod unit_file;
#[path = "foundation/wire_refusals.rs"]
mod wire_refusals;

/// One request per operation RPC, all inside the standard test grant.
async fn call_every_operation(
    client: &mut ConnectorClient<Channel>,
) -> Vec<Result<(), tonic::Status>> {
    vec![
        ok(client
            .map_backup(pb::MapBackupRequest {
                snapshot: SNAPSHOT.into(),
                archive: ARCHIVE.into(),
                pbs_secret: "s3cret".into(),
                encryption_key: vec![],
            })
            .await),
        ok(client
            .create_overlay(pb::CreateOverlayRequest {
                vmid: VMID,
                archive: ARCHIVE.into(),
            })
            .await),
        ok(client
            .create_vm(pb::CreateVmRequest {
                vmid: VMID,
                cores: 2,
                memory_mib: 1024,
                archives: vec![ARCHIVE.into()],
                mirror_source_hardware: false,
            })
            .await),
        ok(client
            .prepare_sandbox(pb::PrepareSandboxRequest {
                vnet: VNET.into(),
                probe_source: PROBE_SOURCE.into(),
            })
            .await),
        ok(client.start_vm(pb::VmRequest { vmid: VMID }).await),
        ok(client.vm_status(pb::VmRequest { vmid: VMID }).await),
        ok(client
            .qmp(pb::QmpRequest {
                vmid: VMID,
                command: pb::QmpCommand::QueryStatus as i32,
            })
            .await),
        ok(client
            .qga(pb::QgaRequest {
                vmid: VMID,
                call: Some(pb::qga_request::Call::Command(pb::QgaCommand::Ping as i32)),
            })
            .await),
        ok(client
            .qga(pb::QgaRequest {
                vmid: VMID,
                call: Some(pb::qga_request::Call::AssertionId("nginx-active".into())),
            })
            .await),
        ok(client
            .probe(pb::ProbeRequest {
                kind: pb::ProbeKind::Tcp as i32,
                address: TARGET.into(),
                port: 22,
            })
            .await),
        ok(client
            .stop_vm(pb::StopVmRequest {
                vmid: VMID,
                timeout_seconds: 30,
            })
            .await),
        ok(client.destroy_vm(pb::VmRequest { vmid: VMID }).await),
        ok(client
            .release_sandbox(pb::ReleaseSandboxRequest { vnet: VNET.into() })
            .await),
        ok(client
            .delete_overlay(pb::DeleteOverlayRequest {
                vmid: VMID,
                archive: ARCHIVE.into(),
            })
            .await),
        ok(client
            .unmap_backup(pb::UnmapBackupRequest {
                archive: ARCHIVE.into(),
            })
            .await),
        ok(client
            .read_journal(pb::ReadJournalRequest {
                run_id: RUN_ID.into(),
            })
            .await),
        ok(client
            .cleanup(pb::CleanupRequest {
                run_id: RUN_ID.into(),
            })
            .await),
        ok(client
            .read_source_config(pb::ReadSourceConfigRequest {
                snapshot: SNAPSHOT.into(),
                pbs_secret: "s3cret".into(),
                encryption_key: vec![],
            })
            .await),
        ok(client
            .recover_guest_network(pb::RecoverGuestNetworkRequest {
                vmid: VMID,
                archive: ARCHIVE.into(),
                mode: pb::NetworkRecoveryMode::Rewrite.into(),
            })
            .await),
    ]
}

/// The RPC each call of [`call_every_operation`] makes, in order.
const EVERY_OPERATION: [&str; 19] = [
    "MapBackup",
    "CreateOverlay",
    "CreateVm",
    "PrepareSandbox",
    "StartVm",
    "VmStatus",
    "Qmp",
    "Qga",
    "Qga",
    "Probe",
    "StopVm",
    "DestroyVm",
    "ReleaseSandbox",
    "DeleteOverlay",
    "UnmapBackup",
    "ReadJournal",
    "Cleanup",
    "ReadSourceConfig",
    "RecoverGuestNetwork",
];

/// A certificate from the controller CA with exactly the given subject alternative names and
/// extended key usages, valid from a minute ago for `lifetime`.
fn issue_with_profile(
    authority: &certistack_controller::authority::Authority,
    names: Vec<rcgen::SanType>,
    usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
    lifetime: time::Duration,
) -> certistack_controller::authority::IssuedCertificate {
    use rcgen::{CertificateParams, Issuer, KeyPair};
    let ca_key =
        KeyPair::from_pem(&std::fs::read_to_string(authority.dir().join("ca.key")).unwrap())
            .unwrap();
    let issuer = Issuer::from_ca_cert_pem(authority.ca_pem(), ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.subject_alt_names = names;
    params.extended_key_usages = usages;
    params.not_before = now() - time::Duration::minutes(1);
    params.not_after = params.not_before + lifetime;
    let cert = params.signed_by(&key, &issuer).unwrap();
    certistack_controller::authority::IssuedCertificate {
        certificate_pem: cert.pem(),
        key_pem: zeroize::Zeroizing::new(key.serialize_pem()),
    }
}

/// A URI subject alternative name.
fn uri(text: &str) -> rcgen::SanType {
    rcgen::SanType::URI(text.to_owned().try_into().unwrap())
}

/// A DNS subject alternative name.
fn dns(text: &str) -> rcgen::SanType {
    rcgen::SanType::DnsName(text.to_owned().try_into().unwrap())
}

/// A controller config whose inventory lists `nodes` (each a name and its `host:port`), with its
/// state and reports directories under `dir`.
fn inventory(
    dir: &std::path::Path,
    nodes: &[(&str, &str)],
) -> certistack_controller::config::ControllerConfig {
    let mut text = format!(
        "state_dir = {:?}\nreports_dir = {:?}\n",
        dir.join("ctl"),
        dir.join("reports")
    );
    for (name, address) in nodes {
        let (host, port) = address.rsplit_once(':').unwrap();
        text.push_str(&format!(
            "[[nodes]]\nname = {name:?}\naddress = {host:?}\nport = {port}\n"
        ));
    }
    certistack_controller::config::ControllerConfig::parse(
        std::path::Path::new("controller.toml"),
        &text,
    )
    .unwrap()
}
