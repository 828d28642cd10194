//! `kvwarden serve`.

use crate::server::fault::Faults;
use crate::server::kv_events::KvEventsEndpoint;
use crate::server::{DEFAULT_MAX_CONNECTIONS, Server, ServerConfig, listen};
use kvwarden_core::{Config, ConfigError, REAP_TIMEOUT_FLOOR};
use l2::l2_config;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tenants::{TenantArg, parse_tenant, trust_config};

mod l2;
mod tenants;

/// Flags of `kvwarden serve`.
#[derive(Debug, clap::Args)]
// `--worker-reap-timeout-seconds -1` reaches the range check (which names the flag's
// range) instead of clap's "unexpected argument '-1'".
#[command(allow_negative_numbers = true)]
#[command(group(clap::ArgGroup::new("kept_pool").args(["l1_file", "l1_fdstore"])))]
pub struct ServeArgs {
    /// Reap a worker that has pinged once after this many seconds of silence; 0
    /// disables reaping (process-exit proof still frees). At least 30, and at least 3 ×
    /// the workers' heartbeat interval (default 10 s).
    // `--reap-timeout-seconds` is `kvwarden demo`'s old spelling of it.
    #[arg(
        long,
        alias = "reap-timeout-seconds",
        default_value_t = 120.0,
        value_name = "SECONDS"
    )]
    worker_reap_timeout_seconds: f64,
    /// Reap a worker that registered but never pinged (still warming up) after this
    /// many seconds. Must be at least the reap timeout.
    #[arg(long, default_value_t = 3600.0, value_name = "SECONDS")]
    worker_registration_grace_seconds: f64,
    /// The latest a reap may happen after its deadline (at most reap timeout / 8).
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    resolution_seconds: f64,
    /// A gap this long without the loop turning means the server itself was paused:
    /// the gap is credited to every worker instead of counting as silence.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    stall_threshold_seconds: f64,
    /// The Unix socket [default: $XDG_RUNTIME_DIR/kvwarden.sock, else
    /// /tmp/kvwarden-<uid>/kvwarden.sock, in a 0700 directory the server creates and
    /// checks]. A stale file from a dead server is replaced.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Permission bits of the socket, in octal. 600 admits only this user; other users
    /// may only ever act on their own instances.
    #[arg(long, default_value = "600", value_name = "OCTAL", value_parser = parse_mode)]
    socket_mode: u32,
    /// Also listen on TCP (e.g. 127.0.0.1:7070). TCP carries no fds and no proof of
    /// the peer's process: such workers are reaped by timeout only. Needs
    /// --tcp-token-file: a TCP peer that does not prove it holds the token gets
    /// `forbidden`.
    #[arg(long, value_name = "ADDR", value_parser = parse_tcp)]
    tcp: Option<SocketAddr>,
    /// The file holding the token every TCP worker proves it holds (whitespace around
    /// it ignored; at least 16 bytes, e.g. `openssl rand -hex 32 > FILE`; keep it mode
    /// 600). The token never crosses the network: server and worker each prove they
    /// hold it (docs/protocol.md, TCP auth). Its workers are tenant `tcp`, unless a
    /// --tenant names the file.
    #[arg(long, value_name = "PATH")]
    tcp_token_file: Option<PathBuf>,
    /// A tenant: whose keys are one keyspace in L1 and L2 (by default each uid is a
    /// tenant of its own, `uid-<uid>`). NAME=MEMBER[,MEMBER...], members `uid:N`
    /// (Unix peers of uid N), `token-file:PATH` (TCP peers presenting that token),
    /// `quota:P%` (its share of L1: a full pool evicts from tenants over their share
    /// first; default a fair share), `engine-driven` (may register engine-driven: such
    /// a worker maps the whole L1 pool, every tenant's slots; by default only the
    /// server's own uid may). Repeat for more tenants. Example:
    /// --tenant team-a=uid:1001,uid:1002,quota:50%
    #[arg(long = "tenant", value_name = "NAME=MEMBERS", value_parser = parse_tenant)]
    tenants: Vec<TenantArg>,
    /// Subordinate uid ranges, `owner:start:count` a line (user name or uid): a peer
    /// of a uid in a range counts as its owner, for its tenant (keys, L1 share) and its
    /// share of the connections, so a user's 65,536 subordinate uids are one tenant,
    /// not 65,536. A uid a --tenant names stays that tenant's [default: /etc/subuid,
    /// none if it is missing].
    #[arg(long, value_name = "PATH")]
    subuid_file: Option<PathBuf>,
    /// The HTTP listener for /status, /metrics and /healthz, or `off`.
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR|off", value_parser = parse_http)]
    http: HttpListen,
    /// Size of the L1 store (K, M, G suffixes accepted).
    #[arg(long, default_value = "1G", value_name = "BYTES", value_parser = super::parse_bytes)]
    l1_bytes: u64,
    /// Size of one L1 slot: the largest chunk one `store` may copy.
    #[arg(long, default_value = "2M", value_name = "BYTES", value_parser = super::parse_bytes)]
    slot_bytes: u64,
    /// Allocate every page of the L1 store at start (it is resident at once, as when a
    /// GPU page-locks it), so that no store or L2 promotion pays a page fault on a slot's
    /// first use. Costs --l1-bytes of memory from the start and a moment at start-up.
    #[arg(long)]
    l1_prefault: bool,
    /// Keep the L1 store in this file, so that a restart (a crash, an upgrade, a
    /// container restart) finds it again: a path on tmpfs or hugetlbfs, such as
    /// /dev/shm/kvwarden-l1 or a memory-backed emptyDir. Its index of seals goes beside
    /// it (PATH.index). Both must be the server's own, mode 0600 (it makes them so).
    /// With --l1-secret-file, a restarted server serves again every chunk whose seal
    /// verifies, while it serves; without one it starts empty.
    #[arg(long, value_name = "PATH")]
    l1_file: Option<PathBuf>,
    /// Keep the L1 store in systemd's file-descriptor store (a Type=notify unit with
    /// FileDescriptorStoreMax=, as the shipped one): its memfds go to systemd, which
    /// hands them back on the next start, after a crash too. With --l1-secret-file, a
    /// restarted server serves again every chunk whose seal verifies, while it serves.
    #[arg(long)]
    l1_fdstore: bool,
    /// The secret that seals the values of --l1-file or --l1-fdstore (a file of at least 32 bytes, kept
    /// across restarts: `head -c 32 /dev/urandom > FILE && chmod 600 FILE`). A value
    /// torn by a crash, or sealed under another secret, is dropped, never served.
    #[arg(long, value_name = "PATH", requires = "kept_pool")]
    l1_secret_file: Option<PathBuf>,
    /// The largest request frame accepted; bigger ones are answered `too_large` and the
    /// connection is closed.
    #[arg(long, default_value = "1M", value_name = "BYTES", value_parser = super::parse_bytes)]
    max_frame_bytes: u64,
    /// The most worker connections held at once [default: 10000, lowered to what the
    /// open-file limit holds: 2 fds per connection, 256 and a quarter of the limit kept
    /// aside (the quarter for fds on their way in frames)].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// The most connections one uid, or one TCP tenant, holds at once, and the part of
    /// the places the others leave it may take (so no one holder takes the last of
    /// them); TCP peers that have not authenticated hold an eighth of --max-connections
    /// together. Past it that uid's new connections are refused
    /// (kvwarden_connections_cut_total{reason="uid_share"}) while other uids still
    /// connect [default: three quarters of --max-connections].
    #[arg(long, value_name = "N")]
    max_connections_per_uid: Option<usize>,
    /// A request frame must arrive whole within this of its first byte (the first frame
    /// within this of the connection's accept), and an HTTP request be read and answered
    /// within it; otherwise the connection is cut (a slow or stalled peer holds no slot).
    /// Idle connections between frames are never cut: a worker that only pings keeps its
    /// connection.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    frame_timeout_seconds: f64,
    /// Accept memfd buffers on hugetlbfs (MFD_HUGETLB). Off by default: mapping one
    /// reserves the node's huge pages for the server and charges them to the server's
    /// memory, so a worker could exhaust the pool for every other process.
    #[arg(long)]
    allow_hugetlb_buffers: bool,
    /// The most bytes of workers' memfd buffers the server maps, all registrations
    /// together. A memfd may be sparse (free for its sender), yet every byte mapped is
    /// the server's address space, and every page a retrieve writes into a hole is
    /// charged to the server's memory: this bounds both. Past it a registration is
    /// refused `overloaded`, naming the flag. CUDA IPC buffers are not counted (their
    /// exporter pays for them).
    #[arg(long, default_value = "64G", value_name = "BYTES", value_parser = super::parse_bytes)]
    max_mapped_bytes: u64,
    /// The most bytes of memfd buffers one tenant's registrations map (a uid's, or a
    /// --tenant's) [default: three quarters of --max-mapped-bytes, so a quarter always
    /// stays for the other tenants].
    #[arg(long, value_name = "BYTES", value_parser = super::parse_bytes)]
    max_mapped_bytes_per_tenant: Option<u64>,
    /// The most bytes of memfd buffers one registration maps; a larger one is refused
    /// `bad_args` [default: --max-mapped-bytes-per-tenant].
    #[arg(long, value_name = "BYTES", value_parser = super::parse_bytes)]
    max_mapped_bytes_per_instance: Option<u64>,
    /// A context free still running after this long is logged and counted
    /// (kvwarden_frees_hung_total); it never blocks pings or other frees.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    free_watchdog_seconds: f64,
    /// Threads that build contexts and copy data (1 to 256). Twice as many jobs run
    /// at once; the other copies wait in the server, one queue per tenant, served a
    /// copy per tenant in turn.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pool_threads: usize,
    /// L2: a Redis Cluster (any of its nodes as seeds) or one plain Redis, shared by
    /// every node's server: chunks published in L1 are written behind to it, and L1
    /// misses read through from it. Without it the server is L1 only.
    /// `rediss://HOST:PORT` seeds reach it over TLS (every seed one scheme). Never put
    /// a password in the URL: it is refused; use --l2-password-file.
    #[arg(long, value_name = "redis[s]://HOST:PORT[,HOST:PORT...]")]
    l2: Option<String>,
    /// The PEM CA certificate(s) that sign the Redis servers' certificates, for
    /// `rediss://` seeds [default: the system's roots]. The servers' certificates are
    /// always verified, names included; read at start.
    #[arg(long, value_name = "PATH", requires = "l2")]
    l2_tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate (chain) for mutual TLS with Redis
    /// (`tls-auth-clients yes`); needs --l2-tls-key-file.
    #[arg(
        long,
        value_name = "PATH",
        requires = "l2",
        requires = "l2_tls_key_file"
    )]
    l2_tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --l2-tls-cert-file (keep it mode 600).
    #[arg(
        long,
        value_name = "PATH",
        requires = "l2",
        requires = "l2_tls_cert_file"
    )]
    l2_tls_key_file: Option<PathBuf>,
    /// The Redis ACL user every L2 connection authenticates as [default: the default
    /// user]. Needs a password (--l2-password-file or KVWARDEN_L2_PASSWORD).
    #[arg(long, value_name = "NAME", requires = "l2")]
    l2_username: Option<String>,
    /// The file holding the L2 password (`requirepass` or the ACL user's; surrounding
    /// whitespace ignored; keep it mode 600). Or set the environment variable
    /// KVWARDEN_L2_PASSWORD. The password is never taken from the command line and
    /// never printed.
    #[arg(long, value_name = "PATH", requires = "l2")]
    l2_password_file: Option<PathBuf>,
    /// The cluster secret (a file of at least 32 bytes, every byte counts: `head -c 32
    /// /dev/urandom > FILE; chmod 600 FILE`): every L2 value then carries a keyed-BLAKE3
    /// MAC over its key and payload, and a value without a valid one (written by anyone
    /// without the secret, or moved to another key) is a miss, counted as corrupt and
    /// deleted. Every server of the namespace needs the same file [default: none:
    /// values carry an xxh3 checksum; whoever can write to Redis is trusted].
    #[arg(long, value_name = "PATH", requires = "l2")]
    l2_secret_file: Option<PathBuf>,
    /// The prefix of every L2 key (`NAMESPACE:…`); servers that share chunks use the
    /// same one. ASCII letters, digits, `.`, `_`, `-`, `:`; at most 64 bytes.
    #[arg(long, default_value = "kvwarden", value_name = "NAME", requires = "l2")]
    l2_namespace: String,
    /// The bound on every L2 wait: a read is a miss once L2 has answered nothing for
    /// this long since the read was asked or since its latest answer (so the reads of a
    /// large batch, answered one after another, are waited for), and each connect, send
    /// and receive of an L2 thread gives up after it.
    #[arg(long, default_value_t = 50, value_name = "MS", requires = "l2")]
    l2_timeout_ms: u64,
    /// Expiry of values written to L2; 0: none (the cluster's maxmemory policy,
    /// allkeys-lru, evicts).
    #[arg(long, default_value_t = 0, value_name = "SECONDS", requires = "l2")]
    l2_ttl_seconds: u64,
    /// The bound of the write-behind queue (K, M, G suffixes); a write that does not
    /// fit is dropped and counted (kvwarden_l2_write_drops_total), never waited for.
    #[arg(long, default_value = "256M", value_name = "BYTES", value_parser = super::parse_bytes, requires = "l2")]
    l2_write_queue_bytes: u64,
    /// Threads that talk to L2, each with its own connections.
    #[arg(long, default_value_t = 4, value_name = "N", requires = "l2")]
    l2_threads: usize,
    /// Announce a tenant's blocks as KV events in vLLM's own format, for KV-aware
    /// routers with no engine in the loop (llm-d's indexer, Dynamo's router):
    /// TENANT=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC], endpoints tcp://HOST:PORT or
    /// ipc://PATH. Like vLLM's publisher, the PUB socket binds a wildcard (tcp://*:5557)
    /// or ipc:// endpoint and connects to any other (a subscriber that binds, as llm-d's
    /// indexer does); the replay ROUTER binds. The topic is `kv@node:<hostname>@TENANT`
    /// by default. A block is announced once every shard of it is held (L1 or L2) and
    /// its parent is, as its connector described it; withdrawn as soon as that stops.
    /// Whoever reads the stream reads the tenant's block hashes and tokens: bind it where
    /// only its routers reach (deploy/kubernetes/kv-events-networkpolicy.yaml). Repeat for
    /// more tenants.
    #[arg(long = "kv-events", value_name = "TENANT=ENDPOINT")]
    kv_events: Vec<String>,
    /// TESTING ONLY: lift the 30 s floor on the reap timeout, so tests and demos can
    /// reap in seconds. Never use it in production: a late heartbeat reaps a live worker.
    #[arg(long)]
    allow_short_timeouts: bool,
    /// TESTING ONLY (row 20, benchmark S3): every context build sleeps this many
    /// milliseconds before it starts. Needs --allow-short-timeouts.
    #[arg(long, hide = true, default_value_t = 0, value_name = "MS")]
    fault_build_delay_ms: u64,
    /// TESTING ONLY (row 20, benchmark S3): the frees of the first N contexts never
    /// return, as a CUDA call that hangs would. Needs --allow-short-timeouts.
    #[arg(long, hide = true, default_value_t = 0, value_name = "N")]
    fault_free_hang_instances: u64,
}

