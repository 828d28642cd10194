//! KV events (issue 42): what entered and left L1, per tenant, in order, for readers
//! that announce it (a connector to its engine's KV-event stream, a router).
//!
//! The log owns its state and its rules. Each change is logged under the tenant its
//! node key names, with that tenant's own sequence number: a reader sees its tenant's
//! changes and nothing of another's, not even how many there were. The log is bounded
//! ([`MAX_EVENTS`] changes, [`MAX_BYTES`] of keys): the oldest change goes first, and a
//! reader that had not read it starts over (a resync). So does a reader of another
//! server process or epoch: its cursor names them.
//!
//! A resync is a snapshot of every key the tenant holds in L1, read page by page from
//! the slot table, followed by the changes logged since it began. A key that changes
//! while the snapshot is read shows up again as a change after it, so the reader's view
//! converges to what L1 holds.

use super::l1::SlotTable;
use super::trust::scoped_key;
use crate::kv_publish::{Announcer, BlockEvent, BlockMeta};
use crate::protocol::answer::{KvEvent, KvEvents, KvTier};
use std::collections::{HashMap, VecDeque};

/// Changes held at most.
pub const MAX_EVENTS: usize = 65_536;
/// Bytes of keys held at most.
pub const MAX_BYTES: usize = 16 << 20;
/// Tenants with a sequence at most; past it every sequence starts over (a new epoch,
/// every reader resyncs).
pub const MAX_TENANTS: usize = 65_536;

/// The cursor's `scan` once the snapshot is read: changes follow.
const CHANGES: u64 = u64::MAX;

/// One logged change.
struct Logged {
    /// Its tenant's sequence number.
    seq: u64,
    /// The length of the tenant's prefix in `key`.
    prefix: usize,
    stored: bool,
    tier: KvTier,
    /// The node key (the tenant's prefix, then the key).
    key: Vec<u8>,
}

/// One tenant's sequence.
#[derive(Default)]
struct Sequence {
    /// The last number given.
    last: u64,
    /// The last number that left the log (a reader before it resyncs).
    dropped_through: u64,
    /// Where each of its changes still held sits in the log (global positions), oldest
    /// first: change `dropped_through + 1 + i` is at `at[i]`.
    at: VecDeque<u64>,
}

/// Where a reader is: the server process and epoch it read, its tenant's sequence
/// number read through, and, during a snapshot, the next slot to read.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Cursor {
    boot: u64,
    epoch: u64,
    seq: u64,
    scan: u64,
}

impl Cursor {
    const BYTES: usize = 32;

    fn encode(&self) -> Vec<u8> {
        [self.boot, self.epoch, self.seq, self.scan]
            .iter()
            .flat_map(|n| n.to_le_bytes())
            .collect()
    }

    fn decode(bytes: &[u8]) -> Option<Cursor> {
        if bytes.len() != Cursor::BYTES {
            return None;
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        Some(Cursor {
            boot: word(0),
            epoch: word(1),
            seq: word(2),
            scan: word(3),
        })
    }
}

/// The log's figures, for `/status` and the metrics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KvEventsView {
    /// Changes held.
    pub changes: usize,
    /// Bytes of their keys.
    pub bytes: usize,
    /// Tenants with a sequence.
    pub tenants: usize,
    /// Times every sequence started over (too many tenants).
    pub epoch: u64,
    /// Pages that started a reader over (new, of another process or epoch, or behind
    /// changes that left the log).
    pub resyncs_total: u64,
}

/// The log. See the module docs.
pub struct KvEventLog {
    boot: u64,
    epoch: u64,
    ring: VecDeque<Logged>,
    /// The global position of `ring[0]`.
    front: u64,
    bytes: usize,
    sequences: HashMap<Vec<u8>, Sequence>,
    resyncs: u64,
    /// The tenants the server announces itself (`--kv-events`), stream `i` at `[i]`:
    /// their key prefix and their announcer. A few, named by the operator: found by a
    /// scan, and none on most servers.
    publishers: Vec<(Vec<u8>, Announcer)>,
}

