//! Accepting connections: TLS handshakes and the bounds that keep the daemon reachable.
//!
//! Nothing a peer does before its handshake completes may make the accept loop wait:
//! - every handshake has `limits.handshake_timeout_ms`;
//! - at most `limits.max_pending_handshakes_per_source` handshakes are in progress from one
//!   source (an IPv4 address or an IPv6 /64) and `limits.max_pending_handshakes` in all; a new
//!   connection over either limit evicts the oldest pending handshake (of its source, else of
//!   the source holding the most), so a legitimate peer always gets a slot and an idle peer
//!   only ever displaces its own or older ones;
//! - peers inside `limits.trusted_peer_networks` (the controller's management network) keep a
//!   quarter of the pending-handshake slots that no other peer may take, and a handshake of
//!   theirs is never evicted for a peer outside them: a flood from many addresses, each holding
//!   as few handshakes as the controller, cannot push the controller out;
//! - connections are not accepted while fewer than `limits.reserved_fds` descriptors remain
//!   below `RLIMIT_NOFILE` (the tools and journals need them): the oldest pending handshake is
//!   given up instead, or, with none pending, accepting waits for connections to close; a
//!   failing `accept` (EMFILE) backs off instead of spinning.
//!
//! After the handshake, `limits.max_connections` established connections are served in all
//! and `limits.max_connections_per_identity` per client identity; more are closed at once. An
//! established connection with no call for `limits.idle_timeout_secs` is closed.
//!
//! Refused handshakes are logged through a [`RefusalLog`]: a peer needs no certificate to
//! cause one.

use crate::config::Limits;
use crate::refusal_log::{RefusalLog, printable};
use crate::success_lines::PendingLines;
use certistack_core::identity::{ClientIdentity, IdentityError, parse_client_certificate};
use certistack_core::net::IpNetwork;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Refused handshakes logged one by one per window before they are only counted.
pub const DETAILED_HANDSHAKE_REFUSALS: u32 = 5;
/// Longest pause of the accept loop after `accept` fails for lack of resources.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// How often the descriptor count is re-read from `/proc/self/fd`; between reads it is
/// estimated from the connections opened and closed.
const FD_RECOUNT: Duration = Duration::from_secs(1);

/// The connection bounds, from `[limits]`.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub handshake_timeout: Duration,
    pub max_pending_handshakes: usize,
    pub max_pending_handshakes_per_source: usize,
    pub max_connections: usize,
    pub max_connections_per_identity: usize,
    pub idle_timeout: Duration,
    pub reserved_fds: usize,
    /// Peers whose handshakes keep `trusted_reserve` slots and are never evicted for others.
    pub trusted_peer_networks: Vec<IpNetwork>,
}

impl ConnectionLimits {
    /// The pending-handshake slots only trusted peers may take: a quarter of all, at least one,
    /// and always one fewer than all so other peers can still connect; none without trusted
    /// networks.
    fn trusted_reserve(&self) -> usize {
        if self.trusted_peer_networks.is_empty() {
            return 0;
        }
        (self.max_pending_handshakes / 4)
            .max(1)
            .min(self.max_pending_handshakes.saturating_sub(1))
    }

    /// Whether `remote` lies inside `limits.trusted_peer_networks` (an IPv4 peer reaching an
    /// IPv6 socket by its IPv4 address).
    fn is_trusted(&self, remote: &SocketAddr) -> bool {
        let ip = match remote.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        self.trusted_peer_networks.iter().any(|n| n.contains(ip))
    }
}

impl From<&Limits> for ConnectionLimits {
    fn from(limits: &Limits) -> Self {
        Self {
            handshake_timeout: Duration::from_millis(limits.handshake_timeout_ms),
            max_pending_handshakes: limits.max_pending_handshakes.max(1),
            max_pending_handshakes_per_source: limits.max_pending_handshakes_per_source.max(1),
            max_connections: limits.max_connections.max(1),
            max_connections_per_identity: limits.max_connections_per_identity.max(1),
            idle_timeout: Duration::from_secs(limits.idle_timeout_secs),
            reserved_fds: limits.reserved_fds,
            trusted_peer_networks: limits
                .trusted_peer_networks
                .iter()
                .map(|n| n.network())
                .collect(),
        }
    }
}

/// Whether a connection has calls in progress and since when it has had none.
#[derive(Debug)]
pub struct Activity {
    origin: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `origin` when the last call began or ended.
    last_ms: AtomicU64,
    /// The lines of calls that succeeded, written once their replies have reached the socket.
    pub success_lines: PendingLines,
}

