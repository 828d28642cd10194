//! The worker's client: connect + `hello`, register memfd buffers, store/retrieve/lookup,
//! and a heartbeat thread driven by the core's [`kvwarden_core::Heartbeat`].
//!
//! Every connection attaches the worker's instance right after `hello`: the id and a
//! 32-byte secret drawn from the OS together, which prove to the server that this
//! process registered it (protocol 2). An id the server finds bound to another secret
//! (a squatter took it while the server held nothing of this worker) is replaced by a
//! fresh id and secret (logged, counted in [`Client::identity_changes`]); the
//! registration then follows under the new id, as after a reap.
//!
//! Over a Unix socket the client checks who answers before it sends any fd: the
//! server's uid (`SO_PEERCRED`) must be root, this process's own, or one of
//! [`ClientConfig::trusted_server_uids`].
//!
//! Recovery (after a ping answered `false`, a ping that failed and then succeeded, or a
//! transfer answered `not_registered`) re-registers the same instance id and the same
//! buffers before health is set again. It always runs on the heartbeat thread, by the
//! core's one rule ([`kvwarden_core::Heartbeat::on_not_registered`], which the Python
//! client follows too); a transfer answered `not_registered` waits for it (at most
//! the request timeout) and is then sent once more. [`Client::shutdown`] stops the
//! heartbeat and waits for a cycle still running, then unregisters, then closes, so no ghost
//! registration is ever re-created and no ping ever follows this worker's own
//! unregister.
//!
//! The heartbeat pings on a connection of its own (attached like the worker's): a
//! transfer the server holds (a slow L2, a busy pool) never delays a ping, so a healthy
//! worker never believes itself unhealthy because of its own request (row 61). The
//! worker's connection carries registrations and transfers; its lock is fair (FIFO
//! hand-off), so a recovery is never starved by a stream of transfers. The server stops
//! starting copies into this worker's buffers past the request timeout (`hello`'s
//! `wait_ms`, row 60), and a timed-out `retrieve` waits a moment more for its answer
//! (one second): once a call returns, its destination is the worker's again.
//!
//! A worker links this crate and the core (protocol, heartbeat), not the server: no
//! event loop, no metrics, no HTTP, no CUDA driver. The server (`kvwarden`) re-exports
//! it as `kvwarden::client`, and its [`memfd`] helpers as `kvwarden::memfd`.

pub mod memfd;
mod reply_json;
mod units;
mod wire;

mod buffer;
mod config;
mod error;
mod shared;

pub use buffer::{ClientBuffer, MemfdBuffer};
pub use config::ClientConfig;
use config::Identity;
pub use error::ClientError;
use shared::{HeldRegistration, Shared, lock};

pub use reply_json::{ids_as_strings, msgpack_to_json};
pub use units::parse_bytes;

pub use wire::Endpoint;

use kvwarden_core::protocol::{ErrorCode, Op, ReplyValue, RetrieveItem, StatusReport, StoreItem};
pub use kvwarden_core::protocol::{KvEvent, KvEvents, MAX_BATCH_ITEMS, MAX_KV_EVENTS};
use kvwarden_core::{Heartbeat, HeartbeatConfig, InstanceId, reap_timeout_floor_warning};
use parking_lot::FairMutex;
use rmpv::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A worker's connection to the server.
pub struct Client {
    shared: Arc<Shared>,
    heartbeat_thread: Mutex<Option<JoinHandle<()>>>,
}

