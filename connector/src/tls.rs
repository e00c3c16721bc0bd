//! The connector's side of TLS: the server configuration new handshakes use, reloadable. The
//! profiles themselves are in [`certistack_core::tls`]; accepting connections is
//! [`crate::connection`]'s.

use rustls::ServerConfig;
use std::sync::Arc;

/// The server configuration new handshakes use. A reload replaces it whole; handshakes that
/// already started, and connections already made, keep the configuration they started with.
#[derive(Debug, Clone)]
pub struct SharedServerConfig(Arc<std::sync::RwLock<Arc<ServerConfig>>>);

impl SharedServerConfig {
    pub fn new(config: Arc<ServerConfig>) -> Self {
        Self(Arc::new(std::sync::RwLock::new(config)))
    }

    /// The configuration for the next handshake.
    pub fn current(&self) -> Arc<ServerConfig> {
        // A writer cannot leave the lock inconsistent (it swaps one Arc): a poisoned lock
        // still holds a whole configuration.
        self.0
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn replace(&self, config: Arc<ServerConfig>) {
        *self
            .0
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = config;
    }
}

impl From<Arc<ServerConfig>> for SharedServerConfig {
    fn from(config: Arc<ServerConfig>) -> Self {
        Self::new(config)
    }
}
