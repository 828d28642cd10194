//! The L2 client's configuration and the checks that keep it sane: seeds (`redis://`
//! or `rediss://`, never with a credential in them), the TLS files, the credentials and
//! the value format (the cluster secret and the slot bound).

use kvwarden_core::l2::{Namespace, ValueFormat};
use std::time::Duration;
use thiserror::Error;

/// The most L2 threads accepted: each holds one connection to every Redis node.
pub const MAX_THREADS: usize = 64;

/// How the L2 client reaches the store and how much it may hold.
#[derive(Clone, Debug)]
pub struct L2Config {
    /// Seed addresses as `redis://HOST:PORT` (or, all of them, `rediss://HOST:PORT`)
    /// URLs: any node of a Redis Cluster, or one plain Redis; never a credential in them.
    /// See [`L2Config::parse_seeds`].
    pub seeds: Vec<String>,
    /// The credentials every connection presents (`AUTH`).
    pub auth: L2Auth,
    /// The certificates of `rediss://` seeds; None: the system's roots, no client
    /// certificate.
    pub tls: Option<L2Tls>,
    /// How values are written and read: with a MAC or a checksum, and the slot bound.
    pub format: ValueFormat,
    /// The key prefix.
    pub namespace: Namespace,
    /// The bound on every wait: a read or existence check not answered by then is a
    /// miss; each connect, send and receive of an L2 thread gives up after it.
    pub timeout: Duration,
    /// Expiry of written values (`SET … PX`); `None`: no expiry, the cluster's
    /// `maxmemory-policy` evicts.
    pub ttl: Option<Duration>,
    /// The bound of the write-behind queue, header bytes included (0: writes are
    /// dropped): the node's (`L2NodeConfig::write_queue_bytes`), which submits to the
    /// client only the writes within it.
    pub write_queue_bytes: u64,
    /// L2 threads (1 to [`MAX_THREADS`]), each with its own connection.
    pub threads: usize,
    /// Every node the cluster's latest slot map named, learned at run time and shared
    /// by every clone of this config: after the first map, connections and maps are
    /// asked of these too, not only of the seeds, so that L2 outlives its seed (row 62).
    pub known_nodes: KnownNodes,
}

/// The nodes of the cluster as its latest slot map named them (masters and replicas),
/// and the node that answered that map. Shared by every thread of one L2 client.
#[derive(Clone, Debug, Default)]
pub struct KnownNodes(std::sync::Arc<std::sync::Mutex<Learned>>);

#[derive(Debug, Default)]
struct Learned {
    /// `redis[s]://HOST:PORT`, in the map's order.
    nodes: Vec<String>,
    /// The node whose `CLUSTER SLOTS` the data path uses now.
    map_from: Option<String>,
}

impl KnownNodes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Learned> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where to ask, in order: the seeds, then every other node the latest map named.
    pub fn candidates(&self, seeds: &[String]) -> Vec<String> {
        let learned = self.lock();
        let mut out = seeds.to_vec();
        for node in &learned.nodes {
            if !out.contains(node) {
                out.push(node.clone());
            }
        }
        out
    }

    /// The cluster's nodes, as the map `from` named them.
    pub fn learn(&self, nodes: Vec<String>, from: String) {
        let mut learned = self.lock();
        learned.nodes = nodes;
        learned.map_from = Some(from);
    }

    /// The node whose slot map is in use, once one was read.
    pub fn map_from(&self) -> Option<String> {
        self.lock().map_from.clone()
    }
}

/// The credentials of every L2 connection; the password is never printed (`Debug` says
/// `<redacted>`).
#[derive(Clone, Default)]
pub struct L2Auth {
    /// The ACL user (`--l2-username`); None: the default user.
    pub username: Option<String>,
    /// The password (`--l2-password-file` or `KVWARDEN_L2_PASSWORD`).
    pub password: Option<String>,
}

impl std::fmt::Debug for L2Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L2Auth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The PEM files of a TLS L2, read and checked at start.
#[derive(Clone)]
pub struct L2Tls {
    /// The CA certificates that sign the Redis servers' certificates
    /// (`--l2-tls-ca-file`); None: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// The client certificate chain and its key, for mutual TLS
    /// (`--l2-tls-cert-file`, `--l2-tls-key-file`).
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for L2Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L2Tls")
            .field("ca", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field(
                "client",
                &self.client_pem.as_ref().map(|_| "<pem, key redacted>"),
            )
            .finish()
    }
}

