//! Deadlines without scans: a timing wheel of coarse buckets, re-checked lazily and a
//! bounded amount per turn.
//!
//! Every tracked instance has exactly one item: its slot number, in the bucket of the
//! tick in which its recorded deadline falls (ticks are `resolution` wide,
//! ZooKeeper-style). Evidence of life never moves an item: when its bucket fires, the
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

/// The most buckets the wheel holds; a reap timeout longer than this many resolutions
/// files its items in the overflow map first.
pub(crate) const MAX_WHEEL_TICKS: u64 = 4096;

/// Items per chunk of a bucket (16 KiB).
pub(crate) const CHUNK_SLOTS: usize = 4096;

/// Worked-off chunks kept for reuse (4 MiB).
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
                // A small bucket grows its first chunk; a large one takes whole chunks.
                let mut chunk = match full {
                    Some(_) => spare
                        .pop()
                        .unwrap_or_else(|| Vec::with_capacity(CHUNK_SLOTS)),
                    None => Vec::new(),
                };
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

/// Division by the tick width without a `div` instruction: every live instance is filed
/// once per reap timeout, and a 64-bit division is most of a re-check's cost (the
/// divider is not pipelined). `reciprocal` is `floor((2^64 - 1) / tick_nanos)`, so
/// `mulhi(n, reciprocal)` is the quotient or up to two less; the rest is corrected.
#[derive(Copy, Clone, Debug)]
struct TickDivisor {
    tick_nanos: u64,
    reciprocal: u64,
}

impl TickDivisor {
    fn new(tick_nanos: u64) -> TickDivisor {
        TickDivisor {
            tick_nanos,
            reciprocal: u64::MAX / tick_nanos,
        }
    }

    /// `nanos / tick_nanos`.
    fn ticks(self, nanos: u64) -> u64 {
        let mut quotient = ((u128::from(nanos) * u128::from(self.reciprocal)) >> 64) as u64;
        let d = u128::from(self.tick_nanos);
        while (u128::from(quotient) + 1) * d <= u128::from(nanos) {
            quotient += 1;
        }
        quotient
    }
}

