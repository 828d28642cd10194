//! What one run is made of: the server's settings, the workers, the network, the faults
//! and when they strike. Built from a scenario file ([`crate::scenario`]) or drawn from a
//! seed ([`crate::swarm`]); the run itself ([`crate::world`]) only reads it.

use crate::time::{MILLISECOND, Nanos, SECOND};
use kvwarden_core::Module;
use kvwarden_core::node::PlantedBug;

/// Everything one run needs; with the same value the run is the same, bit for bit.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Human-readable name (the scenario's `name`, or `swarm seed N`).
    pub name: String,
    /// The seed of the run's only random generator.
    pub seed: u64,
    /// Virtual time at which the run ends.
    pub duration: Nanos,
    /// The simulated server.
    pub server: ServerSpec,
    /// One spec per worker slot (`w0`, `w1`, ... in order).
    pub workers: Vec<WorkerSpec>,
    /// Faults and operator actions, sorted by time.
    pub events: Vec<FaultEvent>,
    /// A deliberate bug in the server model, to prove the invariants catch it.
    pub bug: Option<InjectedBug>,
    /// At the end, every live worker must hold exactly one context per module and be
    /// healthy, and every dead one must hold nothing (the swarm's heal-and-converge phase).
    pub converge_at_end: bool,
}

/// The simulated server's liveness settings and how its shell behaves.
#[derive(Clone, Debug)]
pub struct ServerSpec {
    /// T: the reap timeout (0 disables reaping).
    pub reap_timeout: Nanos,
    /// G: the registration grace.
    pub registration_grace: Nanos,
    /// R: the core's resolution.
    pub resolution: Nanos,
    /// The core's stall threshold.
    pub stall_threshold: Nanos,
    /// Whether reap timeouts below the production floor of 30 s are accepted.
    pub allow_short_timeouts: bool,
    /// A context build takes a time drawn uniformly in this range.
    pub build_delay: (Nanos, Nanos),
    /// Probability that a context build fails (the worker is told and retries).
    pub build_failure_rate: f64,
    /// How long a server-driven copy holds its context (0: instantaneous). A free
    /// that arrives meanwhile waits for the copy (row 16).
    pub copy_duration: Nanos,
    /// How long after a same-host worker's exit the pidfd notice reaches the server.
    pub exit_notice_delay: Nanos,
    /// A free (closing a context's mappings) takes this long.
    pub free_delay: Nanos,
    /// Probability that a free never returns (row 20: a CUDA call that hangs).
    pub free_hang_rate: f64,
    /// The node's free watchdog: a free running longer is reported (row 20).
    pub free_watchdog: Nanos,
    /// The L2 tier (rows 27–29): off unless a scenario's `[l2]` or the swarm enables it.
    pub l2: crate::l2::L2Spec,
    /// The TCP token (`--tcp-token-file`): TCP peers presenting it act for the tenant
    /// [`TCP_TENANT`] (row 32). None: no TCP peer can authenticate.
    pub tcp_token: Option<Vec<u8>>,
    /// Whether L1 lives in a pool file that outlives the process (`--l1-file` with
    /// `--l1-secret-file`, row 71): committed values are sealed, and a restarted server
    /// adopts what the file still holds.
    pub pool_file: bool,
    /// How long a scan job of a restarted server's pool takes (its findings are read
    /// when it starts, reported when it ends).
    pub scan_duration: Nanos,
}

impl Default for ServerSpec {
    fn default() -> ServerSpec {
        ServerSpec {
            reap_timeout: 120 * SECOND,
            registration_grace: 3600 * SECOND,
            resolution: SECOND,
            stall_threshold: 5 * SECOND,
            allow_short_timeouts: false,
            build_delay: (10 * MILLISECOND, 10 * MILLISECOND),
            build_failure_rate: 0.0,
            copy_duration: 0,
            exit_notice_delay: MILLISECOND,
            free_delay: 0,
            free_hang_rate: 0.0,
            free_watchdog: 10 * SECOND,
            l2: crate::l2::L2Spec::default(),
            tcp_token: None,
            pool_file: false,
            scan_duration: MILLISECOND,
        }
    }
}