/// The test-only faults asked for; refused without `--allow-short-timeouts`, so that
/// no production command line can switch them on by accident.
fn faults(args: &ServeArgs) -> Result<Faults, String> {
    let faults = Faults {
        build_delay: Duration::from_millis(args.fault_build_delay_ms),
        free_hang_instances: args.fault_free_hang_instances,
    };
    if faults.any() && !args.allow_short_timeouts {
        return Err(format!(
            "--fault-build-delay-ms {} / --fault-free-hang-instances {} break the server on \
             purpose and are for tests and benchmarks only; they are refused unless \
             --allow-short-timeouts is given too",
            args.fault_build_delay_ms, args.fault_free_hang_instances
        ));
    }
    Ok(faults)
}

#[derive(Clone, Debug)]
struct HttpListen(Option<SocketAddr>);

fn parse_http(text: &str) -> Result<HttpListen, String> {
    if text.eq_ignore_ascii_case("off") {
        return Ok(HttpListen(None));
    }
    resolve("--http", text).map(|addr| HttpListen(Some(addr)))
}

/// `ADDR:PORT` or `HOST:PORT` (e.g. `localhost:8080`), resolved now: the first address
/// the name has (`localhost`: 127.0.0.1 where /etc/hosts says so).
fn resolve(flag: &str, text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    use std::net::ToSocketAddrs;
    match text.to_socket_addrs() {
        Ok(mut addrs) => addrs.next().ok_or_else(|| {
            format!("invalid {flag} {text:?}: the name has no address; use ADDR:PORT (e.g. 127.0.0.1:8080)")
        }),
        Err(error) => Err(format!(
            "invalid {flag} {text:?}: {error}; use ADDR:PORT or HOST:PORT (e.g. 127.0.0.1:8080, localhost:8080)"
        )),
    }
}

