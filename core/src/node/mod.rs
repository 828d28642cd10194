//! The server's request logic as one sans-IO state machine: the node.
//!
//! Both shells drive it unchanged — the mio server with sockets, memfds, CUDA and
//! pidfds, the simulator with simulated ones. `Node` holds its components, each the
//! owner of its state (docs/design.md's component map): the liveness registry; the
//! registry of entries, builds, process watches and frees (`registry.rs`);
//! connections (`conns.rs`); the doors: who is who ([`trust`]), [`admission`] and
//! [`mapped`] bytes (`doors.rs`); the L1 pool ([`l1`], its adoption: `pool.rs`); the
//! work on the shell's pool: contexts and their copies, open batches, the queue
//! ([`jobs`]) (`work.rs`); [`blend`]; the L2 tier ([`l2`]); the KV [`events`] log;
//! the shutdown sequence; counters; and the outbox (`outbox.rs`). Requests
//! (`ops.rs`), transfers (`transfer.rs`, [`engine`]) and completions (`outcomes.rs`)
//! are the node's routing between them: `Node` hands each input to its owners and
//! gathers their outputs and deadlines.
//!
//! Shape (like quinn-proto's `Endpoint` or str0m's `Rtc`): time is passed in on every
//! call; [`Node::handle_input`] for everything that arrives, [`Node::handle_timeout`]
//! when [`Node::poll_timeout`] says, and [`Node::poll_output`] drained until empty
//! after each. Nothing here reads a clock, spawns, blocks or touches an fd: fds,
//! mappings, pidfds and rope tables stay in the shell, named by the ids below.
//!
//! The shell's loop, the rule of the core's crate docs made whole:
//!
//! 1. hand every input that has arrived to `handle_input` (requests before time);
//! 2. then `handle_timeout(now)`;
//! 3. drain `poll_output`, carrying out each output;
//! 4. sleep until `poll_timeout`, or the next input.

pub mod admission;
mod adopt;
mod batches;
pub mod blend;
mod builds;
mod conns;
mod contexts;
mod counters;
mod doors;
pub mod engine;
pub mod events;
mod frees;
mod io;
pub mod jobs;
pub mod l1;
pub mod l2;
pub mod mapped;
mod ops;
mod outbox;
mod outcomes;
mod pool;
mod register;
mod registry;
mod report;
mod shutdown;
mod transfer;
pub mod trust;
mod view;
mod watches;
mod work;

use crate::id::InstanceId;
use crate::liveness::{BuildTicket, Liveness, Status};
use crate::module::Module;
use crate::protocol::{Answer, OpKind, ProtocolError};
use crate::time::Instant;
use crate::{Config, ConfigError};

/// Why a node could not be made: its liveness settings, its L2 breaker's limits, or its
/// tenants were rejected (each component's own error, named here).
#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    /// The liveness settings.
    #[error(transparent)]
    Liveness(#[from] ConfigError),
    /// The L2 breaker's limits.
    #[error(transparent)]
    L2Health(#[from] crate::l2::L2HealthConfigError),
    /// The tenants.
    #[error("invalid tenants: {0}")]
    Trust(#[from] trust::TrustConfigError),
    /// A node-scoped stream names no tenant of this node.
    #[error(
        "--kv-events {0}: no such tenant, or named twice; name each tenant once: a --tenant, \
         or uid-<uid> for a uid's own keys"
    )]
    KvEventsTenant(String),
}
pub use adopt::AdoptionView;
use blend::{BlendBook, BlendId};
use builds::PendingBuild;
use engine::TransferStrategy;
pub use io::{
    BlendChange, Built, ConnId, ContextId, CopyId, DeathNotice, Direction, FreeId, Input, Job,
    L2Request, Note, Output, PeerAction, ProcessKey, Scanned, Transport,
};
use l1::{SlotId, SlotTable};
use l2::{L2Delivery, L2Fetched, L2NodeConfig, L2Presence, L2ReadId, L2Status, L2Tier, L2WriteId};
pub use report::{L2Link, ShellFigures};
use std::collections::{BTreeMap, BTreeSet};
use trust::{Peer, TenantId, TenantView, Trust, TrustConfig};
pub use view::{InstanceView, NodeStatus, TenantStatus};

