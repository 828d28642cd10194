//! Worker identity: uuid4-derived 63-bit integers, never PIDs.
//!
//! Containers reuse small PIDs, so a PID-derived id lets a new worker bind to a dead
//! worker's state. An id drawn from OS entropy never collides across restarts, and 63
//! bits keep it a valid signed int64 for every MessagePack peer.

use thiserror::Error;

/// The id a worker process chooses for itself once, at start-up.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InstanceId(u64);

/// A raw value above [`InstanceId::MAX`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "invalid instance id {value}: it must be at most 2^63 - 1 ({max}) so that every \
     MessagePack peer can hold it as a signed 64-bit integer; derive ids with \
     `uuid4().int & ((1 << 63) - 1)`",
    max = InstanceId::MAX
)]
pub struct InvalidInstanceId {
    /// The rejected value.
    pub value: u64,
}

impl InstanceId {
    /// The largest valid id: 2^63 - 1.
    pub const MAX: u64 = (1 << 63) - 1;

    /// Rejects values above [`InstanceId::MAX`] (they are not signed-int64 safe for
    /// MessagePack peers).
    pub fn new(raw: u64) -> Result<InstanceId, InvalidInstanceId> {
        if raw > Self::MAX {
            return Err(InvalidInstanceId { value: raw });
        }
        Ok(InstanceId(raw))
    }

    /// The low 63 bits of the UUID's 128-bit integer value: `uuid.as_u128() & MAX`.
    pub fn from_uuid(uuid: uuid::Uuid) -> InstanceId {
        // Truncation is the point: the low 64 bits, then the low 63 of those.
        InstanceId(uuid.as_u128() as u64 & Self::MAX)
    }

    /// `from_uuid(Uuid::new_v4())`: OS entropy, so restarted processes never collide.
    pub fn generate() -> InstanceId {
        Self::from_uuid(uuid::Uuid::new_v4())
    }

    /// The raw value, at most [`InstanceId::MAX`].
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
