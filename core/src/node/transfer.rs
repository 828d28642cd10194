//! Transfers: stores and retrieves, single and batched, and the engine-driven
//! prepare/commit pair. The node's L1 slots ([`super::l1`]), the strategies
//! ([`super::engine`]) and the copies in flight meet here; `ops.rs` dispatches to it.

use super::batches::Follower;
use super::contexts::CopyFor;
use super::engine::{CommitStore, PrepareRetrieve, PrepareStore};
use super::l1::Reservation;
use super::l2::ReadFor;
use super::ops::{Immediate, Want, bad_args, pinned, reserved, too_many_held};
use crate::liveness::TransferError;
use crate::node::{
    Built, ConnId, ContextId, CopyId, Direction, Job, Node, PlantedBug, ReplyTo, SlotId, SlotTable,
    TransferStrategy,
};
use crate::protocol::{Answer, ProtocolError};
use crate::protocol::{ErrorCode, RetrieveItem, StoreItem};
use crate::time::Instant;
use crate::{InstanceId, Module};

impl Node {
    /// The context of a transfer (liveness already refreshed by `evidence`).
    fn transfer_context(
        &mut self,
        now: Instant,
        instance: InstanceId,
        module: Module,
        op: &str,
    ) -> Result<ContextId, ProtocolError> {
        match self.liveness.transfer(now, instance, module) {
            Ok(&context) => Ok(context),
            Err(TransferError::NotRegistered) => Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                match module {
                    Module::ServerDriven => format!(
                        "`{op}`: instance {instance} is not registered here; re-register it \
                         (register_kv_cache) and retry"
                    ),
                    Module::EngineDriven => format!(
                        "`{op}`: instance {instance} is not registered for engine-driven \
                         transfers here; re-register it (register_engine_driven) and retry"
                    ),
                },
            )),
            Err(TransferError::NotReady) => Err(ProtocolError::new(
                ErrorCode::NotReady,
                format!("`{op}`: instance {instance} is still being registered; retry shortly"),
            )),
        }
    }

    /// Index of `buffer` in `context`, checked against `[offset, offset + nbytes)`.
    /// `what` names the request (or the batch item) in the message: "`store`".
    pub(super) fn checked_buffer(
        &self,
        context: ContextId,
        what: &str,
        instance: InstanceId,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Result<usize, ProtocolError> {
        let lens = match self.work.contexts.built(context) {
            Some(Built::ServerDriven { buffer_lens }) => buffer_lens,
            _ => {
                return Err(bad_args(format!(
                    "{what}: instance {instance} holds no server-driven buffers"
                )));
            }
        };
        let count = lens.len();
        let Some(index) = usize::try_from(buffer).ok().filter(|&i| i < count) else {
            return Err(bad_args(format!(
                "{what}: buffer index {buffer}, but instance {instance} registered {count} buffers (valid: 0..{count})"
            )));
        };
        let len = lens[index];
        let fits = offset.checked_add(nbytes).is_some_and(|end| end <= len);
        if !fits {
            return Err(bad_args(format!(
                "{what}: offset {offset} + nbytes {nbytes} runs past the end of buffer {buffer} ({len} bytes)"
            )));
        }
        Ok(index)
    }

    /// Opens a server-driven transfer (`store`, `retrieve` and their batches) in the one
    /// order they all keep: the instance's context first (`transfer_context`), then
    /// `validate` on it (buffer ranges, slot sizes: what it returns comes back with the
    /// context), then the connection's cap. So a request that names no registered
    /// instance is told so, and a malformed one is refused as malformed even on a full
    /// connection; only a well-formed one is told to slow down.
    pub(super) fn open_transfer<T>(
        &mut self,
        now: Instant,
        conn: ConnId,
        instance: InstanceId,
        op: &str,
        items: usize,
        validate: impl FnOnce(&Self, ContextId) -> Result<T, ProtocolError>,
    ) -> Result<(ContextId, T), ProtocolError> {
        let context = self.transfer_context(now, instance, Module::ServerDriven, op)?;
        let checked = validate(self, context)?;
        if !self.conns.has_room(conn, items) {
            return Err(self.conns.overloaded(conn));
        }
        Ok((context, checked))
    }

    /// Refuses a store of `nbytes` that would not fit one L1 slot. `what` names the
    /// request (or the batch item) in the message: "`store`".
    fn fits_a_slot(&self, what: &str, nbytes: u64) -> Result<(), ProtocolError> {
        let slot_bytes = self.l1.slots.slot_bytes();
        if nbytes > slot_bytes {
            return Err(bad_args(format!(
                "{what}: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} bytes, \
                 --slot-bytes); store chunks of at most one slot"
            )));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_copy(
        &mut self,
        context: ContextId,
        direction: Direction,
        buffer: usize,
        offset: u64,
        slot: SlotId,
        nbytes: u64,
        purpose: CopyFor,
    ) {
        let not_after = self.work.batches.deadline_of(&purpose);
        let conn = self.work.batches.conn_of(&purpose);
        let copy = self.hold_copy(context, slot, purpose);
        self.submit_copy(
            conn,
            Job::Copy {
                copy,
                context,
                direction,
                buffer,
                offset,
                slot,
                nbytes,
                not_after,
            },
        );
    }

    /// Counts a copy between `context` and `slot` for `purpose`: the context's free
    /// waits until [`Node::copy_done`] or [`Node::copy_dropped`] ends it.
    pub(super) fn hold_copy(
        &mut self,
        context: ContextId,
        slot: SlotId,
        purpose: CopyFor,
    ) -> CopyId {
        let copy = CopyId(self.out.next_id());
        self.work.contexts.start_copy(copy, context, slot, purpose);
        copy
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn store(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Immediate {
        let opened = self.open_transfer(now, to.conn, instance, "store", 1, |node, context| {
            let index =
                node.checked_buffer(context, "`store`", instance, buffer, offset, nbytes)?;
            node.fits_a_slot("`store`", nbytes)?;
            Ok(index)
        });
        let (context, index) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        match self.l1.slots.reserve(&key, self.conns.tenant(to.conn)) {
            Reservation::AlreadyStored => Some(Ok(Answer::Flag(true))),
            Reservation::Full => Some(Ok(Answer::Flag(false))),
            Reservation::Reserved(slot) => {
                self.conns.start_job(to.conn, 1);
                self.start_copy(
                    context,
                    Direction::ToL1,
                    index,
                    offset,
                    slot,
                    nbytes,
                    CopyFor::Store(to),
                );
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn retrieve(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Immediate {
        let opened = self.open_transfer(now, to.conn, instance, "retrieve", 1, |node, context| {
            node.checked_buffer(context, "`retrieve`", instance, buffer, offset, nbytes)
        });
        let context = match opened {
            Ok((context, _)) => context,
            Err(error) => return Some(Err(error)),
        };
        let want = Want {
            buffer,
            offset,
            nbytes,
        };
        if self.l1_holds(&key) || !self.l2_enabled() {
            return self.retrieve_l1(to, instance, context, &key, want);
        }
        let waiter = ReadFor::Retrieve {
            to,
            instance,
            context,
            want,
        };
        match self.l2_ask(now, &key, self.conns.tenant(to.conn), waiter) {
            Ok(()) => {
                self.conns.start_job(to.conn, 1);
                None
            }
            Err(_) => Some(Ok(Answer::Length(None))), // a miss
        }
    }

    /// Whether `key` is committed in L1.
    fn l1_holds(&self, key: &[u8]) -> bool {
        self.l1
            .slots
            .lookup_prefix(std::slice::from_ref(&key.to_vec()))
            == 1
    }

    /// Pins `key`'s committed slot for a copy of exactly `nbytes` into a worker's
    /// buffer. A value of another length is a miss (counted): a retrieve never writes
    /// more, or less, than its destination asked for.
    pub(super) fn pin_exact(&mut self, key: &[u8], nbytes: u64) -> Option<SlotId> {
        let (slot, len) = self.l1.slots.pin(key)?;
        if len != nbytes {
            self.l1.slots.unpin(slot);
            self.counters.length_mismatch();
            return None;
        }
        Some(slot)
    }

    /// [`Node::pin_exact`] for a copy into a worker's buffer that may start only by
    /// `deadline` (its request's): past it, nothing is pinned (row 60). Either way a
    /// None is answered as a miss.
    pub(super) fn pin_in_time(
        &mut self,
        deadline: Option<Instant>,
        key: &[u8],
        nbytes: u64,
    ) -> Option<SlotId> {
        if self.past(deadline) {
            return None; // its worker stopped waiting
        }
        self.pin_exact(key, nbytes)
    }

    /// The L1 part of `retrieve`: pin a value of the wanted length, copy it out.
    pub(super) fn retrieve_l1(
        &mut self,
        to: ReplyTo,
        instance: InstanceId,
        context: ContextId,
        key: &[u8],
        want: Want,
    ) -> Immediate {
        if !self.work.contexts.contains(context) {
            return Some(Err(super::l2::gone(instance, "retrieve")));
        }
        let index = match self.checked_buffer(
            context,
            "`retrieve`",
            instance,
            want.buffer,
            want.offset,
            want.nbytes,
        ) {
            Ok(index) => index,
            Err(error) => return Some(Err(error)),
        };
        let Some(slot) = self.pin_in_time(to.deadline, key, want.nbytes) else {
            return Some(Ok(Answer::Length(None))); // a miss
        };
        self.conns.start_job(to.conn, 1);
        self.start_copy(
            context,
            Direction::FromL1,
            index,
            want.offset,
            slot,
            want.nbytes,
            CopyFor::Retrieve(to),
        );
        None
    }

    /// A batch is one transfer (one refresh, one slot of the connection's cap). Every
    /// item is validated before any slot is reserved, so a bad item refuses the whole
    /// batch and copies nothing; each item then copies on its own and the reply goes
    /// out once the last is done.
    pub(super) fn store_batch(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        items: Vec<StoreItem>,
    ) -> Immediate {
        let count = items.len();
        let opened = self.open_transfer(
            now,
            to.conn,
            instance,
            "store_batch",
            count,
            |node, context| {
                let mut indexes = Vec::with_capacity(items.len());
                for (position, item) in items.iter().enumerate() {
                    let what = format!("`store_batch` items[{position}]");
                    indexes.push(node.checked_buffer(
                        context,
                        &what,
                        instance,
                        item.buffer,
                        item.offset,
                        item.nbytes,
                    )?);
                    node.fits_a_slot(&what, item.nbytes)?;
                }
                Ok(indexes)
            },
        );
        let (context, indexes) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        // A reserved item's `false` is a placeholder: its copy ends it (`item_done`).
        let mut results = vec![false; items.len()];
        let mut copies = Vec::new();
        let tenant = self.conns.tenant(to.conn);
        for (position, (item, index)) in items.into_iter().zip(indexes).enumerate() {
            results[position] = match self.l1.slots.reserve(&item.key, tenant) {
                Reservation::AlreadyStored => true,
                Reservation::Full => false,
                Reservation::Reserved(slot) => {
                    copies.push((position, slot, index, item.offset, item.nbytes));
                    false
                }
            };
        }
        if copies.is_empty() {
            return Some(Ok(Answer::Stored(results)));
        }
        let batch = self.open_batch(to, Answer::Stored(results), count, copies.len());
        for (item, slot, index, offset, nbytes) in copies {
            self.start_copy(
                context,
                Direction::ToL1,
                index,
                offset,
                slot,
                nbytes,
                CopyFor::BatchStore { batch, item },
            );
        }
        None
    }

    pub(super) fn retrieve_batch(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        items: Vec<RetrieveItem>,
    ) -> Immediate {
        let what = |position: usize| format!("`retrieve_batch` items[{position}]");
        let opened = self.open_transfer(
            now,
            to.conn,
            instance,
            "retrieve_batch",
            items.len(),
            |node, context| {
                let mut indexes = Vec::with_capacity(items.len());
                for (position, item) in items.iter().enumerate() {
                    indexes.push(node.checked_buffer(
                        context,
                        &what(position),
                        instance,
                        item.buffer,
                        item.offset,
                        item.nbytes,
                    )?);
                }
                Ok(indexes)
            },
        );
        let (context, indexes) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        // Every item was checked against its buffer: each pins a value of exactly its
        // length, or is a miss.
        let mut copies = Vec::new();
        let mut misses = Vec::new();
        for (position, (item, &index)) in items.iter().zip(&indexes).enumerate() {
            match self.pin_exact(&item.key, item.nbytes) {
                Some(slot) => copies.push((position, slot, index, item.offset, item.nbytes)),
                None => misses.push(position),
            }
        }
        let results = Answer::Lengths(vec![None; items.len()]); // None: a miss
        if !self.l2_enabled() {
            misses.clear();
        }
        if copies.is_empty() && misses.is_empty() {
            return Some(Ok(results));
        }
        let batch = self.open_batch(to, results, items.len(), copies.len());
        self.ask_l2_for_misses(now, to, batch, instance, context, &items, misses);
        if let Some(answered) = self.work.batches.close_if_idle(batch) {
            // Nothing copies and L2 was not asked: answer now.
            self.conns.end_job(to.conn, answered.items);
            return Some(answered.result);
        }
        for (item, slot, index, offset, nbytes) in copies {
            self.start_copy(
                context,
                Direction::FromL1,
                index,
                offset,
                slot,
                nbytes,
                CopyFor::BatchRetrieve { batch, item },
            );
        }
        None
    }

    /// Asks L2 for each L1 miss of a `retrieve_batch`; each read it starts is one more
    /// thing the batch waits for. A key L1 holds with another length is a miss, not an
    /// L2 read.
    #[allow(clippy::too_many_arguments)]
    fn ask_l2_for_misses(
        &mut self,
        now: Instant,
        to: ReplyTo,
        batch: u64,
        instance: InstanceId,
        context: ContextId,
        items: &[RetrieveItem],
        misses: Vec<usize>,
    ) {
        let tenant = self.conns.tenant(to.conn);
        // Items whose key an L2 read of this batch is fetching: the first of each key.
        let mut asked: Vec<usize> = Vec::new();
        for position in misses {
            let item = &items[position];
            if self.l1_holds(&item.key) {
                continue;
            }
            let waiter = ReadFor::BatchRetrieve {
                batch,
                item: position,
                instance,
                context,
                want: Want {
                    buffer: item.buffer,
                    offset: item.offset,
                    nbytes: item.nbytes,
                },
            };
            let first = asked.iter().copied().find(|&at| items[at].key == item.key);
            if let Some(of) = first {
                // The same key again: a second read would find the slot reserved and
                // miss; this item waits for the first item's read instead.
                self.work.batches.follow(
                    batch,
                    Follower {
                        of,
                        waiter,
                        key: item.key.clone(),
                    },
                );
            } else if self.l2_ask(now, &item.key, tenant, waiter).is_ok() {
                self.work.batches.wait_for_one_more(batch);
                asked.push(position);
            }
        }
    }

    /// Holds a batch until its `pending` copies are done; it counts as one request of
    /// `items` items. `results` is the reply so far (`Answer::Stored` or
    /// `Answer::Lengths`).
    fn open_batch(&mut self, to: ReplyTo, results: Answer, items: usize, pending: usize) -> u64 {
        let id = self.out.next_id();
        self.conns.start_job(to.conn, items);
        self.work.batches.open(id, to, results, items, pending);
        id
    }

    /// Runs `step` on the instance's transfer strategy and the slot table; an op the
    /// strategy refuses is refused by `step` returning the error.
    pub(super) fn with_strategy(
        &mut self,
        now: Instant,
        instance: InstanceId,
        op: &str,
        step: impl FnOnce(&mut TransferStrategy, &mut SlotTable) -> Result<Answer, ProtocolError>,
    ) -> Result<Answer, ProtocolError> {
        let context = self.transfer_context(now, instance, Module::EngineDriven, op)?;
        let Some(strategy) = self.work.contexts.strategy_mut(context) else {
            return Err(ProtocolError::new(
                ErrorCode::Internal,
                format!("`{op}`: instance {instance}'s engine-driven entry holds another context"),
            ));
        };
        step(strategy, &mut self.l1.slots)
    }

    pub(super) fn prepare_store(
        &mut self,
        now: Instant,
        conn: ConnId,
        instance: InstanceId,
        key: &[u8],
    ) -> Result<Answer, ProtocolError> {
        let num_slots = self.l1.slots.num_slots();
        let tenant = self.conns.tenant(conn);
        let mut reserved_slot = None;
        let value =
            self.with_strategy(
                now,
                instance,
                "prepare_store",
                |strategy, l1| match strategy.prepare_store(l1, key, tenant) {
                    PrepareStore::Reserved(grant) => {
                        reserved_slot = Some(grant.slot);
                        Ok(reserved(grant))
                    }
                    PrepareStore::AlreadyStored => Ok(Answer::Reserved(None)),
                    PrepareStore::PoolFull => Err(ProtocolError::new(
                        ErrorCode::Overloaded,
                        format!(
                            "`prepare_store`: every one of the {num_slots} L1 slots is reserved \
                         or pinned; commit what you prepared and retry later"
                        ),
                    )),
                    PrepareStore::TooManyHeld => Err(too_many_held("prepare_store", instance)),
                },
            )?;
        if let Some(slot) = reserved_slot
            && self.planted(PlantedBug::WriteUnpublished)
        {
            self.l2_write_unpublished(slot, key);
        }
        Ok(value)
    }

    pub(super) fn commit_store(
        &mut self,
        now: Instant,
        instance: InstanceId,
        key: &[u8],
        nbytes: u64,
    ) -> Result<Answer, ProtocolError> {
        let answer =
            self.with_strategy(now, instance, "commit_store", |strategy, l1| match strategy
                .commit_store(l1, key, nbytes)
            {
                CommitStore::Published => Ok(Answer::Flag(true)),
                CommitStore::NotReserved => Ok(Answer::Flag(false)),
                CommitStore::TooLarge { nbytes, slot_bytes } => Err(bad_args(format!(
                    "`commit_store`: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} \
                     bytes); commit at most one slot (the reservation is kept)"
                ))),
            })?;
        if answer == Answer::Flag(true) {
            // Published: only now may it go to L2 (row 29).
            if let Some((slot, _)) = self.l1.slots.pin(key) {
                self.l1.slots.unpin(slot);
                self.l2_write_behind(now, slot);
            }
        }
        Ok(answer)
    }

    /// `prepare_retrieve`: pins an L1 hit; a miss asks L2 (answered once it ends).
    pub(super) fn prepare_retrieve(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: &[u8],
    ) -> Immediate {
        let answer = self.prepare_retrieve_l1(now, instance, key);
        if answer != Ok(Answer::Pinned(None)) || !self.l2_enabled() || self.l1_holds(key) {
            return Some(answer);
        }
        if !self.conns.has_room(to.conn, 1) {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        let tenant = self.conns.tenant(to.conn);
        match self.l2_ask(now, key, tenant, ReadFor::PrepareRetrieve { to, instance }) {
            Ok(()) => {
                self.conns.start_job(to.conn, 1);
                None
            }
            Err(_) => Some(answer),
        }
    }

    /// The L1 part of `prepare_retrieve`.
    pub(super) fn prepare_retrieve_l1(
        &mut self,
        now: Instant,
        instance: InstanceId,
        key: &[u8],
    ) -> Result<Answer, ProtocolError> {
        self.with_strategy(
            now,
            instance,
            "prepare_retrieve",
            |strategy, l1| match strategy.prepare_retrieve(l1, key) {
                PrepareRetrieve::Pinned(grant) => Ok(pinned(grant)),
                PrepareRetrieve::Miss => Ok(Answer::Pinned(None)),
                PrepareRetrieve::TooManyHeld => Err(too_many_held("prepare_retrieve", instance)),
            },
        )
    }
}

impl Node {
    /// Whether `deadline` (a request's) has passed: then no copy into its worker's
    /// buffer starts (row 60: the worker may have reused it). Counted.
    pub(super) fn past(&mut self, deadline: Option<Instant>) -> bool {
        let past = deadline.is_some_and(|deadline| self.out.now > deadline);
        if past {
            self.counters.past_deadline();
        }
        past
    }
}
