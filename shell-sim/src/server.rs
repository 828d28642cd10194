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
use crate::invariants::{Checker, Read, ShellView, Verdict};
use crate::l2::{L2Fate, L2Job, SimL2};
use crate::message::{Channel, Envelope, HANDSHAKE_ID, Payload, ReplyEnvelope};
use crate::oracle::Key;
use crate::pool::{Holds, PoolFile, PoolJob};
use crate::time::{Nanos, duration, instant, nanos_of};
use kvwarden_core::node::l2::{L2Fetched, L2Presence};
use kvwarden_core::node::{BlendChange, Job, L2Request, PeerAction};
use kvwarden_core::node::{
    Built, ConnId, ContextId, CopyId, DeathNotice, Direction, FreeId, Input as NodeInput, Node,
    NodeConfig, Note, Output, ProcessKey, SHUTDOWN_DRAIN, Transport,
};
use kvwarden_core::protocol::{Answer, BufferSpec, ErrorCode, Op, ProtocolError};
use kvwarden_core::{Config, FreeCause, InstanceId, Module, TransferError};
use rmpv::Value;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

mod outputs;

/// What one node call's outputs did, for the checks that follow them.
#[derive(Default)]
struct Step {
    freed: Vec<(Key, FreeCause)>,
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
        key: Key,
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
    tenant_reads: HashMap<(u64, u64), (&'static str, Read)>,
    next_conn: u64,
    /// Node context id → the checker's ledger id.
    ledger: HashMap<ContextId, u64>,
    builds: HashMap<ContextId, (Key, Vec<u64>)>,
    copies: HashMap<CopyId, u64>,
    frees: HashMap<FreeId, u64>,
    /// Frees running: their key, start and the pause time before it (their run time
    /// excludes the server's pauses: its threads were stopped too).
    free_runs: BTreeMap<FreeId, (Key, Nanos, Nanos)>,
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

    /// The connection of a worker process in this boot, opened (`Connected`, then the
    /// client's `attach`) on its first message; None for a message of a connection the
    /// process has replaced (lost with it).
    fn conn(
        &mut self,
        now: Nanos,
        envelope: &Envelope,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) -> Option<ConnId> {
        let key = (envelope.slot, envelope.incarnation, envelope.channel);
        match self.conns.get(&key) {
            Some(&(epoch, conn)) if epoch == envelope.epoch => return Some(conn),
            Some(&(epoch, _)) if epoch > envelope.epoch => return None,
            Some(&(_, old)) => {
                // The client reconnected: its old connection closes.
                self.conns.remove(&key);
                self.close(now, old, checker, out);
            }
            None => {}
        }
        self.next_conn += 1;
        let conn = ConnId(self.next_conn);
        self.conns.insert(key, (envelope.epoch, conn));
        self.peers
            .insert(conn, (envelope.slot, envelope.incarnation, envelope.tcp));
        let (uid, transport) = if envelope.tcp {
            (None, Transport::Tcp)
        } else {
            (Some(envelope.uid), Transport::Unix)
        };
        let process = (envelope.same_host && !envelope.tcp)
            .then_some((ProcessKey(envelope.instance.get()), DeathNotice::PidfdByPid));
        let input = NodeInput::Connected {
            conn,
            uid,
            transport,
            process,
        };
        checker.connected(conn.0, uid);
        self.call(now, Some(input), Call::Other, checker, out);
        if let Some(secret) = envelope.secret {
            self.stats.attaches += 1;
            let op = Op::Attach {
                instance: envelope.instance,
                secret: secret.to_vec(),
            };
            let request_id = HANDSHAKE_ID + u64::from(envelope.epoch);
            self.feed(now, conn, envelope, request_id, op, 0, checker, out);
        }
        Some(conn)
    }

    /// A connection closes (`Disconnected`).
    fn close(&mut self, now: Nanos, conn: ConnId, checker: &mut Checker, out: &mut ServerOut) {
        self.peers.remove(&conn);
        self.tenant_reads.retain(|&(c, _), _| c != conn.0);
        let input = NodeInput::Disconnected { conn };
        self.call(now, Some(input), Call::Other, checker, out);
        checker.disconnected(conn.0);
    }

    fn read(&mut self, now: Nanos, input: Input, checker: &mut Checker, out: &mut ServerOut) {
        if self.node.is_none() {
            return;
        }
        match input {
            Input::Request(envelope) => self.request(now, envelope, checker, out),
            Input::BuildDone { context, failed } => {
                let context = ContextId(context);
                let Some((key, buffer_lens)) = self.builds.remove(&context) else {
                    return;
                };
                let result = if failed {
                    Err(ProtocolError::new(
                        ErrorCode::Internal,
                        "simulated build failure (mmap refused)",
                    ))
                } else {
                    Ok(match key.1 {
                        Module::ServerDriven => Built::ServerDriven { buffer_lens },
                        Module::EngineDriven => Built::EngineDriven,
                    })
                };
                let call = Call::BuildDone {
                    key,
                    context,
                    failed,
                };
                self.call(
                    now,
                    Some(NodeInput::BuildDone { context, result }),
                    call,
                    checker,
                    out,
                );
            }
            Input::CopyDone(copy) => {
                let copy = CopyId(copy);
                if let Some(context) = self.copies.remove(&copy) {
                    checker.copy_done(context);
                }
                if let Some(slot) = self.pool_writes.remove(&copy.0)
                    && let Some(pool) = self.pool.as_mut()
                {
                    pool.write_done(slot, self.store_copies.get(&copy.0).cloned());
                }
                if let Some(key) = self.store_copies.remove(&copy.0) {
                    // The copy completed: the slot holds the key's published bytes.
                    checker.published(key);
                }
                let input = NodeInput::CopyDone {
                    copy,
                    result: Ok(crate::worker::STORE_BYTES),
                };
                self.call(now, Some(input), Call::CopyDone, checker, out);
            }
            Input::BlendDone(blend) => {
                let input = NodeInput::BlendDone {
                    blend: kvwarden_core::node::blend::BlendId(blend),
                    result: Ok(()),
                };
                self.call(now, Some(input), Call::Other, checker, out);
            }
            Input::FreeDone(free) => {
                let free = FreeId(free);
                if let Some(context) = self.frees.remove(&free) {
                    checker.released(context);
                }
                self.free_runs.remove(&free);
                self.call(
                    now,
                    Some(NodeInput::FreeDone { free }),
                    Call::Other,
                    checker,
                    out,
                );
            }
            Input::PoolDone(job) => self.pool_done(now, job, checker, out),
            Input::Closed { slot, incarnation } => {
                for channel in [Channel::Main, Channel::Raw] {
                    if let Some((_, conn)) = self.conns.remove(&(slot, incarnation, channel)) {
                        self.close(now, conn, checker, out);
                    }
                }
            }
            Input::L2Done { job, fate } => {
                if let Some(input) = self.l2_done(job, fate, checker) {
                    self.call(now, Some(input), Call::Other, checker, out);
                }
            }
            Input::ExitNotice(instance) => {
                let process = ProcessKey(instance.get());
                if self.watched.contains(&process) {
                    let input = NodeInput::ProcessExited { process };
                    self.call(now, Some(input), Call::Exit(instance), checker, out);
                }
            }
        }
    }

    fn request(
        &mut self,
        now: Nanos,
        mut envelope: Envelope,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let Some(conn) = self.conn(now, &envelope, checker, out) else {
            return; // it travelled on a connection the process has closed
        };
        let (request_id, op, fds) =
            match std::mem::replace(&mut envelope.payload, Payload::Bytes(Vec::new())) {
                Payload::Op { id, op, fds } => (id, op, fds),
                Payload::Decoded(Ok(request)) => (request.id, request.op, 0),
                Payload::Decoded(Err(error)) => {
                    // As the production shell: the decode error is the reply; a frame that
                    // cannot be trusted closes that connection only.
                    self.stats.decode_errors += 1;
                    let request_id = error.request_id.unwrap_or(0);
                    let code = error.error.code;
                    if code == ErrorCode::BadArgs {
                        self.stats.bad_args += 1;
                    }
                    out.replies.push(ReplyEnvelope {
                        slot: envelope.slot,
                        incarnation: envelope.incarnation,
                        boot: self.boot,
                        request_id,
                        result: Err(error.error),
                    });
                    if code.closes_connection() {
                        self.stats.connections_closed += 1;
                        let key = (envelope.slot, envelope.incarnation, envelope.channel);
                        self.conns.remove(&key);
                        self.close(now, conn, checker, out);
                    }
                    return;
                }
                Payload::Bytes(_) => return, // decoded on arrival; never here
            };
        self.feed(now, conn, &envelope, request_id, op, fds, checker, out);
    }

    /// Hands one request to the node, judged first by the trust rules' reference model.
    #[allow(clippy::too_many_arguments)]
    fn feed(
        &mut self,
        now: Nanos,
        conn: ConnId,
        envelope: &Envelope,
        request_id: u64,
        op: Op,
        fds: usize,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let verdict = checker.verdict(conn.0, &op);
        let instance = op.instance();
        let allowed = verdict == Verdict::Allowed;
        let mut publish: Publishing = (Vec::new(), false);
        if allowed && let Some(prefix) = checker.tenant_prefix(conn.0) {
            let scoped = |key: &[u8]| {
                let mut scoped = prefix.to_vec();
                scoped.extend_from_slice(key);
                scoped
            };
            publish = match &op {
                Op::Store { key, .. } => (vec![scoped(key)], false),
                Op::CommitStore { key, .. } => (vec![scoped(key)], true),
                Op::StoreBatch { items, .. } => {
                    (items.iter().map(|item| scoped(&item.key)).collect(), false)
                }
                _ => (Vec::new(), false),
            };
            let read = match &op {
                Op::Retrieve { key, .. } => Some((vec![key.clone()], false)),
                Op::RetrieveBatch { items, .. } => {
                    Some((items.iter().map(|item| item.key.clone()).collect(), false))
                }
                Op::Lookup { keys } => Some((keys.clone(), true)),
                _ => None,
            };
            if let Some((keys, lookup)) = read {
                let read = Read {
                    prefix: prefix.to_vec(),
                    keys,
                    lookup,
                };
                self.tenant_reads
                    .insert((conn.0, request_id), (op.name(), read));
            }
        }
        let reads = matches!(op, Op::Retrieve { .. } | Op::PrepareRetrieve { .. });
        let before = match verdict {
            Verdict::Refused(_) => {
                instance.map(|named| (self.entries(named), self.blend.contains(&named)))
            }
            _ => None,
        };
        let call = Call::Request {
            conn,
            request_id,
            name: op.name(),
            instance,
            asked: Asked::of(&op),
            // The clean shutdown's last word is about the process's own instance.
            exiting: envelope.exiting && instance == Some(envelope.instance),
            verdict,
            before,
            reads,
            publish,
        };
        let input = NodeInput::Request {
            conn,
            request_id,
            op,
            fds,
        };
        self.call(now, Some(input), call, checker, out);
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

    /// One node call (`None`: `handle_timeout`), its outputs carried out and reported
    /// to the checker.
    fn call(
        &mut self,
        now: Nanos,
        input: Option<NodeInput>,
        call: Call,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let at = self.core_now(now);
        let Some(node) = self.node.as_mut() else {
            return;
        };
        checker.handle_timeout(now);
        let reaped_before = node.liveness_status().reaped_total;
        match input {
            Some(input) => node.handle_input(at, input),
            None => node.handle_timeout(at),
        }
        let mut outputs = std::mem::take(&mut self.outputs);
        while let Some(output) = node.poll_output() {
            outputs.push(output);
        }
        self.before_outputs(now, &call, &outputs, checker);
        if self.spec.l2.enabled {
            self.l2_replies(&outputs, checker);
        }
        let mut step = Step::default();
        for output in outputs.drain(..) {
            self.carry_out(now, output, &call, checker, out, &mut step);
        }
        self.outputs = outputs;
        if let Call::Exit(instance) = call
            && !step.exit_noted
        {
            checker.fail(
                crate::violation::Class::Liveness,
                "exit_ignored",
                format!(
                    "the kernel proved that the process of instance {instance}, which the node \
                     watches, exited, and the node did not apply it"
                ),
            );
        }
        let reaped = self.reconcile(reaped_before, &step.freed, checker);
        out.reaped += reaped;
        let (l1_held, l1_explained) = match self.node.as_ref() {
            Some(node) if step.engine_freed => {
                let occupancy = node.l1_occupancy();
                (
                    occupancy.reserved + occupancy.pinned,
                    self.reserved_total + self.copies.len() + self.l2_holding + self.sealing,
                )
            }
            _ => (0, 0),
        };
        checker.end_step(&ShellView {
            blend: &self.blend,
            l1_held,
            l1_explained,
        });
        if self.bug == Some(InjectedBug::Panic) && reaped > 0 {
            panic!("injected bug: the simulated shell panics on its first reap");
        }
        for instance in step.exits {
            if self.watched.contains(&ProcessKey(instance.get())) {
                let input = NodeInput::ProcessExited {
                    process: ProcessKey(instance.get()),
                };
                self.call(now, Some(input), Call::Exit(instance), checker, out);
            }
        }
    }

    /// A job the node started: the simulated pool runs it later (its input comes
    /// through the agenda); the checker learns what it holds meanwhile.
    fn on_job(
        &mut self,
        now: Nanos,
        job: Job,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
        step: &mut Step,
    ) {
        match job {
            Job::Build {
                context,
                instance,
                module,
                buffers,
                ..
            } => {
                let lens = buffers
                    .iter()
                    .map(|buffer| match buffer {
                        BufferSpec::Memfd { nbytes, .. } | BufferSpec::CudaIpc { nbytes, .. } => {
                            *nbytes
                        }
                    })
                    .collect();
                self.builds.insert(context, ((instance, module), lens));
                out.builds.push(context.0);
            }
            Job::Copy {
                copy,
                context,
                direction,
                offset,
                slot,
                ..
            } => {
                if self.pool.is_some() {
                    self.pool_copy(copy, direction, slot, offset, call, checker);
                }
                if direction == Direction::ToL1
                    && let Call::Request {
                        publish: (keys, false),
                        ..
                    } = call
                    && let Some(key) = keys.get((offset / crate::worker::STORE_BYTES) as usize)
                {
                    self.store_copies.insert(copy.0, key.clone());
                }
                if let Some(&id) = self.ledger.get(&context) {
                    self.copies.insert(copy, id);
                    checker.copy_started(id);
                }
                out.copies.push(copy.0);
            }
            Job::Blend { blend, .. } => out.blends.push(blend.0),
            Job::Free {
                free,
                context,
                instance,
                module,
                cause,
                ..
            } => {
                let Some(&id) = self.ledger.get(&context) else {
                    checker.fail(
                        crate::violation::Class::Safety,
                        "double_free",
                        format!("the node freed context {context:?}, which it never built"),
                    );
                    return;
                };
                checker.free_requested((instance, module), id, cause);
                if matches!(call, Call::CopyDone) {
                    self.stats.frees_deferred += 1;
                }
                if module == Module::EngineDriven {
                    step.engine_freed = true;
                    if let Some(keys) = self.reserved.remove(&instance) {
                        self.reserved_total -= keys.len();
                    }
                }
                self.frees.insert(free, id);
                self.free_runs
                    .insert(free, ((instance, module), now, self.paused_total));
                out.free_jobs.push(free.0);
                out.frees.push(FreeRecord {
                    instance,
                    module,
                    cause,
                    context: id,
                });
                step.freed.push(((instance, module), cause));
            }
            Job::Seal { slot, key, len } if self.pool.is_some() => {
                if let Call::Request {
                    publish: (keys, true),
                    ..
                } = call
                    && keys.contains(&key)
                    && let Some(pool) = self.pool.as_mut()
                {
                    // An engine-driven commit: the engine wrote the value through its
                    // mapping before it committed.
                    pool.write_started(slot, self.boot);
                    pool.write_done(slot, Some(key.clone()));
                }
                self.sealing += 1;
                out.pool_jobs.push(PoolJob::Seal { slot, key, len });
            }
            Job::Scan { first, count } if self.pool.is_some() => {
                let found = self
                    .pool
                    .as_ref()
                    .map_or_else(Vec::new, |pool| pool.scan(first, count));
                out.pool_jobs.push(PoolJob::Scan { first, found });
            }
            // Without `pool_file` the simulated pool is anonymous (`persist_pool` is never
            // called): a seal or a scan means the node persisted a pool nobody asked it to.
            Job::Seal { slot, .. } | Job::Scan { first: slot, .. } => checker.fail(
                crate::violation::Class::Safety,
                "unasked_persistence",
                format!("the node sealed or scanned slot {slot} of an anonymous pool"),
            ),
        }
    }

    /// A copy on the pool file: one into L1 writes its slot (torn until it ends); one
    /// out of L1 must read the whole value of the key it is read for.
    fn pool_copy(
        &mut self,
        copy: CopyId,
        direction: Direction,
        slot: usize,
        offset: u64,
        call: &Call,
        checker: &mut Checker,
    ) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        if direction == Direction::ToL1 {
            pool.write_started(slot, self.boot);
            self.pool_writes.insert(copy.0, slot);
            return;
        }
        let wanted = match call {
            Call::Request {
                conn, request_id, ..
            } => self
                .tenant_reads
                .get(&(conn.0, *request_id))
                .and_then(|(_, read)| {
                    let key = read
                        .keys
                        .get((offset / crate::worker::STORE_BYTES) as usize)?;
                    let mut scoped = read.prefix.clone();
                    scoped.extend_from_slice(key);
                    Some(scoped)
                }),
            _ => None,
        };
        let fault = match (pool.holds(slot), wanted) {
            (Holds::Torn | Holds::Blank, _) => Some(("served_torn", None)),
            (Holds::Whole(held), Some(wanted)) if *held != wanted => {
                Some(("served_other_value", Some((held.clone(), wanted))))
            }
            _ => None,
        };
        if let Some((invariant, keys)) = fault {
            let detail = match keys {
                Some((held, wanted)) => format!(
                    "the node served key {} from L1 slot {slot}, which holds the value of key \
                     {} (row 71: a value is served only under its own key)",
                    crate::invariants::hex(&wanted),
                    crate::invariants::hex(&held)
                ),
                None => format!(
                    "the node served L1 slot {slot}, whose bytes no write completed \
                     ({}: row 72, a torn value is never served)",
                    pool.holds(slot)
                ),
            };
            checker.fail(crate::violation::Class::Safety, invariant, detail);
        }
        if pool.written_in(slot) < self.boot {
            self.stats.adopted_served += 1;
        }
    }

    /// A seal or scan of the pool file ends: the seal is written over what the slot
    /// holds now; the scan's findings (read when it started) go to the node, and every
    /// slot the node then holds committed must hold that key's value.
    fn pool_done(&mut self, now: Nanos, job: PoolJob, checker: &mut Checker, out: &mut ServerOut) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        match job {
            PoolJob::Seal { slot, key, len } => {
                self.sealing = self.sealing.saturating_sub(1);
                if let Some(held) = pool.seal(slot, key.clone(), len) {
                    checker.fail(
                        crate::violation::Class::Safety,
                        "sealed_other_bytes",
                        format!(
                            "the node had L1 slot {slot} sealed as key {}, but the slot holds \
                             {held}: it was not kept until its seal was written (row 71)",
                            crate::invariants::hex(&key)
                        ),
                    );
                }
                let input = NodeInput::Sealed {
                    slot,
                    written: true,
                };
                self.call(now, Some(input), Call::Other, checker, out);
            }
            PoolJob::Scan { first, found } => {
                let count = found.len();
                let input = NodeInput::Scanned { first, found };
                self.call(now, Some(input), Call::Other, checker, out);
                let (Some(node), Some(pool)) = (self.node.as_ref(), self.pool.as_ref()) else {
                    return;
                };
                for slot in first..first + count {
                    let Some(key) = node.l1_committed_key(slot) else {
                        continue;
                    };
                    match pool.holds(slot) {
                        Holds::Whole(held) if held == key => {}
                        Holds::Unnamed => {}
                        held => checker.fail(
                            crate::violation::Class::Safety,
                            "adopted_other_bytes",
                            format!(
                                "after the scan of L1 slot {slot} the node holds key {} there, but the \
                                 slot holds {held} (row 71: only a value whose seal still covers its \
                                 bytes is adopted)",
                                crate::invariants::hex(key)
                            ),
                        ),
                    }
                }
            }
        }
    }