#[derive(Debug)]
pub(crate) struct ExpiryWheel {
    tick_nanos: u64,
    divisor: TickDivisor,
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
    /// Ticks `tick_nanos` wide (must be > 0), with room for deadlines `horizon_nanos`
    /// ahead before the overflow is used.
    pub(crate) fn new(tick_nanos: u64, horizon_nanos: u64) -> ExpiryWheel {
        let tick_nanos = tick_nanos.max(1);
        let ticks = (horizon_nanos / tick_nanos)
            .saturating_add(2)
            .clamp(8, MAX_WHEEL_TICKS)
            .next_power_of_two();
        ExpiryWheel {
            tick_nanos,
            divisor: TickDivisor::new(tick_nanos),
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
        let tick = self
            .divisor
            .ticks(deadline)
            .saturating_add(1)
            .max(self.base);
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

    /// The next slot to re-check at `now`: the rest of the pending bucket first, then
    /// the buckets that fire at or before `now`, in order.
    pub(crate) fn pop(&mut self, now: u64) -> Option<Slot> {
        loop {
            if let Some(chunk) = self.firing.chunks.get_mut(self.chunk) {
                if let Some(&slot) = chunk.get(self.cursor) {
                    self.cursor += 1;
                    self.firing_left -= 1;
                    return Some(slot);
                }
                // Worked off: keep the chunk for the buckets being filled meanwhile.
                let mut done = std::mem::take(chunk);
                if done.capacity() == CHUNK_SLOTS && self.spare.len() < SPARE_CHUNKS {
                    done.clear();
                    self.spare.push(done);
                }
                self.chunk += 1;
                self.cursor = 0;
                continue;
            }
            self.firing.chunks.clear();
            self.firing.len = 0;
            self.chunk = 0;
            self.cursor = 0;
            if self.base.saturating_mul(self.tick_nanos) > now {
                return None;
            }
            if self.wheel_len == 0 {
                // Nothing in the wheel: jump straight to the overflow or to now.
                let now_tick = now / self.tick_nanos;
                match self.far.first_key_value() {
                    Some((&tick, _)) if tick <= now_tick => self.base = tick,
                    _ => {
                        self.base = now_tick.saturating_add(1);
                        self.pull_far();
                        return None;
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
    fn the_tick_divisor_agrees_with_division() {
        let widths = [
            1,
            2,
            3,
            7,
            1000,
            250_000_000,
            1_000_000_000,
            999_999_937,
            u64::MAX,
        ];
        let mut n = 0x9E37_79B9_7F4A_7C15u64;
        for &d in &widths {
            let divisor = TickDivisor::new(d);
            for nanos in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX - 1, u64::MAX] {
                assert_eq!(divisor.ticks(nanos), nanos / d, "{nanos} / {d}");
            }
            for _ in 0..10_000 {
                n ^= n << 13;
                n ^= n >> 7;
                n ^= n << 17;
                assert_eq!(divisor.ticks(n), n / d, "{n} / {d}");
                assert_eq!(divisor.ticks(n >> 20), (n >> 20) / d, "{} / {d}", n >> 20);
            }
        }
    }

    #[test]
    fn a_bucket_fires_strictly_after_its_deadlines_and_within_one_tick() {
        let mut wheel = ExpiryWheel::new(10, 100);
        wheel.schedule(20, 1); // on a tick boundary: fires at 30
        wheel.schedule(29, 2); // same tick
        assert_eq!(wheel.next_fire(), Some(30));
        assert_eq!(drain(&mut wheel, 29), Vec::<Slot>::new());
        assert_eq!(wheel.next_fire(), Some(30));
        assert_eq!(drain(&mut wheel, 30), vec![1, 2]);
        assert_eq!(wheel.len(), 0);
        assert_eq!(wheel.next_fire(), None);
    }

    #[test]
    fn items_beyond_the_wheel_wait_in_the_overflow_and_fire_in_order() {
        let mut wheel = ExpiryWheel::new(10, 50); // 8 ticks
        wheel.schedule(1_000, 3);
        wheel.schedule(35, 2);
        wheel.schedule(5_000, 4);
        wheel.schedule(5, 1);
        assert_eq!(wheel.len(), 4);
        assert_eq!(drain(&mut wheel, 10), vec![1]);
        assert_eq!(wheel.next_fire(), Some(40));
        assert_eq!(drain(&mut wheel, 999), vec![2]);
        assert_eq!(wheel.next_fire(), Some(1_010));
        assert_eq!(drain(&mut wheel, 1_010), vec![3]);
        assert_eq!(drain(&mut wheel, 1_000_000), vec![4]);
        assert_eq!(wheel.len(), 0);
        // After a jump, new items still land after the jump.
        wheel.schedule(0, 5);
        assert_eq!(wheel.next_fire(), Some(1_000_010));
    }

    #[test]
    fn a_bucket_larger_than_a_chunk_hands_out_every_item_once_in_order() {
        let mut wheel = ExpiryWheel::new(10, 100);
        let count = 3 * CHUNK_SLOTS as u32 + 5;
        for slot in 0..count {
            wheel.schedule(5, slot);
        }
        assert_eq!(wheel.len(), count as usize);
        let mut seen = Vec::new();
        while let Some(slot) = wheel.pop(10) {
            seen.push(slot);
            wheel.schedule(50, slot); // refiled meanwhile, from reused chunks
        }
        assert_eq!(seen, (0..count).collect::<Vec<_>>());
        assert!(!wheel.pending());
        wheel.settle();
        assert_eq!(wheel.len(), count as usize);
        assert_eq!(drain(&mut wheel, 60), (0..count).collect::<Vec<_>>());
    }

    #[test]
    fn a_bucket_taken_out_is_worked_off_before_later_ones() {
        let mut wheel = ExpiryWheel::new(10, 100);
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
        assert_eq!(wheel.next_fire(), Some(160));
    }
}
