//! An L2 thread's writes: a batch of `SET`s pipelined per node over the data path, a
//! value's header and payload sent from where they lie; a write whose pipeline broke,
//! or that was redirected, goes through redis-rs.

use super::{Session, by_node, is_timeout};
use crate::l2::direct::{self, Direct, SetReply};
use crate::l2::{Shared, WriteTask};
use kvwarden_core::l2::WriteOutcome;
use std::io::{self, IoSlice};

impl Shared {
    /// Every `SET` of `writes` pipelined to its node, each value's header and payload
    /// sent straight from where they are (the payload: the caller's bytes, often an L1
    /// slot), the replies received in order.
    pub(super) fn serve_writes(
        &self,
        session: &mut Option<Session>,
        writes: Vec<(WriteTask, u64)>,
    ) {
        let Some(live) = self.session(session) else {
            for (task, bytes) in writes {
                self.write_ended(task, bytes, WriteOutcome::Failed);
            }
            return;
        };
        let prepared = self.prepare(writes);
        let (groups, mut redirected) = by_node(&live.direct, prepared, |prepared| &prepared.name);
        // Writes whose pipeline broke (a timeout, a connection error): retried once
        // through redis-rs, as long as retries succeed.
        let mut retry = Vec::new();
        let mut failed: Option<io::Error> = None;
        let mut sent = Vec::new();
        // Reported in the order they were queued once all ended, as if written one by
        // one: the breaker judges failures in a row, and a node's group failing
        // together is not five failures of L2.
        let mut ended: Vec<(Prepared, WriteOutcome)> = Vec::new();
        for (node, group) in groups {
            match send(&mut live.direct, node, &group) {
                Ok(()) => sent.push((node, group)),
                Err(error) => {
                    retry.extend(group);
                    live.direct.broken(node);
                    failed = Some(error);
                }
            }
        }
        for (node, group) in sent {
            let mut replies = group.into_iter();
            while let Some(prepared) = replies.next() {
                match live.direct.conn(node).and_then(|conn| conn.set_reply()) {
                    Ok(SetReply::Stored) => ended.push((prepared, WriteOutcome::Written)),
                    Ok(SetReply::Error(message)) if direct::is_redirect(&message) => {
                        redirected.push(prepared);
                    }
                    Ok(SetReply::Error(message)) => {
                        tracing::debug!(%message, "L2 write refused");
                        ended.push((prepared, WriteOutcome::Failed));
                    }
                    Err(error) => {
                        retry.push(prepared);
                        retry.extend(replies.by_ref());
                        live.direct.broken(node);
                        failed = Some(error);
                    }
                }
            }
        }
        let broken = failed.map(|error| {
            tracing::debug!(%error, "L2 write failed; retrying through redis-rs");
            write_failure(is_timeout(&error))
        });
        if let Some(live) = session.as_mut()
            && !redirected.is_empty()
        {
            live.direct.mark_stale();
        }
        for prepared in redirected {
            let outcome = self.set_through_redis(session, &prepared);
            ended.push((prepared, outcome));
        }
        let mut outcome = WriteOutcome::Written;
        for prepared in retry {
            if outcome == WriteOutcome::Written {
                outcome = self.set_through_redis(session, &prepared);
            } else {
                outcome = broken.unwrap_or(outcome); // a retry failed: no more of them
            }
            ended.push((prepared, outcome));
        }
        ended.sort_by_key(|(prepared, _)| prepared.order);
        for (prepared, outcome) in ended {
            self.write_ended(prepared.task, prepared.bytes, outcome);
        }
    }

