//! The event loop: one mio thread that drives the node ([`kvwarden_core::node`]) and
//! only translates: bytes ↔ requests ↔ node inputs; node outputs ↔ replies, pool jobs
//! (builds, copies, rope tables, frees), pidfd watches, logs and metrics.
//!
//! Each turn: wait for I/O, a pool result or the node's deadline; hand the node every
//! input that arrived (socket frames, pool results, process exits, signals), carrying
//! out its outputs after each; then `handle_timeout`, unless input that has already
//! arrived is still unread (see [`MAX_DEFERRED_TURNS`]); flush replies.

use super::ServerConfig;
use super::blend::RopeTables;
use super::closer::PeerFd;
use super::connection::Connection;
use super::context::Context;
use super::gpu::GpuState;
use super::http::HttpConnection;
use super::l1::{L1, PoolStart};
use super::listen::{self, ListenError};
use super::metrics::Metrics;
use super::peer::Processes;
use super::pool::Pool;
use crate::protocol::ProtocolError;
use kvwarden_core::node::blend::BlendId;
use kvwarden_core::node::{ConnId, ContextId, CopyId, FreeId, Input, Node};
use kvwarden_core::{InstanceId, Instant};
use mio::net::{TcpListener, UnixListener};
use mio::{Events, Poll, Token};
use std::collections::VecDeque;

/// The loop's maps are keyed by tokens and ids it hands out itself: a fast hash
/// suffices (the default SipHash showed up in a profile of the ping path).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

mod connections;
mod l2;
mod observe;
mod outputs;
mod requests;
mod shutdown;
mod start;

const UNIX_LISTENER: Token = Token(0);
const TCP_LISTENER: Token = Token(1);
const HTTP_LISTENER: Token = Token(2);
const WAKER: Token = Token(3);
const SIGNALS: Token = Token(4);
const FIRST_DYNAMIC_TOKEN: usize = 16;

/// Frames of one connection handled per loop turn, so that a flooding peer cannot
/// starve the others (edge-triggered: a connection left unread is revisited next turn,
/// after everyone else's).
const FRAMES_PER_TURN: usize = 256;
/// Input before deadlines: while a connection was left unread at the end of a turn
/// (more than [`FRAMES_PER_TURN`] frames arrived), the loop does not call
/// `handle_timeout`: it polls with a zero timeout and reads on, so that a heartbeat
/// already queued behind other frames counts before any deadline is judged (after a
/// pause of the server, say). To stay bounded against a peer that floods forever,
/// after this many consecutive turns that deferred the judgement, one turn judges
/// anyway, after reading its own frames (and the count starts again): a queue of up to
/// `(64 + 1) × 256` = 16,640 frames per connection is thus always read before a
/// deadline is judged.
const MAX_DEFERRED_TURNS: u32 = 64;
/// HTTP connections held at once.
const MAX_HTTP_CONNECTIONS: usize = 64;
/// At most one "HTTP listener full" WARNING this often (each says how many were closed).
const HTTP_FULL_LOG_EVERY: Duration = Duration::from_secs(10);
/// How often connections are checked against the frame timeout (its resolution).
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// The server's name and version, told to every `hello`.
const SERVER_NAME: &str = concat!("kvwarden ", env!("CARGO_PKG_VERSION"));

/// How long a start waits for L2 to answer before saying it is unreachable.
pub const L2_START_BOUND: Duration = Duration::from_secs(2);

