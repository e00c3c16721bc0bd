//! `plan show`: a checked plan with every value of every validation spelled out and where each
//! came from, for a person (aligned text) or a script (one JSON document whose keys are
//! documented in docs/plans.md, "plan show", and do not change within `format` 1).
//!
//! Plan text can carry any character a YAML escape writes, so every value printed for a person
//! goes through `untrusted::printable`: a plan cannot move the cursor or rewrite the terminal
//! of whoever reviews it.

use super::*;
use certistack_core::untrusted;

/// The `format` of the JSON document; raised only when a key changes meaning or goes away.
pub const SHOW_FORMAT: u32 = 1;

/// Characters of one value printed for a person.
const MAX_SHOWN_CHARS: usize = 512;

/// The plan as one JSON document: `format`, `plan`, `digest`, `storage`, `validations`.
pub fn json(plan: &Plan) -> serde_json::Value {
    let storage = &plan.storage;
    let path = |file: &Sourced<PathBuf>| {
        serde_json::json!({
            "value": file.value.to_string_lossy(),
            "source": file.source,
            "key": file.key,
        })
    };
    serde_json::json!({
        "format": SHOW_FORMAT,
        "plan": plan.path.to_string_lossy(),
        "digest": plan.digest,
        "storage": {
            "server": storage.server,
            "port": storage.port,
            "datastore": storage.datastore,
            "namespace": storage.namespace,
            "auth_id": storage.auth_id,
            "fingerprint": storage.fingerprint,
            "pbs_password_file": path(&storage.pbs_password_file),
            "encryption_key_file": storage.encryption_key_file.as_ref().map(path),
        },
        "validations": plan
            .validations
            .iter()
            .map(|validation| &validation.resolved)
            .collect::<Vec<_>>(),
    })
}

/// The plan for a person: the storage, then each validation, one value a line with where it
/// came from.
pub fn text(plan: &Plan) -> String {
    let mut out = Lines::default();
    let storage = &plan.storage;
    out.heading(
        &format!("plan {} ({})", plan.path.to_string_lossy(), plan.digest),
        "",
    );
    out.heading("storage", "storage");
    out.value("server", &storage.server);
    out.value("port", &storage.port);
    out.value("datastore", &storage.datastore);
    out.shown("namespace", &storage.namespace, |n| {
        if n.is_empty() {
            "(root)".into()
        } else {
            n.clone()
        }
    });
    out.value("auth_id", &storage.auth_id);
    out.value("fingerprint", &storage.fingerprint);
    out.shown("pbs_password_file", &storage.pbs_password_file, |p| {
        p.to_string_lossy().into_owned()
    });
    match &storage.encryption_key_file {
        Some(file) => out.shown("encryption_key_file", file, |p| {
            p.to_string_lossy().into_owned()
        }),
        None => out.line(
            "encryption_key_file",
            "(none)",
            Origin::Default,
            "storage.encryption_key_file",
        ),
    }
    for validation in &plan.validations {
        let v = &validation.resolved;
        out.heading(&format!("validation {} ({})", v.name, v.key), &v.key);
        out.value("node", &v.node);
        out.value("endpoint", &v.endpoint);
        out.value("source_vmid", &v.source_vmid);
        out.value("snapshot", &v.snapshot);
        out.shown("archives", &v.archives, |a| a.join(", "));
        for (i, vm) in v.sandbox.iter().enumerate() {
            out.value(&format!("sandbox[{i}].vmid"), &vm.vmid);
            out.value(&format!("sandbox[{i}].cores"), &vm.cores);
            out.value(&format!("sandbox[{i}].memory_mib"), &vm.memory_mib);
        }
        out.shown("network.lifecycle", &v.network.lifecycle, |l| {
            l.name().to_owned()
        });
        out.value("network.vnet", &v.network.vnet);
        out.value("network.probe_source", &v.network.probe_source);
        if v.probes.is_empty() {
            out.line(
                "probes",
                "(none)",
                Origin::Default,
                &format!("{}.probes", v.key),
            );
        }
        for (i, probe) in v.probes.iter().enumerate() {
            out.shown(&format!("probes[{i}]"), probe, describe_probe);
        }
        if v.assertions.is_empty() {
            out.line(
                "assertions",
                "(none)",
                Origin::Default,
                &format!("{}.assertions", v.key),
            );
        }
        for (i, assertion) in v.assertions.iter().enumerate() {
            out.shown(&format!("assertions[{i}]"), assertion, describe_assertion);
        }
        out.value("timeouts.run_seconds", &v.timeouts.run_seconds);
        out.value(
            "timeouts.guest_agent_seconds",
            &v.timeouts.guest_agent_seconds,
        );
        out.shown("network_recovery.mode", &v.network_recovery.mode, |m| {
            m.name().to_owned()
        });
        out.shown(
            "network_recovery.guest_address",
            &v.network_recovery.guest_address,
            |a| {
                if a.is_empty() {
                    "(none)".into()
                } else {
                    a.clone()
                }
            },
        );
    }
    out.text
}

