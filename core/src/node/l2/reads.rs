//! Read-through: an L1 miss asks L2, a hit is placed into a reserved slot (or
//! delivered straight into the worker's buffer), and every read has a deadline (the
//! module docs of [`super`] say what each answer means).

use super::super::l1::Reservation;
use super::{PendingRead, ReadFor, gone};
use crate::InstanceId;
use crate::l2::{Gate, OpResult, ReadOutcome};
use crate::node::contexts::CopyFor;
use crate::node::ops::Want;
use crate::node::{
    ContextId, CopyId, Direction, L2Delivery, L2Fetched, L2Presence, L2ReadId, L2Request, Node,
    Output, PlantedBug, ReplyTo, SlotId, TenantId,
};
use crate::protocol::Answer;
use crate::time::Instant;

impl Node {
    /// Asks L2 for `key` after an L1 miss: reserves a slot for the hit and sends
    /// `L2Request::Get`. Gives `waiter` back when L2 is not asked (off, breaker open, no slot,
    /// or the key is being stored or read already): the request is then a miss.
    pub(in crate::node) fn l2_ask(
        &mut self,
        now: Instant,
        key: &[u8],
        tenant: TenantId,
        waiter: ReadFor,
    ) -> Result<(), ReadFor> {
        if self.l2.is_none() {
            return Err(waiter);
        }
        let slot = match self.l1.slots.reserve(key, tenant) {
            Reservation::Reserved(slot) => slot,
            Reservation::AlreadyStored | Reservation::Full => return Err(waiter),
        };
        let Some(tier) = self.l2.as_mut() else {
            self.l1.slots.abort(slot);
            return Err(waiter);
        };
        if tier.health.admit(now) == Gate::Skip {
            tier.counters.record_skipped_read();
            self.l1.slots.abort(slot);
            return Err(waiter);
        }
        let deliver = self.l2_delivery(&waiter, slot);
        let delivery = deliver.map(|deliver| deliver.copy);
        self.l2_send_read(now, key.to_vec(), Some(slot), delivery, waiter, |read| {
            Output::L2(L2Request::Get {
                read,
                key: key.to_vec(),
                slot,
                deliver,
            })
        });
        Ok(())
    }

    /// Where a read for `waiter` delivers a hit besides `slot`: the buffer of a
    /// `retrieve` or a `retrieve_batch` item, counted as a copy on its context from here
    /// (decision 9: a free waits for it) until the read's `L2Got`. None for the rest
    /// (an engine-driven `prepare_retrieve` copies by itself).
    pub(super) fn l2_delivery(&mut self, waiter: &ReadFor, slot: SlotId) -> Option<L2Delivery> {
        let (instance, context, want, purpose) = match *waiter {
            ReadFor::Retrieve {
                to,
                instance,
                context,
                want,
            } => (instance, context, want, CopyFor::Retrieve(to)),
            ReadFor::BatchRetrieve {
                batch,
                item,
                instance,
                context,
                want,
            } => (
                instance,
                context,
                want,
                CopyFor::BatchRetrieve { batch, item },
            ),
            ReadFor::PrepareRetrieve { .. } | ReadFor::Lookup { .. } | ReadFor::Probe => {
                return None;
            }
        };
        let index = self
            .checked_buffer(
                context,
                "an L2 delivery",
                instance,
                want.buffer,
                want.offset,
                want.nbytes,
            )
            .ok()?;
        let not_after = self.work.batches.deadline_of(&purpose);
        Some(L2Delivery {
            copy: self.hold_copy(context, slot, purpose),
            context,
            buffer: index,
            offset: want.offset,
            nbytes: want.nbytes,
            not_after,
        })
    }

    /// `lookup`: `l1_count` leading keys are in L1; asks L2 about the rest. Answers now
    /// (`Some`) when L2 is not asked.
    pub(in crate::node) fn l2_lookup(
        &mut self,
        now: Instant,
        to: ReplyTo,
        keys: &[Vec<u8>],
        l1_count: u64,
    ) -> Option<u64> {
        let rest = keys.get(usize::try_from(l1_count).unwrap_or(usize::MAX)..)?;
        if rest.is_empty() {
            return Some(l1_count);
        }
        let Some(tier) = self.l2.as_mut() else {
            return Some(l1_count);
        };
        if tier.health.admit(now) == Gate::Skip {
            return Some(l1_count);
        }
        self.conns.start_job(to.conn, 1);
        let waiter = ReadFor::Lookup { to, l1_count };
        self.l2_send_read(now, Vec::new(), None, None, waiter, |read| {
            Output::L2(L2Request::Exists {
                read,
                keys: rest.to_vec(),
            })
        });
        None
    }

