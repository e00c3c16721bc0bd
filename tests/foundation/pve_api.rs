//! The controller and the Proxmox VE API (the double `tests/doubles/pve-api`, HTTPS on
//! loopback with a CA of the tests' own): TLS is always verified, by a CA file, a pinned
//! fingerprint or both; the token's secret stays in its file and out of every output; replies
//! are bounded in size and time; `doctor` prints the cluster's lines with what to do.

use super::*;
use certistack_controller::api::https::{ApiError, Limits};
use certistack_controller::api::pve::{PveClient, PveEndpoint};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TOKEN_ID: &str = "certistack@pve!ctl";
const SECRET: &str = "0b1e5c1e-1111-4222-8333-944445555666";

/// The double, serving `pki`'s leaf on 127.0.0.1; stopped on drop.
struct PveDouble {
    port: u16,
    api: ApiDouble,
}

impl PveDouble {
    fn start(pki: &ApiServerPki, settings: serde_json::Value) -> Self {
        // pve-api keeps its certificate, settings, port and calls.log in its --root.
        let root = TempDir::new("pve-api");
        std::fs::write(root.0.join("double.json"), settings.to_string()).unwrap();
        let api = ApiDouble::start_in("pve-api", pki, &[], "--root", root);
        Self {
            port: api.port,
            api,
        }
    }

    fn calls_log(&self) -> String {
        std::fs::read_to_string(self.api.tls_dir().join("calls.log")).unwrap_or_default()
    }
}

fn settings() -> serde_json::Value {
    serde_json::json!({ "tokens": { TOKEN_ID: SECRET } })
}

/// A controller configuration directory with `[pve]` pointing at the double.
struct Controller {
    dir: TempDir,
}

impl Controller {
    fn new(pki: &ApiServerPki) -> Self {
        let dir = TempDir::new("pve-ctl");
        std::fs::write(dir.0.join("pve-root-ca.pem"), &pki.ca_pem).unwrap();
        std::fs::write(
            dir.0.join("other-ca.pem"),
            api_server_pki(&["localhost"]).ca_pem,
        )
        .unwrap();
        let secret = dir.0.join("pve-token");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        Self { dir }
    }

    /// `doctor` with `[pve]` made of `url` and the `trust` lines; its exit code and output.
    fn doctor(&self, url: &str, trust: &str) -> (i32, String, String) {
        let config = format!(
            "state_dir = {:?}\nreports_dir = {:?}\n\n[pve]\napi_url = {url:?}\ntoken_id = {TOKEN_ID:?}\ntoken_secret_file = \"pve-token\"\n{trust}",
            self.dir.0.join("state"),
            self.dir.0.join("reports"),
        );
        let path = self.dir.0.join("controller.toml");
        std::fs::write(&path, config).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        run_binary(
            "certistack-ctl",
            &["doctor", "--config", path.to_str().unwrap()],
        )
    }

    fn endpoint(port: u16, secret_file: &Path) -> PveEndpoint<'_> {
        PveEndpoint {
            host: "localhost",
            port,
            token_id: TOKEN_ID,
            token_secret_file: secret_file,
            ca_file: None,
            fingerprint: None,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }
}

fn pins(pki: &ApiServerPki) -> (String, String) {
    let fingerprint = certistack_core::tls::certificate_fingerprint(&pki.leaf_der);
    let colons = certistack_core::tls::format_fingerprint(&fingerprint);
    (colons.clone(), colons.replace(':', "").to_lowercase())
}

fn wrong_pin() -> String {
    ["ab"; 32].join(":")
}

