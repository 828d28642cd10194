//! The node's L2 decisions: what to write behind, when to read through, what a late or
//! failed answer means, and the breaker's state. The Redis I/O is the shell's.
//!
//! - **Write-behind** of published data only (`failure-modes.md` row 29): a
//!   server-driven `store` whose copy completed, or an engine-driven `commit_store`.
//!   The slot is pinned while the shell writes it ([`L2Request::Write`]) and unpinned on
//!   [`Input::L2Written`]: the shell reads the bytes straight from the L1 mapping on an
//!   L2 thread, so nothing is copied on the event loop and no second buffer is held;
//!   the pins are bounded by the write queue's bytes and by [`WRITE_BEHIND_SLOTS_SHARE`]
//!   of L1's slots, so that a slow L2 never leaves a store without a slot (row 27). A
//!   write past either bound, or one that the breaker skips, is dropped and counted.
//! - **Read-through**: a `retrieve`, a `retrieve_batch` item or a `prepare_retrieve`
//!   that misses L1 reserves an L1 slot for the key and asks L2 ([`L2Request::Get`]);
//!   the shell places a hit's bytes into that slot and reports [`Input::L2Got`]. The
//!   slot is published (promoted) and the request served from L1 as usual. `lookup`
//!   counts the L1 prefix, then asks L2 for the rest ([`L2Request::Exists`]).
//! - **Delivery**: the `L2Request::Get` of a `retrieve` (or a `retrieve_batch` item) also names
//!   the worker's buffer; the shell copies a hit there on the L2 thread that placed it
//!   ([`L2Fetched::Delivered`]), and the request is answered as its copy would have
//!   been. No hop through the event loop and the context pool in between. While it
//!   may deliver, the read counts as a copy on the context (a free waits for it,
//!   decision 9). A hit not delivered (larger than the buffer, say) is copied from L1
//!   as before.
//! - **Bounded waits**: a read waits while L2 keeps answering: its deadline is
//!   `--l2-timeout-ms` after it was asked or after L2's latest answer (to any read or
//!   write of this node), whichever is later. A read queued behind others that L2 is
//!   answering (the items of a large `retrieve_batch`, say) is served, not given up,
//!   while an L2 that stops answering has every read past its deadline within the
//!   timeout of its last answer (the shell bounds each read it sends by the timeout
//!   too, and the worker's own wait bounds the whole request). Past its deadline the
//!   request is answered as a miss. A delivering read is first given up
//!   with the shell ([`L2Request::Cancel`]), which answers at once unless the hit is
//!   being placed; the request is answered with that answer, so no byte lands in a
//!   buffer whose request was answered `nil`. The reserved slot stays reserved until
//!   the shell's late answer comes (so no one else's bytes land in it), then it is
//!   published (a late hit is still correct data) or given back.
//! - **Breaker**: every operation asks [`L2Health::admit`]; while down, reads are
//!   misses at once and writes are dropped; a probe goes out when the back-off ends.
//!
//! None of this touches pings or reaping: a ping is answered before any of it.

use super::ops::Want;
use crate::InstanceId;
use crate::l2::{
    Gate, HEADER_BYTES, L2Counters, L2Health, L2HealthConfig, L2State, OpResult, Push, ReadOutcome,
    WriteOutcome, WriteQueue,
};
use crate::node::{ContextId, CopyId, L2Request, Node, Note, Output, ReplyTo, SlotId};
use crate::protocol::ErrorCode;
use crate::protocol::ProtocolError;
use crate::time::Instant;
use std::collections::BTreeMap;
use std::time::Duration;

mod reads;

/// The key of the existence check sent as the breaker's probe when no request is
/// waiting for L2 (it never exists; any answer proves L2 is back).
pub const PROBE_KEY: &[u8] = b"kvwarden-l2-probe";

