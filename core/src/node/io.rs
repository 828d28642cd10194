//! What crosses the node's boundary: [`Input`] (what arrived), [`Output`] (what the
//! node asks of its shell) and [`Note`] (what it reports for logs and metrics), and the
//! ids and kinds they carry.

use crate::node::{
    AdoptionView, BlendId, L2Delivery, L2Fetched, L2Presence, L2ReadId, L2WriteId, SlotId,
};
use crate::protocol::{Answer, BufferSpec, Op, OpKind, ProtocolError, RopeSpec};
use crate::time::Instant;
use crate::{FreeCause, InstanceId, Module};
use std::time::Duration;
/// A connection, named by the shell (its token).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// A process the shell can watch for its exit, named by the shell.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessKey(pub u64);

/// A context the node asked the shell to build; the shell keeps the real one (its
/// mappings) under this id until the node says `Job::Free`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

/// One copy between a registered buffer and an L1 slot.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyId(pub u64);

/// One free of a context.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FreeId(pub u64);

/// How a connection reached the server.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// The Unix socket: fds travel (`SCM_RIGHTS`), the peer's uid is known.
    Unix,
    /// TCP: no fds, no uid.
    Tcp,
}

/// How the death of an instance's process will be noticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeathNotice {
    /// A pidfd the worker sent of itself (`hello`'s `pidfd_index`).
    PidfdFromPeer,
    /// A pidfd the server opened on the pid `SO_PEERCRED` reported.
    PidfdByPid,
    /// No pidfd: only the heartbeat rules (reap timeout, registration grace).
    TimeoutOnly,
}

impl DeathNotice {
    /// Every kind, in the order status and metrics list them.
    pub const ALL: [DeathNotice; 3] = [
        DeathNotice::PidfdFromPeer,
        DeathNotice::PidfdByPid,
        DeathNotice::TimeoutOnly,
    ];

    /// The label in `/status` and `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            DeathNotice::PidfdFromPeer => "pidfd_from_peer",
            DeathNotice::PidfdByPid => "pidfd_by_pid",
            DeathNotice::TimeoutOnly => "timeout_only",
        }
    }
}

/// What a finished build gives the node: what it must know of the context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Built {
    /// Server-driven buffers, by index: their lengths, for bounds checks.
    ServerDriven {
        /// Each registered buffer's length in bytes.
        buffer_lens: Vec<u64>,
    },
    /// An engine-driven context (its strategy lives on the node).
    EngineDriven,
}

/// Which way a copy goes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From a registered buffer into an L1 slot (`store`).
    ToL1,
    /// From an L1 slot into a registered buffer (`retrieve`).
    FromL1,
}
/// Something that arrived: a request, a connection, a completion, a signal.
#[derive(Debug)]
pub enum Input {
    /// A worker connected.
    Connected {
        /// The connection.
        conn: ConnId,
        /// The peer's uid (`SO_PEERCRED`); None over TCP.
        uid: Option<u32>,
        /// How it connected.
        transport: Transport,
        /// The peer's process, when the shell could open a pidfd of it.
        process: Option<(ProcessKey, DeathNotice)>,
    },
    /// The peer sent a pidfd of itself (`hello`), which the shell checked: it is now
    /// the connection's process. Comes before that `hello`'s `Request`.
    PeerProcess {
        /// The connection.
        conn: ConnId,
        /// The process.
        process: ProcessKey,
        /// How its death will be noticed.
        notice: DeathNotice,
    },
    /// A decoded request.
    Request {
        /// The connection.
        conn: ConnId,
        /// The request's id, echoed in its reply.
        request_id: u64,
        /// The op.
        op: Op,
        /// How many fds came with the frame (the shell keeps them, keyed by
        /// `(conn, request_id)`, until `Job::Build` takes them or the turn ends).
        fds: usize,
    },
    /// The connection closed (never a proof of death).
    Disconnected {
        /// The connection.
        conn: ConnId,
    },
    /// A build asked by `Job::Build` finished.
    BuildDone {
        /// The context.
        context: ContextId,
        /// What the node must know of it, or why it failed.
        result: Result<Built, ProtocolError>,
    },
    /// A copy asked by `Job::Copy` finished: the bytes copied, or why it failed.
    CopyDone {
        /// The copy.
        copy: CopyId,
        /// Bytes copied.
        result: Result<u64, ProtocolError>,
    },
    /// Rope tables asked by `Job::Blend` are computed (the shell holds them), or could
    /// not be.
    BlendDone {
        /// The computation.
        blend: BlendId,
        /// Ok, or why not.
        result: Result<(), String>,
    },
    /// A free asked by `Job::Free` returned.
    FreeDone {
        /// The free.
        free: FreeId,
    },
    /// The kernel proved that a watched process exited (its pidfd became readable).
    ProcessExited {
        /// The process.
        process: ProcessKey,
    },
    /// SIGTERM/SIGINT: answer what is in flight, free everything, stop.
    Shutdown,
    /// An `L2Request::Write` ended; its slot may be evicted again. Exactly one per `L2Request::Write`.
    L2Written {
        /// The write.
        write: L2WriteId,
        /// How it ended.
        outcome: crate::l2::WriteOutcome,
    },
    /// An `L2Request::Get` ended (a hit's bytes are in its slot, and in the buffer when
    /// `Delivered`). Exactly one per `L2Request::Get`, even after its deadline or an `L2Request::Cancel`.
    L2Got {
        /// The read.
        read: L2ReadId,
        /// How it ended.
        fetched: L2Fetched,
    },
    /// An `L2Request::Exists` ended. Exactly one per `L2Request::Exists`.
    L2Existed {
        /// The check.
        read: L2ReadId,
        /// How it ended.
        presence: L2Presence,
    },
    /// A [`Job::Seal`] ended (written, or the value could not be sealed).
    Sealed {
        /// The slot, pinned while it was sealed.
        slot: SlotId,
        /// Whether the seal was written. `false`: the value could not be sealed (its key
        /// is longer than a seal holds); it is served, but not adopted after a restart.
        written: bool,
    },
    /// A [`Job::Scan`] ended: one finding per slot, from `first` on.
    Scanned {
        /// The first slot scanned.
        first: SlotId,
        /// What each slot's seal said.
        found: Vec<Scanned>,
    },
}

