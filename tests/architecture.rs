//! The layout of the code holds what `docs/architecture.md` promises of it: the module list
//! names every module of every crate and nothing else, the controller links no daemon code,
//! no two modules import each other (directly or around a longer circle), and no source file
//! carries over 1,000 lines of code outside its tests without a reason recorded here.
//!
//! It reads the sources as text (no compiler internals): a module is a `.rs` file under a
//! crate's `src/` (a `mod.rs` names its directory; `bin/` and `tests.rs` children are not
//! library modules), and a module depends on another when its code outside comments and
//! `#[cfg(test)]` blocks names a path into it (`crate::…`, `super::…`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose modules the architecture document lists: directory, short name.
const CRATES: &[(&str, &str)] = &[
    ("proto", "proto"),
    ("core", "core"),
    ("connector", "connector"),
    ("controller", "controller"),
];

/// The daemon's crate; the controller must not depend on it.
const DAEMON_CRATE: &str = "certistack-connector";

/// Files allowed over the line bound, each with the reason it reads best as one piece.
const LONG_FILES: &[(&str, &str)] = &[];

/// Lines a source file may hold before its tests (`#[cfg(test)]`), comments included.
const MAX_CODE_LINES: usize = 1_000;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .to_owned()
}

/// One library module: its path (`connector::node::sandbox`) and file.
#[derive(Debug, Clone)]
struct Module {
    path: Vec<String>,
    file: PathBuf,
}

impl Module {
    fn name(&self) -> String {
        self.path.join("::")
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

fn modules() -> Vec<Module> {
    let root = workspace();
    let mut modules = Vec::new();
    for (dir, short) in CRATES {
        let src = root.join(dir).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            let relative = file.strip_prefix(&src).unwrap();
            let mut parts: Vec<String> = relative
                .iter()
                .map(|part| part.to_string_lossy().into_owned())
                .collect();
            if parts.first().is_some_and(|first| first == "bin") {
                continue;
            }
            let last = parts.pop().unwrap();
            let stem = last.trim_end_matches(".rs");
            if stem == "tests" {
                continue;
            }
            if stem != "mod" && stem != "lib" {
                parts.push(stem.to_owned());
            }
            let mut path = vec![(*short).to_owned()];
            path.extend(parts);
            modules.push(Module { path, file });
        }
    }
    modules
}

/// The code of a source file that the build of the library sees: comments and everything
/// from the first `#[cfg(test)]` on (the tests sit at the end of each file) are left out.
fn library_code(text: &str) -> Vec<&str> {
    let mut code = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        code.push(line);
    }
    code
}

/// The module list of `docs/architecture.md`: every `` `crate::module` `` that opens a bullet
/// of its "Modules" section.
fn documented_modules() -> BTreeSet<String> {
    let text = std::fs::read_to_string(workspace().join("docs/architecture.md")).unwrap();
    let section = text
        .split("\n## Modules\n")
        .nth(1)
        .expect("docs/architecture.md has a \"## Modules\" section");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("- `")?;
            let name = rest.split('`').next()?;
            Some(name.to_owned())
        })
        .collect()
}

#[test]
fn the_architecture_document_lists_every_module_and_only_those() {
    let code: BTreeSet<String> = modules().iter().map(Module::name).collect();
    let documented = documented_modules();
    let missing: Vec<_> = code.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&code).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/architecture.md, \"Modules\": add {missing:?}, remove {stale:?} (no such module)"
    );
}

fn dependencies(manifest: &str) -> BTreeSet<String> {
    let table: toml::Table = std::fs::read_to_string(workspace().join(manifest))
        .unwrap()
        .parse()
        .unwrap();
    ["dependencies", "build-dependencies"]
        .iter()
        .filter_map(|section| table.get(*section)?.as_table())
        .flat_map(|deps| deps.keys().cloned())
        .collect()
}

