//! The node's L2 outputs carried out with the L2 client, and the client's results
//! handed back to the node. Nothing here waits for Redis: the client's threads do.

use super::{Done, Server};
use crate::l2::{L2Completion, L2Read, PrefixOutcome};
use crate::server::context::Context;
use crate::server::l1::SlotBytes;
use kvwarden_core::l2::{L2State, Push, ReadOutcome, WriteOutcome};
use kvwarden_core::node::Input;
use kvwarden_core::node::l1::SlotId;
use kvwarden_core::node::l2::{L2Delivery, L2Fetched, L2Presence, L2ReadId, L2WriteId};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where an L2 hit lands: the slot the node reserved for it, then (with a target) the
/// worker's buffer.
struct SlotLanding {
    pool: Arc<crate::memfd::SharedMapping>,
    offset: u64,
    slot_bytes: u64,
    /// The worker's buffer: its context, buffer index, offset and the length asked for.
    target: Option<(Arc<Context>, usize, u64, u64)>,
    /// Deliver no later than this: the worker stops waiting then.
    not_after: Option<std::time::Instant>,
    delivered: Arc<AtomicBool>,
}

impl crate::l2::Landing for SlotLanding {
    fn room(&mut self, nbytes: usize) -> Option<&mut [u8]> {
        if nbytes as u64 > self.slot_bytes {
            return None; // written by a server with larger slots
        }
        let ptr = self.pool.range_ptr(self.offset, nbytes as u64)?;
        // SAFETY: `range_ptr` checked that the range lies inside the pool, which `self`
        // keeps mapped; the node reserved this slot for this read alone and keeps it so
        // until `L2Got`, which the client reports only after it stopped using the room.
        // Nothing in this process reads or writes a reserved slot meanwhile (an
        // engine-driven worker that maps the pool and writes into it anyway writes into
        // a slot that is not yet published: its bytes are never served unchecked).
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, nbytes) })
    }

    fn landed(&mut self, nbytes: usize) {
        let nbytes = nbytes as u64;
        // Delivered only at exactly the length the worker asked for: a value of another
        // length is not its chunk (the node answers it as a miss).
        // Past the worker's deadline the hit stays in L1 only (row 60).
        let on_time = self
            .not_after
            .is_none_or(|at| std::time::Instant::now() <= at);
        if let Some((context, buffer, at, wanted)) = &self.target
            && on_time
            && *wanted == nbytes
            && let Some(buffer) = context.buffers.get(*buffer)
            && at
                .checked_add(nbytes)
                .is_some_and(|end| end <= buffer.len())
            && buffer.copy_from_l1(&self.pool, self.offset, *at, nbytes)
        {
            self.delivered.store(true, Ordering::Release);
        }
    }
}

/// An L2 read out with the client: the slot reserved for it, whether its landing
/// delivered into the worker's buffer too, and the handle that gives it up.
pub(super) struct PendingL2Read {
    slot: SlotId,
    delivered: Arc<AtomicBool>,
    handle: L2Read,
}

impl Server {
    /// Writes a published slot behind: an L2 thread sends the bytes straight from the
    /// L1 mapping (the node keeps the slot pinned until `L2Written`), so the loop copies
    /// nothing.
    pub(super) fn l2_write(&mut self, write: L2WriteId, key: Vec<u8>, slot: SlotId, nbytes: u64) {
        let failed = Input::L2Written {
            write,
            outcome: WriteOutcome::Failed,
        };
        let (Some(client), Ok(len)) = (&self.l2, usize::try_from(nbytes)) else {
            self.inputs.push_back(failed);
            return;
        };
        let offset = self.l1.offset(slot);
        let Some(bytes) = SlotBytes::new(self.l1.mapping(), offset, len) else {
            self.inputs.push_back(failed);
            return;
        };
        let push = client.submit_write(write.0, key, bytes);
        if push == Push::Dropped {
            // The node is the write queue's bound; the client drops only once it is
            // shutting down.
            self.inputs.push_back(failed);
        }
    }

