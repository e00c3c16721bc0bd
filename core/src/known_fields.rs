//! Refuses signed messages that carry fields this build does not know.
//!
//! prost drops unknown fields while decoding, so a grant from a newer controller would be
//! accepted with its new fields silently ignored — and a new field may be a restriction that an
//! older node must not drop. Before a signed grant is decoded, its exact signed bytes are walked
//! tag by tag against the compiled surface descriptor: every field number must be declared for
//! its message, carry the wire type its declared type implies, and (unless repeated) occur
//! once; nested messages are walked the same way.
//!
//! Walking the wire format is chosen over re-encoding the decoded message and comparing bytes:
//! protobuf lets an encoder order fields freely and write packed or unpacked repeated scalars,
//! so a grant minted by another, correct implementation could differ from prost's re-encoding
//! without carrying anything unknown. The walk refuses exactly what is unknown or ambiguous.

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorProto};
use std::collections::BTreeSet;
use std::sync::OnceLock;

/// Nesting deeper than this is refused; the surface nests three levels at most.
const MAX_DEPTH: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownFieldError {
    #[error(
        "{message} carries field number {number}, which this connector does not know; a newer controller may have added a restriction this node cannot enforce: upgrade the connector"
    )]
    Unknown { message: String, number: u64 },
    #[error("{message} carries field {field} more than once; each field must be stated once")]
    Repeated { message: String, field: String },
    #[error("{message}.{field} has wire type {found}, its declared type needs {expected}")]
    WireType {
        message: String,
        field: String,
        found: u64,
        expected: &'static str,
    },
    #[error("{message} is not well-formed protobuf: {reason}")]
    Malformed { message: String, reason: String },
    #[error("the compiled surface lacks message {0}; the build is inconsistent")]
    NoDescriptor(String),
}

/// Checks that `bytes`, an encoding of the surface message `full_name` (e.g.
/// `.certistack.connector.v1.RunGrant`), carries only fields the compiled surface declares.
pub fn check(full_name: &str, bytes: &[u8]) -> Result<(), UnknownFieldError> {
    // Decoded once: every stored grant is checked again when the daemon starts.
    static SURFACE: OnceLock<Option<FileDescriptorProto>> = OnceLock::new();
    let file = SURFACE
        .get_or_init(|| FileDescriptorProto::decode(certistack_proto::SURFACE_DESCRIPTOR).ok())
        .as_ref()
        .ok_or_else(|| UnknownFieldError::NoDescriptor(full_name.to_owned()))?;
    walk(file, full_name, bytes, 0)
}

fn find_message<'a>(file: &'a FileDescriptorProto, full_name: &str) -> Option<&'a DescriptorProto> {
    let local = full_name.strip_prefix('.')?.strip_prefix(file.package())?;
    let mut path = local.strip_prefix('.')?.split('.');
    let top = path.next()?;
    let mut message = file.message_type.iter().find(|m| m.name() == top)?;
    for name in path {
        message = message.nested_type.iter().find(|m| m.name() == name)?;
    }
    Some(message)
}

struct Reader<'a> {
    bytes: &'a [u8],
    message: &'a str,
}

impl<'a> Reader<'a> {
    fn malformed(&self, reason: &str) -> UnknownFieldError {
        UnknownFieldError::Malformed {
            message: self.message.to_owned(),
            reason: reason.to_owned(),
        }
    }

    fn varint(&mut self) -> Result<u64, UnknownFieldError> {
        let mut value = 0u64;
        for index in 0..10u32 {
            let (&byte, rest) = self
                .bytes
                .split_first()
                .ok_or_else(|| self.malformed("truncated varint"))?;
            self.bytes = rest;
            value |= u64::from(byte & 0x7f) << (7 * index);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.malformed("varint longer than 10 bytes"))
    }

    fn take(&mut self, len: u64) -> Result<&'a [u8], UnknownFieldError> {
        let len = usize::try_from(len).map_err(|_| self.malformed("length out of range"))?;
        if len > self.bytes.len() {
            return Err(self.malformed("length runs past the end"));
        }
        let (taken, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(taken)
    }
}

fn expected_wire_type(kind: Type, repeated: bool) -> Option<(&'static [u64], &'static str)> {
    match kind {
        Type::Double | Type::Fixed64 | Type::Sfixed64 => Some((&[1], "64-bit")),
        Type::Float | Type::Fixed32 | Type::Sfixed32 => Some((&[5], "32-bit")),
        Type::Int32
        | Type::Int64
        | Type::Uint32
        | Type::Uint64
        | Type::Sint32
        | Type::Sint64
        | Type::Bool
        | Type::Enum => {
            if repeated {
                Some((&[0, 2], "varint or packed"))
            } else {
                Some((&[0], "varint"))
            }
        }
        Type::String | Type::Bytes | Type::Message => Some((&[2], "length-delimited")),
        Type::Group => None,
    }
}

