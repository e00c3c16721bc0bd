//! The fleet audit: every node of the inventory is asked, as an operator, which surface it serves,
//! what it runs and what it still holds, so an auditor can prove the whole fleet serves the
//! reviewed surface and nothing else.

use crate::authority::IssuedCertificate;
use crate::client;
use crate::config::InventoryNode;
use certistack_core::untrusted;
use certistack_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;

/// Nodes asked at the same time; the rest wait for a slot.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Connecting, Hello and ListRuns together, per node.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_secs(10);
/// A node clock further off than this is a warning: grant deadlines and certificates depend on it.
pub const MAX_CLOCK_SKEW_MS: i64 = 5_000;
/// A node certificate expiring sooner than this is a warning: re-enroll the node before it does.
pub const CERTIFICATE_WARNING_SECS: i64 = 30 * 24 * 3600;

/// Exit codes of `certistack-ctl nodes audit`, decided with the others in [`crate::exit`].
/// What one node answered, or why it could not.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeAudit {
    pub node: String,
    pub endpoint: String,
    pub reachable: bool,
    /// Why the node could not be asked (unreachable, TLS refused, timed out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub answer: Option<NodeAnswer>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeAnswer {
    /// The name the node answers with; differing from the inventory is drift.
    pub answered_name: String,
    pub version: String,
    pub source_commit: String,
    pub source_tree_dirty: bool,
    pub surface_digest: String,
    pub surface_matches: bool,
    pub capabilities: usize,
    /// Node time minus controller time, measured at the middle of the Hello round trip.
    pub clock_skew_ms: i64,
    pub open_runs: Option<usize>,
    pub quarantined_runs: Option<usize>,
    /// Why ListRuns gave no answer (the counts are then absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs_error: Option<String>,
    /// The node certificate's not_after, as verified during the handshake.
    pub certificate_not_after_unix: Option<i64>,
    /// Why the node certificate could not be read (the expiry is then absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub certificate_error: Option<String>,
    /// Controller time when the node was asked, against which the expiry is judged.
    #[serde(skip)]
    pub asked_at_unix: i64,
}

impl NodeAnswer {
    pub fn drifted(&self, expected_name: &str) -> bool {
        !self.surface_matches || self.answered_name != expected_name
    }

    /// Everything short of drift that an operator should look at.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.clock_skew_ms.abs() > MAX_CLOCK_SKEW_MS {
            warnings.push(format!(
                "clock off by {} ms (more than {MAX_CLOCK_SKEW_MS} ms); fix NTP on the node",
                self.clock_skew_ms
            ));
        }
        match self.certificate_not_after_unix {
            Some(not_after) if not_after - self.asked_at_unix < CERTIFICATE_WARNING_SECS => {
                warnings.push(format!(
                    "node certificate expires in {} days; re-enroll the node",
                    (not_after - self.asked_at_unix) / 86_400
                ));
            }
            Some(_) => {}
            None => warnings.push(format!(
                "node certificate not read: {}",
                self.certificate_error
                    .as_deref()
                    .unwrap_or("unknown reason")
            )),
        }
        if let Some(error) = &self.runs_error {
            warnings.push(format!("runs not listed: {error}"));
        }
        if self.quarantined_runs.unwrap_or(0) > 0 {
            warnings
                .push("quarantined runs; see `certistack-ctl runs` and clean them up".to_owned());
        }
        warnings
    }
}

impl NodeAudit {
    /// The status word of the table: ok, DRIFT, WARN or UNREACHABLE.
    pub fn status(&self) -> &'static str {
        match &self.answer {
            None => "UNREACHABLE",
            Some(answer) if answer.drifted(&self.node) => "DRIFT",
            Some(answer) if !answer.warnings().is_empty() => "WARN",
            Some(_) => "ok",
        }
    }

    /// One JSON object, with the status and warnings spelled out.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        if let serde_json::Value::Object(map) = &mut value {
            map.insert("status".into(), self.status().into());
            let warnings = self.answer.as_ref().map(NodeAnswer::warnings);
            map.insert("warnings".into(), warnings.unwrap_or_default().into());
        }
        value
    }
}

