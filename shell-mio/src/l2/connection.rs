//! One L2 thread's connection: a Redis Cluster, or a single plain Redis.
//!
//! Which one is decided at connect time by asking the first reachable seed
//! `CLUSTER INFO`: a node with cluster support answers it, a plain Redis refuses it
//! ("cluster support disabled"). Any other refusal is taken as a plain Redis too (an
//! ACL that forbids `CLUSTER` could not run a cluster client anyway). Asking beats
//! counting seeds: one seed is a normal way to name a whole cluster.
//!
//! Every connect, send and receive gives up after the configured timeout. A few
//! handshake steps inside redis-rs (the cluster client's `READONLY` on a new node
//! connection) have no timeout of their own: a node that accepts a connection and then
//! never answers (SIGSTOPped) holds that one L2 thread until it answers again; the
//! caller is answered by the deadline thread regardless. Against a node that vanished
//! from the network (nothing acknowledged), `TCP_USER_TIMEOUT` ends such a wait after
//! [`user_timeout`] instead of the kernel's many minutes. Sockets are `TCP_NODELAY`.
//!
//! Every connection presents the configured credentials (`AUTH`), and `rediss://` seeds
//! are reached over TLS (rustls) with the server's certificate verified against
//! `--l2-tls-ca-file` (or the system's roots) and its name; there is no insecure mode.

use super::config::L2Config;
use super::direct::{Addr, Direct, Link};
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::io::tcp::TcpSettings;
use redis::{ConnectionInfo, ConnectionLike, IntoConnectionInfo, RedisError, RedisResult};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Whether the warning about several seeds of a plain Redis was logged (once a process).
static PLAIN_WITH_SEEDS_WARNED: AtomicBool = AtomicBool::new(false);

/// Redirections (MOVED, ASK) and retries redis-rs may make inside one operation. Kept
/// small: the caller's wait is bounded anyway, and a dead node is better left to the
/// next operation on a fresh connection (see [`RedisConn::connect`]).
const CLUSTER_RETRIES: u32 = 2;

/// The shortest `TCP_USER_TIMEOUT`: a congested but live link must not be cut.
const USER_TIMEOUT_FLOOR: Duration = Duration::from_secs(5);

/// How long sent data may stay unacknowledged before the kernel drops the connection:
/// 4 × the L2 timeout, at least [`USER_TIMEOUT_FLOOR`].
pub(super) fn user_timeout(timeout: Duration) -> Duration {
    timeout.saturating_mul(4).max(USER_TIMEOUT_FLOOR)
}

fn tcp_settings(timeout: Duration) -> TcpSettings {
    let settings = TcpSettings::default().set_nodelay(true);
    #[cfg(target_os = "linux")]
    let settings = settings.set_user_timeout(user_timeout(timeout));
    #[cfg(not(target_os = "linux"))]
    let _ = timeout;
    settings
}

/// Which kind of store the seeds turned out to be.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A Redis Cluster (or Valkey cluster).
    Cluster,
    /// One plain Redis.
    Single,
}

/// A connection to the L2 store.
pub(super) enum RedisConn {
    Cluster(Box<ClusterConnection>),
    Single(redis::Connection, Addr),
}

impl RedisConn {
    /// Connects through the first seed that answers. A fresh cluster connection reads
    /// the slot map anew, which is how a thread learns about a failover: after any
    /// error the thread drops its connection and the next operation comes here.
    pub(super) fn connect(config: &L2Config, timeout: Duration) -> RedisResult<RedisConn> {
        let seeds = &config.seeds;
        let mut last_error = None;
        for seed in &config.known_nodes.candidates(seeds) {
            let probe = seed_connection(config, seed, timeout);
            let mut connection = match probe {
                Ok(connection) => connection,
                Err(error) => {
                    last_error = Some(error);
                    continue;
                }
            };
            match redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(&mut connection)
            {
                Ok(_) => return RedisConn::connect_cluster(config, timeout),
                Err(error) if is_server_refusal(&error) => {
                    if seeds.len() > 1 && !PLAIN_WITH_SEEDS_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            %seed,
                            "L2: the seed is a plain Redis, not a cluster node; only it is used, the other seeds are ignored"
                        );
                    }
                    return Ok(RedisConn::Single(connection, seed_addr(seed)?));
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error
            .unwrap_or_else(|| RedisError::from((redis::ErrorKind::Client, "no L2 seed"))))
    }

