//! Connector package signatures that carry the RPC surface.
//!
//! `certistack-ctl package sign` signs a connector `.deb` in minisign's format (a prehashed
//! Ed25519 signature, which Debian's `minisign -V` checks) with a trusted comment naming the
//! package, its version and the surface digest its control file declares
//! (`X-Certistack-Surface-Digest`). `verify` checks, in this order: the signature over the
//! package and the trusted comment; that the trusted comment names exactly what the package's
//! control file says; that the surface is the controller's own. An operator thus knows before
//! installing that the package is ours and that the node will pass the audit.
//!
//! The control file is read from the `.deb` itself (an `ar` archive whose `control.tar.gz`
//! holds `./control`), never from a side file, and every read is bounded. The package is read
//! once, through one handle, into memory: the bytes the signature covers are the bytes whose
//! control file is read, even if the file is replaced while it is being checked.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The control field that carries the surface digest the packaged connector serves.
pub const SURFACE_FIELD: &str = "X-Certistack-Surface-Digest";
/// The package of the node's daemon, whose surface must be the controller's.
pub const CONNECTOR_PACKAGE: &str = "certistack-connector";
/// The package of `certistack-ctl`, its service and its timer.
pub const CONTROLLER_PACKAGE: &str = "certistack-controller";
/// The signature's file name is the package's with this appended.
pub const SIGNATURE_SUFFIX: &str = "minisig";
/// A control file is a few hundred bytes; its compressed tar far less than this.
const MAX_CONTROL_MEMBER_BYTES: u64 = 1024 * 1024;
const MAX_CONTROL_FILE_BYTES: u64 = 64 * 1024;
/// A minisign signature, key or password file is well under this.
const MAX_SMALL_FILE_BYTES: u64 = 4096;
/// The connector package is a few MiB; it is held in memory while it is signed or verified.
pub const MAX_PACKAGE_BYTES: u64 = 256 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is larger than {limit} bytes; it is not a minisign key, signature or password")]
    TooLarge { path: PathBuf, limit: u64 },
    #[error(
        "{path} is larger than {limit} bytes; it is not a connector package (those are a few MiB)"
    )]
    PackageTooLarge { path: PathBuf, limit: u64 },
    #[error("{path} exists; refusing to overwrite it (move it away first)")]
    Exists { path: PathBuf },
    #[error("{path} is not a Debian package: {reason}")]
    NotADeb { path: PathBuf, reason: String },
    #[error(
        "{path} keeps its control file in {member}; this verifier reads control.tar.gz, as packaging/build-deb writes it"
    )]
    UnsupportedControl { path: PathBuf, member: String },
    #[error(
        "{path}'s control file has no {field} field; build the package with packaging/build-deb, which adds it"
    )]
    MissingField { path: PathBuf, field: String },
    #[error("cannot load the minisign key {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("the secret key {path} is encrypted; pass --password-file with its password")]
    EncryptedKey { path: PathBuf },
    #[error("signing {path} failed: {reason}")]
    Sign { path: PathBuf, reason: String },
    #[error("{signature} is not a minisign signature: {reason}")]
    SignatureFormat { signature: PathBuf, reason: String },
    #[error(
        "the signature {signature} does not verify {package} with this public key ({reason}): the package or the signature was changed, or another key signed it; do not install it"
    )]
    BadSignature {
        package: PathBuf,
        signature: PathBuf,
        reason: String,
    },
    #[error(
        "the signature's trusted comment {comment:?} is not one `certistack-ctl package sign` writes: {reason}; do not install the package"
    )]
    TrustedComment { comment: String, reason: String },
    #[error(
        "the signature was made for {signed} but the package's control file says {control}; do not install it"
    )]
    CommentMismatch {
        signed: Box<PackageIdentity>,
        control: Box<PackageIdentity>,
    },
    #[error(
        "{package} serves surface {packaged} but this controller speaks {controller}: a node running it would fail the audit (DRIFT); install the connector release built with this certistack-ctl, or use the certistack-ctl of the package's release"
    )]
    SurfaceDiffers {
        package: PathBuf,
        packaged: String,
        controller: String,
    },
}

