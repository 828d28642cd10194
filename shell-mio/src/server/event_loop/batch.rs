//! `store_batch` and `retrieve_batch`: one request for many blocks.
//!
//! A batch is one transfer (one liveness refresh, one slot of the connection's
//! in-flight cap). Every item is validated before any slot is reserved or pinned, so a
//! bad item refuses the whole batch and copies nothing. Each item then copies as a pool
//! job of its own (items run in parallel across the pool's threads); each slot is
//! committed, aborted or unpinned exactly as the single op does it, and the reply goes
//! out once the last item is done.

use super::requests::{copy_result, overloaded};
use super::*;
use crate::protocol::{RetrieveItem, StoreItem};

/// A batch whose copies are still running.
pub(super) struct Batch {
    reply: ReplyTo,
    /// Per item: `true`/`false` (store) or bytes copied/nil (retrieve); items still
    /// copying hold nil until they are done.
    results: Vec<Value>,
    /// Items still copying; the batch is answered when this reaches 0.
    pending: usize,
    /// The first copy that failed, if any: the whole batch answers it.
    failed: Option<ProtocolError>,
}

/// What a batch item's pool job reports.
pub(super) struct ItemDone {
    pub(super) batch: u64,
    pub(super) item: usize,
    pub(super) slot: SlotId,
    pub(super) copied: Result<u64, ProtocolError>,
}

impl Server {
    pub(super) fn store_batch(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        items: Vec<StoreItem>,
    ) -> Option<Result<Value, ProtocolError>> {
        let context = match self.transfer_context(instance, "store_batch") {
            Ok(context) => context,
            Err(error) => return Some(Err(error)),
        };
        let slot_bytes = self.l1.slot_bytes();
        let mut indexes = Vec::with_capacity(items.len());
        for (position, item) in items.iter().enumerate() {
            let what = format!("`store_batch` items[{position}]");
            let index = match Self::checked_buffer(
                &context,
                &what,
                instance,
                item.buffer,
                item.offset,
                item.nbytes,
            ) {
                Ok(index) => index,
                Err(error) => return Some(Err(error)),
            };
            if item.nbytes > slot_bytes {
                return Some(Err(ProtocolError::new(
                    ErrorCode::BadArgs,
                    format!(
                        "{what}: nbytes {} is larger than an L1 slot ({slot_bytes} bytes, \
                         --slot-bytes); store chunks of at most one slot",
                        item.nbytes
                    ),
                )));
            }
            indexes.push(index);
        }
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        let mut results = vec![Value::Nil; items.len()];
        let mut copies = Vec::new();
        for (position, (item, index)) in items.into_iter().zip(indexes).enumerate() {
            results[position] = match self.l1.reserve(&item.key) {
                Reservation::AlreadyStored => true.into(),
                Reservation::Full => false.into(),
                Reservation::Reserved(slot) => {
                    copies.push((position, slot, index, item));
                    Value::Nil
                }
            };
        }
        if copies.is_empty() {
            return Some(Ok(Value::Array(results)));
        }
        let batch = self.open_batch(reply, results, copies.len());
        for (item, slot, index, StoreItem { offset, nbytes, .. }) in copies {
            let context = Arc::clone(&context);
            let pool = Arc::clone(self.l1.mapping());
            let slot_offset = self.l1.offset(slot);
            self.pool.submit(move || {
                let copied = context.server_driven().is_some_and(|c| {
                    c.buffers[index].copy_to_l1(offset, &pool, slot_offset, nbytes)
                });
                drop(context); // the mapping may go now, if the context was freed meanwhile
                Done::BatchStored(ItemDone {
                    batch,
                    item,
                    slot,
                    copied: copy_result(copied, nbytes),
                })
            });
        }
        None
    }