/// The node's maps are keyed by ids it or the shell hands out: a fast hash suffices.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::time::Duration;

/// Requests of one connection that may run (build, copy, blend) at once.
pub const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// Items of one connection's running requests (a batch counts each item, any other
/// request one): two whole batches (row 68).
pub const MAX_ITEMS_IN_FLIGHT_PER_CONNECTION: usize = 2 * crate::protocol::MAX_BATCH_ITEMS;
/// Buffers one registration may name.
pub const MAX_BUFFERS_PER_REGISTRATION: usize = 1024;
/// How long a shutdown waits for builds, copies and blends in flight.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(10);

/// What the shell's environment offers that the node must know to judge requests.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The liveness configuration.
    pub liveness: Config,
    /// The floor on the reap timeout ([`crate::REAP_TIMEOUT_FLOOR`], or zero in tests).
    pub reap_timeout_floor: Duration,
    /// Slots in the L1 pool.
    pub num_slots: usize,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// The server's own uid: its tenant may register engine-driven by default (it
    /// acts on no instance it has not attached, like everyone else).
    pub server_uid: u32,
    /// The operator's tenants and TCP tokens.
    pub trust: TrustConfig,
    /// Random per server start, told to every `hello`.
    pub boot_id: u64,
    /// The server's name and version, told to every `hello`.
    pub server_name: String,
    /// A free running longer than this is reported (once).
    pub free_watchdog: Duration,
    /// How long a shutdown waits for work in flight.
    pub shutdown_drain: Duration,
    /// CUDA devices on this host, or why CUDA is unavailable.
    pub cuda_devices: Result<u64, String>,
    /// The L2 tier (`--l2`), or None: no L2 output is ever produced.
    pub l2: Option<L2NodeConfig>,
    /// Connections held at once, all together and per uid ([`Node::admits`]).
    pub connections: admission::ConnectionLimits,
    /// Bytes of peers' memfds the server maps, in all, per tenant, per instance.
    pub mapped: mapped::MappedLimits,
    /// Builds, copies and blends handed to the shell's pool at once; the rest wait in
    /// the node, in turns by tenant ([`jobs`]). The server's is twice `--pool-threads`;
    /// [`jobs::UNBOUNDED`] hands every job out at once.
    pub pool_window: usize,
    /// The tenants whose blocks the server announces itself, one stream each, in
    /// order (`--kv-events TENANT=ENDPOINT`; [`Output::Publish`]'s `stream`).
    pub kv_publish: Vec<String>,
}

/// Where a reply goes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct ReplyTo {
    conn: ConnId,
    request_id: u64,
    op: OpKind,
    /// For a request that writes into the worker's memory (`retrieve`,
    /// `retrieve_batch`) on a connection whose `hello` said `wait_ms`: when its worker
    /// stops waiting. No copy into the worker's buffer starts past it (row 60).
    deadline: Option<Instant>,
}

/// What the node knows of an entry besides liveness.
struct EntryDetails {
    owner_uid: Option<u32>,
    tenant: TenantId,
    registered_at: Instant,
    model_name: String,
}

/// The server's request logic. See the module docs.
pub struct Node {
    config: NodeConfig,
    liveness: Liveness<ContextId>,
    /// Entry details, builds in flight, process watches and frees.
    registry: registry::Registry,
    /// The connections and the requests they have running.
    conns: conns::Conns,
    /// Who is who, connection admission, mapped bytes.
    doors: doors::Doors,
    /// The L1 slot table and the adoption of its pool file.
    l1: pool::L1Pool,
    /// Contexts and the copies against them, open batches, the pool's queue.
    work: work::PoolWork,
    blend: BlendBook,
    l2: Option<L2Tier>,
    /// What entered and left L1 and L2, per tenant (`kv_events`).
    events: events::KvEventLog,
    /// The shutdown sequence, once begun.
    shutdown: shutdown::Shutdown,
    /// What `status` counts of pings, builds and refused transfers.
    counters: counters::Counters,
    /// Outputs, ids, and the `now` of the call being handled.
    out: outbox::NodeOutbox,
    #[cfg(feature = "planted-bugs")]
    plants: Plants,
}