fn describe_probe(probe: &ProbeFile) -> String {
    let kind = match probe.kind {
        ProbeKindFile::Tcp => "tcp",
        ProbeKindFile::Http => "http",
        ProbeKindFile::Https => "https",
        ProbeKindFile::Dns => "dns",
        ProbeKindFile::Ldap => "ldap",
    };
    let mut text = format!("{kind} {}:{}", probe.address, probe.port);
    let e = &probe.expect;
    let strings = [
        ("banner_prefix", &e.banner_prefix),
        ("http_path", &e.http_path),
        ("body_contains", &e.body_contains),
        ("body_sha256", &e.body_sha256),
        ("dns_name", &e.dns_name),
        ("ldap_naming_context", &e.ldap_naming_context),
    ];
    for (name, value) in strings {
        if !value.is_empty() {
            text.push_str(&format!(" {name}={value:?}"));
        }
    }
    if e.http_status != 0 {
        text.push_str(&format!(" http_status={}", e.http_status));
    }
    if let Some(dns_type) = e.dns_type {
        text.push_str(&format!(" dns_type={dns_type:?}"));
    }
    if !e.dns_answers.is_empty() {
        text.push_str(&format!(" dns_answers={:?}", e.dns_answers));
    }
    text
}

fn describe_assertion(assertion: &AssertionFile) -> String {
    let mut text = format!("{}: {}", assertion.id, assertion.program);
    for arg in &assertion.args {
        text.push_str(&format!(" {arg:?}"));
    }
    text.push_str(&format!(
        "; exit {}; {} s",
        assertion.exit_code, assertion.timeout_seconds
    ));
    if !assertion.stdout_contains.is_empty() {
        text.push_str(&format!(
            "; stdout contains {:?}",
            assertion.stdout_contains
        ));
    }
    text
}

/// Width of the name column.
const NAME_WIDTH: usize = 31;
/// Width of the source column: the longest origin, `configuration`.
const SOURCE_WIDTH: usize = 13;

/// The text being built, and the plan key of what its lines describe (`storage`,
/// `validations[i]`): a value read from `<that>.<name>` needs no key after it, any other does.
#[derive(Default)]
struct Lines {
    text: String,
    within: String,
}

impl Lines {
    fn heading(&mut self, text: &str, within: &str) {
        self.text
            .push_str(&untrusted::printable(text.as_bytes(), MAX_SHOWN_CHARS));
        self.text.push('\n');
        within.clone_into(&mut self.within);
    }

    fn line(&mut self, name: &str, value: &str, source: Origin, key: &str) {
        let value = untrusted::printable(value.as_bytes(), MAX_SHOWN_CHARS);
        let source = source.name();
        let line = format!("  {name:<NAME_WIDTH$} {source:<SOURCE_WIDTH$} {value}");
        self.text.push_str(line.trim_end());
        if key != format!("{}.{name}", self.within) {
            let key = untrusted::printable(key.as_bytes(), MAX_SHOWN_CHARS);
            self.text.push_str(&format!(" (from {key})"));
        }
        self.text.push('\n');
    }

    fn shown<T>(&mut self, name: &str, sourced: &Sourced<T>, show: impl Fn(&T) -> String) {
        self.line(name, &show(&sourced.value), sourced.source, &sourced.key);
    }

    fn value<T: std::fmt::Display>(&mut self, name: &str, sourced: &Sourced<T>) {
        self.shown(name, sourced, T::to_string);
    }
}