fn walk(
    file: &FileDescriptorProto,
    full_name: &str,
    bytes: &[u8],
    depth: usize,
) -> Result<(), UnknownFieldError> {
    let message = find_message(file, full_name)
        .ok_or_else(|| UnknownFieldError::NoDescriptor(full_name.to_owned()))?;
    let name = message.name();
    let mut reader = Reader {
        bytes,
        message: name,
    };
    if depth > MAX_DEPTH {
        return Err(reader.malformed("nested too deeply"));
    }
    let mut seen = BTreeSet::new();
    while !reader.bytes.is_empty() {
        let tag = reader.varint()?;
        let (number, wire_type) = (tag >> 3, tag & 7);
        let field = message
            .field
            .iter()
            .find(|f| u64::try_from(f.number()).ok() == Some(number))
            .ok_or_else(|| UnknownFieldError::Unknown {
                message: name.to_owned(),
                number,
            })?;
        let repeated = field.label() == Label::Repeated;
        let wrong_type = |expected| UnknownFieldError::WireType {
            message: name.to_owned(),
            field: field.name().to_owned(),
            found: wire_type,
            expected,
        };
        let (allowed, expected) =
            expected_wire_type(field.r#type(), repeated).ok_or_else(|| wrong_type("no groups"))?;
        if !allowed.contains(&wire_type) {
            return Err(wrong_type(expected));
        }
        if !repeated && !seen.insert(number) {
            return Err(UnknownFieldError::Repeated {
                message: name.to_owned(),
                field: field.name().to_owned(),
            });
        }
        match wire_type {
            0 => {
                reader.varint()?;
            }
            1 => {
                reader.take(8)?;
            }
            5 => {
                reader.take(4)?;
            }
            _ => {
                let len = reader.varint()?;
                let payload = reader.take(len)?;
                if field.r#type() == Type::Message {
                    walk(file, field.type_name(), payload, depth + 1)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::full_wire_grant;

    const GRANT: &str = ".certistack.connector.v1.RunGrant";

    fn varint(mut value: u64, out: &mut Vec<u8>) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn length_delimited(number: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint(number << 3 | 2, &mut out);
        varint(payload.len() as u64, &mut out);
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn a_grant_of_known_fields_passes() {
        check(GRANT, &full_wire_grant().encode_to_vec()).unwrap();
    }

    #[test]
    fn unknown_fields_are_refused_at_any_depth() {
        let mut top = full_wire_grant().encode_to_vec();
        top.extend(length_delimited(99, b"only-on-weekdays"));
        assert_eq!(
            check(GRANT, &top),
            Err(UnknownFieldError::Unknown {
                message: "RunGrant".into(),
                number: 99
            })
        );

        // A field unknown to the nested SandboxVm message, inside a well-formed grant.
        let mut vm = pb_sandbox_vm();
        let mut extra = Vec::new();
        varint(4 << 3, &mut extra);
        varint(1, &mut extra);
        vm.extend(extra);
        let mut wire = full_wire_grant();
        wire.sandbox_vms.clear();
        let mut bytes = wire.encode_to_vec();
        bytes.extend(length_delimited(9, &vm));
        assert_eq!(
            check(GRANT, &bytes),
            Err(UnknownFieldError::Unknown {
                message: "SandboxVm".into(),
                number: 4
            })
        );
    }

    fn pb_sandbox_vm() -> Vec<u8> {
        certistack_proto::v1::SandboxVm {
            vmid: 9100,
            max_cores: 2,
            max_memory_mib: 2048,
        }
        .encode_to_vec()
    }

    #[test]
    fn field_order_is_free_but_singular_fields_occur_once() {
        // Another encoder may write fields in any order: still the same known fields.
        let wire = full_wire_grant();
        let mut reordered = length_delimited(13, &wire.qga_assertions[0].encode_to_vec());
        let mut rest = wire.clone();
        rest.qga_assertions.clear();
        reordered.extend(rest.encode_to_vec());
        check(GRANT, &reordered).unwrap();

        let mut twice = wire.encode_to_vec();
        twice.extend(length_delimited(3, b"pve2"));
        assert!(matches!(
            check(GRANT, &twice),
            Err(UnknownFieldError::Repeated { field, .. }) if field == "node"
        ));
    }

    #[test]
    fn wrong_wire_types_and_truncation_are_refused() {
        let mut bytes = Vec::new();
        varint(1 << 3 | 2, &mut bytes); // version as a length-delimited field
        varint(0, &mut bytes);
        assert!(matches!(
            check(GRANT, &bytes),
            Err(UnknownFieldError::WireType { .. })
        ));
        let mut bytes = full_wire_grant().encode_to_vec();
        bytes.pop();
        assert!(matches!(
            check(GRANT, &bytes),
            Err(UnknownFieldError::Malformed { .. })
        ));
        // Field 3 (node) with wire type 7, which protobuf does not define.
        assert!(matches!(
            check(GRANT, &[0x1f]),
            Err(UnknownFieldError::WireType { found: 7, .. })
        ));
    }
}
