//! Validators for every string and bytes field that reaches the connector.
//!
//! Each wire string is parsed exactly once, at the edge, into a newtype whose constructor is
//! the validator; nothing downstream sees a raw string. `policy/field-validators.toml` names
//! the validator of every input field, and a test checks that the parse layer applies exactly
//! those validators (see [`field`]). The grammars are deliberately narrower than what Proxmox
//! accepts where a sandbox run never needs more: an object name can never contain `/`, `..`,
//! whitespace or control characters, so it can never become a path or a shell fragment.

use std::fmt;
use std::net::IpAddr;

/// A field that failed its validator: names the field, the rule and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}` is invalid ({validator}): {reason}")]
pub struct FieldError {
    pub field: &'static str,
    pub validator: &'static str,
    pub reason: String,
}

/// A type whose constructor validates one wire string.
pub trait Validated: Sized {
    /// The validator's name as written in `policy/field-validators.toml`.
    const VALIDATOR: &'static str;
    fn validate(value: &str) -> Result<Self, String>;
}

/// Parses `value` of the wire field `field` (`Message.field`) with `T`'s validator.
pub fn field<T: Validated>(field: &'static str, value: &str) -> Result<T, FieldError> {
    usage::record(field, T::VALIDATOR);
    T::validate(value).map_err(|reason| FieldError {
        field,
        validator: T::VALIDATOR,
        reason,
    })
}

/// Checks a bytes field against a size bound; the name is recorded like a string validator.
pub fn bytes_field<'a>(
    field: &'static str,
    validator: &'static str,
    value: &'a [u8],
    min: usize,
    max: usize,
) -> Result<&'a [u8], FieldError> {
    usage::record(field, validator);
    if value.len() < min || value.len() > max {
        return Err(FieldError {
            field,
            validator,
            reason: format!("length {} is outside {min}..={max} bytes", value.len()),
        });
    }
    Ok(value)
}

/// Rejects a repeated field with more than `max` entries before any entry is parsed.
pub fn bounded_count<T>(field: &'static str, values: &[T], max: usize) -> Result<(), FieldError> {
    if values.len() > max {
        return Err(FieldError {
            field,
            validator: "count",
            reason: format!("{} entries, at most {max} are allowed", values.len()),
        });
    }
    Ok(())
}

/// Records which validator the parse layer applied to which field, so a test can compare the
/// parse layer with `policy/field-validators.toml`. Compiled only into tests (`cfg(test)`, or the `fixtures` feature for
/// the connector's tests, whose parse layer calls these validators).
pub mod usage {
    #[cfg(any(test, feature = "fixtures"))]
    thread_local! {
        static SEEN: std::cell::RefCell<std::collections::BTreeSet<(&'static str, &'static str)>> =
            const { std::cell::RefCell::new(std::collections::BTreeSet::new()) };
    }

    #[cfg(any(test, feature = "fixtures"))]
    pub fn record(field: &'static str, validator: &'static str) {
        SEEN.with(|seen| seen.borrow_mut().insert((field, validator)));
    }

    #[cfg(not(any(test, feature = "fixtures")))]
    #[inline(always)]
    pub fn record(_field: &'static str, _validator: &'static str) {}

    #[cfg(any(test, feature = "fixtures"))]
    pub fn take() -> std::collections::BTreeSet<(&'static str, &'static str)> {
        SEEN.with(|seen| std::mem::take(&mut *seen.borrow_mut()))
    }
}

fn check_len(value: &str, min: usize, max: usize) -> Result<(), String> {
    if value.len() < min {
        return Err(if value.is_empty() {
            "must not be empty".into()
        } else {
            format!("shorter than {min} bytes")
        });
    }
    if value.len() > max {
        return Err(format!("longer than {max} bytes"));
    }
    Ok(())
}

/// `[A-Za-z0-9_][A-Za-z0-9._-]*`: Proxmox's SAFE_ID / BACKUP_ID shape.
fn is_safe_id(value: &str) -> bool {
    let mut chars = value.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphanumeric() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn safe_id(value: &str, what: &str, max: usize) -> Result<(), String> {
    check_len(value, 1, max)?;
    if !is_safe_id(value) {
        return Err(format!(
            "{what} {value:?} must start with a letter, digit or `_` and contain only letters, digits, `_`, `.`, `-`"
        ));
    }
    Ok(())
}

/// Printable text with no control characters (so it cannot split a log line or a protocol line).
fn printable(value: &str, min: usize, max: usize) -> Result<(), String> {
    check_len(value, min, max)?;
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(format!("contains the control character {:?}", c));
    }
    Ok(())
}

