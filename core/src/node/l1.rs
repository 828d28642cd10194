//! The L1 pool's slot table: keys → slots, LRU eviction of unpinned committed slots.
//!
//! Pure bookkeeping on the node; the shell holds the memory and copies the bytes. A
//! slot being written or read is never evicted: writes hold a reservation, reads a pin.

use std::collections::{BTreeMap, HashMap};

/// Index of a slot.
pub type SlotId = usize;

#[derive(Debug)]
enum SlotState {
    Free,
    /// A store is copying into the slot.
    Writing {
        key: Vec<u8>,
    },
    /// Holds `len` bytes of `key`; evictable while `pins == 0`.
    Committed {
        key: Vec<u8>,
        len: u64,
        pins: u32,
        tick: u64,
    },
}

/// The outcome of asking for a slot to store a key.
#[derive(Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The key is already stored (or being stored): nothing to copy.
    AlreadyStored,
    /// Copy into this slot, then `commit` (or `abort`).
    Reserved(SlotId),
    /// Every slot is pinned or being written.
    Full,
}

/// Slots that LRU may not evict, by why.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Being written (a server-driven store's copy, or an engine-driven reservation).
    pub reserved: usize,
    /// Committed and pinned by at least one read.
    pub pinned: usize,
}

/// The slot table: which key each slot holds, in which state, and the LRU order of
/// the evictable ones. Bookkeeping only: the bytes live in the shell's pool.
#[derive(Debug)]
pub struct SlotTable {
    slot_bytes: u64,
    slots: Vec<SlotState>,
    index: HashMap<Vec<u8>, SlotId>,
    free: Vec<SlotId>,
    /// Evictable committed slots by last use.
    lru: BTreeMap<u64, SlotId>,
    tick: u64,
}

