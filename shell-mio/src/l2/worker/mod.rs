//! An L2 thread: takes reads (first: a caller waits for them) or writes from the queue
//! in batches, sends each batch's commands to a node as one pipeline over the data
//! path ([`super::direct`]), and answers each as its reply arrives. A hit's payload is
//! received straight into its [`Landing`] (or an owned buffer), checked there, and only
//! then passed on; a value that fails a check is a counted miss, logged once per key and
//! deleted.
//!
//! After an error on a node's connection the thread drops that connection and reads
//! the slot map anew (from the seeds) before its next batch, which is how it learns of
//! a failover; a write whose pipeline broke, and any redirected command (`MOVED`,
//! `ASK`), is retried through redis-rs, which follows redirections and refreshes its
//! own map. An error of redis-rs's connection drops the whole session, as before.

use super::connection::{self, RedisConn};
use super::direct::{self, Direct, GetReply, NodeConn};
use super::{Landing, PendingRead, PrefixOutcome, ReadRequest, Shared, WriteTask, describe_error};
use kvwarden_core::l2::{MAC_HEADER_BYTES, ReadOutcome};
use std::io::{self, IoSlice};
use std::sync::Arc;
use std::sync::atomic::Ordering;

mod writes;

/// Reads one thread takes at once: pipelined per node, so at most this many replies
/// are in flight on a thread's connections.
pub(super) const READ_BATCH_MAX: usize = 64;

/// The most bytes the replies to one thread's batch of reads may hold (each counted as
/// the largest value): a batch is received in order, so its last reads wait for every
/// reply before them (each read's deadline starts when its turn comes, but the worker
/// waits all along); the rest of the queue goes to the other threads. A thread takes at most its share of the reads
/// waiting, so that reads arriving one by one are served by threads in parallel.
const READ_BATCH_BYTES: u64 = 16 << 20;

/// Writes one thread takes at once, and the most bytes they may hold together (at least
/// one write is taken, however large): a pipeline's last reply waits for every value
/// before it to be sent and stored.
pub(super) const WRITE_BATCH_MAX: usize = 64;
const WRITE_BATCH_BYTES: u64 = 2 << 20;

/// A thread's connections: redis-rs's (topology, existence checks, deletes,
/// redirections) and the data path's.
struct Session {
    conn: RedisConn,
    direct: Direct,
}

/// What a thread takes next.
enum Job {
    Reads(Vec<Arc<PendingRead>>),
    Writes(Vec<(WriteTask, u64)>),
}

/// How one reply of a pipeline ended for the connection.
enum Next {
    /// The connection is ready for the next reply.
    Ready,
    /// Redirected: retry through redis-rs.
    Redirected,
}

/// A read's payload destination.
enum Room {
    Landing(Box<dyn Landing>),
    Owned,
}

impl Shared {
    /// The thread's loop, until shutdown.
    pub(super) fn serve(&self) {
        let mut session: Option<Session> = None;
        while let Some(job) = self.next_job() {
            match job {
                Job::Reads(reads) => self.serve_reads(&mut session, reads),
                Job::Writes(writes) => self.serve_writes(&mut session, writes),
            }
        }
    }

