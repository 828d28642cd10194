//! The event loop: one mio thread that owns the liveness core.
//!
//! Each turn: wait for I/O or the core's deadline; handle socket input (queued pings
//! count before any deadline is judged); take the pool's results; call
//! `handle_timeout`; drain every effect; flush replies.

use super::ServerConfig;
use super::connection::{Connection, Frame, ReadOutcome, Stream};
use super::context::{self, BuildRequest, Context};
use super::gpu::GpuState;
use super::http::{HttpConnection, Response, Route};
use super::l1::{L1, Reservation, SlotId};
use super::listen::{self, ListenError};
use super::metrics::Metrics;
use super::peer::{self, Watches};
use super::pool::Pool;
use crate::protocol::{
    BufferSpec, ErrorCode, FrameError, Op, PROTOCOL_VERSION, ProtocolError, decode_request,
    encode_reply,
};
use kvwarden_core::{
    BuildTicket, Effect, FreeCause, InstanceId, Instant, Liveness, Module, Registration,
    TransferError,
};
use mio::net::{TcpListener, UnixListener};
use mio::{Events, Interest, Poll, Token};
use rmpv::Value;
use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

mod batch;
mod blend;
mod connections;
mod effects;
mod engine_driven;
mod observe;
mod requests;
mod shutdown;

const UNIX_LISTENER: Token = Token(0);
const TCP_LISTENER: Token = Token(1);
const HTTP_LISTENER: Token = Token(2);
const WAKER: Token = Token(3);
const SIGNALS: Token = Token(4);
const FIRST_DYNAMIC_TOKEN: usize = 16;

/// Requests of one connection that may run on the pool at once.
const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;
/// Buffers one registration may name.
const MAX_BUFFERS_PER_REGISTRATION: usize = 1024;
/// How long shutdown waits for builds and copies in flight.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(10);
/// Frames of one connection handled per loop turn, so that a flooding peer cannot
/// starve the others (edge-triggered: a connection left unread is revisited next turn).
const FRAMES_PER_TURN: usize = 256;
/// HTTP connections held at once.
const MAX_HTTP_CONNECTIONS: usize = 64;

