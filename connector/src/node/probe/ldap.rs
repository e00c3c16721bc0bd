//! The LDAP probe: an anonymous bind and a base search of the root DSE, read with a small BER
//! decoder that checks every length against the budget.

use super::socket::{Bounded, connect, connect_failed};
use super::{ProbeBounds, ProbeResult};
use certistack_core::grant::Expectation;
use certistack_core::untrusted::{MAX_VALUE_CHARS, printable};
use sha2::{Digest, Sha256};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// One BER element (definite length, low tag numbers: all LDAP needs): its tag and contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ber<'a> {
    pub(super) tag: u8,
    pub(super) body: &'a [u8],
}

/// The length that follows a tag: `(length, bytes it took)`, or `None` when it is indefinite,
/// longer than four bytes or not all there.
fn ber_length(input: &[u8]) -> Option<(usize, usize)> {
    let first = *input.first()?;
    if first < 0x80 {
        return Some((usize::from(first), 1));
    }
    let count = usize::from(first & 0x7f);
    if count == 0 || count > 4 {
        return None;
    }
    let bytes = input.get(1..=count)?;
    let length = bytes
        .iter()
        .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
    Some((length, 1 + count))
}

/// Splits one element off the front of `input`.
pub(super) fn ber(input: &[u8]) -> Option<(Ber<'_>, &[u8])> {
    let tag = *input.first()?;
    if tag & 0x1f == 0x1f {
        return None;
    }
    let (length, taken) = ber_length(input.get(1..)?)?;
    let start = 1 + taken;
    let body = input.get(start..start.checked_add(length)?)?;
    let rest = input.get(start + length..)?;
    Some((Ber { tag, body }, rest))
}

/// Every element inside a constructed element, in order; `None` if one is malformed.
fn ber_children(mut body: &[u8]) -> Option<Vec<Ber<'_>>> {
    let mut children = Vec::new();
    while !body.is_empty() {
        let (child, rest) = ber(body)?;
        children.push(child);
        body = rest;
    }
    Some(children)
}