    fn on_blend(&mut self, change: BlendChange, checker: &mut Checker) {
        match change {
            BlendChange::Keep { instance, .. } => {
                self.blend.insert(instance);
                checker.touch_instance(instance);
            }
            BlendChange::Discard { .. } => {}
            BlendChange::Drop { instance } => {
                self.blend.remove(&instance);
            }
        }
    }

    fn on_peer(&mut self, action: PeerAction, step: &mut Step) {
        match action {
            PeerAction::Watch { process, .. } => {
                self.watched.insert(process);
                let instance = InstanceId::new(process.0).expect("a process key is an id");
                if self.exited_same_host.contains(&instance) {
                    // The pidfd of a peer that already exited is readable at once.
                    step.exits.push(instance);
                }
            }
            PeerAction::Unwatch { process } => {
                self.watched.remove(&process);
            }
            // Simulated connections carry no fds: how they are read is the same.
            PeerAction::ReadWithoutFds { .. } => {}
            // The simulated node has no deadline to authenticate (unbounded limits).
            PeerAction::Disconnect { .. } => {}
        }
    }

    fn on_note(
        &mut self,
        now: Nanos,
        note: Note,
        call: &Call,
        checker: &mut Checker,
        step: &mut Step,
    ) {
        match note {
            Note::Stall { gap } => {
                self.stats.stalls += 1;
                checker.stall_reported(nanos_of(gap));
            }
            Note::ProcessExited { instance, held } => {
                // A process may hold instances besides the one it started as
                // (ids it claimed): any of them noted is the exit applied.
                step.exit_noted |= matches!(call, Call::Exit(_));
                checker.process_exited(now, instance, held);
            }
            Note::PoolAdopted(view) => {
                self.stats.adopted += view.adopted;
                self.stats.dropped_torn += view.dropped_torn;
                self.stats.dropped_taken += view.dropped_taken;
            }
            Note::EngineReleased {
                reservations_discarded,
                pins_released,
                ..
            } => {
                self.stats.reservations_discarded += reservations_discarded as u64 + pins_released;
            }
            Note::FreeHung {
                instance,
                module,
                watchdog,
            } => {
                self.stats.frees_hung += 1;
                let watchdog = nanos_of(watchdog);
                let longest = self
                    .free_runs
                    .values()
                    .filter(|(key, _, _)| *key == (instance, module))
                    .map(|&(_, start, paused)| {
                        (now - start).saturating_sub(self.paused_total - paused)
                    })
                    .max();
                if longest.is_none_or(|ran| ran < watchdog) {
                    checker.fail(
                        crate::violation::Class::Liveness,
                        "free_reported_hung_early",
                        format!(
                            "the node reported a free of instance {instance} ({}) hung \
                             after its watchdog of {:.3}s, but it has run {:.3}s: the \
                             server's own pause counted as the free's time",
                            module.label(),
                            crate::time::as_seconds(watchdog),
                            crate::time::as_seconds(longest.unwrap_or(0))
                        ),
                    );
                }
            }
            Note::L2StateChanged { .. } => self.stats.l2_state_changes += 1,
            _ => {}
        }
    }

