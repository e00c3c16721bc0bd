//! What the daemon logs about connections and calls, without letting a peer fill the log.
//!
//! - Every call is logged once, when its outcome is known (the `grpc-status` of its response
//!   headers or trailers, or the client going away): a short INFO line for a success; a refusal
//!   or failure goes through a [`RefusalLog`].
//! - A [`RefusalLog`] logs the first few refusals of each window one by one, with the peer and
//!   the reason, then only counts them and logs one summary per window: "N refused from M
//!   sources (reasons: …)". Refused handshakes need no certificate, so this is what bounds the
//!   log an unauthenticated peer can cause.

use crate::connection::{Activity, CallGuard, PeerInfo};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::codegen::http;

/// How long one refusal window lasts.
pub const REFUSAL_WINDOW: Duration = Duration::from_secs(10);
/// Refused or failed calls logged one by one per window before they are only counted.
pub const DETAILED_CALL_REFUSALS: u32 = 20;
/// Distinct reasons a summary names; the rest are counted as "other".
const MAX_REASONS: usize = 16;
/// Distinct sources counted per window; beyond this the summary says "at least".
const MAX_SOURCES: usize = 4096;
/// Characters of a peer-derived reason kept in a log line.
const MAX_REASON_CHARS: usize = 240;

/// Refusals of one kind (handshakes, calls), logged one by one up to a budget per window and
/// summarized beyond it.
#[derive(Debug)]
pub struct RefusalLog {
    what: &'static str,
    detailed_per_window: u32,
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    total: u64,
    detailed: u32,
    sources: HashSet<IpAddr>,
    reasons: BTreeMap<String, u64>,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self {
            started: now,
            total: 0,
            detailed: 0,
            sources: HashSet::new(),
            reasons: BTreeMap::new(),
        }
    }
}

/// One closed window with refusals that were not logged one by one.
#[derive(Debug, PartialEq, Eq)]
pub struct Summary {
    pub total: u64,
    pub logged: u32,
    pub sources: usize,
    pub reasons: String,
}

impl RefusalLog {
    /// `what` names the refused thing in the summary ("handshakes", "calls").
    pub fn new(what: &'static str, detailed_per_window: u32) -> Self {
        Self {
            what,
            detailed_per_window,
            window: Mutex::new(Window::new(Instant::now())),
        }
    }

    /// Counts one refusal from `source` for `reason`; true when the caller should log this
    /// one in detail (it is within the window's budget).
    pub fn record(&self, source: IpAddr, reason: &str) -> bool {
        self.record_at(Instant::now(), source, reason)
    }

    fn record_at(&self, now: Instant, source: IpAddr, reason: &str) -> bool {
        let (detailed, closed) = {
            let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
            let closed = Self::roll(&mut window, now);
            window.total = window.total.saturating_add(1);
            if window.sources.len() < MAX_SOURCES {
                window.sources.insert(source);
            }
            let reason = printable(reason);
            let known = window.reasons.contains_key(&reason);
            let key = if known || window.reasons.len() < MAX_REASONS {
                reason
            } else {
                "other".to_owned()
            };
            let count = window.reasons.entry(key).or_insert(0);
            *count = count.saturating_add(1);
            let detailed = window.detailed < self.detailed_per_window;
            if detailed {
                window.detailed = window.detailed.saturating_add(1);
            }
            (detailed, closed)
        };
        if let Some(summary) = closed {
            self.emit(&summary);
        }
        detailed
    }

    /// Logs the summary of the current window when it has ended; called periodically so a
    /// window's summary appears even when no further refusal arrives.
    pub fn flush(&self) {
        let closed = {
            let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
            Self::roll(&mut window, Instant::now())
        };
        if let Some(summary) = closed {
            self.emit(&summary);
        }
    }

