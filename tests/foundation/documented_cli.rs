//! The commands and exit codes the docs give `certistack-ctl`, held to what the binary answers,
//! so that neither can change without the other.

use super::*;
use std::path::PathBuf;

fn ctl(args: &[&str]) -> (i32, String, String) {
    run_binary("certistack-ctl", args)
}

fn read_doc(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names under "Commands:" in a clap help text, without clap's own `help`. A name is
/// indented two spaces; a wrapped description further.
fn listed_subcommands(help: &str) -> BTreeSet<String> {
    help.lines()
        .skip_while(|line| *line != "Commands:")
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| line.strip_prefix("  "))
        .filter(|entry| !entry.starts_with(' '))
        .filter_map(|entry| entry.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// Each command `certistack-ctl --help` lists, with the subcommands its own `--help` lists
/// (none for a command that is not a group).
fn help_commands() -> BTreeMap<String, BTreeSet<String>> {
    let (code, help, err) = ctl(&["--help"]);
    assert_eq!(code, 0, "{err}");
    let commands = listed_subcommands(&help);
    assert!(commands.contains("run"), "no commands read from:\n{help}");
    commands
        .into_iter()
        .map(|command| {
            let (code, help, err) = ctl(&[command.as_str(), "--help"]);
            assert_eq!(code, 0, "certistack-ctl {command} --help: {err}");
            let subcommands = listed_subcommands(&help);
            (command, subcommands)
        })
        .collect()
}

/// Every command as one types it: `surface`, or a group's `ca init`.
fn command_lines(commands: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    commands
        .iter()
        .flat_map(|(command, subcommands)| {
            if subcommands.is_empty() {
                vec![command.clone()]
            } else {
                subcommands
                    .iter()
                    .map(|sub| format!("{command} {sub}"))
                    .collect()
            }
        })
        .collect()
}

/// The inline code spans of Markdown text (`what` names it), outside fenced blocks,
/// whitespace collapsed (a span may wrap across lines).
fn code_spans(what: &str, markdown: &str) -> Vec<String> {
    let mut prose = String::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    // An odd count would pair every later backtick wrongly and hide what is quoted.
    assert_eq!(
        prose.matches('`').count() % 2,
        0,
        "{what}: an odd number of backticks"
    );
    prose
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|span| span.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// The commands a list in the docs names: the code spans of its first sentence, less the
/// documents it points to (`plans.md`) and the program's own name.
fn listed_commands(what: &str, text: &str) -> BTreeSet<String> {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let sentence = text.split(". ").next().unwrap();
    code_spans(what, sentence)
        .into_iter()
        .filter(|span| !span.ends_with(".md") && span != "certistack-ctl")
        .collect()
}

/// Every number that follows `prefix` in `text`, whitespace collapsed.
fn numbers_after(text: &str, prefix: &str) -> Vec<i32> {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    text.split(prefix)
        .skip(1)
        .map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits
                .parse::<i32>()
                .unwrap_or_else(|_| panic!("no number after {prefix:?} in {rest:?}"))
        })
        .collect()
}

#[test]
fn the_architecture_lists_exactly_the_commands_of_the_help() {
    let commands = command_lines(&help_commands());
    let architecture = read_doc(&workspace_root().join("docs/architecture.md"));
    let row = architecture
        .lines()
        .find(|line| line.starts_with("| `controller/` bin `certistack-ctl` |"))
        .expect("architecture.md, Components: the row of certistack-ctl");
    let cell = row.split('|').nth(2).unwrap();
    let what = "architecture.md, Components, the row of certistack-ctl";
    assert_eq!(listed_commands(what, cell), commands, "{what}");
    let paragraph = architecture
        .split("\n\n")
        .find(|paragraph| paragraph.starts_with("`certistack-ctl` has these commands:"))
        .expect("architecture.md, Life of a run: the commands of certistack-ctl");
    let what = "architecture.md, Life of a run, the commands of certistack-ctl";
    assert_eq!(listed_commands(what, paragraph), commands, "{what}");
}

#[test]
fn every_certistack_ctl_command_the_docs_name_exists() {
    let commands = help_commands();
    let root = workspace_root();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.push(root.join("README.md"));
    docs.sort();
    let mut named: BTreeMap<String, usize> = BTreeMap::new();
    for path in &docs {
        let name = path.strip_prefix(&root).unwrap().display().to_string();
        for span in code_spans(&name, &read_doc(path)) {
            let Some(command_line) = span.strip_prefix("certistack-ctl ") else {
                continue;
            };
            let mut words = command_line.split(' ');
            let command = words.next().unwrap();
            let subcommands = commands.get(command).unwrap_or_else(|| {
                panic!(
                    "{name}: `{span}`: certistack-ctl --help lists no command {command:?} (it lists {:?})",
                    commands.keys()
                )
            });
            if !subcommands.is_empty() {
                let sub = words.next().unwrap_or("");
                assert!(
                    subcommands.contains(sub),
                    "{name}: `{span}`: certistack-ctl {command} --help lists no subcommand {sub:?} (it lists {subcommands:?})"
                );
            }
            *named.entry(name.clone()).or_default() += 1;
        }
    }
    // The two documents that describe the commands must have been read as naming some.
    for doc in ["docs/plans.md", "docs/architecture.md"] {
        assert!(
            named.contains_key(doc),
            "no `certistack-ctl ...` read in {doc}: {named:?}"
        );
    }
}

#[test]
fn a_wrong_command_line_exits_with_the_code_the_docs_give() {
    let (code, _, err) = ctl(&["no-such-command"]);
    assert!(err.contains("no-such-command"), "{err}");
    let usage = code;
    assert_eq!(usage, 64, "certistack-ctl no-such-command: {err}");
    let (code, _, err) = ctl(&["plan", "check", "--no-such-flag"]);
    assert_eq!(
        code, usage,
        "certistack-ctl plan check --no-such-flag: {err}"
    );
    assert!(err.contains("--no-such-flag"), "{err}");
    // "Every command answers 64": each one, for an option it does not have.
    for command in command_lines(&help_commands()) {
        let mut args: Vec<&str> = command.split(' ').collect();
        args.push("--no-such-flag");
        let (code, _, err) = ctl(&args);
        assert_eq!(
            code, usage,
            "certistack-ctl {command} --no-such-flag: {err}"
        );
    }

    let (_, help, _) = ctl(&["--help"]);
    assert_eq!(
        numbers_after(&help, "Every command answers "),
        [usage],
        "{help}"
    );
    // architecture.md says it twice: in the Components row and under "Exit codes".
    let architecture = read_doc(&workspace_root().join("docs/architecture.md"));
    let said: Vec<i32> = numbers_after(&architecture, "Every command answers ")
        .into_iter()
        .chain(numbers_after(
            &architecture,
            "Every `certistack-ctl` command answers ",
        ))
        .collect();
    assert_eq!(
        said,
        [usage, usage],
        "architecture.md, for a wrong command line"
    );

    // The `plan check` table of plans.md: the usage row, and exactly the codes its --help gives.
    let plans = read_doc(&workspace_root().join("docs/plans.md"));
    let table = plans
        .split("## `plan check` exit codes")
        .nth(1)
        .expect("plans.md: a section \"`plan check` exit codes\"");
    let table = table.split("\n## ").next().unwrap();
    let rows: Vec<(i32, &str)> = table
        .lines()
        .filter_map(|line| {
            let mut cells = line.split('|').map(str::trim).skip(1);
            let code: i32 = cells.next()?.parse().ok()?;
            Some((code, cells.next()?))
        })
        .collect();
    let usage_rows: Vec<i32> = rows
        .iter()
        .filter(|(_, meaning)| meaning.contains("command line is wrong"))
        .map(|(code, _)| *code)
        .collect();
    assert_eq!(
        usage_rows,
        [usage],
        "plans.md, `plan check` exit codes: {rows:?}"
    );
    let documented: BTreeSet<i32> = rows.iter().map(|(code, _)| *code).collect();
    assert!(
        table.contains("`plan show` answers the same codes"),
        "plans.md, `plan check` exit codes: say that `plan show` answers them too"
    );
    for command in ["check", "show"] {
        let (code, help, err) = ctl(&["plan", command, "--help"]);
        assert_eq!(code, 0, "{err}");
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        let helped: BTreeSet<i32> = help
            .split("Exit codes: ")
            .nth(1)
            .unwrap_or_else(|| panic!("plan {command} --help gives its exit codes"))
            .split("; ")
            .map(|entry| {
                let digits: String = entry.chars().take_while(char::is_ascii_digit).collect();
                digits
                    .parse::<i32>()
                    .unwrap_or_else(|_| panic!("{entry:?} in: {help}"))
            })
            .collect();
        assert_eq!(
            documented, helped,
            "plans.md's `plan check` table against `plan {command} --help`"
        );
    }
}
