//! Someone is told: after a run against a node that does not answer (an error), one mail
//! reaches the SMTP double (`tests/doubles/smtp-receiver`, STARTTLS and TLS, AUTH PLAIN), and the
//! signed webhook reaches the receiver double (`tests/doubles/webhook-receiver`) once, its signature
//! checks with the receiver's five lines of Python from `docs/history.md`, and its delivery is
//! recorded in the history; a receiver that keeps failing gets a bounded number of tries, a
//! recorded failure and the metrics' count, and the exit code stays the run's; a receiver whose
//! certificate the configured CA did not sign gets nothing; summary mode sends a summary. The
//! key is in no output, body or header.

use super::history_command::Controller;
use super::*;
use certistack_controller::history::RunStore;
use certistack_controller::history::sqlite::SqliteStore;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

const KEY: &str = "4f1c0e7d2b9a58e3c6b1f0a7d4e29c85";

/// The receiver double, its requests so far.
struct Receiver {
    api: ApiDouble,
}

impl Receiver {
    fn start(pki: &ApiServerPki, settings: serde_json::Value) -> Self {
        let root = TempDir::new("webhook-receiver");
        std::fs::write(root.0.join("double.json"), settings.to_string()).unwrap();
        Self {
            api: ApiDouble::start_in("webhook-receiver", pki, &[], "--root", root),
        }
    }

    fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.api.tls_dir().join("requests.log"))
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }
}

/// The controller of `history_command` with `[notify]` for `receiver`, trusting `ca_pem`.
fn notifying(receiver: &Receiver, ca_pem: &str, notify: &str, extra: &str) -> Controller {
    let controller = Controller::new();
    let dir = &controller.dir.0;
    let key = dir.join("webhook.key");
    std::fs::write(&key, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(dir.join("webhook-ca.pem"), ca_pem).unwrap();
    let config = dir.join("controller.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        format!(
            "{text}{extra}\n[notify]\n{notify}\n[notify.webhook]\nurl = \"https://localhost:{}/hooks/certistack?team=ops\"\nhmac_key_file = \"webhook.key\"\nca_file = \"webhook-ca.pem\"\n",
            receiver.api.port
        ),
    )
    .unwrap();
    controller
}

/// The receiver's check as `docs/history.md` ("Webhook") gives it, taken from there.
fn documented_check() -> String {
    let doc = std::fs::read_to_string(workspace_root().join("docs/history.md")).unwrap();
    let webhook = doc.split("## Webhook").nth(1).unwrap();
    let code = webhook
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/history.md, Webhook: the receiver's check in a python block");
    code.to_owned()
}

/// Whether the receiver's documented check accepts `request`.
fn receiver_accepts(request: &serde_json::Value) -> bool {
    let script = format!(
        "{}\nimport json, sys\nrequest = json.load(sys.stdin)\nsys.exit(0 if genuine(sys.argv[1].encode(), request['headers'], request['body'].encode()) else 1)\n",
        documented_check()
    );
    let mut child = std::process::Command::new("python3")
        .args(["-c", &script, KEY])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    child.wait().unwrap().success()
}

fn plan_run_id(request: &serde_json::Value) -> String {
    let body: serde_json::Value = serde_json::from_str(request["body"].as_str().unwrap()).unwrap();
    body["plan_run_id"].as_str().unwrap().to_owned()
}