/// Why the server could not start or stopped.
#[derive(Debug, Error)]
pub enum ServerError {
    /// The liveness configuration was rejected.
    #[error(transparent)]
    Config(#[from] kvwarden_core::ConfigError),
    /// The node's configuration (liveness, the L2 breaker, the tenants) was rejected.
    #[error(transparent)]
    Node(#[from] kvwarden_core::node::NodeConfigError),
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
    /// The pool file (`--l1-file`) cannot be used; the message names the fix.
    #[error("{0}")]
    PoolFile(String),
    /// A `--kv-events` stream could not be bound; the message names it.
    #[error("{0}")]
    KvEvents(String),
    /// The event loop failed.
    #[error("event loop: {0}")]
    Io(#[from] io::Error),
    /// The L2 client could not start.
    #[error(transparent)]
    L2(#[from] crate::l2::L2SpawnError),
}

/// Results of the context pool, reported to the node (rope tables and contexts stay
/// in the shell).
enum Done {
    Built {
        context: ContextId,
        result: Result<Option<Context>, ProtocolError>,
    },
    Copied {
        copy: CopyId,
        result: Result<u64, ProtocolError>,
    },
    Blend {
        blend: BlendId,
        result: Result<RopeTables, String>,
    },
    Freed {
        free: FreeId,
    },
    /// An L2 hit's payload was copied into its reserved slot (or could not be).
    L2Placed {
        read: kvwarden_core::node::l2::L2ReadId,
        fetched: kvwarden_core::node::l2::L2Fetched,
    },
    /// A committed value's seal was written (or could not be).
    Sealed {
        slot: usize,
        written: bool,
    },
    /// Seals of a restarted server's pool checked.
    Scanned {
        first: usize,
        found: Vec<kvwarden_core::node::Scanned>,
    },
    /// Something big was dropped off the loop; nothing to report.
    Discarded,
}

/// The server.
pub struct Server {
    config: ServerConfig,
    poll: Poll,
    clock_origin: std::time::Instant,
    node: Node,
    unix_listener: Option<UnixListener>,
    tcp_listener: Option<TcpListener>,
    http_listener: Option<TcpListener>,
    signals: mio::net::UnixStream,
    connections: HashMap<Token, Connection>,
    http_connections: HashMap<Token, HttpConnection>,
    /// Connections a full HTTP listener closed since its last WARNING, and when that was.
    http_full_unlogged: u64,
    http_full_logged_at: Option<std::time::Instant>,
    dirty: HashSet<Token>,
    read_again: HashSet<Token>,
    /// The TCP listener may hold connections not accepted yet (one a turn).
    tcp_accept_again: bool,
    tcp_accepted_this_turn: bool,
    /// Reused lists of tokens taken out of `dirty` and `read_again` each turn, so that
    /// a turn allocates nothing once they have grown to the number of connections.
    flushing: Vec<Token>,
    reading_again: Vec<Token>,
    /// Consecutive turns that left a connection unread and so judged no deadline.
    deferred_turns: u32,
    next_token: usize,
    pool: Pool<Done>,
    l1: L1,
    gpu: GpuState,
    /// The fds of the request being handed to the node, by (connection, request id):
    /// `Job::Build` takes them; the rest are closed once its outputs are carried out.
    fd_stash: HashMap<(ConnId, u64), Vec<PeerFd>>,
    /// Built server-driven contexts, until the node says `Job::Free`.
    contexts: HashMap<ContextId, Arc<Context>>,
    /// Rope tables computed and not yet kept or discarded by the node.
    blends_computed: HashMap<BlendId, RopeTables>,
    /// Rope tables each instance holds.
    blend_tables: HashMap<InstanceId, RopeTables>,
    /// Inputs that outputs produced (a job that could not start): handed to the node
    /// before the outputs are done.
    inputs: VecDeque<Input>,
    /// Peers' processes by the node's keys, and the pidfds of those it watches.
    processes: Processes,
    /// The pid of the process whose exit is being handed to the node (for its logs).
    exiting_pid: Option<i32>,
    metrics: Metrics,
    stopped: bool,
    /// Test-only faults (`--fault-*`); none in production.
    faults: super::fault::FaultState,
    fd_limit: listen::FdLimit,
    /// The L2 client (`--l2`), or None.
    l2: Option<crate::l2::L2Client>,
    /// The node-scoped KV-event streams (`--kv-events`).
    kv_streams: crate::server::kv_events::KvEventStreams,
    /// The L2 state last logged, so that each change to or from down is logged once.
    l2_down_logged: bool,
    /// The slot reserved for each L2 read in flight, by its token.
    l2_reads: HashMap<u64, l2::PendingL2Read>,
    /// Each L2 existence check in flight, by its token, to give it up.
    l2_checks: HashMap<u64, crate::l2::L2Read>,
    /// fds all connections together may hold for frames not yet complete
    /// ([`listen::FdLimit::transit_budget`]).
    fd_transit_budget: usize,
    /// When this loop turn began (after the poll): the clock of frame deadlines.
    turn_started: std::time::Instant,
    /// How the L1 pool was found at start (`/status l1.pool`).
    pool_start: PoolStart,
    /// Whether this process bound the Unix socket (and removes its file at the end);
    /// false for systemd's (socket activation).
    socket_owned: bool,
    /// When connections were last checked against the frame timeout.
    last_sweep: std::time::Instant,
    /// The HTTP listener is on loopback: `/status` shows uids and pids.
    http_is_loopback: bool,
    /// Bytes every connection's input and output buffers hold, as last counted.
    buffered_bytes: usize,
    /// The most they may hold together ([`buffer_budget`]).
    buffer_budget: usize,
}

/// The most bytes all connections' buffers may hold together: 256 MiB, or eight
/// connections' worth of a whole frame and a full output buffer when frames are larger.
/// Past it the connection holding the most is cut (row 49).
fn buffer_budget(max_frame_bytes: usize) -> usize {
    let per_connection = max_frame_bytes + (4 * max_frame_bytes).max(4 << 20) + (64 << 10);
    (256usize << 20).max(8 * per_connection)
}

impl Server {
    /// Validates the configuration, binds every listener and prints the bound
    /// addresses on stdout (`socket=…`, `tcp=…`, `http=…`, then `ready`): see
    /// `start.rs` for each phase.
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let opened = start::Opened::open(config)?;
        opened.announce();
        Ok(Server::from_opened(opened))
    }

    /// The server around what [`start::Opened::open`] opened, before its first turn.
    fn from_opened(opened: start::Opened) -> Server {
        let start::Opened {
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
            boot_id: _,
            fd_limit,
            ready_lines: _,
        } = opened;
        Server {
            poll,
            clock_origin,
            node,
            unix_listener: Some(unix_listener),
            tcp_listener,
            http_listener,
            signals,
            connections: HashMap::default(),
            http_connections: HashMap::default(),
            http_full_unlogged: 0,
            http_full_logged_at: None,
            dirty: HashSet::default(),
            read_again: HashSet::default(),
            tcp_accept_again: false,
            tcp_accepted_this_turn: false,
            flushing: Vec::new(),
            reading_again: Vec::new(),
            deferred_turns: 0,
            next_token: FIRST_DYNAMIC_TOKEN,
            pool,
            l1,
            gpu,
            fd_stash: HashMap::default(),
            contexts: HashMap::default(),
            blends_computed: HashMap::default(),
            blend_tables: HashMap::default(),
            inputs: VecDeque::new(),
            processes: Processes::default(),
            exiting_pid: None,
            metrics: {
                let mut metrics = Metrics::new();
                if l2.is_some() {
                    metrics.enable_l2();
                }
                metrics
            },
            stopped: false,
            faults: super::fault::FaultState::default(),
            fd_limit,
            l2,
            kv_streams,
            l2_down_logged: false,
            l2_reads: HashMap::default(),
            l2_checks: HashMap::default(),
            fd_transit_budget: fd_limit.transit_budget(),
            turn_started: std::time::Instant::now(),
            pool_start,
            socket_owned,
            last_sweep: std::time::Instant::now(),
            http_is_loopback: config.http.is_none_or(|addr| addr.ip().is_loopback()),
            buffered_bytes: 0,
            buffer_budget: buffer_budget(config.max_frame_bytes),
            config,
        }
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
        // What the node asked for before any input (a pool file's scan).
        self.carry_out();
        // Each turn, below: every readable connection is read (up to its frame budget),
        // its frames handed to the node and the replies encoded into its output
        // buffer; only then is each connection with replies flushed, one send each.
        loop {
            let timeout = self.poll_timeout();
            match self.poll.poll(&mut events, Some(timeout)) {
                Ok(()) => {}
                // A stopped and resumed process (SIGSTOP, SIGCONT) sees epoll_wait fail
                // with EINTR even without a signal handler, and the events that arrived
                // meanwhile are not in `events`: poll again before judging any deadline,
                // or a heartbeat already queued on a socket would count too late.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    if self.unix_listener.is_some() && self.socket_owned {
                        let _ = std::fs::remove_file(&self.config.socket_path);
                    }
                    return Err(e.into());
                }
            }
            self.turn_started = std::time::Instant::now();
            // Connections left unread last turn go after this turn's events.
            let mut again = std::mem::take(&mut self.reading_again);
            again.extend(self.read_again.drain());
            self.tcp_accepted_this_turn = false;
            for event in events.iter() {
                self.on_event(event);
            }
            // After this turn's reads (see `accept_tcp`).
            if self.tcp_accept_again {
                self.accept_tcp();
            }
            for token in again.drain(..) {
                // Read to the end: an earlier event may have said the peer closed.
                self.read_connection(token, true);
            }
            self.reading_again = again;
            self.take_completions();
            self.sweep_deadlines();
            // Input before deadlines (see MAX_DEFERRED_TURNS).
            if self.read_again.is_empty() || self.deferred_turns >= MAX_DEFERRED_TURNS {
                self.deferred_turns = 0;
                let now = self.now();
                self.node.handle_timeout(now);
                self.carry_out();
            } else {
                self.deferred_turns += 1;
            }
            self.flush_dirty();
            if self.stopped {
                self.finish_l2_writes();
                return Ok(());
            }
        }
    }

    fn now(&self) -> Instant {
        self.instant_of(std::time::Instant::now())
    }

    /// The clock reading of a node's time (the inverse of [`Server::instant_of`]).
    fn clock_of(&self, at: Instant) -> std::time::Instant {
        self.clock_origin + Duration::from_nanos(at.as_nanos())
    }

    /// The node's time of a clock reading.
    fn instant_of(&self, at: std::time::Instant) -> Instant {
        let nanos = at.saturating_duration_since(self.clock_origin).as_nanos();
        Instant::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    fn poll_timeout(&self) -> Duration {
        if !self.read_again.is_empty() || self.tcp_accept_again {
            return Duration::ZERO;
        }
        let now = self.now();
        // At least once a second: the frame timeout's sweep runs on the loop's turns.
        self.node
            .poll_timeout()
            .map_or(Duration::from_secs(1), |at| {
                at.saturating_duration_since(now)
            })
            .min(Duration::from_secs(1))
    }

    /// Hands `input` to the node and carries out what it asks.
    fn input(&mut self, input: Input) {
        self.input_at(self.now(), input);
    }

    /// Hands the node an input that arrived at `now`, and carries out what it asks.
    fn input_at(&mut self, now: Instant, input: Input) {
        self.node.handle_input(now, input);
        self.carry_out();
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
            token if self.processes.watched_by(token).is_some() => self.on_process_exit(token),
            token if self.http_connections.contains_key(&token) => self.on_http(token),
            token => {
                if event.is_readable() || event.is_read_closed() {
                    self.read_connection(token, event.is_read_closed() || event.is_error());
                }
                // Asked for only while replies wait on a full socket buffer.
                if event.is_writable() {
                    self.dirty.insert(token);
                }
            }
        }
    }
}