    /// Each write with its Redis key, value header and the pipeline's bytes around them,
    /// numbered in the order it was queued.
    fn prepare(&self, writes: Vec<(WriteTask, u64)>) -> impl Iterator<Item = Prepared> + '_ {
        let ttl = self.config.ttl.map(|ttl| {
            u64::try_from(ttl.as_millis())
                .unwrap_or(u64::MAX)
                .max(1)
                .to_string()
        });
        writes
            .into_iter()
            .enumerate()
            .map(move |(order, (task, bytes))| {
                let name = self.config.namespace.redis_key(&task.key);
                let header = self.config.format.header(
                    &self.config.namespace,
                    &task.key,
                    (*task.payload).as_ref(),
                );
                Prepared::new(order, task, bytes, name, header, ttl.as_deref())
            })
    }

    fn set_through_redis(
        &self,
        session: &mut Option<Session>,
        prepared: &Prepared,
    ) -> WriteOutcome {
        let Some(live) = self.session(session) else {
            return WriteOutcome::Failed;
        };
        let result = live.conn.set(
            &prepared.name,
            prepared.header.as_ref(),
            (*prepared.task.payload).as_ref(),
            self.config.ttl,
        );
        match result {
            Ok(()) => WriteOutcome::Written,
            Err(error) => {
                *session = None;
                tracing::debug!(%error, "L2 write failed");
                write_failure(error.is_timeout())
            }
        }
    }

    /// A write ended: its bytes leave the queue's bound and the caller is told.
    fn write_ended(&self, task: WriteTask, bytes: u64, outcome: WriteOutcome) {
        let WriteTask {
            token,
            key,
            payload,
        } = task;
        // The caller's bytes (perhaps an L1 slot kept from eviction) are free from here.
        drop(payload);
        {
            // Counted under the work lock, so that `finish_writes` counts each write
            // once: ended (here) or dropped (there).
            let mut work = self.lock_work();
            work.writes.complete(bytes);
            work.writes_in_flight = work.writes_in_flight.saturating_sub(1);
            self.lock_counters().record_write(outcome);
        }
        self.write_ended.notify_all();
        self.complete(crate::l2::L2Completion::Written {
            token,
            key,
            outcome,
        });
    }
}

/// A write with its command around the value: `start` (the array, the name, the value's
/// length), then the header and the payload, then `end` (CRLF and `PX ms`).
struct Prepared {
    /// Its place in the batch (the queue's order).
    order: usize,
    task: WriteTask,
    bytes: u64,
    name: Vec<u8>,
    header: kvwarden_core::l2::Header,
    start: Vec<u8>,
    end: Vec<u8>,
}

impl Prepared {
    fn new(
        order: usize,
        task: WriteTask,
        bytes: u64,
        name: Vec<u8>,
        header: kvwarden_core::l2::Header,
        ttl_ms: Option<&str>,
    ) -> Prepared {
        let value_bytes = header.as_ref().len() + (*task.payload).as_ref().len();
        let mut start = Vec::with_capacity(64 + name.len());
        direct::encode_start(
            &mut start,
            if ttl_ms.is_some() { 5 } else { 3 },
            &[b"SET", &name],
        );
        direct::encode_bulk_start(&mut start, value_bytes);
        let mut end = b"\r\n".to_vec();
        if let Some(ms) = ttl_ms {
            direct::encode_args(&mut end, &[b"PX", ms.as_bytes()]);
        }
        Prepared {
            order,
            task,
            bytes,
            name,
            header,
            start,
            end,
        }
    }
}

/// How a write that failed ended: timed out, or failed.
fn write_failure(timed_out: bool) -> WriteOutcome {
    if timed_out {
        WriteOutcome::TimedOut
    } else {
        WriteOutcome::Failed
    }
}

/// Sends a node's group of `SET`s as one pipeline: each value's header and payload
/// from where they lie, between the command's bytes.
fn send(direct: &mut Direct, node: usize, group: &[Prepared]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(group.len() * 4);
    for prepared in group {
        slices.push(IoSlice::new(&prepared.start));
        slices.push(IoSlice::new(prepared.header.as_ref()));
        slices.push(IoSlice::new((*prepared.task.payload).as_ref()));
        slices.push(IoSlice::new(&prepared.end));
    }
    direct.conn(node).and_then(|conn| conn.send(&mut slices))
}
