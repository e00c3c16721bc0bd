//! LVM's `global_filter` as `lvm.conf` sets it, read with a small tokenizer of LVM's
//! configuration syntax.

use super::{MAX_FILTER_PATTERNS, bounded, item, read_config_file};
use certistack_proto::v1 as pb;
use std::path::Path;

pub(super) fn lvm_filter_facts(lvm_conf: &Path) -> pb::LvmFilterFacts {
    let mut facts = pb::LvmFilterFacts {
        path: bounded(&lvm_conf.display().to_string()),
        ..Default::default()
    };
    match read_config_file(lvm_conf) {
        Ok(text) => {
            if let Some(patterns) = lvm_global_filter(&text) {
                facts.found = true;
                facts.patterns = patterns
                    .iter()
                    .take(MAX_FILTER_PATTERNS)
                    .map(|p| item(p))
                    .collect();
            }
        }
        Err(error) => {
            facts.error = bounded(&format!("cannot read {}: {error}", lvm_conf.display()));
        }
    }
    facts
}

/// A token of LVM's configuration syntax.
#[derive(Debug, PartialEq, Eq)]
enum LvmToken {
    Word(String),
    Text(String),
    Punct(char),
}

/// LVM's configuration tokens, `#` comments dropped (a `#` inside a string is text).
fn lvm_tokens(text: &str) -> Vec<LvmToken> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '"' => {
                let mut value = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => value.extend(chars.next()),
                        c => value.push(c),
                    }
                }
                tokens.push(LvmToken::Text(value));
            }
            '{' | '}' | '[' | ']' | '=' | ',' => tokens.push(LvmToken::Punct(c)),
            c if c.is_whitespace() => {}
            c => {
                let mut word = String::from(c);
                while let Some(&next) = chars.peek() {
                    if next.is_whitespace() || "{}[]=,#\"".contains(next) {
                        break;
                    }
                    word.push(next);
                    chars.next();
                }
                tokens.push(LvmToken::Word(word));
            }
        }
    }
    tokens
}

/// The patterns of `devices { global_filter = [ ... ] }` (the last setting wins, as in LVM),
/// or `None` when no devices section sets it. Commented-out lines do not count.
pub(super) fn lvm_global_filter(text: &str) -> Option<Vec<String>> {
    let tokens = lvm_tokens(text);
    let mut sections: Vec<String> = Vec::new();
    let mut found = None;
    let mut at = 0;
    while let Some(token) = tokens.get(at) {
        at += 1;
        match token {
            LvmToken::Word(word) if tokens.get(at) == Some(&LvmToken::Punct('{')) => {
                sections.push(word.clone());
                at += 1;
            }
            LvmToken::Punct('}') => {
                sections.pop();
            }
            LvmToken::Word(word)
                if word == "global_filter"
                    && sections.len() == 1
                    && sections.first().is_some_and(|s| s == "devices")
                    && tokens.get(at) == Some(&LvmToken::Punct('=')) =>
            {
                at += 1;
                let mut patterns = Vec::new();
                match tokens.get(at) {
                    Some(LvmToken::Text(single)) => {
                        patterns.push(single.clone());
                        at += 1;
                    }
                    Some(LvmToken::Punct('[')) => {
                        at += 1;
                        while let Some(token) = tokens.get(at) {
                            at += 1;
                            match token {
                                LvmToken::Text(pattern) => patterns.push(pattern.clone()),
                                LvmToken::Punct(']') => break,
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
                found = Some(patterns);
            }
            _ => {}
        }
    }
    found
}
