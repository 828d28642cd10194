//! The L1 pool's memory: one anonymous memfd of fixed-size slots, mapped once.
//!
//! Which key holds which slot (reservations, pins, LRU) is the node's bookkeeping
//! ([`kvwarden_core::node::l1`]); the bytes are copied here, on the context pool, at
//! the offsets it names.

use crate::memfd::{self, SharedMapping};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::SealFlags;
use std::sync::Arc;

pub use kvwarden_core::node::l1::SlotId;

/// The pool.
#[derive(Debug)]
pub struct L1 {
    mapping: Arc<SharedMapping>,
    /// The pool's memfd, kept to hand to engine-driven workers (`SCM_RIGHTS`); sealed
    /// against resizing, so no worker can shrink it under the server's mapping.
    fd: OwnedFd,
    slot_bytes: u64,
    num_slots: usize,
}

impl L1 {
    /// A pool of `l1_bytes / slot_bytes` slots in one anonymous memfd.
    pub fn new(l1_bytes: u64, slot_bytes: u64) -> std::io::Result<L1> {
        let num_slots = l1_bytes.checked_div(slot_bytes).unwrap_or(0);
        let used = num_slots * slot_bytes;
        let fd = memfd::create("kvwarden-l1", used)?;
        // Engine-driven workers get this fd: a shrink would turn the server's next copy
        // into SIGBUS, a grow is pointless, and F_SEAL_SEAL keeps it that way.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let len = usize::try_from(used).map_err(std::io::Error::other)?;
        let mapping = Arc::new(SharedMapping::map(&fd, len)?);
        let num_slots = usize::try_from(num_slots).map_err(std::io::Error::other)?;
        Ok(L1 {
            mapping,
            fd,
            slot_bytes,
            num_slots,
        })
    }

    /// The pool's mapping (copies run against it off the loop).
    pub fn mapping(&self) -> &Arc<SharedMapping> {
        &self.mapping
    }

    /// The pool's memfd (sealed against resizing), for engine-driven workers to map.
    pub fn pool_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Where `slot` begins in the pool.
    pub fn offset(&self, slot: SlotId) -> u64 {
        slot as u64 * self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_memfd_cannot_be_resized_by_whoever_holds_it() {
        let l1 = L1::new(2 * 4096, 4096).unwrap();
        let seals = rustix::fs::fcntl_get_seals(l1.pool_fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4096).is_err());
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4 * 4096).is_err());
    }
}