/// Write-behind pins at most one slot in this many of L1 (and at least one): the rest
/// stay evictable, so a store finds a slot however far behind L2 is (row 27: L1 is
/// served as before). A chunk smaller than a slot pins a whole slot, so the write
/// queue's byte bound alone would let a backlog of small chunks pin all of L1.
pub const WRITE_BEHIND_SLOTS_SHARE: usize = 4;

/// The L2 tier's settings, as the node sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2NodeConfig {
    /// The bound on every L2 wait (`--l2-timeout-ms`).
    pub timeout: Duration,
    /// The bound of the write-behind queue in bytes, headers included
    /// (`--l2-write-queue-bytes`).
    pub write_queue_bytes: u64,
    /// The circuit breaker's limits.
    pub health: L2HealthConfig,
}

/// One L2 read or existence check, named by the node.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct L2ReadId(pub u64);

/// One L2 write, named by the node.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct L2WriteId(pub u64);

/// Where an [`L2Request::Get`] delivers a hit besides its slot: the buffer a `retrieve`
/// (or a `retrieve_batch` item) names, at `offset`. The shell copies the placed payload
/// there only when it fits in the buffer from `offset`; the node checked the rest.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct L2Delivery {
    /// The copy the node counts on `context` while the read may deliver.
    pub copy: CopyId,
    /// The registered context.
    pub context: ContextId,
    /// The buffer's index in the context.
    pub buffer: usize,
    /// Where in the buffer.
    pub offset: u64,
    /// The length the worker asked for: deliver only a value of exactly this length
    /// (any other is not the worker's chunk, and must not touch its buffer).
    pub nbytes: u64,
    /// Deliver no later than this (the worker stops waiting then); past it the hit
    /// stays in L1 only (row 60). None: no bound.
    pub not_after: Option<Instant>,
}

/// How an [`L2Request::Get`] ended, as the shell reports it in [`Input::L2Got`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum L2Fetched {
    /// A whole, checked value: its `nbytes` payload bytes are in the reserved slot.
    Hit {
        /// Payload bytes placed in the slot (at most a slot).
        nbytes: u64,
    },
    /// A hit placed in the reserved slot and copied into the `L2Request::Get`'s `deliver`
    /// buffer as well.
    Delivered {
        /// Payload bytes placed in the slot and the buffer.
        nbytes: u64,
    },
    /// No such key (or a value larger than a slot here: not placed).
    Absent,
    /// A value that failed a check of its header; the shell deleted it.
    Corrupt,
    /// No answer within the timeout.
    TimedOut,
    /// Redis answered with an error, or the connection failed.
    Failed,
}

impl L2Fetched {
    /// The counters' view.
    pub fn outcome(self) -> ReadOutcome {
        match self {
            L2Fetched::Hit { .. } | L2Fetched::Delivered { .. } => ReadOutcome::Hit,
            L2Fetched::Absent => ReadOutcome::Absent,
            L2Fetched::Corrupt => ReadOutcome::Corrupt,
            L2Fetched::TimedOut => ReadOutcome::TimedOut,
            L2Fetched::Failed => ReadOutcome::Failed,
        }
    }
}

/// How an [`L2Request::Exists`] ended, as the shell reports it in [`Input::L2Existed`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum L2Presence {
    /// Redis answered: this many leading keys exist.
    Present(u64),
    /// No answer within the timeout.
    TimedOut,
    /// Redis answered with an error, or the connection failed.
    Failed,
}

impl L2Presence {
    fn op_result(self) -> OpResult {
        match self {
            L2Presence::Present(_) => OpResult::Succeeded,
            L2Presence::TimedOut => OpResult::TimedOut,
            L2Presence::Failed => OpResult::Failed,
        }
    }
}

/// L2's figures for `/status` and `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2Status {
    /// The breaker's state.
    pub state: L2State,
    /// What L2 did; `queue_bytes` is the write-behind queue now.
    pub counters: L2Counters,
    /// Reads and existence checks waiting for an answer.
    pub reads_in_flight: usize,
    /// Writes the shell is carrying out (their slots pinned).
    pub writes_in_flight: usize,
}

