//! A server's start, phase by phase: validate the configuration (before anything is
//! opened or probed), open what it serves from (the pool threads, L1, L2, the GPU, the
//! node), bind its listeners (the Unix socket last, once nothing else can fail, so that
//! a failed start never leaves a socket file behind), then announce it (the log line,
//! the addresses and `ready` on stdout, systemd's READY=1).

use super::{HTTP_LISTENER, SERVER_NAME, SIGNALS, ServerError, TCP_LISTENER, UNIX_LISTENER, WAKER};
use crate::server::ServerConfig;
use crate::server::gpu::GpuState;
use crate::server::kv_events::KvEventStreams;
use crate::server::l1::{L1, PoolStart};
use crate::server::listen::{self, FdLimit};
use crate::server::pool::Pool;
use kvwarden_core::node::{Node, NodeConfig, SHUTDOWN_DRAIN};
use kvwarden_core::{InstanceId, Instant};
use mio::net::{TcpListener, UnixListener};
use mio::{Interest, Poll};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// What a start opened, ready for the loop's first turn.
pub(super) struct Opened {
    pub(super) config: ServerConfig,
    pub(super) poll: Poll,
    pub(super) clock_origin: std::time::Instant,
    pub(super) node: Node,
    pub(super) unix_listener: UnixListener,
    /// Whether this process bound the Unix socket (false: systemd's).
    pub(super) socket_owned: bool,
    pub(super) tcp_listener: Option<TcpListener>,
    pub(super) http_listener: Option<TcpListener>,
    pub(super) signals: mio::net::UnixStream,
    pub(super) pool: Pool<super::Done>,
    pub(super) l1: L1,
    pub(super) pool_start: PoolStart,
    pub(super) gpu: GpuState,
    pub(super) l2: Option<crate::l2::L2Client>,
    pub(super) kv_streams: KvEventStreams,
    pub(super) boot_id: u64,
    pub(super) fd_limit: FdLimit,
    /// What stdout is told once the server is up (`socket=…`, `tcp=…`, `http=…`, `ready`).
    pub(super) ready_lines: String,
}

impl Opened {
    /// Validates `config`, then opens and binds everything, in that order.
    pub(super) fn open(mut config: ServerConfig) -> Result<Opened, ServerError> {
        // What systemd passed: the Unix socket (socket activation) and the pool's
        // memfds (--l1-fdstore).
        let mut passed = crate::server::systemd::passed_fds().map_err(ServerError::PoolFile)?;
        let activated = crate::server::systemd::take_unix_listener(&mut passed);
        if activated.is_none() {
            listen::refuse_a_running_server(&config.socket_path, config.http)?;
        }
        let fd_limit = listen::raise_fd_limit();
        let floor = validate(&mut config, &fd_limit)?;
        let clock_origin = std::time::Instant::now();
        let poll = Poll::new()?;
        // One waker for the pool and the L2 client: mio allows one per poll.
        let waker = Arc::new(mio::Waker::new(poll.registry(), WAKER)?);
        let pool = Pool::new(config.pool_threads, Arc::clone(&waker))?;
        let (l1, pool_start) = open_l1(&config, &mut passed)?;
        let l2 = start_l2(&config, waker)?;
        let gpu = GpuState::start(l1.mapping());
        let boot_id = InstanceId::generate().get();
        let mut node = Node::new(
            node_config(&config, floor, &l1, &gpu, boot_id),
            Instant::ZERO,
        )?;
        node.persist_pool(
            Instant::ZERO,
            l1.seals().is_some(),
            pool_start == PoolStart::Adopt,
        );
        let (tcp_listener, http_listener, signals) = bind_tcp_and_signals(&config, &poll)?;
        let kv_streams = KvEventStreams::bind(&config.kv_events).map_err(ServerError::KvEvents)?;
        let mut ready_lines = format!("socket={}\n", config.socket_path.display());
        if let Some(listener) = &tcp_listener {
            ready_lines += &format!("tcp={}\n", listener.local_addr()?);
        }
        if let Some(listener) = &http_listener {
            ready_lines += &format!("http={}\n", listener.local_addr()?);
        }
        ready_lines += "ready\n";
        let (unix_listener, socket_owned) = bind_unix(&config, activated, &poll)?;
        Ok(Opened {
            config,
            poll,
            clock_origin,
            node,
            unix_listener,
            socket_owned,
            tcp_listener,
            http_listener,
            signals,
            pool,
            l1,
            pool_start,
            gpu,
            l2,
            kv_streams,
            boot_id,
            fd_limit,
            ready_lines,
        })
    }

