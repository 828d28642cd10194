//! The reference model: what the core must have done, computed independently.
//!
//! Two clocks and a shadow registry, written from the core's documented rules (`docs/design.md`) rather than from the
//! core's code:
//! - [`CorrectedClock`] credits only the gaps in which the simulated server really was
//!   paused. A gap the core credits that was no pause means the server loop slept past
//!   `poll_timeout` (a shell bug that hides silence: reported as `spurious_stall`).
//! - [`Shadow`] mirrors every entry's `last_seen` (stall-corrected), `proven` flag and
//!   building state, and keeps each entry's reap deadline in a lazy heap, so that a
//!   reap can be judged "early" or "late" without asking the core.

use crate::time::Nanos;
use kvwarden_core::{InstanceId, Module};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// An entry key: one instance in one module.
pub type Key = (InstanceId, Module);

#[derive(Copy, Clone, Debug)]
struct Gap {
    start: Nanos,
    end: Nanos,
    credited_before: Nanos,
}

/// The server's clock with the pauses taken out.
#[derive(Clone, Debug)]
pub struct CorrectedClock {
    threshold: Nanos,
    last_input: Nanos,
    credited: Nanos,
    gaps: Vec<Gap>,
    paused_since_input: bool,
    pause_started: Nanos,
    /// Pauses too short to be credited as stalls: (start, end) on the shell's clock.
    /// The server could not reap during them, so a reap may be late by their length.
    short_pauses: Vec<(Nanos, Nanos)>,
}

/// What [`CorrectedClock::observe`] saw.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GapKind {
    /// Below the threshold.
    None,
    /// A pause, credited: the core must report this gap.
    Stall(Nanos),
    /// Above the threshold with no pause: the loop slept too long.
    Spurious(Nanos),
}

impl CorrectedClock {
    /// A clock starting at `now` (the server's boot).
    pub fn new(now: Nanos, threshold: Nanos) -> CorrectedClock {
        CorrectedClock {
            threshold,
            last_input: now,
            credited: 0,
            gaps: Vec::new(),
            paused_since_input: false,
            pause_started: now,
            short_pauses: Vec::new(),
        }
    }

    /// The stall threshold.
    pub fn threshold(&self) -> Nanos {
        self.threshold
    }

    /// The server process was paused at `now`.
    pub fn paused(&mut self, now: Nanos) {
        self.paused_since_input = true;
        self.pause_started = now;
    }

    /// How long the server was paused, without credit, within `(from, to]`.
    pub fn short_pause_within(&self, from: Nanos, to: Nanos) -> Nanos {
        self.short_pauses
            .iter()
            .map(|&(start, end)| end.min(to).saturating_sub(start.max(from)))
            .sum()
    }

    /// An input reaches the core at `now`.
    pub fn observe(&mut self, now: Nanos) -> GapKind {
        let now = now.max(self.last_input);
        let gap = now - self.last_input;
        let kind = if gap > self.threshold {
            if self.paused_since_input {
                self.gaps.push(Gap {
                    start: self.last_input,
                    end: now,
                    credited_before: self.credited,
                });
                self.credited += gap;
                GapKind::Stall(gap)
            } else {
                GapKind::Spurious(gap)
            }
        } else {
            if self.paused_since_input {
                self.short_pauses.push((self.pause_started, now));
            }
            GapKind::None
        };
        self.paused_since_input = false;
        self.last_input = now;
        kind
    }

    /// `now` (not before the latest input) on the corrected clock.
    pub fn now(&self, now: Nanos) -> Nanos {
        now.max(self.last_input) - self.credited
    }

    /// Any past instant on the corrected clock; an instant inside a credited pause maps
    /// to the pause's start (nothing happened during it, as far as silence goes).
    pub fn at(&self, instant: Nanos) -> Nanos {
        for gap in self.gaps.iter().rev() {
            if instant > gap.end {
                return instant - gap.credited_before - (gap.end - gap.start);
            }
            if instant > gap.start {
                return gap.start - gap.credited_before;
            }
        }
        instant
    }
}

/// One entry as the reference model sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ShadowEntry {
    /// Last evidence, corrected clock.
    pub last_seen: Nanos,
    /// Whether the instance pinged since the entry was created.
    pub proven: bool,
    /// The server's build serial while the context is being built.
    pub building: Option<u64>,
    version: u64,
    /// The deadline of its item in the heap (never later than its real deadline).
    queued: Nanos,
}

/// The reference registry.
#[derive(Clone, Debug)]
pub struct Shadow {
    /// T (0: reaping disabled).
    pub reap_timeout: Nanos,
    /// G.
    pub registration_grace: Nanos,
    entries: BTreeMap<Key, ShadowEntry>,
    building: BTreeSet<Key>,
    deadlines: BinaryHeap<Reverse<(Nanos, Key, u64)>>,
    versions: u64,
}