    /// Reads `key` from L2 for the slot the node reserved and, with `deliver`, for the
    /// worker's buffer too.
    pub(super) fn l2_get(
        &mut self,
        read: L2ReadId,
        key: Vec<u8>,
        slot: SlotId,
        deliver: Option<L2Delivery>,
    ) {
        let Some(client) = &self.l2 else {
            self.inputs.push_back(Input::L2Got {
                read,
                fetched: L2Fetched::Failed,
            });
            return;
        };
        // The L2 thread receives a hit straight into the reserved slot (the node keeps
        // it reserved until `L2Got`, even past the deadline, and the client never
        // touches a landing of a read it already answered or gave up), then copies it
        // on into the worker's buffer when it has the length asked for and fits there
        // (the node counts the read as a copy on the context, so the buffer stays
        // mapped): the loop and the pool copy nothing.
        let not_after = deliver
            .and_then(|deliver| deliver.not_after)
            .map(|at| self.clock_of(at));
        let target = deliver.and_then(|deliver| {
            let context = Arc::clone(self.contexts.get(&deliver.context)?);
            Some((context, deliver.buffer, deliver.offset, deliver.nbytes))
        });
        let delivered = Arc::new(AtomicBool::new(false));
        let landing = SlotLanding {
            pool: Arc::clone(self.l1.mapping()),
            offset: self.l1.offset(slot),
            slot_bytes: self.l1.slot_bytes(),
            target,
            not_after,
            delivered: Arc::clone(&delivered),
        };
        let handle = client.get_into(read.0, key, landing);
        self.l2_reads.insert(
            read.0,
            PendingL2Read {
                slot,
                delivered,
                handle,
            },
        );
    }

    /// Gives up a delivering read past the node's deadline; its answer comes through
    /// the client as any answer.
    pub(super) fn l2_cancel(&mut self, read: L2ReadId) {
        if let Some(pending) = self.l2_reads.get(&read.0) {
            pending.handle.cancel();
        } else if let Some(check) = self.l2_checks.get(&read.0) {
            check.cancel();
        }
    }

    /// Counts the leading `keys` present in L2.
    pub(super) fn l2_exists(&mut self, read: L2ReadId, keys: Vec<Vec<u8>>) {
        let Some(client) = &self.l2 else {
            self.inputs.push_back(Input::L2Existed {
                read,
                presence: L2Presence::Failed,
            });
            return;
        };
        let check = client.exists_prefix(read.0, keys);
        self.l2_checks.insert(read.0, check);
    }

    /// Hands every L2 result that arrived to the node; a hit's payload is first copied
    /// into its reserved slot on the context pool (the node is told once it is there).
    pub(super) fn take_l2_completions(&mut self) {
        let Some(client) = &self.l2 else {
            return;
        };
        for completion in client.drain() {
            let input = match completion {
                L2Completion::Read {
                    token,
                    outcome,
                    payload,
                    placed,
                    ..
                } => {
                    let read = L2ReadId(token);
                    let pending = self.l2_reads.remove(&token);
                    let delivered = pending
                        .as_ref()
                        .is_some_and(|pending| pending.delivered.load(Ordering::Acquire));
                    let slot = pending.map(|pending| pending.slot);
                    let fetched = match (outcome, payload, slot) {
                        (ReadOutcome::Hit, None, Some(_)) if placed.is_some() => {
                            let nbytes = placed.unwrap_or(0);
                            if delivered {
                                L2Fetched::Delivered { nbytes }
                            } else {
                                L2Fetched::Hit { nbytes }
                            }
                        }
                        (ReadOutcome::Hit, Some(payload), Some(slot)) => {
                            if payload.len() as u64 > self.l1.slot_bytes() {
                                L2Fetched::Absent // written by a server with larger slots
                            } else {
                                self.place(read, slot, payload);
                                continue;
                            }
                        }
                        (ReadOutcome::Hit, _, _) => L2Fetched::Failed,
                        (ReadOutcome::Absent, _, _) => L2Fetched::Absent,
                        (ReadOutcome::Corrupt, _, _) => L2Fetched::Corrupt,
                        (ReadOutcome::TimedOut, _, _) => L2Fetched::TimedOut,
                        (ReadOutcome::Failed, _, _) => L2Fetched::Failed,
                    };
                    Input::L2Got { read, fetched }
                }
                L2Completion::Prefix { token, outcome } => {
                    self.l2_checks.remove(&token);
                    Input::L2Existed {
                        read: L2ReadId(token),
                        presence: match outcome {
                            PrefixOutcome::Present(count) => L2Presence::Present(count as u64),
                            PrefixOutcome::TimedOut => L2Presence::TimedOut,
                            PrefixOutcome::Failed => L2Presence::Failed,
                        },
                    }
                }
                L2Completion::Written { token, outcome, .. } => Input::L2Written {
                    write: L2WriteId(token),
                    outcome,
                },
            };
            self.inputs.push_back(input);
        }
        if !self.inputs.is_empty() {
            self.carry_out();
        }
    }

