//! Requests: ownership, then one core call per op; builds and copies go to the pool.

use super::*;

impl Server {
    // ---------------------------------------------------------------- requests

    pub(super) fn handle_frame(&mut self, token: Token, frame: Frame) {
        let request = match decode_request(&frame.body) {
            Ok(request) => request,
            Err(error) => {
                self.metrics.request("invalid");
                let request_id = error.request_id.unwrap_or(0);
                self.reply(token, request_id, "invalid", Err(error.error));
                return;
            }
        };
        let op = request.op.name();
        self.metrics.request(op);
        if let Some(result) = self.dispatch(token, request.id, request.op, frame.fds) {
            self.reply(token, request.id, op, result);
        }
    }

    /// Answers now (`Some`) or later, from the pool (`None`).
    pub(super) fn dispatch(
        &mut self,
        token: Token,
        request_id: u64,
        op: Op,
        fds: Vec<rustix::fd::OwnedFd>,
    ) -> Option<Result<Value, ProtocolError>> {
        let now = self.now();
        let peer_uid = self.connections.get(&token)?.peer.uid;
        if let Some(instance) = op.instance()
            && let Err(error) = self.check_owner(peer_uid, instance, op.name())
        {
            return Some(Err(error));
        }
        let name = op.name();
        let reply = ReplyTo {
            token,
            request_id,
            op: name,
        };
        match op {
            Op::Hello {
                protocol,
                client,
                pidfd_index,
            } => {
                tracing::debug!(protocol, client = %client, ?pidfd_index, "hello");
                if let Some(index) = pidfd_index
                    && let Err(error) = self.adopt_peer_pidfd(token, index, fds)
                {
                    return Some(Err(error));
                }
                let exit_proof = self.connections.get(&token)?.peer.death_notice();
                let status = self.liveness.status();
                Some(Ok(Value::Map(vec![
                    ("protocol".into(), PROTOCOL_VERSION.into()),
                    (
                        "server".into(),
                        concat!("kvwarden ", env!("CARGO_PKG_VERSION")).into(),
                    ),
                    ("boot_id".into(), self.boot_id.into()),
                    (
                        "reap_timeout_seconds".into(),
                        Value::F64(status.reap_timeout.as_secs_f64()),
                    ),
                    (
                        "registration_grace_seconds".into(),
                        Value::F64(status.registration_grace.as_secs_f64()),
                    ),
                    ("exit_proof".into(), exit_proof.label().into()),
                ])))
            }
            Op::Ping { instance } => {
                let started = std::time::Instant::now();
                let tracked = self.liveness.ping(now, instance);
                if !tracked {
                    self.metrics.pings_answered_false.inc();
                }
                self.metrics
                    .ping_seconds
                    .observe(started.elapsed().as_secs_f64());
                Some(Ok(tracked.into()))
            }
            Op::RegisterKvCache {
                instance,
                buffers,
                model_name,
                world_size: _,
            } => self.register_kv_cache(reply, instance, buffers, model_name, fds),
            Op::UnregisterKvCache { instance } => {
                let was = self
                    .liveness
                    .unregister(now, instance, Module::ServerDriven);
                if !was {
                    tracing::warn!(%instance, "unregister_kv_cache of an instance that is not registered here (unknown or already freed)");
                }
                Some(Ok(was.into()))
            }
            Op::Store {
                instance,
                key,
                buffer,
                offset,
                nbytes,
            } => self.store(reply, instance, key, buffer, offset, nbytes),
            Op::Retrieve {
                instance,
                key,
                buffer,
                offset,
            } => self.retrieve(reply, instance, key, buffer, offset),
            Op::StoreBatch { instance, items } => self.store_batch(reply, instance, items),
            Op::RetrieveBatch { instance, items } => self.retrieve_batch(reply, instance, items),
            Op::Lookup { keys } => Some(Ok(self.l1.lookup_prefix(&keys).into())),
            Op::RegisterEngineDriven {
                instance,
                model_name,
                world_size: _,
            } => self.register_engine_driven(reply, instance, model_name),
            Op::UnregisterEngineDriven { instance } => self.unregister_engine_driven(instance),
            Op::PrepareStore { instance, key } => self.prepare_store(instance, &key),
            Op::CommitStore {
                instance,
                key,
                nbytes,
            } => self.commit_store(instance, &key, nbytes),
            Op::PrepareRetrieve { instance, key } => self.prepare_retrieve(instance, &key),
            Op::CommitRetrieve { instance, key } => self.commit_retrieve(instance, &key),
            Op::RegisterBlend { instance, rope } => self.register_blend(reply, instance, rope),
            Op::Status => Some(Ok(self.status().to_msgpack())),
        }
    }