fn parse_tcp(text: &str) -> Result<SocketAddr, String> {
    resolve("--tcp", text)
}

fn parse_mode(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|mode| *mode <= 0o777)
        .ok_or_else(|| {
            format!("invalid --socket-mode {text:?}: use octal permission bits such as 600 or 660")
        })
}

fn seconds(value: f64, error: impl FnOnce() -> ConfigError) -> Result<Duration, ConfigError> {
    Duration::try_from_secs_f64(value).map_err(|_| error())
}

fn liveness_config(args: &ServeArgs) -> Result<Config, ConfigError> {
    let reap = args.worker_reap_timeout_seconds;
    let grace = args.worker_registration_grace_seconds;
    let floor = if args.allow_short_timeouts {
        Duration::ZERO
    } else {
        REAP_TIMEOUT_FLOOR
    };
    let config = Config {
        reap_timeout: seconds(reap, || ConfigError::ReapTimeout {
            seconds: reap,
            floor_seconds: Some(floor.as_secs_f64()),
        })?,
        registration_grace: seconds(grace, || ConfigError::RegistrationGrace {
            grace_seconds: grace,
            reap_timeout_seconds: reap,
        })?,
        resolution: seconds(args.resolution_seconds, || ConfigError::Resolution {
            resolution_seconds: args.resolution_seconds,
            reap_timeout_seconds: reap,
        })?,
        stall_threshold: seconds(args.stall_threshold_seconds, || {
            ConfigError::StallThreshold {
                stall_threshold_seconds: args.stall_threshold_seconds,
            }
        })?,
    };
    config.validate_with_floor(floor)?;
    Ok(config)
}

