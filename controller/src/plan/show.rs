//! `plan show`: a checked plan with every value of every validation spelled out and where each
//! came from, for a person (one value a line) or a script (one JSON document whose keys are
//! documented in docs/plans.md, "plan show", and do not change within `format` 1).
//!
//! A plan string may carry characters a terminal acts on or that hide what follows them
//! (bidirectional overrides, invisible separators; the grant refuses control characters but
//! not those). Every value printed for a person goes through `untrusted::printable` once, one
//! value a line, so no value can hide another; the JSON writes every such character as a
//! `\uXXXX` escape, so a script still reads the exact value.

use super::*;
use certistack_core::untrusted;

/// The `format` of the JSON document; raised only when a key changes meaning or goes away.
pub const SHOW_FORMAT: u32 = 1;

/// Characters of one value printed for a person: more than any value a grant accepts.
const MAX_SHOWN_CHARS: usize = 4096;

/// The plan as one JSON document (`format`, `plan`, `digest`, `storage`, `validations`), as
/// text with every character a terminal might act on escaped.
pub fn json(plan: &Plan) -> String {
    let storage = &plan.storage;
    let path = |file: &Sourced<PathBuf>| Sourced {
        value: file.value.to_string_lossy().into_owned(),
        source: file.source,
        key: file.key.clone(),
    };
    let document = serde_json::json!({
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
            "encryption_key_file": Sourced {
                value: storage
                    .encryption_key_file
                    .value
                    .as_ref()
                    .map(|file| file.to_string_lossy().into_owned()),
                source: storage.encryption_key_file.source,
                key: storage.encryption_key_file.key.clone(),
            },
        },
        "validations": plan.resolved_in_order(),
    });
    escape_for_terminals(&format!("{document:#}"))
}

