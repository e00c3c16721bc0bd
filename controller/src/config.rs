//! The controller's configuration: where its keys and reports live, and the nodes it may drive.
//!
//! The file steers trust (it names the state directory holding the CA and the nodes a run may
//! reach), so it is read only when nobody else can write it, and every key is known: a misspelt
//! key is refused with its line and column rather than silently ignored.

use certistack_core::files::{self, FileError};
use certistack_core::validate::{Host, NodeName, Validated, Vmid};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where `certistack-ctl` looks when `--config` is not given.
pub const DEFAULT_CONFIG: &str = "/etc/certistack/controller.toml";
/// A controller configuration is a few hundred lines at most; anything larger is a mistake.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;
/// The largest inventory one controller drives.
pub const MAX_NODES: usize = 1024;
/// Labels per node, and the longest label key or value.
pub const MAX_LABELS: usize = 32;
pub const MAX_LABEL_LEN: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path} is {size} bytes; a controller configuration is at most {MAX_CONFIG_BYTES}")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{path}:{line}:{column}: {reason}")]
    Parse {
        path: PathBuf,
        line: usize,
        column: usize,
        reason: String,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    state_dir: PathBuf,
    reports_dir: PathBuf,
    #[serde(default)]
    nodes: Vec<NodeFile>,
    #[serde(default)]
    pve: Option<PveFile>,
    #[serde(default)]
    outputs: Option<OutputsFile>,
    #[serde(default)]
    notify: Option<crate::notify::settings::NotifyFile>,
}

/// `[outputs]`: what the controller writes beside its reports after each run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputsFile {
    #[serde(default)]
    metrics_textfile: Option<PathBuf>,
}

/// `[pve]`: how the controller reaches the Proxmox VE API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct PveFile {
    api_url: String,
    token_id: String,
    token_secret_file: PathBuf,
    #[serde(default)]
    ca_file: Option<PathBuf>,
    #[serde(default)]
    fingerprint: Option<String>,
    #[serde(default)]
    sandbox_vmid_range: Option<String>,
}

/// The port pveproxy serves the API on.
pub const DEFAULT_PVE_API_PORT: u16 = 8006;

/// The Proxmox VE API as the configuration names it: where it is, which token speaks for the
/// controller (its secret stays in its file until a client is built), and how its certificate
/// is verified: a CA file, a pinned SHA-256 fingerprint of the leaf, or both (then both must
/// match). A configuration with neither is refused: there is no way to skip verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PveSettings {
    pub host: String,
    pub port: u16,
    /// `USER@REALM!TOKENID`.
    pub token_id: String,
    pub token_secret_file: PathBuf,
    pub ca_file: Option<PathBuf>,
    pub fingerprint: Option<[u8; 32]>,
    /// `sandbox_vmid_range = "LOW-HIGH"`: where a sandbox VM the plan leaves without a VMID
    /// takes one (the first the cluster does not use).
    pub sandbox_vmid_range: Option<(Vmid, Vmid)>,
}

impl PveSettings {
    /// What a client of the API is built from.
    pub fn endpoint(&self) -> crate::api::pve::PveEndpoint<'_> {
        crate::api::pve::PveEndpoint {
            host: &self.host,
            port: self.port,
            token_id: &self.token_id,
            token_secret_file: &self.token_secret_file,
            ca_file: self.ca_file.as_deref(),
            fingerprint: self.fingerprint,
        }
    }
}

/// The most VMIDs `sandbox_vmid_range` may span: enough for every sandbox VM of many plans,
/// few enough that looking for a free one stays a short walk.
pub const MAX_SANDBOX_VMID_RANGE: u32 = 100_000;

