//! The simulated shell around the real server logic, [`kvwarden_core::node::Node`].
//!
//! There is no model of the server here: the node decides everything. The shell does
//! what `shell-mio` does with sockets, memfds, pidfds and pool threads, in simulation:
//! one connection per worker process and server boot (a restart breaks them), a second
//! one for raw bytes (row 24, decoded by the real decoder and answered as the production
//! shell answers a frame that does not decode), builds, copies, blend computations and
//! frees that take a drawn time (a free may never return: row 20), exit notices for the
//! processes the node watches, and shutdown. Its loop is the core's: every input that
//! has arrived first, then `handle_timeout`, then every output, then sleep until
//! `poll_timeout`. A paused server queues its input and hands all of it to the node
//! before judging any deadline on resume.
//!
//! After every node call the shell reports to the [`Checker`] what the node's outputs
//! and replies say happened (see [`crate::invariants`]).
//!
//! Who is who (protocol 2): a connection is opened by the first of its messages to
//! reach the socket; a worker's client attaches on every connection before anything
//! else, so the shell hands the node that connection's `attach [instance, secret]` (the
//! message carries the secret) right after `Connected` and before the message. Only a
//! refusal of it goes back to the worker. A message of an older connection of the
//! process than the newest one seen (the client reconnected, or drew a fresh id) is
//! lost with that connection, which closes. TCP peers connect without a uid.

use crate::config::{InjectedBug, SERVER_UID, ServerSpec};
use crate::invariants::{Checker, TenantRead, Verdict};
use crate::l2::{L2Fate, L2Job, SimL2};
use crate::message::{Channel, Envelope, ReplyEnvelope};
use crate::oracle::EntryKey;
use crate::pool::{PoolFile, PoolJob};
use crate::time::{Nanos, duration, instant};
use kvwarden_core::node::{
    ConnId, ContextId, CopyId, FreeId, Input as NodeInput, Node, NodeConfig, Output, ProcessKey,
    SHUTDOWN_DRAIN,
};
use kvwarden_core::protocol::Op;
use kvwarden_core::{Config, FreeCause, InstanceId, Module};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

mod checks;
mod connections;
mod l2_requests;
mod outputs;

/// What one node call's outputs did, for the checks that follow them.
#[derive(Default)]
struct Step {
    freed: Vec<(EntryKey, FreeCause)>,
    /// Watched processes already known to have exited: their exit is applied next.
    exits: Vec<InstanceId>,
    exit_noted: bool,
    engine_freed: bool,
}

/// A hash map with a fixed seed: lookups only, never iterated into the trace.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Slots of the node's L1 pool.
pub const NUM_SLOTS: usize = 256;

/// Whether the server process listens.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ServerState {
    /// Serving.
    Up,
    /// Dead; a new process starts later.
    Down,
    /// Shutting down cleanly: the node answers `unavailable`, drains, frees.
    Draining,
    /// Gone for good.
    Stopped,
}

/// Something the loop reads.
#[derive(Debug)]
pub enum Input {
    /// A request from a worker (decoded when it reached the socket).
    Request(Envelope),
    /// A build finished.
    BuildDone {
        /// The node's context id.
        context: u64,
        /// Whether it failed.
        failed: bool,
    },
    /// A copy finished.
    CopyDone(u64),
    /// Rope tables computed.
    BlendDone(u64),
    /// A free returned.
    FreeDone(u64),
    /// A pidfd reported an exit.
    ExitNotice(InstanceId),
    /// An L2 operation ended, as drawn when it was issued.
    L2Done {
        /// The operation.
        job: L2Job,
        /// How it ends.
        fate: L2Fate,
    },
    /// A seal or scan of the pool file ended.
    PoolDone(PoolJob),
    /// The connections of a dead worker process closed.
    Closed {
        /// The slot.
        slot: usize,
        /// The process.
        incarnation: u32,
    },
}

/// One context handed back by the node, for the run's records.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FreeRecord {
    /// The instance.
    pub instance: InstanceId,
    /// The module.
    pub module: Module,
    /// Why.
    pub cause: FreeCause,
    /// The context's id in the checker's ledger.
    pub context: u64,
}

