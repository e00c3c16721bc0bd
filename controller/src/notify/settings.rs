//! `[notify]` of the controller configuration: when to tell someone, and through what.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Where a webhook's server certificate is checked when the configuration names neither a CA
/// file nor a fingerprint: Debian's bundle of the system's trusted CAs (`ca-certificates`).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// `[notify]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifyFile {
    #[serde(default)]
    on: Option<Vec<String>>,
    #[serde(default)]
    webhook: Option<WebhookFile>,
    #[serde(default)]
    smtp: Option<SmtpFile>,
}

/// `[notify.smtp]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmtpFile {
    host: String,
    #[serde(default)]
    port: Option<u16>,
    security: String,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    password_file: Option<PathBuf>,
    from: String,
    to: Vec<String>,
    #[serde(default)]
    ca_file: Option<PathBuf>,
}

/// `[notify.webhook]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookFile {
    url: String,
    hmac_key_file: PathBuf,
    #[serde(default)]
    ca_file: Option<PathBuf>,
    #[serde(default)]
    fingerprint: Option<String>,
}

/// When a run tells someone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Triggers {
    /// A validation failed: its backup did not restore.
    pub failure: bool,
    /// A validation erred: nothing was proven about its backup.
    pub error: bool,
    /// After every run, a summary of all its validations.
    pub summary: bool,
}

/// `[notify]` checked.
#[derive(Debug, Clone, PartialEq)]
pub struct NotifySettings {
    pub on: Triggers,
    pub webhook: Option<WebhookSettings>,
    pub smtp: Option<SmtpSettings>,
}

/// How the SMTP connection is secured: always TLS, verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpSecurity {
    /// Plain connection upgraded with STARTTLS before anything else (submission, port 587);
    /// a server that does not offer it is refused.
    StartTls,
    /// TLS from the first byte (submissions, port 465).
    Tls,
}

/// Recipients of one message at most.
pub const MAX_RECIPIENTS: usize = 32;

/// `[notify.smtp]` checked.
#[derive(Debug, Clone, PartialEq)]
pub struct SmtpSettings {
    pub host: String,
    pub port: u16,
    pub security: SmtpSecurity,
    /// The user and the file holding its password, when the server wants AUTH.
    pub login: Option<(String, PathBuf)>,
    pub from: String,
    pub to: Vec<String>,
    /// The CA the server's certificate must chain to: this file, or the system's bundle.
    pub ca_file: PathBuf,
}

/// `[notify.webhook]` checked.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookSettings {
    /// The URL as written, for messages.
    pub url: String,
    pub host: String,
    pub port: u16,
    pub path_and_query: String,
    pub hmac_key_file: PathBuf,
    /// The CA file, or the system's bundle when neither it nor a fingerprint is given.
    pub ca_file: Option<PathBuf>,
    pub fingerprint: Option<[u8; 32]>,
}

/// `[notify]` checked; relative file names are read from the configuration's directory.
pub fn settings(file: NotifyFile, base: &Path) -> Result<NotifySettings, String> {
    let words = file
        .on
        .unwrap_or_else(|| vec!["failure".into(), "error".into()]);
    let mut on = Triggers {
        failure: false,
        error: false,
        summary: false,
    };
    for word in &words {
        match word.as_str() {
            "failure" => on.failure = true,
            "error" => on.error = true,
            "summary" => on.summary = true,
            other => {
                return Err(format!(
                    "notify.on: {other:?} is not a trigger; write any of \"failure\", \"error\", \"summary\""
                ));
            }
        }
    }
    let webhook = file
        .webhook
        .map(|webhook| webhook_settings(webhook, base))
        .transpose()?;
    let smtp = file
        .smtp
        .map(|smtp| smtp_settings(smtp, base))
        .transpose()?;
    if webhook.is_none() && smtp.is_none() {
        return Err(
            "[notify] names no channel: add [notify.webhook] or [notify.smtp], or remove [notify]"
                .into(),
        );
    }
    Ok(NotifySettings { on, webhook, smtp })
}