/// Why the server could not start or stopped.
#[derive(Debug, Error)]
pub enum ServerError {
    /// The liveness configuration was rejected.
    #[error(transparent)]
    Config(#[from] kvwarden_core::ConfigError),
    /// A listener could not be set up.
    #[error(transparent)]
    Listen(#[from] ListenError),
    /// The L1 pool could not be created.
    #[error(
        "creating the L1 pool of {l1_bytes} bytes in slots of {slot_bytes} bytes failed: {source}"
    )]
    L1 {
        /// --l1-bytes.
        l1_bytes: u64,
        /// --slot-bytes.
        slot_bytes: u64,
        /// The error.
        source: io::Error,
    },
    /// The event loop failed.
    #[error("event loop: {0}")]
    Io(#[from] io::Error),
}

/// Where a deferred reply goes.
struct ReplyTo {
    token: Token,
    request_id: u64,
    op: &'static str,
}

/// Results of the context pool.
enum Done {
    Built {
        ticket: BuildTicket,
        reply: ReplyTo,
        result: Result<Context, ProtocolError>,
    },
    Freed {
        free_id: u64,
    },
    Stored {
        reply: ReplyTo,
        slot: SlotId,
        copied: Result<u64, ProtocolError>,
    },
    Retrieved {
        reply: ReplyTo,
        slot: SlotId,
        copied: Result<u64, ProtocolError>,
    },
    /// One item of a `store_batch` copied.
    BatchStored(batch::ItemDone),
    /// One item of a `retrieve_batch` copied.
    BatchRetrieved(batch::ItemDone),
    /// CacheBlend rope tables computed for `register_blend`.
    BlendComputed {
        reply: ReplyTo,
        ticket: super::blend::BlendTicket,
        result: Result<super::blend::RopeTables, String>,
    },
    /// Something big was dropped off the loop; nothing to do.
    Discarded,
}

/// What the shell knows about an entry besides liveness (status and ownership).
struct Record {
    owner_uid: Option<u32>,
    registered_at: Instant,
    model_name: String,
}

struct FreeWatch {
    instance: InstanceId,
    module: Module,
    started: std::time::Instant,
    reported: bool,
}

#[derive(Copy, Clone)]
enum Shutdown {
    Draining { since: std::time::Instant },
    Freeing { since: std::time::Instant },
}

/// The server.
pub struct Server {
    config: ServerConfig,
    poll: Poll,
    clock_origin: std::time::Instant,
    liveness: Liveness<Arc<Context>>,
    unix_listener: Option<UnixListener>,
    tcp_listener: Option<TcpListener>,
    http_listener: Option<TcpListener>,
    signals: mio::net::UnixStream,
    connections: HashMap<Token, Connection>,
    http_connections: HashMap<Token, HttpConnection>,
    dirty: HashSet<Token>,
    read_again: HashSet<Token>,
    next_token: usize,
    pool: Pool<Done>,
    l1: L1,
    gpu: GpuState,
    records: HashMap<(InstanceId, Module), Record>,
    /// REGISTERs that found their entry still building: answered once the build is
    /// done, so that no worker is told `refreshed` about a context that never comes.
    refreshes_waiting: HashMap<(InstanceId, Module), Vec<ReplyTo>>,
    watches: Watches,
    metrics: Metrics,
    frees: HashMap<u64, FreeWatch>,
    next_free_id: u64,
    jobs_in_flight: usize,
    /// Batches with copies still running, by a server-assigned id.
    batches: HashMap<u64, batch::Batch>,
    next_batch_id: u64,
    boot_id: u64,
    server_uid: u32,
    shutdown: Option<Shutdown>,
    freed_at_shutdown: u64,
    /// CacheBlend rope tables per instance.
    blend: super::blend::BlendStates,
    /// Test-only faults (`--fault-*`); none in production.
    faults: super::fault::FaultState,
    fd_limit: listen::FdLimit,
}

impl Server {
    /// Validates the configuration, binds every listener and prints the bound
    /// addresses on stdout (`socket=…`, `tcp=…`, `http=…`, then `ready`).
    pub fn bind(mut config: ServerConfig) -> Result<Server, ServerError> {
        let fd_limit = listen::raise_fd_limit();
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
                     connection, {} kept aside); raise the hard limit (LimitNOFILE=, ulimit -Hn) \
                     to hold more",
                    listen::FDS_PER_CONNECTION,
                    listen::RESERVED_FDS,
                );
            } else {
                tracing::info!(
                    connection_capacity = capacity,
                    open_files_soft = fd_limit.soft,
                    open_files_hard = fd_limit.hard,
                    "worker connections limited to what the open-file limit holds ({} fds per \
                     connection, {} kept aside; the default asks for {}); raise the hard limit \
                     (LimitNOFILE=, ulimit -Hn) to hold more",
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
        let liveness = Liveness::new_with_floor(config.liveness.clone(), Instant::ZERO, floor)?;
        let clock_origin = std::time::Instant::now();
        let poll = Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKER)?;
        let pool = Pool::new(config.pool_threads, waker)?;
        let l1 = L1::new(config.l1_bytes, config.slot_bytes).map_err(|source| ServerError::L1 {
            l1_bytes: config.l1_bytes,
            slot_bytes: config.slot_bytes,
            source,
        })?;

        let gpu = GpuState::start(l1.mapping());

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
        let mut lines = format!("socket={}\n", config.socket_path.display());
        if let Some(listener) = &tcp_listener {
            lines += &format!("tcp={}\n", listener.local_addr()?);
        }
        if let Some(listener) = &http_listener {
            lines += &format!("http={}\n", listener.local_addr()?);
        }
        lines += "ready\n";

        // The Unix socket last, once nothing else can fail: a failed start never
        // leaves a socket file behind.
        let mut unix_listener = listen::bind_unix(&config.socket_path, config.socket_mode)?;
        if let Err(error) =
            poll.registry()
                .register(&mut unix_listener, UNIX_LISTENER, Interest::READABLE)
        {
            let _ = std::fs::remove_file(&config.socket_path);
            return Err(error.into());
        }

        let status = liveness.status();
        tracing::info!(
            socket = %config.socket_path.display(),
            reap_timeout_seconds = status.reap_timeout.as_secs_f64(),
            registration_grace_seconds = status.registration_grace.as_secs_f64(),
            resolution_seconds = config.liveness.resolution.as_secs_f64(),
            l1_slots = l1.num_slots(),
            slot_bytes = l1.slot_bytes(),
            open_files_soft = fd_limit.soft,
            open_files_soft_at_start = fd_limit.soft_at_start,
            open_files_hard = fd_limit.hard,
            connection_capacity = capacity,
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
            let _ = stdout.write_all(lines.as_bytes());
            let _ = stdout.flush();
        }

        Ok(Server {
            poll,
            clock_origin,
            liveness,
            unix_listener: Some(unix_listener),
            tcp_listener,
            http_listener,
            signals,
            connections: HashMap::new(),
            http_connections: HashMap::new(),
            dirty: HashSet::new(),
            read_again: HashSet::new(),
            next_token: FIRST_DYNAMIC_TOKEN,
            pool,
            l1,
            gpu,
            records: HashMap::new(),
            refreshes_waiting: HashMap::new(),
            watches: Watches::default(),
            metrics: Metrics::new(),
            frees: HashMap::new(),
            next_free_id: 0,
            jobs_in_flight: 0,
            batches: HashMap::new(),
            next_batch_id: 0,
            boot_id: InstanceId::generate().get(),
            server_uid: rustix::process::getuid().as_raw(),
            shutdown: None,
            freed_at_shutdown: 0,
            blend: super::blend::BlendStates::default(),
            faults: super::fault::FaultState::default(),
            fd_limit,
            config,
        })
    }

    /// Switches on test-only faults (slow builds, hung frees) before [`Server::run`];
    /// logged loudly, since a server running with them is broken on purpose.
    pub fn inject_faults(&mut self, faults: super::fault::Faults) {
        if faults.any() {
            tracing::error!(
                build_delay_ms = faults.build_delay.as_millis() as u64,
                free_hang_instances = faults.free_hang_instances,
                "FAULT INJECTION ON: every context build sleeps build_delay_ms first and the \
                 frees of the first free_hang_instances contexts never return. TESTING \
                 ONLY: this server leaks what those frees hold"
            );
        }
        self.faults = super::fault::FaultState::new(faults);
    }

    /// Serves until SIGTERM/SIGINT, then shuts down cleanly (every context freed once,
    /// the socket file removed).
    pub fn run(mut self) -> Result<(), ServerError> {
        let mut events = Events::with_capacity(1024);
        loop {
            let timeout = self.poll_timeout();
            match self.poll.poll(&mut events, Some(timeout)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if self.unix_listener.is_some() {
                        let _ = std::fs::remove_file(&self.config.socket_path);
                    }
                    return Err(e.into());
                }
            }
            // Connections left unread last turn go after this turn's events.
            let again: Vec<Token> = self.read_again.drain().collect();
            for event in events.iter() {
                self.on_event(event);
            }
            for token in again {
                // Read to the end: an earlier event may have said the peer closed.
                self.read_connection(token, true);
            }
            self.take_completions();
            let now = self.now();
            self.liveness.handle_timeout(now);
            self.drain_effects();
            self.check_free_watchdog();
            self.flush_dirty();
            if self.shutdown_step() {
                return Ok(());
            }
        }
    }

    fn now(&self) -> Instant {
        let nanos = self.clock_origin.elapsed().as_nanos();
        Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    fn poll_timeout(&self) -> Duration {
        if self.shutdown.is_some() {
            return Duration::from_millis(10);
        }
        if !self.read_again.is_empty() {
            return Duration::ZERO;
        }
        let now = self.now();
        let mut timeout = self
            .liveness
            .poll_timeout()
            .map_or(Duration::from_secs(1), |at| {
                at.saturating_duration_since(now)
            });
        for free in self.frees.values().filter(|free| !free.reported) {
            let due = self
                .config
                .free_watchdog
                .saturating_sub(free.started.elapsed());
            timeout = timeout.min(due + Duration::from_millis(1));
        }
        timeout
    }

    fn token(&mut self) -> Token {
        let token = Token(self.next_token);
        self.next_token += 1;
        token
    }

    fn on_event(&mut self, event: &mio::event::Event) {
        match event.token() {
            UNIX_LISTENER => self.accept_unix(),
            TCP_LISTENER => self.accept_tcp(),
            HTTP_LISTENER => self.accept_http(),
            WAKER => {} // completions are taken every turn
            SIGNALS => self.on_signal(),
            token if self.watches.is_watch(token) => self.on_process_exit(token),
            token if self.http_connections.contains_key(&token) => self.on_http(token),
            token => {
                if event.is_readable() || event.is_read_closed() {
                    self.read_connection(token, event.is_read_closed() || event.is_error());
                }
                if event.is_writable() {
                    self.dirty.insert(token);
                }
            }
        }
    }
}
