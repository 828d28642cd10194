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

pub use reply_json::{ids_as_strings, msgpack_to_json};
pub use units::parse_bytes;

pub use wire::Endpoint;

use kvwarden_core::protocol::{
    Attached, BufferSpec, ErrorCode, Op, ProtocolError, Registered, ReplyValue, RetrieveItem,
    StoreItem,
};
pub use kvwarden_core::protocol::{KvEvent, KvEvents, MAX_BATCH_ITEMS, MAX_KV_EVENTS};
use kvwarden_core::{
    Heartbeat, HeartbeatAction, HeartbeatConfig, InstanceId, Instant, PingReply,
    reap_timeout_floor_warning, reap_timeout_warning,
};
use memfd::SharedMapping;
use parking_lot::FairMutex;
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;
use thiserror::Error;
use wire::Wire;

/// What can go wrong for a client call.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The connection failed or broke (the server may be restarting).
    #[error("connection to the kvwarden server at {endpoint} failed: {source}")]
    Io {
        /// Where.
        endpoint: String,
        /// The error.
        source: std::io::Error,
    },
    /// The server answered with an error.
    #[error("the server refused `{op}`: {error}")]
    Server {
        /// The op.
        op: String,
        /// The error reply.
        error: ProtocolError,
    },
    /// The server's reply made no sense.
    #[error("unexpected reply to `{op}`: {detail}")]
    Reply {
        /// The op.
        op: String,
        /// What was wrong.
        detail: String,
    },
    /// A local resource (a memfd) could not be set up.
    #[error("{0}")]
    Local(String),
    /// The process answering on the socket runs as a uid this client does not trust:
    /// nothing was sent to it.
    #[error(
        "refusing to talk to the server at {socket}: it runs as uid {uid}, which is neither \
         root, this process's uid ({own_uid}), nor in ClientConfig::trusted_server_uids \
         ({trusted:?}); another user may have created the socket first. Check the socket \
         path, or add uid {uid} to trusted_server_uids if that user runs your server"
    )]
    UntrustedServer {
        /// The socket.
        socket: String,
        /// The server's uid.
        uid: u32,
        /// This process's uid.
        own_uid: u32,
        /// The uids trusted besides root and our own.
        trusted: Vec<u32>,
    },
    /// The process answering on a TCP address could not prove it holds this client's
    /// token: nothing secret was sent to it.
    #[error(
        "refusing to talk to the server at {endpoint}: it could not prove it holds this \
         client's TCP token ({why}), so it is not the kvwarden server configured with that \
         token (another process may be listening on that port, or the server has another \
         token). The token was not sent. Check the address and the token file"
    )]
    ServerNotProven {
        /// The address.
        endpoint: String,
        /// What it answered.
        why: String,
    },
    /// Over TCP, no token to prove: the server answers nothing else.
    #[error(
        "the server at {endpoint} is reached over TCP, which needs its token: set \
         ClientConfig::tcp_token (ClientConfig::read_tcp_token_file, or the CLI's \
         --tcp-token-file) to the contents of the server's --tcp-token-file"
    )]
    NoTcpToken {
        /// The address.
        endpoint: String,
    },
}

impl ClientError {
    /// The server's error code, if this is an error reply.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { error, .. } => Some(error.code),
            _ => None,
        }
    }
}

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Where the server listens.
    pub endpoint: Endpoint,
    /// The heartbeat interval (also a ping's timeout). Default 10 s.
    pub heartbeat_interval: Duration,
    /// The instance id; None draws a fresh uuid-derived one.
    pub instance_id: Option<InstanceId>,
    /// The secret drawn with the id; None draws 32 bytes from the OS (always, for a
    /// worker: its secret is what makes the instance its own). Only a tool that shares
    /// one instance between processes of its own sets it (the benchmarks, the demo).
    pub instance_secret: Option<[u8; 32]>,
    /// The name sent in `hello`.
    pub client_name: String,
    /// How long any other request may take.
    pub request_timeout: Duration,
    /// Send a pidfd of this process with every `hello` over a Unix socket (default
    /// true): the server then frees this worker's state within milliseconds of its
    /// death even where it cannot see the worker's pid (another PID namespace, no
    /// `hostPID`). Off: the server proves the death only by pid, where visible.
    pub send_pidfd: bool,
    /// Server uids to trust besides root and this process's own (Unix socket only):
    /// any other is refused before a single fd is sent.
    pub trusted_server_uids: Vec<u32>,
    /// The token a TCP `hello` presents (the contents of the server's
    /// `--tcp-token-file`); see [`ClientConfig::read_tcp_token_file`].
    pub tcp_token: Option<Vec<u8>>,
}