    /// Says the server is up: the log line, the addresses and `ready` on stdout, and
    /// READY=1 to systemd when it supervises us.
    pub(super) fn announce(&self) {
        let config = &self.config;
        let status = self.node.status().liveness;
        tracing::info!(
            socket = %config.socket_path.display(),
            boot_id = %self.boot_id,
            reap_timeout_seconds = status.reap_timeout.as_secs_f64(),
            registration_grace_seconds = status.registration_grace.as_secs_f64(),
            resolution_seconds = config.liveness.resolution.as_secs_f64(),
            l1_slots = self.l1.num_slots(),
            slot_bytes = self.l1.slot_bytes(),
            open_files_soft = self.fd_limit.soft,
            open_files_soft_at_start = self.fd_limit.soft_at_start,
            open_files_hard = self.fd_limit.hard,
            connection_capacity = self.fd_limit.connection_capacity(),
            max_connections = config.max_connections,
            "kvwarden serving"
        );
        if config.allow_short_timeouts {
            tracing::warn!(
                "--allow-short-timeouts: the 30 s floor on the reap timeout is lifted; \
                 a live worker whose heartbeat is late can be reaped. TESTING ONLY, \
                 never in production"
            );
        }
        {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            // stdout may be closed by whoever started us; serving goes on regardless.
            let _ = stdout.write_all(self.ready_lines.as_bytes());
            let _ = stdout.flush();
        }
        if crate::server::systemd::supervised() {
            crate::server::systemd::ready();
        }
    }
}

/// Judges the configuration before anything is opened or probed: the connections the
/// open-file limit holds (`--max-connections` lowered to them, said once) and the
/// liveness settings. The floor on the reap timeout it leaves in force.
fn validate(config: &mut ServerConfig, fd_limit: &FdLimit) -> Result<Duration, ServerError> {
    let capacity = fd_limit.connection_capacity();
    if config.max_connections > capacity {
        // The default asks for more than an ordinary shell's limit holds: that is
        // worth a line, not a warning. An operator's explicit number is.
        if config.max_connections_from_flag {
            tracing::warn!(
                max_connections = config.max_connections,
                connection_capacity = capacity,
                open_files_soft = fd_limit.soft,
                open_files_hard = fd_limit.hard,
                "--max-connections lowered to what the open-file limit holds ({} fds per \
                 connection, {} and a quarter of the limit kept aside); raise the hard limit \
                 (LimitNOFILE=, ulimit -Hn) to hold more",
                listen::FDS_PER_CONNECTION,
                listen::RESERVED_FDS,
            );
        } else {
            tracing::info!(
                connection_capacity = capacity,
                open_files_soft = fd_limit.soft,
                open_files_hard = fd_limit.hard,
                "worker connections limited to what the open-file limit holds ({} fds per \
                 connection, {} and a quarter of the limit kept aside; the default asks for \
                 {}); raise the hard limit (LimitNOFILE=, ulimit -Hn) to hold more",
                listen::FDS_PER_CONNECTION,
                listen::RESERVED_FDS,
                config.max_connections,
            );
        }
        config.max_connections = capacity;
    }
    let floor = if config.allow_short_timeouts {
        Duration::ZERO
    } else {
        kvwarden_core::REAP_TIMEOUT_FLOOR
    };
    kvwarden_core::Liveness::<()>::new_with_floor(config.liveness.clone(), Instant::ZERO, floor)?;
    Ok(floor)
}

