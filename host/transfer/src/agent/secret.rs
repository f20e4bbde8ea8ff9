//! The deployment's secret as hosts load it ([`load_secret`]).

use super::Secret;

/// Where [`load_secret`] looks when no file is given.
pub const SECRET_ENV: &str = "KVFERRY_SECRET";
/// A file holding the previous secret during a change of secret: [`load_secret`] accepts
/// peers that still prove it (see [`Secret::also_accepting`]).
pub const PREVIOUS_SECRET_FILE_ENV: &str = "KVFERRY_PREVIOUS_SECRET_FILE";

/// Why [`load_secret`] found no usable secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadSecretError {
    /// The file could not be read.
    #[error("reading the secret file {}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file may be read by others than its owner.
    #[error(
        "the secret file {} is readable by its group or others (mode {mode:04o}); run \
         `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    Exposed {
        /// The file.
        path: std::path::PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Neither a file nor the variable.
    #[error(
        "no secret: pass a secret file or set {SECRET_ENV} (at least {} bytes, the same for \
             every agent of the deployment)",
        kvferry_protocol::agent::MIN_SECRET_LEN
    )]
    Missing,
    /// Too short, or blank.
    #[error(transparent)]
    Invalid(#[from] kvferry_protocol::SecretError),
}

/// The deployment's secret as hosts take it: the bytes of `file` (a trailing newline
/// dropped; the file must not be readable by group or others), else of the environment
/// variable [`SECRET_ENV`]. During a change of secret, the file named by
/// [`PREVIOUS_SECRET_FILE_ENV`] holds the previous one, which is then accepted from peers too.
///
/// # Errors
///
/// See [`LoadSecretError`].
pub fn load_secret(file: Option<&std::path::Path>) -> Result<Secret, LoadSecretError> {
    let bytes = match file {
        Some(path) => read_secret_file(path)?,
        None => std::env::var_os(SECRET_ENV)
            .ok_or(LoadSecretError::Missing)?
            .into_encoded_bytes(),
    };
    let secret = Secret::new(bytes)?;
    match std::env::var_os(PREVIOUS_SECRET_FILE_ENV) {
        Some(previous) if !previous.is_empty() => {
            let bytes = read_secret_file(std::path::Path::new(&previous))?;
            Ok(secret.also_accepting(Secret::new(bytes)?))
        }
        _ => Ok(secret),
    }
}

fn read_secret_file(path: &std::path::Path) -> Result<Vec<u8>, LoadSecretError> {
    use std::os::unix::fs::PermissionsExt as _;
    let read = |source| LoadSecretError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(LoadSecretError::Exposed {
            path: path.to_path_buf(),
            mode: mode & 0o7777,
        });
    }
    let mut b = std::fs::read(path).map_err(read)?;
    while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
        b.pop();
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_readable_by_others_or_blank_are_refused_naming_the_fix() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a deployment secret of 32 bytes.\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_secret(Some(&path)).unwrap_err();
        assert!(
            matches!(e, LoadSecretError::Exposed { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load_secret(Some(&path)).is_ok());
        std::fs::write(&path, " ".repeat(20)).unwrap();
        let e = load_secret(Some(&path)).unwrap_err();
        assert!(e.to_string().contains("whitespace"), "{e}");
    }
}