/// `LOW-HIGH`, both VMIDs Proxmox VE accepts, LOW ≤ HIGH, at most [`MAX_SANDBOX_VMID_RANGE`].
fn parse_vmid_range(text: &str) -> Result<(Vmid, Vmid), String> {
    let expected = "write it as LOW-HIGH, e.g. \"990000-990999\": VMIDs no one else allocates";
    let (low, high) = text
        .split_once('-')
        .ok_or_else(|| format!("{text:?} is not a range; {expected}"))?;
    let vmid = |part: &str| {
        part.trim()
            .parse::<u32>()
            .ok()
            .and_then(|n| Vmid::parse("sandbox_vmid_range", n).ok())
            .ok_or_else(|| {
                format!(
                    "{part:?} is not a VMID ({}..={}); {expected}",
                    Vmid::MIN,
                    Vmid::MAX
                )
            })
    };
    let (low, high) = (vmid(low)?, vmid(high)?);
    if low > high {
        return Err(format!("{text:?} ends before it starts; {expected}"));
    }
    if high.get() - low.get() >= MAX_SANDBOX_VMID_RANGE {
        return Err(format!(
            "{text:?} spans more than {MAX_SANDBOX_VMID_RANGE} VMIDs; {expected}"
        ));
    }
    Ok((low, high))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeFile {
    name: String,
    address: String,
    port: u16,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// A node of the inventory: its name (which its certificate must carry) and where it listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryNode {
    pub name: NodeName,
    pub address: Host,
    pub port: u16,
    pub labels: BTreeMap<String, String>,
}

impl InventoryNode {
    /// `HOST:PORT` as a connection address, IPv6 in brackets.
    pub fn endpoint(&self) -> String {
        match &self.address {
            Host::Ip(std::net::IpAddr::V6(ip)) => format!("[{ip}]:{}", self.port),
            host => format!("{host}:{}", self.port),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub state_dir: PathBuf,
    pub reports_dir: PathBuf,
    pub nodes: BTreeMap<NodeName, InventoryNode>,
    /// `[pve]`, when the controller is to speak to the Proxmox VE API.
    pub pve: Option<PveSettings>,
    /// `[outputs] metrics_textfile`: node_exporter's textfile, written after each run.
    pub metrics_textfile: Option<PathBuf>,
    /// `[notify]`: who is told of a run, and when.
    pub notify: Option<crate::notify::settings::NotifySettings>,
}

impl ControllerConfig {
    /// Reads the file after checking nobody else can write it, then parses and checks it.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let size = std::fs::metadata(path)
            .map_err(|error| FileError::Read {
                path: path.to_owned(),
                error,
            })?
            .len();
        if size > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge {
                path: path.to_owned(),
                size,
            });
        }
        let text = files::read_trusted(path)?;
        Self::parse(path, &text)
    }

    /// Parses configuration text; `path` only names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let file: ConfigFile = toml::from_str(text).map_err(|error| {
            let (line, column) = error
                .span()
                .map_or((1, 1), |span| line_column(text, span.start));
            ConfigError::Parse {
                path: path.to_owned(),
                line,
                column,
                reason: error.message().to_owned(),
            }
        })?;
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.to_owned(),
            reason,
        };
        if file.nodes.len() > MAX_NODES {
            return Err(invalid(format!(
                "the inventory lists {} nodes; at most {MAX_NODES}",
                file.nodes.len()
            )));
        }
        let mut nodes = BTreeMap::new();
        for (index, node) in file.nodes.into_iter().enumerate() {
            let at = format!("nodes[{index}]");
            let name = NodeName::validate(&node.name)
                .map_err(|reason| invalid(format!("{at}.name: {reason}")))?;
            let address = Host::validate(&node.address)
                .map_err(|reason| invalid(format!("{at}.address: {reason}")))?;
            if node.port == 0 {
                return Err(invalid(format!("{at}.port: 0 is not a port (1..=65535)")));
            }
            if node.labels.len() > MAX_LABELS
                || node.labels.iter().any(|(k, v)| {
                    k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN
                })
            {
                return Err(invalid(format!(
                    "{at}.labels: at most {MAX_LABELS} labels, keys 1..={MAX_LABEL_LEN} bytes, values at most {MAX_LABEL_LEN}"
                )));
            }
            let entry = InventoryNode {
                name: name.clone(),
                address,
                port: node.port,
                labels: node.labels,
            };
            if nodes.insert(name.clone(), entry).is_some() {
                return Err(invalid(format!(
                    "{at}.name: node {name} is listed twice; each node appears once"
                )));
            }
        }
        let base = path.parent().unwrap_or(Path::new("."));
        let pve = file
            .pve
            .map(|pve| pve_settings(pve, base))
            .transpose()
            .map_err(invalid)?;
        let metrics_textfile = file
            .outputs
            .and_then(|outputs| outputs.metrics_textfile)
            .map(|path| {
                // node_exporter's textfile collector reads `*.prom` files only.
                if path.extension().is_none_or(|ext| ext != "prom")
                    || path.file_name().is_none()
                {
                    return Err(invalid(format!(
                        "outputs.metrics_textfile: {} does not end in .prom, and node_exporter's textfile collector reads only *.prom files: name it e.g. /var/lib/prometheus/node-exporter/certistack.prom",
                        path.display()
                    )));
                }
                Ok(base.join(path))
            })
            .transpose()?;
        let notify = file
            .notify
            .map(|notify| crate::notify::settings::settings(notify, base))
            .transpose()
            .map_err(invalid)?;
        Ok(Self {
            state_dir: file.state_dir,
            reports_dir: file.reports_dir,
            nodes,
            pve,
            metrics_textfile,
            notify,
        })
    }
}