    /// An instance belongs to the uid that registered it; the server's own uid may act
    /// on any instance.
    pub(super) fn check_owner(
        &self,
        uid: Option<u32>,
        instance: InstanceId,
        op: &str,
    ) -> Result<(), ProtocolError> {
        if uid == Some(self.server_uid) {
            return Ok(());
        }
        let owner = Module::ALL
            .iter()
            .find_map(|&module| self.records.get(&(instance, module)))
            .map(|record| record.owner_uid);
        match owner {
            Some(owner) if owner != uid => Err(ProtocolError::new(
                ErrorCode::Forbidden,
                format!(
                    "`{op}`: instance {instance} belongs to {}, and this connection is {}; only \
                     its owner (or the server's own uid {}) may name it",
                    describe_uid(owner),
                    describe_uid(uid),
                    self.server_uid
                ),
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn register_kv_cache(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        buffers: Vec<BufferSpec>,
        model_name: String,
        fds: Vec<rustix::fd::OwnedFd>,
    ) -> Option<Result<Value, ProtocolError>> {
        let bad_args = |message: String| Some(Err(ProtocolError::new(ErrorCode::BadArgs, message)));
        let connection = self.connections.get(&reply.token)?;
        let is_unix = matches!(connection.stream, Stream::Unix(_));
        if buffers.len() > MAX_BUFFERS_PER_REGISTRATION {
            return bad_args(format!(
                "register_kv_cache: {} buffers; at most {MAX_BUFFERS_PER_REGISTRATION} per registration",
                buffers.len()
            ));
        }
        let mut with_fds = Vec::with_capacity(buffers.len());
        for (index, spec) in buffers.into_iter().enumerate() {
            match &spec {
                BufferSpec::Memfd { fd_index, .. } => {
                    if !is_unix {
                        return bad_args(format!(
                            "register_kv_cache: buffers[{index}] is a memfd, but memfds travel \
                             only over the Unix socket (SCM_RIGHTS); this connection is TCP"
                        ));
                    }
                    let fd = usize::try_from(*fd_index).ok().and_then(|i| fds.get(i));
                    let Some(fd) = fd else {
                        return bad_args(format!(
                            "register_kv_cache: buffers[{index}].fd_index {fd_index} names an fd \
                             this frame did not carry (it carried {}); send the memfds as \
                             SCM_RIGHTS with the frame's first byte",
                            fds.len()
                        ));
                    };
                    let fd = match fd.try_clone() {
                        Ok(fd) => fd,
                        Err(e) => {
                            return Some(Err(ProtocolError::new(
                                ErrorCode::Internal,
                                format!(
                                    "register_kv_cache: duplicating buffers[{index}]'s fd failed: {e}"
                                ),
                            )));
                        }
                    };
                    with_fds.push((spec, Some(fd)));
                }
                BufferSpec::CudaIpc { device, .. } => {
                    let gpu = match self.gpu.gpu() {
                        Ok(gpu) => gpu,
                        Err(reason) => {
                            return Some(Err(ProtocolError::new(
                                ErrorCode::Unavailable,
                                format!(
                                    "register_kv_cache: buffers[{index}] is a cuda_ipc buffer on \
                                     device {device}, but this server cannot use CUDA: {reason}; \
                                     register memfd buffers instead, or run the server on the GPU host"
                                ),
                            )));
                        }
                    };
                    if *device >= gpu.device_count() as u64 {
                        return bad_args(format!(
                            "register_kv_cache: buffers[{index}].device {device}, but this host has {} CUDA device(s) (0..{})",
                            gpu.device_count(),
                            gpu.device_count()
                        ));
                    }
                    with_fds.push((spec, None));
                }
            }
        }
        drop(fds);
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        let now = self.now();
        let peer_uid = self.connections.get(&reply.token)?.peer.uid;
        self.watch_peer(reply.token, instance);
        match self.liveness.register(now, instance, Module::ServerDriven) {
            Registration::Refreshed => {
                self.answer_refresh(reply, instance, Module::ServerDriven);
                None
            }
            Registration::Build(ticket) => {
                self.records.insert(
                    (instance, Module::ServerDriven),
                    Record {
                        owner_uid: peer_uid,
                        registered_at: now,
                        model_name: model_name.clone(),
                    },
                );
                let request = BuildRequest {
                    buffers: with_fds,
                    model_name,
                    gpu: self.gpu.gpu().ok().cloned(),
                };
                self.start_job(reply.token);
                let delay = self.faults.build_delay();
                self.pool.submit(move || {
                    crate::server::fault::delay_build(delay); // --fault-build-delay-ms
                    Done::Built {
                        ticket,
                        reply,
                        result: context::build(request),
                    }
                });
                None
            }
        }
    }

    /// Takes the pidfd the peer sent of itself with `hello` (fd `index` of the frame)
    /// as this connection's proof of death, once it checks out.
    pub(super) fn adopt_peer_pidfd(
        &mut self,
        token: Token,
        index: u64,
        mut fds: Vec<rustix::fd::OwnedFd>,
    ) -> Result<(), ProtocolError> {
        let bad_args = |message: String| ProtocolError::new(ErrorCode::BadArgs, message);
        let Some(connection) = self.connections.get_mut(&token) else {
            return Ok(());
        };
        if !matches!(connection.stream, Stream::Unix(_)) {
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index}, but a pidfd travels only over the Unix socket \
                 (SCM_RIGHTS) and this connection is TCP; leave pidfd_index out over TCP"
            )));
        }
        if connection.peer.pidfd_from_peer {
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index}, but this connection already sent its pidfd; \
                 send it once per connection"
            )));
        }
        let carried = fds.len();
        let Some(position) = usize::try_from(index).ok().filter(|&i| i < carried) else {
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index} names an fd this frame did not carry (it \
                 carried {carried}); send the pidfd as SCM_RIGHTS with the frame's first byte"
            )));
        };
        let pidfd = fds.swap_remove(position);
        let process =
            peer::check_peer_pidfd(&connection.peer, &pidfd, index, token).map_err(bad_args)?;
        tracing::debug!(token = token.0, pid = ?process.pid, key = ?process.key, "peer sent its pidfd");
        connection.peer.pidfd = Some(pidfd);
        connection.peer.pidfd_from_peer = true;
        connection.peer.process = Some(process);
        Ok(())
    }

    pub(super) fn watch_peer(&mut self, token: Token, instance: InstanceId) {
        let Some(connection) = self.connections.get(&token) else {
            return;
        };
        let (Some(process), Some(pidfd)) = (connection.peer.process, &connection.peer.pidfd) else {
            return;
        };
        let notice = connection.peer.death_notice();
        let next_token = &mut self.next_token;
        self.watches.watch(
            self.poll.registry(),
            process,
            pidfd,
            notice,
            instance,
            || {
                let token = Token(*next_token);
                *next_token += 1;
                token
            },
        );
    }

    pub(super) fn start_job(&mut self, token: Token) {
        self.jobs_in_flight += 1;
        if let Some(connection) = self.connections.get_mut(&token) {
            connection.in_flight += 1;
        }
    }

    pub(super) fn end_job(&mut self, token: Token) {
        self.jobs_in_flight = self.jobs_in_flight.saturating_sub(1);
        if let Some(connection) = self.connections.get_mut(&token) {
            connection.in_flight = connection.in_flight.saturating_sub(1);
        }
    }

    /// The context of a transfer, refreshing the instance's liveness.
    pub(super) fn transfer_context(
        &mut self,
        instance: InstanceId,
        op: &str,
    ) -> Result<Arc<Context>, ProtocolError> {
        let now = self.now();
        match self.liveness.transfer(now, instance, Module::ServerDriven) {
            Ok(context) => Ok(Arc::clone(context)),
            Err(TransferError::NotRegistered) => Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                format!(
                    "`{op}`: instance {instance} is not registered here; re-register it (register_kv_cache) and retry"
                ),
            )),
            Err(TransferError::NotReady) => Err(ProtocolError::new(
                ErrorCode::NotReady,
                format!("`{op}`: instance {instance} is still being registered; retry shortly"),
            )),
        }
    }

    /// The mapping of `buffer` in `context`, checked against `[offset, offset + nbytes)`.
    /// `what` names the request (or the batch item) in the message: "`store`".
    pub(super) fn checked_buffer(
        context: &Context,
        what: &str,
        instance: InstanceId,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Result<usize, ProtocolError> {
        let bad = |message: String| Err(ProtocolError::new(ErrorCode::BadArgs, message));
        let Some(server_driven) = context.server_driven() else {
            return bad(format!(
                "{what}: instance {instance} holds no server-driven buffers"
            ));
        };
        let count = server_driven.buffers.len();
        let Some(index) = usize::try_from(buffer).ok().filter(|&i| i < count) else {
            return bad(format!(
                "{what}: buffer index {buffer}, but instance {instance} registered {count} buffers (valid: 0..{count})"
            ));
        };
        let registered = &server_driven.buffers[index];
        if !registered.contains(offset, nbytes) {
            return bad(format!(
                "{what}: offset {offset} + nbytes {nbytes} runs past the end of buffer {buffer} ({} bytes)",
                registered.len()
            ));
        }
        Ok(index)
    }

    pub(super) fn store(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Option<Result<Value, ProtocolError>> {
        let context = match self.transfer_context(instance, "store") {
            Ok(context) => context,
            Err(error) => return Some(Err(error)),
        };
        let index =
            match Self::checked_buffer(&context, "`store`", instance, buffer, offset, nbytes) {
                Ok(index) => index,
                Err(error) => return Some(Err(error)),
            };
        let slot_bytes = self.l1.slot_bytes();
        if nbytes > slot_bytes {
            return Some(Err(ProtocolError::new(
                ErrorCode::BadArgs,
                format!(
                    "`store`: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} bytes, --slot-bytes); store chunks of at most one slot"
                ),
            )));
        }
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        match self.l1.reserve(&key) {
            Reservation::AlreadyStored => Some(Ok(true.into())),
            Reservation::Full => Some(Ok(false.into())),
            Reservation::Reserved(slot) => {
                let pool = Arc::clone(self.l1.mapping());
                let slot_offset = self.l1.offset(slot);
                self.start_job(reply.token);
                self.pool.submit(move || {
                    let copied = context.server_driven().is_some_and(|c| {
                        c.buffers[index].copy_to_l1(offset, &pool, slot_offset, nbytes)
                    });
                    drop(context); // the mapping may go now, if the context was freed meanwhile
                    Done::Stored {
                        reply,
                        slot,
                        copied: copy_result(copied, nbytes),
                    }
                });
                None
            }
        }
    }

    pub(super) fn retrieve(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
    ) -> Option<Result<Value, ProtocolError>> {
        let context = match self.transfer_context(instance, "retrieve") {
            Ok(context) => context,
            Err(error) => return Some(Err(error)),
        };
        if let Err(error) =
            Self::checked_buffer(&context, "`retrieve`", instance, buffer, offset, 0)
        {
            return Some(Err(error));
        }
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        let Some((slot, nbytes)) = self.l1.pin(&key) else {
            return Some(Ok(Value::Nil)); // a miss
        };
        let index =
            match Self::checked_buffer(&context, "`retrieve`", instance, buffer, offset, nbytes) {
                Ok(index) => index,
                Err(error) => {
                    self.l1.unpin(slot);
                    return Some(Err(error));
                }
            };
        let pool = Arc::clone(self.l1.mapping());
        let slot_offset = self.l1.offset(slot);
        self.start_job(reply.token);
        self.pool.submit(move || {
            let copied = context
                .server_driven()
                .is_some_and(|c| c.buffers[index].copy_from_l1(&pool, slot_offset, offset, nbytes));
            drop(context);
            Done::Retrieved {
                reply,
                slot,
                copied: copy_result(copied, nbytes),
            }
        });
        None
    }
}

pub(super) fn overloaded() -> ProtocolError {
    ProtocolError::new(
        ErrorCode::Overloaded,
        format!(
            "this connection already has {MAX_IN_FLIGHT_PER_CONNECTION} requests running; wait \
             for replies before sending more"
        ),
    )
}

pub(super) fn copy_result(copied: bool, nbytes: u64) -> Result<u64, ProtocolError> {
    if copied {
        Ok(nbytes)
    } else {
        Err(ProtocolError::new(
            ErrorCode::Internal,
            "a copy between a registered buffer and L1 went out of bounds after validation",
        ))
    }
}

fn describe_uid(uid: Option<u32>) -> String {
    match uid {
        Some(uid) => format!("uid {uid}"),
        None => "a TCP peer (no uid)".to_string(),
    }
}