impl Activity {
    /// The activity of a connection of the client `identity_text` from `remote_ip_text`.
    fn new(identity_text: Arc<str>, remote_ip_text: Arc<str>) -> Self {
        Self {
            origin: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            success_lines: PendingLines::new(identity_text, remote_ip_text),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Marks a call in progress until the guard is dropped.
    pub fn begin_call(self: &Arc<Self>) -> CallGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.touch();
        CallGuard(self.clone())
    }

    /// How long the connection has been without a call; `None` while a call is in progress.
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        Some(self.origin.elapsed().saturating_sub(last))
    }
}

/// A call in progress on a connection.
#[derive(Debug)]
pub struct CallGuard(Arc<Activity>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the connector learned about the client during the handshake; tonic hands it to every
/// request of the connection as a request extension.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: SocketAddr,
    /// Shared by the connection's calls: each call's copy is a reference count.
    pub identity: Result<Arc<ClientIdentity>, IdentityError>,
    /// The identity as logs name it (`unidentified` without one), formatted once per
    /// connection rather than once per call.
    pub identity_text: Arc<str>,
    /// The client's IP address as logs name it, formatted once per connection.
    pub remote_ip_text: Arc<str>,
    pub activity: Arc<Activity>,
}

/// A TLS connection whose handshake succeeded, counted against the connection limits until
/// it is dropped, and ended (reads fail) once it has been idle for the idle timeout.
#[derive(Debug)]
pub struct PeerStream {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerInfo,
    idle_timeout: Duration,
    idle_check: Pin<Box<tokio::time::Sleep>>,
    _slot: ConnectionSlot,
}

impl tonic::transport::server::Connected for PeerStream {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl PeerStream {
    /// Fails the read once the connection has had no call for the idle timeout; otherwise
    /// re-arms the check for when it could first be idle that long.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Error> {
        while self.idle_check.as_mut().poll(cx).is_ready() {
            let wait = match self.info.activity.idle_for() {
                Some(idle) if idle >= self.idle_timeout => {
                    return Poll::Ready(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no call for {} s: connection closed as idle",
                            self.idle_timeout.as_secs()
                        ),
                    ));
                }
                Some(idle) => self.idle_timeout.saturating_sub(idle),
                None => self.idle_timeout,
            };
            self.idle_check
                .as_mut()
                .reset(tokio::time::Instant::now() + wait);
        }
        Poll::Pending
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Poll::Ready(error) = this.poll_idle(cx) {
            tracing::debug!(remote = %this.info.remote, %error, "closing");
            return Poll::Ready(Err(error));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.stream).poll_flush(cx);
        // The replies written so far are in the socket: their calls' lines now, not before.
        if matches!(flushed, Poll::Ready(Ok(()))) {
            this.info.activity.success_lines.write();
        }
        flushed
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Pending handshakes and established connections, counted against the limits.
#[derive(Debug)]
struct Admission {
    limits: ConnectionLimits,
    state: Mutex<AdmissionState>,
}

#[derive(Debug, Default)]
struct AdmissionState {
    next_id: u64,
    /// Pending handshakes by id; ids grow, so the first is the oldest.
    pending: BTreeMap<u64, Pending>,
    pending_by_source: HashMap<IpAddr, BTreeSet<u64>>,
    established: usize,
    established_by_identity: HashMap<String, usize>,
}

#[derive(Debug)]
struct Pending {
    source: IpAddr,
    /// From inside `limits.trusted_peer_networks`.
    trusted: bool,
    /// Tells the handshake it was evicted, and why.
    evict: tokio::sync::oneshot::Sender<Refusal>,
}

/// Why an accepted connection was closed before it was served.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    EvictedBySource,
    EvictedByTotal,
    EvictedForDescriptors,
    ReservedForTrustedPeers,
    TooManyConnections,
    TooManyForIdentity,
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Refusal::EvictedBySource => {
                "pending handshake evicted: too many from this source (limits.max_pending_handshakes_per_source)"
            }
            Refusal::EvictedByTotal => {
                "pending handshake evicted: too many in all (limits.max_pending_handshakes)"
            }
            Refusal::EvictedForDescriptors => {
                "pending handshake evicted: descriptors within limits.reserved_fds of RLIMIT_NOFILE"
            }
            Refusal::ReservedForTrustedPeers => {
                "connection closed before its handshake: the free pending-handshake slots are reserved for limits.trusted_peer_networks"
            }
            Refusal::TooManyConnections => {
                "connection closed: too many established (limits.max_connections)"
            }
            Refusal::TooManyForIdentity => {
                "connection closed: too many for this identity (limits.max_connections_per_identity)"
            }
        }
    }
}