impl Client {
    /// Connects and says hello. The instance id is drawn now (logged at INFO) unless
    /// the config names one.
    pub fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        if let Some(warning) = reap_timeout_floor_warning(config.heartbeat_interval) {
            tracing::warn!("{warning}");
        }
        let mut identity = Identity::generate(config.instance_id);
        if let Some(secret) = config.instance_secret {
            identity.secret = secret;
        }
        tracing::info!(instance = %identity.instance, endpoint = %config.endpoint, "kvwarden client instance id");
        let heartbeat = Heartbeat::new(HeartbeatConfig {
            interval: config.heartbeat_interval,
        });
        let shared = Arc::new(Shared {
            config,
            identity: Mutex::new(identity),
            identity_changes: AtomicU64::new(0),
            origin: std::time::Instant::now(),
            wire: FairMutex::new(None),
            ping_wire: FairMutex::new(None),
            registration: Mutex::new(None),
            heartbeat: Mutex::new(heartbeat),
            wake: Condvar::new(),
            recovered: Condvar::new(),
            lifecycle: Mutex::new(()),
            next_request_id: AtomicU64::new(1),
            recoveries: AtomicU64::new(0),
            pings_answered_false: AtomicU64::new(0),
            last_outcome: Mutex::new(None),
            exit_proof: Mutex::new(None),
            warned_reap_timeout: Mutex::new(None),
        });
        let wire = shared.connect()?;
        *lock(&shared.exit_proof) = wire.exit_proof.clone();
        *shared.wire.lock() = Some(wire);
        Ok(Client {
            shared,
            heartbeat_thread: Mutex::new(None),
        })
    }

    /// This worker's instance id (it changes only when the server had it bound to
    /// another secret: see [`Client::identity_changes`]).
    pub fn instance_id(&self) -> InstanceId {
        self.shared.instance()
    }

    /// How often this worker drew a fresh instance id and secret because the server
    /// had its id bound to another secret (0 unless someone squatted it).
    pub fn identity_changes(&self) -> u64 {
        self.shared.identity_changes.load(Ordering::Relaxed)
    }

    /// Whether the worker may trust its registration (false from a failed ping until a
    /// recovery succeeded).
    pub fn is_healthy(&self) -> bool {
        lock(&self.shared.heartbeat).is_healthy()
    }

    /// Recoveries (re-registrations) done so far.
    pub fn recoveries(&self) -> u64 {
        self.shared.recoveries.load(Ordering::Relaxed)
    }

    /// Pings the server answered `false` (it did not hold this instance). For a live
    /// worker that was neither reaped nor cut off and whose server did not restart,
    /// this stays 0; anything else is a bug (or a reap the caller expected).
    pub fn pings_answered_false(&self) -> u64 {
        self.shared.pings_answered_false.load(Ordering::Relaxed)
    }

    /// How the server said it will notice this process's death, on the latest
    /// connection: `pidfd_from_peer`, `pidfd_by_pid` or `timeout_only` (None from a
    /// server that does not say).
    pub fn exit_proof(&self) -> Option<String> {
        lock(&self.shared.exit_proof).clone()
    }

    /// The outcome of the latest registration (`created` or `refreshed`).
    pub fn last_outcome(&self) -> Option<String> {
        lock(&self.shared.last_outcome).clone()
    }

    /// Registers memfd buffers under this instance id; remembered for recoveries.
    /// Returns the outcome (`created` or `refreshed`).
    pub fn register(
        &self,
        buffers: Vec<Arc<MemfdBuffer>>,
        model_name: &str,
        world_size: u64,
    ) -> Result<String, ClientError> {
        let buffers = buffers.into_iter().map(ClientBuffer::Memfd).collect();
        self.register_buffers(buffers, model_name, world_size)
    }

    /// Registers memfd and CUDA IPC buffers under this instance id; remembered for
    /// recoveries. Returns the outcome (`created` or `refreshed`).
    pub fn register_buffers(
        &self,
        buffers: Vec<ClientBuffer>,
        model_name: &str,
        world_size: u64,
    ) -> Result<String, ClientError> {
        let registration = HeldRegistration {
            buffers,
            model_name: model_name.to_string(),
            world_size,
        };
        let outcome = self.shared.register(&registration)?;
        *lock(&self.shared.registration) = Some(registration);
        Ok(outcome)
    }

    /// Starts the heartbeat now (it also starts by itself on the first store/retrieve).
    pub fn start_heartbeat(&self) {
        let now = self.shared.now();
        {
            let mut heartbeat = lock(&self.shared.heartbeat);
            if heartbeat.is_stopped() || heartbeat.is_started() {
                return;
            }
            heartbeat.start(now);
        }
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("kvwarden-heartbeat".into())
            .spawn(move || shared.heartbeat_loop());
        match spawned {
            Ok(handle) => *lock(&self.heartbeat_thread) = Some(handle),
            Err(error) => tracing::error!(%error, "starting the heartbeat thread failed"),
        }
    }

    /// A transfer of the op `build` makes for the current instance id. On
    /// `not_registered` the heartbeat recovers at once (the one rule both clients
    /// follow, `Heartbeat::on_not_registered`); once it has (within the request
    /// timeout), the transfer is sent once more, else the error is returned.
    fn transfer(&self, op: &str, build: impl Fn(InstanceId) -> Op) -> Result<Value, ClientError> {
        self.start_heartbeat();
        let timeout = self.shared.config.request_timeout;
        let args = |instance| build(instance).args();
        match self.shared.call_as(op, args, &[], timeout) {
            Err(error) if error.code() == Some(ErrorCode::NotRegistered) => {
                tracing::warn!(instance = %self.shared.instance(), op, "the server does not hold this instance; the heartbeat re-registers it now");
                if !self.shared.recover_through_heartbeat(timeout) {
                    return Err(error);
                }
                self.shared.call_as(op, args, &[], timeout)
            }
            other => other,
        }
    }

    /// Copies `[offset, offset + nbytes)` of registered buffer `buffer` into L1 under
    /// `key`. false: L1 is full of pinned data.
    pub fn store(
        &self,
        key: &[u8],
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Result<bool, ClientError> {
        let op = |instance| Op::Store {
            instance,
            key: key.to_vec(),
            buffer,
            offset,
            nbytes,
        };
        read("store", self.transfer("store", op)?)
    }

    /// Copies the L1 value of `key` into `[offset, offset + nbytes)` of buffer
    /// `buffer`: bytes copied (`nbytes`), or None on a miss. A stored value of another
    /// length is a miss, and nothing is written.
    pub fn retrieve(
        &self,
        key: &[u8],
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Result<Option<u64>, ClientError> {
        let op = |instance| Op::Retrieve {
            instance,
            key: key.to_vec(),
            buffer,
            offset,
            nbytes,
        };
        read("retrieve", self.transfer("retrieve", op)?)
    }

    /// Stores many blocks in one request: each item is `(key, buffer, offset, nbytes)`
    /// as for [`Client::store`], and each answer is what `store` would have answered.
    /// A bad item refuses the whole batch (`bad_args` naming its index) and copies
    /// nothing; at most [`MAX_BATCH_ITEMS`] items.
    pub fn store_batch(&self, items: &[(&[u8], u64, u64, u64)]) -> Result<Vec<bool>, ClientError> {
        let op = |instance| Op::StoreBatch {
            instance,
            items: items
                .iter()
                .map(|&(key, buffer, offset, nbytes)| StoreItem {
                    key: key.to_vec(),
                    buffer,
                    offset,
                    nbytes,
                })
                .collect(),
        };
        batch_answers(
            "store_batch",
            self.transfer("store_batch", op)?,
            items.len(),
        )
    }

    /// Retrieves many blocks in one request: each item is `(key, buffer, offset,
    /// nbytes)` as for [`Client::retrieve`], and each answer is bytes copied or None on
    /// a miss.
    pub fn retrieve_batch(
        &self,
        items: &[(&[u8], u64, u64, u64)],
    ) -> Result<Vec<Option<u64>>, ClientError> {
        let op = |instance| Op::RetrieveBatch {
            instance,
            items: items
                .iter()
                .map(|&(key, buffer, offset, nbytes)| RetrieveItem {
                    key: key.to_vec(),
                    buffer,
                    offset,
                    nbytes,
                })
                .collect(),
        };
        batch_answers(
            "retrieve_batch",
            self.transfer("retrieve_batch", op)?,
            items.len(),
        )
    }

    /// How many leading keys L1 holds.
    pub fn lookup(&self, keys: &[Vec<u8>]) -> Result<u64, ClientError> {
        let args = Op::Lookup {
            keys: keys.to_vec(),
        }
        .args();
        let value = self
            .shared
            .call("lookup", args, &[], self.shared.config.request_timeout)?;
        read("lookup", value)
    }

    /// What entered and left L1 in this client's tenant since `cursor` (empty: a new
    /// reader), at most `max` changes: see `kv_events` in docs/protocol.md. Pass the
    /// reply's `cursor` to the next call; on `resync`, withdraw everything announced
    /// before applying the reply's events.
    pub fn kv_events(&self, cursor: &[u8], max: u64) -> Result<KvEvents, ClientError> {
        let args = Op::KvEvents {
            cursor: cursor.to_vec(),
            max,
        }
        .args();
        let value = self
            .shared
            .call("kv_events", args, &[], self.shared.config.request_timeout)?;
        read("kv_events", value)
    }

    /// Attaches a description to each of `items`' keys that L1 holds in this client's
    /// tenant (at most 2048 bytes each): `kv_events` readers get it with the key. One
    /// answer per item: false where L1 does not hold the key.
    pub fn describe_keys(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<bool>, ClientError> {
        let args = Op::DescribeKeys {
            items: items
                .iter()
                .map(|(key, meta)| (key.to_vec(), meta.to_vec()))
                .collect(),
        }
        .args();
        let value = self.shared.call(
            "describe_keys",
            args,
            &[],
            self.shared.config.request_timeout,
        )?;
        read("describe_keys", value)
    }

    /// `status`: the server's figures (docs/protocol.md), typed.
    pub fn status(&self) -> Result<StatusReport, ClientError> {
        let value = self.call("status", Vec::new())?;
        read("status", value)
    }

    /// Any request, raw (for tools and tests).
    pub fn call(&self, op: &str, args: Vec<Value>) -> Result<Value, ClientError> {
        self.shared
            .call(op, args, &[], self.shared.config.request_timeout)
    }

    /// Stops the heartbeat and waits for a cycle still running (its ping, at most one
    /// ping timeout), then unregisters, then closes. A cycle still running neither
    /// recovers nor changes health after the stop, and no ping is sent after the
    /// unregister: one would be answered `false` for a worker that is alive.
    pub fn shutdown(self) -> Result<(), ClientError> {
        lock(&self.shared.heartbeat).stop();
        self.shared.wake.notify_all();
        if let Some(handle) = lock(&self.heartbeat_thread).take() {
            let _ = handle.join();
        }
        let result = {
            let _lifecycle = lock(&self.shared.lifecycle);
            let registered = lock(&self.shared.registration).take().is_some();
            if registered {
                let args = |instance: InstanceId| vec![instance.get().into()];
                self.shared
                    .call_as(
                        "unregister_kv_cache",
                        args,
                        &[],
                        self.shared.config.request_timeout,
                    )
                    .map(|_| ())
            } else {
                Ok(())
            }
        };
        *self.shared.wire.lock() = None;
        result
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        lock(&self.shared.heartbeat).stop();
        self.shared.wake.notify_all();
    }
}

/// `op`'s reply read as the type the protocol's op table says it answers
/// (`kvwarden_core::protocol::answer`, the types the server's node answers with).
pub(crate) fn read<T: ReplyValue>(op: &str, value: Value) -> Result<T, ClientError> {
    T::from_value(&value).ok_or_else(|| ClientError::Reply {
        op: op.to_string(),
        detail: format!("unexpected value {value}"),
    })
}

/// A batch reply: one answer per item sent.
fn batch_answers<T: ReplyValue>(
    op: &str,
    reply: Value,
    sent: usize,
) -> Result<Vec<T>, ClientError> {
    let answers: Vec<T> = read(op, reply)?;
    if answers.len() != sent {
        return Err(ClientError::Reply {
            op: op.to_string(),
            detail: format!("{} answers for {sent} items", answers.len()),
        });
    }
    Ok(answers)
}