    /// Copies a hit's payload into its reserved slot off the loop.
    fn place(&mut self, read: L2ReadId, slot: SlotId, payload: Vec<u8>) {
        let pool = Arc::clone(self.l1.mapping());
        let offset = self.l1.offset(slot);
        self.pool.submit(
            move || {
                let fetched = if pool.write(offset, &payload) {
                    L2Fetched::Hit {
                        nbytes: payload.len() as u64,
                    }
                } else {
                    L2Fetched::Failed
                };
                Done::L2Placed { read, fetched }
            },
            move |_panic| Done::L2Placed {
                read,
                fetched: L2Fetched::Failed,
            },
        );
    }

    /// At shutdown, after the node stopped: gives the write-behind queue up to
    /// [`kvwarden_core::l2::SHUTDOWN_DRAIN`] to reach L2 and logs what it wrote and what
    /// it lost (also counted in `write_drops`). A restart loses what this line says is
    /// dropped.
    pub(super) fn finish_l2_writes(&mut self) {
        let Some(client) = &self.l2 else {
            return;
        };
        let finished = client.finish_writes(kvwarden_core::l2::SHUTDOWN_DRAIN);
        if finished.failed == 0 && finished.dropped == 0 {
            tracing::info!(
                written = finished.written,
                "L2 write-behind queue written out at shutdown"
            );
        } else {
            tracing::warn!(
                written = finished.written,
                failed = finished.failed,
                dropped = finished.dropped,
                bound_ms = kvwarden_core::l2::SHUTDOWN_DRAIN.as_millis() as u64,
                "L2 write-behind queue not written out at shutdown: the failed and dropped \
                 chunks are lost to L2 (they were in this node's L1 only)"
            );
        }
    }

    /// Logs L2 going down and coming back, once each.
    pub(super) fn l2_state_changed(&mut self, from: L2State, to: L2State) {
        if to == L2State::Down && !self.l2_down_logged {
            self.l2_down_logged = true;
            let reason = self
                .l2
                .as_ref()
                .and_then(|client| client.last_error())
                .unwrap_or_else(|| "its operations failed or timed out".to_string());
            tracing::warn!(
                from = from.as_str(),
                %reason,
                "L2 is down: L1 misses are answered as misses at once and writes behind are \
                 dropped (counted) until a probe succeeds; pings, L1 and reaping are unaffected"
            );
        } else if from == L2State::Down && self.l2_down_logged {
            self.l2_down_logged = false;
            tracing::info!(to = to.as_str(), "L2 is back");
        } else {
            tracing::debug!(from = from.as_str(), to = to.as_str(), "L2 state changed");
        }
    }
}