macro_rules! string_newtype {
    ($(#[$meta:meta])* $name:ident, $validator:literal, |$v:ident| $check:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Validated for $name {
            const VALIDATOR: &'static str = $validator;
            fn validate($v: &str) -> Result<Self, String> {
                $check?;
                Ok(Self($v.to_owned()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_newtype!(
    /// A run id: a lower-case hyphenated UUID.
    RunId, "run_id", |v| {
        let parsed = uuid::Uuid::try_parse(v).map_err(|e| format!("{v:?} is not a UUID: {e}"))?;
        if parsed.hyphenated().to_string() != v {
            Err(format!("{v:?} must be written lower-case and hyphenated"))
        } else if parsed.is_nil() {
            Err("the nil UUID is not a run id".to_string())
        } else {
            Ok(())
        }
    }
);

string_newtype!(
    /// A PVE node name: one DNS label.
    NodeName, "node_name", |v| {
        check_len(v, 1, 63)?;
        let bytes = v.as_bytes();
        let edge_ok = |b: Option<&u8>| matches!(b, Some(b) if b.is_ascii_alphanumeric());
        if !edge_ok(bytes.first()) || !edge_ok(bytes.last())
            || !bytes.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-')
        {
            Err(format!("{v:?} is not a node name (letters, digits and inner `-`, at most 63)"))
        } else {
            Ok(())
        }
    }
);

string_newtype!(
    /// An exact PBS snapshot: `(vm|ct|host)/<id>/YYYY-MM-DDTHH:MM:SSZ`. A bare group (which PBS
    /// reads as "latest") is refused: a run names exactly what it restores.
    Snapshot, "snapshot", |v| check_snapshot(v)
);

fn check_snapshot(v: &str) -> Result<(), String> {
    check_len(v, 1, 128)?;
    let parts: Vec<&str> = v.split('/').collect();
    let [kind, id, time] = parts.as_slice() else {
        return Err(format!(
            "{v:?} is not `<vm|ct|host>/<id>/<YYYY-MM-DDTHH:MM:SSZ>` (a bare group means \"latest\" and is refused)"
        ));
    };
    if !matches!(*kind, "vm" | "ct" | "host") {
        return Err(format!("backup type {kind:?} must be vm, ct or host"));
    }
    safe_id(id, "backup id", 64)?;
    check_backup_time(time)
}

fn check_backup_time(time: &str) -> Result<(), String> {
    let bad = || format!("backup time {time:?} is not YYYY-MM-DDTHH:MM:SSZ");
    let b = time.as_bytes();
    let shape_ok = b.len() == 20
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'Z',
            _ => c.is_ascii_digit(),
        });
    if !shape_ok {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| -> Result<u32, String> {
        time.get(r).and_then(|s| s.parse().ok()).ok_or_else(bad)
    };
    let month =
        time::Month::try_from(u8::try_from(num(5..7)?).map_err(|_| bad())?).map_err(|_| bad())?;
    let year = i32::try_from(num(0..4)?).map_err(|_| bad())?;
    let day = u8::try_from(num(8..10)?).map_err(|_| bad())?;
    time::Date::from_calendar_date(year, month, day).map_err(|_| bad())?;
    if num(11..13)? > 23 || num(14..16)? > 59 || num(17..19)? > 59 {
        return Err(bad());
    }
    Ok(())
}

string_newtype!(
    /// A PBS VM-disk archive name, e.g. `drive-scsi0.img` (the client appends `.fidx`).
    ArchiveName, "archive", |v| {
        safe_id(v, "archive", 128)?;
        match v.strip_suffix(".img") {
            Some(stem) if !stem.is_empty() => Ok(()),
            _ => Err(format!("archive {v:?} must name a disk image ending in `.img`")),
        }
    }
);

impl ArchiveName {
    /// The archive name without `.img`, used to name the run's overlay file.
    pub fn stem(&self) -> &str {
        self.0.strip_suffix(".img").unwrap_or(&self.0)
    }

    /// Whether the archive holds a VM's firmware state, not a disk: PVE names the archive of
    /// drive `<bus><n>` `drive-<bus><n>.img` (the TPM state's `drive-tpmstate0-backup.img`),
    /// and `efidisk` (EFI vars) and `tpmstate` (TPM state) are buses of their own.
    pub fn holds_firmware_state(&self) -> bool {
        let bus: Option<String> = self.stem().strip_prefix("drive-").map(|drive| {
            drive
                .chars()
                .take_while(|c| c.is_ascii_alphabetic())
                .collect()
        });
        matches!(bus.as_deref(), Some("efidisk" | "tpmstate"))
    }
}

string_newtype!(
    /// A PVE SDN VNet id: at most 8 characters, `[a-zA-Z][a-zA-Z0-9]*`.
    VnetName, "vnet", |v| {
        check_len(v, 1, 8)?;
        let mut chars = v.chars();
        if matches!(chars.next(), Some(c) if c.is_ascii_alphabetic()) && chars.all(|c| c.is_ascii_alphanumeric()) {
            Ok(())
        } else {
            Err(format!("VNet {v:?} must be a letter followed by letters or digits, at most 8"))
        }
    }
);

string_newtype!(
    /// A DNS host name (letters, digits, `-`, dot-separated labels).
    DnsName, "dns_name", |v| check_dns_name(v)
);

fn check_dns_name(v: &str) -> Result<(), String> {
    check_len(v, 1, 253)?;
    let name = v.strip_suffix('.').unwrap_or(v);
    for label in name.split('.') {
        let b = label.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
            && b.first() != Some(&b'-')
            && b.last() != Some(&b'-');
        if !ok {
            return Err(format!("{v:?} is not a DNS name (label {label:?})"));
        }
    }
    Ok(())
}

/// A host: an IP address or a DNS name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    Ip(IpAddr),
    Name(DnsName),
}

impl Validated for Host {
    const VALIDATOR: &'static str = "host";
    fn validate(v: &str) -> Result<Self, String> {
        if let Ok(ip) = v.parse::<IpAddr>() {
            return Ok(Host::Ip(ip));
        }
        check_dns_name(v).map_err(|e| format!("not an IP address, and {e}"))?;
        Ok(Host::Name(DnsName(v.to_owned())))
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Ip(ip) => ip.fmt(f),
            Host::Name(name) => name.fmt(f),
        }
    }
}

/// A unicast IP address that a probe may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnicastIp(pub IpAddr);

impl Validated for UnicastIp {
    const VALIDATOR: &'static str = "ip_address";
    fn validate(v: &str) -> Result<Self, String> {
        let ip: IpAddr = v
            .parse()
            .map_err(|_| format!("{v:?} is not an IP address"))?;
        if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
            return Err(format!("{ip} is not a unicast, non-loopback address"));
        }
        if let IpAddr::V4(v4) = ip
            && v4.is_broadcast()
        {
            return Err(format!("{ip} is the broadcast address"));
        }
        Ok(Self(ip))
    }
}

impl fmt::Display for UnicastIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An address with its prefix length, e.g. `198.51.100.2/24`: the probe source on the VNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpInterface {
    pub address: UnicastIp,
    pub prefix_len: u8,
}

impl Validated for IpInterface {
    const VALIDATOR: &'static str = "ip_interface";
    fn validate(v: &str) -> Result<Self, String> {
        let (addr, prefix) = v
            .split_once('/')
            .ok_or_else(|| format!("{v:?} must be `<address>/<prefix length>`"))?;
        let address = UnicastIp::validate(addr)?;
        let max = if address.0.is_ipv4() { 32 } else { 128 };
        let prefix_len: u8 = prefix
            .parse()
            .ok()
            .filter(|p| (1..=max).contains(p))
            .ok_or_else(|| format!("prefix length {prefix:?} must be 1..={max}"))?;
        Ok(Self {
            address,
            prefix_len,
        })
    }
}

impl fmt::Display for IpInterface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix_len)
    }
}

