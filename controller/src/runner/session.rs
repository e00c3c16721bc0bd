//! A validation's connection to its node: connecting and reconnecting as the run, what a failed
//! call means (the connection lost, or the node's refusal), and calls bounded by the deadline
//! and the operator's interrupts.

use super::Stop;
use crate::authority::IssuedCertificate;
use crate::client::{self, NodeError};
use crate::interrupt::{ABANDON_STEP, Interrupts, interrupted_to};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// How long connecting and the TLS handshake may take before the node counts as unreachable.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Between two attempts to reach a node again after the connection was lost.
pub(super) const RECONNECT_PAUSE_MAX: Duration = Duration::from_secs(5);

/// A connection to the node as the run.
pub(super) struct Session {
    pub(super) endpoint: String,
    pub(super) node: String,
    pub(super) ca_pem: String,
    pub(super) identity: Arc<IssuedCertificate>,
    /// The signed grant, presented again after a reconnect (BeginRun resumes an open run).
    pub(super) grant: pb::SignedRunGrant,
    pub(super) client: Option<ConnectorClient<Channel>>,
    /// The run's deadline: its certificate is void after it.
    pub(super) deadline: Instant,
}

impl Session {
    pub(super) async fn connect(&mut self) -> Result<pb::HelloReply, NodeError> {
        let connect = client::connect(&self.endpoint, &self.node, &self.ca_pem, &self.identity);
        let mut connection = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| NodeError::Status {
                code: tonic::Code::Unavailable,
                message: format!(
                    "no TLS session with {} within {} s",
                    self.endpoint,
                    CONNECT_TIMEOUT.as_secs()
                ),
            })??;
        let hello =
            tokio::time::timeout(CONNECT_TIMEOUT, client::hello(&mut connection, &self.node))
                .await
                .map_err(|_| NodeError::Status {
                    code: tonic::Code::Unavailable,
                    message: format!("no Hello answer within {} s", CONNECT_TIMEOUT.as_secs()),
                })??;
        self.client = Some(connection);
        Ok(hello)
    }

    /// Connects again and presents the grant: the node resumes the run it recovered from its
    /// journal (or, when the first BeginRun never arrived, begins it, with nothing to undo).
    pub(super) async fn reconnect(&mut self) -> Result<(), NodeError> {
        self.connect().await?;
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        match client
            .begin_run(pb::BeginRunRequest {
                grant: Some(self.grant.clone()),
            })
            .await
        {
            Err(status) if connection_lost(&status) => Err(status.into()),
            // Any other answer: Cleanup's answer says what the node holds.
            _ => Ok(()),
        }
    }
}

/// Whether a failed call means the connection is gone (rather than a node's answer).
pub(super) fn connection_lost(status: &tonic::Status) -> bool {
    // tonic reports a broken transport as UNAVAILABLE or UNKNOWN, and CANCELLED when the
    // stream was reset under the call. The node answers UNAVAILABLE itself only for a probe
    // address the node took away (an `ifreload`): the connection is fine, the run stops as an
    // infrastructure error.
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    ) && !node_removed_probe_address(status)
}

/// The node's own UNAVAILABLE for a probe address it no longer carries (protocol.md, Probe):
/// its status details say so ([`pb::ErrorDetail`]).
fn node_removed_probe_address(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
        && <pb::ErrorDetail as prost::Message>::decode(status.details())
            .is_ok_and(|detail| detail.reason == pb::ErrorReason::ProbeAddressRemoved as i32)
}

/// Whether a BeginRun error is the node's refusal, so no run exists: anything else (a reset
/// stream, an internal error, a timeout) may have left the run open.
pub(super) fn definitely_not_begun(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::InvalidArgument
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::FailedPrecondition
            | tonic::Code::ResourceExhausted
            | tonic::Code::AlreadyExists
            | tonic::Code::OutOfRange
            | tonic::Code::Unimplemented
    )
}

/// A node's refusal for a step's detail and the verdict: its message is the node's text,
/// escaped and bounded.
pub(super) fn describe_status(status: &tonic::Status) -> String {
    use certistack_core::untrusted::{MAX_DETAIL_CHARS, printable};
    format!(
        "{:?}: {}",
        status.code(),
        printable(status.message().as_bytes(), MAX_DETAIL_CHARS)
    )
}

