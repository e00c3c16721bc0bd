//! The controller's PKI, made with its own code, and hand-built TLS clients for the negative
//! cases that code cannot produce.

use crate::NODE;
use certistack_controller::authority::{self, Authority, IssuedCertificate};
use certistack_core::tls;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use std::path::Path;
use std::sync::Arc;
use time::OffsetDateTime;

pub fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

/// A controller state directory made by `authority::init`.
pub fn controller(dir: &Path) -> Authority {
    let state = dir.join("ctl");
    authority::init(&state, now()).unwrap();
    Authority::load(&state).unwrap()
}
pub fn ca_pem(authority: &Authority) -> String {
    authority.ca_pem().to_owned()
}
/// A rustls client config built by hand, for the negative TLS cases the controller's own
/// code cannot produce (no certificate, TLS 1.2 only).
pub fn raw_client_config(
    authority: &Authority,
    versions: &[&'static rustls::SupportedProtocolVersion],
    identity: Option<&IssuedCertificate>,
) -> Arc<rustls::ClientConfig> {
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(tls::provider())
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(tls::ca_roots(&ca).unwrap());
    let mut config = match identity {
        Some(identity) => builder
            .with_client_auth_cert(
                tls::parse_certificates(&identity.certificate_pem, "client").unwrap(),
                tls::parse_private_key(&identity.key_pem, "key").unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// Calls Hello over a hand-built TLS config; returns the error text when anything refuses.
pub async fn hello_with(
    address: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<pb::HelloReply, String> {
    let channel = certistack_controller::connect::connect(address.to_owned(), NODE, config)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = ConnectorClient::new(channel);
    client
        .hello(pb::HelloRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|status| {
            let mut text = format!("status {:?}: {}", status.code(), status.message());
            let mut source = std::error::Error::source(&status);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        })
}

/// A CA of its own and a server certificate it signed, for an API double on loopback (the PVE
/// API's): what a cluster's `pve-root-ca.pem` and a node's `pve-ssl.pem` are to the controller.
pub struct ApiServerPki {
    pub ca_pem: String,
    pub leaf_pem: String,
    pub leaf_key_pem: String,
    /// The leaf's DER, whose SHA-256 is what a pin names.
    pub leaf_der: Vec<u8>,
}

/// A fresh CA and a leaf for the DNS names `names`, valid from a minute ago for a day.
pub fn api_server_pki(names: &[&str]) -> ApiServerPki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::default();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(
        rcgen::DnType::CommonName,
        "Proxmox Virtual Environment (test)",
    );
    ca_params.not_before = now() - time::Duration::minutes(1);
    ca_params.not_after = now() + time::Duration::days(1);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(
        names
            .iter()
            .map(|name| (*name).to_owned())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    params.not_before = now() - time::Duration::minutes(1);
    params.not_after = now() + time::Duration::days(1);
    let leaf = params.signed_by(&key, &issuer).unwrap();
    ApiServerPki {
        ca_pem: ca.pem(),
        leaf_pem: leaf.pem(),
        leaf_key_pem: key.serialize_pem(),
        leaf_der: leaf.der().to_vec(),
    }
}