string_newtype!(
    /// A PBS datastore name (SAFE_ID, at most 32).
    Datastore, "pbs_datastore", |v| safe_id(v, "datastore", 32)
);

string_newtype!(
    /// A PBS namespace: empty (root) or up to 7 `/`-separated SAFE_ID components.
    Namespace, "pbs_namespace", |v| check_namespace(v)
);

fn check_namespace(v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Ok(());
    }
    check_len(v, 0, 256)?;
    let components: Vec<&str> = v.split('/').collect();
    if components.len() > 7 {
        return Err(format!("namespace {v:?} is deeper than 7 levels"));
    }
    components
        .iter()
        .try_for_each(|c| safe_id(c, "namespace component", 32))
}

string_newtype!(
    /// A PBS auth id: `user@realm` or `user@realm!token`.
    AuthId, "pbs_auth_id", |v| {
        check_len(v, 3, 128)?;
        let (user_realm, token) = match v.split_once('!') {
            Some((ur, t)) => (ur, Some(t)),
            None => (v, None),
        };
        let (user, realm) = user_realm
            .rsplit_once('@')
            .ok_or_else(|| format!("auth id {v:?} must be `user@realm` or `user@realm!token`"))?;
        safe_id(user, "user", 64)?;
        safe_id(realm, "realm", 32)?;
        token.map_or(Ok(()), |t| safe_id(t, "token name", 64))
    }
);