/// What a restarted server found in one slot of its pool file (row 71).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scanned {
    /// Never sealed: nothing to adopt.
    Blank,
    /// Its seal verified: `len` bytes of `key` (a node key).
    Sealed {
        /// The node key (the tenant's name, then the worker's key).
        key: Vec<u8>,
        /// The value's length.
        len: u64,
    },
    /// Its seal did not verify or was malformed: dropped.
    Unsealed(crate::seal::Unsealed),
}

/// Something the node asks of its shell, in groups: replies, jobs to run off the loop,
/// blend tables to keep or drop, actions on peers (watches, how to read, closes), L2
/// I/O, notes, and the end. Not `#[non_exhaustive]`: a shell matches every output, so
/// none is ever ignored silently.
#[derive(Debug, PartialEq)]
pub enum Output {
    /// Send a reply.
    Reply {
        /// The connection (gone? then nobody to answer).
        conn: ConnId,
        /// The request's id.
        request_id: u64,
        /// The op answered, for metrics.
        op: OpKind,
        /// The answer (its shape is the op's, `OpKind::reply_shape`), or the error.
        result: Result<Answer, ProtocolError>,
        /// Send the L1 pool's memfd with it (`SCM_RIGHTS`; engine-driven registrations).
        pool_fd: bool,
    },
    /// Answer a `status` request with the node's [`NodeStatus`] and the shell's own
    /// figures.
    ReplyStatus {
        /// The connection.
        conn: ConnId,
        /// The request's id.
        request_id: u64,
    },
    /// Work to run off the loop; each reports back with its input.
    Job(Job),
    /// The shell's hold on computed rope tables.
    Blend(BlendChange),
    /// Something to do with a peer's connection or process.
    Peer(PeerAction),
    /// L2 I/O (only with L2 on).
    L2(L2Request),
    /// Something an operator reads: log it, count it.
    Note(Note),
    /// Events for a tenant's node-scoped stream ([`NodeConfig::kv_publish`]): send
    /// them as one batch, in order.
    Publish {
        /// The stream: its tenant's place in [`NodeConfig::kv_publish`].
        stream: usize,
        /// Its events, oldest first.
        events: Vec<crate::kv_publish::BlockEvent>,
    },
    /// The shutdown is complete: exit.
    Stopped {
        /// Contexts freed by the shutdown.
        contexts_freed: u64,
        /// Frees still running when the node gave up waiting.
        frees_unfinished: usize,
    },
}