/// L1: an anonymous pool, one kept in a file (`--l1-file`) or in systemd's
/// file-descriptor store (`--l1-fdstore`), adopted or started cold (said why).
fn open_l1(
    config: &ServerConfig,
    passed: &mut Vec<(OwnedFd, String)>,
) -> Result<(L1, PoolStart), ServerError> {
    let (l1, pool_start) = match &config.l1_file {
        None if config.l1_fdstore => L1::open_fdstore(
            passed,
            config.l1_bytes,
            config.slot_bytes,
            config.l1_prefault,
            config.l1_secret.clone(),
        )
        .map_err(ServerError::PoolFile)?,
        None => L1::new(config.l1_bytes, config.slot_bytes, config.l1_prefault)
            .map(|l1| (l1, PoolStart::Anonymous))
            .map_err(|source| ServerError::L1 {
                l1_bytes: config.l1_bytes,
                slot_bytes: config.slot_bytes,
                source,
            })?,
        Some(path) => L1::open_file(
            path,
            config.l1_bytes,
            config.slot_bytes,
            config.l1_prefault,
            config.l1_secret.clone(),
        )
        .map_err(ServerError::PoolFile)?,
    };
    for (_, name) in passed.drain(..) {
        tracing::warn!(
            name,
            "systemd passed an fd this server does not use; it is closed"
        );
    }
    let kept = match &config.l1_file {
        Some(path) => path.display().to_string(),
        None => "systemd's file-descriptor store".to_string(),
    };
    match &pool_start {
        PoolStart::Cold(why) => {
            tracing::warn!(pool = %kept, "L1 pool starts empty: {why}")
        }
        PoolStart::Adopt => tracing::info!(
            pool = %kept,
            "L1 pool found: adopting the values whose seals verify while serving"
        ),
        PoolStart::Anonymous => {}
    }
    if config.l1_file.is_some()
        && let Some(tenant) = config.trust.tenants.iter().find(|t| t.engine_driven)
    {
        tracing::warn!(
            tenant = %tenant.name,
            "--l1-file with an engine-driven --tenant: the pool file it maps cannot be \
             sealed against resizing (only a memfd can), so that tenant, trusted with \
             every slot already, could also stop the server by shrinking it; keep the \
             anonymous pool if you do not trust it that far"
        );
    }
    Ok((l1, pool_start))
}

/// The L2 client (`--l2`), probed before `ready` within [`super::L2_START_BOUND`]: an
/// unreachable L2 is said, not fatal.
fn start_l2(
    config: &ServerConfig,
    waker: Arc<mio::Waker>,
) -> Result<Option<crate::l2::L2Client>, ServerError> {
    let l2 = match &config.l2 {
        Some(l2_config) => Some(crate::l2::L2Client::spawn(l2_config.clone(), waker)?),
        None => None,
    };
    if let (Some(client), Some(l2_config)) = (&l2, &config.l2) {
        // Said before `ready`, bounded: what the seeds are, or exactly why not. An
        // unreachable L2 is not fatal (L2 is optional); the server goes on without it
        // until it answers.
        match client.probe(super::L2_START_BOUND) {
            Ok(found) => {
                tracing::info!(seeds = ?l2_config.seeds, "L2: connected to {found}")
            }
            Err(reason) => tracing::warn!(
                seeds = ?l2_config.seeds,
                %reason,
                "L2 is unreachable at start: L1 misses are misses and writes behind are \
                 dropped until it answers; /status says `down` with the reason"
            ),
        }
    }
    Ok(l2)
}