impl AdmissionState {
    fn remove_pending(&mut self, id: u64) -> Option<Pending> {
        let pending = self.pending.remove(&id)?;
        if let Some(ids) = self.pending_by_source.get_mut(&pending.source) {
            ids.remove(&id);
            if ids.is_empty() {
                self.pending_by_source.remove(&pending.source);
            }
        }
        Some(pending)
    }

    fn held(&self) -> usize {
        self.pending.len().saturating_add(self.established)
    }

    fn untrusted_pending(&self) -> usize {
        self.pending.values().filter(|p| !p.trusted).count()
    }

    /// The handshake to give up over the total among those of trusted or of other peers: the
    /// oldest of the source holding the most of them. A flood spread over many addresses still
    /// holds more each than a controller making one connection.
    fn eviction_candidate(&self, trusted: bool) -> Option<u64> {
        self.pending_by_source
            .values()
            .filter_map(|ids| {
                let mut own = ids
                    .iter()
                    .filter(|id| self.pending.get(id).is_some_and(|p| p.trusted == trusted));
                let oldest = *own.next()?;
                Some((own.count().saturating_add(1), std::cmp::Reverse(oldest)))
            })
            .max()
            .map(|(_, std::cmp::Reverse(oldest))| oldest)
    }
}

impl Admission {
    fn lock(&self) -> std::sync::MutexGuard<'_, AdmissionState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a new handshake from `source`, first evicting the oldest pending handshakes
    /// that would put it over a limit; the evicted are told why through their channel. A peer
    /// outside the trusted networks never evicts a trusted peer's handshake: with only those
    /// left to give up, or the rest reserved for them, it is refused.
    fn begin_handshake(
        self: &Arc<Self>,
        source: IpAddr,
        trusted: bool,
    ) -> Result<(PendingHandshake, tokio::sync::oneshot::Receiver<Refusal>), Refusal> {
        let mut state = self.lock();
        let mut evicted = Vec::new();
        loop {
            // A source's share counts its trusted and other handshakes apart: an untrusted host
            // in the controller's IPv6 /64 (one source) must not evict the controller's.
            let of_source: Vec<u64> = state
                .pending_by_source
                .get(&source)
                .map(|ids| {
                    ids.iter()
                        .copied()
                        .filter(|id| state.pending.get(id).is_some_and(|p| p.trusted == trusted))
                        .collect()
                })
                .unwrap_or_default();
            let oldest_of_source = (of_source.len()
                >= self.limits.max_pending_handshakes_per_source)
                .then(|| of_source.first().copied())
                .flatten();
            let Some(oldest) = oldest_of_source else {
                break;
            };
            if let Some(pending) = state.remove_pending(oldest) {
                evicted.push((pending, Refusal::EvictedBySource));
            }
        }
        // Over the total, the handshake given up is the oldest of the source holding the most,
        // of other peers first. A trusted peer may take any slot; another only those outside
        // the reserve, and never by evicting a trusted peer's handshake.
        let untrusted_slots = self
            .limits
            .max_pending_handshakes
            .saturating_sub(self.limits.trusted_reserve());
        let mut refused = false;
        loop {
            let over_total = state.pending.len() >= self.limits.max_pending_handshakes;
            let over_share = !trusted && state.untrusted_pending() >= untrusted_slots;
            if !over_total && !over_share {
                break;
            }
            let victim = state
                .eviction_candidate(false)
                .or_else(|| trusted.then(|| state.eviction_candidate(true)).flatten());
            let Some(oldest) = victim else {
                refused = true;
                break;
            };
            if let Some(pending) = state.remove_pending(oldest) {
                evicted.push((pending, Refusal::EvictedByTotal));
            }
        }
        if refused {
            drop(state);
            for (pending, refusal) in evicted {
                let _ = pending.evict.send(refusal);
            }
            return Err(Refusal::ReservedForTrustedPeers);
        }
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        let (evict, evicted_rx) = tokio::sync::oneshot::channel();
        state.pending.insert(
            id,
            Pending {
                source,
                trusted,
                evict,
            },
        );
        state
            .pending_by_source
            .entry(source)
            .or_default()
            .insert(id);
        drop(state);
        for (pending, refusal) in evicted {
            // The handshake may have just ended on its own; then nobody is listening.
            let _ = pending.evict.send(refusal);
        }
        Ok((
            PendingHandshake {
                admission: self.clone(),
                id,
            },
            evicted_rx,
        ))
    }