/// What the server asks of the world after a step.
#[derive(Debug, Default)]
pub struct ServerOut {
    /// Replies to send.
    pub replies: Vec<ReplyEnvelope>,
    /// Builds started (node context ids): the world schedules their completion.
    pub builds: Vec<u64>,
    /// Copies started: the world schedules their completion.
    pub copies: Vec<u64>,
    /// Blend computations started.
    pub blends: Vec<u64>,
    /// Frees started: the world schedules their return (or never, row 20).
    pub free_jobs: Vec<u64>,
    /// Contexts the node gave back this step.
    pub frees: Vec<FreeRecord>,
    /// Entries reaped this step, context or not.
    pub reaped: u64,
    /// L2 operations issued: the world schedules their answers.
    pub l2_jobs: Vec<L2Job>,
    /// Seals and scans of the pool file: the world schedules their end.
    pub pool_jobs: Vec<PoolJob>,
}

/// Counters a scenario can assert on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Contexts built (handed to the node).
    pub contexts_built: u64,
    /// Builds that failed.
    pub builds_failed: u64,
    /// Engine-driven reservations and pins dropped with their context.
    pub reservations_discarded: u64,
    /// `bad_args` replies.
    pub bad_args: u64,
    /// Stalls the node reported.
    pub stalls: u64,
    /// Frees that waited for a copy.
    pub frees_deferred: u64,
    /// Frees the node reported hung (its watchdog).
    pub frees_hung: u64,
    /// `forbidden` replies.
    pub forbidden: u64,
    /// Frames the real decoder refused.
    pub decode_errors: u64,
    /// Connections closed after a `bad_frame`.
    pub connections_closed: u64,
    /// L2 writes answered `Written`.
    pub l2_written: u64,
    /// L2 reads answered with a hit.
    pub l2_hits: u64,
    /// L2 reads answered `Corrupt`.
    pub l2_corrupt: u64,
    /// L2 operations answered `Failed` or `TimedOut`.
    pub l2_failed: u64,
    /// L2 breaker changes the node noted.
    pub l2_state_changes: u64,
    /// Connections opened with the client's `attach` (each worker connection).
    pub attaches: u64,
    /// `forbidden` replies on TCP connections (row 32).
    pub tcp_forbidden: u64,
    /// Reads (`retrieve`, batch items, `lookup`) answered as a miss for a key another
    /// tenant stored and the reader's tenant did not (row 33: kept apart).
    pub foreign_misses: u64,
    /// Values restarted servers adopted from the pool file (row 71).
    pub adopted: u64,
    /// Reads served from a value an earlier server process wrote (adopted, row 71).
    pub adopted_served: u64,
    /// Values a restarted server dropped as torn (row 72).
    pub dropped_torn: u64,
    /// Values lost to a store that took their slot before its seal was checked.
    pub dropped_taken: u64,
}

/// What a request asks, as far as the checker must know to read its answer (an op
/// without its payload: no clone on the request path).
enum Asked {
    Ping,
    Register(Module),
    Unregister(Module),
    Transfer(Module),
    Prepare(Vec<u8>),
    Commit(Vec<u8>),
    Other,
}

impl Asked {
    fn of(op: &Op) -> Asked {
        match op {
            Op::Ping { .. } => Asked::Ping,
            Op::RegisterKvCache { .. } => Asked::Register(Module::ServerDriven),
            Op::RegisterEngineDriven { .. } => Asked::Register(Module::EngineDriven),
            Op::UnregisterKvCache { .. } => Asked::Unregister(Module::ServerDriven),
            Op::UnregisterEngineDriven { .. } => Asked::Unregister(Module::EngineDriven),
            Op::Store { .. }
            | Op::Retrieve { .. }
            | Op::StoreBatch { .. }
            | Op::RetrieveBatch { .. } => Asked::Transfer(Module::ServerDriven),
            Op::PrepareStore { key, .. } => Asked::Prepare(key.clone()),
            Op::CommitStore { key, .. } => Asked::Commit(key.clone()),
            Op::PrepareRetrieve { .. } | Op::CommitRetrieve { .. } => {
                Asked::Transfer(Module::EngineDriven)
            }
            Op::Hello { .. }
            | Op::Auth { .. }
            | Op::Attach { .. }
            | Op::Lookup { .. }
            | Op::RegisterBlend { .. }
            | Op::Status
            | Op::KvEvents { .. }
            | Op::DescribeKeys { .. } => Asked::Other,
        }
    }
}

