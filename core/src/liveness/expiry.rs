//! Deadlines without scans: a timing wheel of coarse buckets, re-checked lazily and a
//! bounded amount per turn.
//!
//! Every tracked instance has exactly one item: its slot number, in the bucket of the
//! tick in which its recorded deadline falls (ZooKeeper-style; a tick is the largest
//! power of two of nanoseconds not above `resolution`, so a deadline's tick is a
//! shift). Evidence of life never moves an item: when its bucket fires, the
//! registry re-checks the slot's current silence and either reaps the instance or files
//! the slot again once. A `ping` costs O(1), a turn in which no bucket fires costs
//! O(1), and nothing ever walks every instance.
//!
//! A bucket fires at the end of its tick, strictly after every deadline in it and at
//! most `resolution` later: reaps are never early. A bucket too large for one turn is
//! taken out whole and worked off over several turns ([`ExpiryWheel::pending`]); the
//! registry asks to be woken at once while any of it is left, so the rest is judged
//! right after the shell has read its input, never later than `resolution` for it.
//!
//! The wheel covers `W` ticks from the next one to fire (`W` a power of two, at least
//! the reap timeout's ticks, at most [`MAX_WHEEL_TICKS`]); items further out wait in
//! an ordered overflow and move into the wheel as it turns. A bucket is a list of
//! chunks of at most [`CHUNK_SLOTS`] items, so that no single push copies or faults in
//! more than one chunk however large the bucket grows (a million instances registered
//! in the same second share one), and worked-off chunks are reused.

use std::collections::BTreeMap;

/// A dense slot number of the registry.
pub(crate) type Slot = u32;

/// The most buckets the wheel holds; a reap timeout longer than this many ticks files
/// its items in the overflow map first.
pub(crate) const MAX_WHEEL_TICKS: u64 = 4096;

/// Items per chunk of a bucket (16 KiB).
pub(crate) const CHUNK_SLOTS: usize = 4096;

/// Worked-off chunks kept for reuse (at most 4 MiB).
const SPARE_CHUNKS: usize = 256;

/// The items of one tick.
#[derive(Debug, Default)]
struct Bucket {
    /// Every chunk but the last is full.
    chunks: Vec<Vec<Slot>>,
    len: usize,
}

impl Bucket {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, slot: Slot, spare: &mut Vec<Vec<Slot>>) {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK_SLOTS => chunk.push(slot),
            full => {
                // A worked-off chunk if there is one (no allocation, no page faults on
                // the reaper's path); a bucket's second and later chunks are whole.
                let mut chunk = spare.pop().unwrap_or_default();
                if full.is_some() {
                    chunk.reserve_exact(CHUNK_SLOTS);
                }
                chunk.push(slot);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    fn append(&mut self, other: &mut Bucket) {
        self.len += other.len;
        other.len = 0;
        self.chunks.append(&mut other.chunks);
    }
}

#[derive(Debug)]
pub(crate) struct ExpiryWheel {
    /// Ticks are `2^shift` ns wide.
    shift: u32,
    tick_nanos: u64,
    mask: u64,
    /// The next tick to fire; every queued item's tick is at least this.
    base: u64,
    /// Bucket `tick & mask` holds the items of `tick` for ticks `base..base + W`.
    wheel: Vec<Bucket>,
    wheel_len: usize,
    /// Ticks `base + W` and later.
    far: BTreeMap<u64, Bucket>,
    far_len: usize,
    /// The bucket being worked off: its next chunk and the position in it.
    firing: Bucket,
    chunk: usize,
    cursor: usize,
    /// Items of `firing` not yet handed out.
    firing_left: usize,
    spare: Vec<Vec<Slot>>,
    /// The earliest tick holding an item (`u64::MAX` when none); exact after
    /// [`ExpiryWheel::settle`], a lower bound between.
    earliest: u64,
}

impl ExpiryWheel {
    /// Ticks of the largest power of two of nanoseconds not above `resolution_nanos`
    /// (a tick then ends at most a resolution after any deadline in it, and a deadline's
    /// tick is a shift away), with room for deadlines `horizon_nanos` ahead before the
    /// overflow is used.
    pub(crate) fn new(resolution_nanos: u64, horizon_nanos: u64) -> ExpiryWheel {
        let shift = 63 - resolution_nanos.max(1).leading_zeros();
        let tick_nanos = 1u64 << shift;
        let ticks = (horizon_nanos / tick_nanos)
            .saturating_add(2)
            .clamp(8, MAX_WHEEL_TICKS)
            .next_power_of_two();
        ExpiryWheel {
            shift,
            tick_nanos,
            mask: ticks - 1,
            base: 0,
            wheel: (0..ticks).map(|_| Bucket::default()).collect(),
            wheel_len: 0,
            far: BTreeMap::new(),
            far_len: 0,
            firing: Bucket::default(),
            chunk: 0,
            cursor: 0,
            firing_left: 0,
            spare: Vec::new(),
            earliest: u64::MAX,
        }
    }