    /// Sends the L2 read `ask(read)` under a new id and waits for it until its deadline
    /// (the L2 timeout from `now`, or from L2's latest answer if later): `waiter` is
    /// resumed when it ends or its deadline passes.
    /// `key` and `slot` are an `L2Request::Get`'s (the slot reserved for a hit, and the copy
    /// counted for a delivery); an existence check has none.
    pub(super) fn l2_send_read(
        &mut self,
        now: Instant,
        key: Vec<u8>,
        slot: Option<SlotId>,
        delivery: Option<CopyId>,
        waiter: ReadFor,
        ask: impl FnOnce(L2ReadId) -> Output,
    ) {
        if self.l2.is_none() {
            return;
        }
        let read = L2ReadId(self.out.next_id());
        if let Some(tier) = self.l2.as_mut() {
            tier.reads.insert(
                read,
                PendingRead {
                    asked: now,
                    key,
                    slot,
                    delivery,
                    cancelled: false,
                    waiter: Some(waiter),
                },
            );
        }
        self.out.queue.push_back(ask(read));
    }

    pub(in crate::node) fn l2_got(&mut self, now: Instant, read: L2ReadId, fetched: L2Fetched) {
        let slot_bytes = self.l1.slots.slot_bytes();
        let serve_corrupt = self.planted(PlantedBug::ServeCorrupt);
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let Some(pending) = tier.reads.remove(&read) else {
            return; // not a read of this node
        };
        // Late or not, an answer from L2 shows it alive to the reads queued behind it.
        tier.answered(now, fetched.outcome().op_result());
        if fetched == L2Fetched::Corrupt {
            // The shell deletes a corrupt value: L2 no longer holds the key.
            self.events
                .record(&pending.key, false, crate::protocol::KvTier::L2);
        }
        let fetched = match fetched {
            L2Fetched::Corrupt if serve_corrupt => L2Fetched::Hit { nbytes: slot_bytes },
            // Delivered where no delivery was asked: only the slot counts.
            L2Fetched::Delivered { nbytes } if pending.delivery.is_none() => {
                L2Fetched::Hit { nbytes }
            }
            fetched => fetched,
        };
        let placed = match (pending.slot, fetched) {
            (Some(slot), L2Fetched::Hit { nbytes } | L2Fetched::Delivered { nbytes })
                if nbytes <= slot_bytes =>
            {
                // Promoted: correct data, checked by the shell, even when it came late.
                self.l1.slots.commit(slot, nbytes);
                Some((slot, nbytes))
            }
            (Some(slot), _) => {
                self.l1.slots.abort(slot);
                None
            }
            (None, _) => None,
        };
        let hit = placed.is_some();
        let outcome = if hit || fetched.outcome() != ReadOutcome::Hit {
            fetched.outcome()
        } else {
            ReadOutcome::Absent // larger than a slot: not placed
        };
        if let Some(copy) = pending.delivery {
            if let (Some(_waiter), Some((slot, nbytes)), L2Fetched::Delivered { .. }) =
                (&pending.waiter, placed, fetched)
            {
                // The worker's buffer holds the bytes: answered as the copy it was,
                // which unpins the slot pinned here for it.
                self.l2_count_read(now, outcome);
                let _ = self.l1.slots.pin_slot(slot);
                self.copy_done(copy, Ok(nbytes));
                return;
            }
            // Nothing was delivered: the context is free of this read.
            self.copy_dropped(copy);
        }
        let Some(waiter) = pending.waiter else {
            return; // answered by its deadline, counted there
        };
        self.l2_count_read(now, outcome);
        self.l2_resume(now, waiter, &pending.key, hit);
    }

    /// Counts an answered read and tells the breaker.
    pub(super) fn l2_count_read(&mut self, now: Instant, outcome: ReadOutcome) {
        if let Some(tier) = self.l2.as_mut() {
            tier.counters.record_read(outcome);
        }
        self.l2_record(now, outcome.op_result());
    }