    fn on_l2(
        &mut self,
        request: L2Request,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        if !self.spec.l2.enabled {
            checker.fail(
                crate::violation::Class::Internal,
                "l2_without_l2",
                format!("the node, configured without L2, asked for L2: {request:?}"),
            );
            return;
        }
        match request {
            L2Request::Write {
                write, key, nbytes, ..
            } => {
                let good = checker.l2_write(&key);
                self.l2_holding += 1;
                out.l2_jobs.push(L2Job::Write {
                    write,
                    key,
                    nbytes,
                    good,
                });
            }
            L2Request::Get {
                read,
                key,
                deliver,
                slot,
            } => {
                if self.pool.is_some() {
                    self.l2_slots.insert(read.0, slot);
                }
                // A delivering read may write into the worker's buffer until
                // answered: a copy on its context, as far as a free is concerned.
                if let Some(deliver) = deliver
                    && let Some(&id) = self.ledger.get(&deliver.context)
                {
                    self.l2_delivering.insert(read.0, id);
                    checker.copy_started(id);
                }
                if let Call::Request {
                    conn,
                    request_id,
                    reads: true,
                    ..
                } = call
                {
                    self.l2_reads.insert(read.0, (conn.0, *request_id));
                }
                self.l2_holding += 1;
                out.l2_jobs.push(L2Job::Get { read, key });
            }
            L2Request::Exists { read, keys } => {
                self.l2_checks.insert(read.0);
                out.l2_jobs.push(L2Job::Exists { read, keys });
            }
            L2Request::Cancel { read } => {
                // Redis has not answered (its answer is still on the agenda): the
                // client's cancel wins and answers `TimedOut` at once.
                if self.l2_cancelled.insert(read.0) {
                    let check = self.l2_checks.contains(&read.0);
                    out.l2_jobs.push(L2Job::Cancelled { read, check });
                }
            }
        }
    }

