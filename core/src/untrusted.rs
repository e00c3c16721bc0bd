//! Text from a peer that is not trusted (a restored guest, and for the controller the node too), made safe to put in a log line, a reply, the journal or a terminal.
//!
//! The node passes what a guest says (a probe's answer, libguestfs inspection of its disk)
//! through it before the text reaches a reply or the journal; the controller again wherever it
//! prints a node's or a guest's text for a person. Every such string passes through
//! [`printable`]: invalid UTF-8 is replaced, control and other non-printable characters (C0 and
//! C1 controls, bidirectional overrides; and the backslash) are escaped as Rust escapes them
//! (`\n`, `\u{1b}`), and the result is cut to a number of characters with what was left out
//! counted, so a guest can neither forge log lines or terminal sequences nor grow a record.

/// Characters kept of one guest-derived value (a banner, an LDAP value, a DNS answer).
pub const MAX_VALUE_CHARS: usize = 256;

/// Characters kept of one whole probe detail, all its values together.
pub const MAX_DETAIL_CHARS: usize = 2048;

/// `bytes` as escaped text of at most `max_chars` characters (plus a marker counting the bytes
/// left out).
pub fn printable(bytes: &[u8], max_chars: usize) -> String {
    escaped(&String::from_utf8_lossy(bytes), max_chars, true)
}

/// [`printable`] for text that may already be escaped (a reason the runner escaped, stored and
/// shown again): backslashes are kept as they are, so escaping it again changes nothing, while
/// every character a terminal would act on is still escaped and the text still cut.
pub fn printable_again(text: &str, max_chars: usize) -> String {
    escaped(text, max_chars, false)
}

fn escaped(text: &str, max_chars: usize, escape_backslash: bool) -> String {
    let mut out = String::new();
    let mut kept_chars = 0usize;
    for (offset, c) in text.char_indices() {
        let escaped: String = if c == '"' || c == '\'' || (c == '\\' && !escape_backslash) {
            c.to_string()
        } else {
            c.escape_debug().collect()
        };
        let width = escaped.chars().count();
        if kept_chars + width > max_chars {
            let left = text.len().saturating_sub(offset);
            out.push_str(&format!("…[{left} more bytes]"));
            return out;
        }
        kept_chars += width;
        out.push_str(&escaped);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_caps() {
        assert_eq!(printable(b"SSH-2.0-x", 64), "SSH-2.0-x");
        assert_eq!(
            printable(b"a\nFAKE LOG\x1b[31m\\\"", 64),
            "a\\nFAKE LOG\\u{1b}[31m\\\\\""
        );
        assert_eq!(printable(b"\xff\xfe", 64), "\u{fffd}\u{fffd}");
        assert_eq!(printable(&[b'x'; 10], 4), "xxxx…[6 more bytes]");
        // An escape is kept whole or not at all.
        assert_eq!(printable(b"ab\x07", 4), "ab…[1 more bytes]");
        // Bidirectional overrides would reorder what an operator reads.
        assert_eq!(printable("a\u{202e}b".as_bytes(), 64), "a\\u{202e}b");
        // C1 controls: U+009B is CSI to a terminal that reads them.
        assert_eq!(printable("a\u{9b}2J".as_bytes(), 64), "a\\u{9b}2J");
        // Clipboard (OSC 52) and hyperlink (OSC 8) sequences keep none of their controls.
        assert_eq!(
            printable(b"\x1b]52;c;aGk=\x07\x1b]8;;http://x\x1b\\", 128),
            "\\u{1b}]52;c;aGk=\\u{7}\\u{1b}]8;;http://x\\u{1b}\\\\"
        );
        assert!(!printable(&[0u8; 4096], MAX_VALUE_CHARS).contains('\0'));
        assert!(printable(&[0u8; 4096], MAX_VALUE_CHARS).chars().count() < MAX_VALUE_CHARS + 32);
    }
}