/// Who waits for an L2 read.
#[derive(Clone, Debug)]
pub(super) enum ReadFor {
    Retrieve {
        to: ReplyTo,
        instance: InstanceId,
        context: ContextId,
        want: Want,
    },
    BatchRetrieve {
        batch: u64,
        item: usize,
        instance: InstanceId,
        context: ContextId,
        want: Want,
    },
    PrepareRetrieve {
        to: ReplyTo,
        instance: InstanceId,
    },
    Lookup {
        to: ReplyTo,
        l1_count: u64,
    },
    Probe,
}

struct PendingRead {
    /// When it was asked: its deadline is the timeout after this or after L2's latest
    /// answer, whichever is later ([`L2Tier::deadline`]).
    asked: Instant,
    key: Vec<u8>,
    /// The slot reserved for a hit (`L2Request::Get` only).
    slot: Option<SlotId>,
    /// The copy counted on the waiter's context while the shell may deliver into its
    /// buffer (a delivering `L2Request::Get` only).
    delivery: Option<CopyId>,
    /// `L2Request::Cancel` was sent: the read is past its deadline and the node waits for the
    /// shell's `L2Got` (prompt, see [`L2Request::Cancel`]) before answering.
    cancelled: bool,
    /// Taken when the read is answered (by its result or its deadline).
    waiter: Option<ReadFor>,
}

/// The node's L2 state.
pub(super) struct L2Tier {
    config: L2NodeConfig,
    health: L2Health,
    queue: WriteQueue<()>,
    counters: L2Counters,
    /// Writes out with the shell: their pinned slot and queue bytes.
    writes: BTreeMap<L2WriteId, (SlotId, u64)>,
    /// The most writes out at once: [`WRITE_BEHIND_SLOTS_SHARE`] of L1's slots.
    writes_max: usize,
    reads: BTreeMap<L2ReadId, PendingRead>,
    /// When L2 last answered an operation of this node (a hit, an absent or corrupt
    /// value, an existence count, a write stored): it is alive, and reads queued behind
    /// that answer are waited for.
    answered_at: Option<Instant>,
}

impl L2Tier {
    pub(super) fn new(
        config: L2NodeConfig,
        num_slots: usize,
    ) -> Result<L2Tier, crate::l2::L2HealthConfigError> {
        Ok(L2Tier {
            writes_max: (num_slots / WRITE_BEHIND_SLOTS_SHARE).max(1),
            health: L2Health::new(config.health.clone())?,
            queue: WriteQueue::new(config.write_queue_bytes),
            config,
            counters: L2Counters::default(),
            writes: BTreeMap::new(),
            reads: BTreeMap::new(),
            answered_at: None,
        })
    }

    pub(super) fn status(&self) -> L2Status {
        let mut counters = self.counters;
        counters.queue_bytes = self.queue.queue_bytes();
        L2Status {
            state: self.health.state(),
            counters,
            reads_in_flight: self.reads.values().filter(|r| r.waiter.is_some()).count(),
            writes_in_flight: self.writes.len(),
        }
    }

    /// When `read` is given up: the timeout after it was asked or after L2's latest
    /// answer, whichever is later.
    fn deadline(&self, read: &PendingRead) -> Instant {
        let since = self.answered_at.map_or(read.asked, |at| at.max(read.asked));
        since + self.config.timeout
    }

    /// L2 answered an operation at `now` (`result`): reads waiting behind it wait on.
    fn answered(&mut self, now: Instant, result: OpResult) {
        if result == OpResult::Succeeded {
            self.answered_at = Some(self.answered_at.map_or(now, |at| at.max(now)));
        }
    }