    fn next_job(&self) -> Option<Job> {
        let mut work = self.lock_work();
        loop {
            if work.shutdown {
                return None;
            }
            if !work.reads.is_empty() {
                // A fair share of what waits (every thread serves reads in parallel),
                // at most a batch.
                let share = work.reads.len().div_ceil(self.config.threads.max(1));
                let take = share.clamp(1, self.read_batch());
                return Some(Job::Reads(work.reads.drain(..take).collect()));
            }
            let mut writes = Vec::new();
            let mut bytes = 0u64;
            while writes.len() < WRITE_BATCH_MAX && (writes.is_empty() || bytes < WRITE_BATCH_BYTES)
            {
                let Some((task, size)) = work.writes.pop() else {
                    break;
                };
                bytes = bytes.saturating_add(size);
                work.writes_in_flight += 1;
                writes.push((task, size));
            }
            if !writes.is_empty() {
                return Some(Job::Writes(writes));
            }
            work = self
                .work_ready
                .wait(work)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// How many reads a thread takes at once.
    fn read_batch(&self) -> usize {
        let each = self.config.format.read_limit_bytes().max(1);
        usize::try_from(READ_BATCH_BYTES / each)
            .unwrap_or(usize::MAX)
            .clamp(1, READ_BATCH_MAX)
    }

    /// The thread's session, made when missing (and its map read anew when stale).
    fn session<'a>(&self, session: &'a mut Option<Session>) -> Option<&'a mut Session> {
        if let Some(live) = session.as_mut()
            && live.direct.stale()
            && let Err(error) = live.conn.refresh(&mut live.direct, &self.config)
        {
            // Stays stale: everything goes through redis-rs until a map is read (during a
            // failover, say, when the node asked may not answer).
            tracing::debug!(%error, "reading the L2 slot map failed");
        }
        if session.is_none() {
            let (conn, direct) = match RedisConn::connect(&self.config, self.config.timeout) {
                Ok(mut conn) => {
                    let direct = conn
                        .direct(&self.link, &self.config)
                        .unwrap_or_else(|error| {
                            tracing::debug!(%error, "reading the L2 slot map failed");
                            Direct::unmapped(Arc::clone(&self.link))
                        });
                    (conn, direct)
                }
                Err(error) => {
                    *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(describe_error(&error));
                    tracing::debug!(%error, "L2 connection failed");
                    return None;
                }
            };
            *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
            let mut mode = self.mode.lock().unwrap_or_else(|e| e.into_inner());
            if mode.is_none() {
                tracing::info!(mode = ?conn.mode(), seeds = ?self.config.seeds, "L2 connected");
            }
            *mode = Some(conn.mode());
            *session = Some(Session { conn, direct });
        }
        session.as_mut()
    }

    // ---------------------------------------------------------------- reads

    fn serve_reads(&self, session: &mut Option<Session>, reads: Vec<Arc<PendingRead>>) {
        // Given up while waiting for a thread: Redis is not asked at all.
        let reads: Vec<_> = reads
            .into_iter()
            .filter(|pending| !pending.answered.load(Ordering::Acquire))
            .collect();
        if session.is_none() {
            // Connecting waits for L2 on behalf of every read taken: their deadlines
            // start now (a store that accepts and never answers times them all out).
            for pending in &reads {
                self.start_read(pending);
            }
        }
        let (gets, checks): (Vec<_>, Vec<_>) = reads
            .into_iter()
            .partition(|pending| matches!(pending.request, ReadRequest::Get(_)));
        if !gets.is_empty() {
            self.serve_gets(session, gets);
        }
        for pending in checks {
            self.start_read(&pending);
            self.serve_exists(session, &pending);
        }
    }

    fn serve_exists(&self, session: &mut Option<Session>, pending: &PendingRead) {
        let ReadRequest::Exists(keys) = &pending.request else {
            return;
        };
        if keys.is_empty() {
            if self.claim(pending) {
                self.report_prefix(pending, PrefixOutcome::Present(0));
            }
            return;
        }
        let names: Vec<Vec<u8>> = keys
            .iter()
            .map(|key| self.config.namespace.redis_key(key))
            .collect();
        let Some(live) = self.session(session) else {
            self.settle(pending, ReadOutcome::Failed);
            return;
        };
        let outcome = match live.conn.exists_each(&names) {
            Ok(present) => {
                PrefixOutcome::Present(present.iter().take_while(|present| **present).count())
            }
            Err(error) => {
                *session = None;
                tracing::debug!(%error, "L2 existence check failed");
                if error.is_timeout() {
                    PrefixOutcome::TimedOut
                } else {
                    PrefixOutcome::Failed
                }
            }
        };
        if self.claim(pending) {
            self.report_prefix(pending, outcome);
        }
    }

