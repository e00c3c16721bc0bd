//! IP network arithmetic: the one place that masks addresses and compares networks; and the
//! names PVE gives a VM's interfaces.
//!
//! The grant checks its probe targets against the probe network with it, and the sandbox checks
//! the probe network against every address and route the node already has.

use crate::validate::IpInterface;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// How many bits longer an IPv6 probe prefix must be than the IPv4 minimum: the same number of
/// host addresses (`/24` in IPv4 is `/120` in IPv6).
pub const IPV6_PREFIX_OFFSET: u8 = 96;

/// A network: an address with every host bit cleared, and its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IpNetwork {
    base: IpAddr,
    prefix_len: u8,
}

fn mask_v4(prefix_len: u8) -> u32 {
    u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0)
}

fn mask_v6(prefix_len: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(prefix_len.min(128)))
        .unwrap_or(0)
}

/// The longest prefix an address of this family can have.
pub fn max_prefix_len(address: IpAddr) -> u8 {
    if address.is_ipv4() { 32 } else { 128 }
}

/// The shortest probe prefix allowed for `address`'s family, given the IPv4 minimum.
pub fn min_probe_prefix_len(address: IpAddr, min_ipv4_prefix: u8) -> u8 {
    if address.is_ipv4() {
        min_ipv4_prefix
    } else {
        min_ipv4_prefix.saturating_add(IPV6_PREFIX_OFFSET)
    }
}

impl IpNetwork {
    /// The network `address` lies in under `prefix_len`; `None` when the prefix is longer than
    /// the family allows.
    pub fn new(address: IpAddr, prefix_len: u8) -> Option<Self> {
        if prefix_len > max_prefix_len(address) {
            return None;
        }
        let base = match address {
            IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask_v4(prefix_len))),
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask_v6(prefix_len))),
        };
        Some(Self { base, prefix_len })
    }

    /// A single address as a host network (`/32`, `/128`).
    pub fn host(address: IpAddr) -> Self {
        Self {
            base: address,
            prefix_len: max_prefix_len(address),
        }
    }

    /// The network of an interface address, e.g. `198.51.100.0/24` for `198.51.100.2/24`.
    pub fn of(interface: &IpInterface) -> Self {
        let address = interface.address.0;
        Self::new(address, interface.prefix_len).unwrap_or_else(|| Self::host(address))
    }

    /// Parses `address/prefix` or a bare address (a host), as `ip -j` prints destinations.
    pub fn parse(text: &str) -> Option<Self> {
        match text.split_once('/') {
            Some((address, prefix)) => Self::new(address.parse().ok()?, prefix.parse().ok()?),
            None => text.parse().ok().map(Self::host),
        }
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.base, address) {
            (IpAddr::V4(base), IpAddr::V4(a)) => {
                u32::from(a) & mask_v4(self.prefix_len) == u32::from(base)
            }
            (IpAddr::V6(base), IpAddr::V6(a)) => {
                u128::from(a) & mask_v6(self.prefix_len) == u128::from(base)
            }
            _ => false,
        }
    }

    /// Whether the two networks share any address: one contains the other's base.
    pub fn overlaps(&self, other: &IpNetwork) -> bool {
        if self.prefix_len <= other.prefix_len {
            self.contains(other.base)
        } else {
            other.contains(self.base)
        }
    }
}

impl fmt::Display for IpNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix_len)
    }
}

/// The VM and NIC of a PVE tap interface, named `tap<vmid>i<nic>` by qemu-server
/// (`PVE::QemuServer::print_netdevice_full`); `None` for any other name.
pub fn pve_tap(name: &str) -> Option<(u32, u32)> {
    let (vmid, nic) = name.strip_prefix("tap")?.split_once('i')?;
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    if !digits(vmid) || !digits(nic) {
        return None;
    }
    Some((vmid.parse().ok()?, nic.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Validated;

    fn net(text: &str) -> IpNetwork {
        IpNetwork::parse(text).unwrap()
    }

    #[test]
    fn masks_contains_and_overlaps() {
        let probe = IpInterface::validate("198.51.100.2/24").unwrap();
        assert_eq!(IpNetwork::of(&probe).to_string(), "198.51.100.0/24");
        let v6 = IpInterface::validate("2001:db8::2/64").unwrap();
        assert_eq!(IpNetwork::of(&v6).to_string(), "2001:db8::/64");
        assert!(net("198.51.100.0/24").contains("198.51.100.255".parse().unwrap()));
        assert!(!net("198.51.100.0/24").contains("198.51.101.0".parse().unwrap()));
        assert!(!net("198.51.100.0/24").contains("::1".parse().unwrap()));
        // A /1 swallows half the address space, the default route's targets included.
        assert!(net("0.0.0.0/1").overlaps(&net("10.1.2.0/24")));
        assert!(net("10.1.2.0/24").overlaps(&net("10.0.0.0/8")));
        assert!(net("10.1.2.0/24").overlaps(&net("10.1.2.7")));
        assert!(!net("10.1.2.0/24").overlaps(&net("10.1.3.0/24")));
        assert!(!net("10.1.2.0/24").overlaps(&net("2001:db8::/32")));
        assert!(net("0.0.0.0/0").contains("203.0.113.9".parse().unwrap()));
        assert_eq!(net("10.1.2.9/24").to_string(), "10.1.2.0/24");
        assert_eq!(net("2001:db8::5").prefix_len(), 128);
        assert!(IpNetwork::parse("10.0.0.0/33").is_none());
        assert!(IpNetwork::parse("default").is_none());
        assert_eq!(min_probe_prefix_len("10.0.0.1".parse().unwrap(), 24), 24);
        assert_eq!(
            min_probe_prefix_len("2001:db8::1".parse().unwrap(), 24),
            120
        );
    }

    #[test]
    fn pve_taps_are_read_by_vm_and_nic_and_nothing_else_is() {
        assert_eq!(pve_tap("tap9100i0"), Some((9100, 0)));
        assert_eq!(pve_tap("tap100i12"), Some((100, 12)));
        for other in [
            "tap9100i",
            "tapi0",
            "tap91x0i0",
            "fwpr9100p0",
            "veth9100i0",
            "tap9100i0x",
            "tap+9100i0",
        ] {
            assert_eq!(pve_tap(other), None, "{other}");
        }
    }
}