/// The bug planted, and what planted bug `PingWaitsForL2` holds back (test-only).
#[cfg(feature = "planted-bugs")]
#[derive(Default)]
struct Plants {
    bug: Option<PlantedBug>,
    /// Planted bug `PingWaitsForL2` only: ping answers held until `handle_timeout`.
    held_pings: Vec<(ReplyTo, Answer)>,
}

/// Bugs planted in the node on purpose, so that the simulator's checker is shown to
/// catch bugs in the real node. Only a build with the test-only feature `planted-bugs`
/// can plant one ([`Node::plant`]); without it every check below is `false`.
#[doc(hidden)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PlantedBug {
    /// A ping is answered `true` but never reaches the registry.
    IgnorePings,
    /// `DropBlendState` is ignored: rope tables outlive their instance.
    KeepBlendState,
    /// A REGISTER that finds its entry building is answered `refreshed` at once.
    RefreshBeforeBuild,
    /// A free is started while copies still use the context.
    FreeDuringCopy,
    /// Frees are never started: contexts leak.
    LeakOnFree,
    /// `handle_timeout` is never passed to the registry: nothing is reaped.
    SkipReap,
    /// A process exit frees nothing.
    IgnoreProcessExit,
    /// An engine-driven free keeps its reservations and pins.
    KeepReservations,
    /// A build's context is never handed to the registry (it leaks and the entry stays
    /// building).
    DropBuiltContext,
    /// Shutdown stops without freeing anything.
    ShutdownLeaks,
    /// Two contexts are freed for one entry.
    DoubleFree,
    /// `prepare_store` writes the reserved (unpublished) slot to L2 (row 29).
    WriteUnpublished,
    /// With L2 on, a ping's answer waits for the next `handle_timeout` (row 27).
    PingWaitsForL2,
    /// An L2 value answered `Corrupt` is promoted and served as a hit (row 28).
    ServeCorrupt,
    /// A request naming an instance is served without the connection having attached
    /// it: any peer that knows an id acts on it (rows 30-31).
    TrustAnyConnection,
    /// Keys are not scoped to the caller's tenant: one tenant reads another's chunks
    /// (row 33).
    SharedKeyspace,
    /// A restarted server adopts a sealed value into a slot a store took before its
    /// seal was checked (row 71): the slot's bytes are the store's, its key the old
    /// value's.
    AdoptTaken,
}

impl Node {
    /// A node started at `now`.
    pub fn new(config: NodeConfig, now: Instant) -> Result<Node, NodeConfigError> {
        let liveness =
            Liveness::new_with_floor(config.liveness.clone(), now, config.reap_timeout_floor)?;
        let l2 = config
            .l2
            .clone()
            .map(|l2| L2Tier::new(l2, config.num_slots))
            .transpose()?;
        let trust = Trust::new(&config.trust, config.server_uid)?;
        for (at, name) in config.kv_publish.iter().enumerate() {
            if !trust.names_tenant(name) || config.kv_publish[..at].contains(name) {
                return Err(NodeConfigError::KvEventsTenant(name.clone()));
            }
        }
        let pool_window = config.pool_window;
        let shutdown = shutdown::Shutdown::new(config.shutdown_drain, config.free_watchdog);
        let mut l1 = SlotTable::new(config.num_slots, config.slot_bytes);
        for tenant in trust.tenants() {
            let quota = tenant
                .quota_percent
                .map(|percent| (config.num_slots * percent as usize / 100).max(1));
            l1.set_quota(tenant.tenant, quota);
        }
        Ok(Node {
            l1: pool::L1Pool {
                slots: l1,
                adoption: None,
            },
            l2,
            doors: doors::Doors {
                trust,
                admission: admission::Admission::new(config.connections),
                mapped: mapped::Mapped::new(config.mapped),
            },
            events: events::KvEventLog::new(config.boot_id, &config.kv_publish),
            config,
            liveness,
            registry: registry::Registry::default(),
            conns: conns::Conns::default(),
            work: work::PoolWork::new(pool_window),
            blend: BlendBook::default(),
            shutdown,
            out: outbox::NodeOutbox::new(now),
            counters: counters::Counters::default(),
            #[cfg(feature = "planted-bugs")]
            plants: Plants::default(),
        })
    }