#[test]
fn a_failing_run_sends_one_signed_webhook_and_records_its_delivery() {
    let pki = api_server_pki(&["localhost"]);
    let receiver = Receiver::start(&pki, serde_json::json!({}));
    let controller = notifying(&receiver, &pki.ca_pem, "", "");
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "the run's own exit code: {out}{err}");
    assert!(
        out.contains("notify: webhook failure delivered to https://localhost:"),
        "{out}"
    );
    let requests = receiver.requests();
    assert_eq!(requests.len(), 1, "exactly one message: {requests:#?}");
    let request = &requests[0];
    assert_eq!(request["method"], "POST");
    assert_eq!(request["path"], "/hooks/certistack?team=ops");
    assert_eq!(request["headers"]["content-type"], "application/json");
    assert!(receiver_accepts(request), "{request:#}");
    // A tampered body or timestamp does not check.
    let mut tampered = request.clone();
    tampered["body"] =
        serde_json::json!(request["body"].as_str().unwrap().replace("web01", "web02"));
    assert!(!receiver_accepts(&tampered));
    let mut replayed = request.clone();
    replayed["headers"]["x-certistack-timestamp"] = serde_json::json!("1");
    assert!(!receiver_accepts(&replayed));
    let mut garbled = request.clone();
    garbled["headers"]["x-certistack-timestamp"] = serde_json::json!("soon");
    assert!(
        !receiver_accepts(&garbled),
        "a malformed timestamp is refused, not an exception"
    );
    // The URL's path (a receiver's token, for some) is in no output.
    assert!(!out.contains("/hooks/certistack"), "{out}");

    let body: serde_json::Value = serde_json::from_str(request["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["type"], "certistack.run.failure", "{body:#}");
    assert_eq!(body["plan"], "nightly.yaml");
    assert_eq!(body["counts"]["error"], 1);
    let failed = &body["validations"][0];
    assert_eq!(failed["validation"], "web01");
    assert_eq!(failed["source_vmid"], 100);
    assert_eq!(failed["node"], "pve1");
    assert_eq!(failed["verdict"], "error");
    assert_eq!(failed["step"], "doctor");
    assert!(
        failed["reasons"][0].as_str().unwrap().contains("pve1"),
        "{failed}"
    );
    let report = failed["report"].as_str().unwrap();
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        std::fs::read(report).unwrap(),
    ));
    assert_eq!(failed["report_sha256"], digest.as_str());
    // The key is in no output, body or header.
    let everything = format!(
        "{out}{err}{}",
        std::fs::read_to_string(receiver.api.tls_dir().join("requests.log")).unwrap()
    );
    assert!(!everything.contains(KEY), "the HMAC key leaked");

    let store = SqliteStore::open(&controller.history_file(), Duration::from_secs(2)).unwrap();
    let deliveries = store.deliveries_of(&plan_run_id(request)).unwrap();
    assert_eq!(deliveries.len(), 1, "{deliveries:?}");
    assert!(
        deliveries[0].delivered && deliveries[0].attempts == 1,
        "{deliveries:?}"
    );
    assert_eq!(
        (deliveries[0].channel.as_str(), deliveries[0].kind.as_str()),
        ("webhook", "failure")
    );
}

#[test]
fn a_receiver_that_keeps_failing_gets_bounded_tries_a_recorded_failure_and_the_runs_exit_code() {
    let pki = api_server_pki(&["localhost"]);
    let receiver = Receiver::start(&pki, serde_json::json!({"fail_first": 100, "status": 503}));
    let controller = notifying(
        &receiver,
        &pki.ca_pem,
        "",
        "\n[outputs]\nmetrics_textfile = \"certistack.prom\"\n",
    );
    let started = std::time::Instant::now();
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "unchanged by the failed delivery: {out}{err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "bounded: {:?}",
        started.elapsed()
    );
    assert!(
        out.contains("notify: webhook failure NOT delivered"),
        "{out}"
    );
    assert!(
        out.contains("after 3 tries") && out.contains("503"),
        "{out}"
    );
    let requests = receiver.requests();
    assert_eq!(requests.len(), 3, "three tries: {requests:#?}");
    // Each try signed anew, each accepted by the receiver's check.
    assert!(requests.iter().all(receiver_accepts));
    let store = SqliteStore::open(&controller.history_file(), Duration::from_secs(2)).unwrap();
    let delivery = &store.deliveries_of(&plan_run_id(&requests[0])).unwrap()[0];
    assert!(
        !delivery.delivered && delivery.attempts == 3,
        "{delivery:?}"
    );
    assert!(
        delivery.last_error.as_deref().unwrap().contains("503"),
        "{delivery:?}"
    );
    let metrics = std::fs::read_to_string(controller.dir.0.join("certistack.prom")).unwrap();
    assert!(
        metrics.contains("\ncertistack_run_notification_failures 1\n"),
        "{metrics}"
    );
}

#[test]
fn a_receiver_the_configured_ca_did_not_sign_gets_nothing_and_summary_mode_sends_a_summary() {
    let pki = api_server_pki(&["localhost"]);
    let receiver = Receiver::start(&pki, serde_json::json!({}));
    let other = api_server_pki(&["localhost"]);
    let controller = notifying(&receiver, &other.ca_pem, "", "");
    let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "{err}");
    assert!(out.contains("NOT delivered"), "{out}");
    assert!(out.contains("does not chain to the CA"), "{out}");
    assert!(receiver.requests().is_empty(), "nothing reached it");

    // Summary only: one summary, no failure message.
    let controller = notifying(&receiver, &pki.ca_pem, "on = [\"summary\"]", "");
    let (code, _, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 2, "{err}");
    let requests = receiver.requests();
    assert_eq!(requests.len(), 1, "{requests:#?}");
    let body: serde_json::Value =
        serde_json::from_str(requests[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["type"], "certistack.run.summary");
    assert_eq!(body["validations"].as_array().unwrap().len(), 1);

    // A key too short, or readable by others, refuses the run before anything.
    let key = controller.dir.0.join("webhook.key");
    std::fs::write(&key, "short\n").unwrap();
    let (code, _, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("give at least 16"), "{err}");
    std::fs::write(&key, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, _, err) = controller.ctl(&["run", "nightly.yaml"]);
    assert_ne!(code, 2, "refused before the run: {err}");
    assert!(err.contains("webhook.key"), "{err}");
}