    fn connect_cluster(config: &L2Config, timeout: Duration) -> RedisResult<RedisConn> {
        // Every node the latest map named, not only the seeds: a cluster that lost its
        // seed in a failover is still reached (row 62).
        let mut builder = ClusterClient::builder(config.known_nodes.candidates(&config.seeds))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(CLUSTER_RETRIES)
            .tcp_settings(tcp_settings(timeout));
        if let Some(username) = &config.auth.username {
            builder = builder.username(username);
        }
        if let Some(password) = &config.auth.password {
            builder = builder.password(password);
        }
        if let Some(tls) = &config.tls
            && config.uses_tls()
        {
            builder = builder.certs(tls.certificates());
        }
        let connection = builder.build()?.get_connection()?;
        connection.set_write_timeout(Some(timeout))?;
        Ok(RedisConn::Cluster(Box::new(connection)))
    }

    /// The data path's map of this store: the seed of a plain Redis, or the cluster's
    /// masters by hash slot (`CLUSTER SLOTS`, from the seeds).
    pub(super) fn direct(&mut self, link: &Arc<Link>, config: &L2Config) -> RedisResult<Direct> {
        match self {
            RedisConn::Single(_, seed) => Ok(Direct::single(Arc::clone(link), seed.clone())),
            RedisConn::Cluster(..) => {
                let (slots, seed) = slots_from_seeds(config)?;
                Direct::cluster(Arc::clone(link), &slots, &seed).map_err(map_error)
            }
        }
    }

    /// Reads the cluster's slot map anew into `direct` (after a redirection or an
    /// error on the data path), from the seeds.
    pub(super) fn refresh(&mut self, direct: &mut Direct, config: &L2Config) -> RedisResult<()> {
        match self {
            RedisConn::Single(..) => Ok(()),
            RedisConn::Cluster(..) => {
                let (slots, seed) = slots_from_seeds(config)?;
                direct.set_map(&slots, &seed).map_err(map_error)
            }
        }
    }

    /// What this store is, in words: "a Redis Cluster of N masters" (from `CLUSTER
    /// NODES`) or "a single Redis node".
    pub(super) fn describe(&mut self) -> String {
        match self {
            RedisConn::Single(..) => "a single Redis node (not a cluster)".to_string(),
            RedisConn::Cluster(connection) => {
                let nodes: RedisResult<String> = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(connection.as_mut());
                match nodes {
                    Ok(nodes) => {
                        let masters = nodes
                            .lines()
                            .filter(|line| line.contains("master") && !line.contains("fail"))
                            .count();
                        format!("a Redis Cluster of {masters} masters")
                    }
                    Err(_) => "a Redis Cluster".to_string(),
                }
            }
        }
    }

    /// Which kind of store this is.
    pub(super) fn mode(&self) -> Mode {
        match self {
            RedisConn::Cluster(..) => Mode::Cluster,
            RedisConn::Single(..) => Mode::Single,
        }
    }

    fn like(&mut self) -> &mut dyn ConnectionLike {
        match self {
            RedisConn::Cluster(connection) => connection.as_mut(),
            RedisConn::Single(connection, _) => connection,
        }
    }

    /// `GETRANGE name 0 limit_bytes`: the value, or its first `limit_bytes + 1` bytes
    /// when it is longer (so a longer one is seen to be, and never fetched whole); None
    /// when the key is missing (or holds an empty string, which no kvwarden value is).
    pub(super) fn get(&mut self, name: &[u8], limit_bytes: u64) -> RedisResult<Option<Vec<u8>>> {
        let value: Vec<u8> = redis::cmd("GETRANGE")
            .arg(name)
            .arg(0)
            .arg(limit_bytes)
            .query(self.like())?;
        Ok((!value.is_empty()).then_some(value))
    }

    /// `SET name header+payload [PX ttl]`: the two parts are written straight into the
    /// command, so the value is never assembled in a buffer of its own first.
    pub(super) fn set(
        &mut self,
        name: &[u8],
        header: &[u8],
        payload: &[u8],
        ttl: Option<Duration>,
    ) -> RedisResult<()> {
        let mut command = redis::cmd("SET");
        command.arg(name).arg(Joined(header, payload));
        if let Some(ttl) = ttl {
            command
                .arg("PX")
                .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        }
        command.exec(self.like())
    }