    pub(super) fn retrieve_batch(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        items: Vec<RetrieveItem>,
    ) -> Option<Result<Value, ProtocolError>> {
        let context = match self.transfer_context(instance, "retrieve_batch") {
            Ok(context) => context,
            Err(error) => return Some(Err(error)),
        };
        let what = |position: usize| format!("`retrieve_batch` items[{position}]");
        for (position, item) in items.iter().enumerate() {
            if let Err(error) = Self::checked_buffer(
                &context,
                &what(position),
                instance,
                item.buffer,
                item.offset,
                0,
            ) {
                return Some(Err(error));
            }
        }
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        let pins: Vec<Option<(SlotId, u64)>> =
            items.iter().map(|item| self.l1.pin(&item.key)).collect();
        // The value's length is known only once pinned: a value that does not fit where
        // its item asks refuses the whole batch, before any copy starts.
        let mut copies = Vec::new();
        for (position, (item, pin)) in items.iter().zip(&pins).enumerate() {
            let Some((slot, nbytes)) = *pin else {
                continue;
            };
            match Self::checked_buffer(
                &context,
                &what(position),
                instance,
                item.buffer,
                item.offset,
                nbytes,
            ) {
                Ok(index) => copies.push((position, slot, index, item.offset, nbytes)),
                Err(error) => {
                    for (slot, _) in pins.iter().flatten() {
                        self.l1.unpin(*slot);
                    }
                    return Some(Err(error));
                }
            }
        }
        let results = vec![Value::Nil; items.len()]; // nil: a miss
        if copies.is_empty() {
            return Some(Ok(Value::Array(results)));
        }
        let batch = self.open_batch(reply, results, copies.len());
        for (item, slot, index, offset, nbytes) in copies {
            let context = Arc::clone(&context);
            let pool = Arc::clone(self.l1.mapping());
            let slot_offset = self.l1.offset(slot);
            self.pool.submit(move || {
                let copied = context.server_driven().is_some_and(|c| {
                    c.buffers[index].copy_from_l1(&pool, slot_offset, offset, nbytes)
                });
                drop(context);
                Done::BatchRetrieved(ItemDone {
                    batch,
                    item,
                    slot,
                    copied: copy_result(copied, nbytes),
                })
            });
        }
        None
    }

    /// Holds a batch until its `pending` copies are done; it counts as one job.
    fn open_batch(&mut self, reply: ReplyTo, results: Vec<Value>, pending: usize) -> u64 {
        assert!(
            pending > 0,
            "a batch with nothing to copy is answered at once"
        );
        let id = self.next_batch_id;
        self.next_batch_id += 1;
        self.start_job(reply.token);
        let previous = self.batches.insert(
            id,
            Batch {
                reply,
                results,
                pending,
                failed: None,
            },
        );
        assert!(previous.is_none(), "batch ids are never reused");
        id
    }

    /// A store item's copy finished: publish or drop its slot, as `store` does.
    pub(super) fn on_batch_stored(&mut self, done: ItemDone) {
        let result = match done.copied {
            Ok(nbytes) => {
                self.l1.commit(done.slot, nbytes);
                Ok(true.into())
            }
            Err(error) => {
                self.l1.abort(done.slot);
                Err(error)
            }
        };
        self.item_done(done.batch, done.item, result);
    }

    /// A retrieve item's copy finished: unpin its slot, as `retrieve` does.
    pub(super) fn on_batch_retrieved(&mut self, done: ItemDone) {
        self.l1.unpin(done.slot);
        self.item_done(done.batch, done.item, done.copied.map(Value::from));
    }

    fn item_done(&mut self, id: u64, item: usize, result: Result<Value, ProtocolError>) {
        let Some(batch) = self.batches.get_mut(&id) else {
            debug_assert!(false, "batch {id} finished an item after it was answered");
            return;
        };
        match result {
            Ok(value) => batch.results[item] = value,
            Err(error) => {
                batch.failed.get_or_insert(error);
            }
        }
        assert!(batch.pending > 0, "a batch item finishes once");
        batch.pending -= 1;
        if batch.pending > 0 {
            return;
        }
        let Some(Batch {
            reply,
            results,
            failed,
            ..
        }) = self.batches.remove(&id)
        else {
            return;
        };
        self.end_job(reply.token);
        let answer = match failed {
            Some(error) => Err(error),
            None => Ok(Value::Array(results)),
        };
        self.reply(reply.token, reply.request_id, reply.op, answer);
    }
}