/// `[pve]` checked; relative file names are read from the configuration's directory.
fn pve_settings(pve: PveFile, base: &Path) -> Result<PveSettings, String> {
    let (host, port) =
        parse_api_url(&pve.api_url).map_err(|reason| format!("pve.api_url: {reason}"))?;
    check_token_id(&pve.token_id).map_err(|reason| format!("pve.token_id: {reason}"))?;
    let fingerprint = pve
        .fingerprint
        .as_deref()
        .map(certistack_core::tls::parse_fingerprint)
        .transpose()
        .map_err(|reason| format!("pve.fingerprint: {reason}"))?;
    if pve.ca_file.is_none() && fingerprint.is_none() {
        return Err("[pve] names neither ca_file nor fingerprint, and the API's certificate is always verified: set ca_file to the cluster CA (a copy of /etc/pve/pve-root-ca.pem), or fingerprint to the SHA-256 of the certificate pveproxy serves (`pvenode cert info` on the node: the pveproxy-ssl.pem entry if there is one, else pve-ssl.pem; not pve-root-ca.pem), or both".into());
    }
    let sandbox_vmid_range = pve
        .sandbox_vmid_range
        .as_deref()
        .map(parse_vmid_range)
        .transpose()
        .map_err(|reason| format!("pve.sandbox_vmid_range: {reason}"))?;
    Ok(PveSettings {
        host,
        port,
        token_id: pve.token_id,
        token_secret_file: base.join(pve.token_secret_file),
        ca_file: pve.ca_file.map(|file| base.join(file)),
        fingerprint,
        sandbox_vmid_range,
    })
}

/// `https://HOST[:PORT][/]`: the API's host (an IP address or a DNS name) and port (8006 when
/// not given). Anything else (another scheme, a path, credentials in the URL) is refused.
fn parse_api_url(url: &str) -> Result<(String, u16), String> {
    let expected =
        "write it as https://HOST:8006 (the API's host name as its certificate names it)";
    let rest = url
        .get(..8)
        .filter(|scheme| scheme.eq_ignore_ascii_case("https://"))
        .and_then(|_| url.get(8..))
        .ok_or_else(|| format!("{url:?} is not an https:// URL; {expected}"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '@', '?', '#']) || rest.is_empty() {
        return Err(format!(
            "{url:?} carries more than a host and port; {expected}"
        ));
    }
    let (host, port) = match rest.strip_prefix('[') {
        Some(bracketed) => {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or_else(|| format!("{url:?}: an IPv6 address ends with `]`; {expected}"))?;
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(format!(
                    "{url:?}: only an IPv6 address goes in brackets; {expected}"
                ));
            }
            let port = match after {
                "" => None,
                after => Some(after.strip_prefix(':').ok_or_else(|| {
                    format!("{url:?}: after `]` comes `:PORT` or nothing; {expected}")
                })?),
            };
            (host, port)
        }
        None => match rest.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        },
    };
    let port = match port {
        None => DEFAULT_PVE_API_PORT,
        Some(port) => Some(port)
            .filter(|port| {
                !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
            })
            .and_then(|port| port.parse::<u16>().ok())
            .filter(|port| *port != 0)
            .ok_or_else(|| format!("{url:?}: {port:?} is not a port (1..=65535)"))?,
    };
    Host::validate(host).map_err(|reason| format!("{url:?}: the host {reason}"))?;
    Ok((host.to_owned(), port))
}