    /// Every `GETRANGE` of `gets` pipelined to its node, the replies received in order.
    fn serve_gets(&self, session: &mut Option<Session>, gets: Vec<Arc<PendingRead>>) {
        let Some(live) = self.session(session) else {
            for pending in &gets {
                self.settle(pending, ReadOutcome::Failed);
            }
            return;
        };
        let limit = self.config.format.read_limit_bytes().to_string();
        let named = gets.into_iter().filter_map(|pending| {
            let ReadRequest::Get(key) = &pending.request else {
                return None;
            };
            let name = self.config.namespace.redis_key(key);
            Some((pending, name))
        });
        let (groups, mut redirected) = by_node(&live.direct, named, |(_, name)| name);
        let mut failed: Option<io::Error> = None;
        let mut sent = Vec::new();
        for (node, group) in groups {
            let mut command = Vec::new();
            for (_, name) in &group {
                direct::encode(&mut command, &[b"GETRANGE", name, b"0", limit.as_bytes()]);
            }
            let result = live
                .direct
                .conn(node)
                .and_then(|conn| conn.send(&mut [IoSlice::new(&command)]));
            match result {
                Ok(()) => sent.push((node, group)),
                Err(error) => {
                    self.fail_reads(group.iter().map(|(pending, _)| &**pending), &error);
                    live.direct.broken(node);
                    failed = Some(error);
                }
            }
        }
        let mut corrupt = Vec::new();
        for (node, group) in sent {
            let mut replies = group.into_iter();
            while let Some((pending, name)) = replies.next() {
                self.start_read(&pending);
                let received = live
                    .direct
                    .conn(node)
                    .and_then(|conn| self.receive_get(conn, &pending, &name, &mut corrupt));
                match received {
                    Ok(Next::Ready) => {}
                    Ok(Next::Redirected) => redirected.push((pending, name)),
                    Err(error) => {
                        let rest: Vec<_> = replies.by_ref().collect();
                        self.fail_reads(
                            std::iter::once(&*pending).chain(rest.iter().map(|(p, _)| &**p)),
                            &error,
                        );
                        live.direct.broken(node);
                        failed = Some(error);
                    }
                }
            }
        }
        if let Some(error) = failed {
            // That node's connection is gone and the map is read anew before the next
            // batch (a failover moves slots); redis-rs's connection is kept.
            tracing::debug!(%error, "L2 read failed");
        }
        if !redirected.is_empty() {
            if let Some(live) = session.as_mut() {
                live.direct.mark_stale();
            }
            for (pending, name) in redirected {
                self.start_read(&pending);
                self.get_through_redis(session, &pending, &name, &mut corrupt);
            }
        }
        for (key, name, why) in corrupt {
            self.discard_corrupt(session, &key, &name, &why);
        }
    }

