//! The L2 tier's I/O: threads that talk to a Redis Cluster (or one plain Redis) and
//! report back through a `mio::Waker`, the way the context pool does. Nothing here ever
//! blocks its caller.
//!
//! What to write, when to ask, and what the breaker says are the sans-IO side's
//! decisions ([`kvwarden_core::l2`]); this client only does what it is asked:
//!
//! - [`L2Client::submit_write`] queues a write; it is dropped (counted) only once the
//!   client shuts down. The byte bound of the write-behind queue is the node's, which
//!   submits only the writes it admitted (`failure-modes.md` row 27). Only published
//!   data may be submitted (row 29); the caller checks that.
//! - [`L2Client::get`] and [`L2Client::exists_prefix`] are answered later, through
//!   [`L2Client::drain`], within the timeout of when an L2 thread starts waiting for
//!   their answer (plus at most [`deadline::WAKE_SLACK`]): a deadline thread answers
//!   `TimedOut` for whatever the L2 threads have not answered by then. A read waiting
//!   for a thread, or behind the replies before it in a thread's pipeline (the items of
//!   a large batch, say), has no deadline here: how long it may wait is the node's
//!   rule, which gives it up with [`L2Read::cancel`].
//! - A value that fails any check of [`kvwarden_core::l2::ValueFormat::decode`] (its
//!   header, its checksum or MAC, its length against the slot: a read never fetches more
//!   than a slot plus the header), or a key that holds something other than a string,
//!   is a miss, counted as corrupt, logged once per key, and deleted.
//! - [`L2Client::finish_writes`] gives the write-behind queue a bounded time at
//!   shutdown and says what it did not write.
//!
//! The threads ([`worker`]) take reads and writes in batches and pipeline them per
//! node over the data path ([`direct`]): a hit's payload is received from the socket
//! straight into its [`Landing`] and checked there, a write's bytes sent straight from
//! the caller's. redis-rs ([`connection`]) finds out what the seeds are and keeps the
//! slot map, existence checks, deletes and redirected commands.

mod config;
mod connection;
mod deadline;
mod direct;
mod worker;

pub use config::{KnownNodes, L2Auth, L2Config, L2ConfigError, L2Tls, MAX_THREADS, redact_seed};
pub use connection::Mode;
#[doc(hidden)]
pub use direct::{Asked, ReplyRead, read_replies};

use connection::RedisConn;
use deadline::Deadlines;
use kvwarden_core::l2::{self, L2Counters, OpResult, Push, ReadOutcome, WriteOutcome, WriteQueue};
use std::collections::hash_map::RandomState;
use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

/// Reads waiting for an L2 thread beyond which a new read is answered `TimedOut` at
/// once: it could not be served within the timeout anyway.
pub const READS_WAITING_MAX: usize = 4096;

/// Corrupt keys remembered (as 64-bit hashes) so that each is logged once; the memory is
/// forgotten (and a key may be logged again) when it fills.
const CORRUPT_KEYS_LOGGED_MAX: usize = 65_536;

/// How an existence check ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PrefixOutcome {
    /// Redis answered: this many leading keys exist. A corrupt value counts as
    /// present here; the read that follows finds it out.
    Present(usize),
    /// No answer within the timeout.
    TimedOut,
    /// Redis or the connection failed.
    Failed,
}

impl PrefixOutcome {
    /// What the breaker makes of it.
    pub fn op_result(self) -> OpResult {
        match self {
            PrefixOutcome::Present(_) => OpResult::Succeeded,
            PrefixOutcome::TimedOut => OpResult::TimedOut,
            PrefixOutcome::Failed => OpResult::Failed,
        }
    }
}

/// A result handed back to the caller.
#[derive(Debug)]
pub enum L2Completion {
    /// The answer to [`L2Client::get`].
    Read {
        /// The caller's token.
        token: u64,
        /// The chunk's key, as given.
        key: Vec<u8>,
        /// How it ended.
        outcome: ReadOutcome,
        /// The payload, present exactly when `outcome` is [`ReadOutcome::Hit`] of a
        /// [`L2Client::get`].
        payload: Option<Vec<u8>>,
        /// The payload bytes placed by an [`L2Client::get_into`] hit (then `payload`
        /// is None).
        placed: Option<u64>,
    },
    /// The answer to [`L2Client::exists_prefix`].
    Prefix {
        /// The caller's token.
        token: u64,
        /// How it ended.
        outcome: PrefixOutcome,
    },
    /// A write from the queue ended.
    Written {
        /// The caller's token, as given to [`L2Client::submit_write`].
        token: u64,
        /// The chunk's key.
        key: Vec<u8>,
        /// How it ended.
        outcome: WriteOutcome,
    },
}

