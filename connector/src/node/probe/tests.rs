//! Tests of the probes: LDAP answers decoded from what a server encodes, the bounded stream.

use super::ldap::{LdapAnswer, ber, ldap_answer};
use super::socket::Bounded;
use ldap3_proto::proto::{
    LdapMsg, LdapOp, LdapPartialAttribute, LdapResult, LdapResultCode, LdapSearchResultEntry,
};
use std::sync::atomic::Ordering;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::Encoder;

fn encoded(message: LdapMsg) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    ldap3_proto::LdapCodec::new(None, None)
        .encode(message, &mut out)
        .unwrap();
    out.to_vec()
}

#[test]
fn ldap_answers_decode_from_what_a_server_encodes() {
    let entry = encoded(LdapMsg::new(
        2,
        LdapOp::SearchResultEntry(LdapSearchResultEntry {
            dn: String::new(),
            attributes: vec![
                LdapPartialAttribute {
                    atype: "objectClass".into(),
                    vals: vec![b"top".to_vec()],
                },
                LdapPartialAttribute {
                    atype: "namingContexts".into(),
                    vals: vec![b"dc=example,dc=test".to_vec(), vec![0x1b, b'x']],
                },
            ],
        }),
    ));
    let (message, rest) = ber(&entry).unwrap();
    assert!(rest.is_empty());
    assert_eq!(message.tag, 0x30);
    assert_eq!(
        ldap_answer(message.body),
        Some((
            2,
            LdapAnswer::Entry {
                naming_contexts: vec![b"dc=example,dc=test".as_slice(), &[0x1b, b'x']]
            }
        ))
    );
    let done = encoded(LdapMsg::new(
        2,
        LdapOp::SearchResultDone(LdapResult {
            code: LdapResultCode::InsufficentAccessRights,
            matcheddn: String::new(),
            message: "no".into(),
            referral: vec![],
        }),
    ));
    let (message, _) = ber(&done).unwrap();
    assert_eq!(
        ldap_answer(message.body),
        Some((
            2,
            LdapAnswer::Result {
                code: 50,
                message: b"no"
            }
        ))
    );
    // Lengths past the input, indefinite or over four bytes are refused, not guessed.
    assert_eq!(ber(&[0x30, 0x05, 0x02]), None);
    assert_eq!(ber(&[0x30, 0x80, 0x00, 0x00]), None);
    assert_eq!(ber(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
}

#[tokio::test]
async fn a_bounded_stream_stops_at_its_budget() {
    let (mut writer, reader) = tokio::io::duplex(64 * 1024);
    writer.write_all(&[7u8; 5000]).await.unwrap();
    let mut bounded = Bounded::new(reader, 4096);
    let mut sink = Vec::new();
    let error = bounded.read_to_end(&mut sink).await.unwrap_err();
    assert_eq!(sink.len(), 4096);
    assert!(error.to_string().contains("budget"));
    assert!(bounded.exceeded.load(Ordering::SeqCst));
}
