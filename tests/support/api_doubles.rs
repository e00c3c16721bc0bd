//! The HTTPS API doubles (`tests/doubles/pve-api`, `tests/doubles/pbs-api`), each started on
//! loopback with a certificate of the tests' own PKI and stopped on drop.

use crate::{ApiServerPki, TempDir, workspace_root};
use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

/// A running API double.
pub struct ApiDouble {
    pub port: u16,
    /// The SHA-256 of the certificate it serves, as a plan pins it (`aa:bb:…`).
    pub fingerprint: String,
    child: std::process::Child,
    _tls: TempDir,
}

impl ApiDouble {
    /// Starts `tests/doubles/<script>` serving `pki`'s leaf, with `args` and `--tls-dir` (or,
    /// for `pve-api`, its root) given by `tls_arg`: the double reads `cert.pem` and `key.pem`
    /// from that directory and writes the port it listens on to `port` there.
    pub fn start(script: &str, pki: &ApiServerPki, args: &[OsString], tls_arg: &str) -> Self {
        let tls = TempDir::new(&format!("{script}-tls"));
        Self::start_in(script, pki, args, tls_arg, tls)
    }

    /// [`ApiDouble::start`] with the TLS directory given: `pve-api` keeps its settings there.
    pub fn start_in(
        script: &str,
        pki: &ApiServerPki,
        args: &[OsString],
        tls_arg: &str,
        tls: TempDir,
    ) -> Self {
        std::fs::write(tls.0.join("cert.pem"), &pki.leaf_pem).unwrap();
        std::fs::write(tls.0.join("key.pem"), &pki.leaf_key_pem).unwrap();
        let fingerprint = certistack_core::tls::format_fingerprint(
            &certistack_core::tls::certificate_fingerprint(&pki.leaf_der),
        )
        .to_lowercase();
        let child = std::process::Command::new("python3")
            .arg(workspace_root().join("tests/doubles").join(script))
            .args(args)
            .arg(tls_arg)
            .arg(&tls.0)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let port = wait_for_port(&tls.0.join("port"), script);
        Self {
            port,
            fingerprint,
            child,
            _tls: tls,
        }
    }

    /// The directory holding its certificate and port file.
    pub fn tls_dir(&self) -> &Path {
        &self._tls.0
    }
}

impl Drop for ApiDouble {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for_port(path: &Path, script: &str) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(port) = std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            return port;
        }
        assert!(
            Instant::now() < deadline,
            "the {script} double did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
