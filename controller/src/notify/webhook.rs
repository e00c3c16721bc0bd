//! The webhook: a JSON message POSTed over verified TLS, signed with HMAC-SHA256 over its
//! timestamp and body (`X-CertiStack-Timestamp`, `X-CertiStack-Signature: sha256=<hex>`), so
//! its receiver can check it came from this controller and is not a replay.

use super::settings::WebhookSettings;
use crate::api::https::{HttpsClient, Limits, describe_refusal};
use certistack_core::{files, tls};
use std::time::Duration;

/// The header carrying the signing time, in seconds since the epoch.
pub const TIMESTAMP_HEADER: &str = "x-certistack-timestamp";
/// The header carrying `sha256=<hex>`: HMAC-SHA256 with the key over `TIMESTAMP.BODY`.
pub const SIGNATURE_HEADER: &str = "x-certistack-signature";

/// `sha256=<hex>`: HMAC-SHA256 with `key` over the timestamp, a full stop, and the body.
pub fn signature(key: &[u8], timestamp: i64, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut context = ring::hmac::Context::with_key(&key);
    context.update(timestamp.to_string().as_bytes());
    context.update(b".");
    context.update(body);
    format!("sha256={}", hex::encode(context.sign().as_ref()))
}

fn client_url(settings: &WebhookSettings) -> String {
    if settings.host.contains(':') {
        format!("https://[{}]:{}", settings.host, settings.port)
    } else {
        format!("https://{}:{}", settings.host, settings.port)
    }
}

/// A webhook ready to send: its client, path and key.
pub struct Webhook {
    client: HttpsClient,
    path_and_query: String,
    key: zeroize::Zeroizing<String>,
    pub url: String,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Webhook {
    /// Reads the key and the CA and builds the client; contacts nothing.
    pub fn new(settings: &WebhookSettings) -> Result<Self, String> {
        let key = files::read_secret_line(&settings.hmac_key_file, "the webhook's HMAC key")
            .map_err(|error| format!("notify.webhook.hmac_key_file: {error}"))?;
        if key.len() < 16 {
            return Err(format!(
                "notify.webhook.hmac_key_file: {}: the key is {} bytes; give at least 16 (e.g. `openssl rand -hex 32`)",
                settings.hmac_key_file.display(),
                key.len()
            ));
        }
        let ca = match &settings.ca_file {
            None => None,
            Some(path) => {
                let pem = files::read_trusted(path).map_err(|error| {
                    if path == std::path::Path::new(super::settings::SYSTEM_CA_BUNDLE) {
                        format!("notify.webhook: no ca_file or fingerprint is set, so the system's CAs verify the receiver, and {error}: install Debian's ca-certificates, or set ca_file or fingerprint")
                    } else {
                        format!("notify.webhook.ca_file: {error}")
                    }
                })?;
                let certificates =
                    tls::parse_certificates(&pem, "the CA file").map_err(|error| {
                        format!("notify.webhook.ca_file: {}: {error}", path.display())
                    })?;
                Some(tls::ca_roots(&certificates).map_err(|error| {
                    format!("notify.webhook.ca_file: {}: {error}", path.display())
                })?)
            }
        };
        let trust = tls::ApiTrust::new(ca, settings.fingerprint)
            .ok_or("notify.webhook: neither a CA nor a fingerprint to verify it by")?;
        let client = HttpsClient::new(
            &settings.host,
            settings.port,
            &trust,
            Limits {
                connect: Duration::from_secs(10),
                response: Duration::from_secs(15),
                // The receiver's answer is not read beyond its status.
                max_reply_bytes: 64 * 1024,
                concurrency: 1,
            },
        )
        .map_err(|error| format!("notify.webhook.url: {error}"))?;
        Ok(Self {
            client,
            path_and_query: settings.path_and_query.clone(),
            key,
            // Only where it goes: the path may carry the receiver's token.
            url: client_url(settings),
        })
    }

    /// Sends `body` once, signed at `timestamp`; a reply outside 2xx is a failure.
    pub async fn send(&self, body: &str, timestamp: i64) -> Result<(), String> {
        let signed = signature(self.key.as_bytes(), timestamp, body.as_bytes());
        let timestamp = timestamp.to_string();
        self.client
            .send(
                hyper::Method::POST,
                &self.path_and_query,
                &[
                    (TIMESTAMP_HEADER, timestamp.as_bytes()),
                    (SIGNATURE_HEADER, signed.as_bytes()),
                ],
                Some(("application/json", bytes::Bytes::from(body.to_owned()))),
                |reason, body| describe_refusal(reason, body, true),
                &self.key,
            )
            .await
            .map(|_| ())
            // The path may carry the receiver's token (Slack, Mattermost): it is not repeated.
            .map_err(|error| error.to_string().replace(&self.path_and_query, "/…"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_over_timestamp_dot_body() {
        // As Python's `hmac.new(b"Jefe", b"1796000000.{}", hashlib.sha256).hexdigest()`.
        assert_eq!(
            signature(b"Jefe", 1_796_000_000, b"{}"),
            "sha256=d6aa55d7abf4e274a6a29bb2e30a22a26566c8515a422e1b9869e58b9d8785f7"
        );
    }
}