impl PackageError {
    /// A refusal about the package or signature itself (the operator must not install it), as
    /// opposed to a local failure reading or writing files.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::NotADeb { .. }
                | Self::PackageTooLarge { .. }
                | Self::UnsupportedControl { .. }
                | Self::MissingField { .. }
                | Self::SignatureFormat { .. }
                | Self::BadSignature { .. }
                | Self::TrustedComment { .. }
                | Self::CommentMismatch { .. }
                | Self::SurfaceDiffers { .. }
        )
    }
}

/// What a package says it is: from its control file, or from a signature's trusted comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageIdentity {
    pub package: String,
    pub version: String,
    pub surface_digest: String,
}

impl std::fmt::Display for PackageIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} (surface {})",
            self.package, self.version, self.surface_digest
        )
    }
}

impl PackageIdentity {
    /// minisign's own trusted comments are tab-separated `key:value` pairs
    /// (`timestamp:… file:…`); this one adds the package, version and surface.
    fn trusted_comment(&self, timestamp: u64, file_name: &str) -> String {
        format!(
            "timestamp:{timestamp}\tfile:{file_name}\tpackage:{}\tversion:{}\tsurface:{}",
            self.package, self.version, self.surface_digest
        )
    }

    fn from_trusted_comment(comment: &str) -> Result<Self, PackageError> {
        let refuse = |reason: &str| PackageError::TrustedComment {
            comment: comment.to_owned(),
            reason: reason.to_owned(),
        };
        let (mut package, mut version, mut surface) = (None, None, None);
        for pair in comment.split('\t') {
            let Some((key, value)) = pair.split_once(':') else {
                return Err(refuse("a part is not key:value"));
            };
            let slot = match key {
                "package" => &mut package,
                "version" => &mut version,
                "surface" => &mut surface,
                "timestamp" | "file" => continue,
                _ => return Err(refuse("it has an unknown key")),
            };
            if slot.replace(value.to_owned()).is_some() {
                return Err(refuse("a key appears twice"));
            }
        }
        match (package, version, surface) {
            (Some(package), Some(version), Some(surface_digest)) => Ok(Self {
                package,
                version,
                surface_digest,
            }),
            _ => Err(refuse("it does not name package, version and surface")),
        }
    }
}