fn ber_uint(body: &[u8]) -> Option<u64> {
    if body.is_empty() || body.len() > 8 {
        return None;
    }
    Some(body.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// The parts of an LDAP answer the probe looks at (RFC 4511 section 4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LdapAnswer<'a> {
    /// BindResponse or SearchResultDone: the result code and the diagnostic message.
    Result { code: u64, message: &'a [u8] },
    /// SearchResultEntry: the values of `namingContexts`.
    Entry { naming_contexts: Vec<&'a [u8]> },
    /// Any other operation, by its tag.
    Other(u8),
}

const LDAP_BIND_RESPONSE: u8 = 0x61;
const LDAP_SEARCH_RESULT_ENTRY: u8 = 0x64;
const LDAP_SEARCH_RESULT_DONE: u8 = 0x65;

/// Decodes one LDAPMessage's contents: `(messageID, operation)`.
pub(super) fn ldap_answer(message: &[u8]) -> Option<(u64, LdapAnswer<'_>)> {
    let children = ber_children(message)?;
    let id = children.first().filter(|c| c.tag == 0x02)?;
    let id = ber_uint(id.body)?;
    let op = children.get(1)?;
    let answer = match op.tag {
        LDAP_BIND_RESPONSE | LDAP_SEARCH_RESULT_DONE => {
            let parts = ber_children(op.body)?;
            let code = ber_uint(parts.first().filter(|p| p.tag == 0x0a)?.body)?;
            let message = parts.get(2).filter(|p| p.tag == 0x04)?.body;
            LdapAnswer::Result { code, message }
        }
        LDAP_SEARCH_RESULT_ENTRY => {
            let parts = ber_children(op.body)?;
            let attributes = parts.get(1).filter(|p| p.tag == 0x30)?;
            let mut naming_contexts = Vec::new();
            for attribute in ber_children(attributes.body)? {
                let fields = ber_children(attribute.body)?;
                let name = fields.first().filter(|f| f.tag == 0x04)?.body;
                if !name.eq_ignore_ascii_case(b"namingContexts") {
                    continue;
                }
                let values = fields.get(1).filter(|f| f.tag == 0x31)?;
                for value in ber_children(values.body)? {
                    naming_contexts.push(value.body);
                }
            }
            LdapAnswer::Entry { naming_contexts }
        }
        other => LdapAnswer::Other(other),
    };
    Some((id, answer))
}

/// Reads one whole LDAPMessage (its SEQUENCE contents); the length it announces is checked
/// against the budget before anything is allocated for it.
async fn read_ldap_message<S: AsyncRead + Unpin>(
    stream: &mut Bounded<S>,
    max_bytes: usize,
) -> Result<Vec<u8>, String> {
    let mut head = [0u8; 2];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
    let [tag, first] = head;
    if tag != 0x30 {
        return Err(format!(
            "the answer is not an LDAP message (tag {tag:#04x})"
        ));
    }
    let mut length_bytes = vec![first];
    if first >= 0x80 {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return Err("the answer uses a BER length LDAP does not allow".into());
        }
        let mut rest = vec![0u8; count];
        stream
            .read_exact(&mut rest)
            .await
            .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
        length_bytes.extend_from_slice(&rest);
    }
    let (length, _) = ber_length(&length_bytes).ok_or("the answer's BER length is malformed")?;
    if length > stream.remaining.min(max_bytes) {
        stream.exceeded.store(true, Ordering::SeqCst);
        return Err(format!("an LDAP message announces {length} bytes"));
    }
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| format!("reading an LDAP message failed: {e}"))?;
    Ok(body)
}

fn ldap_result_code(code: u64) -> String {
    match code {
        0 => "success".into(),
        49 => "invalidCredentials (49)".into(),
        50 => "insufficientAccessRights (50)".into(),
        other => format!("result code {other}"),
    }
}

pub(super) async fn ldap(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    use ldap3_proto::proto::{
        LdapBindCred, LdapBindRequest, LdapDerefAliases, LdapFilter, LdapMsg, LdapOp,
        LdapSearchRequest, LdapSearchScope,
    };
    use tokio_util::codec::Encoder;
    let mut stream = match connect(source, target, &bounds.device).await {
        Ok(stream) => Bounded::new(stream, bounds.max_bytes),
        Err(error) => return connect_failed(target, &error, started),
    };
    let exceeded = stream.exceeded.clone();
    // Requests are encoded with ldap3_proto; answers are decoded here, under the probe's byte
    // and entry budget, without logging anything the guest sent.
    let mut codec = ldap3_proto::LdapCodec::new(None, None);
    let mut requests = bytes::BytesMut::new();
    let bind = LdapMsg::new(
        1,
        LdapOp::BindRequest(LdapBindRequest {
            version: 3,
            dn: String::new(),
            cred: LdapBindCred::Simple(String::new()),
        }),
    );
    let search = LdapMsg::new(
        2,
        LdapOp::SearchRequest(LdapSearchRequest {
            base: String::new(),
            scope: LdapSearchScope::Base,
            aliases: LdapDerefAliases::Never,
            sizelimit: 1,
            timelimit: 0,
            typesonly: false,
            filter: LdapFilter::Present("objectClass".into()),
            attrs: vec!["namingContexts".into()],
        }),
    );
    let fail = |reason: String, latency: Duration| {
        if exceeded.load(Ordering::SeqCst) {
            ProbeResult::failed(
                format!("{}: {reason}", bounds.bytes_exceeded(target)),
                latency,
            )
        } else {
            ProbeResult::failed(reason, latency)
        }
    };
    if let Err(error) = codec.encode(bind, &mut requests) {
        return fail(
            format!("cannot encode the bind: {error}"),
            started.elapsed(),
        );
    }
    if let Err(error) = stream.inner.write_all(&requests).await {
        return fail(
            format!("sending the bind failed: {error}"),
            started.elapsed(),
        );
    }
    let mut received = Sha256::new();
    let answer = match read_ldap_message(&mut stream, bounds.max_bytes).await {
        Ok(answer) => answer,
        Err(reason) => return fail(reason, started.elapsed()),
    };
    match ldap_answer(&answer) {
        Some((1, LdapAnswer::Result { code: 0, .. })) => received.update(b"bind:success"),
        Some((1, LdapAnswer::Result { code, message })) => {
            return fail(
                format!(
                    "anonymous bind refused: {} \"{}\"",
                    ldap_result_code(code),
                    printable(message, MAX_VALUE_CHARS)
                ),
                started.elapsed(),
            );
        }
        Some((id, other)) => {
            let what = match other {
                LdapAnswer::Other(tag) => format!("operation tag {tag:#04x}"),
                LdapAnswer::Entry { .. } => "a search result entry".into(),
                LdapAnswer::Result { .. } => "a result".into(),
            };
            return fail(
                format!("unexpected answer to the bind: {what} for message {id}"),
                started.elapsed(),
            );
        }
        None => return fail("the bind answer does not decode".into(), started.elapsed()),
    }
    let latency = started.elapsed();
    requests.clear();
    if let Err(error) = codec.encode(search, &mut requests) {
        return fail(
            format!("cannot encode the root DSE search: {error}"),
            latency,
        );
    }
    if let Err(error) = stream.inner.write_all(&requests).await {
        return fail(
            format!("sending the root DSE search failed: {error}"),
            latency,
        );
    }
    let wanted = expect
        .ldap_naming_context
        .as_ref()
        .map(|e| e.as_str().as_bytes());
    let mut contexts: Vec<String> = Vec::new();
    let mut matched = false;
    let mut any = false;
    let mut messages = 0usize;
    loop {
        messages += 1;
        if messages > bounds.max_entries {
            return fail(bounds.entries_exceeded(target, "LDAP messages"), latency);
        }
        let message = match read_ldap_message(&mut stream, bounds.max_bytes).await {
            Ok(message) => message,
            Err(reason) => return fail(reason, latency),
        };
        match ldap_answer(&message) {
            Some((2, LdapAnswer::Entry { naming_contexts })) => {
                for value in naming_contexts {
                    received.update(value);
                    any = true;
                    matched |= wanted.is_some_and(|w| w.eq_ignore_ascii_case(value));
                    contexts.push(format!("\"{}\"", printable(value, MAX_VALUE_CHARS)));
                }
            }
            Some((2, LdapAnswer::Result { code: 0, .. })) => break,
            Some((2, LdapAnswer::Result { code, message })) => {
                return fail(
                    format!(
                        "root DSE search failed: {} \"{}\"",
                        ldap_result_code(code),
                        printable(message, MAX_VALUE_CHARS)
                    ),
                    latency,
                );
            }
            // Referrals, intermediate responses, notices: counted, not kept.
            Some(_) => {}
            None => return fail("the search answer does not decode".into(), latency),
        }
    }
    let _ = stream
        .inner
        .write_all(&[0x30, 0x05, 0x02, 0x01, 0x03, 0x42, 0x00])
        .await;
    let passed = match wanted {
        Some(_) => matched,
        None => any,
    };
    let listed = contexts.join(", ");
    ProbeResult {
        passed,
        detail: match (&expect.ldap_naming_context, passed) {
            (Some(expected), false) => {
                format!("namingContexts [{listed}] lack {:?}", expected.as_str())
            }
            _ => format!("namingContexts [{listed}]"),
        },
        latency,
        received_sha256: hex::encode(received.finalize()),
        tls_certificate_sha256: String::new(),
    }
}
