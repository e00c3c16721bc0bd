//! The DNS probe: one query over UDP from the probe address, its answer records bounded and
//! escaped.

use super::{ProbeBounds, ProbeResult, digest};
use certistack_core::grant::Expectation;
use certistack_core::untrusted::{MAX_VALUE_CHARS, printable};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use tokio::net::UdpSocket;

fn dns_type(kind: certistack_proto::v1::DnsRecordType) -> hickory_proto::rr::RecordType {
    use certistack_proto::v1::DnsRecordType as T;
    use hickory_proto::rr::RecordType;
    match kind {
        T::Aaaa => RecordType::AAAA,
        T::Cname => RecordType::CNAME,
        T::Mx => RecordType::MX,
        T::Txt => RecordType::TXT,
        T::Srv => RecordType::SRV,
        T::Ptr => RecordType::PTR,
        T::A | T::Unspecified => RecordType::A,
    }
}

pub(super) async fn dns(
    source: IpAddr,
    target: SocketAddr,
    expect: &Expectation,
    bounds: &ProbeBounds,
    started: Instant,
) -> ProbeResult {
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::Name;
    let Some(name) = &expect.dns_name else {
        return ProbeResult::failed(
            "the grant names no DNS query for this target",
            started.elapsed(),
        );
    };
    let record_type = dns_type(
        expect
            .dns_type
            .unwrap_or(certistack_proto::v1::DnsRecordType::A),
    );
    let query_name = match Name::from_ascii(name.as_str()) {
        Ok(n) => n,
        Err(error) => {
            return ProbeResult::failed(format!("query name {name}: {error}"), started.elapsed());
        }
    };
    let mut message = Message::query();
    message.add_query(Query::query(query_name, record_type));
    message.metadata.recursion_desired = true;
    let id = message.metadata.id;
    let bytes = match message.to_vec() {
        Ok(bytes) => bytes,
        Err(error) => {
            return ProbeResult::failed(
                format!("cannot encode the query: {error}"),
                started.elapsed(),
            );
        }
    };
    let socket = match UdpSocket::bind(SocketAddr::new(source, 0)).await {
        Ok(socket) => socket,
        Err(error) => {
            return ProbeResult::failed(
                format!("cannot bind {source}: {error}"),
                started.elapsed(),
            );
        }
    };
    if let Err(error) = socket.bind_device(Some(bounds.device.as_bytes())) {
        return ProbeResult::failed(
            format!("cannot bind the probe socket to {}: {error}", bounds.device),
            started.elapsed(),
        );
    }
    if let Err(error) = socket.send_to(&bytes, target).await {
        return ProbeResult::failed(
            format!("sending to {target} failed: {error}"),
            started.elapsed(),
        );
    }
    // One datagram is at most 64 KiB; every datagram that arrives, the target's or a spoofer's,
    // counts against the probe's byte budget.
    let mut buffer = vec![0u8; 65_535];
    let mut read_total = 0usize;
    let received = loop {
        match socket.recv_from(&mut buffer).await {
            Ok((n, from)) => {
                read_total = read_total.saturating_add(n);
                if read_total > bounds.max_bytes {
                    return ProbeResult::failed(bounds.bytes_exceeded(target), started.elapsed());
                }
                if from == target {
                    break buffer.get(..n).unwrap_or_default();
                }
            }
            Err(error) => {
                return ProbeResult::failed(
                    format!("receiving from {target} failed: {error}"),
                    started.elapsed(),
                );
            }
        }
    };
    let latency = started.elapsed();
    // The header announces how many records follow; refuse to decode more than the cap.
    let announced = |at: usize| match (received.get(at), received.get(at + 1)) {
        (Some(high), Some(low)) => usize::from(u16::from_be_bytes([*high, *low])),
        _ => 0,
    };
    let records = announced(6) + announced(8) + announced(10);
    if records > bounds.max_entries {
        let mut result = ProbeResult::failed(
            format!(
                "{}: the answer announces {records} records",
                bounds.entries_exceeded(target, "DNS records")
            ),
            latency,
        );
        result.received_sha256 = digest(received);
        return result;
    }
    let answer = match Message::from_vec(received) {
        Ok(answer) if answer.metadata.id == id => answer,
        Ok(_) => return ProbeResult::failed("the answer's id does not match the query", latency),
        Err(error) => {
            return ProbeResult::failed(
                format!(
                    "the answer does not decode: {}",
                    printable(error.to_string().as_bytes(), MAX_VALUE_CHARS)
                ),
                latency,
            );
        }
    };
    let mut answers: Vec<String> = answer
        .answers
        .iter()
        .filter(|r| r.record_type() == record_type)
        .map(|r| r.data.to_string())
        .collect();
    answers.sort();
    let mut expected: Vec<String> = expect
        .dns_answers
        .iter()
        .map(|a| a.as_str().to_owned())
        .collect();
    expected.sort();
    let code = answer.metadata.response_code;
    let passed = if expected.is_empty() {
        !answers.is_empty()
    } else {
        answers == expected
    };
    let shown: Vec<String> = answers
        .iter()
        .map(|a| format!("\"{}\"", printable(a.as_bytes(), MAX_VALUE_CHARS)))
        .collect();
    ProbeResult {
        passed,
        detail: format!(
            "{code} {record_type} {name}: [{}]{}",
            shown.join(", "),
            if passed || expected.is_empty() {
                String::new()
            } else {
                format!(", expected {expected:?}")
            }
        ),
        latency,
        received_sha256: digest(received),
        tls_certificate_sha256: String::new(),
    }
}
