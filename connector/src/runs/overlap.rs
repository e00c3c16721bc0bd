//! What two runs' grants would share on one node: the check that keeps concurrent runs apart.

use certistack_core::grant::Grant;

/// What two grants would share on one node, if anything.
pub fn overlap(a: &Grant, b: &Grant) -> Option<String> {
    if let Some(vmid) = a.sandbox_vms.keys().find(|v| b.sandbox_vms.contains_key(v)) {
        return Some(format!("VMID {vmid}"));
    }
    if a.vnet == b.vnet {
        return Some(format!("VNet {}", a.vnet));
    }
    let (ra, rb) = (&a.repository, &b.repository);
    let same_snapshot = a.snapshot == b.snapshot
        && ra.server == rb.server
        && ra.port == rb.port
        && ra.datastore == rb.datastore;
    // The namespace is deliberately not compared: the client's mapping name leaves it out, so
    // the same snapshot and archive in two namespaces would map under one name.
    if same_snapshot && let Some(archive) = a.archives.intersection(&b.archives).next() {
        return Some(format!("archive {archive} of {}", a.snapshot));
    }
    None
}