fn warn_if_world_readable(flag: &str, path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o004 != 0
    {
        tracing::warn!(path = %path.display(), "{flag}: the file is readable by every user; chmod 600 it");
    }
}

/// A positive number of seconds for `flag`, or an error naming it (`hint` after it).
fn positive_seconds(value: f64, flag: &str, hint: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("invalid {flag} {value}: use a positive number of seconds{hint}"))
}

/// The pool's sealing key from `--l1-secret-file`, when given.
fn l1_secret(
    path: Option<&std::path::Path>,
) -> Result<Option<kvwarden_core::seal::SealKey>, String> {
    let Some(path) = path else {
        return Ok(None);
    };
    let bytes = std::fs::read(path).map_err(|e| {
        format!(
            "--l1-secret-file {}: cannot read it: {e} (make one with `head -c 32 \
             /dev/urandom > FILE && chmod 600 FILE`, and keep it across restarts)",
            path.display()
        )
    })?;
    warn_if_world_readable("--l1-secret-file", path);
    kvwarden_core::seal::SealKey::from_file_bytes(&path.display().to_string(), &bytes)
        .map(Some)
        .map_err(|e| e.to_string())
}

fn server_config(args: ServeArgs) -> Result<ServerConfig, String> {
    let trust = trust_config(&args)?;
    let liveness = liveness_config(&args).map_err(|e| e.to_string())?;
    let l2 = l2_config(&args)?;
    if args.slot_bytes == 0 || args.l1_bytes < args.slot_bytes {
        return Err(format!(
            "invalid L1 geometry: --l1-bytes {} must hold at least one slot of --slot-bytes {} (and slots must be > 0)",
            args.l1_bytes, args.slot_bytes
        ));
    }
    let max_frame_bytes = usize::try_from(args.max_frame_bytes)
        .ok()
        .filter(|n| (64..=(u32::MAX as usize)).contains(n))
        .ok_or_else(|| {
            format!(
                "invalid --max-frame-bytes {}: use 64 bytes to 4 GiB",
                args.max_frame_bytes
            )
        })?;
    if !(1..=256).contains(&args.pool_threads) {
        return Err(format!(
            "invalid --pool-threads {}: use 1 to 256 (the threads that build contexts and copy \
             data; 4 by default)",
            args.pool_threads
        ));
    }
    if args.max_connections == Some(0) {
        return Err("invalid --max-connections 0: at least 1".into());
    }
    if args.max_connections_per_uid == Some(0) {
        return Err("invalid --max-connections-per-uid 0: at least 1".into());
    }
    let frame_timeout = positive_seconds(
        args.frame_timeout_seconds,
        "--frame-timeout-seconds",
        " (the default is 10)",
    )?;
    let free_watchdog =
        positive_seconds(args.free_watchdog_seconds, "--free-watchdog-seconds", "")?;
    let l1_secret = l1_secret(args.l1_secret_file.as_deref())?;
    let kv_events = kv_events(&args.kv_events)?;
    Ok(ServerConfig {
        liveness,
        allow_short_timeouts: args.allow_short_timeouts,
        socket_path: args.socket.unwrap_or_else(listen::default_socket_path),
        socket_mode: args.socket_mode,
        tcp: args.tcp,
        http: args.http.0,
        l1_bytes: args.l1_bytes,
        l1_prefault: args.l1_prefault,
        l1_file: args.l1_file.clone(),
        l1_fdstore: args.l1_fdstore,
        l1_secret,
        slot_bytes: args.slot_bytes,
        max_frame_bytes,
        max_connections: args.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
        max_connections_from_flag: args.max_connections.is_some(),
        max_connections_per_uid: args.max_connections_per_uid,
        frame_timeout,
        allow_hugetlb_buffers: args.allow_hugetlb_buffers,
        mapped: kvwarden_core::node::mapped::MappedLimits::new(
            args.max_mapped_bytes,
            args.max_mapped_bytes_per_tenant,
            args.max_mapped_bytes_per_instance,
        ),
        free_watchdog,
        pool_threads: args.pool_threads,
        l2,
        trust,
        kv_events,
    })
}