impl ServerSpec {
    /// The node's trust configuration: one declared tenant, [`TCP_TENANT`], for the TCP
    /// token when there is one; every uid is a tenant of its own (`uid-<uid>`).
    pub fn trust(&self) -> kvwarden_core::node::trust::TrustConfig {
        kvwarden_core::node::trust::TrustConfig {
            tenants: self
                .tcp_token
                .iter()
                .map(|token| kvwarden_core::node::trust::TenantSpec {
                    name: TCP_TENANT.to_string(),
                    uids: Vec::new(),
                    tokens: vec![token.clone()],
                    quota_percent: None,
                    engine_driven: false,
                })
                .collect(),
            nonce_secret: SIM_NONCE_SECRET,
            ..Default::default()
        }
    }
}

/// The secret of the node's TCP challenge nonces in a run (the production server draws
/// one at each start). A probe with the right token predicts the server's nonce from it,
/// as if it had read the `auth` answer before sending its `hello` (a probe's requests
/// go out at once); a wrong prediction only costs it the connection.
pub const SIM_NONCE_SECRET: [u8; 32] = [0x5e; 32];

/// The tenant the TCP token's peers act for (the production server names it so too).
pub const TCP_TENANT: &str = "tcp";

/// When a worker starts its heartbeat.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HeartbeatStart {
    /// As soon as its first registration succeeded.
    OnRegister,
    /// Lazily, at its first transfer (the client library's behaviour).
    OnFirstTransfer,
    /// Never (a worker that lost its heartbeat thread before it began).
    Never,
}

/// The uid of the simulated server process: the workers' own (the usual deployment), so
/// that their tenant (`uid-1000`) may register engine-driven (row 35). It acts on no
/// instance it has not attached: nobody does (rows 30–31).
pub const SERVER_UID: u32 = WORKER_UID;
/// The uid workers run as unless a scenario says otherwise.
pub const WORKER_UID: u32 = 1000;

/// One worker slot; a restart puts a new process (fresh id) in the same slot.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// `w0`, `w1`, ...
    pub name: String,
    /// When the process starts and registers.
    pub start_at: Nanos,
    /// H: the heartbeat interval (also a request's timeout).
    pub heartbeat_interval: Nanos,
    /// Whether the server can see the process (same host, Unix socket: pidfd proof).
    pub same_host: bool,
    /// Transfers every this often (None: no traffic).
    pub traffic_every: Option<Nanos>,
    /// Traffic begins this long after the start (row 6: a worker idle longer than G).
    pub traffic_start_after: Nanos,
    /// When the heartbeat starts.
    pub heartbeat_start: HeartbeatStart,
    /// The modules it registers in.
    pub modules: Vec<Module>,
    /// Whether it registers CacheBlend rope state after its registration.
    pub blend: bool,
    /// A pre-liveness client: its pings are `ping []` (row 13).
    pub legacy_ping: bool,
    /// An engine-driven transfer's prepare is committed this long later.
    pub commit_after: Nanos,
    /// Its link to and from the server.
    pub link: LinkSpec,
    /// The uid its connections carry (`SO_PEERCRED`).
    pub uid: u32,
    /// Raw bytes (garbage, truncated or valid frames) through the real decoder this
    /// often, on a connection of their own (row 24); None: never.
    pub garbage_every: Option<Nanos>,
}

impl WorkerSpec {
    /// A worker with the client's defaults, named `name`.
    pub fn new(name: String) -> WorkerSpec {
        WorkerSpec {
            name,
            start_at: 0,
            heartbeat_interval: 10 * SECOND,
            same_host: true,
            traffic_every: None,
            traffic_start_after: 0,
            heartbeat_start: HeartbeatStart::OnRegister,
            modules: vec![Module::ServerDriven],
            blend: false,
            legacy_ping: false,
            commit_after: 50 * MILLISECOND,
            link: LinkSpec::default(),
            uid: WORKER_UID,
            garbage_every: None,
        }
    }
}