/// A SHA-256 certificate fingerprint, `aa:bb:…` (32 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Validated for Fingerprint {
    const VALIDATOR: &'static str = "tls_fingerprint";
    fn validate(v: &str) -> Result<Self, String> {
        let bad = || format!("{v:?} is not a SHA-256 fingerprint (32 hex bytes separated by `:`)");
        let bytes: Vec<u8> = v
            .split(':')
            .map(|pair| {
                if pair.len() == 2 {
                    u8::from_str_radix(pair, 16).map_err(|_| bad())
                } else {
                    Err(bad())
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Self(bytes.try_into().map_err(|_| bad())?))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex: Vec<String> = self.0.iter().map(|b| format!("{b:02x}")).collect();
        f.write_str(&hex.join(":"))
    }
}

/// A secret (the PBS password or API token secret). Held in memory only, zeroized on drop, and
/// never printed: `Debug` is redacted and there is no `Display`.
#[derive(Clone, zeroize::ZeroizeOnDrop)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Validated for Secret {
    const VALIDATOR: &'static str = "secret";
    fn validate(v: &str) -> Result<Self, String> {
        // The reason never quotes the value.
        check_len(v, 1, 4096).map_err(|e| format!("the secret {e}"))?;
        if v.chars().any(|c| c.is_control()) {
            return Err("the secret contains a control character (it is read as one line)".into());
        }
        Ok(Self(v.to_owned()))
    }
}

string_newtype!(
    /// The id of a QGA assertion in the grant.
    AssertionId, "assertion_id", |v| {
        check_len(v, 1, 63)?;
        let mut chars = v.chars();
        let lower_digit = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        if matches!(chars.next(), Some(c) if lower_digit(c)) && chars.all(|c| lower_digit(c) || c == '-' || c == '_') {
            Ok(())
        } else {
            Err(format!("assertion id {v:?} must be lower-case letters, digits, `-`, `_`"))
        }
    }
);

string_newtype!(
    /// An absolute program path inside the guest, as granted for a QGA assertion.
    GuestProgram, "guest_program", |v| {
        printable(v, 2, 256)?;
        if !v.starts_with('/') || v.split('/').any(|c| c == "..") {
            Err(format!("guest program {v:?} must be an absolute path without `..`"))
        } else {
            Ok(())
        }
    }
);

string_newtype!(
    /// One argument of a granted guest program.
    GuestArgument, "guest_argument", |v| printable(v, 0, 1024)
);

string_newtype!(
    /// Free text an expectation compares with (a banner prefix, a body substring, a DN, ...).
    ExpectedText, "expected_text", |v| printable(v, 0, 1024)
);

string_newtype!(
    /// An HTTP request path: `/`, then printable ASCII without spaces.
    HttpPath, "http_path", |v| {
        check_len(v, 1, 1024)?;
        if v.starts_with('/') && v.bytes().all(|b| b.is_ascii_graphic()) {
            Ok(())
        } else {
            Err(format!("HTTP path {v:?} must start with `/` and be printable ASCII without spaces"))
        }
    }
);

string_newtype!(
    /// A lower-case hex SHA-256 digest (64 characters).
    Sha256Hex, "sha256_hex", |v| {
        if v.len() == 64 && v.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(())
        } else {
            Err(format!("{v:?} is not 64 lower-case hex characters"))
        }
    }
);

