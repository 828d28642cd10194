//! The L1 pool's slot table: keys → slots, LRU eviction of unpinned committed slots.
//!
//! Pure bookkeeping on the node; the shell holds the memory and copies the bytes. A
//! slot being written or read is never evicted: writes hold a reservation, reads a pin.
//!
//! Every slot is charged to the tenant that stored it. A full pool evicts from the
//! tenant furthest over its quota first (its own least recently used slot), and only
//! when no tenant is over its quota the pool's least recently used slot: so a
//! neighbour that floods the pool recycles its own slots, not another tenant's share.

use super::trust::TenantId;
use std::collections::{BTreeMap, HashMap};

/// Index of a slot.
pub type SlotId = usize;

#[derive(Debug)]
enum SlotState {
    Free,
    /// A restarted server's pool slot whose seal is not checked yet (failure mode 71):
    /// neither served nor free; a store takes one only when nothing else is left.
    Unscanned,
    /// A store is copying into the slot.
    Writing {
        key: Vec<u8>,
        tenant: TenantId,
    },
    /// Holds `len` bytes of `key`; evictable while `pins == 0`.
    Committed {
        key: Vec<u8>,
        len: u64,
        pins: u32,
        tick: u64,
        tenant: TenantId,
    },
}

/// One tenant's part of the pool.
#[derive(Debug, Default)]
struct TenantSlots {
    /// Slots charged to it (being written or committed).
    used: usize,
    /// Its evictable committed slots by last use.
    lru: BTreeMap<u64, SlotId>,
    /// Its quota in slots; None: a fair share of the tenants holding slots.
    quota: Option<usize>,
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
    tenants: Vec<TenantSlots>,
    /// Slots not scanned yet, for a store to take when nothing else is left (an entry
    /// may be stale: scanned since).
    unscanned: Vec<SlotId>,
    /// Whether committed values are sealed (a pool that outlives the process).
    sealing: bool,
    /// Committed values to seal: `(slot, key, len)`, pinned until sealed.
    to_seal: Vec<(SlotId, Vec<u8>, u64)>,
    /// Values handed out to be sealed and not sealed yet.
    sealing_now: usize,
    /// Values whose seal could not be written (not adopted after a restart).
    unsealed_total: u64,
    /// Keys that entered L1 (true) or left it since the last [`SlotTable::take_changes`].
    changes: Vec<(Vec<u8>, bool)>,
    /// What committed slots' values are, as their writers described them
    /// (`describe_keys`), and the bytes of those descriptions.
    meta: HashMap<SlotId, Box<[u8]>>,
    meta_bytes: usize,
}

/// The bytes of descriptions L1 keeps at most, all slots together.
pub const MAX_META_TOTAL: usize = 64 << 20;