    /// Counts an established connection for `identity`, or says which limit it is over.
    fn establish(self: &Arc<Self>, identity: String) -> Result<ConnectionSlot, Refusal> {
        let mut state = self.lock();
        if state.established >= self.limits.max_connections {
            return Err(Refusal::TooManyConnections);
        }
        let count = state
            .established_by_identity
            .get(&identity)
            .copied()
            .unwrap_or(0);
        if count >= self.limits.max_connections_per_identity {
            return Err(Refusal::TooManyForIdentity);
        }
        state.established = state.established.saturating_add(1);
        state
            .established_by_identity
            .insert(identity.clone(), count.saturating_add(1));
        Ok(ConnectionSlot {
            admission: self.clone(),
            identity,
        })
    }

    fn held(&self) -> usize {
        self.lock().held()
    }

    /// Evicts the oldest pending handshake of a peer outside the trusted networks; false when
    /// there is none (the next peer to connect may be anyone: trusted handshakes are not given
    /// up for it, they end within the handshake timeout).
    fn evict_oldest_pending(&self) -> bool {
        let mut state = self.lock();
        let Some(oldest) = state
            .pending
            .iter()
            .find(|(_, p)| !p.trusted)
            .map(|(id, _)| *id)
        else {
            return false;
        };
        let evicted = state.remove_pending(oldest);
        drop(state);
        if let Some(pending) = evicted {
            let _ = pending.evict.send(Refusal::EvictedForDescriptors);
        }
        true
    }
}

/// A handshake in progress; dropping it frees its slot.
#[derive(Debug)]
struct PendingHandshake {
    admission: Arc<Admission>,
    id: u64,
}

impl Drop for PendingHandshake {
    fn drop(&mut self) {
        self.admission.lock().remove_pending(self.id);
    }
}

/// An established connection, counted until dropped.
#[derive(Debug)]
struct ConnectionSlot {
    admission: Arc<Admission>,
    identity: String,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut state = self.admission.lock();
        state.established = state.established.saturating_sub(1);
        if let Some(count) = state.established_by_identity.get_mut(&self.identity) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                state.established_by_identity.remove(&self.identity);
            }
        }
    }
}

/// The descriptors this process may still open before it reaches the reserve.
#[derive(Debug)]
struct DescriptorBudget {
    reserved: usize,
    counted_at: Option<Instant>,
    open_at_count: usize,
    held_at_count: usize,
}

impl DescriptorBudget {
    fn new(reserved: usize) -> Self {
        Self {
            reserved,
            counted_at: None,
            open_at_count: 0,
            held_at_count: 0,
        }
    }

    /// `None` when one more connection fits above the reserve, else (open, limit).
    fn exhausted(&mut self, held: usize) -> Option<(usize, usize)> {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current?;
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let stale = self.counted_at.is_none_or(|at| at.elapsed() >= FD_RECOUNT);
        let estimate = |budget: &Self| {
            budget
                .open_at_count
                .saturating_add(held)
                .saturating_sub(budget.held_at_count)
        };
        let fits = |open: usize| open.saturating_add(1).saturating_add(self.reserved) <= limit;
        if !stale && fits(estimate(self)) {
            return None;
        }
        // Stale, or near the limit by the estimate: count precisely.
        let open = open_descriptors()?;
        self.counted_at = Some(Instant::now());
        self.open_at_count = open;
        self.held_at_count = held;
        if fits(open) {
            None
        } else {
            Some((open, limit))
        }
    }
}

/// Descriptors this process has open, from `/proc/self/fd` (the directory's own descriptor
/// not counted); `None` where that is unreadable.
fn open_descriptors() -> Option<usize> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    Some(entries.count().saturating_sub(1))
}

