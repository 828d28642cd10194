//! What the worker's calls and its heartbeat thread share: the connections, the
//! registration, the heartbeat machine and the recovery it drives.

use crate::wire::Wire;
use kvwarden_core::protocol::{Attached, BufferSpec, ErrorCode, Op, Registered, ReplyValue};
use kvwarden_core::{
    Heartbeat, HeartbeatAction, InstanceId, Instant, PingReply, reap_timeout_warning,
};
use parking_lot::FairMutex;
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::{ClientBuffer, ClientConfig, ClientError, Identity, read};

#[derive(Clone)]
pub(crate) struct HeldRegistration {
    pub(crate) buffers: Vec<ClientBuffer>,
    pub(crate) model_name: String,
    pub(crate) world_size: u64,
}

pub(crate) struct Shared {
    pub(crate) config: ClientConfig,
    /// Changed only under the `wire` lock, by an `attach` that found the id taken.
    pub(crate) identity: Mutex<Identity>,
    pub(crate) identity_changes: AtomicU64,
    pub(crate) origin: std::time::Instant,
    /// Fair, so that a recovery is never starved by back-to-back transfers.
    pub(crate) wire: FairMutex<Option<Wire>>,
    /// The heartbeat's own connection: a ping never waits for the worker's connection,
    /// where a transfer may be held by a slow L2 or a busy server (row 61).
    pub(crate) ping_wire: FairMutex<Option<Wire>>,
    pub(crate) registration: Mutex<Option<HeldRegistration>>,
    pub(crate) heartbeat: Mutex<Heartbeat>,
    pub(crate) wake: Condvar,
    /// Signalled when a recovery ends (under the `heartbeat` lock).
    pub(crate) recovered: Condvar,
    /// Held by a recovery and by shutdown's unregister, so that they never interleave.
    pub(crate) lifecycle: Mutex<()>,
    pub(crate) next_request_id: AtomicU64,
    pub(crate) recoveries: AtomicU64,
    pub(crate) pings_answered_false: AtomicU64,
    pub(crate) last_outcome: Mutex<Option<String>>,
    /// `hello`'s `exit_proof` on the latest connection.
    pub(crate) exit_proof: Mutex<Option<String>>,
    /// The reap timeout the last warning (or its absence) was judged against.
    pub(crate) warned_reap_timeout: Mutex<Option<Duration>>,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn now(&self) -> Instant {
        Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    pub(crate) fn instance(&self) -> InstanceId {
        lock(&self.identity).instance
    }

    /// A connection that said hello and attached this worker's instance. Warns once
    /// per reap timeout a server says that 3 × this worker's heartbeat exceeds.
    pub(crate) fn connect(&self) -> Result<Wire, ClientError> {
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
    pub(crate) fn attach(&self, wire: &mut Wire) -> Result<(), ClientError> {
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
    pub(crate) fn call_as(
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
    pub(crate) fn call_on(
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
    pub(crate) fn call(
        &self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        self.call_as(op, |_| args, fds, timeout)
    }

    pub(crate) fn ping(&self) -> PingReply {
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

    pub(crate) fn register(&self, registration: &HeldRegistration) -> Result<String, ClientError> {
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
                ClientBuffer::CudaVmm {
                    fd,
                    device,
                    allocation_bytes,
                    offset,
                    nbytes,
                } => {
                    fds.push(fd.as_fd());
                    BufferSpec::CudaVmm {
                        fd_index: fds.len() as u64 - 1,
                        device: u64::from(*device),
                        allocation_bytes: *allocation_bytes,
                        offset: *offset,
                        nbytes: *nbytes,
                    }
                }
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
    pub(crate) fn recover(&self) -> bool {
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
    pub(crate) fn recover_through_heartbeat(&self, timeout: Duration) -> bool {
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

    pub(crate) fn heartbeat_loop(self: Arc<Self>) {
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