impl KvEventLog {
    /// An empty log of server process `boot`, announcing the blocks of the tenants named
    /// in `publish` itself (stream `i` for `publish[i]`).
    pub fn new(boot: u64, publish: &[String]) -> KvEventLog {
        let publishers = publish
            .iter()
            .map(|tenant| (scoped_key(tenant, b""), Announcer::new()))
            .collect();
        KvEventLog {
            publishers,
            boot,
            epoch: 0,
            ring: VecDeque::new(),
            front: 0,
            bytes: 0,
            sequences: HashMap::new(),
            resyncs: 0,
        }
    }

    /// Its figures.
    pub fn view(&self) -> KvEventsView {
        KvEventsView {
            changes: self.ring.len(),
            bytes: self.bytes,
            tenants: self.sequences.len(),
            epoch: self.epoch,
            resyncs_total: self.resyncs,
        }
    }

    /// Changes held now.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Logs that node key `key` entered `tier` (`stored`) or left it.
    pub fn record(&mut self, key: &[u8], stored: bool, tier: KvTier) {
        let Some(prefix) = key.first().map(|&len| 1 + usize::from(len)) else {
            return;
        };
        if prefix > key.len() {
            return; // not a scoped key: no tenant to log it under
        }
        if let Some(announcer) = self.publisher(&key[..prefix]) {
            announcer.change(&key[prefix..], stored, tier);
        }
        if !self.sequences.contains_key(&key[..prefix]) && self.sequences.len() >= MAX_TENANTS {
            // Too many sequences to keep: all start over, and every reader resyncs.
            self.epoch += 1;
            self.front += self.ring.len() as u64;
            self.ring.clear();
            self.bytes = 0;
            self.sequences.clear();
        }
        let at = self.front + self.ring.len() as u64;
        let sequence = self.sequences.entry(key[..prefix].to_vec()).or_default();
        sequence.last += 1;
        sequence.at.push_back(at);
        self.bytes += key.len();
        self.ring.push_back(Logged {
            seq: sequence.last,
            prefix,
            stored,
            tier,
            key: key.to_vec(),
        });
        while self.ring.len() > MAX_EVENTS || self.bytes > MAX_BYTES {
            self.drop_oldest();
        }
    }

    /// Node key `key`, held in L1, was described as `meta` (`describe_keys`): its
    /// tenant's stream may announce the block it names.
    pub fn described(&mut self, key: &[u8], meta: &[u8]) {
        let Some(prefix) = key.first().map(|&len| 1 + usize::from(len)) else {
            return;
        };
        if let Some(announcer) = key.get(..prefix).and_then(|p| self.publisher(p))
            && let Some(block) = BlockMeta::decode(meta)
        {
            announcer.describe(&key[prefix..], block);
        }
    }

    /// Each stream's events since the last call: (stream, events), streams with none
    /// left out.
    pub fn take_published(&mut self) -> Vec<(usize, Vec<BlockEvent>)> {
        self.publishers
            .iter_mut()
            .map(|(_, announcer)| announcer.take())
            .enumerate()
            .filter(|(_, events)| !events.is_empty())
            .collect()
    }

    /// The announcer of the tenant whose key prefix is `prefix`, if it is published.
    fn publisher(&mut self, prefix: &[u8]) -> Option<&mut Announcer> {
        self.publishers
            .iter_mut()
            .find(|(p, _)| p == prefix)
            .map(|(_, announcer)| announcer)
    }

    fn drop_oldest(&mut self) {
        let Some(oldest) = self.ring.pop_front() else {
            return;
        };
        self.front += 1;
        self.bytes -= oldest.key.len();
        if let Some(sequence) = self.sequences.get_mut(&oldest.key[..oldest.prefix]) {
            sequence.at.pop_front();
            sequence.dropped_through = oldest.seq;
        }
    }

