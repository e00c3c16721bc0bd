//! A connector double whose `Hello` reports another surface digest (a node running another
//! release); every other call is refused as unimplemented.

use super::*;
use certistack_controller::authority::Authority;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_server::Connector;
use std::path::Path;
use tonic::{Request, Response, Status};

pub struct DriftedNode {
    pub node: String,
}

/// Builds the whole impl: `async_trait` must see every method, so the refusing ones are
/// spelled out by the macro rather than generated inside the impl.
macro_rules! drifted_impl {
    ($($name:ident($req:ty) -> $reply:ty;)*) => {
        #[tonic::async_trait]
        impl Connector for DriftedNode {
            async fn hello(&self, _: Request<pb::HelloRequest>) -> Result<Response<pb::HelloReply>, Status> {
                Ok(Response::new(pb::HelloReply {
                    node_name: self.node.clone(),
                    surface_digest: format!("sha256:{}", "0".repeat(64)),
                    ..Default::default()
                }))
            }
            type ReadJournalStream = tokio_stream::Empty<Result<pb::JournalRecord, Status>>;
            async fn read_journal(&self, _: Request<pb::ReadJournalRequest>) -> Result<Response<Self::ReadJournalStream>, Status> {
                Err(Status::unimplemented("drifted double"))
            }
            $(async fn $name(&self, _: Request<$req>) -> Result<Response<$reply>, Status> {
                Err(Status::unimplemented("drifted double"))
            })*
        }
    };
}

drifted_impl! {
    begin_run(pb::BeginRunRequest) -> pb::BeginRunReply;
    end_run(pb::EndRunRequest) -> pb::EndRunReply;
    map_backup(pb::MapBackupRequest) -> pb::MapBackupReply;
    unmap_backup(pb::UnmapBackupRequest) -> pb::UnmapBackupReply;
    create_overlay(pb::CreateOverlayRequest) -> pb::CreateOverlayReply;
    delete_overlay(pb::DeleteOverlayRequest) -> pb::DeleteOverlayReply;
    create_vm(pb::CreateVmRequest) -> pb::CreateVmReply;
    start_vm(pb::VmRequest) -> pb::VmReply;
    stop_vm(pb::StopVmRequest) -> pb::VmReply;
    destroy_vm(pb::VmRequest) -> pb::VmReply;
    vm_status(pb::VmRequest) -> pb::VmReply;
    qmp(pb::QmpRequest) -> pb::QmpReply;
    qga(pb::QgaRequest) -> pb::QgaReply;
    prepare_sandbox(pb::PrepareSandboxRequest) -> pb::PrepareSandboxReply;
    release_sandbox(pb::ReleaseSandboxRequest) -> pb::ReleaseSandboxReply;
    probe(pb::ProbeRequest) -> pb::ProbeReply;
    list_runs(pb::ListRunsRequest) -> pb::ListRunsReply;
    cleanup(pb::CleanupRequest) -> pb::CleanupReply;
    node_checks(pb::NodeChecksRequest) -> pb::NodeChecksReply;
    read_source_config(pb::ReadSourceConfigRequest) -> pb::ReadSourceConfigReply;
    recover_guest_network(pb::RecoverGuestNetworkRequest) -> pb::RecoverGuestNetworkReply;
}

/// The connector's own TLS server configuration for the node certificate of `config`,
/// trusting `authority`'s CA for clients.
pub fn node_tls_server_config(
    authority: &Authority,
    config: &certistack_connector::config::Config,
) -> std::sync::Arc<rustls::ServerConfig> {
    use certistack_core::{files, tls};
    let chain = tls::parse_certificates(
        &files::read_trusted(&config.tls.certificate).unwrap(),
        "node",
    )
    .unwrap();
    let key = tls::parse_private_key(
        &files::read_private(&config.tls.private_key).unwrap(),
        "key",
    )
    .unwrap();
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    tls::server_config(chain, key, tls::ca_roots(&ca).unwrap()).unwrap()
}

/// Serves the drifted double, answering as `node` under a certificate for `node` enrolled in
/// `dir`, on a loopback port of the current network namespace; returns its address.
pub async fn serve_drifted(authority: &Authority, dir: &Path, node: &str) -> String {
    let config = enroll(authority, dir, node);
    let server_config = node_tls_server_config(authority, &config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                certistack_proto::v1::connector_server::ConnectorServer::new(
                    drifted::DriftedNode {
                        node: node.to_owned(),
                    },
                ),
            )
            .serve_with_incoming(
                certistack_connector::connection::incoming_with_default_limits(
                    listener,
                    server_config,
                ),
            ),
    );
    address
}