/// A PVE VMID. PVE accepts 100..=999999999; 0 and the reserved 1..=99 are refused. Written
/// out (by `plan show --json`) as the bare number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Vmid(u32);

impl Vmid {
    pub const MIN: u32 = 100;
    pub const MAX: u32 = 999_999_999;

    pub fn parse(field: &'static str, value: u32) -> Result<Self, FieldError> {
        if (Self::MIN..=Self::MAX).contains(&value) {
            Ok(Self(value))
        } else {
            Err(FieldError {
                field,
                validator: "vmid",
                reason: format!("VMID {value} is outside {}..={}", Self::MIN, Self::MAX),
            })
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Vmid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A TCP/UDP port, 1..=65535.
pub fn port(field: &'static str, value: u32) -> Result<u16, FieldError> {
    u16::try_from(value)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| FieldError {
            field,
            validator: "port",
            reason: format!("port {value} is outside 1..=65535"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok<T: Validated>(v: &str) -> bool {
        T::validate(v).is_ok()
    }

    #[test]
    fn snapshot_grammar() {
        assert!(ok::<Snapshot>("vm/100/2026-11-01T02:00:00Z"));
        assert!(ok::<Snapshot>("ct/9999/2024-02-29T23:59:59Z"));
        assert!(ok::<Snapshot>("host/pve_1.lab/2026-01-01T00:00:00Z"));
        for bad in [
            "",
            "vm/100",
            "vm/100/",
            "vm/100/latest",
            "qemu/100/2026-11-01T02:00:00Z",
            "vm/../2026-11-01T02:00:00Z",
            "vm/100/2026-11-01T02:00:00Z/x",
            "vm/100/2026-13-01T02:00:00Z",
            "vm/100/2025-02-29T02:00:00Z",
            "vm/100/2026-11-01T24:00:00Z",
            "vm/100/2026-11-01T02:00:00",
            "vm/100/2026-11-01 02:00:00Z",
            "vm/ 100/2026-11-01T02:00:00Z",
            "/vm/100/2026-11-01T02:00:00Z",
        ] {
            assert!(!ok::<Snapshot>(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn archive_grammar() {
        assert!(ok::<ArchiveName>("drive-scsi0.img"));
        let firmware = |name: &str| ArchiveName::validate(name).unwrap().holds_firmware_state();
        assert!(firmware("drive-efidisk0.img") && firmware("drive-tpmstate0.img"));
        assert!(
            firmware("drive-tpmstate0-backup.img"),
            "the TPM archive PBS writes"
        );
        for disk in [
            "drive-scsi0.img",
            "drive-virtio1.img",
            "drive-sata0.img",
            "efidisk0.img",
        ] {
            assert!(!firmware(disk), "{disk}");
        }
        assert_eq!(
            ArchiveName::validate("drive-virtio1.img").map(|a| a.stem().to_owned()),
            Ok("drive-virtio1".into())
        );
        for bad in [
            "",
            ".img",
            "drive-scsi0",
            "drive-scsi0.pxar",
            "../drive.img",
            "a/b.img",
            ".hidden.img",
            "x y.img",
            "drive\n.img",
        ] {
            assert!(!ok::<ArchiveName>(bad), "{bad:?} accepted");
        }
        assert!(!ok::<ArchiveName>(&format!("{}.img", "a".repeat(130))));
    }

    #[test]
    fn vnet_and_node_grammar() {
        assert!(ok::<VnetName>("csbox1"));
        assert!(ok::<VnetName>("A2345678"));
        for bad in ["", "1abc", "vnet-1", "abcdefghi", "vmbr0.1", "a b"] {
            assert!(!ok::<VnetName>(bad), "{bad:?} accepted");
        }
        assert!(ok::<NodeName>("pve1"));
        assert!(ok::<NodeName>("pve-node-2"));
        for bad in ["", "-pve", "pve-", "pve.lab", "pve_1", &"a".repeat(64)] {
            assert!(!ok::<NodeName>(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn run_id_must_be_canonical_uuid() {
        assert!(ok::<RunId>("0f0e1c2d-3b4a-4c5d-8e6f-7a8b9c0d1e2f"));
        for bad in [
            "",
            "0F0E1C2D-3B4A-4C5D-8E6F-7A8B9C0D1E2F",
            "0f0e1c2d3b4a4c5d8e6f7a8b9c0d1e2f",
            "00000000-0000-0000-0000-000000000000",
            "../x",
        ] {
            assert!(!ok::<RunId>(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn addresses() {
        assert!(ok::<UnicastIp>("198.51.100.7"));
        assert!(ok::<UnicastIp>("2001:db8::7"));
        for bad in [
            "",
            "0.0.0.0",
            "127.0.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "198.51.100.7:80",
            "host",
        ] {
            assert!(!ok::<UnicastIp>(bad), "{bad:?} accepted");
        }
        assert!(ok::<IpInterface>("198.51.100.2/24"));
        assert!(ok::<IpInterface>("2001:db8::2/64"));
        for bad in [
            "198.51.100.2",
            "198.51.100.2/0",
            "198.51.100.2/33",
            "2001:db8::2/129",
            "/24",
        ] {
            assert!(!ok::<IpInterface>(bad), "{bad:?} accepted");
        }
        assert!(ok::<Host>("pbs.example.org"));
        assert!(ok::<Host>("192.0.2.10"));
        for bad in ["", "pbs..example", "-pbs", "pbs example", "pbs/x"] {
            assert!(!ok::<Host>(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn pbs_names() {
        assert!(ok::<Datastore>("store1"));
        assert!(!ok::<Datastore>("../store"));
        assert!(ok::<Namespace>(""));
        assert!(ok::<Namespace>("prod/web"));
        for bad in ["/prod", "prod/", "a/b/c/d/e/f/g/h", "prod/../x", "pr od"] {
            assert!(!ok::<Namespace>(bad), "{bad:?} accepted");
        }
        assert!(ok::<AuthId>("certistack@pbs"));
        assert!(ok::<AuthId>("certistack@pbs!restore"));
        for bad in [
            "certistack",
            "@pbs",
            "user@",
            "user@pbs!",
            "us er@pbs",
            "user@pbs!tok:en",
        ] {
            assert!(!ok::<AuthId>(bad), "{bad:?} accepted");
        }
        let fp = ["ab"; 32].join(":");
        assert!(ok::<Fingerprint>(&fp));
        assert!(!ok::<Fingerprint>(&["ab"; 31].join(":")));
        assert!(!ok::<Fingerprint>(&fp.replace(':', "")));
        assert!(!ok::<Fingerprint>(&["zz"; 32].join(":")));
    }

    #[test]
    fn secret_is_redacted_and_single_line() {
        let secret = Secret::validate("hunter2").map_err(|e| e.to_string());
        assert_eq!(
            secret.as_ref().map(|s| format!("{s:?}")),
            Ok("Secret(<redacted>)".to_string())
        );
        assert!(Secret::validate("").is_err());
        let err = Secret::validate("line1\nline2").err().unwrap_or_default();
        assert!(!err.contains("line1"), "the error quotes the secret: {err}");
        assert!(Secret::validate(&"x".repeat(4097)).is_err());
    }

    #[test]
    fn guest_and_expectation_text() {
        assert!(ok::<GuestProgram>("/usr/bin/systemctl"));
        for bad in ["systemctl", "/usr/../bin/sh", "/", "/bin/\u{7}x"] {
            assert!(!ok::<GuestProgram>(bad), "{bad:?} accepted");
        }
        assert!(ok::<GuestArgument>("is-active"));
        assert!(!ok::<GuestArgument>("a\nb"));
        assert!(ok::<HttpPath>("/healthz?x=1"));
        assert!(!ok::<HttpPath>("healthz"));
        assert!(!ok::<HttpPath>("/a b"));
        assert!(ok::<Sha256Hex>(&"a".repeat(64)));
        assert!(!ok::<Sha256Hex>(&"A".repeat(64)));
        assert!(ok::<AssertionId>("nginx-active"));
        assert!(!ok::<AssertionId>("Nginx"));
    }

    #[test]
    fn numeric_fields() {
        assert!(Vmid::parse("f", 0).is_err());
        assert!(Vmid::parse("f", 99).is_err());
        assert!(Vmid::parse("f", 100).is_ok());
        assert!(Vmid::parse("f", 999_999_999).is_ok());
        assert!(Vmid::parse("f", 1_000_000_000).is_err());
        assert!(port("f", 0).is_err());
        assert!(port("f", 65536).is_err());
        assert_eq!(port("f", 443), Ok(443));
    }
}
