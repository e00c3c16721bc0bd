//! `package keygen`, `sign` and `verify`: connector packages signed with minisign, and checked before installing.

use crate::exit::ExitStatus;
use crate::package;
use clap::Subcommand;
use std::path::PathBuf;
use time::OffsetDateTime;

pub const PACKAGE_EXIT_CODES: &str = "Exit codes: 0 success (verify: the package is signed by the key, \
names itself as its control file does and serves this controller's surface); 1 local failure (a \
key, password or package that cannot be read or written, a key that would be overwritten); 4 the \
package is refused (signature, trusted comment, control file or surface digest): do not install it.";

#[derive(Subcommand, Debug)]
pub enum PackageCommand {
    /// Create a minisign key pair for signing packages (the secret key 0600; never overwrites).
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Keygen {
        /// Where to write the secret key.
        #[arg(long)]
        secret_key: PathBuf,
        /// Where to write the public key (give it to operators, e.g. beside the repository key).
        #[arg(long)]
        public_key: PathBuf,
        /// Encrypt the secret key with the password on this file's first line (as `minisign
        /// -G`); without it the key is stored unencrypted (as `minisign -G -W`).
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// Sign PKG, writing PKG.minisig with a trusted comment naming package, version and surface.
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Sign {
        /// The minisign secret key.
        #[arg(long)]
        key: PathBuf,
        /// The file holding the secret key's password (first line), if it is encrypted.
        #[arg(long)]
        password_file: Option<PathBuf>,
        /// The connector package (.deb).
        package: PathBuf,
    },
    /// Verify PKG against PKG.minisig and the public key, and that it serves this controller's
    /// surface.
    #[command(after_help = PACKAGE_EXIT_CODES)]
    Verify {
        /// The minisign public key (the file `package keygen` or `minisign -G` wrote, or the
        /// bare base64 key).
        #[arg(long)]
        pubkey: PathBuf,
        /// The connector package (.deb); its signature is PKG.minisig.
        package: PathBuf,
    },
}

/// Loads the controller's state directory (CA and keys), mapping its failures to the documented
/// exit codes: 66 unreadable, 77 owner or mode refused.
pub fn package_command(command: PackageCommand, now: OffsetDateTime) -> Result<(), ExitStatus> {
    let password = |file: Option<PathBuf>| {
        file.map(|path| package::read_password(&path))
            .transpose()
            .map_err(ExitStatus::from)
    };
    match command {
        PackageCommand::Keygen {
            secret_key,
            public_key,
            password_file,
        } => {
            let encrypted = password_file.is_some();
            package::generate_key(&secret_key, &public_key, password(password_file)?)?;
            println!(
                "wrote {} ({}) and {}",
                secret_key.display(),
                if encrypted {
                    "encrypted"
                } else {
                    "unencrypted"
                },
                public_key.display()
            );
            Ok(())
        }
        PackageCommand::Sign {
            key,
            password_file,
            package: path,
        } => {
            let timestamp = u64::try_from(now.unix_timestamp()).unwrap_or_default();
            let (signature, identity) =
                package::sign(&path, &key, password(password_file)?, timestamp)?;
            println!("signed {identity}: {}", signature.display());
            Ok(())
        }
        PackageCommand::Verify {
            pubkey,
            package: path,
        } => {
            let identity = package::verify(&path, &pubkey, certistack_proto::SURFACE_DIGEST)?;
            let surface = if identity.package != package::CONTROLLER_PACKAGE {
                "serves this controller's surface".to_owned()
            } else if identity.surface_digest == certistack_proto::SURFACE_DIGEST {
                "speaks this controller's surface".to_owned()
            } else {
                format!(
                    "speaks another surface than this certistack-ctl ({}): once it is installed, upgrade every node's connector to its release (certistack-ctl nodes audit shows DRIFT until then)",
                    certistack_proto::SURFACE_DIGEST
                )
            };
            println!(
                "ok: {} is {identity}, signed by the key in {}, and {surface}",
                path.display(),
                pubkey.display()
            );
            Ok(())
        }
    }
}