impl L2Tls {
    /// The certificates as the Redis client takes them.
    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client_pem
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca_pem.clone(),
        }
    }

    /// Reads and checks the files of `--l2-tls-ca-file` and of `--l2-tls-cert-file` with
    /// `--l2-tls-key-file` (both or neither): each must hold PEM the TLS client takes.
    pub fn from_files(
        ca: Option<&std::path::Path>,
        client: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Result<L2Tls, L2ConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certificates = |flag: &'static str, path: &std::path::Path| {
            let bytes = read_file(flag, path)?;
            let chain = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| L2ConfigError::file(flag, path, error.to_string()))?;
            if chain.is_empty() {
                return Err(L2ConfigError::file(
                    flag,
                    path,
                    "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
                ));
            }
            Ok((bytes, chain))
        };
        let ca_pem = match ca {
            Some(path) => {
                let (bytes, chain) = certificates("--l2-tls-ca-file", path)?;
                let mut roots = rustls::RootCertStore::empty();
                for certificate in chain {
                    roots.add(certificate).map_err(|error| {
                        L2ConfigError::file("--l2-tls-ca-file", path, error.to_string())
                    })?;
                }
                Some(bytes)
            }
            None => None,
        };
        let client_pem = match client {
            Some((cert, key)) => {
                let (cert_bytes, chain) = certificates("--l2-tls-cert-file", cert)?;
                let key_bytes = read_file("--l2-tls-key-file", key)?;
                let private = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|error| {
                    L2ConfigError::file(
                        "--l2-tls-key-file",
                        key,
                        format!("{error} (a PEM private key, PKCS#8, PKCS#1 or SEC1, is needed)"),
                    )
                })?;
                install_crypto_provider();
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_client_auth_cert(chain, private)
                    .map_err(|error| {
                        L2ConfigError::file(
                            "--l2-tls-key-file",
                            key,
                            format!(
                                "it does not go with --l2-tls-cert-file {}: {error}",
                                cert.display()
                            ),
                        )
                    })?;
                Some((cert_bytes, key_bytes))
            }
            None => None,
        };
        Ok(L2Tls { ca_pem, client_pem })
    }
}

/// Makes ring the process's TLS crypto provider (once; later calls do nothing).
pub(super) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read_file(flag: &'static str, path: &std::path::Path) -> Result<Vec<u8>, L2ConfigError> {
    std::fs::read(path).map_err(|error| L2ConfigError::file(flag, path, error.to_string()))
}

/// A seed as it may be printed: a credential in it (`user:password@`) replaced.
pub fn redact_seed(seed: &str) -> String {
    match seed.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://<credential removed>@{host}"),
            None => seed.to_string(),
        },
        None => match seed.rsplit_once('@') {
            Some((_, host)) => format!("<credential removed>@{host}"),
            None => seed.to_string(),
        },
    }
}

/// A configuration value that was rejected, naming it and the fix.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum L2ConfigError {
    /// A file of a flag that cannot be read or does not hold what it should.
    #[error("{flag} {path}: {reason}")]
    File {
        /// The flag.
        flag: &'static str,
        /// The file, as named.
        path: String,
        /// What is wrong, and the fix.
        reason: String,
    },
    /// A seed carries a user name or password.
    #[error(
        "invalid --l2 seed {seed:?}: a credential in the URL would show in the process \
         list, /status and the logs; give the password in --l2-password-file PATH or the \
         environment variable KVWARDEN_L2_PASSWORD (and the user in --l2-username), and the \
         seed as redis://HOST:PORT"
    )]
    Credential {
        /// The seed, the credential removed.
        seed: String,
    },
    /// `redis://` and `rediss://` seeds together.
    #[error(
        "invalid --l2 {given:?}: redis:// (plain) and rediss:// (TLS) seeds mixed; a \
         cluster is reached one way, so give every seed the same scheme"
    )]
    MixedSchemes {
        /// The seeds, credentials removed.
        given: String,
    },
    /// TLS files given for plain seeds.
    #[error(
        "{flag} is for TLS seeds, but --l2 names redis:// seeds; use rediss://HOST:PORT or \
         drop {flag}"
    )]
    TlsWithoutTls {
        /// The TLS flag given.
        flag: &'static str,
    },
    /// No seed given.
    #[error("invalid --l2 {given:?}: name at least one seed, as redis://HOST:PORT[,HOST:PORT...]")]
    NoSeeds {
        /// The flag's value.
        given: String,
    },
    /// A seed that is not a Redis URL.
    #[error("invalid --l2 seed {seed:?}: {reason}; use redis://HOST:PORT[,HOST:PORT...]")]
    Seed {
        /// The seed.
        seed: String,
        /// What the URL parser said.
        reason: String,
    },
    /// A zero timeout would miss every read.
    #[error("invalid --l2-timeout-ms 0: use at least 1 ms (for example 50)")]
    Timeout,
    /// No threads, or more than the limit.
    #[error("invalid --l2-threads {threads}: use 1 to {MAX_THREADS}")]
    Threads {
        /// The count given.
        threads: usize,
    },
}