    /// The earliest deadline of a read still waited for, or the breaker's probe time.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let reads = self
            .reads
            .values()
            .filter(|read| read.waiter.is_some() && !read.cancelled)
            .map(|read| self.deadline(read))
            .min();
        match (reads, self.health.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Node {
    /// Whether L2 is configured.
    pub fn l2_enabled(&self) -> bool {
        self.l2.is_some()
    }

    /// Records the result of an L2 operation in the breaker; a change is noted.
    fn l2_record(&mut self, now: Instant, result: OpResult) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        if let Some(transition) = tier.health.record(now, result) {
            self.note(Note::L2StateChanged {
                from: transition.from,
                to: transition.to,
            });
        }
    }

    /// A chunk was published in L1 at `slot` (a completed server-driven store, a
    /// `commit_store`): write it behind, pinned, or drop it (counted).
    pub(super) fn l2_write_behind(&mut self, now: Instant, slot: SlotId) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let Some((key, nbytes)) = self.l1.slots.pin_slot(slot) else {
            return;
        };
        let admitted =
            tier.writes.len() < tier.writes_max && !matches!(tier.health.admit(now), Gate::Skip);
        if !admitted || !self.l2_send_write(slot, key, nbytes) {
            if let Some(tier) = self.l2.as_mut() {
                tier.counters.record_dropped_write();
            }
            self.l1.slots.unpin(slot);
        }
    }

    /// Planted bug `WriteUnpublished` only: writes a reserved slot (row 29 forbids it).
    pub(super) fn l2_write_unpublished(&mut self, slot: SlotId, key: &[u8]) {
        let nbytes = self.l1.slots.slot_bytes();
        self.l2_send_write(slot, key.to_vec(), nbytes);
    }

    /// Queues the write of `nbytes` of `key` from `slot` and hands it to the shell at
    /// once (`L2Request::Write`); its bytes, header included, stay counted in the queue
    /// until `L2Written`. False, and nothing sent, when L2 is off or the queue is full:
    /// what to do then (count a drop, unpin) is the caller's.
    fn l2_send_write(&mut self, slot: SlotId, key: Vec<u8>, nbytes: u64) -> bool {
        let Some(tier) = self.l2.as_mut() else {
            return false;
        };
        let bytes = nbytes.saturating_add(HEADER_BYTES as u64);
        if tier.queue.push((), bytes) == Push::Dropped {
            return false;
        }
        let _ = tier.queue.pop();
        let write = L2WriteId(self.out.next_id());
        if let Some(tier) = self.l2.as_mut() {
            tier.writes.insert(write, (slot, bytes));
        }
        self.out.queue.push_back(Output::L2(L2Request::Write {
            write,
            key,
            slot,
            nbytes,
        }));
        true
    }

    pub(super) fn l2_written(&mut self, now: Instant, write: L2WriteId, outcome: WriteOutcome) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let Some((slot, bytes)) = tier.writes.remove(&write) else {
            return; // not a write of this node
        };
        tier.queue.complete(bytes);
        tier.counters.record_write(outcome);
        tier.answered(now, outcome.op_result());
        if outcome == WriteOutcome::Written
            && let Some(key) = self.l1.slots.committed_key(slot)
        {
            // The node key is the L2 key: L2 holds it now.
            self.events.record(key, true, crate::protocol::KvTier::L2);
        }
        self.l1.slots.unpin(slot);
        self.l2_record(now, outcome.op_result());
    }

    fn l2_probe(&mut self, now: Instant) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let due = tier.health.poll_timeout().is_some_and(|at| at <= now);
        if !due || tier.health.admit(now) != Gate::Probe {
            return;
        }
        self.l2_send_read(now, Vec::new(), None, None, ReadFor::Probe, |read| {
            Output::L2(L2Request::Exists {
                read,
                keys: vec![PROBE_KEY.to_vec()],
            })
        });
    }
}

/// The context of a transfer went (unregistered, reaped, process exited) while L2
/// was asked.
pub(super) fn gone(instance: InstanceId, op: &str) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::NotRegistered,
        format!(
            "`{op}`: instance {instance} was removed (unregistered, reaped or its process \
             exited) while its chunk was read from L2; register again and retry"
        ),
    )
}