    /// Answers `Failed` (or `TimedOut`, for a timeout) every read not answered yet.
    fn fail_reads<'a>(&self, reads: impl Iterator<Item = &'a PendingRead>, error: &io::Error) {
        let outcome = read_failure(is_timeout(error));
        for pending in reads {
            self.settle(pending, outcome);
        }
    }

    /// Receives one `GETRANGE` reply for `pending`; an `Err` leaves the connection
    /// unusable (and `pending` answered when it was claimed).
    fn receive_get(
        &self,
        conn: &mut NodeConn,
        pending: &PendingRead,
        name: &[u8],
        corrupt: &mut Vec<(Vec<u8>, Vec<u8>, String)>,
    ) -> io::Result<Next> {
        let key = pending.request.get_key();
        let format = &self.config.format;
        let len = match self.get_reply_length(conn, pending, key, name, corrupt)? {
            Ok(len) => len,
            Err(next) => return Ok(next),
        };
        let mut head = [0u8; MAC_HEADER_BYTES];
        let head = &mut head[..len.min(format.header_bytes())];
        conn.read_exact_into(head, None, |_| {})?;
        let rest = len - head.len();
        let payload_bytes = match format.check_head(head, len as u64) {
            Ok(payload_bytes) => payload_bytes as usize,
            Err(error) => {
                self.settle(pending, ReadOutcome::Corrupt);
                corrupt.push((key.to_vec(), name.to_vec(), error.to_string()));
                conn.skip_bulk(rest)?;
                return Ok(Next::Ready);
            }
        };
        if !self.claim(pending) {
            // Answered by its deadline or given up: the payload goes nowhere.
            conn.skip_bulk(rest)?;
            return Ok(Next::Ready);
        }
        let mut room = take_landing(pending).map_or(Room::Owned, Room::Landing);
        let mut owned = Vec::new();
        let into: Option<&mut [u8]> = match &mut room {
            Room::Landing(landing) => landing.room(payload_bytes),
            Room::Owned => {
                owned = vec![0; payload_bytes];
                Some(&mut owned[..])
            }
        };
        let Some(into) = into else {
            conn.skip_bulk(rest)?;
            self.report_read(pending, ReadOutcome::Absent, None, None);
            return Ok(Next::Ready);
        };
        // Checked as it arrives, while each part is still in the cache.
        let mut check = match format.payload_check(&self.config.namespace, key, head) {
            Ok(check) => check,
            Err(error) => {
                conn.skip_bulk(rest)?;
                self.report_read(pending, ReadOutcome::Corrupt, None, None);
                corrupt.push((key.to_vec(), name.to_vec(), error.to_string()));
                return Ok(Next::Ready);
            }
        };
        let received = conn
            .read_exact_into(into, pending.deadline.get().copied(), |part| {
                check.update(part)
            })
            .and_then(|()| conn.crlf());
        if let Err(error) = received {
            self.report_read(pending, read_failure(is_timeout(&error)), None, None);
            return Err(error);
        }
        match check.finish() {
            Err(error) => {
                self.report_read(pending, ReadOutcome::Corrupt, None, None);
                corrupt.push((key.to_vec(), name.to_vec(), error.to_string()));
            }
            Ok(()) => self.report_hit(pending, room, owned, payload_bytes),
        }
        Ok(Next::Ready)
    }

    /// A checked payload answers its read: landed in the caller's memory, or owned.
    fn report_hit(&self, pending: &PendingRead, room: Room, owned: Vec<u8>, payload_bytes: usize) {
        match room {
            Room::Landing(mut landing) => {
                landing.landed(payload_bytes);
                self.report_read(pending, ReadOutcome::Hit, None, Some(payload_bytes as u64));
            }
            Room::Owned => self.report_read(pending, ReadOutcome::Hit, Some(owned), None),
        }
    }

    /// The length of a `GETRANGE` reply's value, or what follows when there is none:
    /// an absent key, a refused read and a value of the wrong type are answered (the
    /// latter two counted corrupt and deleted), a redirection goes through redis-rs.
    /// Every reply is consumed whole here or by the reads after; one of a shape
    /// GETRANGE never has, or longer than any value this server writes, is an `Err`,
    /// and the connection goes.
    fn get_reply_length(
        &self,
        conn: &mut NodeConn,
        pending: &PendingRead,
        key: &[u8],
        name: &[u8],
        corrupt: &mut Vec<(Vec<u8>, Vec<u8>, String)>,
    ) -> io::Result<Result<usize, Next>> {
        let format = &self.config.format;
        Ok(match conn.get_reply(format.read_limit_bytes())? {
            GetReply::Absent => {
                self.settle(pending, ReadOutcome::Absent);
                Err(Next::Ready)
            }
            GetReply::Value(len) => Ok(len),
            GetReply::TooLong(len) => {
                // Not a value this server wrote (none is longer than a slot): a corrupt
                // miss, deleted; its bytes are not read, so the connection goes.
                let why = format!(
                    "an L2 reply of {len} bytes to a GETRANGE of at most {} bytes",
                    format.read_limit_bytes().saturating_add(1)
                );
                self.settle(pending, ReadOutcome::Corrupt);
                corrupt.push((key.to_vec(), name.to_vec(), why.clone()));
                return Err(io::Error::new(io::ErrorKind::InvalidData, why));
            }
            GetReply::Error(message) if direct::is_redirect(&message) => Err(Next::Redirected),
            GetReply::Error(message) if message.starts_with("WRONGTYPE") => {
                self.settle(pending, ReadOutcome::Corrupt);
                corrupt.push((key.to_vec(), name.to_vec(), message));
                Err(Next::Ready)
            }
            GetReply::Error(message) => {
                tracing::debug!(%message, "L2 read refused");
                self.settle(pending, ReadOutcome::Failed);
                Err(Next::Ready)
            }
        })
    }

    /// A read the data path could not serve (redirected, or its slot had no master in
    /// the map): through redis-rs, which follows redirections.
    fn get_through_redis(
        &self,
        session: &mut Option<Session>,
        pending: &PendingRead,
        name: &[u8],
        corrupt: &mut Vec<(Vec<u8>, Vec<u8>, String)>,
    ) {
        let ReadRequest::Get(key) = &pending.request else {
            return;
        };
        if pending.answered.load(Ordering::Acquire) {
            return;
        }
        let Some(live) = self.session(session) else {
            self.settle(pending, ReadOutcome::Failed);
            return;
        };
        let value = match live.conn.get(name, self.config.format.read_limit_bytes()) {
            Ok(None) => return self.settle(pending, ReadOutcome::Absent),
            Ok(Some(value)) => value,
            Err(error) if connection::is_wrong_type(&error) => {
                self.settle(pending, ReadOutcome::Corrupt);
                corrupt.push((key.clone(), name.to_vec(), error.to_string()));
                return;
            }
            Err(error) => {
                *session = None;
                tracing::debug!(%error, "L2 read failed");
                return self.settle(pending, read_failure(error.is_timeout()));
            }
        };
        let payload = match self
            .config
            .format
            .decode(&self.config.namespace, key, &value)
        {
            Ok(payload) => payload,
            Err(error) => {
                self.settle(pending, ReadOutcome::Corrupt);
                corrupt.push((key.clone(), name.to_vec(), error.to_string()));
                return;
            }
        };
        if !self.claim(pending) {
            return;
        }
        let taken = pending
            .landing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match taken {
            None => self.report_read(pending, ReadOutcome::Hit, Some(payload.to_vec()), None),
            Some(mut landing) => match landing.room(payload.len()) {
                Some(room) => {
                    room.copy_from_slice(payload);
                    landing.landed(payload.len());
                    self.report_read(pending, ReadOutcome::Hit, None, Some(payload.len() as u64));
                }
                None => self.report_read(pending, ReadOutcome::Absent, None, None),
            },
        }
    }

    /// Logs a corrupt value once per key and deletes it. Deleting may race with another
    /// node writing a good value under the same key; losing that value costs one miss.
    fn discard_corrupt(&self, session: &mut Option<Session>, key: &[u8], name: &[u8], why: &str) {
        if self.first_corrupt(key) {
            tracing::warn!(
                key = %String::from_utf8_lossy(name),
                reason = why,
                "L2 value is corrupt: answered as a miss and deleted"
            );
        }
        let Some(live) = self.session(session) else {
            return;
        };
        if let Err(error) = live.conn.del(name) {
            *session = None;
            tracing::debug!(%error, "deleting a corrupt L2 value failed; it stays a miss");
        }
    }

    // ---------------------------------------------------------------- writes
}

/// `items` grouped by the node that serves each one's name (in their order within a
/// node), and those whose slot has no master in the map.
fn by_node<T>(
    direct: &Direct,
    items: impl Iterator<Item = T>,
    name: impl Fn(&T) -> &[u8],
) -> (Vec<(usize, Vec<T>)>, Vec<T>) {
    let mut groups: Vec<(usize, Vec<T>)> = Vec::new();
    let mut unmapped = Vec::new();
    for item in items {
        match direct.node_of(name(&item)) {
            Some(node) => match groups.iter_mut().find(|(n, _)| *n == node) {
                Some((_, group)) => group.push(item),
                None => groups.push((node, vec![item])),
            },
            None => unmapped.push(item),
        }
    }
    (groups, unmapped)
}

/// A socket error that is the timeout running out.
fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// How a read that failed ended: timed out, or failed.
fn read_failure(timed_out: bool) -> ReadOutcome {
    if timed_out {
        ReadOutcome::TimedOut
    } else {
        ReadOutcome::Failed
    }
}

/// Where a read's payload may land in its caller's memory, taken once.
fn take_landing(pending: &PendingRead) -> Option<Box<dyn Landing>> {
    pending
        .landing
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
}