    /// Starts a new window when the current one has ended; returns the ended window's summary
    /// when some of its refusals were not logged one by one.
    fn roll(window: &mut Window, now: Instant) -> Option<Summary> {
        if now.saturating_duration_since(window.started) < REFUSAL_WINDOW {
            return None;
        }
        let ended = std::mem::replace(window, Window::new(now));
        if ended.total <= u64::from(ended.detailed) {
            return None;
        }
        let reasons = ended
            .reasons
            .iter()
            .map(|(reason, count)| format!("{reason} ×{count}"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(Summary {
            total: ended.total,
            logged: ended.detailed,
            sources: ended.sources.len(),
            reasons,
        })
    }

    fn emit(&self, summary: &Summary) {
        let at_least = if summary.sources >= MAX_SOURCES {
            "at least "
        } else {
            ""
        };
        tracing::warn!(
            "{} {} refused in {} s from {at_least}{} sources, the first {} logged one by one (reasons: {})",
            summary.total,
            self.what,
            REFUSAL_WINDOW.as_secs(),
            summary.sources,
            summary.logged,
            summary.reasons
        );
    }
}

/// A peer-derived text made safe for one log line: control characters escaped, length capped.
pub fn printable(text: &str) -> String {
    let mut out = String::new();
    for (count, c) in text.chars().enumerate() {
        if count >= MAX_REASON_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Adds [`CallLog`] to every call of the server.
#[derive(Debug, Clone)]
pub struct CallLogLayer {
    refusals: Arc<RefusalLog>,
}

impl CallLogLayer {
    pub fn new(refusals: Arc<RefusalLog>) -> Self {
        Self { refusals }
    }
}

impl<S> tower::Layer<S> for CallLogLayer {
    type Service = CallLog<S>;
    fn layer(&self, inner: S) -> CallLog<S> {
        CallLog {
            inner,
            refusals: self.refusals.clone(),
        }
    }
}

/// Logs each call once with its outcome and marks the connection busy from the moment its
/// request has arrived whole until its response ends, so that the idle timeout only closes
/// connections without calls.
#[derive(Debug, Clone)]
pub struct CallLog<S> {
    inner: S,
    refusals: Arc<RefusalLog>,
}

type CallFuture<E> =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, E>> + Send>>;

impl<S> tower::Service<http::Request<tonic::body::Body>> for CallLog<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = CallFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let call = Call::begin(&request, self.refusals.clone());
        // The connection counts as busy once the request has arrived whole, not from its
        // headers: a stream that never finishes its request must not keep a connection from
        // its idle timeout.
        let busy = call.busy.clone();
        let activity = call.peer.as_ref().map(|p| p.activity.clone());
        let request = request.map(|body| {
            tonic::body::Body::new(ArrivingRequest {
                inner: body,
                arrived: activity.map(|activity| (activity, busy)),
            })
        });
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(call.watch(response))
        })
    }
}

/// The connection's activity and the slot the call's guard goes into once its request arrived.
type ArrivalSlot = (Arc<Activity>, Arc<Mutex<Option<CallGuard>>>);

/// A request body that marks its call in progress once it has been received whole.
struct ArrivingRequest {
    inner: tonic::body::Body,
    arrived: Option<ArrivalSlot>,
}

impl ArrivingRequest {
    fn mark_arrived(&mut self) {
        if let Some((activity, busy)) = self.arrived.take() {
            let mut slot = busy.lock().unwrap_or_else(|e| e.into_inner());
            *slot = Some(activity.begin_call());
        }
    }
}

impl Body for ArrivingRequest {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.mark_arrived();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One call from its request to its outcome.
#[derive(Debug)]
struct Call {
    finished: bool,
    rpc: String,
    peer: Option<PeerInfo>,
    started: Instant,
    refusals: Arc<RefusalLog>,
    /// Set once the request has arrived whole; dropped with the call.
    busy: Arc<Mutex<Option<CallGuard>>>,
}

impl Call {
    fn begin<B>(request: &http::Request<B>, refusals: Arc<RefusalLog>) -> Self {
        let path = request.uri().path();
        let method = path
            .strip_prefix('/')
            .and_then(|p| p.strip_prefix(certistack_proto::SERVICE_NAME))
            .and_then(|p| p.strip_prefix('/'))
            .unwrap_or(path);
        let peer = request.extensions().get::<PeerInfo>().cloned();
        Self {
            finished: false,
            rpc: printable(method),
            peer,
            started: Instant::now(),
            refusals,
            busy: Arc::default(),
        }
    }