    /// What the checker must know before the outputs are carried out: how the node
    /// answered the request (or took the build's outcome).
    fn before_outputs(
        &mut self,
        now: Nanos,
        call: &Call,
        outputs: &[Output],
        checker: &mut Checker,
    ) {
        match call {
            Call::BuildDone {
                key,
                context,
                failed,
            } => {
                if *failed {
                    self.stats.builds_failed += 1;
                    checker.build_failed(now, *key, context.0);
                } else {
                    let id = checker.contexts.len() as u64;
                    checker.built(now, *key, context.0, id);
                    self.ledger.insert(*context, id);
                    self.stats.contexts_built += 1;
                }
            }
            Call::Request {
                conn,
                request_id,
                name,
                instance,
                asked,
                exiting,
                verdict,
                before,
                ..
            } => {
                let reply = outputs.iter().find_map(|output| match output {
                    Output::Reply {
                        conn: to,
                        request_id: id,
                        result,
                        ..
                    } if to == conn && id == request_id => Some(result),
                    _ => None,
                });
                let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
                if code == Some(ErrorCode::Forbidden) && instance.is_some() {
                    self.stats.forbidden += 1;
                }
                // Who is who first: a request the rules refuse is judged here in full.
                let served = checker.judge_trust(conn.0, name, *instance, verdict, reply);
                if let (Some(named), Some(before)) = (*instance, before)
                    && code != Some(ErrorCode::Unavailable)
                {
                    // (A shutdown frees everything, whoever asks.)
                    let after = (self.entries(named), self.blend.contains(&named));
                    checker.refused_left_alone(name, named, before, &after);
                }
                if *verdict == Verdict::OwnerRefused
                    && code == Some(ErrorCode::Forbidden)
                    && let Some(named) = *instance
                {
                    // Refused for its tenant, but the owner's request: evidence of life.
                    checker.evidence(now, named);
                }
                if let Call::Request {
                    publish: (keys, true),
                    ..
                } = call
                    && reply == Some(&Ok(Answer::Flag(true)))
                {
                    // A commit answered `true` published its key (a store's key is
                    // published when its copy completes, never by its answer: `true`
                    // for a key already there copied nothing).
                    keys.iter().for_each(|key| checker.published(key.clone()));
                }
                let Some(instance) = *instance else {
                    return;
                };
                if !served || code == Some(ErrorCode::Forbidden) {
                    return;
                }
                if code == Some(ErrorCode::Unavailable) {
                    return; // shutting down: refused before anything
                }
                if let Asked::Ping = asked {
                    if reply.is_none() {
                        checker.fail(
                            crate::violation::Class::Safety,
                            "ping_waited_for_l2",
                            format!(
                                "a ping of instance {instance} was not answered in the node call \
                                 it was handed in (row 27: nothing a ping needs waits for L2)"
                            ),
                        );
                        return;
                    }
                    if let Some(Ok(Answer::Flag(tracked))) = reply {
                        checker.ping(now, instance, *tracked);
                    }
                    return;
                }
                checker.evidence(now, instance);
                let transfer =
                    |module: Module| -> Option<(Key, Result<Option<u64>, TransferError>)> {
                        let result = match code {
                            Some(ErrorCode::NotRegistered) => Err(TransferError::NotRegistered),
                            Some(ErrorCode::NotReady) => Err(TransferError::NotReady),
                            _ => Ok(None),
                        };
                        Some(((instance, module), result))
                    };
                let transfer = match asked {
                    Asked::Register(module) => {
                        let key = (instance, *module);
                        let build = outputs.iter().find_map(|output| match output {
                            Output::Job(Job::Build {
                                context,
                                instance: i,
                                module: m,
                                ..
                            }) if (*i, *m) == key => Some(context.0),
                            _ => None,
                        });
                        match (build, code) {
                            (Some(serial), _) => checker.register(now, key, Some(serial)),
                            (None, Some(_)) => {} // refused for its arguments or load
                            (None, None) => checker.register(now, key, None),
                        }
                        None
                    }
                    Asked::Unregister(module) => {
                        if let Some(Ok(Answer::Flag(was))) = reply {
                            checker.unregister(now, (instance, *module), *was, *exiting);
                        }
                        None
                    }
                    Asked::Transfer(module) => transfer(*module),
                    Asked::Prepare(key) => {
                        if let Some(Ok(Answer::Reserved(Some(_)))) = reply
                            && self
                                .reserved
                                .entry(instance)
                                .or_default()
                                .insert(key.clone())
                        {
                            self.reserved_total += 1;
                        }
                        transfer(Module::EngineDriven)
                    }
                    Asked::Commit(key) => {
                        if let Some(keys) = self.reserved.get_mut(&instance)
                            && keys.remove(key)
                        {
                            self.reserved_total -= 1;
                        }
                        transfer(Module::EngineDriven)
                    }
                    Asked::Ping | Asked::Other => None,
                };
                if let Some((key, mut result)) = transfer {
                    if let Ok(context) = &mut result {
                        *context = outputs.iter().find_map(|output| match output {
                            Output::Job(Job::Copy { context, .. }) => {
                                self.ledger.get(context).copied()
                            }
                            _ => None,
                        });
                    }
                    checker.transfer(now, key, result);
                }
            }
            Call::CopyDone | Call::Exit(_) | Call::Other => {}
        }
    }