impl ClientConfig {
    /// Defaults for `endpoint`.
    pub fn new(endpoint: Endpoint) -> ClientConfig {
        ClientConfig {
            endpoint,
            heartbeat_interval: HeartbeatConfig::default().interval,
            instance_id: None,
            instance_secret: None,
            client_name: concat!("kvwarden-client ", env!("CARGO_PKG_VERSION")).to_string(),
            request_timeout: Duration::from_secs(30),
            send_pidfd: true,
            trusted_server_uids: Vec::new(),
            tcp_token: None,
        }
    }

    /// Reads the TCP token from `path` (surrounding whitespace stripped): tokens never
    /// travel on a command line.
    pub fn read_tcp_token_file(path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
        let text = std::fs::read(path).map_err(|error| {
            ClientError::Local(format!(
                "cannot read the TCP token file {}: {error}; it holds the token the server's \
                 --tcp-token-file names",
                path.display()
            ))
        })?;
        let token = text.trim_ascii().to_vec();
        if token.is_empty() {
            return Err(ClientError::Local(format!(
                "the TCP token file {} is empty",
                path.display()
            )));
        }
        Ok(token)
    }
}

/// The worker's identity: its instance id and the secret drawn with it.
#[derive(Clone, Copy)]
struct Identity {
    instance: InstanceId,
    secret: [u8; 32],
}

impl Identity {
    fn generate(instance: Option<InstanceId>) -> Identity {
        let mut secret = [0u8; 32];
        // The OS's entropy; a process that cannot get it has no business registering.
        getrandom::fill(&mut secret).expect("the OS random source (getrandom) failed");
        Identity {
            instance: instance.unwrap_or_else(InstanceId::generate),
            secret,
        }
    }
}

/// A host buffer the worker shares with the server: an anonymous memfd, mapped here.
#[derive(Debug)]
pub struct MemfdBuffer {
    fd: OwnedFd,
    mapping: SharedMapping,
}

impl MemfdBuffer {
    /// A zero-filled buffer of `nbytes`.
    pub fn new(nbytes: usize) -> Result<MemfdBuffer, ClientError> {
        let local = |e: std::io::Error| {
            ClientError::Local(format!("creating a memfd buffer of {nbytes} bytes: {e}"))
        };
        let fd = memfd::create("kvwarden-worker-buffer", nbytes as u64).map_err(local)?;
        let mapping = SharedMapping::map(&fd, nbytes).map_err(local)?;
        Ok(MemfdBuffer { fd, mapping })
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }

    /// Writes `bytes` at `offset`; false when out of bounds.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> bool {
        self.mapping.write(offset, bytes)
    }

    /// Reads into `out` from `offset`; false when out of bounds.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> bool {
        self.mapping.read(offset, out)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A buffer a worker registers for server-driven transfers.
#[derive(Clone, Debug)]
pub enum ClientBuffer {
    /// Host memory shared as a memfd (Unix socket only).
    Memfd(Arc<MemfdBuffer>),
    /// A window of a device allocation, named by its `cuIpcGetMemHandle` handle.
    CudaIpc {
        /// The device ordinal.
        device: u32,
        /// The IPC handle of the allocation's base.
        handle: [u8; 64],
        /// Where the window starts in the allocation.
        offset: u64,
        /// The window's length.
        nbytes: u64,
    },
}

#[derive(Clone)]
struct Registration {
    buffers: Vec<ClientBuffer>,
    model_name: String,
    world_size: u64,
}

struct Shared {
    config: ClientConfig,
    /// Changed only under the `wire` lock, by an `attach` that found the id taken.
    identity: Mutex<Identity>,
    identity_changes: AtomicU64,
    origin: std::time::Instant,
    /// Fair, so that a recovery is never starved by back-to-back transfers.
    wire: FairMutex<Option<Wire>>,
    /// The heartbeat's own connection: a ping never waits for the worker's connection,
    /// where a transfer may be held by a slow L2 or a busy server (row 61).
    ping_wire: FairMutex<Option<Wire>>,
    registration: Mutex<Option<Registration>>,
    heartbeat: Mutex<Heartbeat>,
    wake: Condvar,
    /// Signalled when a recovery ends (under the `heartbeat` lock).
    recovered: Condvar,
    /// Held by a recovery and by shutdown's unregister, so that they never interleave.
    lifecycle: Mutex<()>,
    next_request_id: AtomicU64,
    recoveries: AtomicU64,
    pings_answered_false: AtomicU64,
    last_outcome: Mutex<Option<String>>,
    /// `hello`'s `exit_proof` on the latest connection.
    exit_proof: Mutex<Option<String>>,
    /// The reap timeout the last warning (or its absence) was judged against.
    warned_reap_timeout: Mutex<Option<Duration>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn instance(&self) -> InstanceId {
        lock(&self.identity).instance
    }