/// Asks every node concurrently (at most `concurrency` at once, each within `timeout`); rows in
/// inventory order.
pub async fn audit_fleet<'a>(
    nodes: impl IntoIterator<Item = &'a InventoryNode>,
    ca_pem: &str,
    identity: Arc<IssuedCertificate>,
    concurrency: usize,
    timeout: Duration,
) -> Vec<NodeAudit> {
    let ca_pem: Arc<str> = Arc::from(ca_pem);
    for_each_node(
        nodes,
        concurrency,
        move |node| {
            let (ca_pem, identity) = (ca_pem.clone(), identity.clone());
            async move { audit_node(&node, &ca_pem, &identity, timeout).await }
        },
        |node| unreachable(node, "the audit was stopped".to_owned()),
    )
    .await
}

/// Runs `ask` for every node, at most `concurrency` at once; answers in inventory order, and
/// `stopped` for a node whose task did not finish.
pub async fn for_each_node<'a, T, F, Fut>(
    nodes: impl IntoIterator<Item = &'a InventoryNode>,
    concurrency: usize,
    ask: F,
    stopped: impl Fn(&InventoryNode) -> T,
) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(InventoryNode) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut rows = Vec::new();
    for (index, node) in nodes.into_iter().enumerate() {
        rows.push(stopped(node));
        let slots = slots.clone();
        let asked = ask(node.clone());
        tasks.spawn(async move {
            let _slot = slots.acquire_owned().await.ok()?;
            Some((index, asked.await))
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Ok(Some((index, row))) = done
            && let Some(slot) = rows.get_mut(index)
        {
            *slot = row;
        }
    }
    rows
}

/// Says Hello on `connection` and measures the node's clock against this host's at the middle
/// of the round trip: the reply and the skew (node minus controller, ms).
pub async fn hello_with_skew(
    connection: &mut certistack_proto::v1::connector_client::ConnectorClient<
        tonic::transport::Channel,
    >,
) -> Result<(pb::HelloReply, i64), client::NodeError> {
    let sent = time::OffsetDateTime::now_utc();
    let hello = connection.hello(pb::HelloRequest {}).await?.into_inner();
    let received = time::OffsetDateTime::now_utc();
    let middle_ms =
        ((sent.unix_timestamp_nanos() + received.unix_timestamp_nanos()) / 2 / 1_000_000) as i64;
    let skew_ms = hello.node_time_unix_ms.saturating_sub(middle_ms);
    Ok((hello, skew_ms))
}

fn unreachable(node: &InventoryNode, error: String) -> NodeAudit {
    NodeAudit {
        node: node.name.to_string(),
        endpoint: node.endpoint(),
        reachable: false,
        error: Some(error),
        answer: None,
    }
}

/// Connects, says Hello and lists the runs, all within `timeout`.
pub async fn audit_node(
    node: &InventoryNode,
    ca_pem: &str,
    identity: &IssuedCertificate,
    timeout: Duration,
) -> NodeAudit {
    let name = node.name.to_string();
    let endpoint = node.endpoint();
    let asked = tokio::time::timeout(timeout, async {
        let mut connection = client::connect(&endpoint, &name, ca_pem, identity).await?;
        let (hello, skew_ms) = hello_with_skew(&mut connection).await?;
        let middle_ms = hello.node_time_unix_ms.saturating_sub(skew_ms);
        let runs = connection
            // The audit counts open and quarantined runs, which every page lists in full.
            .list_runs(pb::ListRunsRequest {
                closed_page_size: 1,
                closed_cursor: String::new(),
            })
            .await
            .map(|reply| reply.into_inner().runs)
            .map_err(|status| client::NodeError::from(status).to_string());
        let certificate = node_certificate_not_after(&endpoint, &name, ca_pem, identity).await;
        Ok::<_, client::NodeError>(answer(hello, middle_ms, runs, certificate))
    })
    .await;
    match asked {
        Ok(Ok(answer)) => NodeAudit {
            node: name,
            endpoint,
            reachable: true,
            error: None,
            answer: Some(answer),
        },
        Ok(Err(error)) => unreachable(node, error.to_string()),
        Err(_) => unreachable(
            node,
            format!("no answer within {} s", timeout.as_secs_f64()),
        ),
    }
}

/// The node certificate's not_after, from a handshake of its own: the gRPC channel verifies the
/// certificate but does not hand it out. The same verifier (CA, name, node profile) applies.
async fn node_certificate_not_after(
    endpoint: &str,
    name: &str,
    ca_pem: &str,
    identity: &IssuedCertificate,
) -> Result<i64, String> {
    use certistack_core::tls;
    let text = |error: tls::TlsError| error.to_string();
    let ca = tls::parse_certificates(ca_pem, "controller CA").map_err(text)?;
    let chain =
        tls::parse_certificates(&identity.certificate_pem, "client certificate").map_err(text)?;
    let key = tls::parse_private_key(&identity.key_pem, "client key").map_err(text)?;
    let config = tls::client_config(tls::ca_roots(&ca).map_err(text)?, chain, key).map_err(text)?;
    let server_name = rustls_pki_types::ServerName::try_from(name.to_owned())
        .map_err(|error| format!("{name} is not a certificate name: {error}"))?;
    let tcp = tokio::net::TcpStream::connect(endpoint)
        .await
        .map_err(|error| format!("connecting to {endpoint}: {error}"))?;
    let stream = tokio_rustls::TlsConnector::from(config)
        .connect(server_name, tcp)
        .await
        .map_err(|error| format!("TLS handshake with {endpoint}: {error}"))?;
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .ok_or_else(|| format!("{endpoint} presented no certificate"))?;
    let (_, certificate) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|error| format!("the node certificate does not parse: {error}"))?;
    Ok(certificate.validity().not_after.timestamp())
}