    /// An L2 operation ends: carried out against the store, its answer for the node.
    fn l2_done(&mut self, job: L2Job, fate: L2Fate, checker: &mut Checker) -> Option<NodeInput> {
        if let L2Job::Get { read, .. } | L2Job::Exists { read, .. } = &job
            && self.l2_cancelled.remove(&read.0)
        {
            self.l2_checks.remove(&read.0);
            return None; // answered when it was given up
        }
        if !matches!(
            job,
            L2Job::Exists { .. } | L2Job::Cancelled { check: true, .. }
        ) {
            self.l2_holding -= 1;
        }
        Some(match job {
            L2Job::Write {
                write,
                key,
                nbytes,
                good,
            } => {
                let outcome = self.l2.write(fate, key, nbytes, good);
                match outcome {
                    kvwarden_core::l2::WriteOutcome::Written => self.stats.l2_written += 1,
                    _ => self.stats.l2_failed += 1,
                }
                NodeInput::L2Written { write, outcome }
            }
            L2Job::Cancelled { read, check: true } => {
                self.stats.l2_failed += 1;
                NodeInput::L2Existed {
                    read,
                    presence: L2Presence::TimedOut,
                }
            }
            L2Job::Cancelled { read, .. } => {
                self.l2_reads.remove(&read.0);
                if let Some(id) = self.l2_delivering.remove(&read.0) {
                    checker.copy_done(id);
                }
                self.stats.l2_failed += 1;
                NodeInput::L2Got {
                    read,
                    fetched: L2Fetched::TimedOut,
                }
            }
            L2Job::Get { read, key } => {
                let mut fetched = self.l2.get(fate, &key);
                if let Some(slot) = self.l2_slots.remove(&read.0)
                    && let Some(pool) = self.pool.as_mut()
                    && !matches!(
                        fetched,
                        L2Fetched::Absent | L2Fetched::TimedOut | L2Fetched::Failed
                    )
                {
                    // The payload was placed in the slot, good or not.
                    pool.write_started(slot, self.boot);
                    pool.write_done(slot, None);
                }
                let asker = self.l2_reads.remove(&read.0);
                if let Some(id) = self.l2_delivering.remove(&read.0) {
                    checker.copy_done(id);
                    if let L2Fetched::Hit { nbytes } = fetched {
                        // The simulated buffers are as large as any chunk.
                        fetched = L2Fetched::Delivered { nbytes };
                    }
                }
                match fetched {
                    L2Fetched::Hit { .. } | L2Fetched::Delivered { .. } => self.stats.l2_hits += 1,
                    L2Fetched::Corrupt => {
                        self.stats.l2_corrupt += 1;
                        if let Some(asker) = asker {
                            checker.l2_corrupt_read(asker, key);
                        }
                    }
                    L2Fetched::Absent => {}
                    L2Fetched::TimedOut | L2Fetched::Failed => self.stats.l2_failed += 1,
                }
                NodeInput::L2Got { read, fetched }
            }
            L2Job::Exists { read, keys } => {
                self.l2_checks.remove(&read.0);
                let presence = self.l2.exists(fate, &keys);
                if !matches!(presence, L2Presence::Present(_)) {
                    self.stats.l2_failed += 1;
                }
                NodeInput::L2Existed { read, presence }
            }
        })
    }

