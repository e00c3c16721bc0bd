//! The surface audit: proto, policy and code agree; the digest recomputed by a second
//! implementation; the build `Hello` reports.

use super::*;

fn surface() -> prost_types::FileDescriptorProto {
    prost_types::FileDescriptorProto::decode(certistack_proto::SURFACE_DESCRIPTOR).unwrap()
}

const DIGEST_POLICY_FILES: [&str; 5] = [
    "policy/rpc-surface.toml",
    "policy/field-validators.toml",
    "policy/qmp-allowlist.toml",
    "policy/qga-allowlist.toml",
    "policy/source-hardware.toml",
];

#[test]
fn surface_digest_covers_the_descriptor_and_the_policy_files() {
    use sha2::{Digest, Sha256};
    // Recomputed here from the documented definition: labelled, length-prefixed parts.
    let mut parts = vec![(
        "proto/certistack/connector/v1/connector.proto#descriptor".to_owned(),
        certistack_proto::SURFACE_DESCRIPTOR.to_vec(),
    )];
    for file in DIGEST_POLICY_FILES {
        let text = std::fs::read_to_string(workspace_root().join(file)).unwrap();
        parts.push((file.to_owned(), text.replace("\r\n", "\n").into_bytes()));
    }
    let mut hasher = Sha256::new();
    for (label, content) in &parts {
        hasher.update((label.len() as u32).to_be_bytes());
        hasher.update(label.as_bytes());
        hasher.update((content.len() as u64).to_be_bytes());
        hasher.update(content);
    }
    let digest = format!("sha256:{}", hex::encode(hasher.finalize()));
    assert_eq!(digest, certistack_proto::SURFACE_DIGEST);
    let listed: Vec<(String, String)> = parts
        .iter()
        .map(|(label, content)| {
            (
                label.clone(),
                format!("sha256:{}", hex::encode(Sha256::digest(content))),
            )
        })
        .collect();
    let compiled: Vec<(String, String)> = certistack_proto::SURFACE_PARTS
        .iter()
        .map(|(l, d)| ((*l).to_owned(), (*d).to_owned()))
        .collect();
    assert_eq!(listed, compiled);
    // Comments are not part of the surface: the canonical descriptor carries no source info.
    assert!(surface().source_code_info.is_none());
    // A change to a policy file changes the digest: the old definition (the descriptor alone)
    // no longer gives it.
    assert_ne!(
        format!(
            "sha256:{}",
            hex::encode(Sha256::digest(certistack_proto::SURFACE_DESCRIPTOR))
        ),
        certistack_proto::SURFACE_DIGEST
    );
}

#[test]
fn every_rpc_has_exactly_one_policy_entry() {
    let file = surface();
    assert_eq!(file.service.len(), 1, "one service");
    let service = &file.service[0];
    assert_eq!(
        format!("{}.{}", file.package(), service.name()),
        certistack_proto::SERVICE_NAME
    );
    let methods: BTreeSet<String> = service.method.iter().map(|m| m.name().to_owned()).collect();
    let policy = certistack_connector::policy::SurfacePolicy::compiled().unwrap();
    let entries: Vec<String> = policy.rpc.iter().map(|e| e.name.clone()).collect();
    let unique: BTreeSet<String> = entries.iter().cloned().collect();
    assert_eq!(
        entries.len(),
        unique.len(),
        "an RPC is listed twice in policy/rpc-surface.toml"
    );
    assert_eq!(
        methods, unique,
        "proto methods and policy/rpc-surface.toml differ"
    );
    let code: BTreeSet<String> = certistack_connector::policy::Rpc::ALL
        .iter()
        .map(|r| r.name().to_owned())
        .collect();
    assert_eq!(
        methods, code,
        "proto methods and the connector's Rpc enum differ"
    );
    policy.gate().unwrap();
    // Only ReadJournal streams.
    let streaming: Vec<&str> = service
        .method
        .iter()
        .filter(|m| m.server_streaming() || m.client_streaming())
        .map(|m| m.name())
        .collect();
    assert_eq!(streaming, ["ReadJournal"]);
}

/// Every message a caller can send: the RPC inputs and what they contain, and the run grant.
fn input_messages(file: &prost_types::FileDescriptorProto) -> BTreeSet<String> {
    let package = format!(".{}.", file.package());
    let by_name: BTreeMap<String, &prost_types::DescriptorProto> = file
        .message_type
        .iter()
        .map(|m| (format!("{package}{}", m.name()), m))
        .collect();
    let mut pending: Vec<String> = file.service[0]
        .method
        .iter()
        .map(|m| m.input_type().to_owned())
        .collect();
    pending.push(format!("{package}RunGrant"));
    let mut seen = BTreeSet::new();
    while let Some(name) = pending.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let message = by_name
            .get(&name)
            .unwrap_or_else(|| panic!("{name} is not defined in the surface file"));
        for field in &message.field {
            if field.r#type() == prost_types::field_descriptor_proto::Type::Message {
                pending.push(field.type_name().to_owned());
            }
        }
    }
    seen
}

