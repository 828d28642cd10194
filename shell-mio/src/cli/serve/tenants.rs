//! `kvwarden serve`'s tenants: `--tenant NAME=MEMBERS`, their token files and the
//! TCP token, checked as the node will check them.

use super::ServeArgs;
use kvwarden_core::node::trust::{TenantSpec, TrustConfig};
use std::path::{Path, PathBuf};

/// A `--tenant` as given: token files are read when the server starts.
#[derive(Clone, Debug)]
pub struct TenantArg {
    name: String,
    uids: Vec<u32>,
    token_files: Vec<PathBuf>,
    quota_percent: Option<u32>,
    engine_driven: bool,
}

pub(super) fn parse_tenant(text: &str) -> Result<TenantArg, String> {
    let (name, members) = text.split_once('=').ok_or_else(|| {
        format!("`{text}`: expected NAME=MEMBER[,MEMBER...], e.g. team-a=uid:1001,uid:1002")
    })?;
    let mut tenant = TenantArg {
        name: name.to_owned(),
        uids: Vec::new(),
        token_files: Vec::new(),
        quota_percent: None,
        engine_driven: false,
    };
    for member in members.split(',').filter(|m| !m.is_empty()) {
        if let Some(uid) = member.strip_prefix("uid:") {
            let uid = uid
                .parse()
                .map_err(|_| format!("`{member}`: uid:N takes a numeric uid"))?;
            tenant.uids.push(uid);
        } else if let Some(path) = member.strip_prefix("token-file:") {
            tenant.token_files.push(PathBuf::from(path));
        } else if let Some(quota) = member.strip_prefix("quota:") {
            let percent = quota
                .trim_end_matches('%')
                .parse()
                .ok()
                .filter(|p| (1..=100).contains(p))
                .ok_or_else(|| format!("`{member}`: quota:P% takes 1% to 100%"))?;
            tenant.quota_percent = Some(percent);
        } else if member == "engine-driven" {
            tenant.engine_driven = true;
        } else {
            return Err(format!(
                "`{member}`: unknown member; use uid:N, token-file:PATH, quota:P% or engine-driven"
            ));
        }
    }
    Ok(tenant)
}

/// Reads a token file: its contents, surrounding whitespace stripped. Tokens never
/// travel on a command line.
fn read_token(path: &std::path::Path, flag: &str) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::PermissionsExt;
    let bytes =
        std::fs::read(path).map_err(|e| format!("{flag}: cannot read {}: {e}", path.display()))?;
    let token = bytes.trim_ascii().to_vec();
    if token.len() < kvwarden_core::node::trust::MIN_SECRET_BYTES {
        return Err(format!(
            "{flag}: {} holds {} bytes; a token needs at least {} (e.g. `openssl rand -hex 32 > {}`)",
            path.display(),
            token.len(),
            kvwarden_core::node::trust::MIN_SECRET_BYTES,
            path.display()
        ));
    }
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o004 != 0
    {
        tracing::warn!(path = %path.display(), "the TCP token file is readable by every user; chmod 600 it");
    }
    Ok(token)
}

pub(super) fn trust_config(args: &ServeArgs) -> Result<TrustConfig, String> {
    let mut tenants = Vec::new();
    let mut has_token = false;
    for tenant in &args.tenants {
        let tokens = tenant
            .token_files
            .iter()
            .map(|path| read_token(path, &format!("--tenant {}", tenant.name)))
            .collect::<Result<Vec<_>, _>>()?;
        has_token |= !tokens.is_empty();
        tenants.push(TenantSpec {
            name: tenant.name.clone(),
            uids: tenant.uids.clone(),
            tokens,
            quota_percent: tenant.quota_percent,
            engine_driven: tenant.engine_driven,
        });
    }
    if let Some(path) = &args.tcp_token_file {
        let token = read_token(path, "--tcp-token-file")?;
        has_token = true;
        match tenants.iter_mut().find(|t| t.name == "tcp") {
            Some(tcp) => tcp.tokens.push(token),
            None => tenants.push(TenantSpec {
                name: "tcp".into(),
                uids: Vec::new(),
                tokens: vec![token],
                quota_percent: None,
                engine_driven: false,
            }),
        }
    }
    if args.tcp.is_some() && !has_token {
        return Err(
            "--tcp needs --tcp-token-file PATH: TCP has no peer credentials, so every TCP \
             worker proves it holds a token (make one with `openssl rand -hex 32 > PATH; \
             chmod 600 PATH`)"
                .into(),
        );
    }
    // A new secret for the TCP challenges' nonces at each start.
    let mut nonce_secret = [0u8; 32];
    getrandom::fill(&mut nonce_secret)
        .map_err(|error| format!("no randomness for the TCP challenges' nonces: {error}"))?;
    let subuids = match &args.subuid_file {
        Some(path) => crate::cli::subuid::read(path, true)?,
        None => crate::cli::subuid::read(Path::new(crate::cli::subuid::DEFAULT_PATH), false)?,
    };
    let config = TrustConfig {
        tenants,
        nonce_secret,
        subuids,
        max_tenants: None,
    };
    kvwarden_core::node::trust::Trust::new(&config, rustix::process::getuid().as_raw())
        .map_err(|e| format!("invalid --tenant: {e}"))?;
    Ok(config)
}