fn smtp_settings(file: SmtpFile, base: &Path) -> Result<SmtpSettings, String> {
    let security = match file.security.as_str() {
        "starttls" => SmtpSecurity::StartTls,
        "tls" => SmtpSecurity::Tls,
        other => {
            return Err(format!(
                "notify.smtp.security: {other:?}: write \"starttls\" (port 587) or \"tls\" (port 465); mail is never sent in the clear"
            ));
        }
    };
    if file.host.is_empty() || file.host.contains(['/', '@', ' ', ':']) {
        return Err(format!(
            "notify.smtp.host: {:?} is not a host name; write the server's name as its certificate names it",
            file.host
        ));
    }
    let login = match (file.user, file.password_file) {
        (Some(user), Some(password)) => Some((user, base.join(password))),
        (None, None) => None,
        _ => {
            return Err(
                "notify.smtp: user and password_file go together (AUTH PLAIN over TLS), or neither"
                    .into(),
            );
        }
    };
    if file.to.is_empty() || file.to.len() > MAX_RECIPIENTS {
        return Err(format!(
            "notify.smtp.to: give 1 to {MAX_RECIPIENTS} addresses, not {}",
            file.to.len()
        ));
    }
    for address in std::iter::once(&file.from).chain(&file.to) {
        address.parse::<lettre::Address>().map_err(|error| {
            format!("notify.smtp: {address:?} is not an e-mail address: {error}")
        })?;
    }
    Ok(SmtpSettings {
        port: file.port.unwrap_or(match security {
            SmtpSecurity::StartTls => 587,
            SmtpSecurity::Tls => 465,
        }),
        host: file.host,
        security,
        login,
        from: file.from,
        to: file.to,
        ca_file: file
            .ca_file
            .map_or_else(|| PathBuf::from(SYSTEM_CA_BUNDLE), |path| base.join(path)),
    })
}

fn webhook_settings(file: WebhookFile, base: &Path) -> Result<WebhookSettings, String> {
    let expected = "write it as https://HOST[:PORT]/PATH";
    let uri: http::Uri = file.url.parse().map_err(|_| {
        format!(
            "notify.webhook.url: {:?} is not a URL; {expected}",
            file.url
        )
    })?;
    if uri.scheme_str() != Some("https") {
        return Err(format!(
            "notify.webhook.url: {:?} is not https://, and the webhook is always sent over verified TLS; {expected}",
            file.url
        ));
    }
    let authority = uri.authority().ok_or_else(|| {
        format!(
            "notify.webhook.url: {:?} names no host; {expected}",
            file.url
        )
    })?;
    if authority.as_str().contains('@') {
        return Err(format!(
            "notify.webhook.url: {:?} carries credentials; the message is signed with hmac_key_file instead",
            file.url
        ));
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let fingerprint = file
        .fingerprint
        .as_deref()
        .map(certistack_core::tls::parse_fingerprint)
        .transpose()
        .map_err(|reason| format!("notify.webhook.fingerprint: {reason}"))?;
    let ca_file = match (&file.ca_file, fingerprint) {
        (Some(path), _) => Some(base.join(path)),
        (None, Some(_)) => None,
        (None, None) => Some(PathBuf::from(SYSTEM_CA_BUNDLE)),
    };
    Ok(WebhookSettings {
        url: file.url.clone(),
        host,
        port: authority.port_u16().unwrap_or(443),
        path_and_query: uri
            .path_and_query()
            .map_or("/".into(), |path| path.as_str().to_owned()),
        hmac_key_file: base.join(&file.hmac_key_file),
        ca_file,
        fingerprint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NotifySettings, String> {
        let file: NotifyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        settings(file, Path::new("/etc/certistack-ctl"))
    }

    #[test]
    fn a_webhook_is_https_signed_and_verified_by_the_system_cas_unless_told_otherwise() {
        let settings = parse(
            "[webhook]\nurl = \"https://hooks.example.net:8443/certistack?team=ops\"\nhmac_key_file = \"webhook.key\"\n",
        )
        .unwrap();
        assert_eq!(
            settings.on,
            Triggers {
                failure: true,
                error: true,
                summary: false
            }
        );
        let webhook = settings.webhook.unwrap();
        assert_eq!(
            (
                webhook.host.as_str(),
                webhook.port,
                webhook.path_and_query.as_str()
            ),
            ("hooks.example.net", 8443, "/certistack?team=ops")
        );
        assert_eq!(
            webhook.ca_file.as_deref(),
            Some(Path::new(SYSTEM_CA_BUNDLE))
        );
        assert_eq!(
            webhook.hmac_key_file,
            Path::new("/etc/certistack-ctl/webhook.key")
        );
        for (text, expected) in [
            ("url = \"http://hooks.example.net/\"", "not https://"),
            (
                "url = \"https://user:pw@hooks.example.net/\"",
                "carries credentials",
            ),
            ("url = \"https:///x\"", "notify.webhook.url"),
        ] {
            let error = parse(&format!("[webhook]\n{text}\nhmac_key_file = \"k\"\n")).unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
        }
        let error = parse("on = [\"failures\"]\n").unwrap_err();
        assert!(error.contains("is not a trigger"), "{error}");
        let error = parse("on = [\"failure\"]\n").unwrap_err();
        assert!(error.contains("names no channel"), "{error}");
    }
}