    /// What the node's replies say about L2: a read L2 found corrupt must not be answered
    /// with data.
    fn l2_replies(&mut self, outputs: &[Output], checker: &mut Checker) {
        for output in outputs {
            let Output::Reply {
                conn,
                request_id,
                result,
                ..
            } = output
            else {
                continue;
            };
            let miss = matches!(
                result,
                Ok(Answer::Length(None) | Answer::Pinned(None) | Answer::Reserved(None))
            );
            let data = result.is_ok() && !miss;
            checker.answered((conn.0, *request_id), data);
        }
    }

    /// Entries the reference model holds and the node no longer does: reaps (the
    /// registry's counter says how many), or a shutdown's unregistering.
    fn reconcile(
        &mut self,
        reaped_before: u64,
        freed: &[(Key, FreeCause)],
        checker: &mut Checker,
    ) -> u64 {
        let Some(node) = self.node.as_ref() else {
            return 0;
        };
        let reaped = node.liveness_status().reaped_total - reaped_before;
        if reaped == 0 && checker.shadow_len() == node.tracked() {
            return 0;
        }
        let shutting_down = node.is_shutting_down();
        let gone: Vec<Key> = checker
            .shadow_keys()
            .into_iter()
            .filter(|&(instance, module)| node.entry(instance, module).is_none())
            .collect();
        let cause_of = |key: Key| {
            freed
                .iter()
                .find(|(freed_key, _)| *freed_key == key)
                .map(|(_, cause)| *cause)
        };
        let identified = gone
            .iter()
            .filter(|&&key| matches!(cause_of(key), Some(FreeCause::Reaped { .. })))
            .count() as u64;
        let mut unassigned = reaped.saturating_sub(identified);
        let mut list = Vec::with_capacity(gone.len());
        for key in gone {
            let entry = match cause_of(key) {
                Some(FreeCause::Reaped { silence, proven }) => {
                    (key, Some((nanos_of(silence), proven)), false)
                }
                Some(_) if shutting_down => (key, None, true),
                _ if unassigned > 0 => {
                    unassigned -= 1;
                    (key, None, false)
                }
                _ => (key, None, shutting_down),
            };
            list.push(entry);
        }
        checker.reaped(reaped, list);
        reaped
    }

