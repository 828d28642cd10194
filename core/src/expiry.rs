//! Deadlines without scans: coarse expiry buckets with lazy re-check.
//!
//! An entry sits in exactly one bucket, keyed by the tick in which its deadline falls
//! (ticks are `resolution` wide, ZooKeeper-style). Touching an entry never moves it:
//! when its bucket fires, each item is re-checked against the entry's current
//! `last_seen` and either reaped or rescheduled once. So a `ping` costs O(1), a
//! `handle_timeout` that reaps nothing costs O(log buckets) plus the items it re-checks,
//! and nothing ever walks every entry.
//!
//! A bucket fires at the end of its tick, which is strictly after every deadline in it
//! and at most `resolution` later: reaps are never early and never more than
//! `resolution` late.

use crate::id::InstanceId;
use crate::module::Module;
use std::collections::BTreeMap;

/// Identifies one lifetime of one entry: unique per `Liveness`, never reused. The low
/// bit carries the module so that an expiry item fits in 16 bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Serial(u64);

impl Serial {
    pub(crate) fn new(counter: u64, module: Module) -> Serial {
        Serial(counter << 1 | module.index() as u64)
    }

    pub(crate) fn module(self) -> Module {
        Module::ALL[(self.0 & 1) as usize]
    }
}

/// A reference to an entry that may have gone since: valid while the entry of
/// `(instance, serial.module())` still has `serial`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct DueItem {
    pub(crate) instance: InstanceId,
    pub(crate) serial: Serial,
}

/// Buckets of items keyed by tick, on the stall-corrected clock (nanoseconds).
#[derive(Debug)]
pub(crate) struct ExpiryQueue {
    tick_nanos: u64,
    buckets: BTreeMap<u64, Vec<DueItem>>,
    len: usize,
}

impl ExpiryQueue {
    pub(crate) fn new(tick_nanos: u64) -> ExpiryQueue {
        assert!(tick_nanos > 0, "expiry ticks must have a width");
        ExpiryQueue {
            tick_nanos,
            buckets: BTreeMap::new(),
            len: 0,
        }
    }

    /// Schedules `item` for the first instant strictly after `deadline` that ends a tick.
    pub(crate) fn schedule(&mut self, deadline: u64, item: DueItem) {
        let tick = deadline / self.tick_nanos + 1;
        self.buckets.entry(tick).or_default().push(item);
        self.len += 1;
    }

    /// When the earliest bucket fires: strictly after each of its deadlines, at most
    /// one tick later.
    pub(crate) fn next_fire(&self) -> Option<u64> {
        let (&tick, _) = self.buckets.first_key_value()?;
        Some(tick.saturating_mul(self.tick_nanos))
    }

    /// Takes the earliest bucket if it fires at or before `now`.
    pub(crate) fn pop_due(&mut self, now: u64) -> Option<Vec<DueItem>> {
        if self.next_fire()? > now {
            return None;
        }
        let (_, items) = self.buckets.pop_first()?;
        self.len -= items.len();
        Some(items)
    }

    /// Items scheduled, stale ones included.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(raw: u64) -> DueItem {
        DueItem {
            instance: InstanceId::new(raw).unwrap(),
            serial: Serial::new(raw, Module::ServerDriven),
        }
    }

    #[test]
    fn a_bucket_fires_strictly_after_its_deadlines_and_within_one_tick() {
        let mut queue = ExpiryQueue::new(10);
        queue.schedule(20, item(1)); // on a tick boundary: fires at 30
        queue.schedule(29, item(2)); // same tick
        assert_eq!(queue.next_fire(), Some(30));
        assert_eq!(queue.pop_due(29), None);
        assert_eq!(queue.pop_due(30), Some(vec![item(1), item(2)]));
        assert_eq!(queue.len(), 0);
        assert_eq!(queue.next_fire(), None);
    }

    #[test]
    fn serial_carries_its_module() {
        for module in Module::ALL {
            assert_eq!(Serial::new(41, module).module(), module);
        }
        assert_ne!(
            Serial::new(41, Module::ServerDriven),
            Serial::new(41, Module::EngineDriven)
        );
    }
}
