//! Batches: a `store_batch` or `retrieve_batch` held open until each of its items has
//! ended, then answered once.
//!
//! The rules it owns: a batch counts as one request of `items` items while it is open;
//! each item ends once (its copy, its L2 read, or a follower's turn); the first error
//! fails the whole batch; the last item to end answers it. Items naming a key an
//! earlier item's L2 read is fetching follow that read ([`Batches::follow`]).

use super::contexts::CopyFor;
use super::io::ConnId;
use super::l2;
use super::{HashMap, ReplyTo};
use crate::protocol::{Answer, ProtocolError};
use crate::time::Instant;

/// A `retrieve_batch` item waiting for item `of`'s L2 read of the same key.
pub(super) struct Follower {
    pub(super) of: usize,
    pub(super) waiter: l2::ReadFor,
    pub(super) key: Vec<u8>,
}

struct Batch {
    reply: ReplyTo,
    /// Its items: what it counts in its connection's in-flight limit.
    items: usize,
    /// The reply so far: `Answer::Stored` or `Answer::Lengths`, one answer per item.
    results: Answer,
    pending: usize,
    failed: Option<ProtocolError>,
    /// Items of a `retrieve_batch` naming a key an earlier item's L2 read is fetching:
    /// each is served as that read ends (from L1 after a hit, a miss otherwise), as
    /// the same key twice in L1 is (each counted in `pending`).
    followers: Vec<Follower>,
}

impl Batch {
    /// Item `item` ended: `moved` bytes copied (a store: stored), or None (a miss).
    fn set(&mut self, item: usize, moved: Option<u64>) {
        match &mut self.results {
            Answer::Stored(stored) => {
                if let Some(answer) = stored.get_mut(item) {
                    *answer = moved.is_some();
                }
            }
            Answer::Lengths(lengths) => {
                if let Some(answer) = lengths.get_mut(item) {
                    *answer = moved;
                }
            }
            _ => {}
        }
    }
}

/// A batch answered: where, how many items it counted, and its reply.
pub(super) struct Answered {
    pub(super) reply: ReplyTo,
    pub(super) items: usize,
    pub(super) result: Result<Answer, ProtocolError>,
}

/// The open batches, by id.
#[derive(Default)]
pub(super) struct Batches {
    open: HashMap<u64, Batch>,
}

impl Batches {
    /// Holds batch `id` until its `pending` items have ended; `results` is the reply so
    /// far (`Answer::Stored` or `Answer::Lengths`).
    pub(super) fn open(
        &mut self,
        id: u64,
        reply: ReplyTo,
        results: Answer,
        items: usize,
        pending: usize,
    ) {
        self.open.insert(
            id,
            Batch {
                reply,
                items,
                results,
                pending,
                failed: None,
                followers: Vec::new(),
            },
        );
    }

    /// One more item of batch `id` to wait for (an L2 read it started).
    pub(super) fn wait_for_one_more(&mut self, id: u64) {
        if let Some(batch) = self.open.get_mut(&id) {
            batch.pending += 1;
        }
    }

    /// Item `follower.waiter` of batch `id` waits for item `follower.of`'s L2 read.
    pub(super) fn follow(&mut self, id: u64, follower: Follower) {
        if let Some(batch) = self.open.get_mut(&id) {
            batch.followers.push(follower);
            batch.pending += 1;
        }
    }

    /// Closes batch `id` at once if nothing of it is pending: its answer.
    pub(super) fn close_if_idle(&mut self, id: u64) -> Option<Answered> {
        if self.open.get(&id).is_some_and(|batch| batch.pending == 0) {
            return self.open.remove(&id).map(Batch::answered);
        }
        None
    }

    /// The items waiting for item `item`'s L2 read: theirs to serve now.
    pub(super) fn take_followers(&mut self, id: u64, item: usize) -> Vec<Follower> {
        let Some(batch) = self.open.get_mut(&id) else {
            return Vec::new();
        };
        let (followers, rest) = std::mem::take(&mut batch.followers)
            .into_iter()
            .partition::<Vec<_>, _>(|follower| follower.of == item);
        batch.followers = rest;
        followers
    }