/// Work to run off the loop ([`Output::Job`]).
#[derive(Debug, PartialEq)]
pub enum Job {
    /// Build a context off the loop, then report `BuildDone`.
    Build {
        /// The context's id.
        context: ContextId,
        /// Whose fds it uses: the stash of `(conn, request_id)`.
        conn: ConnId,
        /// The request that carried them.
        request_id: u64,
        /// The instance.
        instance: InstanceId,
        /// The module.
        module: Module,
        /// The buffers to map (server-driven; empty for engine-driven).
        buffers: Vec<BufferSpec>,
        /// The model's name.
        model_name: String,
    },
    /// Copy between a buffer of `context` and L1 `slot`, then report `CopyDone`.
    Copy {
        /// The copy.
        copy: CopyId,
        /// The context whose buffer it uses (never freed before the copy is done).
        context: ContextId,
        /// Which way.
        direction: Direction,
        /// The buffer's index in the context.
        buffer: usize,
        /// Where in the buffer.
        offset: u64,
        /// The slot.
        slot: SlotId,
        /// Bytes to copy.
        nbytes: u64,
        /// A copy into a worker's buffer starts no later than this (its worker stops
        /// waiting then: `hello`'s `wait_ms`); past it the shell reports the copy done
        /// with an error and copies nothing (row 60). None: no bound.
        not_after: Option<Instant>,
    },
    /// Compute rope tables off the loop and hold them under `blend`, then report
    /// `BlendDone`.
    Blend {
        /// The computation.
        blend: BlendId,
        /// For whom.
        instance: InstanceId,
        /// The parameters.
        spec: RopeSpec,
    },
    /// Free a context (close its mappings) off the loop, then report `FreeDone`.
    Free {
        /// The free.
        free: FreeId,
        /// The context.
        context: ContextId,
        /// Whose.
        instance: InstanceId,
        /// Which module.
        module: Module,
        /// Why.
        cause: FreeCause,
        /// The label for logs and metrics: the cause's, or `shutdown`.
        label: &'static str,
    },
    /// Seal the value committed in `slot` (a pool that outlives the process, row 71),
    /// then report `Sealed`; the slot stays pinned until then.
    Seal {
        /// The slot.
        slot: SlotId,
        /// The node key it holds.
        key: Vec<u8>,
        /// The value's length.
        len: u64,
    },
    /// Check the seals of `count` slots from `first` on (a restarted server adopting
    /// its pool, row 71), then report `Scanned`.
    Scan {
        /// The first slot.
        first: SlotId,
        /// How many.
        count: usize,
    },
}

/// The shell's hold on computed rope tables ([`Output::Blend`]).
#[derive(Debug, PartialEq)]
pub enum BlendChange {
    /// The tables of `blend` are now the instance's; drop any it held before.
    Keep {
        /// The computation.
        blend: BlendId,
        /// The instance.
        instance: InstanceId,
    },
    /// Drop the tables of `blend`: nobody wants them.
    Discard {
        /// The computation.
        blend: BlendId,
    },
    /// Drop the instance's tables: its last entry went.
    Drop {
        /// The instance.
        instance: InstanceId,
    },
}

/// Something to do with a peer's connection or process ([`Output::Peer`]).
#[derive(Debug, PartialEq)]
pub enum PeerAction {
    /// Watch this process's exit, with the pidfd of `conn`'s peer.
    Watch {
        /// The process.
        process: ProcessKey,
        /// The connection whose pidfd it is.
        conn: ConnId,
    },
    /// Stop watching this process.
    Unwatch {
        /// The process.
        process: ProcessKey,
    },
    /// `conn` promised to send no more fds (`hello` with `sends_fds: false`, over the
    /// Unix socket): have the kernel refuse fds on it and read it with plain `read(2)`
    /// from then on, cheaper than `recvmsg(2)`. Once per connection, before that
    /// `hello`'s reply. A shell that goes on with `recvmsg` is correct too.
    ReadWithoutFds {
        /// The connection.
        conn: ConnId,
    },
    /// Close this connection (then report `Disconnected`): a TCP peer that did not
    /// present a token within the limits' `unauthenticated_timeout` of connecting.
    Disconnect {
        /// The connection.
        conn: ConnId,
        /// Why, for the log.
        why: &'static str,
        /// Why, as a metric label: `unauthenticated` (no token proven in time, logged)
        /// or `stranger_share` (the oldest stranger made room for a new one, counted
        /// only: a flood would flood the log).
        reason: &'static str,
    },
}