    /// Plants a bug (test-only).
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&mut self, bug: PlantedBug) {
        self.plants.bug = Some(bug);
    }

    #[inline(always)]
    fn planted(&self, bug: PlantedBug) -> bool {
        #[cfg(feature = "planted-bugs")]
        {
            self.plants.bug == Some(bug)
        }
        #[cfg(not(feature = "planted-bugs"))]
        {
            let _ = bug;
            false
        }
    }

    /// Whether a peer of `uid` (None: TCP) may open one more connection now: the
    /// shell asks before it accepts one into the node ([`admission`]).
    pub fn admits(&self, uid: Option<u32>) -> Result<(), admission::Refused> {
        self.doors.admits(uid)
    }

    /// The configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// Something arrived at `now`.
    pub fn handle_input(&mut self, now: Instant, input: Input) {
        self.out.now = now;
        match input {
            Input::Connected {
                conn,
                uid,
                transport,
                process,
            } => self.connected(now, conn, uid, transport, process),
            Input::PeerProcess {
                conn,
                process,
                notice,
            } => self.peer_process(conn, process, notice),
            Input::Request {
                conn,
                request_id,
                op,
                fds,
            } => self.request(now, conn, request_id, op, fds),
            Input::Disconnected { conn } => self.disconnected(conn),
            Input::BuildDone { context, result } => {
                self.job_reported();
                self.build_done(now, context, result)
            }
            Input::CopyDone { copy, result } => {
                self.job_reported();
                self.copy_done(copy, result)
            }
            Input::BlendDone { blend, result } => {
                self.job_reported();
                self.blend_done(blend, result)
            }
            Input::FreeDone { free } => self.free_done(now, free),
            Input::ProcessExited { process } => self.process_exited(now, process),
            Input::Shutdown => {
                if self.shutdown.begin(now) {
                    self.note(Note::ShutdownStarted);
                }
            }
            Input::L2Written { write, outcome } => self.l2_written(now, write, outcome),
            Input::L2Got { read, fetched } => self.l2_got(now, read, fetched),
            Input::L2Existed { read, presence } => self.l2_existed(now, read, presence),
            Input::Sealed { slot, written } => self.sealed(slot, written),
            Input::Scanned { first, found } => self.scanned(now, first, found),
        }
        self.drain_effects();
        self.seal_committed();
        for (key, stored) in self.l1.slots.take_changes() {
            self.events
                .record(&key, stored, crate::protocol::KvTier::L1);
        }
        self.step_shutdown(now);
        self.publish();
    }

    /// What the tenants' streams announce after this call ([`Output::Publish`]).
    fn publish(&mut self) {
        for (stream, events) in self.events.take_published() {
            self.out.queue.push_back(Output::Publish { stream, events });
        }
    }

    /// Time passed: reaps what is due, reports hung frees, advances a shutdown.
    /// Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.out.now = now;
        #[cfg(feature = "planted-bugs")]
        for (to, answer) in std::mem::take(&mut self.plants.held_pings) {
            self.reply(to, Ok(answer));
        }
        if !self.planted(PlantedBug::SkipReap) {
            self.liveness.handle_timeout(now);
        }
        self.drain_effects();
        self.check_free_watchdog(now);
        self.l2_timeout(now);
        self.cut_unauthenticated(now);
        self.step_shutdown(now);
        self.publish();
    }

    /// When `handle_timeout` must next be called (None: only after an input).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.shutdown.stopped() {
            return None;
        }
        let mut at = self.shutdown.deadline();
        let mut earliest = |candidate: Instant| {
            at = Some(at.map_or(candidate, |at: Instant| at.min(candidate)));
        };
        if let Some(reap) = self.liveness.poll_timeout() {
            earliest(reap);
        }
        if let Some(free) = self.registry.frees.next_deadline(self.config.free_watchdog) {
            earliest(free);
        }
        if let Some(l2) = self.l2.as_ref().and_then(L2Tier::poll_timeout) {
            earliest(l2);
        }
        if let Some(token) = self.doors.admission.next_deadline() {
            earliest(token);
        }
        at
    }

    /// The next thing to carry out, oldest first; drain until None after every call.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.queue.pop_front()
    }

    /// Whether the shutdown is complete.
    pub fn is_stopped(&self) -> bool {
        self.shutdown.stopped()
    }

    /// Whether a shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.begun()
    }

    /// Read-only view of one entry's liveness (tests, the simulator).
    pub fn entry(&self, instance: InstanceId, module: Module) -> Option<crate::EntryView> {
        self.liveness.entry(instance, module)
    }

    /// The liveness registry's counters (no scan: for the simulator's per-step checks).
    pub fn liveness_status(&self) -> Status {
        self.liveness.status()
    }

    /// Entries tracked.
    pub fn tracked(&self) -> usize {
        self.liveness.status().tracked_entries
    }

    /// How many leading keys L1 holds (the `lookup` op), for tests.
    pub fn l1_lookup(&self, keys: &[Vec<u8>]) -> u64 {
        self.l1.slots.lookup_prefix(keys)
    }

    /// The node key L1 `slot` holds committed, if any, for the simulator's invariants.
    pub fn l1_committed_key(&self, slot: SlotId) -> Option<&[u8]> {
        self.l1.slots.committed_key(slot)
    }

    /// Slots held by reservations and pins, for the simulator's invariants.
    pub fn l1_occupancy(&self) -> l1::Occupancy {
        self.l1.slots.occupancy()
    }

    fn note(&mut self, note: Note) {
        self.out.queue.push_back(Output::Note(note));
    }

    fn reply(&mut self, to: ReplyTo, result: Result<Answer, ProtocolError>) {
        self.reply_with(to, result, false);
    }

    /// Every reply leaves here: its shape is the op table's (`OpKind::reply_shape`).
    fn reply_with(&mut self, to: ReplyTo, result: Result<Answer, ProtocolError>, pool_fd: bool) {
        debug_assert!(
            result
                .as_ref()
                .map_or(true, |answer| answer.shape() == to.op.reply_shape()),
            "{} answered {result:?}",
            to.op.name()
        );
        self.out.queue.push_back(Output::Reply {
            conn: to.conn,
            request_id: to.request_id,
            op: to.op,
            result,
            pool_fd,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{BufferSpec, Op};

    fn node() -> Node {
        let config = NodeConfig {
            liveness: Config::default(),
            reap_timeout_floor: Duration::ZERO,
            num_slots: 4,
            slot_bytes: 64,
            server_uid: 1000,
            trust: TrustConfig::default(),
            boot_id: 1,
            server_name: "test".into(),
            free_watchdog: Duration::from_secs(10),
            shutdown_drain: SHUTDOWN_DRAIN,
            cuda_devices: Err("none".into()),
            l2: None,
            connections: crate::node::admission::ConnectionLimits::unbounded(),
            mapped: crate::node::mapped::MappedLimits::unbounded(),
            pool_window: crate::node::jobs::UNBOUNDED,
            kv_publish: Vec::new(),
        };
        Node::new(config, Instant::ZERO).unwrap()
    }

    #[test]
    fn in_flight_counts_a_connections_running_requests_until_they_are_answered() {
        let mut node = node();
        let (conn, other) = (ConnId(1), ConnId(2));
        for conn in [conn, other] {
            node.handle_input(
                Instant::ZERO,
                Input::Connected {
                    conn,
                    uid: Some(1000),
                    transport: Transport::Unix,
                    process: None,
                },
            );
        }
        let instance = InstanceId::new(7).unwrap();
        node.handle_input(
            Instant::ZERO,
            Input::Request {
                conn,
                request_id: 0,
                op: Op::Attach {
                    instance,
                    secret: vec![1; 32],
                },
                fds: 0,
            },
        );
        assert!(matches!(
            node.poll_output(),
            Some(Output::Reply { result: Ok(_), .. })
        ));
        node.handle_input(
            Instant::ZERO,
            Input::Request {
                conn,
                request_id: 1,
                op: Op::RegisterEngineDriven {
                    instance,
                    model_name: "m".into(),
                    world_size: 1,
                },
                fds: 0,
            },
        );
        let Some(Output::Job(Job::Build { context, .. })) = node.poll_output() else {
            panic!("a REGISTER starts a build");
        };
        assert_eq!(node.in_flight(conn), 1);
        assert_eq!(node.in_flight(other), 0);
        node.handle_input(
            Instant::ZERO,
            Input::BuildDone {
                context,
                result: Ok(Built::EngineDriven),
            },
        );
        assert_eq!(node.in_flight(conn), 0, "answered: nothing runs");
        node.handle_input(Instant::ZERO, Input::Disconnected { conn });
        assert_eq!(
            node.in_flight(conn),
            0,
            "an unknown connection runs nothing"
        );
    }

    /// A `cuda_vmm` buffer travels as an fd and lives on a device: it is refused when the
    /// frame carried no fd for it or names a device the host lacks, answered
    /// `unavailable` on a host without CUDA, and built otherwise (the control).
    #[test]
    fn a_cuda_vmm_buffer_needs_its_fd_and_a_device_of_this_host() {
        let register = |cuda_devices: Result<u64, String>, device: u64, fds: usize| {
            let mut node = node();
            node.config.cuda_devices = cuda_devices;
            let conn = ConnId(1);
            node.handle_input(
                Instant::ZERO,
                Input::Connected {
                    conn,
                    uid: Some(1000),
                    transport: Transport::Unix,
                    process: None,
                },
            );
            let instance = InstanceId::new(9).unwrap();
            let attach = Op::Attach {
                instance,
                secret: vec![1; 32],
            };
            let register = Op::RegisterKvCache {
                instance,
                buffers: vec![BufferSpec::CudaVmm {
                    fd_index: 0,
                    device,
                    allocation_bytes: 2 << 20,
                    offset: 0,
                    nbytes: 4096,
                }],
                model_name: "m".into(),
                world_size: 1,
            };
            for (request_id, op, fds) in [(0, attach, 0), (1, register, fds)] {
                node.handle_input(
                    Instant::ZERO,
                    Input::Request {
                        conn,
                        request_id,
                        op,
                        fds,
                    },
                );
            }
            let outputs: Vec<Output> = std::iter::from_fn(|| node.poll_output()).collect();
            outputs
                .into_iter()
                .find_map(|output| match output {
                    Output::Job(Job::Build { buffers, .. }) => Some(Ok(buffers)),
                    Output::Reply {
                        request_id: 1,
                        result: Err(error),
                        ..
                    } => Some(Err(error)),
                    _ => None,
                })
                .expect("the register is answered or built")
        };
        let built = register(Ok(1), 0, 1).expect("the control builds");
        assert_eq!(built[0].fd_index(), Some(0));
        assert_eq!(built[0].cuda_device(), Some(0));
        let no_fd = register(Ok(1), 0, 0).expect_err("no fd");
        assert!(
            no_fd
                .message
                .contains("fd_index 0 names an fd this frame did not carry"),
            "{}",
            no_fd.message
        );
        let no_device = register(Ok(1), 2, 1).expect_err("no device 2");
        assert!(
            no_device.message.contains("device 2"),
            "{}",
            no_device.message
        );
        let no_cuda = register(Err("no driver".into()), 0, 1).expect_err("no CUDA");
        assert_eq!(no_cuda.code, crate::protocol::ErrorCode::Unavailable);
        assert!(
            no_cuda.message.contains("cuda_vmm buffer") && no_cuda.message.contains("no driver"),
            "{}",
            no_cuda.message
        );
    }
}
