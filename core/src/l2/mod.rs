//! L2: the building blocks of the second tier, a Redis Cluster shared by every node's
//! server. Pure data and decisions; the Redis I/O lives in the shell's L2 threads.
//!
//! - [`value`]: the format of a value in L2 (header with magic, version, length and
//!   checksum) and the decoder that refuses anything else.
//! - [`key`]: how a chunk's key is named in L2 ([`Namespace`]).
//! - [`health`]: up / degraded / down, and the circuit breaker that stops asking.
//! - [`write_queue`]: the write-behind queue, bounded in bytes.
//! - [`counters`]: what L2 did, for `/status` and `/metrics`.

pub mod counters;
pub mod health;
pub mod key;
pub mod value;
pub mod write_queue;

pub use counters::{L2Counters, ReadOutcome, WriteOutcome};
pub use health::{
    Admission, L2Health, L2HealthConfig, L2HealthConfigError, L2State, OpResult, Transition,
};
pub use key::{DEFAULT_NAMESPACE, NAMESPACE_MAX_BYTES, Namespace, NamespaceError};
pub use value::{DecodeError, FORMAT_VERSION, HEADER_BYTES, MAGIC, decode, encode, header};
pub use write_queue::{Push, WriteQueue};
