//! The engine-driven transfer strategy: what one instance holds in the L1 pool while its
//! engine copies KV data in and out of slots itself — slots reserved for writes not yet
//! committed (`prepare_store` without `commit_store`) and pins of slots it is reading
//! (`prepare_retrieve` without `commit_retrieve`).
//!
//! The strategy is the instance's engine-driven context, so it goes exactly when the
//! core frees that context (unregister, reap, process exit, shutdown): [`TransferStrategy::release`]
//! discards every reservation — a reserved slot may hold half-written data, so it is
//! never published — and releases every pin; the slots go back to the pool (row 21).
//! It is bookkeeping of the node, like the rest of the slot table.

use super::l1::{Reservation, SlotId, SlotTable};
use super::trust::TenantId;
use std::collections::HashMap;

/// Slots one instance may hold at once (reservations plus distinct pinned keys): an
/// engine that prepares without ever committing cannot take the whole pool from the
/// other instances. Beyond it `prepare_*` is answered `overloaded`.
pub const MAX_HELD_SLOTS_PER_INSTANCE: usize = 4096;

/// Pins one instance may hold on one key (nested `prepare_retrieve`s of the same key);
/// bounds the pin counters, which a looping peer could otherwise overflow.
pub const MAX_PINS_PER_KEY: u32 = 1024;

/// Where a prepared slot lies in the pool the worker mapped.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SlotGrant {
    /// The slot's index.
    pub slot: SlotId,
    /// Its byte offset in the pool.
    pub offset: u64,
    /// Bytes the worker may write (`prepare_store`: a whole slot) or read
    /// (`prepare_retrieve`: the committed length).
    pub nbytes: u64,
}

/// The outcome of `prepare_store`.
#[derive(Debug, PartialEq, Eq)]
pub enum PrepareStore {
    /// Write into this slot, then `commit_store`.
    Reserved(SlotGrant),
    /// The key is stored (or being stored): nothing to write.
    AlreadyStored,
    /// Every slot of the pool is pinned or reserved.
    PoolFull,
    /// This instance already holds [`MAX_HELD_SLOTS_PER_INSTANCE`] slots.
    TooManyHeld,
}

/// The outcome of `prepare_retrieve`.
#[derive(Debug, PartialEq, Eq)]
pub enum PrepareRetrieve {
    /// Read this slot, then `commit_retrieve`.
    Pinned(SlotGrant),
    /// The key is not committed in L1.
    Miss,
    /// This instance holds too many slots, or too many pins of this key.
    TooManyHeld,
}

/// The outcome of `commit_store`.
#[derive(Debug, PartialEq, Eq)]
pub enum CommitStore {
    /// The slot now holds `nbytes` of the key, visible to every instance.
    Published,
    /// This instance holds no reservation for the key (never prepared, already
    /// committed, or `prepare_store` answered nil).
    NotReserved,
    /// `nbytes` is larger than a slot; the reservation is kept so that a corrected
    /// commit can still publish it.
    TooLarge {
        /// The bytes claimed.
        nbytes: u64,
        /// The slot size.
        slot_bytes: u64,
    },
}

/// What freeing a strategy gave back to the pool.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Reservations discarded unpublished.
    pub reservations_discarded: usize,
    /// Pins released (counting nested pins of one key).
    pub pins_released: u64,
}

/// The reservations and pins of one engine-driven instance.
#[derive(Debug, Default)]
pub struct TransferStrategy {
    reservations: HashMap<Vec<u8>, SlotId>,
    /// key → (slot, how many times this instance pinned it).
    pins: HashMap<Vec<u8>, (SlotId, u32)>,
}

impl TransferStrategy {
    /// Slots held: reservations plus distinct pinned keys.
    pub fn held_slots(&self) -> usize {
        self.reservations.len() + self.pins.len()
    }

