//! L2: the building blocks of the second tier, a Redis Cluster shared by every node's
//! server. Pure data and decisions; the Redis I/O lives in the shell's L2 threads.
//!
//! - [`value`]: the format of a value in L2 (header with magic, version, length and
//!   checksum, or a MAC under the cluster secret) and the decoder that refuses anything
//!   else, longer values included.
//! - [`key`]: how a chunk's key is named in L2 ([`Namespace`]).
//! - [`health`]: up / degraded / down, and the circuit breaker that stops asking.
//! - [`write_queue`]: the write-behind queue, bounded in bytes.
//! - [`counters`]: what L2 did, for `/status` and `/metrics`.
//!
//! # How a server uses them
//!
//! Ask the breaker before every L2 operation, record every result with the time it
//! arrived, log each transition to or from `Down` once, and wake for
//! [`L2Health::poll_timeout`] to send the probe:
//!
//! ```
//! use kvwarden_core::Instant;
//! use kvwarden_core::l2::{
//!     Gate, L2Counters, L2Health, L2HealthConfig, L2State, Push, ReadOutcome, WriteQueue,
//! };
//! # fn ask_l2(_key: &[u8]) {}
//! let mut health = L2Health::new(L2HealthConfig::default())?;
//! let mut queue: WriteQueue<Vec<u8>> = WriteQueue::new(64 << 20);
//! let mut counters = L2Counters::default();
//! let now = Instant::from_nanos(1_000);
//!
//! // A retrieve that missed L1:
//! match health.admit(now) {
//!     Gate::Ask | Gate::Probe => ask_l2(b"chunk"), // answered later, within the timeout
//!     Gate::Skip => counters.record_skipped_read(), // down: a miss at once
//! }
//!
//! // A chunk published in L1 (and only then):
//! let chunk = vec![0u8; 4096];
//! let bytes = chunk.len() as u64;
//! if queue.push(chunk, bytes) == Push::Dropped {
//!     counters.record_dropped_write();
//! }
//!
//! // An answer arrived:
//! let outcome = ReadOutcome::TimedOut;
//! counters.record_read(outcome);
//! if let Some(transition) = health.record(now, outcome.op_result()) {
//!     if transition.to == L2State::Down || transition.from == L2State::Down {
//!         println!("L2 is {}", transition.to.as_str()); // once per change
//!     }
//! }
//! # Ok::<(), kvwarden_core::l2::L2HealthConfigError>(())
//! ```

pub mod counters;
pub mod health;
pub mod key;
pub mod value;
pub mod write_queue;

pub use counters::{L2Counters, ReadOutcome, WriteOutcome};
pub use health::{
    Gate, L2Health, L2HealthConfig, L2HealthConfigError, L2State, OpResult, Transition,
};
pub use key::{DEFAULT_NAMESPACE, NAMESPACE_MAX_BYTES, Namespace, NamespaceError};
pub use value::{
    ClusterSecret, FORMAT_VERSION, HEADER_BYTES, Header, MAC_CONTEXT, MAC_FORMAT_VERSION,
    MAC_HEADER_BYTES, MAC_TAG_BYTES, MAGIC, PayloadCheck, SECRET_MIN_BYTES, SecretError,
    ValueError, ValueFormat, decode, encode, header,
};
pub use write_queue::{Push, SHUTDOWN_DRAIN, WriteQueue};