    pub(in crate::node) fn l2_existed(
        &mut self,
        now: Instant,
        read: L2ReadId,
        presence: L2Presence,
    ) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let Some(pending) = tier.reads.remove(&read) else {
            return;
        };
        tier.answered(now, presence.op_result());
        let Some(waiter) = pending.waiter else {
            return;
        };
        tier.counters.record_failed_probe(presence.op_result());
        self.l2_record(now, presence.op_result());
        if let ReadFor::Lookup { to, l1_count } = waiter {
            self.conns.end_job(to.conn, 1);
            let present = match presence {
                L2Presence::Present(count) => count,
                L2Presence::TimedOut | L2Presence::Failed => 0,
            };
            self.reply(to, Ok(Answer::Count(l1_count.saturating_add(present))));
        }
    }

    /// Answers every read past its deadline as a miss; sends the breaker's probe when
    /// it is due.
    pub(in crate::node) fn l2_timeout(&mut self, now: Instant) {
        let Some(tier) = self.l2.as_mut() else {
            return;
        };
        let mut expired = Vec::new();
        let mut gone = Vec::new();
        let mut cancels = Vec::new();
        let due: Vec<L2ReadId> = tier
            .reads
            .iter()
            .filter(|(_, read)| tier.deadline(read) <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            let Some(read) = tier.reads.get_mut(&id) else {
                continue;
            };
            if read.delivery.is_some() {
                // The shell may be writing into the worker's buffer: only its answer,
                // prompt once asked, tells whether it did.
                if read.waiter.is_some() && !read.cancelled {
                    read.cancelled = true;
                    cancels.push(id);
                }
                continue;
            }
            if let Some(waiter) = read.waiter.take() {
                expired.push((waiter, read.key.clone()));
                // Given up with the shell too: a read or existence check no one waits
                // for takes no L2 thread's time, and a read's answer (prompt) gives its
                // slot back.
                read.cancelled = true;
                cancels.push(id);
            }
            if read.slot.is_none() {
                gone.push(id); // nothing held: a late answer finds nothing
            }
        }
        for id in gone {
            tier.reads.remove(&id);
        }
        for read in cancels {
            self.out
                .queue
                .push_back(Output::L2(L2Request::Cancel { read }));
        }
        for (waiter, key) in expired {
            if let Some(tier) = self.l2.as_mut() {
                match waiter {
                    ReadFor::Lookup { .. } | ReadFor::Probe => {
                        tier.counters.record_failed_probe(OpResult::TimedOut)
                    }
                    _ => tier.counters.record_read(ReadOutcome::TimedOut),
                }
            }
            self.l2_record(now, OpResult::TimedOut);
            self.l2_resume(now, waiter, &key, false);
        }
        self.l2_probe(now);
    }

    /// A read ended (hit: the key is now committed in L1): serve its request.
    pub(super) fn l2_resume(&mut self, now: Instant, waiter: ReadFor, key: &[u8], hit: bool) {
        match waiter {
            ReadFor::Retrieve {
                to,
                instance,
                context,
                want,
            } => {
                self.conns.end_job(to.conn, 1);
                let answer = if hit {
                    self.retrieve_l1(to, instance, context, key, want)
                } else {
                    Some(Ok(Answer::Length(None)))
                };
                if let Some(answer) = answer {
                    self.reply(to, answer);
                }
            }
            ReadFor::BatchRetrieve {
                batch,
                item,
                instance,
                context,
                want,
            } => {
                self.resume_batch_item(batch, item, instance, context, want, key, hit);
            }
            ReadFor::PrepareRetrieve { to, instance } => {
                self.conns.end_job(to.conn, 1);
                let answer = if hit {
                    self.prepare_retrieve_l1(now, instance, key)
                } else {
                    Ok(Answer::Pinned(None))
                };
                self.reply(to, answer);
            }
            ReadFor::Lookup { to, l1_count } => {
                self.conns.end_job(to.conn, 1);
                self.reply(to, Ok(Answer::Count(l1_count)));
            }
            ReadFor::Probe => {}
        }
    }

    /// Item `item` of `batch` after its L2 read ended: copied from the slot the hit
    /// was committed to, or a miss.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::node) fn resume_batch_item(
        &mut self,
        batch: u64,
        item: usize,
        instance: InstanceId,
        context: ContextId,
        want: Want,
        key: &[u8],
        hit: bool,
    ) {
        if !hit {
            self.item_done(batch, item, Ok(None));
            return;
        }
        if !self.work.contexts.contains(context) {
            self.item_done(batch, item, Err(gone(instance, "retrieve_batch")));
            return;
        }
        let what = format!("`retrieve_batch` items[{item}]");
        let index = match self.checked_buffer(
            context,
            &what,
            instance,
            want.buffer,
            want.offset,
            want.nbytes,
        ) {
            Ok(index) => index,
            Err(error) => {
                self.item_done(batch, item, Err(error));
                return;
            }
        };
        let deadline = self.work.batches.deadline(batch);
        let Some(slot) = self.pin_in_time(deadline, key, want.nbytes) else {
            self.item_done(batch, item, Ok(None));
            return;
        };
        self.start_copy(
            context,
            Direction::FromL1,
            index,
            want.offset,
            slot,
            want.nbytes,
            CopyFor::BatchRetrieve { batch, item },
        );
    }
}