impl L2ConfigError {
    fn file(flag: &'static str, path: &std::path::Path, reason: String) -> L2ConfigError {
        L2ConfigError::File {
            flag,
            path: path.display().to_string(),
            reason,
        }
    }
}

impl L2Config {
    /// Whether the seeds are `rediss://`.
    pub fn uses_tls(&self) -> bool {
        self.seeds.first().is_some_and(|seed| is_tls(seed))
    }

    /// Refuses the TLS flag `flag` unless `seeds` are `rediss://`.
    pub fn check_tls_flag(seeds: &[String], flag: &'static str) -> Result<(), L2ConfigError> {
        if seeds.first().is_some_and(|seed| is_tls(seed)) {
            Ok(())
        } else {
            Err(L2ConfigError::TlsWithoutTls { flag })
        }
    }

    /// The seeds of `--l2`: comma-separated `redis://HOST:PORT` or `rediss://HOST:PORT`
    /// (later entries may omit the scheme, as in `redis://a:6379,b:6379`, and take the
    /// first one's); every seed of one scheme, and no credential in any.
    pub fn parse_seeds(flag: &str) -> Result<Vec<String>, L2ConfigError> {
        let scheme = flag
            .split(',')
            .map(str::trim)
            .find_map(|seed| seed.split_once("://").map(|(scheme, _)| scheme))
            .unwrap_or("redis");
        let seeds: Vec<String> = flag
            .split(',')
            .map(str::trim)
            .filter(|seed| !seed.is_empty())
            .map(|seed| {
                if seed.contains("://") {
                    Ok(seed.to_string())
                } else if seed.contains('@') {
                    Err(L2ConfigError::Credential {
                        seed: redact_seed(seed),
                    })
                } else if has_port(seed) {
                    Ok(format!("{scheme}://{seed}"))
                } else {
                    Err(L2ConfigError::Seed {
                        seed: redact_seed(seed),
                        reason: "it is neither a URL nor HOST:PORT (a bare name would be \
                                 taken for a host on the default port, which is rarely meant)"
                            .into(),
                    })
                }
            })
            .collect::<Result<_, _>>()?;
        if seeds.is_empty() {
            return Err(L2ConfigError::NoSeeds {
                given: redact_seed(flag),
            });
        }
        for seed in &seeds {
            check_seed(seed)?;
        }
        check_schemes(&seeds)?;
        Ok(seeds)
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<(), L2ConfigError> {
        if self.seeds.is_empty() {
            return Err(L2ConfigError::NoSeeds {
                given: String::new(),
            });
        }
        for seed in &self.seeds {
            check_seed(seed)?;
        }
        check_schemes(&self.seeds)?;
        if let Some(tls) = &self.tls {
            L2Config::check_tls_flag(
                &self.seeds,
                if tls.ca_pem.is_some() {
                    "--l2-tls-ca-file"
                } else {
                    "--l2-tls-cert-file"
                },
            )?;
        }
        if self.timeout.is_zero() {
            return Err(L2ConfigError::Timeout);
        }
        if self.threads == 0 || self.threads > MAX_THREADS {
            return Err(L2ConfigError::Threads {
                threads: self.threads,
            });
        }
        Ok(())
    }
}

/// `HOST:PORT` (or `[V6]:PORT`) with a numeric port.
fn has_port(seed: &str) -> bool {
    seed.rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

fn is_tls(seed: &str) -> bool {
    seed.starts_with("rediss://") || seed.starts_with("valkeys://")
}

fn check_seed(seed: &str) -> Result<(), L2ConfigError> {
    use redis::IntoConnectionInfo;
    let refuse = |reason: String| L2ConfigError::Seed {
        seed: redact_seed(seed),
        reason,
    };
    if !(seed.starts_with("redis://") || seed.starts_with("valkey://") || is_tls(seed)) {
        return Err(refuse(
            "only redis:// (or valkey://) and rediss:// (TLS) URLs are supported".into(),
        ));
    }
    // Refused before it is parsed, so that no parser's message can repeat it.
    if seed
        .split_once("://")
        .is_some_and(|(_, rest)| rest.contains('@'))
    {
        return Err(L2ConfigError::Credential {
            seed: redact_seed(seed),
        });
    }
    let info = seed
        .into_connection_info()
        .map_err(|error| refuse(error.to_string()))?;
    if info.redis_settings().password().is_some() || info.redis_settings().username().is_some() {
        return Err(L2ConfigError::Credential {
            seed: redact_seed(seed),
        });
    }
    Ok(())
}

fn check_schemes(seeds: &[String]) -> Result<(), L2ConfigError> {
    let tls = seeds.iter().filter(|seed| is_tls(seed)).count();
    if tls != 0 && tls != seeds.len() {
        return Err(L2ConfigError::MixedSchemes {
            given: seeds.join(","),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> L2Config {
        L2Config {
            seeds: vec!["redis://127.0.0.1:7000".into()],
            auth: L2Auth::default(),
            tls: None,
            format: ValueFormat::new(None, 1 << 20),
            namespace: Namespace::default(),
            timeout: Duration::from_millis(50),
            ttl: None,
            write_queue_bytes: 1 << 20,
            threads: 2,
            known_nodes: Default::default(),
        }
    }

    #[test]
    fn a_seed_that_is_neither_a_url_nor_host_port_is_refused_naming_the_form() {
        let error = L2Config::parse_seeds("foo").unwrap_err().to_string();
        assert!(error.contains("\"foo\""), "{error}");
        assert!(error.contains("redis://HOST:PORT"), "{error}");
        assert_eq!(
            L2Config::parse_seeds("redis://a:7000,b:7001").unwrap(),
            vec!["redis://a:7000".to_string(), "redis://b:7001".to_string()]
        );
        assert!(L2Config::parse_seeds("redis://a:7000,b").is_err());
        assert!(L2Config::parse_seeds("127.0.0.1:6379").is_ok());
    }

    #[test]
    fn seeds_after_the_first_may_omit_the_scheme() {
        assert_eq!(
            L2Config::parse_seeds("redis://a:7000, b:7001,,").unwrap(),
            ["redis://a:7000", "redis://b:7001"]
        );
    }

    #[test]
    fn empty_or_foreign_seeds_are_refused_naming_the_flag() {
        let error = L2Config::parse_seeds(" , ").unwrap_err();
        assert!(error.to_string().contains("--l2"), "{error}");
        let error = L2Config::parse_seeds("http://a:7000").unwrap_err();
        assert!(error.to_string().contains("http://a:7000"), "{error}");
    }

    #[test]
    fn rediss_seeds_are_accepted_and_mixed_schemes_refused() {
        assert_eq!(
            L2Config::parse_seeds("rediss://a:7000,b:7001").unwrap(),
            ["rediss://a:7000", "rediss://b:7001"]
        );
        let error = L2Config::parse_seeds("redis://a:7000,rediss://b:7001").unwrap_err();
        assert!(
            matches!(error, L2ConfigError::MixedSchemes { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("same scheme"), "{error}");
        let mut plain = config();
        plain.tls = Some(L2Tls {
            ca_pem: Some(Vec::new()),
            client_pem: None,
        });
        let error = plain.validate().unwrap_err().to_string();
        assert!(
            error.contains("--l2-tls-ca-file") && error.contains("rediss://"),
            "{error}"
        );
    }

    #[test]
    fn a_credential_in_a_seed_is_refused_without_repeating_it() {
        assert!(L2Config::parse_seeds("redis://127.0.0.1:7000").is_ok());
        for seed in [
            "redis://:hunter2secret@127.0.0.1:7000",
            "rediss://bob:hunter2secret@127.0.0.1:7000",
            "redis://a:7000,bob:hunter2secret@b:7001",
        ] {
            let error = L2Config::parse_seeds(seed).unwrap_err().to_string();
            assert!(!error.contains("hunter2secret"), "{error}");
            assert!(
                error.contains("--l2-password-file") && error.contains("KVWARDEN_L2_PASSWORD"),
                "{error}"
            );
        }
        let auth = L2Auth {
            username: Some("bob".into()),
            password: Some("hunter2secret".into()),
        };
        assert!(!format!("{auth:?}").contains("hunter2secret"));
    }

    #[test]
    fn zero_timeout_and_thread_counts_out_of_range_are_refused() {
        assert!(config().validate().is_ok());
        let mut bad = config();
        bad.timeout = Duration::ZERO;
        assert_eq!(bad.validate(), Err(L2ConfigError::Timeout));
        for threads in [0, MAX_THREADS + 1] {
            let mut bad = config();
            bad.threads = threads;
            assert!(
                bad.validate()
                    .unwrap_err()
                    .to_string()
                    .contains("--l2-threads")
            );
        }
    }
}