    /// Item `item` of batch `id` ended: bytes moved, None for a miss, or the error that
    /// fails the whole batch. The last one closes it: its answer.
    pub(super) fn item_ended(
        &mut self,
        id: u64,
        item: usize,
        result: Result<Option<u64>, ProtocolError>,
    ) -> Option<Answered> {
        let batch = self.open.get_mut(&id)?;
        match result {
            Ok(moved) => batch.set(item, moved),
            Err(error) => {
                batch.failed.get_or_insert(error);
            }
        }
        batch.pending = batch.pending.saturating_sub(1);
        if batch.pending > 0 {
            return None;
        }
        self.open.remove(&id).map(Batch::answered)
    }

    /// The connection a copy for `purpose` answers: its tenant's turn at the pool is
    /// the copy's.
    pub(super) fn conn_of(&self, purpose: &CopyFor) -> ConnId {
        match purpose {
            CopyFor::Retrieve(to) | CopyFor::Store(to) => to.conn,
            CopyFor::BatchRetrieve { batch, .. } | CopyFor::BatchStore { batch, .. } => self
                .open
                .get(batch)
                .map_or(ConnId(u64::MAX), |batch| batch.reply.conn),
        }
    }

    /// The deadline of batch `id`'s worker ([`ReplyTo::deadline`]).
    pub(super) fn deadline(&self, id: u64) -> Option<Instant> {
        self.open.get(&id).and_then(|batch| batch.reply.deadline)
    }

    /// The deadline of a copy for `purpose`: its request's ([`ReplyTo::deadline`]) when
    /// it copies into a worker's buffer, else None.
    pub(super) fn deadline_of(&self, purpose: &CopyFor) -> Option<Instant> {
        match purpose {
            CopyFor::Retrieve(to) => to.deadline,
            CopyFor::BatchRetrieve { batch, .. } => self.deadline(*batch),
            CopyFor::Store(_) | CopyFor::BatchStore { .. } => None,
        }
    }
}

impl Batch {
    fn answered(self) -> Answered {
        Answered {
            reply: self.reply,
            items: self.items,
            result: match self.failed {
                Some(error) => Err(error),
                None => Ok(self.results),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ErrorCode, OpKind};

    fn to() -> ReplyTo {
        ReplyTo {
            conn: ConnId(4),
            request_id: 9,
            op: OpKind::RetrieveBatch,
            deadline: None,
        }
    }

    #[test]
    fn the_last_item_answers_with_every_items_result() {
        let mut batches = Batches::default();
        batches.open(1, to(), Answer::Lengths(vec![None; 3]), 3, 2);
        assert!(batches.close_if_idle(1).is_none(), "two items pending");
        assert!(batches.item_ended(1, 0, Ok(Some(8))).is_none());
        let answered = batches.item_ended(1, 2, Ok(None)).expect("the last item");
        assert_eq!(answered.items, 3);
        assert_eq!(answered.reply, to());
        match answered.result {
            Ok(Answer::Lengths(lengths)) => assert_eq!(lengths, vec![Some(8), None, None]),
            other => panic!("{other:?}"),
        }
        assert!(
            batches.item_ended(1, 1, Ok(Some(8))).is_none(),
            "answered once"
        );
    }

    #[test]
    fn the_first_error_fails_the_batch_and_a_follower_is_waited_for() {
        let mut batches = Batches::default();
        batches.open(2, to(), Answer::Stored(vec![false; 2]), 2, 1);
        batches.wait_for_one_more(2);
        assert!(batches.item_ended(2, 0, Ok(Some(8))).is_none());
        let error = ProtocolError::new(ErrorCode::Internal, "copy failed");
        let answered = batches.item_ended(2, 1, Err(error)).expect("the last item");
        assert!(answered.result.is_err());
        // Control: with nothing pending, a batch closes at once.
        batches.open(3, to(), Answer::Stored(vec![true]), 1, 0);
        assert!(batches.close_if_idle(3).is_some());
    }
}
