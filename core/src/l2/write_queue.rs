//! The write-behind queue: chunks published in L1 waiting to be written to L2, bounded
//! in bytes.
//!
//! A push never blocks: it is queued or dropped (and counted). Bytes stay counted from
//! the push until the write is [`complete`](WriteQueue::complete)d, whether it is still
//! waiting or already being written, because the memory is held either way.
//!
//! Only published data may be pushed (`failure-modes.md` row 29): a server-driven
//! `store` that completed, or an engine-driven `commit_store`. Never an engine-driven
//! reservation that was not committed, nor a copy cut short by a free. The queue cannot
//! tell; checking it is the caller's job, at the one place that publishes a chunk in L1.
//!
//! At shutdown the queue gets [`SHUTDOWN_DRAIN`] to empty; the rest is lost.

use std::collections::VecDeque;
use std::time::Duration;

/// How long the queue may take to reach L2 once the server has stopped (SIGTERM): long
/// enough for a healthy cluster to take a full queue of a few hundred MiB, short enough
/// that an orchestrator's grace period (30 s by default in Kubernetes) is never at risk
/// whatever Redis does. What is left then is dropped and counted.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(2);

/// What became of a push.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[must_use]
pub enum Push {
    /// Waiting to be written.
    Queued,
    /// Not queued: it would have taken the queue past its bound. Counted in
    /// [`WriteQueue::drops`].
    Dropped,
}

/// A queue of writes bounded by the sum of their sizes.
#[derive(Debug)]
pub struct WriteQueue<T> {
    capacity_bytes: u64,
    waiting: VecDeque<(T, u64)>,
    waiting_bytes: u64,
    in_flight_bytes: u64,
    drops: u64,
}

impl<T> WriteQueue<T> {
    /// An empty queue holding at most `capacity_bytes` (0: every write is dropped).
    pub fn new(capacity_bytes: u64) -> WriteQueue<T> {
        WriteQueue {
            capacity_bytes,
            waiting: VecDeque::new(),
            waiting_bytes: 0,
            in_flight_bytes: 0,
            drops: 0,
        }
    }

    /// Queues `item` of `bytes` bytes, or drops it when it does not fit.
    pub fn push(&mut self, item: T, bytes: u64) -> Push {
        let fits = self
            .queue_bytes()
            .checked_add(bytes)
            .is_some_and(|total| total <= self.capacity_bytes);
        if !fits {
            self.drops = self.drops.saturating_add(1);
            return Push::Dropped;
        }
        self.waiting.push_back((item, bytes));
        self.waiting_bytes += bytes;
        Push::Queued
    }

    /// Takes the oldest waiting write to be written; its bytes stay counted until
    /// [`WriteQueue::complete`] is called with them.
    pub fn pop(&mut self) -> Option<(T, u64)> {
        let (item, bytes) = self.waiting.pop_front()?;
        self.waiting_bytes -= bytes;
        self.in_flight_bytes += bytes;
        Some((item, bytes))
    }

    /// A write taken by [`WriteQueue::pop`] ended (written, failed or timed out).
    pub fn complete(&mut self, bytes: u64) {
        debug_assert!(
            bytes <= self.in_flight_bytes,
            "completing {bytes} bytes with only {} in flight",
            self.in_flight_bytes
        );
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(bytes);
    }

    /// Bytes waiting plus bytes being written.
    pub fn queue_bytes(&self) -> u64 {
        self.waiting_bytes + self.in_flight_bytes
    }

    /// Bytes being written.
    pub fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes
    }

    /// Writes waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The bound.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Writes dropped since the queue was made.
    pub fn drops(&self) -> u64 {
        self.drops
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pushes_within_the_bound_queue_and_the_one_past_it_drops() {
        let mut queue = WriteQueue::new(10);
        assert_eq!(queue.push("a", 4), Push::Queued);
        assert_eq!(queue.push("b", 6), Push::Queued);
        assert_eq!(queue.queue_bytes(), 10);
        assert_eq!(queue.push("c", 1), Push::Dropped);
        assert_eq!(queue.drops(), 1);
        assert_eq!(queue.waiting(), 2);
    }

    #[test]
    fn write_larger_than_the_whole_queue_is_dropped_even_when_empty() {
        let mut queue = WriteQueue::new(10);
        assert_eq!(queue.push((), 11), Push::Dropped);
        assert_eq!(queue.push((), u64::MAX), Push::Dropped);
        assert_eq!(queue.queue_bytes(), 0);
        assert_eq!(queue.drops(), 2);
        let mut off = WriteQueue::new(0);
        assert_eq!(off.push((), 1), Push::Dropped);
    }

    #[test]
    fn bytes_in_flight_count_until_complete() {
        let mut queue = WriteQueue::new(10);
        assert_eq!(queue.push("a", 8), Push::Queued);
        assert_eq!(queue.pop(), Some(("a", 8)));
        assert_eq!(queue.in_flight_bytes(), 8);
        assert_eq!(
            queue.push("b", 8),
            Push::Dropped,
            "the popped write still holds 8"
        );
        queue.complete(8);
        assert_eq!(queue.queue_bytes(), 0);
        assert_eq!(queue.push("b", 8), Push::Queued);
    }

    #[test]
    fn pops_come_out_in_push_order() {
        let mut queue = WriteQueue::new(100);
        for (item, bytes) in [("a", 1), ("b", 2), ("c", 3)] {
            assert_eq!(queue.push(item, bytes), Push::Queued);
        }
        let order: Vec<_> = std::iter::from_fn(|| queue.pop().map(|(item, _)| item)).collect();
        assert_eq!(order, ["a", "b", "c"]);
        assert_eq!(queue.pop(), None);
    }

    proptest! {
        #[test]
        fn queue_bytes_never_exceed_the_bound_and_always_add_up(
            capacity in 0u64..1000,
            ops in proptest::collection::vec((0u8..3, 0u64..300), 0..200),
        ) {
            let mut queue = WriteQueue::new(capacity);
            let mut popped: Vec<u64> = Vec::new();
            let (mut queued, mut dropped) = (0u64, 0u64);
            for (op, bytes) in ops {
                match op {
                    0 => match queue.push((), bytes) {
                        Push::Queued => queued += 1,
                        Push::Dropped => dropped += 1,
                    },
                    1 => if let Some(((), bytes)) = queue.pop() { popped.push(bytes) },
                    _ => if let Some(bytes) = popped.pop() { queue.complete(bytes) },
                }
                prop_assert!(queue.queue_bytes() <= capacity);
                prop_assert_eq!(queue.in_flight_bytes(), popped.iter().sum::<u64>());
            }
            prop_assert_eq!(queue.drops(), dropped);
            prop_assert!(queue.waiting() as u64 + popped.len() as u64 <= queued);
        }
    }
}
