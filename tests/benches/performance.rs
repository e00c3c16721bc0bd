//! What the connector costs against its floors, measured side by side in one run and printed as
//! markdown tables (median and p99; ratios are computed within the run, because the machines
//! these run on are shared and noisy).
//!
//! Sections (arguments after `--`; default `transport setup history concurrency footprint`):
//! - `transport`: a minimal tonic echo service over plain h2c and over mTLS with the connector's
//!   own TLS configuration, beside the connector's Hello, VmStatus and ReadJournal on an open
//!   connection and a new connection (TCP + TLS 1.3 handshake) + first call;
//! - `setup`: a run's set-up (mint grant and run certificate, connect, Hello, BeginRun, first
//!   operation) against a new mTLS connection with the same number of echo calls, and against
//!   an SSH bootstrap (Debian's OpenSSH on a loopback port, key authentication, strict
//!   known_hosts, worker directory, a static binary of the connector's size copied and run once);
//!   the fsyncs one BeginRun + EndRun issues, counted by strace;
//! - `history`: the shipped daemon over 10,000 closed runs against an empty state directory:
//!   start-to-ready, idle RSS, open descriptors, ListRuns latency;
//! - `concurrency`: 16 runs at once on one daemon with the Proxmox doubles (map, overlay,
//!   create, status, cleanup): per-step latency, daemon CPU and peak RSS (needs root);
//! - `footprint`: stripped release binary sizes, start-to-ready and idle RSS of an empty node;
//! - `fleet`: 100 daemons on loopback, `certistack-ctl nodes audit` of all of them, then one
//!   validation per node and 1,000 across the 100 driven by this process with the controller's
//!   library at the controller's default concurrency (needs root);
//! - `checks`: the connector's checks each on its own (grant verification, request parsing,
//!   authorization) and mTLS round trips on an open and on a new connection
//!   (`performance/checks.rs`);
//! - `node-ops`: each node operation through the connector against its tool alone, with the
//!   Proxmox doubles, real `qemu-img`, loop devices and QEMU (`performance/node_ops.rs`; needs
//!   root);
//! - `resolve`: `plan show` of a 100-VM pool selection with `snapshot: latest` and VMIDs from
//!   the range against the PBS and PVE API doubles, beside the same plan written out, and the API
//!   calls of one resolution by kind (`performance/resolve.rs`).
//! - `run-history`: the controller's run history holding 100,000 validations: `history`'s
//!   per-VM summary, pages, the command, and the store's cost per validation
//!   (`performance/run_history.rs`).
//!
//! `fleet`, `checks` and `node-ops` run only when named. They share one binary because each bench
//! target is a separate executable linked with the release profile's thin LTO over every
//! dependency, which is most of the bench build's time.
//!
//! `--profile [ROW]` runs no section: it counts ROW's instructions and its floor's under
//! callgrind, both sides on one thread, and prints the top functions (`performance/profile.rs`;
//! rows `new-connection` (the default), `hello`, `list-runs`, `read-journal`, `set-up`; needs
//! valgrind).
//!
//! `--short` (or `CERTISTACK_BENCH_SHORT=1`) runs fewer iterations and a smaller history, for CI;
//! `checks` and `node-ops` have fixed iteration counts and ignore it. `--workers=N` gives the
//! runtime N worker threads instead of one per core (section 1 then repeats itself from run to
//! run: no connection's tasks are placed by chance).
//! The daemons are the binaries next to this bench (`target/release`): build them first with
//! `cargo build --release --bins`.
//!
//! Run: `cargo build --release --bins && cargo bench -p certistack-tests --bench performance`
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    clippy::panic,
    missing_debug_implementations
)]

use certistack_connector::config::Config;
use certistack_controller::authority::{Authority, IssuedCertificate};
use certistack_core::tls;
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use certistack_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

// ---------------------------------------------------------------------------------------------
// Statistics and tables

/// Samples of one measurement, in the order taken.
#[derive(Default, Clone)]
struct Samples(Vec<Duration>);

impl Samples {
    fn push(&mut self, d: Duration) {
        self.0.push(d);
    }
    fn sorted(&self) -> Vec<Duration> {
        let mut s = self.0.clone();
        s.sort();
        s
    }
    fn median(&self) -> Duration {
        let s = self.sorted();
        s[s.len() / 2]
    }
    fn p99(&self) -> Duration {
        let s = self.sorted();
        let rank = (s.len() * 99).div_ceil(100).max(1);
        s[rank - 1]
    }
    fn max(&self) -> Duration {
        self.sorted()[self.0.len() - 1]
    }
}

fn ms(d: Duration) -> String {
    let v = d.as_secs_f64() * 1000.0;
    if v < 1.0 {
        format!("{:.0} µs", v * 1000.0)
    } else if v < 100.0 {
        format!("{v:.2} ms")
    } else {
        format!("{v:.0} ms")
    }
}

fn ratio(a: Duration, b: Duration) -> String {
    format!("{:.1}×", a.as_secs_f64() / b.as_secs_f64())
}

/// Two decimals, for the tables whose goals sit within a tenth of the floor (sections 1 and 2).
fn ratio2(a: Duration, b: Duration) -> String {
    format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64())
}

fn heading(title: &str) {
    println!("\n### {title}\n");
}

async fn timed<F, Fut, T>(samples: &mut Samples, f: F) -> T
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let started = Instant::now();
    let out = f().await;
    samples.push(started.elapsed());
    out
}