impl L2Completion {
    /// What the breaker makes of it.
    pub fn op_result(&self) -> OpResult {
        match self {
            L2Completion::Read { outcome, .. } => outcome.op_result(),
            L2Completion::Prefix { outcome, .. } => outcome.op_result(),
            L2Completion::Written { outcome, .. } => outcome.op_result(),
        }
    }
}

/// Why the client could not start.
#[derive(Debug, thiserror::Error)]
pub enum L2SpawnError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] L2ConfigError),
    /// The TLS files were refused by the TLS client.
    #[error("L2 TLS: {0}")]
    Tls(String),
    /// A thread could not be started.
    #[error(
        "starting an L2 thread failed: {0}; raise the process's thread limit or lower --l2-threads"
    )]
    Thread(#[from] std::io::Error),
}

/// A read waiting for its answer, shared by the L2 thread that serves it and the
/// deadline thread; whichever claims it first answers it, the other does nothing.
struct PendingRead {
    token: u64,
    request: ReadRequest,
    /// When the deadline thread answers it, if no L2 thread did; an L2 thread receiving
    /// its payload gives up then too. Set when an L2 thread starts waiting for its
    /// answer: the timeout from then ([`Shared::start_read`]).
    deadline: OnceLock<Instant>,
    /// Claimed: answered, or being received and placed by the one thread that will
    /// answer it.
    answered: AtomicBool,
    /// Where a hit's payload goes ([`L2Client::get_into`]); taken only by whoever
    /// claimed the read.
    landing: Mutex<Option<Box<dyn Landing>>>,
}

/// Where the payload of a hit of [`L2Client::get_into`] lands: an L2 thread receives it
/// from the socket straight into [`Landing::room`], checks it there, then tells
/// [`Landing::landed`]. Both are called only by the thread that claimed the read, before
/// its answer is reported, and never once it was answered otherwise (timed out, or
/// given up with [`L2Read::cancel`]).
pub trait Landing: Send {
    /// The memory a payload of `nbytes` is received into, this read's alone until it is
    /// answered; None when it cannot hold it (the read is then answered `Absent`). What
    /// it holds after a read that was not answered `Hit` is garbage.
    fn room(&mut self, nbytes: usize) -> Option<&mut [u8]>;
    /// The `nbytes` in the room passed every check (the checksum or the MAC): pass them
    /// on. Called once, and only then.
    fn landed(&mut self, nbytes: usize);
}

enum ReadRequest {
    Get(Vec<u8>),
    Exists(Vec<Vec<u8>>),
}

impl ReadRequest {
    /// The key a `Get` reads; none for an existence check.
    fn get_key(&self) -> &[u8] {
        match self {
            ReadRequest::Get(key) => key,
            ReadRequest::Exists(_) => &[],
        }
    }
}

/// A queued write: the caller's bytes (owned, or a view of an L1 slot the caller keeps
/// from eviction), held until written.
struct WriteTask {
    token: u64,
    key: Vec<u8>,
    payload: Box<dyn AsRef<[u8]> + Send>,
}

struct Work {
    reads: VecDeque<Arc<PendingRead>>,
    writes: WriteQueue<WriteTask>,
    /// Writes taken by an L2 thread and not ended yet.
    writes_in_flight: usize,
    shutdown: bool,
}

/// What [`L2Client::finish_writes`] did with the write-behind queue.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FinishedWrites {
    /// Writes that reached L2 while it waited.
    pub written: u64,
    /// Writes that failed or timed out while it waited.
    pub failed: u64,
    /// Writes still queued or being written when the bound passed: lost.
    pub dropped: u64,
}

struct Shared {
    config: L2Config,
    work: Mutex<Work>,
    work_ready: Condvar,
    /// Signalled each time a write ends.
    write_ended: Condvar,
    deadlines: Deadlines<PendingRead>,
    completions: Mutex<VecDeque<L2Completion>>,
    waker: Arc<mio::Waker>,
    counters: Mutex<L2Counters>,
    corrupt_logged: Mutex<HashSet<u64>>,
    corrupt_hasher: RandomState,
    mode: Mutex<Option<Mode>>,
    /// Why the latest connection attempt failed (cleared by one that succeeds).
    last_error: Mutex<Option<String>>,
    /// How the data path connects (TLS, credentials).
    link: Arc<direct::Link>,
    /// The waker was woken and the loop has not drained since: completions that arrive
    /// meanwhile need no wake of their own.
    woken: AtomicBool,
}

/// The L2 client: a handle on the L2 threads.
pub struct L2Client {
    shared: Arc<Shared>,
}