fn answer(
    hello: pb::HelloReply,
    controller_ms: i64,
    runs: Result<Vec<pb::RunSummary>, String>,
    certificate: Result<i64, String>,
) -> NodeAnswer {
    let state = |run: &pb::RunSummary| pb::RunState::try_from(run.state).ok();
    let (open_runs, quarantined_runs, runs_error) = match runs {
        Ok(runs) => (
            Some(
                runs.iter()
                    .filter(|run| {
                        matches!(state(run), Some(pb::RunState::Open | pb::RunState::Expired))
                    })
                    .count(),
            ),
            Some(
                runs.iter()
                    .filter(|run| state(run) == Some(pb::RunState::Quarantined))
                    .count(),
            ),
            None,
        ),
        Err(error) => (None, None, Some(error)),
    };
    // What the node says of itself is its own text, printed in the table and the JSON: kept
    // escaped and bounded (a plain name, version or digest is unchanged).
    let shown = |text: &str| untrusted::printable(text.as_bytes(), untrusted::MAX_VALUE_CHARS);
    NodeAnswer {
        surface_matches: hello.surface_digest == certistack_proto::SURFACE_DIGEST,
        answered_name: shown(&hello.node_name),
        version: shown(&hello.daemon_version),
        source_commit: shown(&hello.source_commit),
        source_tree_dirty: hello.source_tree_dirty,
        surface_digest: shown(&hello.surface_digest),
        capabilities: hello.capabilities.len(),
        clock_skew_ms: hello.node_time_unix_ms.saturating_sub(controller_ms),
        open_runs,
        quarantined_runs,
        runs_error,
        certificate_not_after_unix: certificate.as_ref().ok().copied(),
        certificate_error: certificate
            .err()
            .map(|error| untrusted::printable(error.as_bytes(), untrusted::MAX_DETAIL_CHARS)),
        asked_at_unix: controller_ms / 1000,
    }
}

/// The table a person reads: one line per node, then the reasons for every status but ok.
pub fn table(rows: &[NodeAudit]) -> String {
    let header = [
        "NODE",
        "STATUS",
        "REACHABLE",
        "VERSION",
        "SURFACE",
        "CAPS",
        "CERT EXPIRES",
        "SKEW",
        "OPEN",
        "QUARANTINED",
    ];
    let count = |n: Option<usize>| n.map_or("-".to_owned(), |n| n.to_string());
    let mut lines: Vec<[String; 10]> = vec![header.map(str::to_owned)];
    for row in rows {
        let cells = match &row.answer {
            None => [
                row.node.clone(),
                row.status().to_owned(),
                "no".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ],
            Some(answer) => [
                row.node.clone(),
                row.status().to_owned(),
                "yes".to_owned(),
                format!(
                    "{} ({}{})",
                    answer.version,
                    short_commit(&answer.source_commit),
                    if answer.source_tree_dirty {
                        "+dirty"
                    } else {
                        ""
                    }
                ),
                if answer.surface_matches {
                    short_digest(&answer.surface_digest)
                } else {
                    format!("DRIFT {}", short_digest(&answer.surface_digest))
                },
                answer.capabilities.to_string(),
                answer
                    .certificate_not_after_unix
                    .map_or("-".to_owned(), |not_after| {
                        format!(
                            "{} ({}d)",
                            date(not_after),
                            (not_after - answer.asked_at_unix) / 86_400
                        )
                    }),
                format!("{:+.1}s", answer.clock_skew_ms as f64 / 1000.0),
                count(answer.open_runs),
                count(answer.quarantined_runs),
            ],
        };
        lines.push(cells);
    }
    let mut widths = [0usize; 10];
    for line in &lines {
        for (width, cell) in widths.iter_mut().zip(line) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!(
        "controller surface: {}\n",
        certistack_proto::SURFACE_DIGEST
    ));
    for row in rows {
        match &row.answer {
            None => out.push_str(&format!(
                "{}: unreachable at {}: {}\n",
                row.node,
                row.endpoint,
                row.error.as_deref().unwrap_or("no answer")
            )),
            Some(answer) => {
                if !answer.surface_matches {
                    out.push_str(&format!(
                        "{}: serves surface {}, not the controller's; install the same certistack release\n",
                        row.node, answer.surface_digest
                    ));
                }
                if answer.answered_name != row.node {
                    out.push_str(&format!(
                        "{}: answers as \"{}\"; check the address and the node's config\n",
                        row.node, answer.answered_name
                    ));
                }
                for warning in answer.warnings() {
                    out.push_str(&format!("{}: {warning}\n", row.node));
                }
            }
        }
    }
    out
}