/// `USER@REALM!TOKENID` as pve-access-control reads an API token's id (`PVE::AccessControl`,
/// `$userid_regex` and `$token_subid_regex`).
fn check_token_id(id: &str) -> Result<(), String> {
    let shape = "write the token's full id, USER@REALM!TOKENID, e.g. certistack@pve!ctl (`pveum user token list USER@REALM`)";
    let (user, token) = id
        .split_once('!')
        .ok_or_else(|| format!("it has no `!TOKENID`; {shape}"))?;
    let (name, realm) = user
        .rsplit_once('@')
        .ok_or_else(|| format!("it has no `@REALM`; {shape}"))?;
    let name_ok = !name.is_empty()
        && name.len() <= 60
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, ':' | '/' | '!'));
    let realm_ok = (2..=32).contains(&realm.len())
        && realm.starts_with(|c: char| c.is_ascii_alphabetic())
        && realm
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    let token_ok = (2..=64).contains(&token.len())
        && token.starts_with(|c: char| c.is_ascii_alphabetic())
        && token
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    if name_ok && realm_ok && token_ok {
        Ok(())
    } else {
        // The id is not quoted back: written as the header writes it (`ID=SECRET`), it ends
        // with the secret.
        Err(format!(
            "this is not a PVE API token id; {shape} (the secret goes in token_secret_file, never here)"
        ))
    }
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
state_dir = "/var/lib/certistack"
reports_dir = "/var/lib/certistack/reports"

[[nodes]]
name = "pve1"
address = "192.0.2.11"
port = 7443
labels = { site = "fra" }