impl SlotTable {
    /// A table of `num_slots` slots of `slot_bytes` each, all free.
    pub fn new(num_slots: usize, slot_bytes: u64) -> SlotTable {
        SlotTable {
            slot_bytes,
            slots: (0..num_slots).map(|_| SlotState::Free).collect(),
            index: HashMap::new(),
            free: (0..num_slots).rev().collect(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Slots reserved for a write and slots pinned for a read, counted now (a scan:
    /// for status pages, not for the request path).
    pub fn occupancy(&self) -> Occupancy {
        let mut occupancy = Occupancy::default();
        for state in &self.slots {
            match state {
                SlotState::Writing { .. } => occupancy.reserved += 1,
                SlotState::Committed { pins, .. } if *pins > 0 => occupancy.pinned += 1,
                _ => {}
            }
        }
        occupancy
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Slots not free.
    pub fn used_slots(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Byte offset of a slot in the pool.
    pub fn offset(&self, slot: SlotId) -> u64 {
        slot as u64 * self.slot_bytes
    }

    /// A slot to store `key` into, evicting the least recently used unpinned slot if
    /// needed.
    pub fn reserve(&mut self, key: &[u8]) -> Reservation {
        if self.index.contains_key(key) {
            return Reservation::AlreadyStored;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => match self.lru.pop_first() {
                Some((_, victim)) => {
                    if let SlotState::Committed { key, .. } =
                        std::mem::replace(&mut self.slots[victim], SlotState::Free)
                    {
                        self.index.remove(&key);
                    }
                    victim
                }
                None => return Reservation::Full,
            },
        };
        self.slots[slot] = SlotState::Writing { key: key.to_vec() };
        self.index.insert(key.to_vec(), slot);
        Reservation::Reserved(slot)
    }

    /// The copy into a reserved slot finished: publish `len` bytes.
    pub fn commit(&mut self, slot: SlotId, len: u64) {
        let tick = self.next_tick();
        if let Some(state) = self.slots.get_mut(slot)
            && let SlotState::Writing { key } = std::mem::replace(state, SlotState::Free)
        {
            *state = SlotState::Committed {
                key,
                len,
                pins: 0,
                tick,
            };
            self.lru.insert(tick, slot);
        }
    }

    /// The copy into a reserved slot failed: the slot goes back, never published.
    pub fn abort(&mut self, slot: SlotId) {
        if let Some(state) = self.slots.get_mut(slot)
            && let SlotState::Writing { key } = std::mem::replace(state, SlotState::Free)
        {
            self.index.remove(&key);
            self.free.push(slot);
        }
    }

    /// Pins the committed slot of `key` for a read: `(slot, len)`, or None on a miss.
    pub fn pin(&mut self, key: &[u8]) -> Option<(SlotId, u64)> {
        let slot = *self.index.get(key)?;
        match &mut self.slots[slot] {
            SlotState::Committed {
                len, pins, tick, ..
            } => {
                if *pins == 0 {
                    self.lru.remove(tick);
                }
                *pins += 1;
                Some((slot, *len))
            }
            _ => None,
        }
    }

    /// Pins a committed slot by its index (to write it to L2 while it stays put):
    /// `(key, len)`, or None when the slot holds no committed value.
    pub fn pin_slot(&mut self, slot: SlotId) -> Option<(Vec<u8>, u64)> {
        match self.slots.get_mut(slot)? {
            SlotState::Committed {
                key,
                len,
                pins,
                tick,
            } => {
                if *pins == 0 {
                    self.lru.remove(tick);
                }
                *pins += 1;
                Some((key.clone(), *len))
            }
            _ => None,
        }
    }

    /// A read of a pinned slot finished.
    pub fn unpin(&mut self, slot: SlotId) {
        let next = self.next_tick();
        if let Some(SlotState::Committed { pins, tick, .. }) = self.slots.get_mut(slot)
            && *pins > 0
        {
            *pins -= 1;
            if *pins == 0 {
                *tick = next;
                self.lru.insert(next, slot);
            }
        }
    }

    /// How many leading keys are stored (committed).
    pub fn lookup_prefix(&self, keys: &[Vec<u8>]) -> u64 {
        keys.iter()
            .take_while(|key| {
                self.index
                    .get(key.as_slice())
                    .is_some_and(|&slot| matches!(self.slots[slot], SlotState::Committed { .. }))
            })
            .count() as u64
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_unpinned_and_full_when_everything_is_pinned() {
        let mut l1 = SlotTable::new(2, 4096);
        assert_eq!(l1.num_slots(), 2);
        let Reservation::Reserved(a) = l1.reserve(b"a") else {
            panic!()
        };
        l1.commit(a, 10);
        assert_eq!(l1.reserve(b"a"), Reservation::AlreadyStored);
        let Reservation::Reserved(b) = l1.reserve(b"b") else {
            panic!()
        };
        l1.commit(b, 10);
        assert_eq!(
            l1.lookup_prefix(&[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]),
            2
        );
        // Pin b, then a third key evicts a (the only unpinned one).
        let (pinned, len) = l1.pin(b"b").unwrap();
        assert_eq!(len, 10);
        let Reservation::Reserved(c) = l1.reserve(b"c") else {
            panic!()
        };
        assert_eq!(c, a);
        assert_eq!(l1.lookup_prefix(&[b"a".to_vec()]), 0);
        // c is being written and b is pinned: full.
        assert_eq!(l1.reserve(b"d"), Reservation::Full);
        l1.abort(c);
        l1.unpin(pinned);
        assert!(matches!(l1.reserve(b"d"), Reservation::Reserved(_)));
    }

    /// Random reserve/commit/abort/pin/unpin sequences: a slot that is reserved or
    /// pinned is never handed out again, and a reservation is refused (`Full`) only
    /// when every slot is reserved or pinned.
    #[test]
    fn lru_never_evicts_a_pinned_or_reserved_slot() {
        const SLOTS: usize = 6;
        let mut l1 = SlotTable::new(SLOTS, 4096);
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut reserved: Vec<(Vec<u8>, SlotId)> = Vec::new();
        let mut pinned: Vec<(Vec<u8>, SlotId)> = Vec::new();
        for round in 0..20_000u64 {
            let key = format!("k{}", next() % 24).into_bytes();
            match next() % 5 {
                0 | 1 => match l1.reserve(&key) {
                    Reservation::Reserved(slot) => {
                        assert!(
                            !reserved.iter().chain(&pinned).any(|(_, s)| *s == slot),
                            "round {round}: slot {slot} handed out while reserved or pinned"
                        );
                        reserved.push((key, slot));
                    }
                    Reservation::Full => {
                        let held: std::collections::HashSet<SlotId> =
                            reserved.iter().chain(&pinned).map(|(_, s)| *s).collect();
                        assert_eq!(held.len(), SLOTS, "round {round}: Full with free slots");
                    }
                    Reservation::AlreadyStored => {}
                },
                2 if !reserved.is_empty() => {
                    let (key, slot) = reserved.swap_remove((next() as usize) % reserved.len());
                    if next() % 4 == 0 {
                        l1.abort(slot);
                    } else {
                        l1.commit(slot, key.len() as u64);
                    }
                }
                3 => {
                    if let Some((slot, len)) = l1.pin(&key) {
                        assert_eq!(len, key.len() as u64);
                        pinned.push((key, slot));
                    }
                }
                _ if !pinned.is_empty() => {
                    let (_, slot) = pinned.swap_remove((next() as usize) % pinned.len());
                    l1.unpin(slot);
                }
                _ => {}
            }
            for (key, _) in &pinned {
                assert_eq!(
                    l1.lookup_prefix(std::slice::from_ref(key)),
                    1,
                    "pinned stays"
                );
            }
            let occupancy = l1.occupancy();
            assert_eq!(occupancy.reserved, reserved.len());
            let distinct_pins: std::collections::HashSet<SlotId> =
                pinned.iter().map(|(_, s)| *s).collect();
            assert_eq!(occupancy.pinned, distinct_pins.len());
        }
    }
}
