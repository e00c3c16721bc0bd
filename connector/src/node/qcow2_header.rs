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
/// The feature name table `qemu-img create` writes: names only, no behaviour.
const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
/// A version 3 header without (104) and with (112) the compression type field QEMU 5.1 added.
const HEADER_LENGTHS: [u32; 2] = [104, 112];
/// `qemu-img create`'s defaults: 64 KiB clusters, 16-bit refcounts.
const CLUSTER_BITS: u32 = 16;
const REFCOUNT_ORDER: u32 = 4;

/// Why the overlay at `path` is not the plain overlay of `backing` (raw) it must be, or `Ok`.
///
/// Only the header shape `qemu-img create -f qcow2 -b DEVICE -F raw` writes is accepted, read
/// as QEMU reads it (`qcow2_do_open`): version 3, no encryption, no feature bit (not dirty, no
/// external data file, no other compression, no extended L2, no lazy refcounts, no bitmaps),
/// no snapshot, the default cluster and refcount sizes, header extensions from
/// `header_length` up to the backing file name (which QEMU reads no further than), exactly a
/// `raw` backing format and at most the feature name table among them, and the backing file
/// name exactly `backing`. Anything else (a header QEMU would read differently from this check,
/// e.g. a backing file offset inside the header, where QEMU reads no extension and probes the
/// device's own content for its format) is refused.
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
    if magic != MAGIC || version != 3 {
        return refuse(format!("magic {magic:#x}, version {version}"));
    }
    let field = |at: usize, what: &str| -> Result<u64, String> {
        u64_at(at).ok_or_else(|| format!("a truncated header ({what})"))
    };
    let field32 = |at: usize, what: &str| -> Result<u32, String> {
        u32_at(at).ok_or_else(|| format!("a truncated header ({what})"))
    };
    let header = (|| -> Result<_, String> {
        Ok((
            field(8, "backing file offset")?,
            field32(16, "backing file size")?,
            field32(20, "cluster bits")?,
            field32(32, "encryption")?,
            field32(60, "snapshots")?,
            field(72, "incompatible features")?,
            field(80, "compatible features")?,
            field(88, "autoclear features")?,
            field32(96, "refcount order")?,
            field32(100, "header length")?,
        ))
    })();
    let (
        name_at,
        name_len,
        cluster_bits,
        encryption,
        snapshots,
        incompatible,
        compatible,
        autoclear,
        refcount_order,
        header_length,
    ) = match header {
        Ok(header) => header,
        Err(why) => return refuse(why),
    };
    if encryption != 0 {
        return refuse("it is encrypted".into());
    }
    if incompatible != 0 {
        return refuse(format!(
            "incompatible features {incompatible:#x} are set (dirty, an external data file, another compression or extended L2)"
        ));
    }
    if compatible != 0 || autoclear != 0 {
        return refuse(format!(
            "compatible features {compatible:#x} or autoclear features {autoclear:#x} are set"
        ));
    }
    if snapshots != 0 {
        return refuse(format!("it holds {snapshots} internal snapshot(s)"));
    }
    if cluster_bits != CLUSTER_BITS || refcount_order != REFCOUNT_ORDER {
        return refuse(format!(
            "cluster bits {cluster_bits} and refcount order {refcount_order} are not qemu-img's {CLUSTER_BITS} and {REFCOUNT_ORDER}"
        ));
    }
    if !HEADER_LENGTHS.contains(&header_length) {
        return refuse(format!("header length {header_length}"));
    }
    if header_length == 112 && head.get(104) != Some(&0) {
        return refuse("its compression type is not zlib".into());
    }
    // The backing file name, where QEMU stops reading extensions.
    let name_at = usize::try_from(name_at).unwrap_or(usize::MAX);
    if name_at < header_length as usize {
        return refuse(format!(
            "its backing file name starts at {name_at}, inside the {header_length}-byte header, where QEMU reads no extension"
        ));
    }
    let name = name_at
        .checked_add(name_len as usize)
        .and_then(|end| head.get(name_at..end));
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
    // The extensions, from the header's end up to the backing file name.
    let mut at = header_length as usize;
    let mut backing_format = None;
    loop {
        let (Some(kind), Some(length)) = (u32_at(at), u32_at(at + 4)) else {
            return refuse("its header extensions run past the header".into());
        };
        if kind == 0 {
            break;
        }
        let end = at + 8 + (length as usize).div_ceil(8) * 8;
        let Some(data) = head.get(at + 8..at + 8 + length as usize) else {
            return refuse("a header extension runs past the header".into());
        };
        if end > name_at {
            return refuse("a header extension runs into the backing file name, past where QEMU reads extensions".into());
        }
        match kind {
            EXT_BACKING_FORMAT if backing_format.is_none() => backing_format = Some(data.to_vec()),
            EXT_FEATURE_TABLE => {}
            other => return refuse(format!("header extension {other:#010x}")),
        }
        at = end;
    }
    if at + 8 > name_at {
        return refuse("its extensions end past the backing file name".into());
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

    /// What QEMU reads of the image's header (`qemu-img info` opens no backing file).
    fn qemu_img_info(path: &Path) -> serde_json::Value {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(path)
            .output()
            .expect("qemu-img");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
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
        // Each header QEMU would read otherwise than this check, or that carries more than
        // `qemu-img create` writes, is refused; qemu-img itself reads the good one as the
        // raw overlay of the device.
        let info = qemu_img_info(&good);
        assert_eq!(info["backing-filename"], "/dev/loop7", "{info}");
        assert_eq!(info["backing-filename-format"], "raw", "{info}");
        let crafted: [(&str, usize, &[u8], &str); 6] = [
            // The backing name's offset moved inside the header: QEMU reads no extension, so
            // no pinned format, and probes the device's own first sectors.
            ("offset-inside", 8, &48u64.to_be_bytes(), "inside the"),
            ("dirty", 72 + 7, &[1], "incompatible features 0x1"),
            ("lazy-refcounts", 80 + 7, &[1], "compatible features 0x1"),
            ("bitmaps", 88 + 7, &[1], "autoclear features 0x1"),
            ("snapshot", 60, &1u32.to_be_bytes(), "1 internal snapshot"),
            ("cluster", 20, &12u32.to_be_bytes(), "cluster bits 12"),
        ];
        for (name, at, bytes, reason) in crafted {
            let path = dir.join(format!("{name}.qcow2"));
            std::fs::copy(&good, &path).unwrap();
            patch(&path, at, bytes);
            let error = check_overlay_header(&path, "/dev/loop7").unwrap_err();
            assert!(error.contains(reason), "{name}: {error}");
        }
        // With the name's offset inside the header, QEMU indeed sees no raw backing format.
        let moved = qemu_img_info(&dir.join("offset-inside.qcow2"));
        assert_ne!(moved["backing-filename-format"], "raw", "{moved}");
        // An extension other than the backing format and the feature table (here the feature
        // table renamed to the bitmaps extension).
        let feature_table = 0x6803_f857u32.to_be_bytes();
        let data = std::fs::read(&good).unwrap();
        let table_at = data.windows(4).position(|w| w == feature_table).unwrap();
        let bitmaps = dir.join("bitmaps-extension.qcow2");
        std::fs::copy(&good, &bitmaps).unwrap();
        patch(&bitmaps, table_at, &0x2385_2875u32.to_be_bytes());
        let error = check_overlay_header(&bitmaps, "/dev/loop7").unwrap_err();
        assert!(error.contains("header extension 0x23852875"), "{error}");

        // Not a qcow2 file at all.
        let raw = dir.join("raw.img");
        std::fs::write(&raw, vec![0u8; 4096]).unwrap();
        assert!(check_overlay_header(&raw, "/dev/loop7").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
