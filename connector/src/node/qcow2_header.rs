//! The header of a run's qcow2 overlay, read by the daemon itself: after the confined
//! appliance held the overlay, and before QEMU (as root) opens it, the overlay must still name
//! exactly the run's loop device as its raw backing and no other file.
//!
//! The appliance user may write every byte of the overlay while recovery runs, header
//! included. A header pointing `backing_file` at another device, or an external data file
//! (incompatible feature bit 2, extension `0x44415441`) at a host file, would make the root
//! QEMU of `StartVm` read or write what the appliance chose. Only the header is parsed, with
//! fixed bounds (`docs/interop/qcow2.txt` in QEMU's tree: the header, its extensions, the
//! backing file name).

use std::io::Read;
use std::path::Path;

const MAGIC: u32 = 0x5146_49fb;
/// What is read of the file: the header, its extensions and the backing file name all lie in
/// the first cluster (64 KiB by default) of an overlay `qemu-img create` made.
const READ_BYTES: usize = 64 * 1024;
/// The extension naming the backing file's format.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// The extension naming an external data file.
const EXT_DATA_FILE: u32 = 0x4441_5441;
/// Incompatible feature bits qcow2 defines: dirty, corrupt, external data file, compression
/// type, extended L2 entries.
const INCOMPATIBLE_KNOWN: u64 = 0b1_1111;
const INCOMPATIBLE_DATA_FILE: u64 = 1 << 2;

/// Why the overlay at `path` is not the plain overlay of `backing` (raw) it must be, or `Ok`.
pub fn check_overlay_header(path: &Path, backing: &str) -> Result<(), String> {
    let mut head = Vec::with_capacity(READ_BYTES);
    std::fs::File::open(path)
        .and_then(|file| file.take(READ_BYTES as u64).read_to_end(&mut head))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let refuse = |why: String| {
        Err(format!(
            "the overlay {} is no longer a plain qcow2 overlay of {backing}: {why}; it is not booted (delete the overlay and create it again)",
            path.display()
        ))
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_be_bytes(head.get(at..at + 4)?.try_into().ok()?))
    };
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_be_bytes(head.get(at..at + 8)?.try_into().ok()?))
    };
    let (Some(magic), Some(version)) = (u32_at(0), u32_at(4)) else {
        return refuse("shorter than a qcow2 header".into());
    };
    if magic != MAGIC || !(2..=3).contains(&version) {
        return refuse(format!("magic {magic:#x}, version {version}"));
    }
    if u32_at(32) != Some(0) {
        return refuse("it is encrypted".into());
    }
    let (extensions_at, incompatible) = if version == 3 {
        match (u32_at(100), u64_at(72)) {
            (Some(length), Some(bits)) => (length as usize, bits),
            _ => return refuse("a truncated version 3 header".into()),
        }
    } else {
        (72, 0)
    };
    if incompatible & INCOMPATIBLE_DATA_FILE != 0 {
        return refuse("it names an external data file".into());
    }
    if incompatible & !INCOMPATIBLE_KNOWN != 0 {
        return refuse(format!("unknown incompatible features {incompatible:#x}"));
    }
    // The backing file name.
    let (Some(name_at), Some(name_len)) = (u64_at(8), u32_at(16)) else {
        return refuse("a truncated header".into());
    };
    let name = usize::try_from(name_at)
        .ok()
        .and_then(|at| head.get(at..at.checked_add(name_len as usize)?));
    match name {
        Some(name) if name == backing.as_bytes() => {}
        Some(name) => {
            return refuse(format!(
                "its backing file is {}",
                certistack_core::untrusted::printable(name, 256)
            ));
        }
        None => return refuse("its backing file name lies outside the header".into()),
    }
    // The extensions: a raw backing format, and no data file.
    let mut at = extensions_at;
    let mut backing_format = None;
    loop {
        let (Some(kind), Some(length)) = (u32_at(at), u32_at(at + 4)) else {
            return refuse("its header extensions run past the header".into());
        };
        if kind == 0 {
            break;
        }
        let data = head.get(at + 8..at + 8 + length as usize);
        let Some(data) = data else {
            return refuse("a header extension runs past the header".into());
        };
        match kind {
            EXT_DATA_FILE => return refuse("it names an external data file".into()),
            EXT_BACKING_FORMAT => backing_format = Some(data.to_vec()),
            _ => {}
        }
        at += 8 + (length as usize).div_ceil(8) * 8;
    }
    match backing_format.as_deref() {
        Some(b"raw") => Ok(()),
        Some(other) => refuse(format!(
            "its backing format is {}",
            certistack_core::untrusted::printable(other, 64)
        )),
        None => refuse("its backing format is not pinned raw".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::check_overlay_header;
    use std::path::{Path, PathBuf};

    fn overlay(dir: &Path, name: &str, backing: &str, format: &str) -> PathBuf {
        let path = dir.join(name);
        let made = std::process::Command::new("qemu-img")
            .args([
                "create", "-q", "-u", "-f", "qcow2", "-b", backing, "-F", format,
            ])
            .arg(&path)
            .arg("64M")
            .output()
            .expect("qemu-img");
        assert!(made.status.success(), "{made:?}");
        path
    }

    fn patch(path: &Path, at: usize, bytes: &[u8]) {
        let mut data = std::fs::read(path).unwrap();
        data[at..at + bytes.len()].copy_from_slice(bytes);
        std::fs::write(path, data).unwrap();
    }

    /// What a broken-out appliance could write into the overlay it held, each refused before a
    /// root QEMU opens it; the overlay as `CreateOverlay` makes it passes.
    #[test]
    fn an_overlay_whose_header_names_another_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("qcow2-header-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        let good = overlay(&dir, "good.qcow2", "/dev/loop7", "raw");
        assert_eq!(check_overlay_header(&good, "/dev/loop7"), Ok(()));

        // Another device of the same name length, written over the name in place.
        let data = std::fs::read(&good).unwrap();
        let name_at = data.windows(10).position(|w| w == b"/dev/loop7").unwrap();
        let redirected = dir.join("redirected.qcow2");
        std::fs::copy(&good, &redirected).unwrap();
        patch(&redirected, name_at, b"/dev/sda01");
        let error = check_overlay_header(&redirected, "/dev/loop7").unwrap_err();
        assert!(error.contains("its backing file is /dev/sda01"), "{error}");

        // The external data file bit.
        let data_file = dir.join("data-file.qcow2");
        std::fs::copy(&good, &data_file).unwrap();
        patch(&data_file, 72 + 7, &[0b100]);
        assert!(
            check_overlay_header(&data_file, "/dev/loop7")
                .unwrap_err()
                .contains("external data file")
        );

        // Another backing format, and another device altogether.
        let qcow2_backed = overlay(&dir, "qcow2-backed.qcow2", "/dev/loop7", "qcow2");
        assert!(
            check_overlay_header(&qcow2_backed, "/dev/loop7")
                .unwrap_err()
                .contains("backing format is qcow2")
        );
        assert!(check_overlay_header(&good, "/dev/loop8").is_err());
        // Not a qcow2 file at all.
        let raw = dir.join("raw.img");
        std::fs::write(&raw, vec![0u8; 4096]).unwrap();
        assert!(check_overlay_header(&raw, "/dev/loop7").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
