//! The controller's configuration: where its keys and reports live, and the nodes it may drive.
//!
//! The file steers trust (it names the state directory holding the CA and the nodes a run may
//! reach), so it is read only when nobody else can write it, and every key is known: a misspelt
//! key is refused with its line and column rather than silently ignored.

use certistack_core::files::{self, FileError};
use certistack_core::validate::{Host, NodeName, Validated};
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
        Ok(Self {
            state_dir: file.state_dir,
            reports_dir: file.reports_dir,
            nodes,
        })
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
    fn line_and_column_count_characters() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("é\nx", 3), (2, 1));
    }
}
