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
    /// A pool of `l1_bytes / slot_bytes` slots in one anonymous memfd; with `prefault`
    /// every page is allocated now rather than on its first write.
    pub fn new(l1_bytes: u64, slot_bytes: u64, prefault: bool) -> std::io::Result<L1> {
        let num_slots = l1_bytes.checked_div(slot_bytes).unwrap_or(0);
        let used = num_slots * slot_bytes;
        let fd = memfd::create("kvwarden-l1", used)?;
        // Engine-driven workers get this fd: a shrink would turn the server's next copy
        // into SIGBUS, a grow is pointless, and F_SEAL_SEAL keeps it that way.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let len = usize::try_from(used).map_err(std::io::Error::other)?;
        let mapping = Arc::new(SharedMapping::map(&fd, len)?);
        if prefault {
            mapping.populate()?;
        }
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

/// A view of `len` bytes of the pool at an offset, for an L2 thread to send a published
/// slot without copying it first. It keeps the mapping alive; the node keeps the slot
/// pinned (published, so nothing writes it) until the write ends, and the view is
/// dropped by then. A worker that wrote into a published slot anyway (the protocol
/// forbids it) could make the bytes sent differ from the bytes checksummed: readers
/// then find the value corrupt, a miss (row 28), never wrong data.
pub struct SlotBytes {
    _mapping: Arc<SharedMapping>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is into `_mapping`, which is `Send + Sync` and kept alive here; the
// view only reads.
unsafe impl Send for SlotBytes {}

impl SlotBytes {
    /// `[offset, offset + len)` of `mapping`, or None when out of bounds.
    pub fn new(mapping: &Arc<SharedMapping>, offset: u64, len: usize) -> Option<SlotBytes> {
        let ptr = mapping.range_ptr(offset, len as u64)?;
        Some(SlotBytes {
            _mapping: Arc::clone(mapping),
            ptr: ptr.cast_const(),
            len,
        })
    }
}

impl AsRef<[u8]> for SlotBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `new` checked that the range lies inside the mapping, which lives as
        // long as `self`; the slot is pinned, so nothing in this process writes it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_view_reads_what_the_pool_holds_and_refuses_out_of_bounds() {
        let l1 = L1::new(4 * 4096, 4096, false).unwrap();
        assert!(l1.mapping().write(l1.offset(2), b"published"));
        let view = SlotBytes::new(l1.mapping(), l1.offset(2), 9).unwrap();
        assert_eq!(view.as_ref(), b"published");
        assert!(SlotBytes::new(l1.mapping(), l1.offset(3), 4097).is_none());
        drop(l1);
        assert_eq!(
            view.as_ref(),
            b"published",
            "the view keeps the mapping alive"
        );
    }

    #[test]
    fn the_pool_memfd_cannot_be_resized_by_whoever_holds_it() {
        let l1 = L1::new(2 * 4096, 4096, true).unwrap();
        let seals = rustix::fs::fcntl_get_seals(l1.pool_fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4096).is_err());
        assert!(rustix::fs::ftruncate(l1.pool_fd(), 4 * 4096).is_err());
    }
}
