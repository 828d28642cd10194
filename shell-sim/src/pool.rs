//! The L1 pool file (`--l1-file` with `--l1-secret-file`, failure modes 71–72): what
//! the slots of a pool that outlives the server process hold, and their seals.
//!
//! The bytes are not simulated; each slot records whose they are. A write bumps the
//! slot's version when it starts (the slot is torn from then on) and when it ends (it
//! holds the key's whole value, or bytes the model does not name). A seal records the
//! version it covered: a seal whose slot was written since does not verify, as the
//! keyed tag over the bytes would not. A crash leaves whatever was torn torn.
//!
//! The shell answers the node's `Job::Seal` and `Job::Scan` from this model, and the
//! checks ask it what a slot the node serves or adopts really holds.

use kvwarden_core::node::Scanned;
use kvwarden_core::seal::Unsealed;

/// A job of the node on the pool file, as the simulated pool threads run it.
#[derive(Debug)]
pub enum PoolJob {
    /// Seal `len` bytes of `key` in `slot` (read when the job ends).
    Seal {
        /// The slot.
        slot: usize,
        /// The node key.
        key: Vec<u8>,
        /// The value's length.
        len: u64,
    },
    /// Slots from `first` on, read when the job started.
    Scan {
        /// The first slot.
        first: usize,
        /// One finding per slot.
        found: Vec<Scanned>,
    },
}

/// What a slot's bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holds {
    /// Never written.
    Blank,
    /// A write started and did not end (in flight, or cut off by a crash).
    Torn,
    /// The whole value of this node key.
    Whole(Vec<u8>),
    /// Written by something the model does not follow (an L2 read placing a value).
    Unnamed,
}

impl std::fmt::Display for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holds::Blank => f.write_str("nothing (never written)"),
            Holds::Torn => f.write_str("a torn write"),
            Holds::Whole(key) => write!(f, "the value of key {}", crate::invariants::hex(key)),
            Holds::Unnamed => f.write_str("a value the model does not name"),
        }
    }
}

#[derive(Clone, Debug)]
struct Seal {
    key: Vec<u8>,
    len: u64,
    version: u64,
}

#[derive(Clone, Debug)]
struct Slot {
    version: u64,
    holds: Holds,
    /// The server boot that wrote it last.
    boot: u64,
    seal: Option<Seal>,
}

/// The pool file and its index of seals.
#[derive(Clone, Debug)]
pub struct PoolFile {
    slots: Vec<Slot>,
}

impl PoolFile {
    /// A new, empty pool file of `slots` slots.
    pub fn new(slots: usize) -> PoolFile {
        let blank = Slot {
            version: 0,
            holds: Holds::Blank,
            boot: 0,
            seal: None,
        };
        PoolFile {
            slots: vec![blank; slots],
        }
    }

    /// A write into `slot` starts in server boot `boot`: the slot is torn until it ends.
    pub fn write_started(&mut self, slot: usize, boot: u64) {
        if let Some(state) = self.slots.get_mut(slot) {
            state.version += 1;
            state.holds = Holds::Torn;
            state.boot = boot;
        }
    }

    /// The write into `slot` ended: it holds `key`'s whole value (None: bytes the model
    /// does not name).
    pub fn write_done(&mut self, slot: usize, key: Option<Vec<u8>>) {
        if let Some(state) = self.slots.get_mut(slot) {
            state.version += 1;
            state.holds = key.map_or(Holds::Unnamed, Holds::Whole);
        }
    }

    /// What `slot` holds.
    pub fn holds(&self, slot: usize) -> &Holds {
        self.slots
            .get(slot)
            .map_or(&Holds::Blank, |state| &state.holds)
    }

    /// The server boot that wrote `slot` last.
    pub fn written_in(&self, slot: usize) -> u64 {
        self.slots.get(slot).map_or(0, |state| state.boot)
    }

    /// Seals `len` bytes of `key` in `slot` over what the slot holds now (the keyed tag
    /// covers the bytes as they are). Returns what it holds when that is not `key`'s
    /// whole value: the node asked to seal bytes that are not the key's.
    pub fn seal(&mut self, slot: usize, key: Vec<u8>, len: u64) -> Option<Holds> {
        let state = self.slots.get_mut(slot)?;
        let wrong = match &state.holds {
            Holds::Whole(held) if *held == key => None,
            Holds::Unnamed => None,
            other => Some(other.clone()),
        };
        state.seal = Some(Seal {
            key,
            len,
            version: state.version,
        });
        wrong
    }

    /// What the shell's scan of `count` slots from `first` finds: a seal that still
    /// covers its slot's bytes verifies, any other is torn.
    pub fn scan(&self, first: usize, count: usize) -> Vec<Scanned> {
        (first..first + count)
            .map(
                |slot| match self.slots.get(slot).and_then(|s| s.seal.as_ref()) {
                    None => Scanned::Blank,
                    Some(seal) if seal.version == self.slots[slot].version => Scanned::Sealed {
                        key: seal.key.clone(),
                        len: seal.len,
                    },
                    Some(_) => Scanned::Unsealed(Unsealed::Torn),
                },
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_verifies_until_its_slot_is_written_again() {
        let mut pool = PoolFile::new(2);
        pool.write_started(0, 0);
        pool.write_done(0, Some(b"k".to_vec()));
        assert_eq!(pool.seal(0, b"k".to_vec(), 4), None);
        assert_eq!(
            pool.scan(0, 2),
            vec![
                Scanned::Sealed {
                    key: b"k".to_vec(),
                    len: 4
                },
                Scanned::Blank
            ]
        );
        // A write cut off by a crash: torn, whatever the seal said.
        pool.write_started(0, 1);
        assert_eq!(pool.holds(0), &Holds::Torn);
        assert_eq!(pool.scan(0, 1), vec![Scanned::Unsealed(Unsealed::Torn)]);
        pool.write_done(0, Some(b"j".to_vec()));
        assert_eq!(pool.scan(0, 1), vec![Scanned::Unsealed(Unsealed::Torn)]);
        assert_eq!(pool.written_in(0), 1);
    }

    #[test]
    fn sealing_bytes_of_another_key_is_reported() {
        let mut pool = PoolFile::new(1);
        pool.write_started(0, 0);
        assert_eq!(pool.seal(0, b"k".to_vec(), 4), Some(Holds::Torn));
        pool.write_done(0, Some(b"j".to_vec()));
        assert_eq!(
            pool.seal(0, b"k".to_vec(), 4),
            Some(Holds::Whole(b"j".to_vec()))
        );
    }
}
