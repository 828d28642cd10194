//! The agenda: what happens next in virtual time.
//!
//! Events at the same instant run in the order they were scheduled (a serial breaks
//! ties), so a run never depends on heap internals.

use crate::message::{Envelope, ReplyEnvelope};
use crate::time::Nanos;
use kvwarden_core::InstanceId;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Something scheduled to happen.
#[derive(Debug)]
pub enum Event {
    /// A request reaches the server's socket (boxed: the agenda moves its items).
    ToServer(Box<Envelope>),
    /// A reply reaches a worker.
    ToWorker(Box<ReplyEnvelope>),
    /// A worker's next timer (valid while `generation` is the worker's current one).
    WorkerWake {
        /// The slot.
        slot: usize,
        /// The wake generation it was scheduled under.
        generation: u64,
    },
    /// The server loop's deadline (`poll_timeout`).
    ServerWake {
        /// The wake generation it was scheduled under.
        generation: u64,
    },
    /// A context build finished off the loop.
    BuildDone {
        /// The server boot that started it.
        boot: u64,
        /// The node's context id.
        build: u64,
        /// Whether it failed.
        failed: bool,
    },
    /// A server-driven copy finished.
    CopyDone {
        /// The server boot that started it.
        boot: u64,
        /// The node's copy id.
        copy: u64,
    },
    /// Rope tables are computed.
    BlendDone {
        /// The server boot that started it.
        boot: u64,
        /// The node's computation id.
        blend: u64,
    },
    /// A free returned.
    FreeDone {
        /// The server boot that started it.
        boot: u64,
        /// The node's free id.
        free: u64,
    },
    /// An L2 operation ends.
    L2Done {
        /// The server boot that issued it.
        boot: u64,
        /// The operation.
        job: crate::l2::L2Job,
        /// How it ends.
        fate: crate::l2::L2Fate,
    },
    /// A seal or scan of the pool file ends.
    PoolDone {
        /// The server boot that started it.
        boot: u64,
        /// The job.
        job: crate::pool::PoolJob,
    },
    /// A dead worker's connections close (after what it sent before it died).
    Disconnect {
        /// The server boot the connections were opened to.
        boot: u64,
        /// The slot.
        slot: usize,
        /// The process.
        incarnation: u32,
    },
    /// The pidfd of a same-host worker reports its exit.
    ExitNotice {
        /// The instance whose process exited.
        instance: InstanceId,
    },
    /// Worker slot `0` starts its first process.
    Start(usize),
    /// A restarted server starts listening.
    ServerUp,
    /// The scenario's fault number `index` strikes.
    Fault(usize),
    /// A checkpoint for expectations at a given instant.
    Checkpoint(usize),
}

struct Scheduled {
    at: Nanos,
    serial: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.serial) == (other.at, other.serial)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap's maximum is the earliest event.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.serial).cmp(&(self.at, self.serial))
    }
}

/// Events ordered by time, then by scheduling order.
#[derive(Default)]
pub struct Agenda {
    heap: BinaryHeap<Scheduled>,
    serial: u64,
}

impl Agenda {
    /// Schedules `event` at `at`.
    pub fn push(&mut self, at: Nanos, event: Event) {
        self.serial += 1;
        self.heap.push(Scheduled {
            at,
            serial: self.serial,
            event,
        });
    }

    /// The earliest event, if any, with its time.
    pub fn pop(&mut self) -> Option<(Nanos, Event)> {
        self.heap
            .pop()
            .map(|scheduled| (scheduled.at, scheduled.event))
    }

    /// When the earliest event is due.
    pub fn peek_at(&self) -> Option<Nanos> {
        self.heap.peek().map(|scheduled| scheduled.at)
    }

    /// Events pending.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}