/// The `--kv-events` streams, each read against this host's name (the default topic).
fn kv_events(flags: &[String]) -> Result<Vec<KvEventsEndpoint>, String> {
    let hostname = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    flags
        .iter()
        .map(|text| KvEventsEndpoint::parse(text, &hostname))
        .collect::<Result<_, _>>()
        .map_err(|error| format!("invalid --kv-events {error}"))
}

/// Runs the server until SIGTERM/SIGINT.
pub fn run(args: ServeArgs) -> ExitCode {
    // Before any secret is read (token files, the L2 secret and password): no core dump
    // of this process, no ptrace or /proc/<pid>/mem by its uid's other processes.
    if let Err(error) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(%error, "PR_SET_DUMPABLE 0 failed: a core dump could carry secrets");
    }
    let config = faults(&args).and_then(|faults| server_config(args).map(|c| (faults, c)));
    let config = match config {
        Ok(config) => config,
        Err(message) => {
            eprintln!("kvwarden serve: {message}");
            return ExitCode::from(2);
        }
    };
    let (faults, config) = config;
    let mut server = match Server::bind(config) {
        Ok(server) => server,
        Err(error) => {
            eprintln!("kvwarden serve: {error}");
            return ExitCode::from(1);
        }
    };
    server.inject_faults(faults);
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvwarden serve: {error}");
            ExitCode::from(1)
        }
    }
}