#[test]
fn the_controller_depends_on_core_and_proto_never_on_the_daemon() {
    let controller = dependencies("controller/Cargo.toml");
    assert!(
        !controller.contains(DAEMON_CRATE),
        "controller/Cargo.toml names {DAEMON_CRATE}: what both programs share belongs in certistack-core"
    );
    assert!(controller.contains("certistack-core") && controller.contains("certistack-proto"));
    let core = dependencies("core/Cargo.toml");
    assert!(
        !core
            .iter()
            .any(|dep| dep == DAEMON_CRATE || dep == "certistack-controller"),
        "core/Cargo.toml may name only certistack-proto of this workspace: {core:?}"
    );
}

/// The module a path in `module`'s code names: `crate::a::b::Item` → the longest prefix
/// `[crate, a, b]` that is a module; `super::` and `self::` resolved against `module`.
fn resolve(
    module: &Module,
    segments: &[&str],
    known: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let crate_name = module.path[0].clone();
    // `super` is the parent of the file's module, whether the file is `a/b.rs` or `a/b/mod.rs`.
    let mut base: Vec<String> = module.path.clone();
    let mut rest = segments;
    match rest.first() {
        Some(&"crate") => {
            base = vec![crate_name];
            rest = &rest[1..];
        }
        Some(&"super") => {
            while rest.first() == Some(&"super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        Some(&"self") => rest = &rest[1..],
        _ => return None,
    }
    let mut path = base;
    let mut best = None;
    if known.contains(&path) {
        best = Some(path.clone());
    }
    for segment in rest {
        path.push((*segment).to_owned());
        if known.contains(&path) {
            best = Some(path.clone());
        } else {
            break;
        }
    }
    best
}

/// Every path (`crate::…`, `super::…`, `self::…`) in a line, braces of `use` groups expanded
/// one level: `crate::{a, b::c}` gives `crate::a` and `crate::b::c`.
fn paths_in(line: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let bytes = line.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = line[from..].find(start) {
            let begin = from + at;
            from = begin + start.len();
            if begin > 0 {
                let before = bytes[begin - 1] as char;
                if before.is_alphanumeric() || before == '_' || before == ':' {
                    continue;
                }
            }
            let tail = &line[begin..];
            let head: String = tail
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let prefix: Vec<String> = head
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            if head.ends_with("::") && tail[head.len()..].starts_with('{') {
                let group = &tail[head.len() + 1..];
                let mut depth = 0usize;
                let mut item = String::new();
                let mut items = Vec::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                        _ => {}
                    }
                    if depth == 0 && c != ',' && c != '}' {
                        item.push(c);
                    }
                }
                items.push(item);
                for item in items {
                    let item: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    let mut path = prefix.clone();
                    path.extend(
                        item.split("::")
                            .filter(|s| !s.is_empty() && *s != "self")
                            .map(str::to_owned),
                    );
                    found.push(path);
                }
            } else {
                found.push(prefix);
            }
        }
    }
    found
}

/// For one module of a parent (`(parent, child)`), the siblings it names, each with the
/// first line that names it.
type SiblingEdges = BTreeMap<(Vec<String>, String), BTreeSet<(String, String)>>;

/// The edges between sibling modules: `a → b` when code under `a` names a path under `b`,
/// and `a` and `b` are children of the same module.
fn sibling_edges() -> SiblingEdges {
    let modules = modules();
    let known: BTreeSet<Vec<String>> = modules.iter().map(|m| m.path.clone()).collect();
    let mut edges = SiblingEdges::new();
    for module in &modules {
        let text = std::fs::read_to_string(&module.file).unwrap();
        for line in library_code(&text) {
            for path in paths_in(line) {
                let segments: Vec<&str> = path.iter().map(String::as_str).collect();
                let Some(target) = resolve(module, &segments, &known) else {
                    continue;
                };
                let common = module
                    .path
                    .iter()
                    .zip(&target)
                    .take_while(|(a, b)| a == b)
                    .count();
                // A module naming its own ancestor or descendant is not a sibling edge.
                if common == module.path.len() || common == target.len() {
                    continue;
                }
                let parent = module.path[..common].to_vec();
                let from = module.path[common].clone();
                let to = target[common].clone();
                edges.entry((parent, from.clone())).or_default().insert((
                    to,
                    format!(
                        "{}: {}",
                        module
                            .file
                            .strip_prefix(workspace())
                            .unwrap_or(&module.file)
                            .display(),
                        line.trim()
                    ),
                ));
            }
        }
    }
    edges
}

