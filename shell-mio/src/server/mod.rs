//! The production server: one mio event loop that drives the node
//! ([`kvwarden_core::node`]), a context pool for builds, copies, rope tables and frees,
//! and the listeners.
//!
//! The loop only translates: bytes ↔ requests ([`crate::protocol`]) ↔ node inputs;
//! node outputs ↔ replies, pool jobs and syscalls. Every rule lives in the node.

pub mod blend;
pub mod closer;
pub mod connection;
pub mod context;
mod event_loop;
pub mod fault;
pub mod gpu;
pub mod http;
pub mod kv_events;
pub mod l1;
pub mod listen;
pub mod metrics;
pub mod peer;
pub mod pool;
pub mod status;
pub mod systemd;

pub use event_loop::{Server, ServerError};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// `--max-connections` when the operator does not say: lowered at start, quietly, to
/// what the open-file limit holds.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

/// `--frame-timeout-seconds` when the operator does not say.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything `kvwarden serve` decides.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The liveness configuration.
    pub liveness: kvwarden_core::Config,
    /// Lift the 30 s floor on the reap timeout (tests and demos only).
    pub allow_short_timeouts: bool,
    /// The Unix socket path.
    pub socket_path: PathBuf,
    /// Its permission bits.
    pub socket_mode: u32,
    /// Optional TCP listener.
    pub tcp: Option<SocketAddr>,
    /// Optional HTTP listener.
    pub http: Option<SocketAddr>,
    /// Size of the L1 pool.
    pub l1_bytes: u64,
    /// Size of one L1 slot.
    pub slot_bytes: u64,
    /// Touch every page of the L1 pool at start (`--l1-prefault`).
    pub l1_prefault: bool,
    /// The pool in this file, found again after a restart (`--l1-file`); None: an
    /// anonymous memfd.
    pub l1_file: Option<PathBuf>,
    /// The pool's memfds in systemd's file-descriptor store (`--l1-fdstore`).
    pub l1_fdstore: bool,
    /// The key of the pool file's seals (`--l1-secret-file`); without one nothing is
    /// adopted.
    pub l1_secret: Option<kvwarden_core::seal::SealKey>,
    /// The largest frame accepted.
    pub max_frame_bytes: usize,
    /// The most worker connections held at once.
    pub max_connections: usize,
    /// `max_connections` came from the operator's `--max-connections`, not the
    /// default: lowering it to the open-file limit is then worth a warning.
    pub max_connections_from_flag: bool,
    /// The most connections one uid holds at once (TCP peers together count as one);
    /// None: three quarters of `max_connections`.
    pub max_connections_per_uid: Option<usize>,
    /// A frame (and the first frame after the accept, and an HTTP request and its
    /// answer) must arrive whole within this, or the connection is cut.
    pub frame_timeout: Duration,
    /// Memfd buffers on hugetlbfs are accepted (`--allow-hugetlb-buffers`).
    pub allow_hugetlb_buffers: bool,
    /// The caps on workers' memfd bytes mapped (`--max-mapped-bytes`, per tenant, per
    /// instance).
    pub mapped: kvwarden_core::node::mapped::MappedLimits,
    /// A free running longer than this is reported.
    pub free_watchdog: Duration,
    /// Threads for builds and copies.
    pub pool_threads: usize,
    /// The L2 tier (`--l2`), or None.
    pub l2: Option<crate::l2::L2Config>,
    /// The tenants and TCP tokens (`--tenant`, `--tcp-token-file`).
    pub trust: kvwarden_core::node::trust::TrustConfig,
    /// The tenants whose blocks the server announces itself (`--kv-events`).
    pub kv_events: Vec<kv_events::KvEventsEndpoint>,
}