    /// The next page for the reader of the tenant of `prefix` at `cursor` (empty: a new
    /// reader), at most `max` changes (or held keys, during a snapshot).
    pub fn read(&mut self, l1: &SlotTable, prefix: &[u8], cursor: &[u8], max: usize) -> KvEvents {
        let max = max.max(1);
        let (last, dropped_through) = self
            .sequences
            .get(prefix)
            .map_or((0, 0), |s| (s.last, s.dropped_through));
        let here = |seq: u64, scan: u64| Cursor {
            boot: self.boot,
            epoch: self.epoch,
            seq,
            scan,
        };
        let resume = Cursor::decode(cursor)
            .filter(|c| c.boot == self.boot && c.epoch == self.epoch)
            .filter(|c| c.scan != CHANGES || (dropped_through..=last).contains(&c.seq));
        let (start, resync) = match resume {
            Some(c) if c.scan == CHANGES => return self.changes(l1, prefix, c, last, max),
            Some(c) => (c, false),
            // A snapshot, from the first slot, then the changes after `last`.
            None => (here(last, 0), true),
        };
        self.resyncs += u64::from(resync);
        let (keys, next) = l1.committed_from(prefix, start.scan as usize, max);
        let events = keys
            .into_iter()
            .map(|key| KvEvent {
                stored: true,
                meta: l1.meta_of(&key).map(<[u8]>::to_vec),
                key: key[prefix.len()..].to_vec(),
                tier: KvTier::L1,
            })
            .collect();
        let scan = next.map_or(CHANGES, |slot| slot as u64);
        KvEvents {
            cursor: here(start.seq, scan).encode(),
            resync,
            events,
            more: next.is_some() || last > start.seq,
        }
    }

