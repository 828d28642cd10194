//! The L2 client's configuration and the checks that keep it sane.

use kvwarden_core::l2::Namespace;
use std::time::Duration;
use thiserror::Error;

/// The most L2 threads accepted: each holds one connection to every Redis node.
pub const MAX_THREADS: usize = 64;

/// How the L2 client reaches the store and how much it may hold.
#[derive(Clone, Debug)]
pub struct L2Config {
    /// Seed addresses as `redis://HOST:PORT` URLs: any node of a Redis Cluster, or one
    /// plain Redis. See [`L2Config::parse_seeds`].
    pub seeds: Vec<String>,
    /// The key prefix.
    pub namespace: Namespace,
    /// The bound on every wait: a read or existence check not answered by then is a
    /// miss; each connect, send and receive of an L2 thread gives up after it.
    pub timeout: Duration,
    /// Expiry of written values (`SET … PX`); `None`: no expiry, the cluster's
    /// `maxmemory-policy` evicts.
    pub ttl: Option<Duration>,
    /// The bound of the write-behind queue, header bytes included (0: writes are dropped).
    pub write_queue_bytes: u64,
    /// L2 threads (1 to [`MAX_THREADS`]), each with its own connection.
    pub threads: usize,
}

/// A configuration value that was rejected, naming it and the fix.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum L2ConfigError {
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

impl L2Config {
    /// The seeds of `--l2`: comma-separated `redis://HOST:PORT` (later entries may omit
    /// the scheme, as in `redis://a:6379,b:6379`).
    pub fn parse_seeds(flag: &str) -> Result<Vec<String>, L2ConfigError> {
        let seeds: Vec<String> = flag
            .split(',')
            .map(str::trim)
            .filter(|seed| !seed.is_empty())
            .map(|seed| {
                if seed.contains("://") {
                    Ok(seed.to_string())
                } else if has_port(seed) {
                    Ok(format!("redis://{seed}"))
                } else {
                    Err(L2ConfigError::Seed {
                        seed: seed.to_string(),
                        reason: "it is neither a URL nor HOST:PORT (a bare name would be \
                                 taken for a host on the default port, which is rarely meant)"
                            .into(),
                    })
                }
            })
            .collect::<Result<_, _>>()?;
        if seeds.is_empty() {
            return Err(L2ConfigError::NoSeeds {
                given: flag.to_string(),
            });
        }
        for seed in &seeds {
            check_seed(seed)?;
        }
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

fn check_seed(seed: &str) -> Result<(), L2ConfigError> {
    let refuse = |reason: String| L2ConfigError::Seed {
        seed: seed.to_string(),
        reason,
    };
    if !(seed.starts_with("redis://") || seed.starts_with("valkey://")) {
        return Err(refuse(
            "only redis:// (or valkey://) URLs are supported".into(),
        ));
    }
    redis::Client::open(seed)
        .map(drop)
        .map_err(|error| refuse(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> L2Config {
        L2Config {
            seeds: vec!["redis://127.0.0.1:7000".into()],
            namespace: Namespace::default(),
            timeout: Duration::from_millis(50),
            ttl: None,
            write_queue_bytes: 1 << 20,
            threads: 2,
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