/// The faults of one direction of a link.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkSpec {
    /// Fixed one-way delay.
    pub delay: Nanos,
    /// Extra delay drawn uniformly in `[0, jitter]` per message: it reorders messages.
    pub jitter: Nanos,
    /// Probability a message is lost.
    pub loss: f64,
    /// Probability a message is delivered twice.
    pub duplicate: f64,
}

impl Default for LinkSpec {
    fn default() -> LinkSpec {
        LinkSpec {
            delay: 100_000, // 0.1 ms: a local socket
            jitter: 0,
            loss: 0.0,
            duplicate: 0.0,
        }
    }
}

/// Which direction a partition cuts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CutDirection {
    /// Nothing passes either way.
    Both,
    /// The server hears nothing from the worker; the worker still hears replies.
    ToServer,
    /// The worker hears nothing from the server.
    ToWorker,
}

/// A fault or operator action at a point in virtual time.
#[derive(Clone, Debug)]
pub struct FaultEvent {
    /// When it strikes.
    pub at: Nanos,
    /// What happens.
    pub action: Action,
}

/// Everything that can happen to a run from outside.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// SIGKILL: the process is gone; same-host workers leave a pidfd proof.
    Crash(Vec<usize>),
    /// SIGSTOP: the process holds still; it has not exited.
    Freeze(Vec<usize>),
    /// SIGCONT.
    Thaw(Vec<usize>),
    /// Crash, then a new process with a fresh id in the same slot.
    Restart(Vec<usize>),
    /// The heartbeat thread stops getting CPU (transfers go on).
    StarveHeartbeat(Vec<usize>),
    /// The heartbeat thread runs again.
    FeedHeartbeat(Vec<usize>),
    /// Clean shutdown: heartbeat stopped first, then UNREGISTER, then exit.
    Stop(Vec<usize>),
    /// A worker sends UNREGISTER for its modules without exiting (row 14).
    Unregister(Vec<usize>),
    /// A worker sends REGISTER again for its modules (row 15).
    Register(Vec<usize>),
    /// A worker transfers once on each of its modules now (a client using its
    /// registrations; a `not_registered` answer makes it re-register).
    Transfer(Vec<usize>),
    /// Cut the links of these workers.
    Partition(Vec<usize>, CutDirection),
    /// Restore the links of these workers (all faults of the link off).
    Heal(Vec<usize>),
    /// Replace the link faults of these workers, both directions.
    SetLink(Vec<usize>, LinkSpec),
    /// SIGSTOP of the server process (or a starved loop).
    ServerPause,
    /// SIGCONT of the server process.
    ServerResume,
    /// The server dies and a new one starts `down` later with nothing.
    ServerRestart {
        /// How long no server listens.
        down: Nanos,
    },
    /// Clean shutdown of the server: every context freed once, then it is gone.
    ServerStop,
    /// The wall clock steps by this many nanoseconds (negative: backwards); the
    /// monotonic clock the core reads does not move, and one stale reading is fed to
    /// the core to prove it never moves state backwards.
    ClockStep(i64),
    /// Change the probability that a context build fails.
    BuildFailureRate(f64),
    /// Change the probability that a free never returns (row 20).
    FreeHangRate(f64),
    /// Worker `0` (of any uid) names worker `1`'s current instance in a ping, a
    /// REGISTER, transfers, `register_blend`, both UNREGISTERs and an `attach` with a
    /// wrong secret, on its own connection, which never attached it (rows 23, 30, 31).
    Intrude(usize, usize),
    /// The process in this slot reads every instance id from the node's status (and
    /// remembers those it read before, across server restarts) and intrudes on each,
    /// at most [`MAX_IMPERSONATED`] of them (rows 30–31: after a server restart its
    /// wrong-secret `attach` of an unbound id claims it first, a squat).
    Impersonate(usize),
    /// The process in this slot, of another tenant than its victims, stores, retrieves
    /// and looks up their keys (those they stored last and those they store next) with
    /// its own instance, and tries to register engine-driven (rows 33, 35).
    Poach(usize),
    /// A TCP peer connects, says `hello` with this token, then names every known
    /// instance in requests (row 32); its connection closes after.
    TcpProbe(TokenChoice),
    /// L2 goes down: every operation fails (`l2_down`), until `L2Up`.
    L2Down,
    /// L2 is unreachable: no operation is answered, the shell's client times out
    /// (`l2_partition`), until `L2Up`.
    L2Partition,
    /// L2 is back: down, partitioned and slow end (`l2_up`).
    L2Up,
    /// L2 answers every operation this late (`l2_slow`, `delay_ms`), until `L2Up`.
    L2Slow(Nanos),
    /// This fraction of L2 reads find a torn value from now on (`l2_corrupt`, `rate`).
    L2Corrupt(f64),
    /// This fraction of L2 operations fail from now on (`l2_flaky`, `rate`).
    L2Flaky(f64),
    /// Every value L2 holds under these workers' current instances is overwritten with
    /// garbage (`l2_garble`: written by something else, row 28).
    L2Garble(Vec<usize>),
    /// End every fault: heal every link, thaw and feed every worker, resume or start
    /// the server, builds stop failing, frees stop hanging, L2 healthy (the swarm's
    /// final phase).
    HealAll,
}