/// The outcome of adopting a slot a restarted server found sealed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// Committed again, under its tenant, evictable.
    Adopted,
    /// The slot was taken by a store before its seal was checked.
    Taken,
    /// Another slot holds the same key already.
    Duplicate,
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
            tenants: Vec::new(),
            unscanned: Vec::new(),
            sealing: false,
            to_seal: Vec::new(),
            sealing_now: 0,
            unsealed_total: 0,
            changes: Vec::new(),
            meta: HashMap::new(),
            meta_bytes: 0,
        }
    }

    /// Makes every slot of an empty table unscanned (a restarted server's pool) until
    /// its seal is checked ([`SlotTable::adopt`], [`SlotTable::scanned_empty`]).
    pub fn mark_unscanned(&mut self) {
        if self.free.len() != self.slots.len() {
            return;
        }
        self.slots
            .iter_mut()
            .for_each(|slot| *slot = SlotState::Unscanned);
        // Taken from the end: the slots the scan reaches last.
        self.free.clear();
        self.unscanned = (0..self.slots.len()).collect();
    }

    /// The tenant charged for `slot`, if it holds a value or a write.
    pub fn tenant_of(&self, slot: SlotId) -> Option<TenantId> {
        match self.slots.get(slot)? {
            SlotState::Writing { tenant, .. } | SlotState::Committed { tenant, .. } => {
                Some(*tenant)
            }
            SlotState::Free | SlotState::Unscanned => None,
        }
    }

    /// Seals every value committed from now on ([`SlotTable::take_seals`]).
    pub fn seal_commits(&mut self) {
        self.sealing = true;
    }

    /// The values committed since the last call, each pinned until
    /// [`SlotTable::unpin`]: `(slot, key, len)`.
    pub fn take_seals(&mut self) -> Vec<(SlotId, Vec<u8>, u64)> {
        self.sealing_now += self.to_seal.len();
        std::mem::take(&mut self.to_seal)
    }

    /// `slot`'s seal ended, `written` or not: it is unpinned.
    pub fn sealed(&mut self, slot: SlotId, written: bool) {
        self.sealing_now = self.sealing_now.saturating_sub(1);
        self.unsealed_total += u64::from(!written);
        self.unpin(slot);
    }

    /// Values whose seal could not be written so far.
    pub fn unsealed_total(&self) -> u64 {
        self.unsealed_total
    }

    /// Values committed and not sealed yet.
    pub fn sealing(&self) -> usize {
        self.sealing_now + self.to_seal.len()
    }

    /// Whether `slot` is still unscanned.
    pub fn is_unscanned(&self, slot: SlotId) -> bool {
        matches!(self.slots.get(slot), Some(SlotState::Unscanned))
    }

    /// Adopts unscanned `slot`, found sealed with `len` bytes of `key` of `tenant`.
    pub fn adopt(&mut self, slot: SlotId, key: Vec<u8>, len: u64, tenant: TenantId) -> Adoption {
        if !self.is_unscanned(slot) {
            return Adoption::Taken;
        }
        if self.index.contains_key(&key) {
            self.scanned_empty(slot);
            return Adoption::Duplicate;
        }
        let tick = self.next_tick();
        self.forget_meta(slot);
        self.index.insert(key.clone(), slot);
        self.changes.push((key.clone(), true));
        self.slots[slot] = SlotState::Committed {
            key,
            len,
            pins: 0,
            tick,
            tenant,
        };
        self.tenant_mut(tenant).used += 1;
        self.lru_add(tick, slot, tenant);
        Adoption::Adopted
    }

    /// Attaches `meta` to committed `key` (replacing what it had), and tells readers the
    /// key again, now with it. False when L1 holds no committed value of `key`, or the
    /// descriptions would take more than [`MAX_META_TOTAL`].
    pub fn describe(&mut self, key: &[u8], meta: Vec<u8>) -> bool {
        let Some(&slot) = self.index.get(key) else {
            return false;
        };
        if !matches!(self.slots[slot], SlotState::Committed { .. }) {
            return false;
        }
        let old = self.meta.get(&slot).map_or(0, |m| m.len());
        if self.meta_bytes - old + meta.len() > MAX_META_TOTAL {
            return false;
        }
        self.meta_bytes = self.meta_bytes - old + meta.len();
        self.meta.insert(slot, meta.into_boxed_slice());
        self.changes.push((key.to_vec(), true));
        true
    }

    /// The description of committed `key`, if it has one.
    pub fn meta_of(&self, key: &[u8]) -> Option<&[u8]> {
        let &slot = self.index.get(key)?;
        matches!(self.slots[slot], SlotState::Committed { .. })
            .then(|| self.meta.get(&slot).map(|m| &m[..]))
            .flatten()
    }

    /// `slot` takes a new value: its description goes.
    fn forget_meta(&mut self, slot: SlotId) {
        if let Some(meta) = self.meta.remove(&slot) {
            self.meta_bytes -= meta.len();
        }
    }

    /// The keys that entered L1 (true) or left it since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<(Vec<u8>, bool)> {
        std::mem::take(&mut self.changes)
    }

    /// Up to `max` keys under `prefix` committed in slots from `from` on, in slot
    /// order, and the slot to go on from (None: none left).
    pub fn committed_from(
        &self,
        prefix: &[u8],
        from: usize,
        max: usize,
    ) -> (Vec<Vec<u8>>, Option<usize>) {
        let mut keys = Vec::new();
        for (slot, state) in self.slots.iter().enumerate().skip(from) {
            if let SlotState::Committed { key, .. } = state
                && key.starts_with(prefix)
            {
                if keys.len() == max {
                    return (keys, Some(slot));
                }
                keys.push(key.clone());
            }
        }
        (keys, None)
    }

    /// The key `slot` holds committed, if any.
    pub fn committed_key(&self, slot: SlotId) -> Option<&[u8]> {
        match self.slots.get(slot)? {
            SlotState::Committed { key, .. } => Some(key),
            _ => None,
        }
    }

    /// The planted bug `AdoptTaken`: `slot`, taken by a store since the scan began, is
    /// treated as unscanned again (its store's key still names it).
    #[cfg(feature = "planted-bugs")]
    pub fn forget_taken(&mut self, slot: SlotId) {
        if let Some(state @ (SlotState::Writing { .. } | SlotState::Committed { .. })) =
            self.slots.get_mut(slot)
        {
            *state = SlotState::Unscanned;
        }
    }

    /// Unscanned `slot` holds nothing to adopt: it is free.
    pub fn scanned_empty(&mut self, slot: SlotId) {
        if self.is_unscanned(slot) {
            self.slots[slot] = SlotState::Free;
            self.free.push(slot);
        }
    }

    fn tenant_mut(&mut self, tenant: TenantId) -> &mut TenantSlots {
        let index = tenant.0 as usize;
        if self.tenants.len() <= index {
            self.tenants.resize_with(index + 1, TenantSlots::default);
        }
        &mut self.tenants[index]
    }

    /// Sets `tenant`'s quota to `slots` (None: a fair share).
    pub fn set_quota(&mut self, tenant: TenantId, slots: Option<usize>) {
        self.tenant_mut(tenant).quota = slots;
    }

    /// Slots charged to `tenant` now.
    pub fn tenant_slots(&self, tenant: TenantId) -> usize {
        self.tenants.get(tenant.0 as usize).map_or(0, |t| t.used)
    }

    /// `tenant`'s quota in slots now: its own, else a fair share of the pool among the
    /// tenants holding slots (itself counted).
    pub fn quota_slots(&self, tenant: TenantId) -> usize {
        let own = self.tenants.get(tenant.0 as usize);
        let holding = self.tenants.iter().filter(|t| t.used > 0).count();
        let counted = holding + usize::from(own.is_none_or(|t| t.used == 0));
        self.quota_given(own, counted)
    }

    /// A tenant's quota when `holding` tenants (it among them) hold slots.
    fn quota_given(&self, tenant: Option<&TenantSlots>, holding: usize) -> usize {
        tenant
            .and_then(|t| t.quota)
            .unwrap_or_else(|| self.slots.len().div_ceil(holding.max(1)))
    }

    fn lru_add(&mut self, tick: u64, slot: SlotId, tenant: TenantId) {
        self.lru.insert(tick, slot);
        self.tenant_mut(tenant).lru.insert(tick, slot);
    }

    fn lru_remove(&mut self, tick: u64, tenant: TenantId) {
        self.lru.remove(&tick);
        self.tenant_mut(tenant).lru.remove(&tick);
    }

    /// The slot to evict: the least recently used of the tenant furthest over its
    /// quota, else the pool's least recently used; None when nothing is evictable. One
    /// pass over the tenants (only when the pool is full).
    fn victim(&self) -> Option<(u64, SlotId)> {
        let holding = self.tenants.iter().filter(|t| t.used > 0).count();
        let over = self
            .tenants
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.lru.is_empty())
            .filter_map(|(index, t)| {
                // A tenant with evictable slots holds slots: `holding` counts it.
                let excess = t.used.checked_sub(self.quota_given(Some(t), holding))?;
                (excess > 0).then_some((excess, index))
            })
            .max_by_key(|&(excess, index)| (excess, std::cmp::Reverse(index)));
        match over {
            Some((_, index)) => self.tenants[index].lru.first_key_value(),
            None => self.lru.first_key_value(),
        }
        .map(|(&tick, &slot)| (tick, slot))
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

    /// A slot to store `key` into for `tenant`, evicting an unpinned slot if needed
    /// (see the module docs for which).
    pub fn reserve(&mut self, key: &[u8], tenant: TenantId) -> Reservation {
        if self.index.contains_key(key) {
            return Reservation::AlreadyStored;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => match self.victim() {
                Some((tick, victim)) => {
                    if let SlotState::Committed {
                        key, tenant: owner, ..
                    } = std::mem::replace(&mut self.slots[victim], SlotState::Free)
                    {
                        self.index.remove(&key);
                        self.changes.push((key, false));
                        self.lru_remove(tick, owner);
                        let owner = self.tenant_mut(owner);
                        owner.used = owner.used.saturating_sub(1);
                    }
                    victim
                }
                None => match self.take_unscanned() {
                    Some(slot) => slot,
                    None => return Reservation::Full,
                },
            },
        };
        self.forget_meta(slot);
        self.slots[slot] = SlotState::Writing {
            key: key.to_vec(),
            tenant,
        };
        self.tenant_mut(tenant).used += 1;
        self.index.insert(key.to_vec(), slot);
        Reservation::Reserved(slot)
    }

    /// An unscanned slot for a store, its seal never checked: the pool is full of
    /// pinned, reserved and unscanned slots only.
    fn take_unscanned(&mut self) -> Option<SlotId> {
        while let Some(slot) = self.unscanned.pop() {
            if self.is_unscanned(slot) {
                self.slots[slot] = SlotState::Free;
                return Some(slot);
            }
        }
        None
    }

    /// The copy into a reserved slot finished: publish `len` bytes (pinned until
    /// sealed, when values are sealed).
    pub fn commit(&mut self, slot: SlotId, len: u64) {
        let tick = self.next_tick();
        if let Some(state) = self.slots.get_mut(slot)
            && let SlotState::Writing { key, tenant } = std::mem::replace(state, SlotState::Free)
        {
            self.changes.push((key.clone(), true));
            if self.sealing {
                self.to_seal.push((slot, key.clone(), len));
                *state = SlotState::Committed {
                    key,
                    len,
                    pins: 1,
                    tick,
                    tenant,
                };
                return;
            }
            *state = SlotState::Committed {
                key,
                len,
                pins: 0,
                tick,
                tenant,
            };
            self.lru_add(tick, slot, tenant);
        }
    }

    /// The copy into a reserved slot failed: the slot goes back, never published.
    pub fn abort(&mut self, slot: SlotId) {
        if let Some(state) = self.slots.get_mut(slot)
            && let SlotState::Writing { key, tenant } = std::mem::replace(state, SlotState::Free)
        {
            self.index.remove(&key);
            self.free.push(slot);
            let tenant = self.tenant_mut(tenant);
            tenant.used = tenant.used.saturating_sub(1);
        }
    }

    /// Pins the committed slot of `key` for a read: `(slot, len)`, or None on a miss.
    pub fn pin(&mut self, key: &[u8]) -> Option<(SlotId, u64)> {
        let slot = *self.index.get(key)?;
        let (unlisted, len) = match &mut self.slots[slot] {
            SlotState::Committed {
                len,
                pins,
                tick,
                tenant,
                ..
            } => {
                *pins += 1;
                ((*pins == 1).then_some((*tick, *tenant)), *len)
            }
            _ => return None,
        };
        if let Some((tick, tenant)) = unlisted {
            self.lru_remove(tick, tenant);
        }
        Some((slot, len))
    }

    /// Pins a committed slot by its index (to write it to L2 while it stays put):
    /// `(key, len)`, or None when the slot holds no committed value.
    pub fn pin_slot(&mut self, slot: SlotId) -> Option<(Vec<u8>, u64)> {
        let (unlisted, found) = match self.slots.get_mut(slot)? {
            SlotState::Committed {
                key,
                len,
                pins,
                tick,
                tenant,
            } => {
                *pins += 1;
                (
                    (*pins == 1).then_some((*tick, *tenant)),
                    (key.clone(), *len),
                )
            }
            _ => return None,
        };
        if let Some((tick, tenant)) = unlisted {
            self.lru_remove(tick, tenant);
        }
        Some(found)
    }

    /// A read of a pinned slot finished.
    pub fn unpin(&mut self, slot: SlotId) {
        let next = self.next_tick();
        if let Some(SlotState::Committed {
            pins, tick, tenant, ..
        }) = self.slots.get_mut(slot)
            && *pins > 0
        {
            *pins -= 1;
            if *pins == 0 {
                *tick = next;
                let tenant = *tenant;
                self.lru_add(next, slot, tenant);
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

    const T: TenantId = TenantId(0);

    fn stored(l1: &mut SlotTable, key: &[u8], tenant: TenantId) -> Option<SlotId> {
        match l1.reserve(key, tenant) {
            Reservation::Reserved(slot) => {
                l1.commit(slot, 1);
                Some(slot)
            }
            _ => None,
        }
    }

    /// A tenant that floods a full pool evicts its own slots once it is over its fair
    /// share, never the slots of a tenant within its share; and a tenant within its
    /// share that stores into a full pool evicts the flooder's.
    #[test]
    fn a_full_pool_evicts_the_tenant_over_its_quota_first() {
        let (victim, flooder) = (TenantId(0), TenantId(1));
        let mut l1 = SlotTable::new(8, 64);
        for key in [b"v0", b"v1", b"v2"] {
            stored(&mut l1, key, victim).unwrap();
        }
        for n in 0..100u32 {
            stored(&mut l1, format!("f{n}").as_bytes(), flooder).unwrap();
        }
        let victim_keys = [b"v0".to_vec(), b"v1".to_vec(), b"v2".to_vec()];
        assert_eq!(
            l1.lookup_prefix(&victim_keys),
            3,
            "the victim keeps its 3 slots"
        );
        assert_eq!(l1.tenant_slots(victim), 3);
        assert_eq!(l1.tenant_slots(flooder), 5);
        // The victim stores a fourth chunk (within its fair share of 4): the flooder pays.
        stored(&mut l1, b"v3", victim).unwrap();
        assert_eq!(l1.tenant_slots(victim), 4);
        assert_eq!(l1.tenant_slots(flooder), 4);
        // Control: with no tenant over its quota, plain LRU evicts the oldest (v0).
        stored(&mut l1, b"v4", victim).unwrap();
        assert_eq!(l1.lookup_prefix(&victim_keys[..1]), 0, "plain LRU took v0");
    }

    #[test]
    fn a_description_goes_with_its_value() {
        let mut l1 = SlotTable::new(1, 64);
        stored(&mut l1, b"a", T).unwrap();
        assert!(l1.describe(b"a", b"block a".to_vec()));
        assert_eq!(l1.meta_of(b"a"), Some(&b"block a"[..]));
        assert!(!l1.describe(b"b", b"never stored".to_vec()));
        // "b" evicts "a" from the only slot: the slot's new value has no description.
        stored(&mut l1, b"b", T).unwrap();
        assert_eq!((l1.meta_of(b"a"), l1.meta_of(b"b")), (None, None));
        assert_eq!(l1.meta_bytes, 0, "its bytes are given back");
    }

    #[test]
    fn a_configured_quota_overrides_the_fair_share() {
        let (small, big) = (TenantId(0), TenantId(1));
        let mut l1 = SlotTable::new(10, 64);
        l1.set_quota(small, Some(2));
        for n in 0..10u32 {
            stored(&mut l1, format!("s{n}").as_bytes(), small).unwrap();
        }
        assert_eq!(l1.tenant_slots(small), 10, "a free pool is used whole");
        for n in 0..6u32 {
            stored(&mut l1, format!("b{n}").as_bytes(), big).unwrap();
        }
        assert_eq!(l1.tenant_slots(big), 6);
        assert_eq!(l1.tenant_slots(small), 4);
        assert_eq!(l1.quota_slots(small), 2);
    }

    #[test]
    fn lru_evicts_unpinned_and_full_when_everything_is_pinned() {
        let mut l1 = SlotTable::new(2, 4096);
        assert_eq!(l1.num_slots(), 2);
        let Reservation::Reserved(a) = l1.reserve(b"a", T) else {
            panic!()
        };
        l1.commit(a, 10);
        assert_eq!(l1.reserve(b"a", T), Reservation::AlreadyStored);
        let Reservation::Reserved(b) = l1.reserve(b"b", T) else {
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
        let Reservation::Reserved(c) = l1.reserve(b"c", T) else {
            panic!()
        };
        assert_eq!(c, a);
        assert_eq!(l1.lookup_prefix(&[b"a".to_vec()]), 0);
        // c is being written and b is pinned: full.
        assert_eq!(l1.reserve(b"d", T), Reservation::Full);
        l1.abort(c);
        l1.unpin(pinned);
        assert!(matches!(l1.reserve(b"d", T), Reservation::Reserved(_)));
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
                0 | 1 => match l1.reserve(&key, T) {
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
