//! The e-mail: the same message as the webhook, as text for a person, sent by SMTP over TLS
//! (STARTTLS or TLS from the first byte, never in the clear) verified by a CA file or the
//! system's CAs, with AUTH PLAIN when a user is configured (`lettre`, on rustls with ring).

use super::Message;
use super::settings::{SmtpSecurity, SmtpSettings};
use certistack_core::{files, tls};
use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{Certificate, CertificateStore, Tls, TlsParameters};
use lettre::{AsyncSmtpTransport, AsyncTransport, Tokio1Executor};
use std::fmt::Write as _;
use std::time::Duration;

/// An SMTP server ready to take messages.
pub struct Email {
    transport: AsyncSmtpTransport<Tokio1Executor>,
    from: lettre::message::Mailbox,
    to: Vec<lettre::message::Mailbox>,
    /// `smtp://host:port` and how it is secured, for messages.
    pub server: String,
}

impl std::fmt::Debug for Email {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Email")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl Email {
    /// Reads the password and the CA and builds the transport; contacts nothing.
    pub fn new(settings: &SmtpSettings) -> Result<Self, String> {
        let pem = files::read_trusted(&settings.ca_file)
            .map_err(|error| format!("notify.smtp.ca_file: {error}"))?;
        // Parsed as the other TLS clients parse a CA file, then handed to lettre.
        let certificates = tls::parse_certificates(&pem, "the CA file").map_err(|error| {
            format!(
                "notify.smtp.ca_file: {}: {error}",
                settings.ca_file.display()
            )
        })?;
        let mut parameters =
            TlsParameters::builder(settings.host.clone()).certificate_store(CertificateStore::None);
        for der in certificates {
            let certificate = Certificate::from_der(der.to_vec()).map_err(|error| {
                format!(
                    "notify.smtp.ca_file: {}: {error}",
                    settings.ca_file.display()
                )
            })?;
            parameters = parameters.add_root_certificate(certificate);
        }
        let parameters = parameters
            .build_rustls()
            .map_err(|error| format!("notify.smtp: {error}"))?;
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(&settings.host)
            .port(settings.port)
            .timeout(Some(Duration::from_secs(15)))
            .tls(match settings.security {
                SmtpSecurity::StartTls => Tls::Required(parameters),
                SmtpSecurity::Tls => Tls::Wrapper(parameters),
            });
        if let Some((user, password_file)) = &settings.login {
            let password = files::read_secret_line(password_file, "the SMTP password")
                .map_err(|error| format!("notify.smtp.password_file: {error}"))?;
            builder = builder
                .credentials(Credentials::new(user.clone(), password.to_string()))
                .authentication(vec![Mechanism::Plain]);
        }
        let mailbox = |address: &str| {
            address
                .parse::<lettre::message::Mailbox>()
                .map_err(|error| format!("notify.smtp: {address:?}: {error}"))
        };
        Ok(Self {
            transport: builder.build(),
            from: mailbox(&settings.from)?,
            to: settings
                .to
                .iter()
                .map(|to| mailbox(to))
                .collect::<Result<_, _>>()?,
            server: format!(
                "smtp://{}:{} ({})",
                settings.host,
                settings.port,
                match settings.security {
                    SmtpSecurity::StartTls => "STARTTLS",
                    SmtpSecurity::Tls => "TLS",
                }
            ),
        })
    }

    /// Sends `message` once.
    pub async fn send(&self, message: &Message) -> Result<(), String> {
        let (subject, text) = render(message);
        let mut builder = lettre::Message::builder()
            .from(self.from.clone())
            .subject(subject)
            .header(lettre::message::header::ContentType::TEXT_PLAIN);
        for to in &self.to {
            builder = builder.to(to.clone());
        }
        let mail = builder.body(text).map_err(|error| error.to_string())?;
        self.transport
            .send(mail)
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    }
}

/// A message's body as the e-mail reads it back (what `super::messages` wrote).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct Parsed {
    plan: String,
    plan_sha256: String,
    plan_run_id: String,
    counts: Counts,
    validations: Vec<Entry>,
    left_out: u64,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct Counts {
    passed: u64,
    failed: u64,
    error: u64,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct Entry {
    validation: String,
    source_vmid: u32,
    node: String,
    verdict: String,
    step: Option<String>,
    reasons: Vec<String>,
    report: Option<String>,
    report_sha256: Option<String>,
}

/// The subject and text of `message` for a person: one paragraph per validation.
pub fn render(message: &Message) -> (String, String) {
    let body: Parsed = serde_json::from_str(&message.body).unwrap_or_default();
    let (plan, counts) = (&body.plan, &body.counts);
    let subject = match message.kind {
        "failure" => format!(
            "CertiStack: {} failed, {} erred in {plan}",
            counts.failed, counts.error
        ),
        _ => format!(
            "CertiStack: {} passed, {} failed, {} erred in {plan}",
            counts.passed, counts.failed, counts.error
        ),
    };
    let mut text = format!(
        "Plan {plan} ({}), run {}.\n\n",
        body.plan_sha256, body.plan_run_id
    );
    for entry in &body.validations {
        let _ = writeln!(
            text,
            "{} (VM {}) on {}: {}{}",
            entry.validation,
            entry.source_vmid,
            entry.node,
            entry.verdict,
            entry
                .step
                .as_deref()
                .map(|step| format!(" at step {step}"))
                .unwrap_or_default()
        );
        for reason in &entry.reasons {
            let _ = writeln!(text, "  {reason}");
        }
        if let Some(report) = &entry.report {
            let _ = writeln!(
                text,
                "  report {report} (sha256 {})",
                entry.report_sha256.as_deref().unwrap_or("?")
            );
        }
        text.push('\n');
    }
    if body.left_out > 0 {
        let _ = writeln!(
            text,
            "and {} more (see `certistack-ctl history`).",
            body.left_out
        );
    }
    (subject, text)
}