fn read_bounded(path: &Path) -> Result<String, PackageError> {
    let file = File::open(path).map_err(|source| PackageError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut text = String::new();
    file.take(MAX_SMALL_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|source| PackageError::Read {
            path: path.to_owned(),
            source,
        })?;
    if text.len() as u64 > MAX_SMALL_FILE_BYTES {
        return Err(PackageError::TooLarge {
            path: path.to_owned(),
            limit: MAX_SMALL_FILE_BYTES,
        });
    }
    Ok(text)
}

/// The password in `path`: its first line (a trailing newline is not part of it).
pub fn read_password(path: &Path) -> Result<String, PackageError> {
    let text = read_bounded(path)?;
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

/// The signature file of `package`: `<package>.minisig`.
pub fn signature_path(package: &Path) -> PathBuf {
    let mut name = package.as_os_str().to_owned();
    name.push(".");
    name.push(SIGNATURE_SUFFIX);
    PathBuf::from(name)
}

/// The whole package, read once through one handle and bounded by [`MAX_PACKAGE_BYTES`]:
/// everything signed or verified is checked on these bytes, never on a second open of the path.
fn read_package(path: &Path) -> Result<Vec<u8>, PackageError> {
    let read_error = |source| PackageError::Read {
        path: path.to_owned(),
        source,
    };
    let too_large = || PackageError::PackageTooLarge {
        path: path.to_owned(),
        limit: MAX_PACKAGE_BYTES,
    };
    let file = File::open(path).map_err(read_error)?;
    // A regular file says its size up front; a pipe or device is cut off by the bounded read.
    let length = file.metadata().map_err(read_error)?.len();
    if length > MAX_PACKAGE_BYTES {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(length).unwrap_or_default());
    file.take(MAX_PACKAGE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_PACKAGE_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Reads the control file of a `.deb`: `debian-binary` first, then `control.tar.gz` holding
/// `./control`; returns the package's name, version and surface digest.
pub fn read_control(path: &Path) -> Result<PackageIdentity, PackageError> {
    control_of(path, &read_package(path)?)
}

/// The identity in the control file of the package `bytes` (read from `path`, named in errors).
fn control_of(path: &Path, bytes: &[u8]) -> Result<PackageIdentity, PackageError> {
    let not_a_deb = |reason: String| PackageError::NotADeb {
        path: path.to_owned(),
        reason,
    };
    let mut archive = ar::Archive::new(bytes);
    let mut first = true;
    while let Some(entry) = archive.next_entry() {
        let entry = entry.map_err(|e| not_a_deb(format!("not an ar archive ({e})")))?;
        let name = String::from_utf8_lossy(entry.header().identifier())
            .trim_end_matches('/')
            .to_owned();
        if first {
            first = false;
            if name != "debian-binary" {
                return Err(not_a_deb(format!(
                    "its first member is {name:?}, not debian-binary"
                )));
            }
            continue;
        }
        if name == "control.tar.gz" {
            let text = control_from_tar(entry.take(MAX_CONTROL_MEMBER_BYTES))
                .map_err(|reason| not_a_deb(format!("control.tar.gz: {reason}")))?;
            return identity_from_control(path, &text);
        }
        if name.starts_with("control.tar") {
            return Err(PackageError::UnsupportedControl {
                path: path.to_owned(),
                member: name,
            });
        }
    }
    Err(not_a_deb("it has no control.tar.gz member".to_owned()))
}

fn control_from_tar(member: impl Read) -> Result<String, String> {
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(member));
    let entries = tar.entries().map_err(|e| e.to_string())?;
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        let is_control = entry
            .path()
            .map(|p| matches!(p.to_string_lossy().as_ref(), "./control" | "control"))
            .unwrap_or(false);
        if !is_control {
            continue;
        }
        let mut text = String::new();
        entry
            .take(MAX_CONTROL_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("./control: {e}"))?;
        if text.len() as u64 > MAX_CONTROL_FILE_BYTES {
            return Err(format!(
                "./control is larger than {MAX_CONTROL_FILE_BYTES} bytes"
            ));
        }
        return Ok(text);
    }
    Err("it has no ./control".to_owned())
}

/// The value of `field` in a control file's first paragraph (names are case-insensitive;
/// continuation lines belong to the field before them and are not read here).
fn control_field<'a>(control: &'a str, field: &str) -> Option<&'a str> {
    control
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .filter(|line| !line.starts_with([' ', '\t']))
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case(field).then(|| value.trim())
        })
}

fn identity_from_control(path: &Path, control: &str) -> Result<PackageIdentity, PackageError> {
    let field = |name: &str| {
        control_field(control, name)
            .filter(|value| !value.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| PackageError::MissingField {
                path: path.to_owned(),
                field: name.to_owned(),
            })
    };
    Ok(PackageIdentity {
        package: field("Package")?,
        version: field("Version")?,
        surface_digest: field(SURFACE_FIELD)?,
    })
}