/// What the call being made is about, to read the node's outputs.
enum Call {
    Request {
        conn: ConnId,
        request_id: u64,
        name: &'static str,
        instance: Option<InstanceId>,
        asked: Asked,
        exiting: bool,
        /// What the trust rules let it do (the reference model's verdict).
        verdict: Verdict,
        /// The named instance's entries and blend state before, when the rules refuse
        /// the request.
        before: Option<Before>,
        /// A `retrieve` or `prepare_retrieve`: an L2 read it causes is its own.
        reads: bool,
        /// A store's or commit's keys, as the node keys them (both start their copy,
        /// or answer, in the call they are handed in).
        publish: Publishing,
    },
    BuildDone {
        key: EntryKey,
        context: ContextId,
        failed: bool,
    },
    CopyDone,
    Exit(InstanceId),
    Other,
}

/// What a store or commit in flight publishes: its keys (as the node keys them), and
/// whether it is a commit (whose `true` publishes; a store's copies do).
type Publishing = (Vec<Vec<u8>>, bool);

/// An instance as a refused request must leave it: its entries and blend state.
type Before = ([Option<kvwarden_core::EntryView>; 2], bool);

/// The simulated server process.
pub struct Server {
    spec: ServerSpec,
    bug: Option<InjectedBug>,
    /// Bumped at each restart; connections to an older boot are broken.
    pub boot: u64,
    /// Whether it listens.
    pub state: ServerState,
    /// SIGSTOPped.
    pub paused: bool,
    node: Option<Node>,
    outputs: Vec<Output>,
    inbox: VecDeque<Input>,
    /// Each process's open connections: the newest epoch seen, and its id.
    conns: HashMap<(usize, u32, Channel), (u32, ConnId)>,
    /// Whom a connection answers: slot, process, and whether it is TCP.
    peers: HashMap<ConnId, (usize, u32, bool)>,
    /// Reads in flight whose answer must not reveal another tenant's chunk.
    tenant_reads: HashMap<(u64, u64), (&'static str, TenantRead)>,
    next_conn: u64,
    /// Node context id → the checker's ledger id.
    ledger: HashMap<ContextId, u64>,
    builds: HashMap<ContextId, (EntryKey, Vec<u64>)>,
    copies: HashMap<CopyId, u64>,
    frees: HashMap<FreeId, u64>,
    /// Frees running: their key, start and the pause time before it (their run time
    /// excludes the server's pauses: its threads were stopped too).
    free_runs: BTreeMap<FreeId, (EntryKey, Nanos, Nanos)>,
    paused_total: Nanos,
    paused_since: Nanos,
    /// Instances holding rope tables (the shell keeps them; the node names them).
    pub blend: BTreeSet<InstanceId>,
    /// Reservations granted to engine-driven instances and not yet committed.
    reserved: BTreeMap<InstanceId, BTreeSet<Vec<u8>>>,
    reserved_total: usize,
    watched: BTreeSet<ProcessKey>,
    /// Same-host processes the kernel says have exited (their pidfd is readable).
    pub exited_same_host: BTreeSet<InstanceId>,
    /// Counters.
    pub stats: ServerStats,
    /// The L2 store (another process: it outlives a restart of the server).
    pub l2: SimL2,
    /// L2 reads asked for a `retrieve` or `prepare_retrieve`: its (connection, request).
    l2_reads: BTreeMap<u64, (u64, u64)>,
    /// Copies into L1 of a store: the key their completion publishes.
    store_copies: HashMap<u64, Vec<u8>>,
    /// L2 writes (a pinned slot) and reads (a reserved slot) not answered yet.
    l2_holding: usize,
    /// Delivering L2 reads (a `retrieve`'s) → the context they count as a copy on
    /// (its ledger id), until answered.
    l2_delivering: BTreeMap<u64, u64>,
    /// L2 reads the node gave up (`L2Request::Cancel`) and that were answered then: their own
    /// answer, when it comes, is dropped, as the production client never places a read
    /// it answered.
    l2_cancelled: BTreeSet<u64>,
    /// L2 existence checks in flight (a cancel answers them, not a read).
    l2_checks: BTreeSet<u64>,
    /// The pool file, with `pool_file` (it outlives the process).
    pool: Option<PoolFile>,
    /// Copies into L1 in flight → their slot (the pool file's writes).
    pool_writes: HashMap<u64, usize>,
    /// Seals handed out and not ended: each pins its slot.
    sealing: usize,
    /// L2 reads in flight → the slot a hit is placed in.
    l2_slots: BTreeMap<u64, usize>,
    /// The pending wake's instant.
    pub wake_at: Option<Nanos>,
    /// The pending wake's generation.
    pub wake_generation: u64,
    /// How far the wall clock is from the monotonic one (only the `wall_clock` bug
    /// reads it).
    pub wall_offset: i64,
}

impl Server {
    /// A server booted at `now`.
    pub fn new(spec: ServerSpec, bug: Option<InjectedBug>, now: Nanos) -> Result<Server, String> {
        let mut server = Server {
            l2: SimL2::new(spec.l2.clone()),
            spec,
            bug,
            boot: 0,
            state: ServerState::Down,
            paused: false,
            node: None,
            outputs: Vec::new(),
            inbox: VecDeque::new(),
            conns: HashMap::default(),
            peers: HashMap::default(),
            tenant_reads: HashMap::default(),
            next_conn: 0,
            ledger: HashMap::default(),
            builds: HashMap::default(),
            copies: HashMap::default(),
            frees: HashMap::default(),
            free_runs: BTreeMap::new(),
            paused_total: 0,
            paused_since: 0,
            blend: BTreeSet::new(),
            reserved: BTreeMap::new(),
            reserved_total: 0,
            watched: BTreeSet::new(),
            exited_same_host: BTreeSet::new(),
            stats: ServerStats::default(),
            l2_reads: BTreeMap::new(),
            store_copies: HashMap::default(),
            l2_holding: 0,
            l2_delivering: BTreeMap::new(),
            l2_cancelled: BTreeSet::new(),
            l2_checks: BTreeSet::new(),
            pool: None,
            pool_writes: HashMap::default(),
            sealing: 0,
            l2_slots: BTreeMap::new(),
            wake_at: None,
            wake_generation: 0,
            wall_offset: 0,
        };
        server.start(now)?;
        Ok(server)
    }