    /// The node's answer, judged, then sent as the wire carries it (the shell encodes
    /// it).
    fn answer(
        &mut self,
        conn: ConnId,
        request_id: u64,
        result: Result<Answer, ProtocolError>,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        if !self.tenant_reads.is_empty()
            && let Some((name, read)) = self.tenant_reads.remove(&(conn.0, request_id))
        {
            // Reads answered: never with a chunk another tenant stored (row 33).
            self.stats.foreign_misses += checker.read_answered(name, &read, &result);
        }
        let result = result.map(|answer| answer.to_value());
        self.reply(conn, request_id, result, out);
    }

    fn reply(
        &mut self,
        conn: ConnId,
        request_id: u64,
        result: Result<Value, ProtocolError>,
        out: &mut ServerOut,
    ) {
        let Some(&(slot, incarnation, tcp)) = self.peers.get(&conn) else {
            return; // the connection is gone: nobody to answer
        };
        if let Err(error) = &result {
            match error.code {
                ErrorCode::BadArgs => self.stats.bad_args += 1,
                ErrorCode::Forbidden if tcp => self.stats.tcp_forbidden += 1,
                _ => {}
            }
        }
        if request_id >= HANDSHAKE_ID && result.is_ok() {
            return; // the client reads only a refusal of its connection's attach
        }
        out.replies.push(ReplyEnvelope {
            slot,
            incarnation,
            boot: self.boot,
            request_id,
            result,
        });
    }
}
