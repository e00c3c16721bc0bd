//! The guest's console picture from a QMP `screendump` reply, checked before it is kept.
//!
//! The node asks QEMU for PNG (QEMU 7.1 and later) and returns the file QEMU wrote, bounded by
//! its `limits.max_screendump_bytes`. The image comes from a node running an untrusted guest,
//! so the controller checks it is one PNG picture of sane size before it goes beside a report:
//! the signature, a first `IHDR` chunk with its CRC and non-zero dimensions within
//! [`MAX_DIMENSION`], and an `IEND` chunk closing the file. Pixels are not decoded.

use certistack_proto::v1 as pb;
use sha2::{Digest, Sha256};

/// The PNG file signature.
pub const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
/// The widest or tallest console accepted (QEMU's largest display is 16384 pixels).
pub const MAX_DIMENSION: u32 = 16_384;
/// The format the node names in `QmpReply.image_format`.
pub const PNG_FORMAT: &str = "png";

/// A checked console picture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Screenshot {
    pub png: Vec<u8>,
    pub width: u32,
    pub height: u32,
    /// Lower-case hex SHA-256 of `png`, as the report signs it.
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScreenshotError {
    #[error("the node returned no image; was the call a screendump?")]
    Empty,
    #[error(
        "the node returned a {0:?} image; this controller keeps PNG only (the node's QEMU must be 7.1 or later)"
    )]
    Format(String),
    #[error("the image is not a PNG: {0}")]
    NotPng(String),
}

/// The checked PNG of a `screendump` reply.
pub fn screenshot_png(reply: &pb::QmpReply) -> Result<Screenshot, ScreenshotError> {
    if reply.image.is_empty() {
        return Err(ScreenshotError::Empty);
    }
    if reply.image_format != PNG_FORMAT {
        return Err(ScreenshotError::Format(reply.image_format.clone()));
    }
    let (width, height) = check_png(&reply.image).map_err(ScreenshotError::NotPng)?;
    Ok(Screenshot {
        png: reply.image.clone(),
        width,
        height,
        sha256: hex::encode(Sha256::digest(&reply.image)),
    })
}

/// The dimensions of a PNG whose structure holds (see the module doc).
pub fn check_png(bytes: &[u8]) -> Result<(u32, u32), String> {
    let rest = bytes
        .strip_prefix(&PNG_SIGNATURE)
        .ok_or("it does not start with the PNG signature")?;
    let Chunk {
        length,
        kind,
        data,
        crc,
    } = chunk(rest).ok_or("the IHDR chunk is cut short")?;
    if kind != *b"IHDR" || length != 13 {
        return Err("the first chunk is not a 13-byte IHDR".to_owned());
    }
    if crc32(&[kind.as_slice(), data].concat()) != crc {
        return Err("the IHDR chunk's CRC does not match".to_owned());
    }
    let word = |at: usize| {
        data.get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
            .unwrap_or(0)
    };
    let (width, height) = (word(0), word(4));
    if width == 0 || height == 0 || width > MAX_DIMENSION || height > MAX_DIMENSION {
        return Err(format!(
            "{width}x{height} pixels is outside 1..={MAX_DIMENSION} in each dimension"
        ));
    }
    let iend = [0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xae, 0x42, 0x60, 0x82];
    if !bytes.ends_with(&iend) {
        return Err("it does not end with an IEND chunk (cut short?)".to_owned());
    }
    Ok((width, height))
}

/// One PNG chunk as it lies in the file.
struct Chunk<'a> {
    length: u32,
    kind: [u8; 4],
    data: &'a [u8],
    crc: u32,
}

/// The chunk at the start of `bytes`, when all of it is there.
fn chunk(bytes: &[u8]) -> Option<Chunk<'_>> {
    let length = u32::from_be_bytes(bytes.get(..4)?.try_into().ok()?);
    let kind: [u8; 4] = bytes.get(4..8)?.try_into().ok()?;
    let end = 8usize.checked_add(usize::try_from(length).ok()?)?;
    let data = bytes.get(8..end)?;
    let crc = u32::from_be_bytes(bytes.get(end..end.checked_add(4)?)?.try_into().ok()?);
    Some(Chunk {
        length,
        kind,
        data,
        crc,
    })
}

/// The CRC-32 PNG chunks carry (ISO-HDLC, reflected polynomial 0xEDB88320).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = u32::MAX;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2x1 grey PNG (as `python3 -c 'import zlib…'` writes one).
    fn tiny_png() -> Vec<u8> {
        let mut png = PNG_SIGNATURE.to_vec();
        let mut push = |kind: &[u8; 4], data: &[u8]| {
            png.extend_from_slice(&(data.len() as u32).to_be_bytes());
            png.extend_from_slice(kind);
            png.extend_from_slice(data);
            png.extend_from_slice(&crc32(&[kind.as_slice(), data].concat()).to_be_bytes());
        };
        push(b"IHDR", &[0, 0, 0, 2, 0, 0, 0, 1, 8, 0, 0, 0, 0]);
        push(
            b"IDAT",
            &[
                0x78, 0x9c, 0x63, 0x60, 0x60, 0x00, 0x00, 0x00, 0x03, 0x00, 0x01,
            ],
        );
        push(b"IEND", &[]);
        png
    }

    fn reply(image: Vec<u8>, format: &str) -> pb::QmpReply {
        pb::QmpReply {
            image,
            image_format: format.into(),
            ..Default::default()
        }
    }

    #[test]
    fn crc32_is_the_png_one() {
        assert_eq!(crc32(b"IEND"), 0xae42_6082);
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn a_png_is_kept_with_its_size_and_digest() {
        let shot = screenshot_png(&reply(tiny_png(), "png")).unwrap();
        assert_eq!((shot.width, shot.height), (2, 1));
        assert_eq!(shot.sha256, hex::encode(Sha256::digest(tiny_png())));
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        assert_eq!(
            screenshot_png(&reply(Vec::new(), "")),
            Err(ScreenshotError::Empty)
        );
        assert!(matches!(
            screenshot_png(&reply(b"P6\n2 1\n255\n\0\0\0\0\0\0".to_vec(), "ppm")),
            Err(ScreenshotError::Format(_))
        ));
        let not_png = screenshot_png(&reply(b"GIF89a".to_vec(), "png"));
        assert!(
            matches!(&not_png, Err(ScreenshotError::NotPng(m)) if m.contains("signature")),
            "{not_png:?}"
        );
        let mut cut = tiny_png();
        cut.truncate(cut.len() - 12);
        assert!(check_png(&cut).unwrap_err().contains("IEND"));
        let mut changed = tiny_png();
        changed[19] = 9; // width 2 -> 9 without a new CRC
        assert!(check_png(&changed).unwrap_err().contains("CRC"));
        let mut huge = PNG_SIGNATURE.to_vec();
        let data = [0, 1, 0, 0, 0, 0, 0, 1, 8, 0, 0, 0, 0];
        huge.extend_from_slice(&13u32.to_be_bytes());
        huge.extend_from_slice(b"IHDR");
        huge.extend_from_slice(&data);
        huge.extend_from_slice(&crc32(&[b"IHDR".as_slice(), &data].concat()).to_be_bytes());
        assert!(check_png(&huge).unwrap_err().contains("65536x1"));
    }
}