/// Says at start when `RLIMIT_NOFILE` is too low for the connection limits plus the reserve:
/// the daemon then refuses connections before the limits are reached.
fn warn_if_descriptors_cannot_cover(limits: &ConnectionLimits) {
    let Some(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current else {
        return;
    };
    let needed = limits
        .max_pending_handshakes
        .saturating_add(limits.max_connections)
        .saturating_add(limits.reserved_fds)
        .saturating_add(open_descriptors().unwrap_or(0));
    if usize::try_from(limit).is_ok_and(|limit| limit < needed) {
        tracing::warn!(
            limit,
            needed,
            "RLIMIT_NOFILE is below limits.max_pending_handshakes + limits.max_connections + limits.reserved_fds + the descriptors open at start; connections will be refused before those limits are reached (raise LimitNOFILE= or lower the limits)"
        );
    }
}

/// Whether an `accept` error means the process or system is out of a resource (as opposed to
/// one connection having failed), so accepting again at once would spin.
fn out_of_resources(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The source a peer's pending handshakes are counted under: its IPv4 address (also when it
/// reaches an IPv6 socket), or its IPv6 /64, since one host commonly holds a whole /64.
fn source_of(remote: &SocketAddr) -> IpAddr {
    match remote.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(
                v6.to_bits() & !u128::from(u64::MAX),
            )),
        },
        v4 => v4,
    }
}

