//! `kvwarden serve`'s L2 flags: the cluster, its TLS, the values' secret and format,
//! and Redis's password (a file or the environment).

use super::{ServeArgs, warn_if_world_readable};
use crate::l2::{L2Auth, L2Config, L2Tls};
use kvwarden_core::l2::{ClusterSecret, Namespace, ValueFormat};
use std::time::Duration;

/// The L2 flags checked, or None without `--l2`.
pub(super) fn l2_config(args: &ServeArgs) -> Result<Option<L2Config>, String> {
    let Some(seeds) = &args.l2 else {
        return Ok(None);
    };
    let seeds = L2Config::parse_seeds(seeds).map_err(|e| e.to_string())?;
    let namespace = Namespace::new(&args.l2_namespace).map_err(|e| e.to_string())?;
    if args.l2_timeout_ms == 0 || args.l2_timeout_ms > 60_000 {
        return Err(format!(
            "invalid --l2-timeout-ms {}: use 1 to 60000 ms (for example 50)",
            args.l2_timeout_ms
        ));
    }
    if args.l2_ttl_seconds > 100 * 365 * 86_400 {
        return Err(format!(
            "invalid --l2-ttl-seconds {}: use 0 (no expiry) up to 100 years of seconds",
            args.l2_ttl_seconds
        ));
    }
    let tls = match (
        &args.l2_tls_ca_file,
        &args.l2_tls_cert_file,
        &args.l2_tls_key_file,
    ) {
        (None, None, None) => None,
        (ca, cert, key) => {
            let flag = if ca.is_some() {
                "--l2-tls-ca-file"
            } else {
                "--l2-tls-cert-file"
            };
            L2Config::check_tls_flag(&seeds, flag).map_err(|e| e.to_string())?;
            let client = match (cert, key) {
                (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
                (None, None) => None,
                _ => {
                    return Err(
                        "--l2-tls-cert-file and --l2-tls-key-file go together: give \
                                both (mutual TLS) or neither"
                            .into(),
                    );
                }
            };
            if let Some((_, key)) = client {
                warn_if_world_readable("--l2-tls-key-file", key);
            }
            Some(L2Tls::from_files(ca.as_deref(), client).map_err(|e| e.to_string())?)
        }
    };
    let secret = match &args.l2_secret_file {
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| {
                format!(
                    "--l2-secret-file {}: cannot read it: {e} (give every server of the \
                     namespace the same file of at least 32 bytes)",
                    path.display()
                )
            })?;
            warn_if_world_readable("--l2-secret-file", path);
            Some(
                ClusterSecret::from_file_bytes(&path.display().to_string(), &bytes)
                    .map_err(|e| e.to_string())?,
            )
        }
        None => None,
    };
    let config = L2Config {
        seeds,
        auth: l2_auth(args)?,
        tls,
        format: ValueFormat::new(secret, args.slot_bytes),
        namespace,
        timeout: Duration::from_millis(args.l2_timeout_ms),
        ttl: (args.l2_ttl_seconds > 0).then(|| Duration::from_secs(args.l2_ttl_seconds)),
        write_queue_bytes: args.l2_write_queue_bytes,
        threads: args.l2_threads,
        known_nodes: Default::default(),
    };
    config.validate().map_err(|e| e.to_string())?;
    Ok(Some(config))
}

/// Warns when the file of `flag` at `path` is readable by every user: it holds a secret.
/// The environment variable that may hold the L2 password.
pub const L2_PASSWORD_ENV: &str = "KVWARDEN_L2_PASSWORD";

/// The L2 credentials: `--l2-username`, and the password from `--l2-password-file` or
/// [`L2_PASSWORD_ENV`] (not both).
fn l2_auth(args: &ServeArgs) -> Result<L2Auth, String> {
    let from_env = std::env::var_os(L2_PASSWORD_ENV).filter(|value| !value.is_empty());
    let password = match (&args.l2_password_file, from_env) {
        (Some(path), Some(_)) => {
            return Err(format!(
                "--l2-password-file {} and {L2_PASSWORD_ENV} both given: use one",
                path.display()
            ));
        }
        (Some(path), None) => {
            let bytes = std::fs::read(path).map_err(|e| {
                format!("--l2-password-file {}: cannot read it: {e}", path.display())
            })?;
            warn_if_world_readable("--l2-password-file", path);
            let text = String::from_utf8(bytes.trim_ascii().to_vec()).map_err(|_| {
                format!(
                    "--l2-password-file {}: the password is not UTF-8 text",
                    path.display()
                )
            })?;
            if text.is_empty() {
                return Err(format!(
                    "--l2-password-file {}: the file is empty; put the password in it",
                    path.display()
                ));
            }
            Some(text)
        }
        (None, Some(value)) => Some(
            value
                .into_string()
                .map_err(|_| format!("{L2_PASSWORD_ENV}: the password is not UTF-8 text"))?,
        ),
        (None, None) => None,
    };
    if args.l2_username.is_some() && password.is_none() {
        return Err(format!(
            "--l2-username needs a password: give --l2-password-file PATH or set \
             {L2_PASSWORD_ENV}"
        ));
    }
    Ok(L2Auth {
        username: args.l2_username.clone(),
        password,
    })
}