fn date(unix: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix)
        .map_or_else(|_| unix.to_string(), |at| at.date().to_string())
}

fn short_commit(commit: &str) -> String {
    commit.chars().take(12).collect()
}

/// `sha256:` and the first 12 hex digits: enough to tell digests apart in a table.
fn short_digest(digest: &str) -> String {
    digest.chars().take(19).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer_expiring_in(secs: i64) -> NodeAnswer {
        NodeAnswer {
            answered_name: "pve1".into(),
            version: "0.1.0".into(),
            source_commit: "abc".into(),
            source_tree_dirty: false,
            surface_digest: certistack_proto::SURFACE_DIGEST.into(),
            surface_matches: true,
            capabilities: 3,
            clock_skew_ms: 0,
            open_runs: Some(0),
            quarantined_runs: Some(0),
            runs_error: None,
            certificate_not_after_unix: Some(1_000_000 + secs),
            certificate_error: None,
            asked_at_unix: 1_000_000,
        }
    }

    #[test]
    fn certificates_expiring_within_30_days_and_skew_over_5_s_are_warnings() {
        assert!(answer_expiring_in(31 * 86_400).warnings().is_empty());
        let warnings = answer_expiring_in(29 * 86_400).warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("expires in 29 days"), "{warnings:?}");
        let mut skewed = answer_expiring_in(365 * 86_400);
        skewed.clock_skew_ms = -5_001;
        assert!(skewed.warnings()[0].contains("clock off by -5001 ms"));
        skewed.clock_skew_ms = 5_000;
        assert!(skewed.warnings().is_empty());
        let row = NodeAudit {
            node: "pve1".into(),
            endpoint: "127.0.0.1:7443".into(),
            reachable: true,
            error: None,
            answer: Some(answer_expiring_in(86_400)),
        };
        assert_eq!(row.status(), "WARN");
        assert_eq!(
            crate::exit::audit_exit_code(&[row]),
            crate::exit::AUDIT_DRIFT_OR_WARNING
        );
    }

    #[test]
    fn the_audit_prints_no_terminal_sequence_of_the_node_and_stays_bounded() {
        use certistack_core::fixtures::{TERMINAL_SEQUENCES, acts_on_a_terminal};
        let hostile = |label: &str| format!("{label}{TERMINAL_SEQUENCES}{}", "A".repeat(100_000));
        let hello = pb::HelloReply {
            node_name: hostile("pve1"),
            daemon_version: hostile("0.1.0"),
            source_commit: hostile(""),
            surface_digest: hostile("sha256:"),
            ..Default::default()
        };
        let runs = Err(
            client::NodeError::from(tonic::Status::internal(hostile("ListRuns: "))).to_string(),
        );
        let row = NodeAudit {
            node: "pve1".into(),
            endpoint: "127.0.0.1:7443".into(),
            reachable: true,
            error: None,
            answer: Some(answer(hello, 0, runs, Err(hostile("certificate: ")))),
        };
        let table = table(std::slice::from_ref(&row));
        for line in table.lines() {
            assert!(!acts_on_a_terminal(line), "{line:?}");
        }
        assert!(table.len() < 32 * 1024, "{} bytes", table.len());
        let json = row.to_json().to_string();
        assert!(!acts_on_a_terminal(&json), "{json:?}");
        assert!(json.len() < 32 * 1024, "{} bytes", json.len());
    }
}