/// `json` with every non-ASCII character that Rust's `escape_debug` would escape (C1 controls,
/// bidirectional and other format characters, separators) written as a JSON `\uXXXX` escape
/// (a surrogate pair above U+FFFF). serde_json already escapes C0 controls, `"` and `\`; in
/// valid JSON such characters can only stand inside strings, so the document means the same.
fn escape_for_terminals(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if !c.is_ascii() && c.escape_debug().next() == Some('\\') {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The plan for a person: the storage, then each validation, one value a line with where it
/// came from. Keys whose default checks nothing (an unset probe expectation) are left out.
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
    out.shown(
        "encryption_key_file",
        &storage.encryption_key_file,
        |file| match file {
            Some(file) => file.to_string_lossy().into_owned(),
            None => "(none)".into(),
        },
    );
    for v in plan.resolved_in_order() {
        out.heading(&format!("validation {} ({})", v.name, v.key), &v.key);
        if let Some(fails) = &v.fails_before_run {
            out.line(
                "fails_before_run",
                &fails.reason,
                Origin::Pbs,
                &v.snapshot.key,
            );
        }
        if let Some(hours) = v.max_age_hours.value {
            out.line(
                "max_age_hours",
                &hours.to_string(),
                v.max_age_hours.source,
                &v.max_age_hours.key,
            );
        }
        if let Some(why) = &v.unplaced {
            out.line("unplaced", why, Origin::Placement, &v.node.key);
        }
        out.value("node", &v.node);
        out.value("endpoint", &v.endpoint);
        out.value("source_vmid", &v.source_vmid);
        out.value("snapshot", &v.snapshot);
        if let Some(found) = &v.latest {
            out.line(
                "snapshot.latest",
                &format!(
                    "the newest of {} finished snapshot(s) ({} listed), {} old, {} bytes",
                    found.finished,
                    found.listed,
                    backup::age_text(found.age_seconds),
                    found.size_bytes
                ),
                Origin::Pbs,
                &v.snapshot.key,
            );
        }
        for (i, archive) in v.archives.value.iter().enumerate() {
            let shown = match v.archive_sizes.get(archive) {
                Some(size) => format!("{archive}, {size} bytes"),
                None => archive.clone(),
            };
            let key = if v.archives.source == Origin::Plan {
                format!("{}[{i}]", v.archives.key)
            } else {
                v.archives.key.clone()
            };
            out.line(&format!("archives[{i}]"), &shown, v.archives.source, &key);
        }
        // A validation that fails before any node is asked never reads the sizes it left out.
        let not_read = |sourced: &Sourced<u32>| {
            v.fails_before_run.is_some() && sourced.source == Origin::Default
        };
        for (i, vm) in v.sandbox.iter().enumerate() {
            out.value(&format!("sandbox[{i}].vmid"), &vm.vmid);
            for (name, sourced) in [("cores", &vm.cores), ("memory_mib", &vm.memory_mib)] {
                if not_read(sourced) {
                    out.line(
                        &format!("sandbox[{i}].{name}"),
                        "(not read: the validation fails before any node is asked)",
                        sourced.source,
                        &sourced.key,
                    );
                } else {
                    out.value(&format!("sandbox[{i}].{name}"), sourced);
                }
            }
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
            probe_lines(&mut out, &format!("probes[{i}]"), probe);
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
            let name = |key: &str| format!("assertions[{i}].{key}");
            out.value(&name("id"), &assertion.id);
            out.value(&name("program"), &assertion.program);
            out.list(&name("args"), &assertion.args);
            out.value(&name("exit_code"), &assertion.exit_code);
            if assertion.stdout_contains.source != Origin::Default {
                out.value(&name("stdout_contains"), &assertion.stdout_contains);
            }
            out.value(&name("timeout_seconds"), &assertion.timeout_seconds);
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

/// One probe's lines: kind, address, port, and each expectation the plan sets.
fn probe_lines(out: &mut Lines, at: &str, probe: &ResolvedProbe) {
    let name = |key: &str| format!("{at}.{key}");
    out.shown(&name("kind"), &probe.kind, |kind| kind.name().to_owned());
    out.value(&name("address"), &probe.address);
    out.value(&name("port"), &probe.port);
    let e = &probe.expect;
    for (key, value) in [
        ("banner_prefix", &e.banner_prefix),
        ("http_path", &e.http_path),
        ("body_contains", &e.body_contains),
        ("body_sha256", &e.body_sha256),
        ("dns_name", &e.dns_name),
        ("ldap_naming_context", &e.ldap_naming_context),
    ] {
        if value.source != Origin::Default {
            out.value(&name(&format!("expect.{key}")), value);
        }
    }
    if e.http_status.source != Origin::Default {
        out.value(&name("expect.http_status"), &e.http_status);
    }
    if e.dns_type.source != Origin::Default {
        out.shown(&name("expect.dns_type"), &e.dns_type, |dns_type| {
            dns_type.map_or_else(String::new, |t| t.name().to_owned())
        });
    }
    if e.dns_answers.source != Origin::Default {
        out.list(&name("expect.dns_answers"), &e.dns_answers);
    }
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

    /// A list, one item a line (`name[i]`), or `(none)` when it is empty.
    fn list(&mut self, name: &str, sourced: &Sourced<Vec<String>>) {
        if sourced.value.is_empty() {
            self.line(name, "(none)", sourced.source, &sourced.key);
        }
        for (i, item) in sourced.value.iter().enumerate() {
            let key = format!("{}[{i}]", sourced.key);
            self.line(&format!("{name}[{i}]"), item, sourced.source, &key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes_what_a_terminal_acts_on_and_keeps_the_value() {
        let value = "a\u{202e}b\u{9b}c\u{2028}d\u{e0001}é";
        let escaped = escape_for_terminals(&serde_json::to_string(value).unwrap());
        assert!(escaped.is_ascii() || escaped.contains('é'), "{escaped}");
        assert!(
            !escaped.contains('\u{202e}') && !escaped.contains('\u{9b}'),
            "{escaped}"
        );
        assert!(
            escaped.contains("\\u202e") && escaped.contains("\\udb40\\udc01"),
            "{escaped}"
        );
        let read: String = serde_json::from_str(&escaped).unwrap();
        assert_eq!(read, value);
    }
}