fn create_new(path: &Path, mode: u32, contents: &str) -> Result<(), PackageError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|source| {
            if source.kind() == std::io::ErrorKind::AlreadyExists {
                PackageError::Exists {
                    path: path.to_owned(),
                }
            } else {
                PackageError::Write {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
    file.write_all(contents.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|source| PackageError::Write {
            path: path.to_owned(),
            source,
        })
}

/// Creates a minisign key pair: the secret key (0600, encrypted with `password` when given,
/// as `minisign -G` does; unencrypted otherwise, as `minisign -G -W` does) and the public key.
/// Refuses to overwrite either file.
pub fn generate_key(
    secret_key: &Path,
    public_key: &Path,
    password: Option<String>,
) -> Result<(), PackageError> {
    let key_error = |reason: String| PackageError::Key {
        path: secret_key.to_owned(),
        reason,
    };
    for path in [secret_key, public_key] {
        if path.exists() {
            return Err(PackageError::Exists {
                path: path.to_owned(),
            });
        }
    }
    let pair = match password {
        Some(password) => minisign::KeyPair::generate_encrypted_keypair(Some(password)),
        None => minisign::KeyPair::generate_unencrypted_keypair(),
    }
    .map_err(|e| key_error(e.to_string()))?;
    let secret_box = pair
        .sk
        .to_box(Some("certistack package signing secret key"))
        .map_err(|e| key_error(e.to_string()))?;
    let public_box = pair.pk.to_box().map_err(|e| key_error(e.to_string()))?;
    create_new(secret_key, 0o600, &secret_box.to_string())?;
    create_new(public_key, 0o644, &public_box.to_string())
}

fn load_secret_key(
    path: &Path,
    password: Option<String>,
) -> Result<minisign::SecretKey, PackageError> {
    let key_error = |reason: String| PackageError::Key {
        path: path.to_owned(),
        reason,
    };
    let text = read_bounded(path)?;
    let secret_box =
        minisign::SecretKeyBox::from_string(&text).map_err(|e| key_error(e.to_string()))?;
    match (kdf_is_set(&text), password) {
        (true, None) => Err(PackageError::EncryptedKey {
            path: path.to_owned(),
        }),
        // With a password given, minisign never prompts.
        (true, Some(password)) => secret_box
            .into_secret_key(Some(password))
            .map_err(|e| key_error(e.to_string())),
        // A password for an unencrypted key (`minisign -G -W`) is not needed.
        (false, _) => secret_box
            .into_unencrypted_secret_key()
            .map_err(|e| key_error(e.to_string())),
    }
}

/// Whether a minisign secret key box names a key derivation (an encrypted key): the key line
/// decodes to the signature algorithm (2 bytes), then the KDF algorithm (2 bytes, zero when the
/// key is stored unencrypted). The minisign crate prompts on a terminal for an encrypted key
/// given no password, so this is decided before the crate sees it.
fn kdf_is_set(secret_box: &str) -> bool {
    use base64::Engine;
    secret_box
        .lines()
        .nth(1)
        .and_then(|line| {
            base64::engine::general_purpose::STANDARD
                .decode(line.trim())
                .ok()
        })
        .and_then(|bytes| bytes.get(2..4).map(|kdf| kdf != [0, 0]))
        .unwrap_or(false)
}

fn load_public_key(path: &Path) -> Result<minisign::PublicKey, PackageError> {
    let key_error = |reason: String| PackageError::Key {
        path: path.to_owned(),
        reason,
    };
    let text = read_bounded(path)?;
    // `minisign -G` writes a two-line box; a bare base64 key (`minisign -P`) is accepted too.
    if text.trim_start().starts_with("untrusted comment:") {
        minisign::PublicKeyBox::from_string(&text).and_then(minisign::PublicKeyBox::into_public_key)
    } else {
        minisign::PublicKey::from_base64(text.trim())
    }
    .map_err(|e| key_error(e.to_string()))
}

/// Signs `package` with the secret key in `key`, writing `<package>.minisig` (replacing an
/// older signature). Returns the signature's path and what the trusted comment names.
pub fn sign(
    package: &Path,
    key: &Path,
    password: Option<String>,
    timestamp: u64,
) -> Result<(PathBuf, PackageIdentity), PackageError> {
    let bytes = read_package(package)?;
    let identity = control_of(package, &bytes)?;
    let secret = load_secret_key(key, password)?;
    let file_name = package
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let comment = identity.trusted_comment(timestamp, &file_name);
    let signature = minisign::sign(
        None,
        &secret,
        bytes.as_slice(),
        Some(&comment),
        Some("certistack connector package signature"),
    )
    .map_err(|e| PackageError::Sign {
        path: package.to_owned(),
        reason: e.to_string(),
    })?;
    let path = signature_path(package);
    let partial = path.with_extension(format!("{SIGNATURE_SUFFIX}.partial"));
    let _ = std::fs::remove_file(&partial);
    create_new(&partial, 0o644, &signature.to_string())?;
    std::fs::rename(&partial, &path).map_err(|source| PackageError::Write {
        path: path.clone(),
        source,
    })?;
    Ok((path, identity))
}

/// Verifies `package` against `<package>.minisig` and the public key in `public_key`, then
/// that the signed trusted comment names what the control file says and that the surface is
/// `controller_surface`. Returns what the package is.
pub fn verify(
    package: &Path,
    public_key: &Path,
    controller_surface: &str,
) -> Result<PackageIdentity, PackageError> {
    let key = load_public_key(public_key)?;
    let signature_file = signature_path(package);
    let signature =
        minisign::SignatureBox::from_string(&read_bounded(&signature_file)?).map_err(|e| {
            PackageError::SignatureFormat {
                signature: signature_file.clone(),
                reason: e.to_string(),
            }
        })?;
    let bytes = read_package(package)?;
    // Legacy (not prehashed) signatures are refused: Debian's minisign writes prehashed ones.
    minisign::verify(
        &key,
        &signature,
        std::io::Cursor::new(bytes.as_slice()),
        true,
        false,
        false,
    )
    .map_err(|e| PackageError::BadSignature {
        package: package.to_owned(),
        signature: signature_file.clone(),
        reason: e.to_string(),
    })?;
    let comment = signature
        .trusted_comment()
        .map_err(|e| PackageError::SignatureFormat {
            signature: signature_file.clone(),
            reason: e.to_string(),
        })?;
    let signed = PackageIdentity::from_trusted_comment(&comment)?;
    let control = control_of(package, &bytes)?;
    if signed != control {
        return Err(PackageError::CommentMismatch {
            signed: Box::new(signed),
            control: Box::new(control),
        });
    }
    // The connector must serve what this controller speaks, or its node fails the audit; a
    // controller package of another surface is an upgrade of the controller itself (its
    // nodes' connectors follow), which the caller reports without refusing it.
    if control.package != CONTROLLER_PACKAGE && control.surface_digest != controller_surface {
        return Err(PackageError::SurfaceDiffers {
            package: package.to_owned(),
            packaged: control.surface_digest,
            controller: controller_surface.to_owned(),
        });
    }
    Ok(control)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SURFACE: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    fn control_text(version: &str, surface: Option<&str>) -> String {
        let mut text = format!(
            "Package: certistack-connector\nVersion: {version}\nArchitecture: amd64\nDescription: the connector\n a continuation line: X\n"
        );
        if let Some(surface) = surface {
            text.push_str(&format!("{SURFACE_FIELD}: {surface}\n"));
        }
        text
    }

    /// A `.deb` as dpkg-deb lays it out: debian-binary, control.tar.<ext>, data.tar.gz.
    fn write_deb(dir: &Path, name: &str, control: &str, control_member: &str) -> PathBuf {
        let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::default(),
        ));
        let mut header = tar::Header::new_gnu();
        header.set_size(control.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, "./control", control.as_bytes())
            .unwrap();
        let control_tar = tar.into_inner().unwrap().finish().unwrap();
        let path = dir.join(name);
        let mut deb = ar::Builder::new(File::create(&path).unwrap());
        let mut add = |id: &str, data: &[u8]| {
            let header = ar::Header::new(id.as_bytes().to_vec(), data.len() as u64);
            deb.append(&header, data).unwrap();
        };
        add("debian-binary", b"2.0\n");
        add(control_member, &control_tar);
        add("data.tar.gz", b"not read by the verifier");
        path
    }

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("certistack-package-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn keys(dir: &Path, password: Option<&str>) -> (PathBuf, PathBuf) {
        let (secret, public) = (dir.join("sign.key"), dir.join("sign.pub"));
        generate_key(&secret, &public, password.map(str::to_owned)).unwrap();
        (secret, public)
    }

    #[test]
    fn reads_name_version_and_surface_from_the_control_member() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("0.1.0-1", Some(SURFACE)),
            "control.tar.gz",
        );
        assert_eq!(
            read_control(&deb).unwrap(),
            PackageIdentity {
                package: "certistack-connector".into(),
                version: "0.1.0-1".into(),
                surface_digest: SURFACE.into()
            }
        );
    }

    #[test]
    fn a_package_without_the_surface_field_or_with_another_control_format_is_refused() {
        let dir = temp_dir();
        let bare = write_deb(&dir, "a.deb", &control_text("1", None), "control.tar.gz");
        let error = read_control(&bare).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("no X-Certistack-Surface-Digest field")
                && error.to_string().contains("packaging/build-deb"),
            "{error}"
        );
        let xz = write_deb(
            &dir,
            "b.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.xz",
        );
        assert!(matches!(
            read_control(&xz),
            Err(PackageError::UnsupportedControl { member, .. }) if member == "control.tar.xz"
        ));
        let not_deb = dir.join("c.deb");
        std::fs::write(&not_deb, b"#!/bin/sh\n").unwrap();
        assert!(matches!(
            read_control(&not_deb),
            Err(PackageError::NotADeb { .. })
        ));
    }

    #[test]
    fn a_signed_package_verifies_and_names_itself() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("0.2.0-1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        let (signature, identity) = sign(&deb, &secret, None, 1_700_000_000).unwrap();
        assert_eq!(signature, dir.join("p.deb.minisig"));
        let text = std::fs::read_to_string(&signature).unwrap();
        assert!(
            text.contains(&format!(
                "trusted comment: timestamp:1700000000\tfile:p.deb\tpackage:certistack-connector\tversion:0.2.0-1\tsurface:{SURFACE}"
            )),
            "{text}"
        );
        assert_eq!(verify(&deb, &public, SURFACE).unwrap(), identity);
    }

    #[test]
    fn an_encrypted_key_without_its_password_or_with_a_wrong_one_does_not_sign() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, _) = keys(&dir, Some("right"));
        assert!(matches!(
            sign(&deb, &secret, None, 0),
            Err(PackageError::EncryptedKey { .. })
        ));
        assert!(sign(&deb, &secret, Some("wrong".into()), 0).is_err());
        assert!(!signature_path(&deb).exists());
    }

    #[test]
    fn keygen_refuses_to_overwrite_a_key() {
        let dir = temp_dir();
        let (secret, public) = keys(&dir, None);
        let before = std::fs::read(&secret).unwrap();
        assert!(matches!(
            generate_key(&secret, &public, None),
            Err(PackageError::Exists { .. })
        ));
        assert_eq!(std::fs::read(&secret).unwrap(), before);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn one_changed_byte_in_the_package_or_the_signature_is_refused() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        sign(&deb, &secret, None, 0).unwrap();

        let mut bytes = std::fs::read(&deb).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 1;
        let changed = dir.join("changed.deb");
        std::fs::write(&changed, &bytes).unwrap();
        std::fs::copy(signature_path(&deb), signature_path(&changed)).unwrap();
        assert!(matches!(
            verify(&changed, &public, SURFACE),
            Err(PackageError::BadSignature { .. })
        ));

        // The signature line is the second; change one of its base64 characters.
        let text = std::fs::read_to_string(signature_path(&deb)).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let flipped: String = lines[1]
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i == 20 {
                    if c == 'A' { 'B' } else { 'A' }
                } else {
                    c
                }
            })
            .collect();
        lines[1] = flipped;
        std::fs::write(signature_path(&deb), lines.join("\n") + "\n").unwrap();
        let error = verify(&deb, &public, SURFACE).unwrap_err();
        assert!(error.is_refusal(), "{error}");
    }

    #[test]
    fn verify_checks_the_signature_and_the_control_file_on_one_read_of_the_package() {
        let dir = temp_dir();
        let signed = write_deb(
            &dir,
            "signed.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        sign(&signed, &secret, None, 0).unwrap();
        let swapped = write_deb(
            &dir,
            "swapped.deb",
            &control_text("9.9", Some(SURFACE)),
            "control.tar.gz",
        );
        // A FIFO hands out the signed package to the first open and another package to the
        // next: a verifier that opens the path twice checks one file's signature and reads the
        // other's control file. The second package is served once verify has returned, or
        // after ten seconds to a verifier still waiting in a second open.
        let fifo = dir.join("served.deb");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::copy(signature_path(&signed), signature_path(&fifo)).unwrap();
        let payloads = [
            std::fs::read(&signed).unwrap(),
            std::fs::read(&swapped).unwrap(),
        ];
        let (verify_returned, returned) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn({
            let fifo = fifo.clone();
            move || {
                for (index, payload) in payloads.into_iter().enumerate() {
                    if index > 0 {
                        let _ = returned.recv_timeout(std::time::Duration::from_secs(10));
                    }
                    let mut pipe = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
                    // The reader may stop early (a refusal); a broken pipe is its business.
                    let _ = pipe.write_all(&payload);
                }
            }
        });
        let verified = verify(&fifo, &public, SURFACE);
        // A writer that served both packages already has hung up.
        let _ = verify_returned.send(());
        // Let the writer's second open complete if verify made none: a FIFO opened read-write
        // never blocks, and while it is held open the writer's open finds a reader and its
        // small write fits the pipe.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        writer.join().unwrap();
        drop(reader);
        assert_eq!(
            verified.unwrap(),
            PackageIdentity {
                package: "certistack-connector".into(),
                version: "1".into(),
                surface_digest: SURFACE.into()
            }
        );
    }

    /// A connector of another surface would fail the audit and is refused; a controller of
    /// another surface is the controller's own upgrade and verifies (the command says what
    /// follows for the nodes).
    #[test]
    fn only_the_connector_must_serve_this_controllers_surface() {
        let dir = temp_dir();
        let (secret, public) = keys(&dir, None);
        let other = "sha256:2222222222222222222222222222222222222222222222222222222222222222";
        let connector = write_deb(
            &dir,
            "connector.deb",
            &control_text("1", Some(other)),
            "control.tar.gz",
        );
        let controller = write_deb(
            &dir,
            "controller.deb",
            &control_text("1", Some(other)).replace(
                "Package: certistack-connector",
                "Package: certistack-controller",
            ),
            "control.tar.gz",
        );
        sign(&connector, &secret, None, 0).unwrap();
        sign(&controller, &secret, None, 0).unwrap();
        assert!(matches!(
            verify(&connector, &public, SURFACE),
            Err(PackageError::SurfaceDiffers { .. })
        ));
        // Any other name is held to the controller's surface, as the connector is.
        let other_name = write_deb(
            &dir,
            "ng.deb",
            &control_text("1", Some(other)).replace(
                "Package: certistack-connector",
                "Package: certistack-connector-ng",
            ),
            "control.tar.gz",
        );
        sign(&other_name, &secret, None, 0).unwrap();
        assert!(matches!(
            verify(&other_name, &public, SURFACE),
            Err(PackageError::SurfaceDiffers { .. })
        ));
        let verified = verify(&controller, &public, SURFACE).unwrap();
        assert_eq!(verified.package, CONTROLLER_PACKAGE);
        assert_eq!(verified.surface_digest, other);
    }

    #[test]
    fn a_package_larger_than_the_bound_is_refused_before_it_is_read() {
        let dir = temp_dir();
        let huge = dir.join("huge.deb");
        File::create(&huge)
            .unwrap()
            .set_len(MAX_PACKAGE_BYTES + 1)
            .unwrap();
        let small = write_deb(
            &dir,
            "small.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        sign(&small, &secret, None, 0).unwrap();
        std::fs::copy(signature_path(&small), signature_path(&huge)).unwrap();
        let error = verify(&huge, &public, SURFACE).unwrap_err();
        assert!(
            matches!(error, PackageError::PackageTooLarge { .. }) && error.is_refusal(),
            "{error}"
        );
        assert!(matches!(
            sign(&huge, &secret, None, 0),
            Err(PackageError::PackageTooLarge { .. })
        ));
    }

    #[test]
    fn another_key_is_refused() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, _) = keys(&dir, None);
        let other = temp_dir();
        let (_, other_public) = keys(&other, None);
        sign(&deb, &secret, None, 0).unwrap();
        assert!(matches!(
            verify(&deb, &other_public, SURFACE),
            Err(PackageError::BadSignature { .. })
        ));
    }

    #[test]
    fn a_package_for_another_surface_is_refused_with_what_to_do() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("1", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        sign(&deb, &secret, None, 0).unwrap();
        let ours = format!("sha256:{}", "2".repeat(64));
        let error = verify(&deb, &public, &ours).unwrap_err();
        assert!(matches!(error, PackageError::SurfaceDiffers { .. }));
        let message = error.to_string();
        assert!(
            message.contains(SURFACE)
                && message.contains(&ours)
                && message.contains("would fail the audit")
                && message.contains("install the connector release built with this certistack-ctl"),
            "{message}"
        );
    }

    #[test]
    fn a_signature_whose_trusted_comment_names_another_package_is_refused() {
        let dir = temp_dir();
        let deb = write_deb(
            &dir,
            "p.deb",
            &control_text("2.0", Some(SURFACE)),
            "control.tar.gz",
        );
        let (secret, public) = keys(&dir, None);
        // A valid signature by the right key, made over this package with an older release's
        // comment: replaying it must not make the package look like that release.
        let older = PackageIdentity {
            package: "certistack-connector".into(),
            version: "1.0".into(),
            surface_digest: SURFACE.into(),
        };
        let key = load_secret_key(&secret, None).unwrap();
        let signature = minisign::sign(
            None,
            &key,
            File::open(&deb).unwrap(),
            Some(&older.trusted_comment(0, "p.deb")),
            None,
        )
        .unwrap();
        std::fs::write(signature_path(&deb), signature.to_string()).unwrap();
        assert!(matches!(
            verify(&deb, &public, SURFACE),
            Err(PackageError::CommentMismatch { signed, .. }) if *signed == older
        ));
    }

    #[test]
    fn trusted_comments_other_than_ours_are_refused() {
        for comment in [
            "timestamp:1\tfile:x.deb",
            "package:a\tversion:1\tsurface:s\tpackage:b",
            "package:a\tversion:1\tsurface:s\textra:1",
            "package a",
        ] {
            assert!(
                matches!(
                    PackageIdentity::from_trusted_comment(comment),
                    Err(PackageError::TrustedComment { .. })
                ),
                "{comment}"
            );
        }
    }

    #[test]
    fn control_fields_are_read_from_the_first_paragraph_only() {
        let text = "Package: a\nDescription: x\n Version: not-this\nVersion: 1\n\nVersion: 2\n";
        assert_eq!(control_field(text, "version"), Some("1"));
        assert_eq!(control_field(text, "Missing"), None);
    }
}