    /// The outcome is in the response headers when the call was answered trailers-only (every
    /// refusal), else in the trailers at the end of the body.
    fn watch(
        mut self,
        response: http::Response<tonic::body::Body>,
    ) -> http::Response<tonic::body::Body> {
        if let Some(status) = tonic::Status::from_header_map(response.headers()) {
            self.finish(status.code(), status.message());
            return response;
        }
        response.map(|body| {
            tonic::body::Body::new(WatchedBody {
                inner: body,
                call: Some(self),
            })
        })
    }

    fn finish(&mut self, code: Code, reason: &str) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let (id, from) = match &self.peer {
            Some(peer) => (
                match &peer.identity {
                    Ok(client) => client.identity.to_string(),
                    Err(_) => "unidentified".to_owned(),
                },
                Some(peer.remote.ip()),
            ),
            None => ("unknown".to_owned(), None),
        };
        let from_text = from.map(|ip| ip.to_string()).unwrap_or_default();
        if code == Code::Ok {
            tracing::info!(rpc = %self.rpc, %id, from = %from_text, ms, "ok");
            return;
        }
        let source = from.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        let kind = format!("{} {code:?}", self.rpc);
        if self.refusals.record(source, &kind) {
            let reason = printable(reason);
            let outcome = match code {
                Code::Cancelled => "cancelled",
                Code::Internal
                | Code::Unknown
                | Code::Unavailable
                | Code::DataLoss
                | Code::DeadlineExceeded => "failed",
                _ => "refused",
            };
            tracing::warn!(rpc = %self.rpc, %id, from = %from_text, ?code, %reason, ms, "{outcome}");
        }
    }
}

impl Drop for Call {
    /// A call dropped before its outcome was known: the client reset the stream or the
    /// connection closed while the request was still being read or handled.
    fn drop(&mut self) {
        self.finish(
            Code::Cancelled,
            "the client went away before the call ended",
        );
    }
}

/// A response body whose trailers carry the call's outcome.
struct WatchedBody {
    inner: tonic::body::Body,
    call: Option<Call>,
}

impl WatchedBody {
    fn finish(&mut self, code: Code, reason: &str) {
        if let Some(mut call) = self.call.take() {
            call.finish(code, reason);
        }
    }
}

impl Body for WatchedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(status) = frame
                    .trailers_ref()
                    .and_then(tonic::Status::from_header_map)
                {
                    self.finish(status.code(), status.message());
                }
            }
            Poll::Ready(Some(Err(status))) => {
                let (code, reason) = (status.code(), status.message().to_owned());
                self.finish(code, &reason);
            }
            Poll::Ready(None) => self.finish(Code::Unknown, "the response ended without a status"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_window_logs_its_budget_then_summarizes_the_rest() {
        let log = RefusalLog::new("handshakes", 3);
        let start = Instant::now();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let detailed: Vec<bool> = (0..10)
            .map(|i| log.record_at(start, if i % 2 == 0 { a } else { b }, "timed out"))
            .collect();
        assert_eq!(
            detailed,
            [
                true, true, true, false, false, false, false, false, false, false
            ]
        );
        let mut window = log.window.lock().unwrap();
        let summary = RefusalLog::roll(&mut window, start + REFUSAL_WINDOW).unwrap();
        assert_eq!(
            summary,
            Summary {
                total: 10,
                logged: 3,
                sources: 2,
                reasons: "timed out ×10".into()
            }
        );
        // The new window starts with a fresh budget and nothing to summarize.
        assert!(RefusalLog::roll(&mut window, start + REFUSAL_WINDOW * 2).is_none());
    }

    #[test]
    fn reasons_are_bounded_and_escaped() {
        let log = RefusalLog::new("calls", 0);
        let start = Instant::now();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        for i in 0..100 {
            log.record_at(start, ip, &format!("reason {i}\n"));
        }
        let mut window = log.window.lock().unwrap();
        assert_eq!(window.reasons.len(), MAX_REASONS + 1);
        assert_eq!(window.reasons["other"], 100 - MAX_REASONS as u64);
        assert!(window.reasons.contains_key("reason 0\\n"));
        let summary = RefusalLog::roll(&mut window, start + REFUSAL_WINDOW).unwrap();
        assert_eq!(summary.total, 100);
        assert_eq!(
            printable(&"x".repeat(500)).chars().count(),
            MAX_REASON_CHARS + 1
        );
    }
}