/// A circle among the children of one module, if any: the modules on it, in order.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        on_path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = on_path.iter().position(|n| n == node) {
            let mut circle = on_path[at..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        on_path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, on_path, done) {
                return Some(circle);
            }
        }
        on_path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(circle) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(circle);
        }
    }
    None
}

#[test]
fn no_modules_import_each_other() {
    let edges = sibling_edges();
    let mut by_parent: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for ((parent, from), targets) in &edges {
        let graph = by_parent.entry(parent.clone()).or_default();
        for (to, _) in targets {
            graph.entry(from.clone()).or_default().insert(to.clone());
        }
    }
    for (parent, graph) in &by_parent {
        if let Some(circle) = find_circle(graph) {
            let evidence: Vec<String> = circle
                .windows(2)
                .filter_map(|pair| {
                    let (_, line) = edges
                        .get(&(parent.clone(), pair[0].clone()))?
                        .iter()
                        .find(|(to, _)| *to == pair[1])?;
                    Some(format!("{} → {} ({line})", pair[0], pair[1]))
                })
                .collect();
            panic!(
                "modules of {} import each other around a circle {}:\n{}\nmove what both need into a module both may import",
                parent.join("::"),
                circle.join(" → "),
                evidence.join("\n")
            );
        }
    }
}

#[test]
fn no_source_file_is_long_without_a_reason() {
    let allowed: BTreeMap<&str, &str> = LONG_FILES.iter().copied().collect();
    let root = workspace();
    let mut long = Vec::new();
    let mut sources = Vec::new();
    for (dir, _) in CRATES {
        rust_files(&root.join(dir).join("src"), &mut sources);
    }
    for file in sources {
        let text = std::fs::read_to_string(&file).unwrap();
        // Every line before the tests counts, comments and blank lines too.
        let lines = text
            .lines()
            .take_while(|line| !line.trim_start().starts_with("#[cfg(test)]"))
            .count();
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        if lines > MAX_CODE_LINES && !allowed.contains_key(name.as_str()) {
            long.push(format!("{name}: {lines} lines before its tests"));
        }
    }
    assert!(
        long.is_empty(),
        "split these by concern, or record why one piece reads best in LONG_FILES: {long:#?}"
    );
}

#[test]
fn the_path_reader_sees_groups_and_relative_paths() {
    assert_eq!(
        paths_in("use crate::{action::{self, Action}, grant};"),
        vec![
            vec!["crate".to_owned(), "action".to_owned()],
            vec!["crate".to_owned(), "grant".to_owned()]
        ]
    );
    assert_eq!(
        paths_in("let x = super::super::clock::Clock::now();"),
        vec![vec![
            "super".to_owned(),
            "super".to_owned(),
            "clock".to_owned(),
            "Clock".to_owned(),
            "now".to_owned()
        ]]
    );
    let mut graph = BTreeMap::new();
    graph.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    graph.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    graph.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_circle(&graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    graph.insert("c".to_owned(), BTreeSet::new());
    assert_eq!(find_circle(&graph), None);
}

#[test]
fn every_source_file_the_docs_name_exists() {
    let root = workspace();
    let mut documents = vec![root.join("README.md"), root.join("SECURITY.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "md") {
            documents.push(path);
        }
    }
    let mut missing = Vec::new();
    for document in documents {
        let text = std::fs::read_to_string(&document).unwrap();
        for word in text.split(|c: char| c.is_whitespace() || "`()[],;".contains(c)) {
            let named = word.trim_end_matches(['.', ':']);
            let in_a_crate = CRATES
                .iter()
                .any(|(dir, _)| named.starts_with(&format!("{dir}/")))
                || named.starts_with("tests/");
            if in_a_crate && named.ends_with(".rs") && !root.join(named).exists() {
                missing.push(format!("{}: {named}", document.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name files that do not exist: {missing:#?}"
    );
}
