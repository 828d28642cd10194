//! The reference model: what the core must have done, computed independently.
//!
//! Two clocks and a shadow registry, written from the core's documented rules (`docs/design.md`) rather than from the
//! core's code:
//! - [`CorrectedClock`] credits only the gaps in which the simulated server really was
//!   paused. A gap the core credits that was no pause means the server loop slept past
//!   `poll_timeout` (a shell bug that hides silence: reported as `spurious_stall`).
//! - [`Shadow`] mirrors every instance's `last_seen` (stall-corrected) and `proven`
//!   flag, every entry's building state, and keeps each instance's reap deadline in a
//!   lazy heap, so that a reap can be judged "early" or "late" without asking the core.
//!   Liveness is per instance (failure-modes row 26): every ping, register and transfer
//!   refreshes the instance, and its entries are due together.

use crate::time::Nanos;
use kvwarden_core::{InstanceId, Module};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// An entry key: one instance in one module.
pub type EntryKey = (InstanceId, Module);

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

/// One entry as the reference model sees it: its instance's liveness and its own
/// building state.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ShadowEntry {
    /// The instance's last evidence, corrected clock.
    pub last_seen: Nanos,
    /// Whether the instance pinged since it was registered.
    pub proven: bool,
    /// The server's build serial while the context is being built.
    pub building: Option<u64>,
}

/// One instance's liveness: an instance is one process, its entries live and die
/// together (failure-modes row 26).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Life {
    last_seen: Nanos,
    proven: bool,
    version: u64,
}

/// The reference registry.
#[derive(Clone, Debug)]
pub struct Shadow {
    /// T (0: reaping disabled).
    pub reap_timeout: Nanos,
    /// G.
    pub registration_grace: Nanos,
    lives: BTreeMap<InstanceId, Life>,
    /// Each entry's build serial while it is building.
    entries: BTreeMap<EntryKey, Option<u64>>,
    building: BTreeSet<EntryKey>,
    deadlines: BinaryHeap<Reverse<(Nanos, InstanceId, u64)>>,
    versions: u64,
}

impl Shadow {
    /// An empty registry with the server's windows.
    pub fn new(reap_timeout: Nanos, registration_grace: Nanos) -> Shadow {
        Shadow {
            reap_timeout,
            registration_grace,
            lives: BTreeMap::new(),
            entries: BTreeMap::new(),
            building: BTreeSet::new(),
            deadlines: BinaryHeap::new(),
            versions: 0,
        }
    }

    /// The entry at `key`, with its instance's liveness.
    pub fn get(&self, key: EntryKey) -> Option<ShadowEntry> {
        let building = *self.entries.get(&key)?;
        let life = self.lives.get(&key.0)?;
        Some(ShadowEntry {
            last_seen: life.last_seen,
            proven: life.proven,
            building,
        })
    }

    /// Whether the instance has an entry in any module.
    pub fn holds(&self, instance: InstanceId) -> bool {
        self.lives.contains_key(&instance)
    }

    /// Entries, summed over modules.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry's window: T when its instance is proven, G before.
    pub fn window(&self, entry: &ShadowEntry) -> Nanos {
        self.window_of(entry.proven)
    }

    fn window_of(&self, proven: bool) -> Nanos {
        if proven {
            self.reap_timeout
        } else {
            self.registration_grace
        }
    }

    /// Sets the instance's liveness and files its deadline.
    fn live(&mut self, instance: InstanceId, last_seen: Nanos, proven: bool) {
        self.versions += 1;
        let life = Life {
            last_seen,
            proven,
            version: self.versions,
        };
        if self.reap_timeout > 0 {
            let deadline = last_seen + self.window_of(proven);
            self.deadlines
                .push(Reverse((deadline, instance, life.version)));
        }
        self.lives.insert(instance, life);
    }

    /// A new entry at `key`, building under `serial`; the instance is refreshed (and
    /// starts unproven if it is new here).
    pub fn insert(&mut self, key: EntryKey, now: Nanos, serial: u64) {
        let proven = self.lives.get(&key.0).is_some_and(|life| life.proven);
        self.live(key.0, now, proven);
        self.entries.insert(key, Some(serial));
        self.building.insert(key);
    }

    /// The entry's context arrived; the instance is refreshed.
    pub fn built(&mut self, key: EntryKey, now: Nanos) {
        if let Some(building) = self.entries.get_mut(&key) {
            *building = None;
            self.building.remove(&key);
            self.touch(key.0, now, false);
        }
    }

    /// Refreshes the instance's `last_seen` (and latches `proven` when asked); false
    /// when it holds no entry.
    pub fn touch(&mut self, instance: InstanceId, now: Nanos, prove: bool) -> bool {
        let Some(life) = self.lives.get(&instance).copied() else {
            return false;
        };
        self.live(instance, now, life.proven || prove);
        true
    }

    /// Removes the entry (and the instance with its last one).
    pub fn remove(&mut self, key: EntryKey) -> Option<ShadowEntry> {
        let entry = self.get(key)?;
        self.entries.remove(&key);
        self.building.remove(&key);
        if !Module::ALL
            .iter()
            .any(|&m| self.entries.contains_key(&(key.0, m)))
        {
            self.lives.remove(&key.0);
        }
        Some(entry)
    }

    /// Keys whose context is still being built.
    pub fn building_keys(&self) -> Vec<EntryKey> {
        self.building.iter().copied().collect()
    }

    /// The earliest current deadline with one of its instance's entries, dropping stale
    /// heap items on the way.
    pub fn earliest_deadline(&mut self) -> Option<(Nanos, EntryKey)> {
        while let Some(&Reverse((deadline, instance, version))) = self.deadlines.peek() {
            if self
                .lives
                .get(&instance)
                .is_some_and(|l| l.version == version)
                && let Some(&module) = Module::ALL
                    .iter()
                    .find(|&&m| self.entries.contains_key(&(instance, m)))
            {
                return Some((deadline, (instance, module)));
            }
            self.deadlines.pop();
        }
        None
    }

    /// Every key, in order.
    pub fn keys(&self) -> impl Iterator<Item = EntryKey> + '_ {
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
        shadow.insert(key, 0, 1);
        shadow.built(key, 0);
        assert_eq!(shadow.earliest_deadline(), Some((60 * SECOND, key)));
        shadow.touch(id, 10 * SECOND, true);
        assert_eq!(shadow.earliest_deadline(), Some((40 * SECOND, key)));
        shadow.remove(key);
        assert_eq!(shadow.earliest_deadline(), None);
    }

    #[test]
    fn row_26_an_instance_shares_one_life_across_its_modules() {
        let id = InstanceId::new(2).unwrap();
        let sd = (id, Module::ServerDriven);
        let ed = (id, Module::EngineDriven);
        let mut shadow = Shadow::new(30 * SECOND, 60 * SECOND);
        shadow.insert(sd, 0, 1);
        assert!(shadow.touch(id, 5 * SECOND, true));
        shadow.insert(ed, 10 * SECOND, 2); // after the last ping: proven all the same
        let entry = shadow.get(ed).unwrap();
        assert!(entry.proven);
        assert_eq!(shadow.get(sd).unwrap().last_seen, 10 * SECOND);
        assert_eq!(shadow.earliest_deadline(), Some((40 * SECOND, sd)));
        // Unregistering one module keeps the instance; the last one ends it.
        shadow.remove(sd);
        assert!(shadow.holds(id));
        assert_eq!(shadow.earliest_deadline(), Some((40 * SECOND, ed)));
        shadow.remove(ed);
        assert!(!shadow.holds(id));
        assert_eq!(shadow.earliest_deadline(), None);
    }
}
