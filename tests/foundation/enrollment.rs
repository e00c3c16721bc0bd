//! Enrollment's keys and CA pinning: the keys `ca init` writes load in OpenSSL (and the older
//! PKCS#8 v2 form still loads), and `enroll --install` requires the CA fingerprint.

use super::*;
use std::process::Command;

fn openssl(args: &[&str]) -> String {
    let out = Command::new("openssl").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ca_init(state: &std::path::Path) -> String {
    let (code, out, err) = run_binary(
        "certistack-ctl",
        &["ca", "init", "--state-dir", state.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    out.lines()
        .find_map(|l| l.strip_prefix("CA fingerprint: "))
        .unwrap_or_else(|| panic!("ca init prints no fingerprint: {out}"))
        .to_owned()
}

#[test]
fn keys_written_by_ca_init_load_in_openssl() {
    let dir = TempDir::new("pkcs8");
    let state = dir.0.join("ctl");
    ca_init(&state);
    for (key, public) in [
        ("run-authority.key", "run-authority.pub"),
        ("report-signing.key", "report-signing.pub"),
    ] {
        let key = state.join(key);
        let key = key.to_str().unwrap();
        // OpenSSL 3 loads the private key and derives the same public key the file beside
        // it holds.
        let derived = openssl(&["pkey", "-in", key, "-pubout"]);
        assert_eq!(
            derived,
            std::fs::read_to_string(state.join(public)).unwrap(),
            "{key}"
        );
        let text = openssl(&["pkey", "-in", key, "-noout", "-text"]);
        assert!(text.contains("ED25519 Private-Key"), "{text}");
        // PKCS#8 v1 (RFC 8410): version 0, no embedded public key: 48 bytes of DER, as
        // `openssl genpkey -algorithm ed25519` writes.
        let pem = std::fs::read_to_string(key).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let written = base64_len(&body);
        assert_eq!(written, 48, "{pem}");
    }
    openssl(&[
        "pkey",
        "-in",
        state.join("ca.key").to_str().unwrap(),
        "-noout",
    ]);
    // The controller still loads what it wrote.
    certistack_controller::authority::Authority::load(&state).unwrap();
}

fn base64_len(body: &str) -> usize {
    let padding = body.chars().rev().take_while(|c| *c == '=').count();
    body.len() / 4 * 3 - padding
}

#[test]
fn keys_in_the_older_pkcs8_v2_form_still_load() {
    use ed25519_dalek::pkcs8::{EncodePrivateKey, spki::der::pem::LineEnding};
    let dir = TempDir::new("pkcs8v2");
    let state = dir.0.join("ctl");
    ca_init(&state);
    let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
    // ed25519-dalek's own encoding embeds the public key (PKCS#8 v2).
    let v2 = key.to_pkcs8_pem(LineEnding::LF).unwrap();
    let path = state.join("run-authority.key");
    std::fs::remove_file(&path).unwrap();
    certistack_core::files::write_new(&path, v2.as_bytes(), 0o600).unwrap();
    let loaded = certistack_controller::authority::Authority::load(&state).unwrap();
    assert_eq!(loaded.run_authority().to_bytes(), key.to_bytes());
}

#[test]
fn enroll_install_requires_the_ca_fingerprint() {
    let dir = TempDir::new("capin");
    let state = dir.0.join("ctl");
    let fingerprint = ca_init(&state);
    // What ca init prints is what OpenSSL computes over the CA certificate.
    let openssl_view = openssl(&[
        "x509",
        "-in",
        state.join("ca.crt").to_str().unwrap(),
        "-noout",
        "-fingerprint",
        "-sha256",
    ]);
    let openssl_hex = openssl_view
        .trim()
        .rsplit('=')
        .next()
        .unwrap()
        .replace(':', "")
        .to_lowercase();
    assert_eq!(fingerprint, format!("sha256:{openssl_hex}"));

    // Another controller's CA: what an attacker would hand the node.
    let other_state = dir.0.join("other");
    let other_fingerprint = ca_init(&other_state);
    assert_ne!(fingerprint, other_fingerprint);

    let node_dir = dir.0.join("node");
    std::fs::create_dir_all(&node_dir).unwrap();
    let n = node_dir.display();
    let config_path = node_dir.join("connector.toml");
    std::fs::write(
        &config_path,
        format!(
            "node_name = \"pve1\"\nlisten = \"127.0.0.1:1\"\n[tls]\ncertificate = \"{n}/node.crt\"\nprivate_key = \"{n}/node.key\"\ncontroller_ca = \"{n}/ca.crt\"\nrun_authority_public_key = \"{n}/run-authority.pub\"\n[paths]\nstate_dir = \"{n}/state\"\noverlay_root = \"{n}/overlays\"\n"
        ),
    )
    .unwrap();
    let c = config_path.to_str().unwrap();
    let (code, csr, err) = run_binary("certistack-connector", &["--config", c, "enroll", "--csr"]);
    assert_eq!(code, 0, "{err}");
    let csr_path = dir.0.join("node.csr");
    std::fs::write(&csr_path, &csr).unwrap();
    let cert_path = dir.0.join("node.crt");
    let (code, out, err) = run_binary(
        "certistack-ctl",
        &[
            "node",
            "sign",
            "--state-dir",
            state.to_str().unwrap(),
            "--node",
            "pve1",
            "--csr",
            csr_path.to_str().unwrap(),
            "--out",
            cert_path.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("--ca-fingerprint {fingerprint}")),
        "node sign prints the install command with the pin: {out}"
    );

    let install = |ca_dir: &std::path::Path, pin: Option<&str>| {
        let ca = ca_dir.join("ca.crt");
        let authority = state.join("run-authority.pub");
        let mut args = vec![
            "--config",
            c,
            "enroll",
            "--install",
            "--certificate",
            cert_path.to_str().unwrap(),
            "--ca",
            ca.to_str().unwrap(),
            "--run-authority",
            authority.to_str().unwrap(),
        ];
        if let Some(pin) = pin {
            args.extend(["--ca-fingerprint", pin]);
        }
        run_binary("certistack-connector", &args)
    };
    let installed = || node_dir.join("ca.crt").exists() || node_dir.join("node.crt").exists();

    // Without a pin: a usage error, nothing installed.
    let (code, _, err) = install(&state, None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--ca-fingerprint"), "{err}");
    // A malformed pin.
    let (code, _, err) = install(&state, Some("md5:abcd"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sha256:"), "{err}");
    // The right CA file, but the pin of another CA.
    let (code, _, err) = install(&state, Some(&other_fingerprint));
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("this is not the controller's CA") && err.contains(&fingerprint),
        "{err}"
    );
    // Another CA file presented with the pin the operator read off the real controller.
    let (code, _, err) = install(&other_state, Some(&fingerprint));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("this is not the controller's CA"), "{err}");
    assert!(!installed(), "nothing is installed after a refusal");

    // The pin as OpenSSL prints it (upper case, colons) is accepted.
    let colons = openssl_view.trim().rsplit('=').next().unwrap().to_owned();
    let (code, _, err) = install(&state, Some(&format!("sha256:{colons}")));
    assert_eq!(code, 0, "{err}");
    assert!(installed());
}
