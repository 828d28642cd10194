//! The per-instance record: an instance is one process, so its registrations live and
//! die together (failure-modes row 26).
//!
//! The registry keeps instances in dense slots. The index maps an instance to its slot
//! and its exact liveness word ([`Seen`]: last evidence and `proven`), so a ping writes
//! where its one hash probe landed; a dense array holds a coarse copy per slot
//! ([`Recent`], what the reaper reads for a live instance); the modules' contexts hang
//! off the slot's [`Record`]. A slot is handed out again only once the expiry item that
//! refers to it has fired, so items need no generation.

use crate::id::InstanceId;
use crate::module::Module;

/// Identifies one lifetime of one (instance, module) entry while it is building:
/// unique per `Liveness`, never reused. The low bit carries the module.
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

/// One module's entry of an instance.
#[derive(Debug)]
pub(crate) enum ModuleEntry<C> {
    /// The instance holds nothing in this module.
    Absent,
    /// REGISTER asked for a build; the context has not come back yet.
    Building(Serial),
    /// The context the shell built.
    Ready(C),
}

impl<C> ModuleEntry<C> {
    pub(crate) fn is_present(&self) -> bool {
        !matches!(self, ModuleEntry::Absent)
    }
}

/// The contexts of one instance, one per module.
#[derive(Debug)]
pub(crate) struct Record<C> {
    pub(crate) instance: InstanceId,
    pub(crate) modules: [ModuleEntry<C>; 2],
}

impl<C> Record<C> {
    pub(crate) fn new(instance: InstanceId) -> Record<C> {
        Record {
            instance,
            modules: [ModuleEntry::Absent, ModuleEntry::Absent],
        }
    }

    /// Entries present (building included).
    pub(crate) fn present(&self) -> usize {
        self.modules.iter().filter(|m| m.is_present()).count()
    }
}

/// An instance's liveness word: the last evidence (stall-corrected nanoseconds) in the
/// low 63 bits, `proven` in the top bit.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Seen(u64);

impl Seen {
    const PROVEN: u64 = 1 << 63;

    /// `last_seen` is clamped below 2^63 - 1 ns (292 years of uptime).
    pub(crate) fn new(last_seen: u64, proven: bool) -> Seen {
        let last_seen = last_seen.min(Self::PROVEN - 2);
        Seen(last_seen | if proven { Self::PROVEN } else { 0 })
    }

    pub(crate) fn last_seen(self) -> u64 {
        self.0 & !Self::PROVEN
    }

    pub(crate) fn proven(self) -> bool {
        self.0 & Self::PROVEN != 0
    }

    /// The same word refreshed at `now`, `proven` latched when `prove`.
    pub(crate) fn refreshed(self, now: u64, prove: bool) -> Seen {
        Seen::new(now, self.proven() || prove)
    }
}

/// A slot's coarse liveness word, for the reaper's fast path: the unit (a power of two
/// of nanoseconds, at most the resolution) of the last evidence modulo 2^14, `proven`
/// in the top bit, and a vacant mark (the instance has gone while the slot's expiry
/// item is still queued). At 2 bytes a slot the array mostly stays in cache; the
/// reaper reads the exact word (through the index) only for an instance that may be
/// due.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Recent(u16);

impl Recent {
    const PROVEN: u16 = 1 << 15;
    const VACANT_BIT: u16 = 1 << 14;
    const MASK: u16 = (1 << 14) - 1;
    /// The ages a word tells apart: an age is known modulo this many units.
    pub(crate) const UNITS: u64 = 1 << 14;
    pub(crate) const VACANT: Recent = Recent(Self::VACANT_BIT);

    pub(crate) fn new(units: u64, proven: bool) -> Recent {
        Recent((units as u16 & Self::MASK) | if proven { Self::PROVEN } else { 0 })
    }

    pub(crate) fn is_vacant(self) -> bool {
        self.0 & Self::VACANT_BIT != 0
    }

    pub(crate) fn proven(self) -> bool {
        self.0 & Self::PROVEN != 0
    }

    /// Units from the word's to `now_units`, modulo [`Recent::UNITS`]: the true age
    /// whenever that is below `UNITS`.
    pub(crate) fn age(self, now_units: u64) -> u64 {
        now_units.wrapping_sub(u64::from(self.0 & Self::MASK)) & u64::from(Self::MASK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn seen_keeps_proven_apart_from_last_seen() {
        let seen = Seen::new(7, false);
        assert_eq!((seen.last_seen(), seen.proven()), (7, false));
        let seen = seen.refreshed(9, true);
        assert_eq!((seen.last_seen(), seen.proven()), (9, true));
        assert!(seen.refreshed(11, false).proven());
        assert_eq!(Seen::new(u64::MAX, false).last_seen(), (1 << 63) - 2);
    }

    #[test]
    fn recent_tells_ages_modulo_its_units_and_never_reads_as_vacant() {
        let word = Recent::new(Recent::UNITS * 3 + 5, true);
        assert!(word.proven() && !word.is_vacant());
        assert_eq!(word.age(Recent::UNITS * 3 + 5), 0);
        assert_eq!(word.age(Recent::UNITS * 3 + 105), 100);
        assert_eq!(word.age(Recent::UNITS * 4 + 4), Recent::UNITS - 1);
        assert!(!Recent::new(u64::MAX, false).is_vacant());
        assert!(Recent::VACANT.is_vacant());
    }
}