    /// The core configuration of this server.
    pub fn core_config(spec: &ServerSpec) -> Config {
        Config {
            reap_timeout: duration(spec.reap_timeout),
            registration_grace: duration(spec.registration_grace),
            resolution: duration(spec.resolution),
            stall_threshold: duration(spec.stall_threshold),
        }
    }

    /// A new process: an empty node, clock from `now`.
    pub fn start(&mut self, now: Nanos) -> Result<(), String> {
        let floor = if self.spec.allow_short_timeouts {
            std::time::Duration::ZERO
        } else {
            kvwarden_core::REAP_TIMEOUT_FLOOR
        };
        let config = NodeConfig {
            liveness: Self::core_config(&self.spec),
            reap_timeout_floor: floor,
            num_slots: NUM_SLOTS,
            slot_bytes: crate::worker::STORE_BYTES,
            server_uid: SERVER_UID,
            trust: self.spec.trust(),
            boot_id: self.boot,
            server_name: "kvwarden-sim".to_string(),
            free_watchdog: duration(self.spec.free_watchdog),
            shutdown_drain: SHUTDOWN_DRAIN,
            cuda_devices: Err("the simulator has no CUDA".to_string()),
            l2: self.spec.l2.node_config(),
            connections: kvwarden_core::node::admission::ConnectionLimits::unbounded(),
            mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
            // Every job handed out at once: the checker ties a copy to the request whose
            // node call handed it out, so copies held back for their tenant's turn
            // (row 68, proven by core/tests/node_bounds.rs) are not modelled here.
            pool_window: kvwarden_core::node::jobs::UNBOUNDED,
            kv_publish: Vec::new(),
        };
        let mut node = Node::new(config, instant(now)).map_err(|error| error.to_string())?;
        #[cfg(feature = "planted-bugs")]
        if let Some(planted) = self.bug.and_then(InjectedBug::planted) {
            node.plant(planted);
        }
        if self.spec.pool_file {
            // The first process makes the file (nothing to adopt); a later one finds it
            // and adopts what its seals still cover.
            let adopt = self.pool.is_some();
            self.pool.get_or_insert_with(|| PoolFile::new(NUM_SLOTS));
            node.persist_pool(instant(now), true, adopt);
        }
        self.node = Some(node);
        self.state = ServerState::Up;
        self.paused = false;
        Ok(())
    }