/// L2 I/O ([`Output::L2`], only with L2 on).
#[derive(Debug, PartialEq)]
pub enum L2Request {
    /// Write the `nbytes` published at L1 `slot` to L2 under `key` (only with L2 on).
    /// The slot stays pinned (never evicted or rewritten) until `L2Written`.
    Write {
        /// The write.
        write: L2WriteId,
        /// The chunk's key.
        key: Vec<u8>,
        /// The slot holding its bytes.
        slot: SlotId,
        /// Bytes to write.
        nbytes: u64,
    },
    /// Read `key` from L2 (only with L2 on); place a hit's payload into the reserved
    /// `slot` (at most a slot's bytes), then report `L2Got`. With `deliver`, also copy
    /// the placed payload into that registered buffer when it fits there (report
    /// [`L2Fetched::Delivered`]), on the same thread, before reporting: a read-through
    /// then costs no copy hop of its own. The node counts such a read as a copy on its
    /// context (a free waits for its `L2Got`) and, at its deadline, asks the shell to
    /// give it up ([`L2Request::Cancel`]) instead of answering the miss itself.
    Get {
        /// The read.
        read: L2ReadId,
        /// The chunk's key.
        key: Vec<u8>,
        /// The slot reserved for it.
        slot: SlotId,
        /// Where the worker waits for the bytes, for a `retrieve` (or a batch item).
        deliver: Option<L2Delivery>,
    },
    /// Give up the delivering `L2Request::Get` `read`, past its deadline: answer its `L2Got` as
    /// [`L2Fetched::TimedOut`] at once and never touch the slot or the buffer, unless
    /// the hit is being placed already; then report that (`Delivered`) when it is. The
    /// node answers the request only when that `L2Got` comes, so no byte ever lands in
    /// a buffer after its request was answered.
    Cancel {
        /// The read.
        read: L2ReadId,
    },
    /// Count how many leading `keys` exist in L2 (pipelined; only with L2 on), then
    /// report `L2Existed`.
    Exists {
        /// The check.
        read: L2ReadId,
        /// The keys, in order.
        keys: Vec<Vec<u8>>,
    },
}

/// What the node reports for logs and metrics.
#[derive(Clone, Debug, PartialEq)]
pub enum Note {
    /// A context was built and is the instance's.
    ContextBuilt {
        /// The instance.
        instance: InstanceId,
        /// The module.
        module: Module,
    },
    /// A build failed.
    BuildFailed {
        /// The instance.
        instance: InstanceId,
        /// Why.
        error: ProtocolError,
    },
    /// A registration was refused: its memfd buffers pass a cap on mapped bytes.
    OverMappedCap {
        /// The instance.
        instance: InstanceId,
        /// Which cap, by how much.
        over: super::mapped::OverCap,
    },
    /// The node saw no input for `gap`: the server itself was stalled.
    Stall {
        /// How long.
        gap: Duration,
    },
    /// Every slot of a restarted server's pool file was scanned (row 71).
    PoolAdopted(AdoptionView),
    /// The kernel proved that an instance's process exited.
    ProcessExited {
        /// The instance.
        instance: InstanceId,
        /// Whether it held any entry.
        held: bool,
    },
    /// An UNREGISTER named an instance not registered here.
    UnregisterUnknown {
        /// The instance.
        instance: InstanceId,
        /// The module.
        module: Module,
    },
    /// An engine-driven context went: unpublished reservations were discarded and
    /// pins released.
    EngineReleased {
        /// The instance.
        instance: InstanceId,
        /// Why it went.
        label: &'static str,
        /// Reservations discarded unpublished.
        reservations_discarded: usize,
        /// Pins released.
        pins_released: u64,
    },
    /// A free has run longer than the watchdog.
    FreeHung {
        /// The instance.
        instance: InstanceId,
        /// The module.
        module: Module,
        /// The watchdog period.
        watchdog: Duration,
    },
    /// A free reported hung finished at last.
    FreeFinishedLate {
        /// The instance.
        instance: InstanceId,
        /// The module.
        module: Module,
        /// How long it ran.
        after: Duration,
    },
    /// An instance now holds rope tables.
    BlendHeld {
        /// The instance.
        instance: InstanceId,
        /// Bytes.
        bytes: u64,
    },
    /// An instance's rope tables were dropped.
    BlendDropped {
        /// The instance.
        instance: InstanceId,
        /// Bytes.
        bytes: u64,
    },
    /// A shutdown began.
    ShutdownStarted,
    /// The L2 breaker changed state (log the changes to and from `down` once each).
    L2StateChanged {
        /// The state before.
        from: crate::l2::L2State,
        /// The state now.
        to: crate::l2::L2State,
    },
}