    fn ticks(&self) -> u64 {
        self.mask + 1
    }

    /// Files `slot` for the first instant strictly after `deadline` that ends a tick
    /// (or the next tick to fire, if that is later).
    pub(crate) fn schedule(&mut self, deadline: u64, slot: Slot) {
        let tick = (deadline >> self.shift).saturating_add(1).max(self.base);
        if tick - self.base < self.ticks() {
            self.wheel[(tick & self.mask) as usize].push(slot, &mut self.spare);
            self.wheel_len += 1;
        } else {
            self.far
                .entry(tick)
                .or_default()
                .push(slot, &mut self.spare);
            self.far_len += 1;
        }
        self.earliest = self.earliest.min(tick);
    }

    /// Whether a bucket that fired is not yet worked off.
    pub(crate) fn pending(&self) -> bool {
        self.firing_left > 0
    }

    /// When the earliest bucket fires (not counting a pending one).
    pub(crate) fn next_fire(&self) -> Option<u64> {
        (self.earliest != u64::MAX).then(|| self.earliest.saturating_mul(self.tick_nanos))
    }

    /// The next slots to re-check at `now`, into `out`: the rest of the pending bucket
    /// first, then the buckets that fire at or before `now`, in order. Returns how many;
    /// fewer than `out` holds only when nothing more is due.
    pub(crate) fn pop_batch(&mut self, now: u64, out: &mut [Slot]) -> usize {
        let mut taken = 0;
        while taken < out.len() {
            let Some(chunk) = self.firing.chunks.get_mut(self.chunk) else {
                if !self.advance(now) {
                    break;
                }
                continue;
            };
            let rest = &chunk[self.cursor.min(chunk.len())..];
            if !rest.is_empty() {
                let n = rest.len().min(out.len() - taken);
                out[taken..taken + n].copy_from_slice(&rest[..n]);
                self.cursor += n;
                self.firing_left -= n;
                taken += n;
                continue;
            }
            // Worked off: keep the chunk for the buckets being filled meanwhile.
            let mut done = std::mem::take(chunk);
            if done.capacity() > 0 && self.spare.len() < SPARE_CHUNKS {
                done.clear();
                self.spare.push(done);
            }
            self.chunk += 1;
            self.cursor = 0;
        }
        taken
    }

    /// The next slot to re-check at `now` (as [`ExpiryWheel::pop_batch`], one at a time).
    #[cfg(test)]
    pub(crate) fn pop(&mut self, now: u64) -> Option<Slot> {
        let mut one = [0];
        (self.pop_batch(now, &mut one) == 1).then_some(one[0])
    }

    /// The pending bucket is worked off: take out the next one that fires at or before
    /// `now`, if any.
    fn advance(&mut self, now: u64) -> bool {
        self.firing.chunks.clear();
        self.firing.len = 0;
        self.chunk = 0;
        self.cursor = 0;
        loop {
            if self.base.saturating_mul(self.tick_nanos) > now {
                return false;
            }
            if self.wheel_len == 0 {
                // Nothing in the wheel: jump straight to the overflow or to now.
                let now_tick = now >> self.shift;
                match self.far.first_key_value() {
                    Some((&tick, _)) if tick <= now_tick => self.base = tick,
                    _ => {
                        self.base = now_tick.saturating_add(1);
                        self.pull_far();
                        return false;
                    }
                }
                self.pull_far();
            }
            let bucket = &mut self.wheel[(self.base & self.mask) as usize];
            std::mem::swap(bucket, &mut self.firing);
            self.wheel_len -= self.firing.len;
            self.firing_left = self.firing.len;
            self.base = self.base.saturating_add(1);
            self.pull_far();
            if self.firing_left > 0 {
                return true;
            }
        }
    }

    /// Moves the overflow's buckets that the wheel now covers into it.
    fn pull_far(&mut self) {
        let ticks = self.ticks();
        while let Some(entry) = self.far.first_entry() {
            if entry.key().saturating_sub(self.base) >= ticks {
                break;
            }
            let tick = *entry.key();
            let mut items = entry.remove();
            self.far_len -= items.len;
            self.wheel_len += items.len;
            let bucket = &mut self.wheel[(tick & self.mask) as usize];
            if bucket.is_empty() {
                std::mem::swap(bucket, &mut items);
            } else {
                bucket.append(&mut items);
            }
        }
    }