/// At most this many instances one `Impersonate` names.
pub const MAX_IMPERSONATED: usize = 8;

/// What a probing TCP peer presents in its `hello`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TokenChoice {
    /// No token at all.
    Missing,
    /// A token the server does not accept.
    Wrong,
    /// The server's token (it acts for [`TCP_TENANT`], which attached no instance).
    Right,
}

/// Deliberate bugs, to show the invariants catch them: bugs of the simulated shell or
/// worker stay here; bugs of the server's logic are planted in the real node
/// ([`kvwarden_core::node::PlantedBug`], feature `planted-bugs`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum InjectedBug {
    /// Shell: the loop never calls `handle_timeout` on its own (only after input).
    SkipHandleTimeout,
    /// Node: two frees are started for one context.
    DoubleFree,
    /// Node: `DropBlendState` is ignored.
    KeepBlendState,
    /// Node: reservations and pins are not released when a context is freed
    /// (`keep_pins` and `keep_reservations`).
    KeepPins,
    /// Shell: after a pause, deadlines are judged before the queued input is read.
    TimeoutBeforeInput,
    /// Node: pings are answered but never reach the registry.
    IgnorePings,
    /// Shell: a panic on the first reap (for exit code 127).
    Panic,
    /// Shell: the loop wakes 2.4 s after `poll_timeout` (still under the stall threshold).
    LateWake,
    /// Shell: the core is fed the wall clock instead of the monotonic one.
    WallClock,
    /// Worker: a client re-registers once more after its clean shutdown's UNREGISTER (a
    /// recovery thread that was not joined).
    RegisterAfterUnregister,
    /// Node: a REGISTER that finds its entry still building is answered `refreshed` at
    /// once.
    RefreshWhileBuilding,
    /// Node: a free starts while copies still use the context.
    FreeDuringCopy,
    /// Node: frees are never started.
    LeakOnFree,
    /// Node: `handle_timeout` never reaches the registry.
    SkipReap,
    /// Node: a process exit frees nothing.
    IgnoreProcessExit,
    /// Node: a built context is never handed to the registry.
    DropBuiltContext,
    /// Node: shutdown stops without freeing anything.
    ShutdownLeaks,
    /// Node: `prepare_store` writes the unpublished reservation to L2 (row 29).
    WriteUnpublished,
    /// Node: an L2 value answered `Corrupt` is served as a hit (row 28).
    ServeCorrupt,
    /// Node: with L2 on, a ping's answer waits for the next `handle_timeout` (row 27).
    PingWaitsForL2,
    /// Node: a request naming an instance is served whether or not its connection
    /// attached it (rows 30–31).
    TrustAnyConnection,
    /// Node: keys are not scoped to the caller's tenant (row 33).
    SharedKeyspace,
    /// Node: a restarted server adopts a sealed value into a slot a store took before
    /// its seal was checked (row 71).
    AdoptTaken,
}

