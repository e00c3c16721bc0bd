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
    Ok(NotifySettings { on, webhook })
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
    }
}