impl L2Client {
    /// Checks `config` and starts its L2 threads and the deadline thread. Connects
    /// lazily: an unreachable store is not an error here, only misses later.
    /// `waker` may be shared with the context pool (mio allows one waker per poll).
    pub fn spawn(
        config: L2Config,
        waker: impl Into<Arc<mio::Waker>>,
    ) -> Result<L2Client, L2SpawnError> {
        let waker = waker.into();
        config.validate()?;
        config::install_crypto_provider();
        let link = Arc::new(direct::Link::new(&config).map_err(L2SpawnError::Tls)?);
        let threads = config.threads;
        let shared = Arc::new(Shared {
            work: Mutex::new(Work {
                reads: VecDeque::new(),
                // The node bounds the write-behind queue (`L2NodeConfig::
                // write_queue_bytes`, failure-modes row 27) and hands this client only
                // the writes it admitted: queued here whatever their bytes.
                writes: WriteQueue::new(u64::MAX),
                writes_in_flight: 0,
                shutdown: false,
            }),
            config,
            work_ready: Condvar::new(),
            write_ended: Condvar::new(),
            deadlines: Deadlines::new(),
            completions: Mutex::new(VecDeque::new()),
            waker,
            counters: Mutex::new(L2Counters::default()),
            corrupt_logged: Mutex::new(HashSet::new()),
            corrupt_hasher: RandomState::new(),
            mode: Mutex::new(None),
            last_error: Mutex::new(None),
            link,
            woken: AtomicBool::new(false),
        });
        let client = L2Client {
            shared: Arc::clone(&shared),
        };
        // From here on, dropping `client` (on an error below) stops what was started.
        let deadline_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("kvwarden-l2-deadline".into())
            .spawn(move || {
                deadline_shared.deadlines.run(|pending| {
                    deadline_shared.time_out(pending);
                })
            })?;
        for index in 0..threads {
            let worker_shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("kvwarden-l2-{index}"))
                .spawn(move || worker_shared.serve())?;
        }
        Ok(client)
    }

    /// Queues `payload` to be written under `key` (dropped, counted, only after
    /// [`L2Client::finish_writes`]); never blocks. The node bounds what it submits. The answer comes as [`L2Completion::Written`] with
    /// `token`. `payload` is held until the write ends, and an L2 thread sends its
    /// bytes straight after the value's header (no copy of them is made first): pass
    /// owned bytes, or a view of an L1 slot the caller keeps from eviction until then.
    /// Only published data.
    pub fn submit_write(
        &self,
        token: u64,
        key: Vec<u8>,
        payload: impl AsRef<[u8]> + Send + 'static,
    ) -> Push {
        let bytes = (payload.as_ref().len() as u64).saturating_add(l2::HEADER_BYTES as u64);
        let task = WriteTask {
            token,
            key,
            payload: Box::new(payload),
        };
        let mut work = self.shared.lock_work();
        let push = if work.shutdown {
            Push::Dropped
        } else {
            work.writes.push(task, bytes)
        };
        drop(work);
        match push {
            Push::Queued => self.shared.work_ready.notify_one(),
            Push::Dropped => self.shared.lock_counters().record_dropped_write(),
        }
        push
    }

    /// Reads `key`; the answer comes through [`L2Client::drain`] as
    /// [`L2Completion::Read`] with `token`, within the timeout.
    pub fn get(&self, token: u64, key: Vec<u8>) {
        self.shared.submit_read(token, ReadRequest::Get(key), None);
    }

    /// Reads `key` and, on a hit, receives its payload into `landing` on the L2 thread
    /// before the answer is reported (as [`L2Completion::Read`] with `placed`; a hit
    /// that `landing` has no room for is reported `Absent`). `landing` is never touched
    /// once the read was answered otherwise (timed out, or given up with
    /// [`L2Read::cancel`]), so a caller may receive into memory it keeps for this read
    /// until the answer comes.
    pub fn get_into(&self, token: u64, key: Vec<u8>, landing: impl Landing + 'static) -> L2Read {
        L2Read {
            shared: Arc::clone(&self.shared),
            pending: self
                .shared
                .submit_read(token, ReadRequest::Get(key), Some(Box::new(landing))),
        }
    }

    /// Counts how many leading `keys` exist in L2 (pipelined); the answer comes through
    /// [`L2Client::drain`] as [`L2Completion::Prefix`] with `token`, within the timeout.
    /// The check may be given up with the handle ([`L2Read::cancel`]).
    pub fn exists_prefix(&self, token: u64, keys: Vec<Vec<u8>>) -> L2Read {
        L2Read {
            shared: Arc::clone(&self.shared),
            pending: self
                .shared
                .submit_read(token, ReadRequest::Exists(keys), None),
        }
    }

    /// Takes every result that arrived since the last call.
    pub fn drain(&self) -> VecDeque<L2Completion> {
        // Cleared first: a result that arrives after the take below wakes the loop again.
        self.shared.woken.store(false, Ordering::Release);
        std::mem::take(
            &mut *self
                .shared
                .completions
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// The counters now, `queue_bytes` included.
    pub fn counters(&self) -> L2Counters {
        let queue_bytes = self.shared.lock_work().writes.queue_bytes();
        let mut counters = *self.shared.lock_counters();
        counters.queue_bytes = queue_bytes;
        counters
    }

    /// What the seeds turned out to be, once an L2 thread (or [`L2Client::probe`]) has
    /// connected.
    pub fn mode(&self) -> Option<Mode> {
        *self.shared.mode.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node whose `CLUSTER SLOTS` the data path uses now (a seed, or after the
    /// first map any node it named); None before the first map, or for a plain Redis.
    pub fn map_from(&self) -> Option<String> {
        self.shared
            .config
            .known_nodes
            .map_from()
            .map(|node| redact_seed(&node))
    }

    /// Why the latest connection attempt failed; None once one succeeded.
    pub fn last_error(&self) -> Option<String> {
        self.shared
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Connects once from the calling thread, each step bounded by `bound`, and says
    /// what it found ("a Redis Cluster of 3 masters", "a single Redis node") or exactly
    /// why not: what a server says at start, before `ready`.
    pub fn probe(&self, bound: std::time::Duration) -> Result<String, String> {
        match RedisConn::connect(&self.shared.config, bound) {
            Ok(mut conn) => {
                let found = conn.describe();
                *self.shared.mode.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.mode());
                *self
                    .shared
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = None;
                Ok(found)
            }
            Err(error) => {
                let reason = describe_error(&error);
                *self
                    .shared
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(reason.clone());
                Err(reason)
            }
        }
    }
}

impl L2Client {
    /// At shutdown: waits until every queued write has ended, for at most `bound`, then
    /// stops the threads (as dropping the client does). Writes still queued or under
    /// way then are dropped, counted in `write_drops` and in the answer. Never waits
    /// longer than `bound`, whatever Redis does.
    pub fn finish_writes(&self, bound: std::time::Duration) -> FinishedWrites {
        let before = *self.shared.lock_counters();
        let deadline = Instant::now() + bound;
        let mut work = self.shared.lock_work();
        while !work.shutdown && (work.writes.waiting() > 0 || work.writes_in_flight > 0) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            work = self
                .shared
                .write_ended
                .wait_timeout(work, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut dropped = work.writes_in_flight as u64;
        while work.writes.pop().is_some() {
            dropped += 1;
        }
        work.shutdown = true;
        let counters = {
            let mut counters = self.shared.lock_counters();
            counters.write_drops = counters.write_drops.saturating_add(dropped);
            *counters
        };
        drop(work);
        self.shared.work_ready.notify_all();
        self.shared.deadlines.shut_down();
        FinishedWrites {
            written: counters.writes.saturating_sub(before.writes),
            failed: (counters.timeouts + counters.errors)
                .saturating_sub(before.timeouts + before.errors),
            dropped,
        }
    }
}

impl Drop for L2Client {
    /// Stops the threads without waiting for them: one may be inside a Redis call that
    /// only its timeout ends, and the caller must not wait for that. Queued writes are
    /// dropped; nothing is reported after this.
    fn drop(&mut self) {
        self.shared.lock_work().shutdown = true;
        self.shared.work_ready.notify_all();
        self.shared.deadlines.shut_down();
    }
}

/// A read asked with [`L2Client::get_into`], which its caller may give up.
pub struct L2Read {
    shared: Arc<Shared>,
    pending: Arc<PendingRead>,
}

impl L2Read {
    /// Gives the read up: it is answered `TimedOut` now (through [`L2Client::drain`],
    /// as any answer) and its `place` is never called. Unless it was answered already
    /// or its hit is being placed: then that answer comes as it would have. Exactly one
    /// answer either way, and never a `place` after this returns `true`.
    pub fn cancel(&self) -> bool {
        self.shared.time_out(&self.pending)
    }
}

impl Shared {
    fn lock_work(&self) -> std::sync::MutexGuard<'_, Work> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_counters(&self) -> std::sync::MutexGuard<'_, L2Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn submit_read(
        &self,
        token: u64,
        request: ReadRequest,
        landing: Option<Box<dyn Landing>>,
    ) -> Arc<PendingRead> {
        let pending = Arc::new(PendingRead {
            token,
            request,
            deadline: OnceLock::new(),
            answered: AtomicBool::new(false),
            landing: Mutex::new(landing),
        });
        let mut work = self.lock_work();
        if work.shutdown || work.reads.len() >= READS_WAITING_MAX {
            drop(work);
            self.time_out(&pending);
            return pending;
        }
        work.reads.push_back(Arc::clone(&pending));
        drop(work);
        self.work_ready.notify_one();
        pending
    }

    /// An L2 thread starts waiting for `pending`'s answer (the first reply of a pipeline
    /// when it was sent, each next one when the one before it is in): it gets its
    /// deadline, the timeout from now. So a read's deadline bounds how long Redis takes
    /// to answer it, never the time it waits behind the others of a thread's batch.
    fn start_read(&self, pending: &Arc<PendingRead>) {
        let deadline = Instant::now() + self.config.timeout;
        if pending.deadline.set(deadline).is_ok() {
            self.deadlines.add(deadline, Arc::clone(pending));
        }
    }

    /// Claims `pending`: true for the one caller that answers it.
    fn claim(&self, pending: &PendingRead) -> bool {
        !pending.answered.swap(true, Ordering::AcqRel)
    }

    /// Answers the `Get` `pending`, which the caller claimed; counts it.
    fn report_read(
        &self,
        pending: &PendingRead,
        outcome: ReadOutcome,
        payload: Option<Vec<u8>>,
        placed: Option<u64>,
    ) {
        let key = match &pending.request {
            ReadRequest::Get(key) => key.clone(),
            ReadRequest::Exists(_) => Vec::new(),
        };
        self.lock_counters().record_read(outcome);
        self.complete(L2Completion::Read {
            token: pending.token,
            key,
            outcome,
            payload,
            placed,
        });
    }

    /// Answers the existence check `pending`, which the caller claimed; counts it.
    fn report_prefix(&self, pending: &PendingRead, outcome: PrefixOutcome) {
        self.lock_counters()
            .record_failed_probe(outcome.op_result());
        self.complete(L2Completion::Prefix {
            token: pending.token,
            outcome,
        });
    }

    /// Claims and answers `pending` without a payload, unless it was claimed already.
    fn settle(&self, pending: &PendingRead, outcome: ReadOutcome) {
        if self.claim(pending) {
            match pending.request {
                ReadRequest::Get(_) => self.report_read(pending, outcome, None, None),
                ReadRequest::Exists(_) => self.report_prefix(
                    pending,
                    match outcome.op_result() {
                        OpResult::TimedOut => PrefixOutcome::TimedOut,
                        _ => PrefixOutcome::Failed,
                    },
                ),
            }
        }
    }

    /// Answers `pending` `TimedOut` unless it was claimed already: true when this
    /// answered it.
    fn time_out(&self, pending: &PendingRead) -> bool {
        if !self.claim(pending) {
            return false;
        }
        match pending.request {
            ReadRequest::Get(_) => self.report_read(pending, ReadOutcome::TimedOut, None, None),
            ReadRequest::Exists(_) => self.report_prefix(pending, PrefixOutcome::TimedOut),
        }
        true
    }

    fn complete(&self, completion: L2Completion) {
        if self.lock_work().shutdown {
            return;
        }
        self.completions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(completion);
        if self.woken.swap(true, Ordering::AcqRel) {
            return; // the loop has not drained since its last wake: it takes this too
        }
        if let Err(error) = self.waker.wake() {
            tracing::error!(%error, "waking the event loop for an L2 result failed");
        }
    }

    /// Logs a corrupt value once per key (true the first time).
    fn first_corrupt(&self, key: &[u8]) -> bool {
        let mut logged = self
            .corrupt_logged
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if logged.len() >= CORRUPT_KEYS_LOGGED_MAX {
            logged.clear();
        }
        logged.insert(self.corrupt_hasher.hash_one(key))
    }
}

#[cfg(test)]
mod tests;

/// An operator's reading of a connection failure: what kind, and the client's words.
pub fn describe_error(error: &redis::RedisError) -> String {
    let kind = if error.is_timeout() {
        "timed out"
    } else if error.is_connection_refusal() {
        "connection refused"
    } else if matches!(error.kind(), redis::ErrorKind::AuthenticationFailed) {
        "authentication failed (check --l2-password-file or KVWARDEN_L2_PASSWORD, and \
         --l2-username)"
    } else if error.is_io_error() {
        "cannot connect"
    } else {
        "refused"
    };
    format!("{kind}: {error}")
}