    /// The instant the loop must next call `handle_timeout`.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if !self.is_turning() || self.bug == Some(InjectedBug::SkipHandleTimeout) {
            return None;
        }
        let late = if self.bug == Some(InjectedBug::LateWake) {
            2_400 * crate::time::MILLISECOND
        } else {
            0
        };
        self.node
            .as_ref()
            .and_then(Node::poll_timeout)
            .map(|at| at.as_nanos() + late)
    }

    /// The registry's counters.
    pub fn status(&self) -> Option<kvwarden_core::Status> {
        self.node.as_ref().map(Node::liveness_status)
    }

    /// The node, for views.
    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// Whether the loop turns (up or draining, not paused).
    pub fn is_turning(&self) -> bool {
        !self.paused && matches!(self.state, ServerState::Up | ServerState::Draining)
    }

    /// One input: read it now, or queue it while paused.
    pub fn input(&mut self, now: Nanos, input: Input, checker: &mut Checker, out: &mut ServerOut) {
        if !matches!(self.state, ServerState::Up | ServerState::Draining) {
            return;
        }
        if self.paused {
            self.inbox.push_back(input);
            return;
        }
        self.read(now, input, checker, out);
        self.turn(now, checker, out);
    }

    /// The loop's own deadline.
    pub fn wake(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if self.is_turning() {
            self.turn(now, checker, out);
        }
    }

    /// SIGSTOP.
    pub fn pause(&mut self, now: Nanos, checker: &mut Checker) {
        if self.state == ServerState::Up && !self.paused {
            self.paused = true;
            self.paused_since = now;
            checker.server_paused(now);
        }
    }

    /// SIGCONT: every queued input goes to the node before any deadline is judged.
    pub fn resume(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if !self.paused {
            return;
        }
        self.paused = false;
        self.count_pause(now);
        if self.bug == Some(InjectedBug::TimeoutBeforeInput) {
            self.turn(now, checker, out);
        }
        while let Some(input) = self.inbox.pop_front() {
            self.read(now, input, checker, out);
        }
        self.turn(now, checker, out);
    }

    /// A pause ends: one longer than the stall threshold is time the node can know it
    /// did not run (it credits the stall), so a free's run time excludes it; a shorter
    /// one the node cannot tell from running.
    fn count_pause(&mut self, now: Nanos) {
        let pause = now - self.paused_since;
        if pause > self.spec.stall_threshold {
            self.paused_total += pause;
        }
    }

    /// The process dies: every context dies with it, connections break.
    pub fn crash(&mut self, now: Nanos, checker: &mut Checker) {
        self.state = ServerState::Down;
        self.paused = false;
        self.node = None;
        self.inbox.clear();
        self.conns.clear();
        self.peers.clear();
        self.tenant_reads.clear();
        self.ledger.clear();
        self.builds.clear();
        self.copies.clear();
        self.frees.clear();
        self.free_runs.clear();
        self.blend.clear();
        self.reserved.clear();
        self.reserved_total = 0;
        self.watched.clear();
        self.l2_reads.clear();
        self.store_copies.clear();
        self.l2_holding = 0;
        self.l2_delivering.clear();
        self.l2_cancelled.clear();
        self.l2_checks.clear();
        // The pool file stays; the copies writing it stop where they are (torn).
        self.pool_writes.clear();
        self.sealing = 0;
        self.l2_slots.clear();
        self.boot += 1;
        self.wake_at = None;
        self.wake_generation += 1;
        checker.server_restarted(now);
    }

    /// SIGTERM: the node answers what is in flight, frees every context once, stops.
    pub fn shut_down(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if self.state != ServerState::Up {
            return;
        }
        if self.paused {
            self.paused = false;
            self.count_pause(now);
        }
        while let Some(input) = self.inbox.pop_front() {
            self.read(now, input, checker, out);
        }
        self.state = ServerState::Draining;
        self.call(now, Some(NodeInput::Shutdown), Call::Other, checker, out);
        self.turn(now, checker, out);
    }

    /// The instant the node is told: the monotonic clock (the wall clock under the
    /// `wall_clock` bug).
    fn core_now(&self, now: Nanos) -> kvwarden_core::Instant {
        if self.bug == Some(InjectedBug::WallClock) {
            instant(now.saturating_add_signed(self.wall_offset))
        } else {
            instant(now)
        }
    }

    fn entries(&self, instance: InstanceId) -> [Option<kvwarden_core::EntryView>; 2] {
        let Some(node) = self.node.as_ref() else {
            return [None, None];
        };
        Module::ALL.map(|module| node.entry(instance, module))
    }

    /// `handle_timeout`, then the per-turn checks.
    fn turn(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if self.state == ServerState::Stopped {
            return;
        }
        self.call(now, None, Call::Other, checker, out);
    }
}
