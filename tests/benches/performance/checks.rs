//! Section `checks`: what the connector's checks cost, measured in one run and printed as a
//! table: the pure parts (grant verification, request parsing, authorization) and the mTLS round
//! trips (a fresh connection with handshake + Hello, and a call on an open connection).
//!
//! Run: `cargo bench -p certistack-tests --bench performance -- checks`

use certistack_connector::action::{authorize, parse};
use certistack_core::grant;
use certistack_proto::v1 as pb;
use certistack_tests::*;
use std::time::{Duration, Instant};

struct Row {
    name: &'static str,
    iterations: u32,
    total: Duration,
}

fn time<F: FnMut()>(name: &'static str, iterations: u32, mut f: F) -> Row {
    for _ in 0..iterations.min(100) {
        f();
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    Row {
        name,
        iterations,
        total: start.elapsed(),
    }
}

async fn time_async<F, Fut>(name: &'static str, iterations: u32, mut f: F) -> Row
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..iterations.min(10) {
        f().await;
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f().await;
    }
    Row {
        name,
        iterations,
        total: start.elapsed(),
    }
}

pub async fn checks() {
    super::heading("The connector's checks, each on its own");
    let rows = {
        let dir = TempDir::new("bench");
        let authority = controller(&dir.0);
        let node = TestNode::start(&authority, &dir.0.join("node"), NODE).await;
        let wire = grant(RUN_ID, NODE);
        let credentials = mint(&authority, &wire);
        let signed = credentials.signed_grant.clone();
        let key = authority.run_authority().verifying_key();
        let parsed = grant::verify(&signed, &key).unwrap();
        let request = || pb::CreateVmRequest {
            vmid: VMID,
            cores: 2,
            memory_mib: 1024,
            archives: vec![ARCHIVE.into()],
            mirror_source_hardware: false,
        };
        let action = parse::create_vm(request()).unwrap();

        let mut rows = vec![
            time(
                "grant verify + parse (Ed25519, all validators)",
                20_000,
                || {
                    std::hint::black_box(grant::verify(&signed, &key).unwrap());
                },
            ),
            time("request parse (CreateVm)", 200_000, || {
                std::hint::black_box(parse::create_vm(request()).unwrap());
            }),
            time("authorize(grant, CreateVm)", 1_000_000, || {
                authorize(std::hint::black_box(&parsed), std::hint::black_box(&action)).unwrap();
            }),
        ];

        let mut client = run_client(&authority, &node, &credentials).await;
        client.begin_run(begin_request(&credentials)).await.unwrap();
        rows.push(
            time_async(
                "mTLS: VmStatus on an open connection (recording executor)",
                2_000,
                || {
                    let mut client = client.clone();
                    async move {
                        client
                            .vm_status(pb::VmRequest { vmid: VMID })
                            .await
                            .unwrap();
                    }
                },
            )
            .await,
        );
        rows.push(
            time_async("mTLS: Hello on an open connection", 2_000, || {
                let mut client = client.clone();
                async move {
                    client.hello(pb::HelloRequest {}).await.unwrap();
                }
            })
            .await,
        );
        let operator = authority.issue_operator("bench", now()).unwrap();
        rows.push(
            time_async(
                "mTLS: new connection (TCP + TLS 1.3 handshake) + Hello",
                200,
                || {
                    let operator = &operator;
                    let authority = &authority;
                    let address = node.address.clone();
                    async move {
                        let mut client = client_for(authority, &address, operator).await;
                        client.hello(pb::HelloRequest {}).await.unwrap();
                    }
                },
            )
            .await,
        );
        rows
    };

    println!("| measurement | iterations | per iteration |");
    println!("|---|---:|---:|");
    for row in &rows {
        let per = row.total / row.iterations;
        let shown = if per < Duration::from_micros(10) {
            format!("{} ns", per.as_nanos())
        } else if per < Duration::from_millis(10) {
            format!("{:.1} µs", per.as_nanos() as f64 / 1000.0)
        } else {
            format!("{:.2} ms", per.as_secs_f64() * 1000.0)
        };
        println!("| {} | {} | {} |", row.name, row.iterations, shown);
    }
}

async fn client_for(
    authority: &certistack_controller::authority::Authority,
    address: &str,
    identity: &certistack_controller::authority::IssuedCertificate,
) -> certistack_proto::v1::connector_client::ConnectorClient<tonic::transport::Channel> {
    client(authority, address, NODE, identity).await.unwrap()
}
