//! What the daemon logs about connections and calls, without letting a peer fill the log: every
//! call is logged once, when its outcome is known (the `grpc-status` of its response headers or
//! trailers, or the client going away): a short INFO line for a success, written once the
//! connection has flushed the reply to its socket ([`crate::success_lines`]); a refusal or failure goes
//! through a [`RefusalLog`], which logs the first few of each window one by one and then only
//! counts them ([`crate::refusal_log`]).

use crate::connection::{Activity, CallGuard, PeerInfo};
use crate::policy::Rpc;
use crate::refusal_log::RefusalLog;
use crate::refusal_log::printable;
use crate::success_lines::SuccessLine;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::borrow::Cow;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tonic::Code;
use tonic::codegen::http;

/// Refused or failed calls logged one by one per window before they are only counted.
pub const DETAILED_CALL_REFUSALS: u32 = 20;

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

/// Where a call keeps its in-progress mark once its request has arrived (dropped with the call).
type BusySlot = Arc<Mutex<Option<CallGuard>>>;

/// A request body that marks its call in progress once it has been received whole.
struct ArrivingRequest {
    inner: tonic::body::Body,
    arrived: Option<(Arc<Activity>, BusySlot)>,
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
    rpc: Cow<'static, str>,
    peer: Option<PeerInfo>,
    started: Instant,
    refusals: Arc<RefusalLog>,
    /// Set once the request has arrived whole; dropped with the call.
    busy: BusySlot,
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
        // The surface's own names need no escaping; anything else a client sent does.
        let rpc = match Rpc::ALL.iter().find(|rpc| rpc.name() == method) {
            Some(rpc) => Cow::Borrowed(rpc.name()),
            None => Cow::Owned(printable(method)),
        };
        Self {
            finished: false,
            rpc,
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
        if let Some((code, reason)) = status_in(response.headers()) {
            self.finish(code, &reason);
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
        let ended = Instant::now();
        let ms = u64::try_from(ended.duration_since(self.started).as_millis()).unwrap_or(u64::MAX);
        let (id, from_text, from): (&str, &str, _) = match &self.peer {
            Some(peer) => (
                &peer.identity_text,
                &peer.remote_ip_text,
                Some(peer.remote.ip()),
            ),
            None => ("unknown", "", None),
        };
        if code == Code::Ok {
            let line = SuccessLine::new(self.rpc.clone(), ms);
            match &self.peer {
                Some(peer) => peer.activity.success_lines.push(line, ended),
                None => line.write(id, from_text),
            }
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

/// The call's status if `headers` carry one (`grpc-status`): its code and, for a failure, its
/// message. A success without a message (what tonic sends) is read from that one header:
/// `Status::from_header_map` also decodes the message and copies every other header into a new
/// map, about 1,600 instructions a call (docs/performance.md, section 1, "The third pass"), for
/// a line that names neither. Anything else is tonic's to parse: a message that does not decode
/// turns even a `0` into `Unknown` there.
fn status_in(headers: &http::HeaderMap) -> Option<(Code, String)> {
    let without_message = headers
        .get("grpc-message")
        .is_none_or(|message| message.is_empty());
    if headers.get("grpc-status")?.as_bytes() == b"0" && without_message {
        return Some((Code::Ok, String::new()));
    }
    tonic::Status::from_header_map(headers)
        .map(|status| (status.code(), status.message().to_owned()))
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
                if let Some((code, reason)) = frame.trailers_ref().and_then(status_in) {
                    self.finish(code, &reason);
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
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, http::HeaderValue::from_str(value).unwrap());
        }
        map
    }

    /// The success lines, written by `success_lines`, carry this module's target as its other
    /// lines do.
    #[test]
    fn success_lines_carry_the_call_logs_target() {
        assert_eq!(
            format!("{}::tests", crate::success_lines::CALL_LOG_TARGET),
            module_path!()
        );
    }

    /// The shortcut for a success gives what tonic's own parsing gives, for every code, for
    /// values no code has and for a message that does not decode; a failure keeps its decoded
    /// message.
    #[test]
    fn the_status_is_the_one_tonic_reads() {
        let codes = (0..=16).map(|code| code.to_string());
        let values: Vec<String> = codes
            .chain(["00", "0 ", "17", "-1", "ok", ""].map(String::from))
            .collect();
        for value in &values {
            for message in [None, Some(""), Some("no%20run%20r1"), Some("%FF")] {
                let mut pairs = vec![("grpc-status", value.as_str())];
                pairs.extend(message.map(|message| ("grpc-message", message)));
                let map = headers(&pairs);
                let expected = tonic::Status::from_header_map(&map).unwrap();
                let context = format!("grpc-status {value:?}, grpc-message {message:?}");
                assert_eq!(
                    status_in(&map).unwrap(),
                    (expected.code(), expected.message().to_owned()),
                    "{context}"
                );
            }
        }
        assert_eq!(
            status_in(&headers(&[("grpc-status", "0"), ("grpc-message", "%FF")]))
                .unwrap()
                .0,
            Code::Unknown,
            "a success whose message does not decode is not logged as one"
        );
        assert_eq!(
            status_in(&headers(&[
                ("grpc-status", "5"),
                ("grpc-message", "no%20run")
            ])),
            Some((Code::NotFound, "no run".to_owned()))
        );
        assert_eq!(
            status_in(&headers(&[("content-type", "application/grpc")])),
            None
        );
    }
}