impl Shadow {
    /// An empty registry with the server's windows.
    pub fn new(reap_timeout: Nanos, registration_grace: Nanos) -> Shadow {
        Shadow {
            reap_timeout,
            registration_grace,
            entries: BTreeMap::new(),
            building: BTreeSet::new(),
            deadlines: BinaryHeap::new(),
            versions: 0,
        }
    }

    /// The entry at `key`.
    pub fn get(&self, key: Key) -> Option<&ShadowEntry> {
        self.entries.get(&key)
    }

    /// Whether the instance has an entry in any module.
    pub fn holds(&self, instance: InstanceId) -> bool {
        Module::ALL
            .iter()
            .any(|&m| self.entries.contains_key(&(instance, m)))
    }

    /// Entries, in key order.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry's window: T when proven, G before.
    pub fn window(&self, entry: &ShadowEntry) -> Nanos {
        if entry.proven {
            self.reap_timeout
        } else {
            self.registration_grace
        }
    }

    /// Inserts or replaces the entry and files its deadline. A deadline that moves
    /// later keeps the entry's heap item (it is moved when it comes up, lazily); only
    /// an earlier one is pushed.
    pub fn put(&mut self, key: Key, last_seen: Nanos, proven: bool, building: Option<u64>) {
        let mut entry = ShadowEntry {
            last_seen,
            proven,
            building,
            version: 0,
            queued: 0,
        };
        if building.is_some() {
            self.building.insert(key);
        } else {
            self.building.remove(&key);
        }
        if self.reap_timeout > 0 {
            let deadline = last_seen + self.window(&entry);
            match self.entries.get(&key) {
                Some(previous) if previous.queued <= deadline => {
                    entry.version = previous.version;
                    entry.queued = previous.queued;
                }
                _ => {
                    self.versions += 1;
                    entry.version = self.versions;
                    entry.queued = deadline;
                    self.deadlines.push(Reverse((deadline, key, entry.version)));
                }
            }
        }
        self.entries.insert(key, entry);
    }

    /// Refreshes `last_seen` (and latches `proven` when asked).
    pub fn touch(&mut self, key: Key, now: Nanos, prove: bool) -> bool {
        let Some(entry) = self.entries.get(&key).copied() else {
            return false;
        };
        self.put(key, now, entry.proven || prove, entry.building);
        true
    }

    /// Removes the entry.
    pub fn remove(&mut self, key: Key) -> Option<ShadowEntry> {
        self.building.remove(&key);
        self.entries.remove(&key)
    }

    /// Keys whose context is still being built.
    pub fn building_keys(&self) -> Vec<Key> {
        self.building.iter().copied().collect()
    }

    /// The earliest current deadline, dropping stale heap items on the way.
    pub fn earliest_deadline(&mut self) -> Option<(Nanos, Key)> {
        while let Some(&Reverse((deadline, key, version))) = self.deadlines.peek() {
            match self.entries.get(&key).copied() {
                Some(entry) if entry.version == version => {
                    let current = entry.last_seen + self.window(&entry);
                    if current == deadline {
                        return Some((deadline, key));
                    }
                    // The entry was refreshed since: its item moves to its deadline now.
                    self.deadlines.pop();
                    self.deadlines.push(Reverse((current, key, version)));
                    if let Some(entry) = self.entries.get_mut(&key) {
                        entry.queued = current;
                    }
                }
                _ => {
                    self.deadlines.pop();
                }
            }
        }
        None
    }

    /// Every key, in order.
    pub fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.entries.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SECOND;

    #[test]
    fn only_a_real_pause_is_credited_and_past_instants_map_into_it() {
        let mut clock = CorrectedClock::new(0, 5 * SECOND);
        assert_eq!(clock.observe(2 * SECOND), GapKind::None);
        clock.paused(2 * SECOND);
        assert_eq!(clock.observe(100 * SECOND), GapKind::Stall(98 * SECOND));
        assert_eq!(clock.now(100 * SECOND), 2 * SECOND);
        assert_eq!(clock.at(50 * SECOND), 2 * SECOND);
        assert_eq!(clock.at(SECOND), SECOND);
        assert_eq!(clock.at(101 * SECOND), 3 * SECOND);
        assert_eq!(clock.observe(110 * SECOND), GapKind::Spurious(10 * SECOND));
    }

    #[test]
    fn a_refresh_makes_the_old_deadline_stale() {
        let id = InstanceId::new(1).unwrap();
        let key = (id, Module::ServerDriven);
        let mut shadow = Shadow::new(30 * SECOND, 60 * SECOND);
        shadow.put(key, 0, false, None);
        assert_eq!(shadow.earliest_deadline(), Some((60 * SECOND, key)));
        shadow.touch(key, 10 * SECOND, true);
        assert_eq!(shadow.earliest_deadline(), Some((40 * SECOND, key)));
        shadow.remove(key);
        assert_eq!(shadow.earliest_deadline(), None);
    }
}