/// Runs `call` unless the operator abandons it or the deadline passes first.
pub(super) async fn guarded<T>(
    interrupts: &mut Interrupts,
    deadline: Instant,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, Stop> {
    if *interrupts.borrow() >= ABANDON_STEP {
        return Err(Stop::Interrupted("interrupted by the operator".into()));
    }
    let abandon = interrupted_to(interrupts, ABANDON_STEP);
    tokio::select! {
        result = call => match result {
            Ok(response) => Ok(response.into_inner()),
            Err(status) if connection_lost(&status) => Err(Stop::Lost(describe_status(&status))),
            Err(status) => Err(Stop::Refused(describe_status(&status))),
        },
        () = abandon => Err(Stop::Interrupted(
            "interrupted by the operator (second interrupt: the step in progress was abandoned)".into(),
        )),
        () = tokio::time::sleep_until(deadline.into()) => Err(Stop::Deadline(
            "the run's deadline passed during the step".into(),
        )),
    }
}

/// How a call outside the steps ended without an answer.
#[derive(Debug)]
pub(super) enum CallError {
    /// The connection is gone (reconnecting may help).
    Lost(String),
    /// The node answered with a refusal.
    Refused(String),
    /// No answer within the time allowed.
    TimedOut(String),
    /// The operator's interrupts reached the level that abandons this wait.
    Abandoned,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Lost(text) | CallError::Refused(text) | CallError::TimedOut(text) => {
                f.write_str(text)
            }
            CallError::Abandoned => f.write_str("abandoned by the operator"),
        }
    }
}

/// How long an operator call (Cleanup after the deadline, the journal) may take.
pub(super) const OPERATOR_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long BeginRun and EndRun may take: the node answers them without running a tool.
pub(super) const RUN_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Awaits `call` for at most `limit`, unless the interrupts reach `abandon_at` first.
pub(super) async fn within<T, E: std::fmt::Display>(
    interrupts: &mut Interrupts,
    abandon_at: u8,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, E>>,
    lost: impl Fn(&E) -> bool,
) -> Result<T, CallError> {
    if *interrupts.borrow() >= abandon_at {
        return Err(CallError::Abandoned);
    }
    let abandon = interrupted_to(interrupts, abandon_at);
    tokio::select! {
        result = tokio::time::timeout(limit, call) => match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) if lost(&error) => Err(CallError::Lost(error.to_string())),
            Ok(Err(error)) => Err(CallError::Refused(error.to_string())),
            Err(_) => Err(CallError::TimedOut(format!("no answer within {} s", limit.as_secs()))),
        },
        () = abandon => Err(CallError::Abandoned),
    }
}

pub(super) fn node_error_lost(error: &NodeError) -> bool {
    match error {
        NodeError::Status { code, .. } => matches!(
            code,
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
        ),
        NodeError::Connect(_) => true,
        _ => false,
    }
}

/// Sleeps `pause` (or until the deadline, or until the interrupts change).
pub(super) async fn pause_before_retry(
    interrupts: &mut Interrupts,
    pause: Duration,
    deadline: Instant,
) {
    let wait = tokio::time::sleep_until((Instant::now() + pause).min(deadline).into());
    tokio::select! {
        () = wait => {}
        _ = interrupts.changed() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_address_the_node_removed_is_not_a_lost_connection() {
        assert!(connection_lost(&tonic::Status::unavailable(
            "error trying to connect: tcp connect error"
        )));
        let removed = |reason: pb::ErrorReason| {
            tonic::Status::with_details(
                tonic::Code::Unavailable,
                "probe address removed by the node (ifreload?): 10.99.0.1/24 is no longer on csnet1",
                prost::Message::encode_to_vec(&pb::ErrorDetail {
                    reason: reason as i32,
                })
                .into(),
            )
        };
        assert!(!connection_lost(&removed(
            pb::ErrorReason::ProbeAddressRemoved
        )));
        // Decided by the detail, not the text: the same message without it is a lost connection.
        assert!(connection_lost(&tonic::Status::unavailable(
            "probe address removed by the node (ifreload?): 10.99.0.1/24 is no longer on csnet1"
        )));
        assert!(connection_lost(&removed(pb::ErrorReason::Unspecified)));
    }

    #[test]
    fn only_a_refusal_means_begin_run_left_nothing_to_clean() {
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::PermissionDenied,
            tonic::Code::FailedPrecondition,
            tonic::Code::ResourceExhausted,
        ] {
            assert!(definitely_not_begun(&tonic::Status::new(code, "refused")));
        }
        // A reset stream, an internal error or a timeout may have left the run open.
        for code in [
            tonic::Code::Internal,
            tonic::Code::Unavailable,
            tonic::Code::Unknown,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Cancelled,
        ] {
            assert!(!definitely_not_begun(&tonic::Status::new(code, "lost")));
        }
    }
}
