//! What travels between a worker and the server: the protocol's requests and replies,
//! reduced to what liveness depends on.

use kvwarden_core::{InstanceId, Module};

/// A request from a worker process, as the server's socket receives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The worker slot it came from.
    pub slot: usize,
    /// Which process in that slot (a restart is a new incarnation).
    pub incarnation: u32,
    /// The id the process chose at start-up.
    pub instance: InstanceId,
    /// The server boot the connection was opened to: a restart breaks it.
    pub boot: u64,
    /// When the worker sent it.
    pub sent_at: u64,
    /// The worker is shutting down cleanly (its UNREGISTER is the last word).
    pub exiting: bool,
    /// What it asks.
    pub request: Request,
}

/// The requests of the protocol that matter to liveness.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// `register_kv_cache` / `register_engine_driven`, part of registration round `round`.
    Register {
        /// Where the state goes.
        module: Module,
        /// The worker's round serial, echoed in the reply.
        round: u64,
    },
    /// `unregister_*`.
    Unregister {
        /// Which registration goes.
        module: Module,
    },
    /// `ping [instance]`.
    Ping {
        /// The worker's ping serial, echoed in the reply.
        seq: u64,
    },
    /// `ping []`: a pre-liveness client (row 13).
    LegacyPing {
        /// The worker's ping serial, echoed in the reply.
        seq: u64,
    },
    /// `store`/`retrieve` (server-driven) or `prepare_*` (engine-driven).
    Transfer {
        /// Which registration it uses.
        module: Module,
        /// The worker's operation serial (engine-driven commits name it).
        op: u64,
    },
    /// `commit_*` of an engine-driven prepare.
    Commit {
        /// The prepare it commits.
        op: u64,
    },
    /// `register_blend`.
    RegisterBlend,
}

impl Request {
    /// A small stable code for the trace hash.
    pub fn code(&self) -> u64 {
        match self {
            Request::Register { .. } => 1,
            Request::Unregister { .. } => 2,
            Request::Ping { .. } => 3,
            Request::LegacyPing { .. } => 4,
            Request::Transfer { .. } => 5,
            Request::Commit { .. } => 6,
            Request::RegisterBlend => 7,
        }
    }
}

/// How REGISTER went.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RegisterOutcome {
    /// A context was built.
    Created,
    /// The entry was present; nothing built.
    Refreshed,
    /// The build failed or was cancelled: try again.
    Failed,
}

/// How a ping was answered.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PingAnswer {
    /// `true`.
    Known,
    /// `false`: not registered here.
    Unknown,
    /// `bad_args`: a `ping []` from an old client.
    BadArgs,
}

/// How a transfer was answered.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TransferAnswer {
    /// Done (or prepared).
    Done,
    /// `not_registered`: re-register.
    NotRegistered,
    /// `not_ready`: the context is still being built.
    NotReady,
}

/// A reply on its way to a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplyEnvelope {
    /// The worker slot it goes to.
    pub slot: usize,
    /// The process it answers.
    pub incarnation: u32,
    /// The server boot that answered.
    pub boot: u64,
    /// The answer.
    pub reply: Reply,
}

/// The replies, one per request.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// To `Register`.
    Register {
        /// The module.
        module: Module,
        /// The round it belongs to.
        round: u64,
        /// The outcome.
        outcome: RegisterOutcome,
    },
    /// To `Unregister`: whether it was registered.
    Unregister {
        /// The module.
        module: Module,
        /// The server's answer.
        was_registered: bool,
    },
    /// To `Ping` or `LegacyPing`.
    Ping {
        /// The ping serial.
        seq: u64,
        /// The answer.
        answer: PingAnswer,
    },
    /// To `Transfer`.
    Transfer {
        /// The module.
        module: Module,
        /// The operation serial.
        op: u64,
        /// The answer.
        answer: TransferAnswer,
    },
    /// To `Commit`: false when the prepare was discarded.
    Commit {
        /// Whether it was published.
        published: bool,
    },
    /// To `RegisterBlend`.
    Blend {
        /// Whether the server kept it.
        kept: bool,
    },
}