/// The cluster's lines of a doctor output: (check, level, detail).
fn cluster_lines(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .filter_map(|line| line.strip_prefix("cluster "))
        .map(|rest| {
            let mut parts = rest.splitn(3, ' ');
            (
                parts.next().unwrap().to_owned(),
                parts.next().unwrap().to_owned(),
                parts.next().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[test]
fn doctor_proves_the_connection_to_the_pve_api_and_refuses_every_certificate_it_was_not_told_to_trust()
 {
    let pki = api_server_pki(&["localhost"]);
    let double = PveDouble::start(&pki, settings());
    let controller = Controller::new(&pki);
    let url = format!("https://localhost:{}", double.port);
    let (colons, bare) = pins(&pki);
    let mut outputs = Vec::new();

    // Trusted by the CA file: every line ok, and the exit status 0.
    let (code, out, err) = controller.doctor(&url, "ca_file = \"pve-root-ca.pem\"\n");
    assert_eq!(code, 0, "{out}{err}");
    let lines = cluster_lines(&out);
    let names: Vec<&str> = lines.iter().map(|(check, _, _)| check.as_str()).collect();
    assert_eq!(
        names,
        [
            "pve-api",
            "pve-tls",
            "pve-token",
            "pve-version",
            "pve-cluster"
        ],
        "{out}"
    );
    assert!(lines.iter().all(|(_, level, _)| level == "ok"), "{out}");
    assert!(out.contains("cluster pve-tls ok"), "{out}");
    assert!(out.contains("verified by the CA file"), "{out}");
    assert!(
        out.contains(&format!("cluster pve-token ok token {TOKEN_ID} accepted")),
        "{out}"
    );
    assert!(
        out.contains("cluster pve-version ok Proxmox VE 9."),
        "{out}"
    );
    outputs.push(out + &err);

    // Pinned, in both spellings, without a CA: ok, and said to be by the pin.
    for pin in [&colons, &bare] {
        let (code, out, err) = controller.doctor(&url, &format!("fingerprint = {pin:?}\n"));
        assert_eq!(code, 0, "{pin}: {out}{err}");
        assert!(out.contains("verified by the pinned fingerprint"), "{out}");
        outputs.push(out + &err);
    }
    let (code, out, err) = controller.doctor(
        &url,
        &format!("ca_file = \"pve-root-ca.pem\"\nfingerprint = {colons:?}\n"),
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("verified by the CA file and the pinned fingerprint"),
        "{out}"
    );
    outputs.push(out + &err);

    // Each refusal: the API reached, TLS refused, the reason and what to do; nothing after.
    let refusals: [(&str, String, &str); 5] = [
        (
            "another CA",
            "ca_file = \"other-ca.pem\"\n".into(),
            "does not chain to the CA in ca_file",
        ),
        (
            "a pin mismatch",
            format!("fingerprint = {:?}\n", wrong_pin()),
            "not the pinned AB:AB",
        ),
        (
            "the CA but a pin mismatch",
            format!(
                "ca_file = \"pve-root-ca.pem\"\nfingerprint = {:?}\n",
                wrong_pin()
            ),
            "not the pinned AB:AB",
        ),
        (
            "the pin but another CA",
            format!("ca_file = \"other-ca.pem\"\nfingerprint = {colons:?}\n"),
            "does not chain to the CA in ca_file",
        ),
        (
            "a wrong host name",
            "ca_file = \"pve-root-ca.pem\"\n".into(),
            "is not valid for 127.0.0.1",
        ),
    ];
    for (case, trust, reason) in refusals {
        let url = if case == "a wrong host name" {
            format!("https://127.0.0.1:{}", double.port)
        } else {
            url.clone()
        };
        let (code, out, err) = controller.doctor(&url, &trust);
        assert_eq!(code, 1, "{case}: {out}{err}");
        let lines = cluster_lines(&out);
        assert_eq!(lines.len(), 2, "{case}: {out}");
        assert_eq!(
            (lines[0].0.as_str(), lines[0].1.as_str()),
            ("pve-api", "ok"),
            "{case}: {out}"
        );
        assert_eq!(
            (lines[1].0.as_str(), lines[1].1.as_str()),
            ("pve-tls", "fail"),
            "{case}: {out}"
        );
        assert!(lines[1].2.contains(reason), "{case}: {out}");
        outputs.push(out + &err);
    }
    // No request reached the API without a verified certificate: four good doctor runs, two
    // calls each (/version, /cluster/status); the five refusals ended in the handshake, which
    // the server saw fail.
    // The double logs a refused handshake on its own thread, possibly after the client has
    // gone: the log is read until it holds them (on a loaded machine that takes a moment).
    let counts = |log: &str| {
        let requests = log
            .lines()
            .filter(|line| line.contains("\"path\": \"/api2/json/"))
            .count();
        let handshakes_refused = log
            .lines()
            .filter(|line| line.contains("\"tls_error\""))
            .count();
        (requests, handshakes_refused)
    };
    let mut log = double.calls_log();
    for _ in 0..50 {
        if counts(&log) == (8, 5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        log = double.calls_log();
    }
    assert_eq!(counts(&log), (8, 5), "{log}");

    // A secret file others may read: refused before anything is sent, with the chmod to run.
    std::fs::set_permissions(
        controller.path("pve-token"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let (code, out, err) = controller.doctor(&url, "ca_file = \"pve-root-ca.pem\"\n");
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("cluster pve-api fail pve.token_secret_file:"),
        "{out}"
    );
    assert!(out.contains("chmod 0600"), "{out}");
    outputs.push(out + &err);
    std::fs::set_permissions(
        controller.path("pve-token"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    // A wrong secret: the token line fails, naming the call, the status and what to check.
    std::fs::write(controller.path("pve-token"), "not-the-secret\n").unwrap();
    let (code, out, err) = controller.doctor(&url, "ca_file = \"pve-root-ca.pem\"\n");
    assert_eq!(code, 1, "{out}{err}");
    let token = cluster_lines(&out)
        .into_iter()
        .find(|(check, _, _)| check == "pve-token")
        .unwrap();
    assert_eq!(token.1, "fail", "{out}");
    assert!(
        token.2.contains("GET /api2/json/version: HTTP 401"),
        "{out}"
    );
    assert!(token.2.contains("pveum user token add"), "{out}");
    outputs.push(out + &err);
    std::fs::write(controller.path("pve-token"), format!("{SECRET}\n")).unwrap();

    // The secret is in no output and not in the API's log; the log has the token's id.
    for output in &outputs {
        assert!(!output.contains(SECRET), "{output}");
    }
    let log = double.calls_log();
    assert!(
        !log.contains(SECRET) && !log.contains("not-the-secret"),
        "{log}"
    );
    assert!(log.contains(TOKEN_ID), "{log}");
}

#[test]
fn replies_are_bounded_in_size_and_time() {
    let pki = api_server_pki(&["localhost"]);
    let controller = Controller::new(&pki);
    let secret_file = controller.path("pve-token");
    let ca_file = controller.path("pve-root-ca.pem");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = Limits {
        connect: Duration::from_secs(5),
        response: Duration::from_secs(1),
        max_reply_bytes: 64 * 1024,
        concurrency: 2,
    };

    // A reply over the cap is refused, naming the call.
    let mut padded = settings();
    padded["pad_reply_bytes"] = serde_json::json!(128 * 1024);
    let double = PveDouble::start(&pki, padded);
    let mut endpoint = Controller::endpoint(double.port, &secret_file);
    endpoint.ca_file = Some(&ca_file);
    let client = PveClient::new(&endpoint, limits).unwrap();
    let error = runtime.block_on(client.version()).unwrap_err();
    assert!(matches!(error, ApiError::TooLarge { .. }), "{error}");
    assert!(
        error
            .to_string()
            .starts_with("GET /api2/json/version: the reply is larger than 65536 bytes"),
        "{error}"
    );
    drop(double);

    // A server that stalls: the call ends at the deadline, saying which stage waited.
    let mut stalling = settings();
    stalling["stall_seconds"] = serde_json::json!(10);
    let double = PveDouble::start(&pki, stalling);
    let endpoint = PveEndpoint {
        port: double.port,
        ..endpoint
    };
    let client = PveClient::new(&endpoint, limits).unwrap();
    let started = std::time::Instant::now();
    let error = runtime.block_on(client.version()).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            error,
            ApiError::Timeout {
                stage: "reply",
                seconds: 1,
                ..
            }
        ),
        "{error}"
    );

    // Nothing listening: unreachable, with the URL.
    drop(double);
    let error = runtime.block_on(client.version()).unwrap_err();
    assert!(matches!(error, ApiError::Connect { .. }), "{error}");
    assert!(!error.reached());

    // The token's Debug output names the id only.
    let shown = format!("{client:?}");
    assert!(
        shown.contains(TOKEN_ID) && !shown.contains(SECRET),
        "{shown}"
    );
}

#[test]
fn the_token_reads_the_api_as_pve_answers_it() {
    let pki = api_server_pki(&["localhost"]);
    let mut with_permissions = settings();
    with_permissions["permissions"] = serde_json::json!({
        TOKEN_ID: { "/": { "Sys.Audit": 1 }, "/vms": { "VM.Audit": 1, "VM.Allocate": 0 } }
    });
    let double = PveDouble::start(&pki, with_permissions);
    let controller = Controller::new(&pki);
    let secret_file = controller.path("pve-token");
    let (colons, _) = pins(&pki);
    let fingerprint = certistack_core::tls::parse_fingerprint(&colons).unwrap();
    let mut endpoint = Controller::endpoint(double.port, &secret_file);
    endpoint.fingerprint = Some(fingerprint);
    let client = PveClient::new(&endpoint, Limits::default()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let version = runtime.block_on(client.version()).unwrap();
    assert!(version.version.starts_with("9."), "{version:?}");
    let permissions = runtime.block_on(client.permissions(None)).unwrap();
    assert!(permissions["/"]["Sys.Audit"].0);
    assert!(!permissions["/vms"]["VM.Allocate"].0);
    let status = runtime.block_on(client.cluster_status()).unwrap();
    assert!(
        status.iter().any(|entry| entry.kind == "node"),
        "{status:?}"
    );
}

#[test]
fn doctor_checks_the_controllers_keys_before_it_contacts_the_api() {
    let pki = api_server_pki(&["localhost"]);
    let double = PveDouble::start(&pki, settings());
    let controller = Controller::new(&pki);
    // A node in the inventory, and no controller state directory: refused (66) before the
    // API is asked anything.
    let config = format!(
        "state_dir = {:?}\nreports_dir = {:?}\n\n[[nodes]]\nname = \"pve1\"\naddress = \"127.0.0.1\"\nport = 9\n\n[pve]\napi_url = \"https://localhost:{}\"\ntoken_id = {TOKEN_ID:?}\ntoken_secret_file = \"pve-token\"\nca_file = \"pve-root-ca.pem\"\n",
        controller.path("missing-state"),
        controller.path("reports"),
        double.port,
    );
    let path = controller.path("controller.toml");
    std::fs::write(&path, config).unwrap();
    let (code, out, err) = run_binary(
        "certistack-ctl",
        &["doctor", "--config", path.to_str().unwrap()],
    );
    assert_eq!(code, 66, "{out}{err}");
    assert!(err.contains("controller state directory refused"), "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(double.calls_log(), "", "the API was contacted");
}

/// The first `count` API calls of `calls.log`, each as (client port, path, status): the double
/// writes a call's line just after its reply, so this waits a moment for the lines.
fn calls(double: &PveDouble, count: usize) -> Vec<(u64, String, u64)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let calls = logged_calls(double);
        if calls.len() >= count || std::time::Instant::now() > deadline {
            return calls;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn logged_calls(double: &PveDouble) -> Vec<(u64, String, u64)> {
    double
        .calls_log()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|call| call["path"].is_string())
        .map(|call| {
            (
                call["connection"].as_u64().unwrap(),
                call["path"].as_str().unwrap().to_owned(),
                call["status"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

#[test]
fn calls_share_a_connection_the_server_keeps_open_and_a_closed_one_is_opened_anew() {
    let pki = api_server_pki(&["localhost"]);
    let mut double_settings = settings();
    double_settings["idle_timeout_seconds"] = serde_json::json!(0.5);
    let double = PveDouble::start(&pki, double_settings);
    let controller = Controller::new(&pki);
    let secret_file = controller.path("pve-token");
    let (colons, _) = pins(&pki);
    let mut endpoint = Controller::endpoint(double.port, &secret_file);
    endpoint.fingerprint = Some(certistack_core::tls::parse_fingerprint(&colons).unwrap());
    let client = PveClient::new(
        &endpoint,
        Limits {
            concurrency: 1,
            ..Limits::default()
        },
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // Ten calls, one connection: pveproxy keeps it open (Connection: Keep-Alive).
    for _ in 0..10 {
        runtime.block_on(client.version()).unwrap();
    }
    let first = calls(&double, 10);
    assert_eq!(first.len(), 10, "{first:?}");
    assert!(
        first.iter().all(|(port, _, _)| *port == first[0].0),
        "{first:?}"
    );

    // A refusal closes the connection (AnyEvent.pm `response`: 400 and above); the next call
    // opens another and succeeds.
    let refused = runtime.block_on(client.pool("no-such-pool")).unwrap_err();
    assert!(
        refused.status().is_some_and(|status| status >= 400),
        "{refused}"
    );
    runtime.block_on(client.version()).unwrap();
    let after_refusal = calls(&double, 12);
    let (refused_port, _, refused_status) = &after_refusal[10];
    assert!(*refused_status >= 400, "{after_refusal:?}");
    assert_eq!(*refused_port, first[0].0, "{after_refusal:?}");
    assert_ne!(after_refusal[11].0, *refused_port, "{after_refusal:?}");

    // The server closes a kept connection idle past its timeout: the next call, finding it
    // closed, opens a new one and succeeds.
    std::thread::sleep(Duration::from_millis(1200));
    runtime.block_on(client.version()).unwrap();
    let after_idle = calls(&double, 13);
    assert_eq!(after_idle.len(), 13, "{after_idle:?}");
    assert_ne!(after_idle[12].0, after_idle[11].0, "{after_idle:?}");
    assert_eq!(after_idle[12].2, 200, "{after_idle:?}");
}