/// `count` calls, each timed into `samples`: `prepare` makes what a call takes (a client's
/// clone, a configuration) before its clock starts, `call` makes the call.
async fn timed_calls<P, C, F, Fut>(samples: &mut Samples, count: usize, mut prepare: P, call: F)
where
    P: FnMut() -> C,
    F: Fn(C) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..count {
        let prepared = prepare();
        timed(samples, || call(prepared)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Processes: the shipped daemon, its memory, descriptors and CPU

/// Clock ticks in /proc/<pid>/stat: USER_HZ, 100 on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// User + system CPU seconds the process used so far.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let utime: f64 = fields[11].parse().unwrap();
    let stime: f64 = fields[12].parse().unwrap();
    (utime + stime) / TICKS_PER_SECOND
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A daemon started from the shipped binary; SIGTERM on drop.
struct Daemon {
    child: Child,
    address: String,
    /// From spawn to the first Hello answered over mTLS.
    ready: Duration,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// Starts `certistack-connector` on `config` and waits until a Hello over mTLS answers.
async fn start_daemon(
    authority: &Authority,
    config: &Config,
    dir: &Path,
    identity: &IssuedCertificate,
) -> Daemon {
    let port = free_local_port();
    let config_path = dir.join(format!("connector-{port}.toml"));
    write_config_file(&config_path, config, port);
    let address = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let child = Command::new(binary("certistack-connector"))
        .args(["--config", config_path.to_str().unwrap(), "serve"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let name = config.node_name.clone();
    let ready = loop {
        if let Ok(mut c) = client(authority, &address, &name, identity).await
            && c.hello(pb::HelloRequest {}).await.is_ok()
        {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the connector at {address} did not come up"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    Daemon {
        child,
        address,
        ready,
    }
}

// ---------------------------------------------------------------------------------------------
// The transport floor: an echo service on the same tonic, rustls and tokio

mod echo {
    use std::convert::Infallible;
    use std::task::{Context, Poll};
    use tonic::codegen::{BoxFuture, Service, http};

    pub const PATH: &str = "/bench.Echo/Echo";
    /// The same echo, answered from tokio's blocking pool: one hand-off to a blocking thread
    /// and back, as a call that reads the disk off the async workers makes.
    pub const BLOCKING_PATH: &str = "/bench.Echo/EchoBlocking";
    /// The same, the blocking thread busy for [`BLOCKING_WORK`] first, as ListRuns' and
    /// ReadJournal's reads keep it: the async worker may park meanwhile.
    pub const BLOCKING_WORK_PATH: &str = "/bench.Echo/EchoBlockingWork";
    pub const BLOCKING_WORK: std::time::Duration = std::time::Duration::from_micros(20);
    /// The request's message sent back [`STREAMED`] times as a server stream: ReadJournal's
    /// shape (a stream of records, then trailers) with nothing of the connector's work.
    pub const STREAM_PATH: &str = "/bench.Echo/EchoStream";
    /// Messages the streaming echo sends: as many as the ReadJournal row's journal holds.
    pub const STREAMED: usize = 1;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Message {
        #[prost(bytes = "vec", tag = "1")]
        pub payload: Vec<u8>,
        /// For the streaming echo: the size each message sent back encodes to (0: the request's
        /// message as it is), so the stream has the size of the journal it stands for.
        #[prost(uint32, tag = "2")]
        pub reply_len: u32,
    }

    /// A message that encodes to `len` bytes, or to one byte less where a payload's length
    /// prefix grows by a byte and no message has that size.
    fn sized(len: usize) -> Message {
        let encodes_to = |n: usize| n + 1 + prost::encoding::encoded_len_varint(n as u64);
        let payload_len = (0..len).rev().find(|&n| encodes_to(n) <= len).unwrap_or(0);
        Message {
            payload: vec![0x5a; payload_len],
            reply_len: 0,
        }
    }

    /// Answers every call with the request's message.
    #[derive(Clone, Default)]
    pub struct EchoServer;

    impl tonic::server::NamedService for EchoServer {
        const NAME: &'static str = "bench.Echo";
    }

    struct Unary;

    impl tonic::server::UnaryService<Message> for Unary {
        type Response = Message;
        type Future = std::future::Ready<Result<tonic::Response<Message>, tonic::Status>>;
        fn call(&mut self, request: tonic::Request<Message>) -> Self::Future {
            std::future::ready(Ok(tonic::Response::new(request.into_inner())))
        }
    }

    struct BlockingUnary {
        work: std::time::Duration,
    }

    impl tonic::server::UnaryService<Message> for BlockingUnary {
        type Response = Message;
        type Future = BoxFuture<tonic::Response<Message>, tonic::Status>;
        fn call(&mut self, request: tonic::Request<Message>) -> Self::Future {
            let message = request.into_inner();
            let work = self.work;
            Box::pin(async move {
                let message = tokio::task::spawn_blocking(move || {
                    // Busy, not asleep: a read that finds its pages in the cache.
                    let started = std::time::Instant::now();
                    while started.elapsed() < work {}
                    message
                })
                .await
                .map_err(|error| tonic::Status::internal(error.to_string()))?;
                Ok(tonic::Response::new(message))
            })
        }
    }

    struct Streaming;

    impl tonic::server::ServerStreamingService<Message> for Streaming {
        type Response = Message;
        type ResponseStream =
            tokio_stream::Iter<std::vec::IntoIter<Result<Message, tonic::Status>>>;
        type Future =
            std::future::Ready<Result<tonic::Response<Self::ResponseStream>, tonic::Status>>;
        fn call(&mut self, request: tonic::Request<Message>) -> Self::Future {
            let message = match request.into_inner() {
                Message {
                    reply_len: 0,
                    payload,
                } => Message {
                    payload,
                    reply_len: 0,
                },
                Message { reply_len, .. } => sized(reply_len as usize),
            };
            let copies = vec![Ok(message); STREAMED];
            std::future::ready(Ok(tonic::Response::new(tokio_stream::iter(copies))))
        }
    }

    impl<B> Service<http::Request<B>> for EchoServer
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<tonic::codegen::StdError> + Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(
                    tonic_prost::ProstCodec::<Message, Message>::default(),
                );
                let path = request.uri().path();
                if path == BLOCKING_PATH {
                    let work = std::time::Duration::ZERO;
                    Ok(grpc.unary(BlockingUnary { work }, request).await)
                } else if path == BLOCKING_WORK_PATH {
                    let work = BLOCKING_WORK;
                    Ok(grpc.unary(BlockingUnary { work }, request).await)
                } else if path == STREAM_PATH {
                    Ok(grpc.server_streaming(Streaming, request).await)
                } else {
                    Ok(grpc.unary(Unary, request).await)
                }
            })
        }
    }

    /// One unary echo call on `channel`.
    pub async fn call(channel: &tonic::transport::Channel, payload: &[u8]) {
        call_path(channel, payload, PATH).await;
    }

    /// One unary echo call on `channel`, answered from a blocking thread.
    pub async fn call_blocking(channel: &tonic::transport::Channel, payload: &[u8]) {
        call_path(channel, payload, BLOCKING_PATH).await;
    }

    /// The same, the blocking thread busy for [`BLOCKING_WORK`] first.
    pub async fn call_blocking_work(channel: &tonic::transport::Channel, payload: &[u8]) {
        call_path(channel, payload, BLOCKING_WORK_PATH).await;
    }

    /// One server-streaming echo call on `channel`: `payload` sent, [`STREAMED`] messages that
    /// each encode to `reply_len` bytes received.
    pub async fn call_streaming(
        channel: &tonic::transport::Channel,
        payload: &[u8],
        reply_len: usize,
    ) {
        // Below 3 bytes no message has a payload (0 would mean the request's message echoed).
        assert!(
            reply_len >= 3,
            "a reply of {reply_len} bytes cannot be sized"
        );
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let mut stream = grpc
            .server_streaming(
                tonic::Request::new(Message {
                    payload: payload.to_vec(),
                    reply_len: u32::try_from(reply_len).unwrap(),
                }),
                http::uri::PathAndQuery::from_static(STREAM_PATH),
                tonic_prost::ProstCodec::<Message, Message>::default(),
            )
            .await
            .unwrap()
            .into_inner();
        let mut received = 0;
        while let Some(message) = stream.message().await.unwrap() {
            let encoded = prost::Message::encoded_len(&message);
            assert!(
                encoded == reply_len || encoded + 1 == reply_len,
                "{encoded} bytes"
            );
            received += 1;
        }
        assert_eq!(received, STREAMED);
    }

    async fn call_path(channel: &tonic::transport::Channel, payload: &[u8], path: &'static str) {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let reply: tonic::Response<Message> = grpc
            .unary(
                tonic::Request::new(Message {
                    payload: payload.to_vec(),
                    reply_len: 0,
                }),
                http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::<Message, Message>::default(),
            )
            .await
            .unwrap();
        assert_eq!(reply.into_inner().payload, payload);
    }
}

/// The echo service over plain h2c on loopback; returns its address.
async fn serve_echo_h2c() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(echo::EchoServer)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    address
}

/// The echo service behind the connector's own TLS server configuration and connection
/// handling (`tls::server_config`, `connection::incoming_with_default_limits`), with the node certificate of `config`.
async fn serve_echo_mtls(authority: &Authority, config: &Config) -> String {
    let server_config = node_tls_server_config(authority, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(echo::EchoServer)
            .serve_with_incoming(
                certistack_connector::connection::incoming_with_default_limits(
                    listener,
                    server_config,
                ),
            ),
    );
    address
}

/// The controller's client TLS configuration for `identity`.
fn controller_tls(
    authority: &Authority,
    identity: &IssuedCertificate,
) -> Arc<rustls::ClientConfig> {
    let ca = tls::parse_certificates(authority.ca_pem(), "ca").unwrap();
    tls::client_config(
        tls::ca_roots(&ca).unwrap(),
        tls::parse_certificates(&identity.certificate_pem, "client").unwrap(),
        tls::parse_private_key(&identity.key_pem, "key").unwrap(),
    )
    .unwrap()
}

async fn h2c_channel(address: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

struct Settings {
    short: bool,
}

impl Settings {
    fn n(&self, full: usize, short: usize) -> usize {
        if self.short { short } else { full }
    }
}

async fn transport(settings: &Settings) {
    let dir = TempDir::new("bench-transport");
    let authority = controller(&dir.0);
    let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    let operator = authority.issue_operator("bench", now()).unwrap();
    let tls_config = controller_tls(&authority, &operator);

    let h2c_address = serve_echo_h2c().await;
    let mtls_address = serve_echo_mtls(&authority, &node.config).await;
    let h2c = h2c_channel(&h2c_address).await;
    let mtls =
        certistack_controller::connect::connect(mtls_address.clone(), NODE, tls_config.clone())
            .await
            .unwrap();

    let credentials = mint(&authority, &grant(RUN_ID, NODE));
    let mut run = run_client(&authority, &node, &credentials).await;
    run.begin_run(begin_request(&credentials)).await.unwrap();
    run.vm_status(pb::VmRequest { vmid: VMID }).await.unwrap();
    let mut op = operator_client(&authority, &node.address, &operator).await;

    // Enough calls that a row's median moves by less than the hundredths its ratio prints.
    let calls = settings.n(1000, 60);
    let connections = settings.n(60, 10);
    // Many short batches, so a drift of the machine's speed during the run (it moves the echo
    // by a tenth between runs) reaches every row alike.
    let rounds = settings.n(20, 5);
    let names = [
        "echo, h2c (floor without TLS)",
        "echo, mTLS (the floor)",
        "Hello",
        "VmStatus (recording executor; read-only, not journaled)",
        "ReadJournal (an open run's journal, answered from its records in memory)",
        "ListRuns (operator)",
        "Hello (operator, on ListRuns' connection)",
        "echo, mTLS, answered from a blocking thread (one hand-off, as ListRuns and ReadJournal make when they must wait for a journal or the disk)",
        "echo, mTLS, answered from a blocking thread busy 20 µs first (the async worker may park meanwhile)",
        "echo, mTLS, server-streaming: ReadJournal's shape (as many messages as its journal's records, each of a record's size, then trailers)",
        "echo, mTLS: new connection, resumed TLS 1.3 handshake (one configuration shared) + first call",
        "echo, mTLS: new connection, full TLS 1.3 handshake (a new configuration, as client::connect makes) + first call",
        "Hello: new connection + full TLS 1.3 handshake + first call",
    ];
    let payload = vec![0x5a; 64];
    // The streaming echo sends messages of the size of the journal's record (312 bytes here,
    // most of them its two digests in hex): h2 writes a DATA frame of 256 bytes or more on its own,
    // before the trailers (h2 0.4, `codec/framed_write.rs`, `CHAIN_THRESHOLD`), so a stream of
    // 64-byte messages would be spared a write ReadJournal makes.
    let journal = journal_records(&mut run, RUN_ID).await;
    assert_eq!(
        journal.len(),
        echo::STREAMED,
        "the streaming echo sends as many messages as the ReadJournal row's journal holds records"
    );
    let record_len = journal
        .iter()
        .map(prost::Message::encoded_len)
        .max()
        .unwrap();
    // Several passes, each on connections of its own: which worker thread the runtime gives a
    // connection's tasks stays with the connection and moves its calls by up to a fifth, so a
    // single pass carries its connections' placement in every ratio it gives (docs/
    // performance.md, section 1, "The third pass"). The table gives the median of the passes'
    // ratios and their range.
    let passes = settings.n(7, 1);
    let mut all_passes: Vec<Vec<Samples>> = Vec::with_capacity(passes);
    for pass in 0..passes {
        let (h2c, mtls, run, op) = if pass == 0 {
            (h2c.clone(), mtls.clone(), run.clone(), op.clone())
        } else {
            let mtls = certistack_controller::connect::connect(
                mtls_address.clone(),
                NODE,
                tls_config.clone(),
            )
            .await
            .unwrap();
            let (mut run, mut op) = (
                run_client(&authority, &node, &credentials).await,
                operator_client(&authority, &node.address, &operator).await,
            );
            // Each new connection's first call (the node checks the client's certificate then)
            // is left out of the samples.
            run.hello(pb::HelloRequest {}).await.unwrap();
            op.hello(pb::HelloRequest {}).await.unwrap();
            echo::call(&mtls, &payload).await;
            (h2c_channel(&h2c_address).await, mtls, run, op)
        };
        echo::call(&h2c, &payload).await;
        let mut samples: Vec<Samples> = vec![Samples::default(); names.len()];
        // Round-robin in batches so a change in the machine's load hits every row alike.
        let payload = payload.as_slice();
        let (batch, connection_batch) = (calls / rounds, connections / rounds);
        let (authority, operator) = (&authority, &operator);
        for _ in 0..rounds {
            let [
                h2c_echo,
                mtls_echo,
                hello,
                vm_status,
                read_journal,
                list_runs,
                operator_hello,
                blocking,
                blocking_work,
                streaming,
                resumed,
                full,
                hello_new,
            ] = &mut samples[..]
            else {
                unreachable!("one sample set per row name")
            };
            timed_calls(h2c_echo, batch, || (), |()| echo::call(&h2c, payload)).await;
            timed_calls(mtls_echo, batch, || (), |()| echo::call(&mtls, payload)).await;
            timed_calls(
                hello,
                batch,
                || run.clone(),
                |mut c| async move {
                    c.hello(pb::HelloRequest {}).await.unwrap();
                },
            )
            .await;
            timed_calls(
                vm_status,
                batch,
                || run.clone(),
                |mut c| async move {
                    c.vm_status(pb::VmRequest { vmid: VMID }).await.unwrap();
                },
            )
            .await;
            timed_calls(
                read_journal,
                batch,
                || run.clone(),
                |mut c| async move { read_whole_journal(&mut c).await },
            )
            .await;
            timed_calls(
                list_runs,
                batch,
                || op.clone(),
                |mut c| async move {
                    c.list_runs(pb::ListRunsRequest::default()).await.unwrap();
                },
            )
            .await;
            timed_calls(
                operator_hello,
                batch,
                || op.clone(),
                |mut c| async move {
                    c.hello(pb::HelloRequest {}).await.unwrap();
                },
            )
            .await;
            timed_calls(
                blocking,
                batch,
                || (),
                |()| echo::call_blocking(&mtls, payload),
            )
            .await;
            timed_calls(
                blocking_work,
                batch,
                || (),
                |()| echo::call_blocking_work(&mtls, payload),
            )
            .await;
            timed_calls(
                streaming,
                batch,
                || (),
                |()| echo::call_streaming(&mtls, payload, record_len),
            )
            .await;
            let new_connection = || (tls_config.clone(), mtls_address.clone());
            timed_calls(
                resumed,
                connection_batch,
                new_connection,
                |(config, address)| async move {
                    let channel = certistack_controller::connect::connect(address, NODE, config)
                        .await
                        .unwrap();
                    echo::call(&channel, payload).await;
                },
            )
            .await;
            // What every controller connection does today: parse the CA, the certificate and
            // the key and build the configuration, so no session ticket is kept to resume.
            timed_calls(
                full,
                connection_batch,
                || mtls_address.clone(),
                |address| async move {
                    let config = controller_tls(authority, operator);
                    let channel = certistack_controller::connect::connect(address, NODE, config)
                        .await
                        .unwrap();
                    echo::call(&channel, payload).await;
                },
            )
            .await;
            timed_calls(
                hello_new,
                connection_batch,
                || (),
                |()| async {
                    let mut c = client(authority, &node.address, NODE, operator)
                        .await
                        .unwrap();
                    c.hello(pb::HelloRequest {}).await.unwrap();
                },
            )
            .await;
        }
        all_passes.push(samples);
    }
    // Keep the operator's connection in use so it is not idle-closed between rounds.
    op.hello(pb::HelloRequest {}).await.unwrap();
    let journal_records = journal.len();

    heading("1. Transport floor: calls on one open connection, and a new connection");
    // Each row's samples of every pass, for the times; the ratios are each pass's own.
    let pooled: Vec<Samples> = (0..names.len())
        .map(|row| {
            Samples(
                all_passes
                    .iter()
                    .flat_map(|pass| pass[row].0.clone())
                    .collect(),
            )
        })
        .collect();
    let ratio = |row: usize, base: usize| {
        let mut ratios: Vec<f64> = all_passes
            .iter()
            .map(|pass| pass[row].median().as_secs_f64() / pass[base].median().as_secs_f64())
            .collect();
        ratios.sort_by(f64::total_cmp);
        let (low, high) = (ratios[0], ratios[ratios.len() - 1]);
        let median = ratios[ratios.len() / 2];
        if ratios.len() == 1 {
            format!("{median:.2}×")
        } else {
            format!("{median:.2}× ({low:.2}–{high:.2})")
        }
    };
    println!(
        "In-process server and client on loopback; {passes} pass(es), each on connections of its own, of {} calls per row (one at a time) and {} new connections. The journal streamed holds {journal_records} record(s) of {record_len} bytes.\n",
        all_passes[0][0].0.len(),
        all_passes[0][10].0.len()
    );
    println!("| call | median | p99 | median ÷ mTLS floor (median of the passes, range) |");
    println!("|---|---:|---:|---:|");
    for (i, name) in names.iter().enumerate() {
        let base = if i >= 10 { 11 } else { 1 };
        println!(
            "| {name} | {} | {} | {} |",
            ms(pooled[i].median()),
            ms(pooled[i].p99()),
            ratio(i, base)
        );
    }
    println!(
        "\nRows on a new connection are divided by the echo's new connection with a full handshake (the like-for-like floor: the Hello row's client builds its configuration per connection, so it never resumes); the others by the echo on an open mTLS connection. The resumed row shows what a kept configuration would save."
    );
    println!(
        "\nReadJournal against the streaming echo (the same shape: a stream of {} message(s) of {record_len} bytes, then trailers): {}.",
        echo::STREAMED,
        ratio(4, 9)
    );
    println!(
        "\nAgainst the echo answered from a blocking thread (the same hand-off): ReadJournal {}, ListRuns {}; against the one busy 20 µs there: ReadJournal {}, ListRuns {}.",
        ratio(4, 7),
        ratio(5, 7),
        ratio(4, 8),
        ratio(5, 8)
    );
}

/// ReadJournal of [`RUN_ID`], every record of the stream received.
async fn read_whole_journal(c: &mut ConnectorClient<Channel>) {
    journal_records(c, RUN_ID).await;
}

async fn operator_client(
    authority: &Authority,
    address: &str,
    identity: &IssuedCertificate,
) -> ConnectorClient<Channel> {
    client(authority, address, NODE, identity).await.unwrap()
}

// ---------------------------------------------------------------------------------------------
// Per-run set-up against a new mTLS connection and against an SSH bootstrap

/// Debian's OpenSSH server on a loopback port, with its own host key, an authorized client key
/// and a strict known_hosts file, all in `dir`. Stopped on drop.
struct Sshd {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Sshd {
    fn start(dir: &Path) -> Option<Self> {
        if !Path::new("/usr/sbin/sshd").exists() || !Path::new("/usr/bin/ssh").exists() {
            println!(
                "\nSSH bootstrap skipped: /usr/sbin/sshd or /usr/bin/ssh is missing (apt-get install openssh-server openssh-client)."
            );
            return None;
        }
        std::fs::create_dir_all(dir).unwrap();
        let keygen = |file: &str| {
            let out = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(dir.join(file))
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        keygen("host_key");
        keygen("client_key");
        std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys")).unwrap();
        let port = free_local_port();
        let host_pub = std::fs::read_to_string(dir.join("host_key.pub")).unwrap();
        let mut fields = host_pub.split_whitespace();
        let (kind, key) = (fields.next().unwrap(), fields.next().unwrap());
        std::fs::write(
            dir.join("known_hosts"),
            format!("[127.0.0.1]:{port} {kind} {key}\n"),
        )
        .unwrap();
        let config = format!(
            "ListenAddress 127.0.0.1\nPort {port}\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n\
             AuthorizedKeysFile {d}/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n\
             LogLevel ERROR\n",
            d = dir.display()
        );
        std::fs::write(dir.join("sshd_config"), config).unwrap();
        // sshd's privilege separation needs its empty directory; the package ships it under /run.
        std::fs::create_dir_all("/run/sshd").unwrap();
        let child = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let up = (0..500).any(|_| {
            let ok = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            if !ok {
                std::thread::sleep(Duration::from_millis(10));
            }
            ok
        });
        assert!(up, "sshd on 127.0.0.1:{port} did not come up");
        Some(Self {
            child,
            port,
            dir: dir.to_owned(),
        })
    }

    /// `ssh` with key authentication only, strict known_hosts, no system configuration.
    fn ssh(&self, remote: &str) -> Command {
        let mut command = Command::new("/usr/bin/ssh");
        command
            .args(["-F", "/dev/null", "-o", "BatchMode=yes", "-o"])
            .arg("StrictHostKeyChecking=yes")
            .arg("-o")
            .arg(format!(
                "UserKnownHostsFile={}",
                self.dir.join("known_hosts").display()
            ))
            .args([
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "GlobalKnownHostsFile=/dev/null",
            ])
            .arg("-i")
            .arg(self.dir.join("client_key"))
            .args(["-p", &self.port.to_string(), "root@127.0.0.1", remote]);
        command
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_ok(command: &mut Command, stdin: Option<&Path>) {
    if let Some(file) = stdin {
        command.stdin(std::fs::File::open(file).unwrap());
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A static binary as large as the connector's release binary: busybox, padded (an ELF file
/// runs the same with bytes appended).
fn payload_binary(dir: &Path) -> (PathBuf, u64) {
    let size = std::fs::metadata(binary("certistack-connector"))
        .unwrap()
        .len();
    let path = dir.join("busybox");
    std::fs::copy("/bin/busybox", &path).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let current = file.metadata().unwrap().len();
    file.set_len(size.max(current)).unwrap();
    (path, size.max(current))
}

async fn setup(settings: &Settings) {
    let dir = TempDir::new("bench-setup");
    let authority = controller(&dir.0);
    let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
    let operator = authority.issue_operator("bench", now()).unwrap();
    let tls_config = controller_tls(&authority, &operator);
    let mtls_address = serve_echo_mtls(&authority, &node.config).await;
    // Enough that the syncs' cost, the difference of two floors' medians, moves the ratio of the
    // set-up beyond them by a few hundredths from run to run, not by a tenth (40 did).
    let iterations = settings.n(200, 8);
    let payload = vec![0x5a; 64];

    let mut connector = Samples::default();
    let mut floor = Samples::default();
    let mut floor_with_syncs = Samples::default();
    // Beside the connector's state directory: the same file system, outside what it reads.
    let sync_dir = node
        .config
        .paths
        .state_dir
        .parent()
        .unwrap()
        .join("bench-sync-floor");
    std::fs::create_dir_all(&sync_dir).unwrap();
    let mut steps: Vec<(&str, Samples)> = [
        "mint grant + run certificate",
        "connect (TCP + TLS 1.3 handshake)",
        "Hello",
        "BeginRun (grant verified, run directory and journal created)",
        "first operation (VmStatus, recording executor)",
    ]
    .into_iter()
    .map(|n| (n, Samples::default()))
    .collect();
    // The floors' own steps, beside the set-up's: connect, then each echo call (the second
    // after BeginRun's syncs in the floor with them, where BeginRun makes them).
    let mut floor_steps: [[Samples; 4]; 2] = Default::default();
    for i in 0..iterations {
        let started = Instant::now();
        let run_id = uuid::Uuid::new_v4().to_string();
        let mut t = Instant::now();
        let mut lap = |steps: &mut Vec<(&str, Samples)>, index: usize| {
            steps[index].1.push(t.elapsed());
            t = Instant::now();
        };
        let credentials = mint(&authority, &grant(&run_id, NODE));
        lap(&mut steps, 0);
        let mut c = client(&authority, &node.address, NODE, &credentials.certificate)
            .await
            .unwrap();
        lap(&mut steps, 1);
        certistack_controller::client::hello(&mut c, NODE)
            .await
            .unwrap();
        lap(&mut steps, 2);
        c.begin_run(begin_request(&credentials)).await.unwrap();
        lap(&mut steps, 3);
        c.vm_status(pb::VmRequest { vmid: VMID }).await.unwrap();
        lap(&mut steps, 4);
        connector.push(started.elapsed());
        c.end_run(pb::EndRunRequest {}).await.unwrap();
        // Each measured part starts while one connection closes: the floor after the
        // set-up's (here), the floor with syncs after the floor's, the next set-up after the
        // floor with syncs'. Nothing is removed between them: where the file system is mounted
        // with `discard` (this machine's root is), a removal's discards slow a later commit.
        drop(c);

        // The floor connects as a run does: a configuration of its own, so a full handshake
        // (a run's certificate is new, so its first connection never resumes a session).
        for (with_syncs, samples) in [(false, &mut floor), (true, &mut floor_with_syncs)] {
            let started = Instant::now();
            let mut t = Instant::now();
            let config = controller_tls(&authority, &operator);
            let channel =
                certistack_controller::connect::connect(mtls_address.clone(), NODE, config)
                    .await
                    .unwrap();
            floor_steps[usize::from(with_syncs)][0].push(t.elapsed());
            for call in 0..3 {
                t = Instant::now();
                if with_syncs && call == 1 {
                    let dir = sync_dir.join(format!("{i}"));
                    tokio::task::spawn_blocking(move || syncs_of_begin_run(&dir))
                        .await
                        .unwrap();
                }
                echo::call(&channel, &payload).await;
                floor_steps[usize::from(with_syncs)][call + 1].push(t.elapsed());
            }
            samples.push(started.elapsed());
        }
    }
    let _ = &tls_config;

    let mut ssh_one = Samples::default();
    let mut ssh_three = Samples::default();
    let ssh_dir = dir.0.join("ssh");
    let sshd = Sshd::start(&ssh_dir);
    let mut payload_size = 0;
    if let Some(sshd) = &sshd {
        let (payload_path, size) = payload_binary(&dir.0);
        payload_size = size;
        let remote_root = dir.0.join("remote");
        std::fs::create_dir_all(&remote_root).unwrap();
        for i in 0..iterations {
            // As a configuration-management tool does it: one connection per step.
            let worker = remote_root.join(format!("three-{i}"));
            let w = worker.display();
            let started = Instant::now();
            run_ok(&mut sshd.ssh(&format!("mkdir -p {w}")), None);
            run_ok(
                &mut sshd.ssh(&format!("cat > {w}/busybox && chmod 0755 {w}/busybox")),
                Some(&payload_path),
            );
            run_ok(&mut sshd.ssh(&format!("{w}/busybox true")), None);
            ssh_three.push(started.elapsed());
            // The least SSH can do: one connection for all three.
            let worker = remote_root.join(format!("one-{i}"));
            let w = worker.display();
            let started = Instant::now();
            run_ok(
                &mut sshd.ssh(&format!(
                    "mkdir -p {w} && cat > {w}/busybox && chmod 0755 {w}/busybox && {w}/busybox true"
                )),
                Some(&payload_path),
            );
            ssh_one.push(started.elapsed());
        }
    }

    heading("2. Per-run set-up against its floor and against an SSH bootstrap");
    println!(
        "{iterations} set-ups each, interleaved. The connector is in-process with the recording executor, its state directory on {}.\n",
        std::env::temp_dir().display()
    );
    println!("| set-up | median | p99 | median ÷ floor |");
    println!("|---|---:|---:|---:|");
    let base = floor.median();
    println!(
        "| floor: new mTLS connection + 3 echo calls | {} | {} | 1.0× |",
        ms(base),
        ms(floor.p99())
    );
    println!(
        "| floor with BeginRun's syncs: the same, and 3 fsync + 1 fdatasync of a new directory and two files beside the connector's runs | {} | {} | {} |",
        ms(floor_with_syncs.median()),
        ms(floor_with_syncs.p99()),
        ratio2(floor_with_syncs.median(), base)
    );
    println!(
        "| run set-up: mint, connect, Hello, BeginRun, first operation | {} | {} | {} |",
        ms(connector.median()),
        ms(connector.p99()),
        ratio2(connector.median(), base)
    );
    for (name, s) in &steps {
        println!(
            "| — {name} | {} | {} | {} |",
            ms(s.median()),
            ms(s.p99()),
            ratio2(s.median(), base)
        );
    }
    for (floor_name, steps) in ["floor", "floor with the syncs"].iter().zip(&floor_steps) {
        for (name, s) in ["connect", "echo 1", "echo 2", "echo 3"].iter().zip(steps) {
            println!(
                "| — {floor_name}: {name} | {} | {} | {} |",
                ms(s.median()),
                ms(s.p99()),
                ratio2(s.median(), base)
            );
        }
    }
    if sshd.is_some() {
        println!(
            "| SSH bootstrap, 1 connection: mkdir, copy {:.1} MiB static binary, run it | {} | {} | {} |",
            payload_size as f64 / (1 << 20) as f64,
            ms(ssh_one.median()),
            ms(ssh_one.p99()),
            ratio2(ssh_one.median(), base)
        );
        println!(
            "| SSH bootstrap, 3 connections (mkdir; copy; run) | {} | {} | {} |",
            ms(ssh_three.median()),
            ms(ssh_three.p99()),
            ratio2(ssh_three.median(), base)
        );
        println!(
            "\nSSH (1 connection) ÷ run set-up: {}; SSH (3 connections) ÷ run set-up: {}.",
            ratio2(ssh_one.median(), connector.median()),
            ratio2(ssh_three.median(), connector.median())
        );
    }
    // What the syncs cost, as the floors measure them; the set-up less that, against the
    // floor without syncs: the set-up's own work beyond its syncs.
    let syncs = floor_with_syncs.median().saturating_sub(base);
    println!(
        "\nThe syncs (the floor with them less the floor): {}. The run set-up beyond its syncs ({}) ÷ the floor: {}; the run set-up ÷ the floor with the syncs: {}. Mint, Hello's checks and BeginRun's checks are the difference.",
        ms(syncs),
        ms(connector.median().saturating_sub(syncs)),
        ratio2(connector.median().saturating_sub(syncs), base),
        ratio2(connector.median(), floor_with_syncs.median())
    );
    fsyncs(&authority, &dir.0, &operator).await;
}

/// What BeginRun syncs, on the same file system (`runs/` beside it), without its checks: a new
/// directory with a file written and fsync'd (the grant), a file written and fdatasync'd (the
/// journal's first record), the new directory and its parent fsync'd: 3 fsync + 1 fdatasync,
/// as `strace -c` counts BeginRun (section 2).
fn syncs_of_begin_run(dir: &Path) {
    use std::io::Write;
    std::fs::create_dir(dir).unwrap();
    let mut grant = std::fs::File::create(dir.join("grant.pb")).unwrap();
    grant.write_all(&[0x5a; 600]).unwrap();
    grant.sync_all().unwrap();
    let mut journal = std::fs::File::create(dir.join("journal")).unwrap();
    journal.write_all(&[0x5a; 400]).unwrap();
    journal.sync_data().unwrap();
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
    std::fs::File::open(dir.parent().unwrap())
        .unwrap()
        .sync_all()
        .unwrap();
}

/// strace counting the sync calls of process `pid` (all its threads) into `out_file`.
fn strace_syncs(pid: u32, out_file: &Path) -> Child {
    Command::new("strace")
        .args([
            "-f",
            "-c",
            "-e",
            "trace=fsync,fdatasync,sync_file_range,syncfs",
        ])
        .arg("-o")
        .arg(out_file)
        .args(["-p", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Stops `strace` and returns (fsync, fdatasync) from its summary.
async fn strace_counts(mut strace: Child, out_file: &Path) -> (u64, u64) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = Command::new("kill")
        .args(["-INT", &strace.id().to_string()])
        .status();
    let _ = strace.wait();
    let summary = std::fs::read_to_string(out_file).unwrap_or_default();
    let count = |call: &str| -> u64 {
        summary
            .lines()
            .find(|l| l.split_whitespace().last() == Some(call))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (count("fsync"), count("fdatasync"))
}

/// The syncs one BeginRun and one EndRun issue in the shipped daemon, each counted by strace
/// attached to it over the same number of calls.
async fn fsyncs(authority: &Authority, dir: &Path, operator: &IssuedCertificate) {
    if !Path::new("/usr/bin/strace").exists() {
        println!("\nfsync count skipped: strace is missing.");
        return;
    }
    let config = enroll(authority, &dir.join("strace-node"), NODE);
    let daemon = start_daemon(authority, &config, dir, operator).await;
    // One run at a time (runs made by `grant` share a VMID, so they may not be open together),
    // each call in its own strace window.
    const RUNS: usize = 10;
    let (mut begin, mut end) = ((0, 0), (0, 0));
    for n in 0..RUNS {
        let run_id = uuid::Uuid::new_v4().to_string();
        let credentials = mint(authority, &grant(&run_id, NODE));
        let mut c = client(authority, &daemon.address, NODE, &credentials.certificate)
            .await
            .unwrap();
        let begin_file = dir.join(format!("strace-begin-{n}.txt"));
        let strace = strace_syncs(daemon.pid(), &begin_file);
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.begin_run(begin_request(&credentials)).await.unwrap();
        let counted = strace_counts(strace, &begin_file).await;
        begin = (begin.0 + counted.0, begin.1 + counted.1);
        let end_file = dir.join(format!("strace-end-{n}.txt"));
        let strace = strace_syncs(daemon.pid(), &end_file);
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.end_run(pb::EndRunRequest {}).await.unwrap();
        let counted = strace_counts(strace, &end_file).await;
        end = (end.0 + counted.0, end.1 + counted.1);
    }
    let per = |n: u64| n as f64 / RUNS as f64;
    println!(
        "\nSyncs in the shipped daemon (strace -f -c, {RUNS} calls each): BeginRun fsync {:.1} + fdatasync {:.1}; EndRun fsync {:.1} + fdatasync {:.1}.",
        per(begin.0),
        per(begin.1),
        per(end.0),
        per(end.1)
    );
}

// ---------------------------------------------------------------------------------------------
// History: 10,000 closed runs on disk against none

/// Begins and ends `count` runs in the registry of `config`, with the connector's own code.
async fn closed_runs_on_disk(authority: &Authority, config: &Config, count: usize) {
    use certistack_connector::runs::{RegistryLimits, RunRegistry};
    use certistack_connector::server::load_authority_key;
    use certistack_core::grant::sign as sign_grant;
    use certistack_core::validate::{RunId, Validated};
    let key = load_authority_key(&config.tls.run_authority_public_key).unwrap();
    let now_ms = now().unix_timestamp() * 1000;
    let registry = RunRegistry::open(
        &config.paths.state_dir,
        &key,
        RegistryLimits::from_config(&config.limits),
        now_ms,
    )
    .unwrap();
    // One verified grant as a template; each run has its own run id and its own digest.
    let template = {
        let signed = sign_grant(authority.run_authority(), &grant(RUN_ID, NODE));
        certistack_core::grant::verify(&signed, &key).unwrap()
    };
    for _ in 0..count {
        let run_id = uuid::Uuid::new_v4().to_string();
        let signed = sign_grant(authority.run_authority(), &grant(&run_id, NODE));
        let mut verified = template.clone();
        verified.run_id = RunId::validate(&run_id).unwrap();
        verified.digest = certistack_core::grant::digest(&signed.grant);
        let id = verified.run_id.clone();
        registry.begin(&signed, verified, now_ms).await.unwrap();
        registry.end(&id, now_ms).await.unwrap();
    }
}

struct NodeFigures {
    ready: Samples,
    rss_kib: u64,
    fds: usize,
    list_runs: Samples,
    listed: usize,
}

/// Starts the daemon `starts` times on `config` and measures it idle.
async fn measure_node(
    authority: &Authority,
    config: &Config,
    dir: &Path,
    operator: &IssuedCertificate,
    starts: usize,
    calls: usize,
) -> NodeFigures {
    let mut ready = Samples::default();
    let mut figures = None;
    for i in 0..starts {
        let daemon = start_daemon(authority, config, dir, operator).await;
        ready.push(daemon.ready);
        if i + 1 < starts {
            continue;
        }
        let mut op = operator_client(authority, &daemon.address, operator).await;
        let mut list_runs = Samples::default();
        let mut listed = 0;
        for _ in 0..calls {
            let mut c = op.clone();
            listed = timed(&mut list_runs, || async move {
                c.list_runs(pb::ListRunsRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
                    .runs
                    .len()
            })
            .await;
        }
        op.hello(pb::HelloRequest {}).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let pid = daemon.pid();
        figures = Some((
            status_kib(pid, "VmRSS:"),
            descriptors(pid),
            list_runs,
            listed,
        ));
    }
    let (rss_kib, fds, list_runs, listed) = figures.unwrap();
    NodeFigures {
        ready,
        rss_kib,
        fds,
        list_runs,
        listed,
    }
}

async fn history(settings: &Settings) {
    let closed = settings.n(10_000, 1_000);
    let dir = TempDir::new("bench-history");
    let authority = controller(&dir.0);
    let operator = authority.issue_operator("bench", now()).unwrap();
    let page = certistack_connector::runs::DEFAULT_CLOSED_PAGE;
    let empty = enroll(&authority, &dir.0.join("empty"), NODE);
    let one_page = enroll(&authority, &dir.0.join("one-page"), NODE);
    let full = enroll(&authority, &dir.0.join("full"), NODE);
    closed_runs_on_disk(&authority, &one_page, page).await;
    let written = Instant::now();
    closed_runs_on_disk(&authority, &full, closed).await;
    let written = written.elapsed();
    let starts = settings.n(7, 3);
    let calls = settings.n(50, 10);
    let a = measure_node(&authority, &empty, &dir.0, &operator, starts, calls).await;
    let p = measure_node(&authority, &one_page, &dir.0, &operator, starts, calls).await;
    let b = measure_node(&authority, &full, &dir.0, &operator, starts, calls).await;
    let every_page = list_every_page(&authority, &full, &dir.0, &operator, settings.n(5, 2)).await;
    heading(&format!(
        "4. History: a node with {closed} closed runs against an empty one"
    ));
    println!(
        "The shipped daemon (`{}`), state directory under {}; the runs were written with the connector's registry code in {:.1} s. Start-to-ready is spawn → first Hello answered over mTLS ({starts} starts); ListRuns {calls} calls, each the first page (open runs and up to {page} closed runs).\n",
        binary("certistack-connector").display(),
        std::env::temp_dir().display(),
        written.as_secs_f64()
    );
    println!(
        "| node | start-to-ready median | p99 | idle RSS | open descriptors | ListRuns median | p99 | runs listed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, f) in [
        ("no runs", &a),
        (&format!("{page} closed runs (one page)") as &str, &p),
        (&format!("{closed} closed runs") as &str, &b),
    ] {
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
            ms(f.ready.median()),
            ms(f.ready.p99()),
            mib(f.rss_kib),
            f.fds,
            ms(f.list_runs.median()),
            ms(f.list_runs.p99()),
            f.listed
        );
    }
    println!(
        "| ratio {closed} ÷ none (ListRuns: ÷ one page) | {} | | {:.2}× | {:+} | {} | | |",
        ratio(b.ready.median(), a.ready.median()),
        b.rss_kib as f64 / a.rss_kib as f64,
        b.fds as i64 - a.fds as i64,
        ratio(b.list_runs.median(), p.list_runs.median()),
    );
    println!(
        "\nEvery closed run of the {closed}, page by page as `certistack-ctl runs` asks (1000 per page): median {}, p99 {} ({} samples).",
        ms(every_page.median()),
        ms(every_page.p99()),
        every_page.0.len()
    );
}

/// The time to list every closed run of the node on `config`, 1000 per page, `times` times.
async fn list_every_page(
    authority: &Authority,
    config: &Config,
    dir: &Path,
    operator: &IssuedCertificate,
    times: usize,
) -> Samples {
    let daemon = start_daemon(authority, config, dir, operator).await;
    let op = operator_client(authority, &daemon.address, operator).await;
    let mut samples = Samples::default();
    for _ in 0..times {
        let mut c = op.clone();
        timed(&mut samples, || async move {
            certistack_controller::operator::list_runs(&mut c)
                .await
                .unwrap()
                .len()
        })
        .await;
    }
    samples
}

// ---------------------------------------------------------------------------------------------
// Concurrency on one node: 16 runs at once against the doubles

const STEPS: [&str; 7] = [
    "set-up (connect, BeginRun)",
    "MapBackup",
    "CreateOverlay",
    "CreateVm",
    "VmStatus",
    "Cleanup",
    "EndRun",
];

/// The backup snapshot of validation slot `slot`: runs at once on one node never share a
/// backup, a VMID or a VNet.
fn slot_snapshot(slot: u32) -> String {
    format!("vm/{}/2026-11-01T02:00:00Z", 100 + slot)
}

/// One run's steps on `address` in validation slot `slot`, each step's latency added to `into`.
async fn validation(
    authority: &Authority,
    address: &str,
    node: &str,
    slot: u32,
    into: &mut [Samples],
) {
    let run_id = uuid::Uuid::new_v4().to_string();
    let vmid = 9100 + slot;
    let mut wire = grant(&run_id, node);
    wire.sandbox_vms = vec![pb::SandboxVm {
        vmid,
        max_cores: 1,
        max_memory_mib: 256,
    }];
    wire.snapshot = slot_snapshot(slot);
    wire.vnet = format!("csv{slot}");
    wire.probe_source = format!("10.77.{slot}.2/24");
    wire.guest_address = format!("10.77.{slot}.10/24");
    for target in &mut wire.probe_targets {
        target.address = format!("10.77.{slot}.10");
    }
    let mut t = Instant::now();
    let mut lap = |into: &mut [Samples], i: usize| {
        into[i].push(t.elapsed());
        t = Instant::now();
    };
    let credentials = mint(authority, &wire);
    let mut c = client(authority, address, node, &credentials.certificate)
        .await
        .unwrap();
    certistack_controller::client::hello(&mut c, node)
        .await
        .unwrap();
    c.begin_run(begin_request(&credentials)).await.unwrap();
    lap(into, 0);
    c.map_backup(pb::MapBackupRequest {
        snapshot: slot_snapshot(slot),
        archive: ARCHIVE.into(),
        pbs_secret: PBS_PASSWORD.into(),
        encryption_key: vec![],
    })
    .await
    .unwrap();
    lap(into, 1);
    c.create_overlay(pb::CreateOverlayRequest {
        vmid,
        archive: ARCHIVE.into(),
    })
    .await
    .unwrap();
    lap(into, 2);
    c.create_vm(pb::CreateVmRequest {
        vmid,
        cores: 1,
        memory_mib: 256,
        archives: vec![ARCHIVE.into()],
        // The connector's default sandbox shape: reading the source config is a step of its
        // own, not part of what this measures.
        mirror_source_hardware: false,
    })
    .await
    .unwrap();
    lap(into, 3);
    c.vm_status(pb::VmRequest { vmid }).await.unwrap();
    lap(into, 4);
    let reply = c
        .cleanup(pb::CleanupRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.residue.is_empty(), "residue: {:?}", reply.residue);
    lap(into, 5);
    c.end_run(pb::EndRunRequest {}).await.unwrap();
    lap(into, 6);
}

/// A node with the doubles: its lab, config and a backup to map for each of `slots`.
fn sim_node(authority: &Authority, dir: &Path, name: &str, slots: u32) -> (Lab, Config) {
    let lab = Lab::new(&format!("bench-{name}"));
    lab.settings(serde_json::json!({ "node": name }));
    for slot in 0..slots {
        lab.add_backup(&slot_snapshot(slot), ARCHIVE, b"BENCH", 8 << 20);
    }
    let mut config = enroll(authority, &dir.join(name), name);
    config.tools.proxmox_backup_client = lab.root.join("bin/proxmox-backup-client");
    config.tools.qm = lab.root.join("bin/qm");
    config.pve.qemu_server_run_dir = lab.root.join("var/run/qemu-server");
    config.pve.vm_config_dir = lab.root.join("etc/pve/qemu-server");
    config.pve.pbs_loopdev_dir = lab.root.join("run/pbs-loopdev");
    config.pve.pve_cluster_dir = lab.root.join("var/lib/pve-cluster");
    config.pve.dpkg_status = lab.root.join("var/lib/dpkg/status");
    config.paths.overlay_root = lab.root.join("overlays");
    (lab, config)
}

fn print_steps(per_step: &[Samples], whole: &Samples) {
    println!("| step | median | p99 | max |");
    println!("|---|---:|---:|---:|");
    for (name, s) in STEPS.iter().zip(per_step) {
        println!(
            "| {name} | {} | {} | {} |",
            ms(s.median()),
            ms(s.p99()),
            ms(s.max())
        );
    }
    println!(
        "| whole validation | {} | {} | {} |",
        ms(whole.median()),
        ms(whole.p99()),
        ms(whole.max())
    );
}

async fn concurrency(settings: &Settings) {
    if !privileged(
        "performance bench: concurrency",
        &["losetup", "qemu-img", "python3"],
    ) {
        return;
    }
    let runs = settings.n(16, 4);
    let dir = TempDir::new("bench-concurrency");
    let authority = Arc::new(controller(&dir.0));
    let operator = authority.issue_operator("bench", now()).unwrap();
    let (_lab, mut config) = sim_node(&authority, &dir.0, NODE, runs as u32 + 1);
    // The default admits 4 runs at once; an operator raises it for a node meant to take more.
    config.limits.max_concurrent_runs = runs;
    let daemon = start_daemon(&authority, &config, &dir.0, &operator).await;
    let pid = daemon.pid();
    let idle_rss = status_kib(pid, "VmRSS:");

    let mut one_at_a_time = vec![Samples::default(); STEPS.len()];
    let mut whole_serial = Samples::default();
    for i in 0..settings.n(4, 1) {
        let started = Instant::now();
        validation(
            &authority,
            &daemon.address,
            NODE,
            i as u32 % (runs as u32 + 1),
            &mut one_at_a_time,
        )
        .await;
        whole_serial.push(started.elapsed());
    }

    let cpu_before = cpu_seconds(&pid.to_string());
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..runs {
        let authority = authority.clone();
        let address = daemon.address.clone();
        tasks.spawn(async move {
            let mut steps = vec![Samples::default(); STEPS.len()];
            let started = Instant::now();
            validation(&authority, &address, NODE, i as u32, &mut steps).await;
            (steps, started.elapsed())
        });
    }
    let mut per_step = vec![Samples::default(); STEPS.len()];
    let mut whole = Samples::default();
    while let Some(done) = tasks.join_next().await {
        let (steps, elapsed) = done.unwrap();
        for (into, s) in per_step.iter_mut().zip(steps) {
            into.0.extend(s.0);
        }
        whole.push(elapsed);
    }
    let wall = started.elapsed();
    let cpu = cpu_seconds(&pid.to_string()) - cpu_before;
    let peak = status_kib(pid, "VmHWM:");

    heading(&format!(
        "5. Concurrency: {runs} runs at once on one node (the doubles, real loop devices and qemu-img)"
    ));
    println!(
        "The shipped daemon; each run: connect + BeginRun, MapBackup, CreateOverlay, CreateVm, VmStatus, Cleanup, EndRun. First one at a time ({} runs), then {runs} at once.\n",
        whole_serial.0.len()
    );
    println!("One at a time:\n");
    print_steps(&one_at_a_time, &whole_serial);
    println!("\n{runs} at once:\n");
    print_steps(&per_step, &whole);
    println!(
        "\nWall time for {runs} at once: {}; the daemon's CPU (user + system, its own threads, not the tools it runs): {:.2} s; idle RSS {}, peak RSS (VmHWM) {}.",
        ms(wall),
        cpu,
        mib(idle_rss),
        mib(peak)
    );
}

// ---------------------------------------------------------------------------------------------
// Footprint

async fn footprint(settings: &Settings) {
    heading("6. Footprint");
    let dir = TempDir::new("bench-footprint");
    println!("| binary | size | stripped |");
    println!("|---|---:|---:|");
    for name in ["certistack-connector", "certistack-ctl"] {
        let path = binary(name);
        let size = std::fs::metadata(&path).unwrap().len();
        let stripped = dir.0.join(format!("{name}.stripped"));
        let out = Command::new("strip")
            .arg("-o")
            .arg(&stripped)
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "strip: {out:?}");
        let small = std::fs::metadata(&stripped).unwrap().len();
        println!(
            "| {name} (`{}`) | {:.1} MiB | {:.1} MiB |",
            path.display(),
            size as f64 / (1 << 20) as f64,
            small as f64 / (1 << 20) as f64
        );
    }
    let authority = controller(&dir.0);
    let operator = authority.issue_operator("bench", now()).unwrap();
    let config = enroll(&authority, &dir.0.join("node"), NODE);
    let f = measure_node(
        &authority,
        &config,
        &dir.0,
        &operator,
        settings.n(9, 3),
        settings.n(10, 3),
    )
    .await;
    println!(
        "\nThe shipped daemon on an empty node: start-to-ready median {} (p99 {}, {} starts), idle RSS {}, {} open descriptors. RSS under load: see sections 4, 5 and 3.",
        ms(f.ready.median()),
        ms(f.ready.p99()),
        f.ready.0.len(),
        mib(f.rss_kib),
        f.fds
    );
}

// ---------------------------------------------------------------------------------------------

#[path = "performance/checks.rs"]
mod checks;
#[path = "performance/node_ops.rs"]
mod node_ops;
#[path = "performance/profile.rs"]
mod profile;
#[path = "performance/resolve.rs"]
mod resolve;
#[path = "performance/run_history.rs"]
mod run_history;

fn main() {
    // The connector logs a line per call (`call_log`) at info, as the daemon does; its text
    // formatter writes here to nowhere, so the formatting is counted but no terminal's write.
    // The daemon's plain line, as it writes when its standard error is neither a terminal nor
    // the journal.
    tracing_subscriber::util::SubscriberInitExt::init(
        certistack_connector::log_line::plain_subscriber(
            tracing_subscriber::EnvFilter::new("info"),
            std::io::sink,
        ),
    );
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.iter().any(|a| a == "--profile") {
        profile::profile(&args);
        return;
    }
    let short = args.iter().any(|a| a == "--short")
        || std::env::var("CERTISTACK_BENCH_SHORT").as_deref() == Ok("1");
    let mut sections: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(String::as_str)
        .collect();
    if sections.is_empty() {
        sections = vec!["transport", "setup", "history", "concurrency", "footprint"];
    }
    let settings = Settings { short };
    // `--workers=N`: the runtime's worker threads (default one per core, as the daemon's). With
    // one, no connection's tasks are placed by chance and runs repeat each other closely
    // (docs/performance.md, section 1, "The third pass").
    let workers = args
        .iter()
        .find_map(|a| a.strip_prefix("--workers="))
        .map(|n| {
            n.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .unwrap_or_else(|| panic!("--workers={n}: give a number of threads, 1 or more"))
        });
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        runtime.worker_threads(workers);
    }
    let runtime = runtime.enable_all().build().unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "performance bench{}{}: sections {sections:?}; load average at start {}",
        if short { " (short)" } else { "" },
        workers.map_or(String::new(), |n| format!(" ({n} worker thread(s))")),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    runtime.block_on(async {
        for section in &sections {
            match *section {
                "transport" => transport(&settings).await,
                "setup" => setup(&settings).await,
                "history" => history(&settings).await,
                "concurrency" => concurrency(&settings).await,
                "footprint" => footprint(&settings).await,
                "fleet" => fleet::fleet(&settings).await,
                "checks" => checks::checks().await,
                "resolve" => resolve::resolve(&settings).await,
                "run-history" => run_history::run_history(&settings).await,
                // Runs on its own thread and runtime inside a network namespace until it is done.
                "node-ops" => tokio::task::block_in_place(node_ops::node_ops),
                other => panic!(
                    "unknown section {other:?}: transport, setup, history, concurrency, footprint, fleet, checks, node-ops, resolve, run-history"
                ),
            }
        }
    });
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nload average at the end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

mod fleet {
    use super::*;
    use certistack_controller::runner::{DEFAULT_PER_NODE, DEFAULT_TOTAL};

    /// Backups per node: the 1,000 validations are 10 per node.
    const SLOTS: u32 = 10;

    struct FleetNode {
        name: String,
        _lab: Lab,
        daemon: Daemon,
    }

    /// `certistack-ctl` under GNU time: wall seconds, CPU seconds, peak RSS in KiB, stdout.
    fn ctl_timed(args: &[&str]) -> (f64, f64, u64, String) {
        let out = Command::new("/usr/bin/time")
            .args(["-f", "TIME %e %U %S %M"])
            .arg(binary("certistack-ctl"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("TIME "))
            .unwrap_or_else(|| panic!("no timing from /usr/bin/time: {stderr}"));
        let v: Vec<f64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        (
            v[0],
            v[1] + v[2],
            v[3] as u64,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// `total` validations over `nodes`, at most DEFAULT_TOTAL at once and DEFAULT_PER_NODE at
    /// once on a node, as `certistack-ctl run` schedules them.
    async fn validations(
        authority: &Arc<Authority>,
        nodes: &[FleetNode],
        total: usize,
    ) -> (Duration, f64, Vec<Samples>, Samples) {
        let slots = Arc::new(tokio::sync::Semaphore::new(DEFAULT_TOTAL));
        let per_node: Vec<Arc<tokio::sync::Semaphore>> = nodes
            .iter()
            .map(|_| Arc::new(tokio::sync::Semaphore::new(DEFAULT_PER_NODE)))
            .collect();
        let cpu_before = cpu_seconds("self");
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..total {
            let n = i % nodes.len();
            let node_slot = per_node[n].clone();
            let slots = slots.clone();
            let authority = authority.clone();
            let address = nodes[n].daemon.address.clone();
            let name = nodes[n].name.clone();
            // Validations that may share a node at once use different slots.
            let slot = (i / nodes.len()) as u32 % SLOTS;
            tasks.spawn(async move {
                let _node = node_slot.acquire_owned().await.unwrap();
                let _slot = slots.acquire_owned().await.unwrap();
                let mut steps = vec![Samples::default(); STEPS.len()];
                let started = Instant::now();
                validation(&authority, &address, &name, slot, &mut steps).await;
                (steps, started.elapsed())
            });
        }
        let mut per_step = vec![Samples::default(); STEPS.len()];
        let mut whole = Samples::default();
        while let Some(done) = tasks.join_next().await {
            let (steps, elapsed) = done.unwrap();
            for (into, s) in per_step.iter_mut().zip(steps) {
                into.0.extend(s.0);
            }
            whole.push(elapsed);
        }
        (
            started.elapsed(),
            cpu_seconds("self") - cpu_before,
            per_step,
            whole,
        )
    }

    pub async fn fleet(settings: &Settings) {
        if !privileged(
            "performance bench: fleet",
            &["losetup", "qemu-img", "python3"],
        ) {
            return;
        }
        let count = settings.n(100, 10);
        let dir = TempDir::new("bench-fleet");
        let authority = Arc::new(controller(&dir.0));
        let operator = authority.issue_operator("bench", now()).unwrap();
        let mut nodes = Vec::new();
        let mut ready = Samples::default();
        let started = Instant::now();
        for i in 1..=count {
            let name = format!("pve{i}");
            let (lab, config) = sim_node(&authority, &dir.0, &name, SLOTS);
            let daemon = start_daemon(&authority, &config, &dir.0, &operator).await;
            ready.push(daemon.ready);
            nodes.push(FleetNode {
                name,
                _lab: lab,
                daemon,
            });
        }
        let brought_up = started.elapsed();
        let mut inventory = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n",
            authority.dir(),
            dir.0.join("reports")
        );
        for node in &nodes {
            let port = node.daemon.address.rsplit(':').next().unwrap();
            inventory.push_str(&format!(
                "\n[[nodes]]\nname = \"{}\"\naddress = \"127.0.0.1\"\nport = {port}\n",
                node.name
            ));
        }
        let config_path = dir.0.join("controller.toml");
        std::fs::write(&config_path, inventory).unwrap();
        let config_arg = config_path.to_str().unwrap();
        let audits = settings.n(5, 2);
        let mut audit_wall = Samples::default();
        let mut audit_cpu = Vec::new();
        let mut audit_rss = 0;
        let mut reachable = 0;
        for _ in 0..audits {
            let (wall, cpu, rss, stdout) =
                ctl_timed(&["nodes", "audit", "--config", config_arg, "--json"]);
            audit_wall.push(Duration::from_secs_f64(wall));
            audit_cpu.push(cpu);
            audit_rss = audit_rss.max(rss);
            reachable = stdout
                .lines()
                .filter(|l| l.contains("\"reachable\":true"))
                .count();
        }
        let idle_rss: u64 = nodes
            .iter()
            .map(|n| status_kib(n.daemon.pid(), "VmRSS:"))
            .sum();

        heading(&format!(
            "3. Fleet: {count} connector daemons on loopback, one controller"
        ));
        println!(
            "Each node: the shipped daemon with its own name, port, state directory and Proxmox doubles. Brought up one after another in {:.1} s (start-to-ready median {}, p99 {}); together {} idle RSS.\n",
            brought_up.as_secs_f64(),
            ms(ready.median()),
            ms(ready.p99()),
            mib(idle_rss)
        );
        println!(
            "`certistack-ctl nodes audit --json` of all {count} ({audits} times, concurrency {}): wall median {} (max {}), controller CPU median {:.2} s, peak RSS {}; {reachable} of {count} reachable.\n",
            certistack_controller::audit::DEFAULT_CONCURRENCY,
            ms(audit_wall.median()),
            ms(audit_wall.max()),
            {
                let mut c = audit_cpu.clone();
                c.sort_by(f64::total_cmp);
                c[c.len() / 2]
            },
            mib(audit_rss)
        );
        for total in [count, count * 10] {
            let (wall, cpu, per_step, whole) = validations(&authority, &nodes, total).await;
            let daemon_peak: u64 = nodes
                .iter()
                .map(|n| status_kib(n.daemon.pid(), "VmHWM:"))
                .max()
                .unwrap();
            println!(
                "{total} validations over {count} nodes (map, overlay, create, status, cleanup; no VM boot), at most {DEFAULT_TOTAL} at once and {DEFAULT_PER_NODE} on a node (the controller's defaults): wall {:.1} s, {:.1} validations/s; the driving process's CPU {cpu:.1} s, its peak RSS {}; the largest daemon's peak RSS {}.\n",
                wall.as_secs_f64(),
                total as f64 / wall.as_secs_f64(),
                mib(status_kib(std::process::id(), "VmHWM:")),
                mib(daemon_peak)
            );
            print_steps(&per_step, &whole);
            println!();
        }
    }
}