    /// A connection that said hello and attached this worker's instance. Warns once
    /// per reap timeout a server says that 3 × this worker's heartbeat exceeds.
    fn connect(&self) -> Result<Wire, ClientError> {
        let mut wire = Wire::connect(&self.config)?;
        if let Some(reap_timeout) = wire.reap_timeout
            && lock(&self.warned_reap_timeout).replace(reap_timeout) != Some(reap_timeout)
            && let Some(warning) =
                reap_timeout_warning(self.config.heartbeat_interval, reap_timeout)
        {
            tracing::warn!("{warning}");
        }
        self.attach(&mut wire)?;
        Ok(wire)
    }

    /// `attach`: proves the instance on this connection. An id bound to another secret
    /// is replaced by a fresh id and secret (the registration follows: the new id's
    /// first ping answers `false`).
    fn attach(&self, wire: &mut Wire) -> Result<(), ClientError> {
        const ATTEMPTS: usize = 4;
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let identity = *lock(&self.identity);
            let args = Op::Attach {
                instance: identity.instance,
                secret: identity.secret.to_vec(),
            }
            .args();
            let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
            match wire
                .call(id, "attach", args, &[], self.config.request_timeout)
                .and_then(|value| read::<Attached>("attach", value))
            {
                Ok(_) => return Ok(()),
                Err(error) if error.code() == Some(ErrorCode::Forbidden) => {
                    let fresh = Identity::generate(None);
                    tracing::warn!(
                        old = %identity.instance,
                        new = %fresh.instance,
                        %error,
                        "the server has this instance id bound to another secret (taken \
                         while the server held nothing of this worker); carrying on under \
                         a fresh id and secret"
                    );
                    *lock(&self.identity) = fresh;
                    self.identity_changes.fetch_add(1, Ordering::Relaxed);
                    last = Some(error);
                }
                Err(other) => return Err(other),
            }
        }
        Err(last.unwrap_or_else(|| ClientError::Local("attach failed".into())))
    }

    /// One request built from the current instance id, on the worker's connection; a
    /// broken or timed-out connection is dropped (the next call reconnects, says hello
    /// and attaches again).
    fn call_as(
        &self,
        op: &str,
        args: impl FnOnce(InstanceId) -> Vec<Value>,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        self.call_on(&self.wire, op, args, fds, timeout)
    }

    /// [`Shared::call_as`] on `wire`: the worker's connection, or the heartbeat's own
    /// (its pings never wait behind a transfer the server holds: row 61).
    fn call_on(
        &self,
        wire: &FairMutex<Option<Wire>>,
        op: &str,
        args: impl FnOnce(InstanceId) -> Vec<Value>,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let mut wire = wire.lock();
        if wire.is_none() {
            let fresh = self.connect()?;
            *lock(&self.exit_proof) = fresh.exit_proof.clone();
            *wire = Some(fresh);
        }
        let Some(connection) = wire.as_mut() else {
            return Err(ClientError::Local("no connection".into()));
        };
        let args = args(self.instance());
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let result = connection.call(id, op, args, fds, timeout);
        if matches!(
            result,
            Err(ClientError::Io { .. }) | Err(ClientError::Reply { .. })
        ) {
            *wire = None;
        }
        result
    }

    /// One request whose arguments name no instance.
    fn call(
        &self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        self.call_as(op, |_| args, fds, timeout)
    }

    fn ping(&self) -> PingReply {
        let ping = |instance| {
            Op::Ping {
                instance: Some(instance),
            }
            .args()
        };
        let instance = self.instance();
        let reply = self
            .call_on(
                &self.ping_wire,
                "ping",
                ping,
                &[],
                self.config.heartbeat_interval,
            )
            .map(|value| bool::from_value(&value).ok_or(value));
        match reply {
            Ok(Ok(true)) => PingReply::Known,
            Ok(Ok(false)) => {
                self.pings_answered_false.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%instance, "the server does not hold this instance (reaped or restarted); re-registering");
                PingReply::Unknown
            }
            Ok(Err(other)) => {
                tracing::error!(%instance, reply = ?other, "ping answered with a non-bool; client and server versions differ?");
                PingReply::Failed
            }
            Err(error @ ClientError::Server { .. }) => {
                tracing::error!(%instance, %error, "ping refused by the server: this worker stays unhealthy until it is fixed");
                PingReply::Failed
            }
            Err(error) => {
                tracing::warn!(%instance, %error, "ping failed; unhealthy until the server answers again");
                PingReply::Failed
            }
        }
    }

    fn register(&self, registration: &Registration) -> Result<String, ClientError> {
        let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
        let buffers: Vec<BufferSpec> = registration
            .buffers
            .iter()
            .map(|buffer| match buffer {
                ClientBuffer::Memfd(memfd) => {
                    fds.push(memfd.fd());
                    BufferSpec::Memfd {
                        fd_index: fds.len() as u64 - 1,
                        nbytes: memfd.len() as u64,
                    }
                }
                ClientBuffer::CudaIpc {
                    device,
                    handle,
                    offset,
                    nbytes,
                } => BufferSpec::CudaIpc {
                    device: u64::from(*device),
                    handle: handle.to_vec(),
                    offset: *offset,
                    nbytes: *nbytes,
                },
            })
            .collect();
        let args = |instance| {
            Op::RegisterKvCache {
                instance,
                buffers,
                model_name: registration.model_name.clone(),
                world_size: registration.world_size,
            }
            .args()
        };
        let value = self.call_as("register_kv_cache", args, &fds, self.config.request_timeout)?;
        let registered: Registered = read("register_kv_cache", value)?;
        let outcome = registered.outcome.label().to_owned();
        *lock(&self.last_outcome) = Some(outcome.clone());
        Ok(outcome)
    }

    /// Re-registers the same id and buffers; false when it failed or the client is
    /// shutting down (a stopped heartbeat never re-creates anything).
    fn recover(&self) -> bool {
        let _lifecycle = lock(&self.lifecycle);
        if lock(&self.heartbeat).is_stopped() {
            return false;
        }
        let Some(registration) = lock(&self.registration).clone() else {
            return true; // nothing registered: nothing to restore
        };
        match self.register(&registration) {
            Ok(outcome) => {
                self.recoveries.fetch_add(1, Ordering::Relaxed);
                tracing::info!(instance = %self.instance(), outcome, "re-registered");
                true
            }
            Err(error) => {
                tracing::warn!(instance = %self.instance(), %error, "re-registering failed; will retry after the next successful ping");
                false
            }
        }
    }

    /// A transfer was answered `not_registered`: the heartbeat's one recovery rule
    /// (`Heartbeat::on_not_registered`: health clears, the recovery is due at once and
    /// runs on the heartbeat thread). Waits at most `timeout` for health to come back;
    /// true when it did.
    fn recover_through_heartbeat(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut heartbeat = lock(&self.heartbeat);
        heartbeat.on_not_registered(self.now());
        self.wake.notify_all();
        while !heartbeat.is_healthy() && !heartbeat.is_stopped() {
            let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
                return false;
            };
            heartbeat = self
                .recovered
                .wait_timeout(heartbeat, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        heartbeat.is_healthy()
    }

    fn heartbeat_loop(self: Arc<Self>) {
        loop {
            let action = {
                let mut heartbeat = lock(&self.heartbeat);
                loop {
                    if heartbeat.is_stopped() {
                        return;
                    }
                    let now = self.now();
                    if let Some(action) = heartbeat.handle_timeout(now) {
                        break action;
                    }
                    let wait = heartbeat
                        .poll_timeout()
                        .map_or(Duration::from_secs(1), |at| {
                            at.saturating_duration_since(now)
                        });
                    heartbeat = self
                        .wake
                        .wait_timeout(heartbeat, wait.max(Duration::from_millis(1)))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            };
            let recover = match action {
                HeartbeatAction::SendPing => {
                    let reply = self.ping();
                    let now = self.now();
                    lock(&self.heartbeat).on_ping_reply(now, reply)
                        == Some(HeartbeatAction::Recover)
                }
                HeartbeatAction::Recover => true,
            };
            if recover {
                let ok = self.recover();
                let now = self.now();
                lock(&self.heartbeat).on_recover_done(now, ok);
                self.recovered.notify_all();
            }
        }
    }
}

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
        let registration = Registration {
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
fn read<T: ReplyValue>(op: &str, value: Value) -> Result<T, ClientError> {
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