    /// Reservations not yet committed.
    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }

    /// Pins held, nested ones counted.
    pub fn pins(&self) -> u64 {
        self.pins.values().map(|&(_, count)| u64::from(count)).sum()
    }

    /// Reserves a slot of `l1` for `key`, evicting the least recently used unpinned
    /// committed slot if needed (never a pinned or reserved one).
    pub fn prepare_store(
        &mut self,
        l1: &mut SlotTable,
        key: &[u8],
        tenant: TenantId,
    ) -> PrepareStore {
        if self.held_slots() >= MAX_HELD_SLOTS_PER_INSTANCE {
            return PrepareStore::TooManyHeld;
        }
        match l1.reserve(key, tenant) {
            Reservation::AlreadyStored => PrepareStore::AlreadyStored,
            Reservation::Full => PrepareStore::PoolFull,
            Reservation::Reserved(slot) => {
                self.reservations.insert(key.to_vec(), slot);
                PrepareStore::Reserved(SlotGrant {
                    slot,
                    offset: l1.offset(slot),
                    nbytes: l1.slot_bytes(),
                })
            }
        }
    }

    /// Publishes this instance's reservation of `key` with `nbytes` written.
    pub fn commit_store(&mut self, l1: &mut SlotTable, key: &[u8], nbytes: u64) -> CommitStore {
        let Some(&slot) = self.reservations.get(key) else {
            return CommitStore::NotReserved;
        };
        let slot_bytes = l1.slot_bytes();
        if nbytes > slot_bytes {
            return CommitStore::TooLarge { nbytes, slot_bytes };
        }
        self.reservations.remove(key);
        l1.commit(slot, nbytes);
        CommitStore::Published
    }

    /// Pins the committed slot of `key` so that it is never evicted while the worker
    /// reads it.
    pub fn prepare_retrieve(&mut self, l1: &mut SlotTable, key: &[u8]) -> PrepareRetrieve {
        match self.pins.get(key) {
            Some(&(_, count)) if count >= MAX_PINS_PER_KEY => return PrepareRetrieve::TooManyHeld,
            None if self.held_slots() >= MAX_HELD_SLOTS_PER_INSTANCE => {
                return PrepareRetrieve::TooManyHeld;
            }
            _ => {}
        }
        let Some((slot, len)) = l1.pin(key) else {
            return PrepareRetrieve::Miss;
        };
        let entry = self.pins.entry(key.to_vec()).or_insert((slot, 0));
        entry.1 += 1;
        PrepareRetrieve::Pinned(SlotGrant {
            slot,
            offset: l1.offset(slot),
            nbytes: len,
        })
    }

    /// Releases one pin of `key`; false when this instance holds none.
    pub fn commit_retrieve(&mut self, l1: &mut SlotTable, key: &[u8]) -> bool {
        let Some((slot, count)) = self.pins.get_mut(key) else {
            return false;
        };
        l1.unpin(*slot);
        *count -= 1;
        if *count == 0 {
            self.pins.remove(key);
        }
        true
    }

    /// The context is being freed: every reservation is discarded (never published)
    /// and every pin released; the slots go back to `l1`.
    pub fn release(&mut self, l1: &mut SlotTable) -> Released {
        let mut released = Released::default();
        for (_, slot) in self.reservations.drain() {
            l1.abort(slot);
            released.reservations_discarded += 1;
        }
        for (_, (slot, count)) in self.pins.drain() {
            for _ in 0..count {
                l1.unpin(slot);
            }
            released.pins_released += u64::from(count);
        }
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOT: u64 = 4096;

    fn reserve(strategy: &mut TransferStrategy, l1: &mut SlotTable, key: &[u8]) -> SlotGrant {
        match strategy.prepare_store(l1, key, TenantId(0)) {
            PrepareStore::Reserved(grant) => grant,
            other => panic!("prepare_store {key:?}: {other:?}"),
        }
    }

    #[test]
    fn store_then_retrieve_round_trips_through_the_pool() {
        let mut l1 = SlotTable::new(4, SLOT);
        let mut strategy = TransferStrategy::default();
        let grant = reserve(&mut strategy, &mut l1, b"k");
        assert_eq!(grant.nbytes, SLOT);
        assert_eq!(grant.offset, l1.offset(grant.slot));
        assert_eq!(l1.lookup_prefix(&[b"k".to_vec()]), 0, "not published yet");
        assert_eq!(
            strategy.prepare_store(&mut l1, b"k", TenantId(0)),
            PrepareStore::AlreadyStored,
            "being stored counts as stored"
        );
        assert_eq!(
            strategy.commit_store(&mut l1, b"k", SLOT + 1),
            CommitStore::TooLarge {
                nbytes: SLOT + 1,
                slot_bytes: SLOT
            }
        );
        assert_eq!(
            strategy.commit_store(&mut l1, b"k", 6),
            CommitStore::Published
        );
        assert_eq!(
            strategy.commit_store(&mut l1, b"k", 6),
            CommitStore::NotReserved
        );
        assert_eq!(l1.lookup_prefix(&[b"k".to_vec()]), 1);
        let PrepareRetrieve::Pinned(read) = strategy.prepare_retrieve(&mut l1, b"k") else {
            panic!("a committed key is pinned");
        };
        assert_eq!((read.slot, read.nbytes), (grant.slot, 6));
        assert!(strategy.commit_retrieve(&mut l1, b"k"));
        assert!(!strategy.commit_retrieve(&mut l1, b"k"), "no pin left");
        assert_eq!(
            strategy.prepare_retrieve(&mut l1, b"absent"),
            PrepareRetrieve::Miss
        );
        assert_eq!(strategy.held_slots(), 0);
    }

    #[test]
    fn release_discards_reservations_and_releases_pins_but_keeps_published_data() {
        let mut l1 = SlotTable::new(4, SLOT);
        let mut owner = TransferStrategy::default();
        let published = reserve(&mut owner, &mut l1, b"published");
        assert_eq!(
            owner.commit_store(&mut l1, b"published", 5),
            CommitStore::Published
        );
        let half = reserve(&mut owner, &mut l1, b"half-written");
        assert_ne!(half.slot, published.slot);
        for _ in 0..3 {
            assert!(matches!(
                owner.prepare_retrieve(&mut l1, b"published"),
                PrepareRetrieve::Pinned(_)
            ));
        }
        assert_eq!((owner.reservations(), owner.pins()), (1, 3));
        assert_eq!(l1.occupancy().reserved, 1);
        assert_eq!(l1.occupancy().pinned, 1);

        let released = owner.release(&mut l1);
        assert_eq!(
            released,
            Released {
                reservations_discarded: 1,
                pins_released: 3
            }
        );
        assert_eq!(owner.held_slots(), 0);
        let occupancy = l1.occupancy();
        assert_eq!((occupancy.reserved, occupancy.pinned), (0, 0));
        assert_eq!(
            l1.used_slots(),
            1,
            "the discarded slot went back to the pool"
        );
        // Both directions: the half-written key was never published, the committed one
        // stays published and readable by another instance.
        assert_eq!(l1.lookup_prefix(&[b"half-written".to_vec()]), 0);
        let mut other = TransferStrategy::default();
        let PrepareRetrieve::Pinned(read) = other.prepare_retrieve(&mut l1, b"published") else {
            panic!("published data survives its writer");
        };
        assert_eq!((read.slot, read.nbytes), (published.slot, 5));
        assert!(matches!(
            other.prepare_store(&mut l1, b"half-written", TenantId(0)),
            PrepareStore::Reserved(_)
        ));
    }

    #[test]
    fn held_slots_and_nested_pins_are_bounded() {
        let mut l1 = SlotTable::new(2, SLOT);
        let mut strategy = TransferStrategy::default();
        let grant = reserve(&mut strategy, &mut l1, b"k");
        assert_eq!(
            strategy.commit_store(&mut l1, b"k", 1),
            CommitStore::Published
        );
        assert_eq!(grant.slot, l1.pin(b"k").unwrap().0);
        l1.unpin(grant.slot);
        for _ in 0..MAX_PINS_PER_KEY {
            assert!(matches!(
                strategy.prepare_retrieve(&mut l1, b"k"),
                PrepareRetrieve::Pinned(_)
            ));
        }
        assert_eq!(
            strategy.prepare_retrieve(&mut l1, b"k"),
            PrepareRetrieve::TooManyHeld
        );
        assert_eq!(
            strategy.release(&mut l1).pins_released,
            u64::from(MAX_PINS_PER_KEY)
        );
        assert_eq!(l1.occupancy().pinned, 0);
    }
}
