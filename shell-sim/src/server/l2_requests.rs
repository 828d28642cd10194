//! The simulated server's L2: the node's L2 requests handed to the simulated tier,
//! their completions handed back, and the L2 replies checked.

use super::{Call, Server, ServerOut};
use crate::invariants::Checker;
use crate::l2::{L2Fate, L2Job};
use kvwarden_core::node::L2Request;
use kvwarden_core::node::l2::{L2Fetched, L2Presence};
use kvwarden_core::node::{Input as NodeInput, Output};
use kvwarden_core::protocol::Answer;

impl Server {
    pub(super) fn on_l2(
        &mut self,
        request: L2Request,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        if !self.spec.l2.enabled {
            checker.fail(
                crate::violation::Class::Internal,
                "l2_without_l2",
                format!("the node, configured without L2, asked for L2: {request:?}"),
            );
            return;
        }
        match request {
            L2Request::Write {
                write, key, nbytes, ..
            } => {
                let good = checker.l2_write(&key);
                self.l2_holding += 1;
                out.l2_jobs.push(L2Job::Write {
                    write,
                    key,
                    nbytes,
                    good,
                });
            }
            L2Request::Get {
                read,
                key,
                deliver,
                slot,
            } => {
                if self.pool.is_some() {
                    self.l2_slots.insert(read.0, slot);
                }
                // A delivering read may write into the worker's buffer until
                // answered: a copy on its context, as far as a free is concerned.
                if let Some(deliver) = deliver
                    && let Some(&id) = self.ledger.get(&deliver.context)
                {
                    self.l2_delivering.insert(read.0, id);
                    checker.copy_started(id);
                }
                if let Call::Request {
                    conn,
                    request_id,
                    reads: true,
                    ..
                } = call
                {
                    self.l2_reads.insert(read.0, (conn.0, *request_id));
                }
                self.l2_holding += 1;
                out.l2_jobs.push(L2Job::Get { read, key });
            }
            L2Request::Exists { read, keys } => {
                self.l2_checks.insert(read.0);
                out.l2_jobs.push(L2Job::Exists { read, keys });
            }
            L2Request::Cancel { read } => {
                // Redis has not answered (its answer is still on the agenda): the
                // client's cancel wins and answers `TimedOut` at once.
                if self.l2_cancelled.insert(read.0) {
                    let check = self.l2_checks.contains(&read.0);
                    out.l2_jobs.push(L2Job::Cancelled { read, check });
                }
            }
        }
    }

    /// An L2 operation ends: carried out against the store, its answer for the node.
    pub(super) fn l2_done(
        &mut self,
        job: L2Job,
        fate: L2Fate,
        checker: &mut Checker,
    ) -> Option<NodeInput> {
        if let L2Job::Get { read, .. } | L2Job::Exists { read, .. } = &job
            && self.l2_cancelled.remove(&read.0)
        {
            self.l2_checks.remove(&read.0);
            return None; // answered when it was given up
        }
        if !matches!(
            job,
            L2Job::Exists { .. } | L2Job::Cancelled { check: true, .. }
        ) {
            self.l2_holding -= 1;
        }
        Some(match job {
            L2Job::Write {
                write,
                key,
                nbytes,
                good,
            } => {
                let outcome = self.l2.write(fate, key, nbytes, good);
                match outcome {
                    kvwarden_core::l2::WriteOutcome::Written => self.stats.l2_written += 1,
                    _ => self.stats.l2_failed += 1,
                }
                NodeInput::L2Written { write, outcome }
            }
            L2Job::Cancelled { read, check: true } => {
                self.stats.l2_failed += 1;
                NodeInput::L2Existed {
                    read,
                    presence: L2Presence::TimedOut,
                }
            }
            L2Job::Cancelled { read, .. } => {
                self.l2_reads.remove(&read.0);
                if let Some(id) = self.l2_delivering.remove(&read.0) {
                    checker.copy_done(id);
                }
                self.stats.l2_failed += 1;
                NodeInput::L2Got {
                    read,
                    fetched: L2Fetched::TimedOut,
                }
            }
            L2Job::Get { read, key } => self.l2_got(read, key, fate, checker),
            L2Job::Exists { read, keys } => {
                self.l2_checks.remove(&read.0);
                let presence = self.l2.exists(fate, &keys);
                if !matches!(presence, L2Presence::Present(_)) {
                    self.stats.l2_failed += 1;
                }
                NodeInput::L2Existed { read, presence }
            }
        })
    }

    /// An L2 read answered: into its slot (and the worker's buffer, when it delivers),
    /// counted by what it found.
    fn l2_got(
        &mut self,
        read: kvwarden_core::node::l2::L2ReadId,
        key: Vec<u8>,
        fate: L2Fate,
        checker: &mut Checker,
    ) -> NodeInput {
        let mut fetched = self.l2.get(fate, &key);
        if let Some(slot) = self.l2_slots.remove(&read.0)
            && let Some(pool) = self.pool.as_mut()
            && !matches!(
                fetched,
                L2Fetched::Absent | L2Fetched::TimedOut | L2Fetched::Failed
            )
        {
            // The payload was placed in the slot, good or not.
            pool.write_started(slot, self.boot);
            pool.write_done(slot, None);
        }
        let asker = self.l2_reads.remove(&read.0);
        if let Some(id) = self.l2_delivering.remove(&read.0) {
            checker.copy_done(id);
            if let L2Fetched::Hit { nbytes } = fetched {
                // The simulated buffers are as large as any chunk.
                fetched = L2Fetched::Delivered { nbytes };
            }
        }
        match fetched {
            L2Fetched::Hit { .. } | L2Fetched::Delivered { .. } => self.stats.l2_hits += 1,
            L2Fetched::Corrupt => {
                self.stats.l2_corrupt += 1;
                if let Some(asker) = asker {
                    checker.l2_corrupt_read(asker, key);
                }
            }
            L2Fetched::Absent => {}
            L2Fetched::TimedOut | L2Fetched::Failed => self.stats.l2_failed += 1,
        }
        NodeInput::L2Got { read, fetched }
    }

    /// What the node's replies say about L2: a read L2 found corrupt must not be answered
    /// with data.
    pub(super) fn l2_replies(&mut self, outputs: &[Output], checker: &mut Checker) {
        for output in outputs {
            let Output::Reply {
                conn,
                request_id,
                result,
                ..
            } = output
            else {
                continue;
            };
            let miss = matches!(
                result,
                Ok(Answer::Length(None) | Answer::Pinned(None) | Answer::Reserved(None))
            );
            let data = result.is_ok() && !miss;
            checker.answered((conn.0, *request_id), data);
        }
    }
}