    /// The changes after `cursor.seq`, which the log still holds.
    fn changes(
        &self,
        l1: &SlotTable,
        prefix: &[u8],
        cursor: Cursor,
        last: u64,
        max: usize,
    ) -> KvEvents {
        let mut events = Vec::new();
        let mut seq = cursor.seq;
        if let Some(sequence) = self.sequences.get(prefix)
            && seq < last
        {
            // Change `seq + 1` sits at `at[seq - dropped_through]`.
            let first = sequence
                .at
                .get((seq - sequence.dropped_through) as usize)
                .map_or(self.ring.len(), |&at| (at - self.front) as usize);
            for logged in self.ring.iter().skip(first) {
                if events.len() >= max {
                    break;
                }
                if logged.key[..logged.prefix] == *prefix {
                    seq = logged.seq;
                    let described = logged.stored && logged.tier == KvTier::L1;
                    events.push(KvEvent {
                        stored: logged.stored,
                        key: logged.key[logged.prefix..].to_vec(),
                        tier: logged.tier,
                        meta: described
                            .then(|| l1.meta_of(&logged.key).map(<[u8]>::to_vec))
                            .flatten(),
                    });
                }
            }
        }
        KvEvents {
            cursor: Cursor { seq, ..cursor }.encode(),
            resync: false,
            events,
            more: seq < last,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::l1::Reservation;
    use crate::node::trust::TenantId;

    /// Tenant `name`'s node key for `key` (`len | name | key`).
    fn scoped(name: &str, key: &str) -> Vec<u8> {
        let mut scoped = vec![name.len() as u8];
        scoped.extend_from_slice(name.as_bytes());
        scoped.extend_from_slice(key.as_bytes());
        scoped
    }

    fn prefix(name: &str) -> Vec<u8> {
        scoped(name, "")
    }

    /// Every change read from `cursor` on, page by page: (resync seen, changes).
    fn read_all(
        log: &mut KvEventLog,
        l1: &SlotTable,
        name: &str,
        cursor: &mut Vec<u8>,
    ) -> (bool, Vec<(bool, String)>) {
        let mut resync = false;
        let mut changes = Vec::new();
        loop {
            let page = log.read(l1, &prefix(name), cursor, 2);
            resync |= page.resync;
            changes.extend(
                page.events
                    .into_iter()
                    .map(|e| (e.stored, String::from_utf8(e.key).unwrap())),
            );
            *cursor = page.cursor;
            if !page.more {
                return (resync, changes);
            }
        }
    }

    fn stored(l1: &mut SlotTable, log: &mut KvEventLog, name: &str, key: &str) {
        let Reservation::Reserved(slot) = l1.reserve(&scoped(name, key), TenantId(0)) else {
            panic!("reserved")
        };
        l1.commit(slot, 1);
        for (key, stored) in l1.take_changes() {
            log.record(&key, stored, KvTier::L1);
        }
    }

    #[test]
    fn a_reader_starts_with_what_is_held_then_follows_the_changes_of_its_tenant_only() {
        let mut l1 = SlotTable::new(4, 64);
        let mut log = KvEventLog::new(7, &[]);
        stored(&mut l1, &mut log, "a", "k0");
        stored(&mut l1, &mut log, "b", "other");
        stored(&mut l1, &mut log, "a", "k1");
        let mut cursor = Vec::new();
        let (resync, changes) = read_all(&mut log, &l1, "a", &mut cursor);
        assert!(resync, "a new reader starts with a snapshot");
        assert_eq!(
            changes,
            vec![(true, "k0".to_string()), (true, "k1".to_string())]
        );
        // Caught up: nothing more, no resync.
        assert_eq!(read_all(&mut log, &l1, "a", &mut cursor), (false, vec![]));
        // Two more stores fill the pool; a third evicts a's k0 (the oldest).
        stored(&mut l1, &mut log, "a", "k2");
        stored(&mut l1, &mut log, "b", "other2");
        stored(&mut l1, &mut log, "a", "k3");
        let (resync, changes) = read_all(&mut log, &l1, "a", &mut cursor);
        assert!(!resync);
        assert_eq!(
            changes,
            vec![
                (true, "k2".to_string()),
                (false, "k0".to_string()),
                (true, "k3".to_string())
            ],
            "b's changes are not a's, and a's come in order"
        );
        // b's reader sees b's keys only.
        let (_, changes) = read_all(&mut log, &l1, "b", &mut Vec::new());
        assert!(changes.iter().all(|(_, key)| key.starts_with("other")));
    }

    #[test]
    fn a_reader_that_missed_changes_or_read_another_process_resyncs() {
        let mut l1 = SlotTable::new(MAX_EVENTS + 8, 64);
        let mut log = KvEventLog::new(7, &[]);
        stored(&mut l1, &mut log, "a", "first");
        let mut cursor = Vec::new();
        read_all(&mut log, &l1, "a", &mut cursor);
        // Control: one more change is read as a change.
        stored(&mut l1, &mut log, "a", "second");
        let mut control = cursor.clone();
        assert_eq!(
            read_all(&mut log, &l1, "a", &mut control),
            (false, vec![(true, "second".to_string())])
        );
        // Another tenant's changes push a's out of the log: a resyncs, and its
        // snapshot holds both keys.
        for n in 0..MAX_EVENTS {
            log.record(&scoped("b", &format!("{n}")), true, KvTier::L1);
        }
        let (resync, changes) = read_all(&mut log, &l1, "a", &mut cursor);
        assert!(resync, "a's change was dropped unread");
        assert_eq!(log.view().resyncs_total, 2, "the first read's and this one");
        assert_eq!(
            changes,
            vec![(true, "first".to_string()), (true, "second".to_string())]
        );
        // A cursor of another server process (or garbage) is a resync.
        let mut other = KvEventLog::new(8, &[]);
        assert!(other.read(&l1, &prefix("a"), &cursor, 8).resync);
        assert!(log.read(&l1, &prefix("a"), b"garbage", 8).resync);
    }

    #[test]
    fn the_log_stays_bounded_by_changes_bytes_and_tenants() {
        let l1 = SlotTable::new(1, 64);
        let mut log = KvEventLog::new(1, &[]);
        let long = "x".repeat(4000);
        for n in 0..(MAX_BYTES / 4000 + 10) {
            log.record(&scoped("a", &format!("{n}{long}")), true, KvTier::L1);
        }
        assert!(log.bytes <= MAX_BYTES, "{} bytes", log.bytes);
        let mut cursor = Vec::new();
        read_all(&mut log, &l1, "a", &mut cursor);
        for n in 0..=MAX_TENANTS {
            log.record(&scoped(&format!("t{n}"), "k"), true, KvTier::L2);
        }
        assert!(log.sequences.len() <= MAX_TENANTS);
        assert!(log.len() <= MAX_EVENTS);
        assert!(
            log.read(&l1, &prefix("a"), &cursor, 8).resync,
            "a new epoch: every reader resyncs"
        );
    }
}