/// The connections a server on `listener` accepts, with the default `[limits]` and a refusal
/// log of its own: for a server that reads no configuration (tests, benchmarks).
pub fn incoming_with_default_limits(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<PeerStream>> {
    incoming(
        listener,
        config.into(),
        ConnectionLimits::from(&crate::config::Limits::default()),
        Arc::new(RefusalLog::new("handshakes", DETAILED_HANDSHAKE_REFUSALS)),
    )
}

/// Accepts TCP connections, runs the TLS handshakes concurrently within the limits and yields
/// the connections that completed one and fit the connection limits. Refusals are logged
/// through `handshake_refusals` and never reach the gRPC layer.
pub fn incoming(
    listener: TcpListener,
    config: crate::tls::SharedServerConfig,
    limits: ConnectionLimits,
    handshake_refusals: Arc<RefusalLog>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<PeerStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let admission = Arc::new(Admission {
        limits,
        state: Mutex::new(AdmissionState::default()),
    });
    warn_if_descriptors_cannot_cover(&admission.limits);
    tokio::spawn(async move {
        let mut budget = DescriptorBudget::new(admission.limits.reserved_fds);
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some((open, limit)) = budget.exhausted(admission.held()) {
                if handshake_refusals.record(
                    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                    "not accepting: descriptors within limits.reserved_fds of RLIMIT_NOFILE",
                ) {
                    tracing::warn!(
                        open,
                        limit,
                        reserved = admission.limits.reserved_fds,
                        "not accepting connections: the open descriptors are within limits.reserved_fds of RLIMIT_NOFILE"
                    );
                }
                // Pending handshakes are the descriptors a peer can hold without a
                // certificate: give the oldest up so a new peer can be accepted; with none
                // pending, wait for connections to close.
                if admission.evict_oldest_pending() {
                    tokio::task::yield_now().await;
                    continue;
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, remote) = match accepted {
                Ok(conn) => {
                    backoff = Duration::from_millis(50);
                    conn
                }
                Err(error) if out_of_resources(&error) => {
                    if handshake_refusals.record(
                        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                        "accept failed: out of descriptors or memory",
                    ) {
                        tracing::warn!(%error, pause_ms = backoff.as_millis() as u64, "accept failed; pausing before accepting again");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.saturating_mul(2).min(MAX_ACCEPT_BACKOFF);
                    continue;
                }
                Err(error) => {
                    tracing::debug!(%error, "accept failed for one connection");
                    continue;
                }
            };
            let source = source_of(&remote);
            let trusted = admission.limits.is_trusted(&remote);
            let (pending, evicted) = match admission.begin_handshake(source, trusted) {
                Ok(admitted) => admitted,
                Err(refusal) => {
                    // Dropping the stream closes the connection.
                    drop(tcp);
                    if handshake_refusals.record(source, refusal.reason()) {
                        tracing::warn!(%remote, reason = refusal.reason(), "TLS handshake refused");
                    }
                    continue;
                }
            };
            tokio::spawn(handshake(
                tcp,
                remote,
                pending,
                evicted,
                // Each handshake takes the configuration current when it was accepted, so a
                // reloaded certificate applies from the next connection on.
                tokio_rustls::TlsAcceptor::from(config.current()),
                handshake_refusals.clone(),
                tx.clone(),
            ));
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// One connection from its TCP accept to its hand-over to the gRPC server.
async fn handshake(
    tcp: TcpStream,
    remote: SocketAddr,
    pending: PendingHandshake,
    evicted: tokio::sync::oneshot::Receiver<Refusal>,
    acceptor: tokio_rustls::TlsAcceptor,
    refusals: Arc<RefusalLog>,
    tx: tokio::sync::mpsc::Sender<std::io::Result<PeerStream>>,
) {
    let source = source_of(&remote);
    let refuse = |reason: &str| {
        if refusals.record(source, reason) {
            tracing::warn!(%remote, reason = %printable(reason), "TLS handshake refused");
        }
    };
    let _ = tcp.set_nodelay(true);
    let admission = pending.admission.clone();
    let limits = &admission.limits;
    let stream = tokio::select! {
        result = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)) => match result {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => return refuse(&error.to_string()),
            Err(_) => return refuse("timed out (limits.handshake_timeout_ms)"),
        },
        Ok(refusal) = evicted => return refuse(refusal.reason()),
    };
    drop(pending);
    let identity = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .ok_or(IdentityError::Missing)
        .and_then(|leaf| parse_client_certificate(leaf));
    if let Err(reason) = &identity
        && refusals.record(source, "client certificate without a usable identity")
    {
        tracing::warn!(%remote, %reason, "client certificate carries no usable identity");
    }
    // Connections whose certificate names no identity share one count: each of their calls
    // is refused, so together they need no more room than one identity.
    let key = match &identity {
        Ok(client) => client.identity.to_string(),
        Err(_) => "unidentified".to_owned(),
    };
    let identity_text: Arc<str> = Arc::from(key.as_str());
    let slot = match admission.establish(key) {
        Ok(slot) => slot,
        Err(refusal) => return refuse(refusal.reason()),
    };
    let remote_ip_text: Arc<str> = Arc::from(remote.ip().to_string().as_str());
    let activity = Activity::new(identity_text.clone(), remote_ip_text.clone());
    let stream = PeerStream {
        stream,
        info: PeerInfo {
            remote,
            identity: identity.map(Arc::new),
            identity_text,
            remote_ip_text,
            activity: Arc::new(activity),
        },
        idle_timeout: limits.idle_timeout,
        idle_check: Box::pin(tokio::time::sleep(limits.idle_timeout)),
        _slot: slot,
    };
    // The server stopped accepting: the connection is dropped, which closes it.
    let _ = tx.send(Ok(stream)).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn admission(
        per_source: usize,
        total: usize,
        connections: usize,
        per_identity: usize,
    ) -> Arc<Admission> {
        Arc::new(Admission {
            limits: ConnectionLimits {
                handshake_timeout: Duration::from_secs(1),
                max_pending_handshakes: total,
                max_pending_handshakes_per_source: per_source,
                max_connections: connections,
                max_connections_per_identity: per_identity,
                idle_timeout: Duration::from_secs(10),
                reserved_fds: 0,
                trusted_peer_networks: Vec::new(),
            },
            state: Mutex::new(AdmissionState::default()),
        })
    }

    #[test]
    fn a_new_handshake_evicts_the_oldest_of_its_source_first() {
        let admission = admission(2, 3, 8, 8);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let (_a1, mut a1_evicted) = admission.begin_handshake(a, false).unwrap();
        let (_a2, mut a2_evicted) = admission.begin_handshake(a, false).unwrap();
        // A third from `a` displaces a's oldest, nobody else's.
        let (_a3, mut a3_evicted) = admission.begin_handshake(a, false).unwrap();
        assert!(matches!(
            a1_evicted.try_recv(),
            Ok(Refusal::EvictedBySource)
        ));
        assert!(a2_evicted.try_recv().is_err());
        // `b` gets in: the table is not full yet (a2, a3, b1).
        let (_b1, mut b1_evicted) = admission.begin_handshake(b, false).unwrap();
        assert!(a2_evicted.try_recv().is_err());
        // Full: the next one, from a new source, displaces the oldest of the source holding most (a2).
        let (_c1, _) = admission
            .begin_handshake("192.0.2.3".parse().unwrap(), false)
            .unwrap();
        assert!(matches!(a2_evicted.try_recv(), Ok(Refusal::EvictedByTotal)));
        assert!(a3_evicted.try_recv().is_err());
        assert!(b1_evicted.try_recv().is_err());
        assert_eq!(admission.lock().pending.len(), 3);
        // With descriptors short, the oldest pending (a3) is given up.
        assert!(admission.evict_oldest_pending());
        assert!(matches!(
            a3_evicted.try_recv(),
            Ok(Refusal::EvictedForDescriptors)
        ));
    }

    #[test]
    fn over_the_total_the_source_holding_most_gives_up_its_oldest() {
        let admission = admission(3, 3, 8, 8);
        // A controller's handshake, older than any of the flood's.
        let (_controller, mut controller_evicted) = admission
            .begin_handshake("192.0.2.9".parse().unwrap(), false)
            .unwrap();
        let flood: IpAddr = "192.0.2.1".parse().unwrap();
        let (_f1, mut f1_evicted) = admission.begin_handshake(flood, false).unwrap();
        let (_f2, mut f2_evicted) = admission.begin_handshake(flood, false).unwrap();
        // Full: a new source displaces the flood's oldest, not the older controller's.
        let (_c1, _) = admission
            .begin_handshake("192.0.2.3".parse().unwrap(), false)
            .unwrap();
        assert!(matches!(f1_evicted.try_recv(), Ok(Refusal::EvictedByTotal)));
        assert!(controller_evicted.try_recv().is_err());
        assert!(f2_evicted.try_recv().is_err());
    }

    fn with_trusted(admission: Arc<Admission>, networks: &[&str]) -> Arc<Admission> {
        let mut limits = admission.limits.clone();
        limits.trusted_peer_networks = networks
            .iter()
            .map(|n| IpNetwork::parse(n).unwrap())
            .collect();
        Arc::new(Admission {
            limits,
            state: Mutex::new(AdmissionState::default()),
        })
    }

    /// A flood from many sources, one pending handshake each, ties every source at one: the
    /// oldest goes first, which may be the controller's, unless its network is trusted.
    #[test]
    fn a_trusted_peers_handshake_is_never_evicted_for_a_flood_of_single_handshakes() {
        let controller: IpAddr = "192.0.2.9".parse().unwrap();
        let flood = |n: u8| IpAddr::from([198, 51, 100, n]);
        // Untrusted, as before: the controller's, the oldest, is evicted.
        let plain = admission(4, 8, 8, 8);
        let (_c, mut evicted) = plain.begin_handshake(controller, false).unwrap();
        let held: Vec<_> = (1..=8)
            .map(|n| plain.begin_handshake(flood(n), false).unwrap())
            .collect();
        assert_eq!(held.len(), 8);
        assert!(matches!(evicted.try_recv(), Ok(Refusal::EvictedByTotal)));

        let trusted = with_trusted(admission(4, 8, 8, 8), &["192.0.2.0/24"]);
        assert_eq!(trusted.limits.trusted_reserve(), 2);
        let (_c, mut evicted) = trusted.begin_handshake(controller, true).unwrap();
        let mut flooders = Vec::new();
        for n in 1..=64 {
            let (held, rx) = trusted.begin_handshake(flood(n), false).unwrap();
            flooders.push((held, rx));
        }
        assert!(
            evicted.try_recv().is_err(),
            "the controller's handshake was evicted"
        );
        // The flood holds at most the slots outside the reserve.
        assert_eq!(trusted.lock().untrusted_pending(), 6);
        // A second controller connection takes the other reserved slot, a third (the table
        // full) evicts a flooder's, never the first controller connection.
        let (_c2, mut evicted2) = trusted.begin_handshake(controller, true).unwrap();
        let (_c3, _) = trusted.begin_handshake(controller, true).unwrap();
        assert!(evicted.try_recv().is_err() && evicted2.try_recv().is_err());
        assert_eq!(trusted.lock().untrusted_pending(), 5);
        // Descriptors short: only a flooder's handshake is given up.
        assert!(trusted.evict_oldest_pending());
        assert!(evicted.try_recv().is_err());

        // Trusted peers holding every slot: another peer is refused rather than evict one.
        let full = with_trusted(admission(8, 4, 8, 8), &["192.0.2.9/32"]);
        let held: Vec<_> = (0..4)
            .map(|_| full.begin_handshake(controller, true).unwrap())
            .collect();
        assert!(matches!(
            full.begin_handshake(flood(1), false),
            Err(Refusal::ReservedForTrustedPeers)
        ));
        assert!(!full.evict_oldest_pending());
        drop(held);
        assert!(full.begin_handshake(flood(1), false).is_ok());
    }

    /// One IPv6 /64 is one source; an untrusted host beside the trusted controller in it
    /// fills its own share, never evicting the controller's handshake.
    #[test]
    fn an_untrusted_neighbour_in_the_controllers_64_does_not_evict_its_handshake() {
        let trusted = with_trusted(admission(2, 16, 8, 8), &["2001:db8::9/128"]);
        let controller: SocketAddr = "[2001:db8::9]:40000".parse().unwrap();
        let neighbour: SocketAddr = "[2001:db8::2]:40000".parse().unwrap();
        assert_eq!(source_of(&controller), source_of(&neighbour));
        assert!(trusted.limits.is_trusted(&controller));
        assert!(!trusted.limits.is_trusted(&neighbour));
        let (_c, mut evicted) = trusted
            .begin_handshake(source_of(&controller), true)
            .unwrap();
        let mut neighbours = Vec::new();
        for _ in 0..6 {
            neighbours.push(
                trusted
                    .begin_handshake(source_of(&neighbour), false)
                    .unwrap(),
            );
        }
        assert!(
            evicted.try_recv().is_err(),
            "the controller's handshake was evicted"
        );
        // The neighbour evicted its own oldest: it holds its share, two.
        assert_eq!(trusted.lock().untrusted_pending(), 2);
        assert!(matches!(
            neighbours[0].1.try_recv(),
            Ok(Refusal::EvictedBySource)
        ));
    }

    #[test]
    fn trusted_networks_match_ipv4_ipv6_and_mapped_peers() {
        let limits = with_trusted(admission(1, 8, 8, 8), &["192.0.2.0/24", "2001:db8:1::/48"])
            .limits
            .clone();
        for (remote, trusted) in [
            ("192.0.2.44:5000", true),
            ("[::ffff:192.0.2.44]:5000", true),
            ("192.0.3.1:5000", false),
            ("[2001:db8:1:ffff::1]:5000", true),
            ("[2001:db8:2::1]:5000", false),
        ] {
            assert_eq!(
                limits.is_trusted(&remote.parse().unwrap()),
                trusted,
                "{remote}"
            );
        }
        // A single slot is never reserved: others could not connect at all.
        let mut one = limits.clone();
        one.max_pending_handshakes = 1;
        assert_eq!(one.trusted_reserve(), 0);
        one.trusted_peer_networks.clear();
        one.max_pending_handshakes = 256;
        assert_eq!(one.trusted_reserve(), 0);
    }

    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_prefixes() {
        let source = |text: &str| source_of(&text.parse().unwrap());
        assert_eq!(
            source("192.0.2.1:443"),
            "192.0.2.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            source("[::ffff:192.0.2.1]:443"),
            "192.0.2.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            source("[2001:db8:1:2:3:4:5:6]:443"),
            source("[2001:db8:1:2::9]:80")
        );
        assert_ne!(
            source("[2001:db8:1:2::1]:443"),
            source("[2001:db8:1:3::1]:443")
        );
    }

    #[test]
    fn a_finished_handshake_frees_its_slot() {
        let admission = admission(1, 1, 8, 8);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let (first, _) = admission.begin_handshake(a, false).unwrap();
        drop(first);
        let (_second, mut second_evicted) = admission.begin_handshake(a, false).unwrap();
        assert!(second_evicted.try_recv().is_err());
        assert_eq!(admission.held(), 1);
    }

    #[test]
    fn established_connections_are_bounded_in_all_and_per_identity() {
        let admission = admission(4, 4, 3, 2);
        let alice1 = admission.establish("operator:alice".into()).unwrap();
        let _alice2 = admission.establish("operator:alice".into()).unwrap();
        assert!(matches!(
            admission.establish("operator:alice".into()),
            Err(Refusal::TooManyForIdentity)
        ));
        let _bob = admission.establish("operator:bob".into()).unwrap();
        assert!(matches!(
            admission.establish("operator:carol".into()),
            Err(Refusal::TooManyConnections)
        ));
        drop(alice1);
        let _alice3 = admission.establish("operator:alice".into()).unwrap();
        assert_eq!(admission.held(), 3);
    }

    #[test]
    fn the_descriptor_reserve_stops_accepting_before_the_limit() {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap();
        let limit = usize::try_from(limit).unwrap();
        let open = open_descriptors().unwrap();
        // A reserve that leaves room for more connections, and one that does not (with a
        // margin for descriptors other tests open or close meanwhile).
        assert_eq!(DescriptorBudget::new(limit - open - 64).exhausted(0), None);
        let (counted, reported) = DescriptorBudget::new(limit - open + 64)
            .exhausted(0)
            .unwrap();
        assert_eq!(reported, limit);
        assert!(counted + 64 >= open, "{counted} open, {open} before");
    }
}