    /// `DEL name`.
    pub(super) fn del(&mut self, name: &[u8]) -> RedisResult<()> {
        redis::cmd("DEL").arg(name).exec(self.like())
    }

    /// `EXISTS` of each name, pipelined (split by node in a cluster): one answer each.
    pub(super) fn exists_each(&mut self, names: &[Vec<u8>]) -> RedisResult<Vec<bool>> {
        match self {
            RedisConn::Cluster(connection) => {
                let mut pipe = redis::cluster::cluster_pipe();
                for name in names {
                    pipe.cmd("EXISTS").arg(name);
                }
                pipe.query(connection.as_mut())
            }
            RedisConn::Single(connection, _) => {
                let mut pipe = redis::pipe();
                for name in names {
                    pipe.cmd("EXISTS").arg(name);
                }
                pipe.query(connection)
            }
        }
    }
}

/// A plain connection to one seed, with the credentials and TLS of `config`.
fn seed_connection(
    config: &L2Config,
    seed: &str,
    timeout: Duration,
) -> RedisResult<redis::Connection> {
    seed.into_connection_info()
        .map(|info| with_auth(info, config).set_tcp_settings(tcp_settings(timeout)))
        .and_then(|info| match &config.tls {
            Some(tls) if config.uses_tls() => {
                redis::Client::build_with_tls(info, tls.certificates())
            }
            _ => redis::Client::open(info),
        })
        .and_then(|client| client.get_connection_with_timeout(timeout))
        .and_then(|connection| {
            connection.set_read_timeout(Some(timeout))?;
            connection.set_write_timeout(Some(timeout))?;
            Ok(connection)
        })
}

/// `CLUSTER SLOTS` from the first seed (then the first node of the latest map) that
/// answers it, on a connection of its own: a killed or stopped node among them costs a
/// refused connection or one timeout, and never the cluster connection's state. Every
/// node the answer names is remembered for the next time (row 62).
fn slots_from_seeds(config: &L2Config) -> RedisResult<(redis::Value, Addr)> {
    let mut last_error = None;
    for seed in &config.known_nodes.candidates(&config.seeds) {
        let answered = seed_connection(config, seed, config.timeout)
            .and_then(|mut connection| redis::cmd("CLUSTER").arg("SLOTS").query(&mut connection));
        match answered {
            Ok(slots) => {
                let from = seed_addr(seed)?;
                let scheme = if config.uses_tls() { "rediss" } else { "redis" };
                let nodes = super::direct::cluster_nodes(&slots, &from)
                    .into_iter()
                    .map(|addr| addr.url(scheme))
                    .collect();
                config.known_nodes.learn(nodes, seed.clone());
                return Ok((slots, from));
            }
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| RedisError::from((redis::ErrorKind::Client, "no L2 seed"))))
}

fn map_error(message: String) -> RedisError {
    RedisError::from((redis::ErrorKind::Client, "L2 cluster map", message))
}

/// The host and port of `seed`.
fn seed_addr(seed: &str) -> RedisResult<Addr> {
    match seed.into_connection_info()?.addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => Ok(Addr {
            host: host.clone(),
            port: *port,
        }),
        other => Err(map_error(format!("a seed that is not TCP: {other:?}"))),
    }
}

/// `info` with the configured credentials (seeds never carry any).
fn with_auth(info: ConnectionInfo, config: &L2Config) -> ConnectionInfo {
    let mut redis = info.redis_settings().clone();
    if let Some(username) = &config.auth.username {
        redis = redis.set_username(username);
    }
    if let Some(password) = &config.auth.password {
        redis = redis.set_password(password);
    }
    info.set_redis_settings(redis)
}

/// One command argument made of two byte strings, one after the other.
struct Joined<'a>(&'a [u8], &'a [u8]);

impl redis::ToRedisArgs for Joined<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write;
        let mut writer = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail.
        let _ = writer.write_all(self.0);
        let _ = writer.write_all(self.1);
    }
}

/// The server answered, with an error (as opposed to the connection failing).
fn is_server_refusal(error: &RedisError) -> bool {
    !(error.is_io_error() || error.is_timeout() || error.is_connection_dropped())
        && error.code().is_some()
}

/// The key holds something that is not a string: written by something else.
pub(super) fn is_wrong_type(error: &RedisError) -> bool {
    error.code() == Some("WRONGTYPE")
}