const SMTP_PASSWORD: &str = "mail-secret-5f1e9c2a";

#[test]
fn a_failing_run_sends_one_mail_over_starttls_or_tls_with_auth_plain_and_no_secret_in_it() {
    let pki = api_server_pki(&["localhost"]);
    for mode in ["starttls", "tls"] {
        let secrets = TempDir::new("smtp-secrets");
        let server_password = secrets.0.join("password");
        std::fs::write(&server_password, format!("{SMTP_PASSWORD}\n")).unwrap();
        let smtp = ApiDouble::start_in(
            "smtp-receiver",
            &pki,
            &[
                "--mode".into(),
                mode.into(),
                "--user".into(),
                "certistack".into(),
                "--password-file".into(),
                server_password.clone().into_os_string(),
            ],
            "--root",
            TempDir::new("smtp-receiver"),
        );
        let controller = Controller::new();
        let dir = &controller.dir.0;
        let password = dir.join("smtp-password");
        std::fs::write(&password, format!("{SMTP_PASSWORD}\n")).unwrap();
        std::fs::set_permissions(&password, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(dir.join("smtp-ca.pem"), &pki.ca_pem).unwrap();
        let config = dir.join("controller.toml");
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            format!(
                "{text}\n[notify]\n[notify.smtp]\nhost = \"localhost\"\nport = {}\nsecurity = \"{mode}\"\nuser = \"certistack\"\npassword_file = \"smtp-password\"\nfrom = \"certistack@example.net\"\nto = [\"ops@example.net\", \"backup-team@example.net\"]\nca_file = \"smtp-ca.pem\"\n",
                smtp.port
            ),
        )
        .unwrap();
        let (code, out, err) = controller.ctl(&["run", "nightly.yaml"]);
        assert_eq!(code, 2, "{mode}: {out}{err}");
        assert!(
            out.contains("notify: email failure delivered to smtp://localhost:"),
            "{mode}: {out}"
        );
        let log =
            |name: &str| std::fs::read_to_string(smtp.tls_dir().join(name)).unwrap_or_default();
        let messages: Vec<serde_json::Value> = log("messages.log")
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(messages.len(), 1, "{mode}: exactly one mail: {messages:#?}");
        let mail = &messages[0];
        assert_eq!(mail["tls"], true, "{mode}");
        assert_eq!(mail["auth_user"], "certistack", "{mode}");
        assert_eq!(mail["mail_from"], "certistack@example.net");
        assert_eq!(
            mail["rcpt_to"],
            serde_json::json!(["ops@example.net", "backup-team@example.net"])
        );
        let data = mail["data"].as_str().unwrap();
        eprintln!("{mode}: the mail as received:\n{data}");
        assert!(
            data.contains("Subject: CertiStack: 0 failed, 1 erred in nightly.yaml"),
            "{data}"
        );
        assert!(
            data.contains("web01 (VM 100) on pve1: error at step doctor"),
            "{data}"
        );
        assert!(data.contains("report /"), "{data}");
        let everything = format!("{out}{err}{}{}", log("messages.log"), log("sessions.log"));
        assert!(
            !everything.contains(SMTP_PASSWORD),
            "{mode}: the password leaked"
        );
        let store = SqliteStore::open(&controller.history_file(), Duration::from_secs(2)).unwrap();
        let summaries = store.vm_summaries(i64::MAX / 2).unwrap();
        assert_eq!(summaries.len(), 1);
        let run = store
            .validations_of(100, None, 1, i64::MAX / 2)
            .unwrap()
            .validations[0]
            .plan_run_id
            .clone();
        let deliveries = store.deliveries_of(&run).unwrap();
        assert_eq!(deliveries.len(), 1, "{deliveries:?}");
        assert_eq!(deliveries[0].channel, "email");
        assert!(deliveries[0].delivered, "{deliveries:?}");
    }
}