#[test]
fn every_input_string_field_has_a_validator() {
    use prost_types::field_descriptor_proto::Type;
    let file = surface();
    let inputs = input_messages(&file);
    let mut fields = BTreeSet::new();
    for message in &file.message_type {
        if !inputs.contains(&format!(".{}.{}", file.package(), message.name())) {
            continue;
        }
        for field in &message.field {
            if matches!(field.r#type(), Type::String | Type::Bytes) {
                fields.insert(format!(
                    "{}.{}.{}",
                    file.package(),
                    message.name(),
                    field.name()
                ));
            }
        }
    }
    #[derive(serde::Deserialize)]
    struct FieldPolicy {
        fields: BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../policy/field-validators.toml"
    ))
    .unwrap();
    let policy: FieldPolicy = toml::from_str(&text).unwrap();
    let declared: BTreeSet<String> = policy.fields.keys().cloned().collect();
    let missing: Vec<_> = fields.difference(&declared).collect();
    let stale: Vec<_> = declared.difference(&fields).collect();
    assert!(
        missing.is_empty(),
        "string/bytes fields without a validator in policy/field-validators.toml: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "policy/field-validators.toml names fields the surface does not have: {stale:?}"
    );
    // No field name suggests a command, a path or a script.
    for field in &fields {
        let name = field.rsplit('.').next().unwrap();
        for forbidden in [
            "command_line",
            "argv",
            "script",
            "shell",
            "path_on_node",
            "cmd",
        ] {
            assert!(
                !name.contains(forbidden),
                "{field} looks like a free-form command or path"
            );
        }
    }
}

#[test]
fn ctl_surface_prints_every_rpc_and_the_digest() {
    let text = certistack_controller::surface::describe().unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        certistack_connector::policy::Rpc::ALL.len() + certistack_proto::SURFACE_PARTS.len() + 1
    );
    for (line, rpc) in lines.iter().zip(certistack_connector::policy::Rpc::ALL) {
        assert!(
            line.starts_with(&format!(
                "/certistack.connector.v1.Connector/{} ",
                rpc.name()
            )),
            "{line}"
        );
    }
    assert_eq!(
        lines.last().unwrap(),
        &format!("digest: {}", certistack_proto::SURFACE_DIGEST)
    );
    for file in DIGEST_POLICY_FILES {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("part: {file} sha256:"))),
            "{text}"
        );
    }
    assert!(text.contains(
        "/certistack.connector.v1.Connector/ReadJournal ReadJournalRequest -> stream JournalRecord"
    ));
}
/// The digest definition of docs/architecture.md ("Surface digest"), in Python, from the files
/// and the canonical descriptor alone.
const PYTHON_SURFACE_DIGEST: &str = r#"
import hashlib, struct, sys
root, descriptor_path = sys.argv[1], sys.argv[2]
descriptor = open(descriptor_path, "rb").read()
try:
    from google.protobuf import descriptor_pb2
    parsed = descriptor_pb2.FileDescriptorProto.FromString(descriptor)
    assert parsed.name == "certistack/connector/v1/connector.proto", parsed.name
    assert not parsed.HasField("source_code_info")
    # Another protobuf implementation re-encodes the descriptor to the same bytes.
    assert parsed.SerializeToString(deterministic=True) == descriptor, "not canonical"
    print("descriptor checked with google.protobuf", file=sys.stderr)
except ImportError:
    print("google.protobuf missing: descriptor not re-encoded", file=sys.stderr)
parts = [("proto/certistack/connector/v1/connector.proto#descriptor", descriptor)]
for name in ["policy/rpc-surface.toml", "policy/field-validators.toml",
             "policy/qmp-allowlist.toml", "policy/qga-allowlist.toml",
             "policy/source-hardware.toml"]:
    parts.append((name, open(root + "/" + name, "rb").read().replace(b"\r\n", b"\n")))
h = hashlib.sha256()
for label, content in parts:
    label = label.encode("ascii")
    h.update(struct.pack(">I", len(label)) + label + struct.pack(">Q", len(content)) + content)
print("sha256:" + h.hexdigest())
"#;

#[test]
fn a_second_implementation_recomputes_the_surface_digest() {
    let dir = TempDir::new("digest");
    let descriptor = dir.0.join("connector.descriptor");
    std::fs::write(&descriptor, certistack_proto::SURFACE_DESCRIPTOR).unwrap();
    // Debian's Python, where python3-protobuf installs (tests/prepare-machine.sh), not
    // whichever python3 comes first on this shell's PATH.
    let out = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(PYTHON_SURFACE_DIGEST)
        .arg(workspace_root())
        .arg(&descriptor)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    eprintln!("{stderr}");
    assert!(
        !stderr.contains("google.protobuf missing")
            || std::env::var("CERTISTACK_REQUIRE_PRIVILEGED_TESTS").as_deref() != Ok("1"),
        "the descriptor was not re-encoded by a second implementation: install python3-protobuf (tests/prepare-machine.sh)"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        certistack_proto::SURFACE_DIGEST
    );
}

#[tokio::test]
async fn hello_reports_the_source_commit_the_daemon_was_built_from() {
    let (_dir, authority, node) = started_node("source").await;
    let reply = operator(&authority, &node)
        .await
        .hello(pb::HelloRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.daemon_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(reply.source_commit, certistack_proto::SOURCE_COMMIT);
    assert_eq!(reply.source_tree_dirty, certistack_proto::SOURCE_TREE_DIRTY);
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head) => {
            // Built from this checkout: the commit is HEAD's, and the dirty flag is what git
            // says about the sources of the binaries.
            assert_eq!(reply.source_commit, head);
            let changes = git(&[
                "--no-optional-locks",
                "status",
                "--porcelain",
                "--",
                "connector",
                "controller",
                "proto",
                "policy",
                "Cargo.toml",
                "Cargo.lock",
            ])
            .unwrap();
            assert_eq!(reply.source_tree_dirty, !changes.is_empty(), "{changes}");
        }
        None => assert_eq!(reply.source_commit, "unknown"),
    }
}