[[nodes]]
name = "pve2"
address = "2001:db8::2"
port = 7443
"#;

    fn parse(text: &str) -> Result<ControllerConfig, ConfigError> {
        ControllerConfig::parse(Path::new("controller.toml"), text)
    }

    #[test]
    fn reads_the_inventory() {
        let config = parse(GOOD).unwrap();
        assert_eq!(config.state_dir, Path::new("/var/lib/certistack"));
        assert_eq!(config.nodes.len(), 2);
        let pve2 = config.nodes.values().nth(1).unwrap();
        assert_eq!(pve2.endpoint(), "[2001:db8::2]:7443");
        let pve1 = config.nodes.values().next().unwrap();
        assert_eq!(pve1.labels.get("site").map(String::as_str), Some("fra"));
    }

    #[test]
    fn unknown_keys_are_refused_with_key_line_and_column() {
        let text = GOOD.replace("port = 7443\nlabels", "port = 7443\nlabel = 1\nlabels");
        let error = parse(&text).unwrap_err().to_string();
        assert!(error.starts_with("controller.toml:9:1: "), "{error}");
        assert!(error.contains("unknown field `label`"), "{error}");
        let error = parse(&format!("stat_dir = \"/x\"\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("controller.toml:1:1: "), "{error}");
        assert!(error.contains("`stat_dir`"), "{error}");
    }

    #[test]
    fn bad_names_and_duplicates_are_refused() {
        let error = parse(&GOOD.replace("\"pve2\"", "\"pve1\""))
            .unwrap_err()
            .to_string();
        assert!(error.contains("listed twice"), "{error}");
        let error = parse(&GOOD.replace("\"pve2\"", "\"pve_2\""))
            .unwrap_err()
            .to_string();
        assert!(error.contains("nodes[1].name"), "{error}");
        let error = parse(&GOOD.replacen("port = 7443", "port = 0", 1))
            .unwrap_err()
            .to_string();
        assert!(error.contains("nodes[0].port"), "{error}");
    }

    #[test]
    fn the_pve_section_names_the_api_its_token_and_how_it_is_trusted() {
        let pve = "\n[pve]\napi_url = \"https://pve.example.net:8006\"\ntoken_id = \"certistack@pve!ctl\"\ntoken_secret_file = \"secrets/pve-token\"\nca_file = \"/etc/certistack/pve-root-ca.pem\"\n";
        let config = ControllerConfig::parse(
            Path::new("/etc/certistack/controller.toml"),
            &format!("{GOOD}{pve}"),
        )
        .unwrap();
        let settings = config.pve.unwrap();
        assert_eq!(
            (settings.host.as_str(), settings.port),
            ("pve.example.net", 8006)
        );
        assert_eq!(
            settings.token_secret_file,
            Path::new("/etc/certistack/secrets/pve-token")
        );
        assert_eq!(settings.fingerprint, None);
        // Without a port, 8006; an IPv6 host in brackets.
        assert_eq!(
            parse_api_url("https://[2001:db8::1]/").unwrap(),
            ("2001:db8::1".into(), 8006)
        );
        for (url, reason) in [
            ("http://pve:8006", "not an https:// URL"),
            ("https://pve:8006/api2/json", "more than a host and port"),
            ("https://root@pve:8006", "more than a host and port"),
            ("https://pve:0", "not a port"),
            ("https://pve:99999", "not a port"),
            ("https://pve..example:8006", "the host"),
            ("https://[::1]x:8006", "after `]`"),
            ("https://[::1]]:8006", "after `]`"),
            ("https://[localhost]:8006", "only an IPv6 address"),
            ("https://pve:+8006", "not a port"),
        ] {
            let error = parse(&format!(
                "{GOOD}{}",
                pve.replace("https://pve.example.net:8006", url)
            ))
            .unwrap_err()
            .to_string();
            assert!(
                error.contains("pve.api_url") && error.contains(reason),
                "{url}: {error}"
            );
        }
        for id in [
            "certistack@pve",
            "certistack!ctl",
            "certistack@pve!",
            "a b@pve!ctl",
            "certistack@p!ctl",
            "certistack@pve!ctl=0b1e5c1e-secret",
        ] {
            let error = parse(&format!("{GOOD}{}", pve.replace("certistack@pve!ctl", id)))
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("pve.token_id") && error.contains("USER@REALM!TOKENID"),
                "{id}: {error}"
            );
        }
        // The secret written into the id is not quoted back.
        let error = parse(&format!(
            "{GOOD}{}",
            pve.replace("certistack@pve!ctl", "certistack@pve!ctl=0b1e5c1e-secret")
        ))
        .unwrap_err()
        .to_string();
        assert!(!error.contains("0b1e5c1e"), "{error}");
        // A user name may hold `@` (an e-mail address in an OpenID or LDAP realm); the scheme
        // may be written in capitals.
        let email = parse(&format!(
            "{GOOD}{}",
            pve.replace("certistack@pve!ctl", "alice@example.com@oidc!ctl")
                .replace("https://", "HTTPS://")
        ))
        .unwrap();
        assert_eq!(email.pve.unwrap().token_id, "alice@example.com@oidc!ctl");
        // Neither a CA nor a pin: refused, saying how to give one.
        let error = parse(&format!(
            "{GOOD}{}",
            pve.replace("ca_file = \"/etc/certistack/pve-root-ca.pem\"\n", "")
        ))
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("neither ca_file nor fingerprint")
                && error.contains("pvenode cert info"),
            "{error}"
        );
        // A pin, in either spelling.
        let colons = (0..32)
            .map(|i| format!("{i:02X}"))
            .collect::<Vec<_>>()
            .join(":");
        let bare = colons.replace(':', "").to_lowercase();
        for pin in [colons.as_str(), bare.as_str()] {
            let config = parse(&format!("{GOOD}{pve}fingerprint = \"{pin}\"\n")).unwrap();
            assert_eq!(config.pve.unwrap().fingerprint.unwrap()[31], 31);
        }
        let error = parse(&format!("{GOOD}{pve}fingerprint = \"AB:CD\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("pve.fingerprint") && error.contains("32 bytes"),
            "{error}"
        );
    }

    #[test]
    fn line_and_column_count_characters() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("é\nx", 3), (2, 1));
    }
}