    /// Makes [`ExpiryWheel::next_fire`] exact again after a turn.
    pub(crate) fn settle(&mut self) {
        self.earliest = u64::MAX;
        if self.wheel_len > 0 {
            for tick in self.base..self.base.saturating_add(self.ticks()) {
                if !self.wheel[(tick & self.mask) as usize].is_empty() {
                    self.earliest = tick;
                    return;
                }
            }
        }
        if let Some((&tick, _)) = self.far.first_key_value() {
            self.earliest = tick;
        }
    }

    /// Items queued, the rest of a pending bucket included.
    pub(crate) fn len(&self) -> usize {
        self.wheel_len + self.far_len + self.firing_left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(wheel: &mut ExpiryWheel, now: u64) -> Vec<Slot> {
        let mut out = Vec::new();
        while let Some(slot) = wheel.pop(now) {
            out.push(slot);
        }
        wheel.settle();
        out
    }

    #[test]
    fn ticks_are_the_largest_power_of_two_within_the_resolution() {
        for (resolution, tick) in [(1, 1), (10, 8), (16, 16), (1_000_000_000, 1 << 29)] {
            assert_eq!(ExpiryWheel::new(resolution, 100).tick_nanos, tick);
        }
    }

    #[test]
    fn a_bucket_fires_strictly_after_its_deadlines_and_within_one_tick() {
        let mut wheel = ExpiryWheel::new(8, 100);
        wheel.schedule(16, 1); // on a tick boundary: fires at 24
        wheel.schedule(23, 2); // same tick
        assert_eq!(wheel.next_fire(), Some(24));
        assert_eq!(drain(&mut wheel, 23), Vec::<Slot>::new());
        assert_eq!(wheel.next_fire(), Some(24));
        assert_eq!(drain(&mut wheel, 24), vec![1, 2]);
        assert_eq!(wheel.len(), 0);
        assert_eq!(wheel.next_fire(), None);
    }

    #[test]
    fn items_beyond_the_wheel_wait_in_the_overflow_and_fire_in_order() {
        let mut wheel = ExpiryWheel::new(8, 40); // 8 ticks
        wheel.schedule(1_000, 3);
        wheel.schedule(35, 2);
        wheel.schedule(5_000, 4);
        wheel.schedule(5, 1);
        assert_eq!(wheel.len(), 4);
        assert_eq!(drain(&mut wheel, 8), vec![1]);
        assert_eq!(wheel.next_fire(), Some(40));
        assert_eq!(drain(&mut wheel, 999), vec![2]);
        assert_eq!(wheel.next_fire(), Some(1_008));
        assert_eq!(drain(&mut wheel, 1_008), vec![3]);
        assert_eq!(drain(&mut wheel, 1_000_000), vec![4]);
        assert_eq!(wheel.len(), 0);
        // After a jump, new items still land after the jump.
        wheel.schedule(0, 5);
        assert_eq!(wheel.next_fire(), Some(1_000_008));
    }

    #[test]
    fn a_bucket_larger_than_a_chunk_hands_out_every_item_once_in_order() {
        let mut wheel = ExpiryWheel::new(8, 100);
        let count = 3 * CHUNK_SLOTS as u32 + 5;
        for slot in 0..count {
            wheel.schedule(5, slot);
        }
        assert_eq!(wheel.len(), count as usize);
        let mut seen = Vec::new();
        let mut batch = [0; 100];
        loop {
            let taken = wheel.pop_batch(8, &mut batch);
            for &slot in &batch[..taken] {
                seen.push(slot);
                wheel.schedule(50, slot); // refiled meanwhile, from reused chunks
            }
            if taken < batch.len() {
                break;
            }
        }
        assert_eq!(seen, (0..count).collect::<Vec<_>>());
        assert!(!wheel.pending());
        wheel.settle();
        assert_eq!(wheel.len(), count as usize);
        assert_eq!(drain(&mut wheel, 56), (0..count).collect::<Vec<_>>());
    }

    #[test]
    fn a_bucket_taken_out_is_worked_off_before_later_ones() {
        let mut wheel = ExpiryWheel::new(8, 100);
        for slot in 0..5 {
            wheel.schedule(5, slot);
        }
        wheel.schedule(15, 9);
        assert_eq!(wheel.pop(100), Some(0));
        assert!(wheel.pending());
        wheel.schedule(150, 7); // filed meanwhile
        let rest: Vec<Slot> = std::iter::from_fn(|| wheel.pop(100)).collect();
        assert_eq!(rest, vec![1, 2, 3, 4, 9]);
        assert!(!wheel.pending());
        wheel.settle();
        assert_eq!(wheel.next_fire(), Some(152));
    }
}
