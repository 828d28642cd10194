//! Where the nodes are and how a connection to one is made: addresses, the cluster's
//! masters from `CLUSTER SLOTS`, TLS and the credentials.

use crate::l2::config::L2Config;
use std::sync::Arc;
use std::time::Duration;

/// How a connection is made: TLS or not, and the credentials.
pub(in crate::l2) struct Link {
    pub(super) tls: Option<Arc<rustls::ClientConfig>>,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) timeout: Duration,
}

impl Link {
    /// The link of `config`; an error names what in the TLS files rustls refused.
    pub(in crate::l2) fn new(config: &L2Config) -> Result<Link, String> {
        let tls = if config.uses_tls() {
            Some(Arc::new(tls_config(config)?))
        } else {
            None
        };
        Ok(Link {
            tls,
            username: config.auth.username.clone(),
            password: config.auth.password.clone(),
            timeout: config.timeout,
        })
    }
}

fn tls_config(config: &L2Config) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    match config.tls.as_ref().and_then(|tls| tls.ca_pem.as_ref()) {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|error| format!("--l2-tls-ca-file: {error}"))?;
                roots
                    .add(cert)
                    .map_err(|error| format!("--l2-tls-ca-file: {error}"))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                // A system root rustls cannot use is skipped, as redis-rs does.
                let _ = roots.add(cert);
            }
        }
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match config.tls.as_ref().and_then(|tls| tls.client_pem.as_ref()) {
        Some((chain, key)) => {
            let chain = CertificateDer::pem_slice_iter(chain)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| format!("--l2-tls-cert-file: {error}"))?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|error| format!("--l2-tls-key-file: {error}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|error| format!("--l2-tls-cert-file with --l2-tls-key-file: {error}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// A node's address as the cluster (or the seed) names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::l2) struct Addr {
    pub(in crate::l2) host: String,
    pub(in crate::l2) port: u16,
}

impl Addr {
    /// As a seed URL of `scheme` (`redis` or `rediss`).
    pub(in crate::l2) fn url(&self, scheme: &str) -> String {
        if self.host.contains(':') {
            format!("{scheme}://[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// Every node a `CLUSTER SLOTS` answer names (masters and replicas, each once, in its
/// order); a node without a host is `seed`'s host, as Redis means it.
pub(in crate::l2) fn cluster_nodes(slots: &redis::Value, seed: &Addr) -> Vec<Addr> {
    use redis::Value;
    let mut nodes: Vec<Addr> = Vec::new();
    let Value::Array(ranges) = slots else {
        return nodes;
    };
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        for node in fields.iter().skip(2) {
            let Value::Array(node) = node else {
                continue;
            };
            let host = match node.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => String::new(),
            };
            let Some(Ok(port)) = node.get(1).map(|port| match port {
                Value::Int(port) => u16::try_from(*port),
                _ => u16::try_from(-1i64),
            }) else {
                continue;
            };
            let addr = Addr {
                host: if host.is_empty() || host == "?" {
                    seed.host.clone()
                } else {
                    host
                },
                port,
            };
            if !nodes.contains(&addr) {
                nodes.push(addr);
            }
        }
    }
    nodes
}