/// The node's configuration: the server's, with what L1 and the GPU turned out to be.
fn node_config(
    config: &ServerConfig,
    floor: Duration,
    l1: &L1,
    gpu: &GpuState,
    boot_id: u64,
) -> NodeConfig {
    NodeConfig {
        liveness: config.liveness.clone(),
        reap_timeout_floor: floor,
        num_slots: l1.num_slots(),
        slot_bytes: l1.slot_bytes(),
        server_uid: rustix::process::getuid().as_raw(),
        trust: config.trust.clone(),
        boot_id,
        server_name: SERVER_NAME.to_string(),
        free_watchdog: config.free_watchdog,
        shutdown_drain: SHUTDOWN_DRAIN,
        cuda_devices: gpu
            .gpu()
            .map(|gpu| gpu.device_count() as u64)
            .map_err(str::to_string),
        l2: config
            .l2
            .as_ref()
            .map(|l2| kvwarden_core::node::l2::L2NodeConfig {
                timeout: l2.timeout,
                write_queue_bytes: l2.write_queue_bytes,
                health: kvwarden_core::l2::L2HealthConfig::default(),
            }),
        connections: kvwarden_core::node::admission::ConnectionLimits::new(
            config.max_connections,
            config.max_connections_per_uid,
            Some(config.frame_timeout),
        ),
        mapped: config.mapped,
        // Twice the threads: each finds its next job without a turn of the
        // loop in between, and a tenant's copy waits for at most that many.
        pool_window: 2 * config.pool_threads.max(1),
        kv_publish: config.kv_events.iter().map(|e| e.tenant.clone()).collect(),
    }
}

/// The TCP and HTTP listeners (when configured) and the signal pipe, registered.
fn bind_tcp_and_signals(
    config: &ServerConfig,
    poll: &Poll,
) -> Result<
    (
        Option<TcpListener>,
        Option<TcpListener>,
        mio::net::UnixStream,
    ),
    ServerError,
> {
    let mut tcp_listener = config
        .tcp
        .map(|addr| listen::bind_tcp(addr, listen::TcpRole::Workers))
        .transpose()?;
    if let Some(listener) = &mut tcp_listener {
        poll.registry()
            .register(listener, TCP_LISTENER, Interest::READABLE)?;
    }
    let mut http_listener = config
        .http
        .map(|addr| listen::bind_tcp(addr, listen::TcpRole::Http))
        .transpose()?;
    if let Some(listener) = &mut http_listener {
        poll.registry()
            .register(listener, HTTP_LISTENER, Interest::READABLE)?;
    }
    let (signal_write, signal_read) = std::os::unix::net::UnixStream::pair()?;
    signal_read.set_nonblocking(true)?;
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::low_level::pipe::register(signal, signal_write.try_clone()?)?;
    }
    let mut signals = mio::net::UnixStream::from_std(signal_read);
    poll.registry()
        .register(&mut signals, SIGNALS, Interest::READABLE)?;
    Ok((tcp_listener, http_listener, signals))
}

/// The Unix socket, last: systemd's (socket activation, never removed here) or bound
/// now; its file is removed again if registering it fails. Whether this process owns it.
fn bind_unix(
    config: &ServerConfig,
    activated: Option<OwnedFd>,
    poll: &Poll,
) -> Result<(UnixListener, bool), ServerError> {
    // The Unix socket last, once nothing else can fail: a failed start never
    // leaves a socket file behind.
    // Socket activation: systemd's socket, which outlives this process (its file is
    // systemd's, never removed here).
    let socket_owned = activated.is_none();
    let mut unix_listener = match activated {
        Some(fd) => {
            let listener = std::os::unix::net::UnixListener::from(fd);
            listener.set_nonblocking(true)?;
            tracing::info!(
                socket = %config.socket_path.display(),
                "listening on the Unix socket systemd passed (socket activation)"
            );
            mio::net::UnixListener::from_std(listener)
        }
        None => listen::bind_unix(&config.socket_path, config.socket_mode)?,
    };
    if let Err(error) =
        poll.registry()
            .register(&mut unix_listener, UNIX_LISTENER, Interest::READABLE)
    {
        if socket_owned {
            let _ = std::fs::remove_file(&config.socket_path);
        }
        return Err(error.into());
    }
    Ok((unix_listener, socket_owned))
}