impl InjectedBug {
    /// Every bug with its scenario-file spelling.
    pub const ALL: [(InjectedBug, &'static str); 24] = [
        (InjectedBug::SkipHandleTimeout, "skip_handle_timeout"),
        (InjectedBug::DoubleFree, "double_free"),
        (InjectedBug::KeepBlendState, "keep_blend_state"),
        (InjectedBug::KeepPins, "keep_pins"),
        (InjectedBug::KeepPins, "keep_reservations"),
        (InjectedBug::TimeoutBeforeInput, "timeout_before_input"),
        (InjectedBug::IgnorePings, "ignore_pings"),
        (InjectedBug::Panic, "panic"),
        (InjectedBug::LateWake, "late_wake"),
        (InjectedBug::WallClock, "wall_clock"),
        (
            InjectedBug::RegisterAfterUnregister,
            "register_after_unregister",
        ),
        (InjectedBug::RefreshWhileBuilding, "refresh_while_building"),
        (InjectedBug::FreeDuringCopy, "free_during_copy"),
        (InjectedBug::LeakOnFree, "leak_on_free"),
        (InjectedBug::SkipReap, "skip_reap"),
        (InjectedBug::IgnoreProcessExit, "ignore_process_exit"),
        (InjectedBug::DropBuiltContext, "drop_built_context"),
        (InjectedBug::ShutdownLeaks, "shutdown_leaks"),
        (InjectedBug::WriteUnpublished, "write_unpublished"),
        (InjectedBug::ServeCorrupt, "serve_corrupt"),
        (InjectedBug::PingWaitsForL2, "ping_waits_for_l2"),
        (InjectedBug::TrustAnyConnection, "trust_any_connection"),
        (InjectedBug::SharedKeyspace, "shared_keyspace"),
        (InjectedBug::AdoptTaken, "adopt_taken"),
    ];

    /// The bug's spelling.
    pub fn label(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(bug, _)| *bug == self)
            .map_or("?", |(_, name)| name)
    }

    /// The node's planted bug this is, if it is one of the node's.
    pub fn planted(self) -> Option<PlantedBug> {
        Some(match self {
            InjectedBug::DoubleFree => PlantedBug::DoubleFree,
            InjectedBug::KeepBlendState => PlantedBug::KeepBlendState,
            InjectedBug::KeepPins => PlantedBug::KeepReservations,
            InjectedBug::IgnorePings => PlantedBug::IgnorePings,
            InjectedBug::RefreshWhileBuilding => PlantedBug::RefreshBeforeBuild,
            InjectedBug::FreeDuringCopy => PlantedBug::FreeDuringCopy,
            InjectedBug::LeakOnFree => PlantedBug::LeakOnFree,
            InjectedBug::SkipReap => PlantedBug::SkipReap,
            InjectedBug::IgnoreProcessExit => PlantedBug::IgnoreProcessExit,
            InjectedBug::DropBuiltContext => PlantedBug::DropBuiltContext,
            InjectedBug::ShutdownLeaks => PlantedBug::ShutdownLeaks,
            InjectedBug::WriteUnpublished => PlantedBug::WriteUnpublished,
            InjectedBug::ServeCorrupt => PlantedBug::ServeCorrupt,
            InjectedBug::PingWaitsForL2 => PlantedBug::PingWaitsForL2,
            InjectedBug::TrustAnyConnection => PlantedBug::TrustAnyConnection,
            InjectedBug::SharedKeyspace => PlantedBug::SharedKeyspace,
            InjectedBug::AdoptTaken => PlantedBug::AdoptTaken,
            InjectedBug::SkipHandleTimeout
            | InjectedBug::TimeoutBeforeInput
            | InjectedBug::Panic
            | InjectedBug::LateWake
            | InjectedBug::WallClock
            | InjectedBug::RegisterAfterUnregister => return None,
        })
    }

    /// Whether this build can run the bug: the node's bugs need the feature
    /// `planted-bugs` (the tests enable it; `cargo build --features planted-bugs`).
    pub fn available(self) -> bool {
        self.planted().is_none() || cfg!(feature = "planted-bugs")
    }
}
