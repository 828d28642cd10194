//! Requests: who is who first ([`super::trust`]), then one decision per op.
//!
//! Evidence of life: every request of an instance's owner that names a tracked
//! instance refreshes it, whether it is acted on or refused for its arguments or the
//! connection's load (the worker's process sent it). A request the trust component
//! refuses (`forbidden`: not attached, not authenticated) never does.

use super::engine::{
    CommitStore, MAX_HELD_SLOTS_PER_INSTANCE, MAX_PINS_PER_KEY, PrepareRetrieve, PrepareStore,
    SlotGrant,
};
use super::l1::Reservation;
use super::l2::ReadFor;
use super::*;

/// Where a retrieve wants its bytes: exactly `nbytes` at `offset` of `buffer`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Want {
    pub(super) buffer: u64,
    pub(super) offset: u64,
    pub(super) nbytes: u64,
}
use crate::liveness::{Registration, TransferError};
use crate::protocol::{ErrorCode, PROTOCOL_VERSION, RetrieveItem, StoreItem};

type Answer = Option<Result<Value, ProtocolError>>;

fn bad_args(message: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::BadArgs, message)
}

fn overloaded() -> ProtocolError {
    ProtocolError::new(
        ErrorCode::Overloaded,
        format!(
            "this connection already has {MAX_IN_FLIGHT_PER_CONNECTION} requests running; wait \
             for replies before sending more"
        ),
    )
}

impl Node {
    pub(super) fn request(
        &mut self,
        now: Instant,
        conn: ConnId,
        request_id: u64,
        op: Op,
        fds: usize,
    ) {
        let to = ReplyTo {
            conn,
            request_id,
            op: op.name(),
        };
        if let Some(answer) = self.dispatch(now, to, op, fds) {
            self.reply(to, answer);
        }
    }

    /// Answers now (`Some`) or once the work it started is done (`None`).
    fn dispatch(&mut self, now: Instant, to: ReplyTo, mut op: Op, fds: usize) -> Answer {
        if self.shutdown.is_some() {
            return Some(Err(ProtocolError::new(
                ErrorCode::Unavailable,
                "the server is shutting down; reconnect to its successor and register again",
            )));
        }
        let trust_any = self.planted(PlantedBug::TrustAnyConnection);
        let Some(connection) = self.conns.get_mut(&to.conn) else {
            return None; // a request of a connection the shell never announced
        };
        let transport = connection.transport;
        // Who is who (trust.rs), before anything else: a TCP peer is nobody until its
        // `hello` presents a token; a request naming an instance needs the connection
        // to have attached it. A refused request refreshes nothing.
        let checked = match &op {
            Op::Hello { token, .. } if transport == Transport::Tcp => self
                .trust
                .authenticate(&mut connection.peer, token.as_deref()),
            Op::Hello { .. } => Ok(()),
            Op::Attach { .. } => self.trust.require_identity(&connection.peer, to.op),
            _ => self
                .trust
                .require_identity(&connection.peer, to.op)
                .and_then(|()| match op.instance() {
                    Some(_) if trust_any => Ok(()),
                    Some(instance) => self.trust.check(&connection.peer, instance, to.op),
                    None => Ok(()),
                }),
        };
        if let Err(error) = checked {
            return Some(Err(error));
        }
        let tenant = connection.peer.tenant();
        if let Op::Attach { instance, secret } = &op {
            return Some(
                self.trust
                    .attach(&mut connection.peer, *instance, secret)
                    .map(|attached| Value::Map(vec![("outcome".into(), attached.label().into())])),
            );
        }
        if let Some(tenant) = tenant
            && !self.planted(PlantedBug::SharedKeyspace)
        {
            trust::scope_keys(&mut op, self.trust.key_prefix(tenant));
        }
        if let Op::Ping { instance } = op {
            let answer: Value = self.ping(now, instance).into();
            #[cfg(feature = "planted-bugs")]
            if self.planted(PlantedBug::PingWaitsForL2) && self.l2_enabled() {
                self.held_pings.push((to, answer));
                return None;
            }
            return Some(Ok(answer));
        }
        // Refused or not, the owner's request is evidence of life (see the module docs).
        // A transfer's first step is the registry's `transfer`, which refreshes the
        // instance before any check can refuse it; the other ops can be refused before
        // they reach the registry, and an UNREGISTER of one module is evidence for the
        // instance's other one.
        let reaches_the_registry_first = matches!(
            op,
            Op::Store { .. }
                | Op::Retrieve { .. }
                | Op::StoreBatch { .. }
                | Op::RetrieveBatch { .. }
                | Op::PrepareStore { .. }
                | Op::CommitStore { .. }
                | Op::PrepareRetrieve { .. }
                | Op::CommitRetrieve { .. }
        );
        if let Some(instance) = op.instance()
            && !reaches_the_registry_first
        {
            self.evidence(now, instance);
        }
        match op {
            Op::Ping { .. } | Op::Attach { .. } => None,
            Op::Hello { sends_fds, .. } => Some(Ok(self.hello(to.conn, sends_fds))),
            Op::Status => {
                self.outputs.push_back(Output::ReplyStatus {
                    conn: to.conn,
                    request_id: to.request_id,
                });
                None
            }
            Op::Lookup { keys } => {
                let l1_count = self.l1.lookup_prefix(&keys);
                // Its L2 remainder runs as a job: counted in the connection's cap, as
                // every transfer is (failure mode 46).
                if self.l2.is_some() && (l1_count as usize) < keys.len() && !self.has_room(to.conn)
                {
                    return Some(Err(overloaded()));
                }
                self.l2_lookup(now, to, &keys, l1_count)
                    .map(|count| Ok(count.into()))
            }
            Op::RegisterKvCache {
                instance,
                buffers,
                model_name,
                world_size: _,
            } => self.register_kv_cache(now, to, transport, instance, buffers, model_name, fds),
            Op::RegisterEngineDriven {
                instance,
                model_name,
                world_size: _,
            } => {
                if let Some(tenant) = tenant
                    && !self.trust.engine_driven_allowed(tenant)
                {
                    return Some(Err(ProtocolError::new(
                        ErrorCode::Forbidden,
                        format!(
                            "register_engine_driven: tenant {:?} may not register \
                             engine-driven: such a worker maps the whole L1 pool read-write, \
                             every tenant's slots included. Use register_kv_cache with \
                             store/retrieve, or have the operator trust its uids \
                             (serve --tenant NAME=uid:N,engine-driven)",
                            self.trust.name(tenant),
                        ),
                    )));
                }
                if transport != Transport::Unix {
                    return Some(Err(bad_args(
                        "register_engine_driven: the L1 pool's memfd travels only over the Unix \
                         socket (SCM_RIGHTS), and this connection is TCP; connect over the Unix \
                         socket, or use register_kv_cache with store/retrieve over TCP"
                            .into(),
                    )));
                }
                self.register(
                    now,
                    to,
                    instance,
                    Module::EngineDriven,
                    Vec::new(),
                    model_name,
                )
            }
            Op::UnregisterKvCache { instance } => Some(Ok(self
                .unregister(now, instance, Module::ServerDriven)
                .into())),
            Op::UnregisterEngineDriven { instance } => Some(Ok(self
                .unregister(now, instance, Module::EngineDriven)
                .into())),
            Op::Store {
                instance,
                key,
                buffer,
                offset,
                nbytes,
            } => self.store(now, to, instance, key, buffer, offset, nbytes),
            Op::Retrieve {
                instance,
                key,
                buffer,
                offset,
                nbytes,
            } => self.retrieve(now, to, instance, key, buffer, offset, nbytes),
            Op::StoreBatch { instance, items } => self.store_batch(now, to, instance, items),
            Op::RetrieveBatch { instance, items } => self.retrieve_batch(now, to, instance, items),
            Op::PrepareStore { instance, key } => {
                Some(self.prepare_store(now, to.conn, instance, &key))
            }
            Op::CommitStore {
                instance,
                key,
                nbytes,
            } => Some(self.commit_store(now, instance, &key, nbytes)),
            Op::PrepareRetrieve { instance, key } => self.prepare_retrieve(now, to, instance, &key),
            Op::CommitRetrieve { instance, key } => Some(self.with_strategy(
                now,
                instance,
                "commit_retrieve",
                |strategy, l1| Ok(strategy.commit_retrieve(l1, &key).into()),
            )),
            Op::RegisterBlend { instance, rope } => self.register_blend(to, instance, rope),
        }
    }

    fn ping(&mut self, now: Instant, instance: Option<InstanceId>) -> bool {
        let tracked = if self.planted(PlantedBug::IgnorePings) {
            true
        } else {
            self.liveness.ping(now, instance)
        };
        self.pings_total += 1;
        if !tracked {
            self.pings_false += 1;
        }
        tracked
    }

    /// Refreshes `instance` (a transfer's evidence: `last_seen` without latching
    /// `proven`). The registry judges instances, so one transfer refreshes every module
    /// of it, whichever it names.
    fn evidence(&mut self, now: Instant, instance: InstanceId) {
        let _ = self.liveness.transfer(now, instance, Module::ServerDriven);
    }

    /// `hello`: what the worker needs to know of this server. A `sends_fds: false` holds
    /// for the rest of the connection (a later `hello` cannot take it back: the shell
    /// reads the connection without `SCM_RIGHTS` from here on).
    fn hello(&mut self, conn: ConnId, sends_fds: bool) -> Value {
        let Some(connection) = self.conns.get_mut(&conn) else {
            return Value::Nil; // unreachable: dispatch found it
        };
        let promised_now = connection.sends_fds && !sends_fds;
        connection.sends_fds &= sends_fds;
        let sends_fds = connection.sends_fds;
        let notice = connection
            .process
            .map_or(DeathNotice::TimeoutOnly, |(_, notice)| notice);
        let tenant = connection
            .peer
            .tenant()
            .map_or(Value::Nil, |tenant| self.trust.name(tenant).into());
        if promised_now {
            self.outputs.push_back(Output::ReadWithoutFds { conn });
        }
        let status = self.liveness.status();
        Value::Map(vec![
            ("protocol".into(), PROTOCOL_VERSION.into()),
            ("server".into(), self.config.server_name.as_str().into()),
            ("boot_id".into(), self.config.boot_id.into()),
            (
                "reap_timeout_seconds".into(),
                Value::F64(status.reap_timeout.as_secs_f64()),
            ),
            (
                "registration_grace_seconds".into(),
                Value::F64(status.registration_grace.as_secs_f64()),
            ),
            ("exit_proof".into(), notice.label().into()),
            ("sends_fds".into(), sends_fds.into()),
            ("tenant".into(), tenant),
        ])
    }

    #[allow(clippy::too_many_arguments)]
    fn register_kv_cache(
        &mut self,
        now: Instant,
        to: ReplyTo,
        transport: Transport,
        instance: InstanceId,
        buffers: Vec<BufferSpec>,
        model_name: String,
        fds: usize,
    ) -> Answer {
        if buffers.len() > MAX_BUFFERS_PER_REGISTRATION {
            return Some(Err(bad_args(format!(
                "register_kv_cache: {} buffers; at most {MAX_BUFFERS_PER_REGISTRATION} per registration",
                buffers.len()
            ))));
        }
        for (index, spec) in buffers.iter().enumerate() {
            match spec {
                BufferSpec::Memfd { fd_index, .. } => {
                    if transport != Transport::Unix {
                        return Some(Err(bad_args(format!(
                            "register_kv_cache: buffers[{index}] is a memfd, but memfds travel \
                             only over the Unix socket (SCM_RIGHTS); this connection is TCP"
                        ))));
                    }
                    if usize::try_from(*fd_index).map_or(true, |i| i >= fds) {
                        let fix = if self.conns.get(&to.conn).is_some_and(|c| !c.sends_fds) {
                            "this connection said `sends_fds: false` in `hello`, so the \
                             server reads it without SCM_RIGHTS and the kernel drops any fd \
                             sent on it; register over a connection that sends fds"
                        } else {
                            "send the memfds as SCM_RIGHTS with the frame's first byte"
                        };
                        return Some(Err(bad_args(format!(
                            "register_kv_cache: buffers[{index}].fd_index {fd_index} names an fd \
                             this frame did not carry (it carried {fds}); {fix}"
                        ))));
                    }
                }
                BufferSpec::CudaIpc { device, .. } => match &self.config.cuda_devices {
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
                    Ok(count) if device >= count => {
                        return Some(Err(bad_args(format!(
                            "register_kv_cache: buffers[{index}].device {device}, but this host \
                             has {count} CUDA device(s) (0..{count})"
                        ))));
                    }
                    Ok(_) => {}
                },
            }
        }
        self.register(now, to, instance, Module::ServerDriven, buffers, model_name)
    }

    /// REGISTER of either module, arguments checked.
    fn register(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        module: Module,
        buffers: Vec<BufferSpec>,
        model_name: String,
    ) -> Answer {
        let connection = self.conns.get(&to.conn)?;
        if connection.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded()));
        }
        let owner_uid = connection.uid;
        let tenant = connection.peer.tenant().unwrap_or(TenantId(0));
        self.watch(to.conn, instance);
        match self.liveness.register(now, instance, module) {
            Registration::Refreshed => {
                self.answer_refresh(to, instance, module);
                None
            }
            Registration::Build(ticket) => {
                self.records.insert(
                    (instance, module),
                    Record {
                        owner_uid,
                        tenant,
                        registered_at: now,
                        model_name: model_name.clone(),
                    },
                );
                let context = ContextId(self.next_id());
                self.builds.insert(
                    context,
                    PendingBuild {
                        ticket,
                        reply: to,
                        waiters: Vec::new(),
                    },
                );
                self.building.insert((instance, module), context);
                self.start_job(to.conn);
                self.outputs.push_back(Output::StartBuild {
                    context,
                    conn: to.conn,
                    request_id: to.request_id,
                    instance,
                    module,
                    buffers,
                    model_name,
                });
                None
            }
        }
    }

    /// A REGISTER that refreshed a present entry: answered now when the entry is
    /// built, else with the outcome of the build it found running (it may yet fail).
    fn answer_refresh(&mut self, to: ReplyTo, instance: InstanceId, module: Module) {
        let building = self
            .liveness
            .entry(instance, module)
            .is_some_and(|entry| entry.building);
        if building
            && !self.planted(PlantedBug::RefreshBeforeBuild)
            && let Some(build) = self
                .building
                .get(&(instance, module))
                .and_then(|context| self.builds.get_mut(context))
        {
            build.waiters.push(to);
            return;
        }
        self.reply_registered(to, module, "refreshed");
    }

    /// The reply to a REGISTER that holds: `{outcome}` (engine-driven: with the pool's
    /// geometry and memfd).
    pub(super) fn reply_registered(&mut self, to: ReplyTo, module: Module, outcome: &str) {
        let value = match module {
            Module::ServerDriven => Value::Map(vec![("outcome".into(), outcome.into())]),
            Module::EngineDriven => Value::Map(vec![
                ("outcome".into(), outcome.into()),
                ("slot_bytes".into(), self.l1.slot_bytes().into()),
                ("num_slots".into(), (self.l1.num_slots() as u64).into()),
                ("pool_fd_index".into(), 0u64.into()),
            ]),
        };
        self.outputs.push_back(Output::Reply {
            conn: to.conn,
            request_id: to.request_id,
            op: to.op,
            result: Ok(value),
            pool_fd: module == Module::EngineDriven,
        });
    }

    fn unregister(&mut self, now: Instant, instance: InstanceId, module: Module) -> bool {
        let was = self.liveness.unregister(now, instance, module);
        if !was {
            self.note(Note::UnregisterUnknown { instance, module });
        }
        was
    }

    /// The context of a transfer (liveness already refreshed by `evidence`).
    fn transfer_context(
        &mut self,
        now: Instant,
        instance: InstanceId,
        module: Module,
        op: &str,
    ) -> Result<ContextId, ProtocolError> {
        match self.liveness.transfer(now, instance, module) {
            Ok(&context) => Ok(context),
            Err(TransferError::NotRegistered) => Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                match module {
                    Module::ServerDriven => format!(
                        "`{op}`: instance {instance} is not registered here; re-register it \
                         (register_kv_cache) and retry"
                    ),
                    Module::EngineDriven => format!(
                        "`{op}`: instance {instance} is not registered for engine-driven \
                         transfers here; re-register it (register_engine_driven) and retry"
                    ),
                },
            )),
            Err(TransferError::NotReady) => Err(ProtocolError::new(
                ErrorCode::NotReady,
                format!("`{op}`: instance {instance} is still being registered; retry shortly"),
            )),
        }
    }

    /// Index of `buffer` in `context`, checked against `[offset, offset + nbytes)`.
    /// `what` names the request (or the batch item) in the message: "`store`".
    pub(super) fn checked_buffer(
        &self,
        context: ContextId,
        what: &str,
        instance: InstanceId,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Result<usize, ProtocolError> {
        let lens = match self.contexts.get(&context).map(|info| &info.built) {
            Some(Built::ServerDriven { buffer_lens }) => buffer_lens,
            _ => {
                return Err(bad_args(format!(
                    "{what}: instance {instance} holds no server-driven buffers"
                )));
            }
        };
        let count = lens.len();
        let Some(index) = usize::try_from(buffer).ok().filter(|&i| i < count) else {
            return Err(bad_args(format!(
                "{what}: buffer index {buffer}, but instance {instance} registered {count} buffers (valid: 0..{count})"
            )));
        };
        let len = lens[index];
        let fits = offset.checked_add(nbytes).is_some_and(|end| end <= len);
        if !fits {
            return Err(bad_args(format!(
                "{what}: offset {offset} + nbytes {nbytes} runs past the end of buffer {buffer} ({len} bytes)"
            )));
        }
        Ok(index)
    }

    fn has_room(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|connection| connection.in_flight < MAX_IN_FLIGHT_PER_CONNECTION)
    }

    /// Opens a server-driven transfer (`store`, `retrieve` and their batches) in the one
    /// order they all keep: the instance's context first (`transfer_context`), then
    /// `validate` on it (buffer ranges, slot sizes: what it returns comes back with the
    /// context), then the connection's cap. So a request that names no registered
    /// instance is told so, and a malformed one is refused as malformed even on a full
    /// connection; only a well-formed one is told to slow down.
    fn open_transfer<T>(
        &mut self,
        now: Instant,
        conn: ConnId,
        instance: InstanceId,
        op: &str,
        validate: impl FnOnce(&Self, ContextId) -> Result<T, ProtocolError>,
    ) -> Result<(ContextId, T), ProtocolError> {
        let context = self.transfer_context(now, instance, Module::ServerDriven, op)?;
        let checked = validate(self, context)?;
        if !self.has_room(conn) {
            return Err(overloaded());
        }
        Ok((context, checked))
    }

    /// Refuses a store of `nbytes` that would not fit one L1 slot. `what` names the
    /// request (or the batch item) in the message: "`store`".
    fn fits_a_slot(&self, what: &str, nbytes: u64) -> Result<(), ProtocolError> {
        let slot_bytes = self.l1.slot_bytes();
        if nbytes > slot_bytes {
            return Err(bad_args(format!(
                "{what}: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} bytes, \
                 --slot-bytes); store chunks of at most one slot"
            )));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_copy(
        &mut self,
        context: ContextId,
        direction: Direction,
        buffer: usize,
        offset: u64,
        slot: SlotId,
        nbytes: u64,
        purpose: CopyFor,
    ) {
        let copy = self.hold_copy(context, slot, purpose);
        self.outputs.push_back(Output::StartCopy {
            copy,
            context,
            direction,
            buffer,
            offset,
            slot,
            nbytes,
        });
    }

    /// Counts a copy between `context` and `slot` for `purpose`: the context's free
    /// waits until [`Node::copy_done`] or [`Node::copy_dropped`] ends it.
    pub(super) fn hold_copy(
        &mut self,
        context: ContextId,
        slot: SlotId,
        purpose: CopyFor,
    ) -> CopyId {
        let copy = CopyId(self.next_id());
        if let Some(info) = self.contexts.get_mut(&context) {
            info.copies += 1;
        }
        self.copies.insert(
            copy,
            Copy {
                context,
                slot,
                purpose,
            },
        );
        copy
    }

    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Answer {
        let opened = self.open_transfer(now, to.conn, instance, "store", |node, context| {
            let index =
                node.checked_buffer(context, "`store`", instance, buffer, offset, nbytes)?;
            node.fits_a_slot("`store`", nbytes)?;
            Ok(index)
        });
        let (context, index) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        match self.l1.reserve(&key, self.tenant(to.conn)) {
            Reservation::AlreadyStored => Some(Ok(true.into())),
            Reservation::Full => Some(Ok(false.into())),
            Reservation::Reserved(slot) => {
                self.start_job(to.conn);
                self.start_copy(
                    context,
                    Direction::ToL1,
                    index,
                    offset,
                    slot,
                    nbytes,
                    CopyFor::Store(to),
                );
                None
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn retrieve(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    ) -> Answer {
        let opened = self.open_transfer(now, to.conn, instance, "retrieve", |node, context| {
            node.checked_buffer(context, "`retrieve`", instance, buffer, offset, nbytes)
        });
        let context = match opened {
            Ok((context, _)) => context,
            Err(error) => return Some(Err(error)),
        };
        let want = Want {
            buffer,
            offset,
            nbytes,
        };
        if self.l1_holds(&key) || !self.l2_enabled() {
            return self.retrieve_l1(to, instance, context, &key, want);
        }
        let waiter = ReadFor::Retrieve {
            to,
            instance,
            context,
            want,
        };
        match self.l2_ask(now, &key, self.tenant(to.conn), waiter) {
            Ok(()) => {
                self.start_job(to.conn);
                None
            }
            Err(_) => Some(Ok(Value::Nil)), // a miss
        }
    }

    /// Whether `key` is committed in L1.
    fn l1_holds(&self, key: &[u8]) -> bool {
        self.l1.lookup_prefix(std::slice::from_ref(&key.to_vec())) == 1
    }

    /// The tenant `conn` acts for (checked by `dispatch` before any op runs).
    pub(super) fn tenant(&self, conn: ConnId) -> TenantId {
        self.conns
            .get(&conn)
            .and_then(|connection| connection.peer.tenant())
            .unwrap_or(TenantId(0))
    }

    /// Pins `key`'s committed slot for a copy of exactly `nbytes` into a worker's
    /// buffer. A value of another length is a miss (counted): a retrieve never writes
    /// more, or less, than its destination asked for.
    pub(super) fn pin_exact(&mut self, key: &[u8], nbytes: u64) -> Option<SlotId> {
        let (slot, len) = self.l1.pin(key)?;
        if len != nbytes {
            self.l1.unpin(slot);
            self.length_mismatches += 1;
            return None;
        }
        Some(slot)
    }

    /// The L1 part of `retrieve`: pin a value of the wanted length, copy it out.
    pub(super) fn retrieve_l1(
        &mut self,
        to: ReplyTo,
        instance: InstanceId,
        context: ContextId,
        key: &[u8],
        want: Want,
    ) -> Answer {
        if !self.contexts.contains_key(&context) {
            return Some(Err(super::l2::gone(instance, "retrieve")));
        }
        let index = match self.checked_buffer(
            context,
            "`retrieve`",
            instance,
            want.buffer,
            want.offset,
            want.nbytes,
        ) {
            Ok(index) => index,
            Err(error) => return Some(Err(error)),
        };
        let Some(slot) = self.pin_exact(key, want.nbytes) else {
            return Some(Ok(Value::Nil)); // a miss
        };
        self.start_job(to.conn);
        self.start_copy(
            context,
            Direction::FromL1,
            index,
            want.offset,
            slot,
            want.nbytes,
            CopyFor::Retrieve(to),
        );
        None
    }

    /// A batch is one transfer (one refresh, one slot of the connection's cap). Every
    /// item is validated before any slot is reserved, so a bad item refuses the whole
    /// batch and copies nothing; each item then copies on its own and the reply goes
    /// out once the last is done.
    fn store_batch(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        items: Vec<StoreItem>,
    ) -> Answer {
        let opened = self.open_transfer(now, to.conn, instance, "store_batch", |node, context| {
            let mut indexes = Vec::with_capacity(items.len());
            for (position, item) in items.iter().enumerate() {
                let what = format!("`store_batch` items[{position}]");
                indexes.push(node.checked_buffer(
                    context,
                    &what,
                    instance,
                    item.buffer,
                    item.offset,
                    item.nbytes,
                )?);
                node.fits_a_slot(&what, item.nbytes)?;
            }
            Ok(indexes)
        });
        let (context, indexes) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        let mut results = vec![Value::Nil; items.len()];
        let mut copies = Vec::new();
        let tenant = self.tenant(to.conn);
        for (position, (item, index)) in items.into_iter().zip(indexes).enumerate() {
            results[position] = match self.l1.reserve(&item.key, tenant) {
                Reservation::AlreadyStored => true.into(),
                Reservation::Full => false.into(),
                Reservation::Reserved(slot) => {
                    copies.push((position, slot, index, item.offset, item.nbytes));
                    Value::Nil
                }
            };
        }
        if copies.is_empty() {
            return Some(Ok(Value::Array(results)));
        }
        let batch = self.open_batch(to, results, copies.len());
        for (item, slot, index, offset, nbytes) in copies {
            self.start_copy(
                context,
                Direction::ToL1,
                index,
                offset,
                slot,
                nbytes,
                CopyFor::BatchStore { batch, item },
            );
        }
        None
    }

    fn retrieve_batch(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        items: Vec<RetrieveItem>,
    ) -> Answer {
        let what = |position: usize| format!("`retrieve_batch` items[{position}]");
        let opened =
            self.open_transfer(now, to.conn, instance, "retrieve_batch", |node, context| {
                let mut indexes = Vec::with_capacity(items.len());
                for (position, item) in items.iter().enumerate() {
                    indexes.push(node.checked_buffer(
                        context,
                        &what(position),
                        instance,
                        item.buffer,
                        item.offset,
                        item.nbytes,
                    )?);
                }
                Ok(indexes)
            });
        let (context, indexes) = match opened {
            Ok(opened) => opened,
            Err(error) => return Some(Err(error)),
        };
        // Every item was checked against its buffer: each pins a value of exactly its
        // length, or is a miss.
        let mut copies = Vec::new();
        let mut misses = Vec::new();
        for (position, (item, &index)) in items.iter().zip(&indexes).enumerate() {
            match self.pin_exact(&item.key, item.nbytes) {
                Some(slot) => copies.push((position, slot, index, item.offset, item.nbytes)),
                None => misses.push(position),
            }
        }
        let results = vec![Value::Nil; items.len()]; // nil: a miss
        if !self.l2_enabled() {
            misses.clear();
        }
        if copies.is_empty() && misses.is_empty() {
            return Some(Ok(Value::Array(results)));
        }
        let batch = self.open_batch(to, results, copies.len());
        let tenant = self.tenant(to.conn);
        for position in misses {
            let item = &items[position];
            if self.l1_holds(&item.key) {
                continue; // stored with another length: a miss, not an L2 read
            }
            let waiter = ReadFor::BatchRetrieve {
                batch,
                item: position,
                instance,
                context,
                want: Want {
                    buffer: item.buffer,
                    offset: item.offset,
                    nbytes: item.nbytes,
                },
            };
            if self.l2_ask(now, &item.key, tenant, waiter).is_ok()
                && let Some(open) = self.batches.get_mut(&batch)
            {
                open.pending += 1;
            }
        }
        if self
            .batches
            .get(&batch)
            .is_some_and(|open| open.pending == 0)
        {
            // Nothing copies and L2 was not asked: answer now.
            if let Some(open) = self.batches.remove(&batch) {
                self.end_job(to.conn);
                return Some(Ok(Value::Array(open.results)));
            }
        }
        for (item, slot, index, offset, nbytes) in copies {
            self.start_copy(
                context,
                Direction::FromL1,
                index,
                offset,
                slot,
                nbytes,
                CopyFor::BatchRetrieve { batch, item },
            );
        }
        None
    }

    /// Holds a batch until its `pending` copies are done; it counts as one job.
    fn open_batch(&mut self, to: ReplyTo, results: Vec<Value>, pending: usize) -> u64 {
        let id = self.next_id();
        self.start_job(to.conn);
        self.batches.insert(
            id,
            Batch {
                reply: to,
                results,
                pending,
                failed: None,
            },
        );
        id
    }

    /// Runs `step` on the instance's transfer strategy and the slot table; an op the
    /// strategy refuses is refused by `step` returning the error.
    fn with_strategy(
        &mut self,
        now: Instant,
        instance: InstanceId,
        op: &str,
        step: impl FnOnce(&mut TransferStrategy, &mut SlotTable) -> Result<Value, ProtocolError>,
    ) -> Result<Value, ProtocolError> {
        let context = self.transfer_context(now, instance, Module::EngineDriven, op)?;
        let Some(strategy) = self.strategies.get_mut(&context) else {
            return Err(ProtocolError::new(
                ErrorCode::Internal,
                format!("`{op}`: instance {instance}'s engine-driven entry holds another context"),
            ));
        };
        step(strategy, &mut self.l1)
    }

    fn prepare_store(
        &mut self,
        now: Instant,
        conn: ConnId,
        instance: InstanceId,
        key: &[u8],
    ) -> Result<Value, ProtocolError> {
        let num_slots = self.l1.num_slots();
        let tenant = self.tenant(conn);
        let mut reserved = None;
        let value =
            self.with_strategy(
                now,
                instance,
                "prepare_store",
                |strategy, l1| match strategy.prepare_store(l1, key, tenant) {
                    PrepareStore::Reserved(grant) => {
                        reserved = Some(grant.slot);
                        Ok(grant_value(grant, true))
                    }
                    PrepareStore::AlreadyStored => Ok(Value::Nil),
                    PrepareStore::PoolFull => Err(ProtocolError::new(
                        ErrorCode::Overloaded,
                        format!(
                            "`prepare_store`: every one of the {num_slots} L1 slots is reserved \
                         or pinned; commit what you prepared and retry later"
                        ),
                    )),
                    PrepareStore::TooManyHeld => Err(too_many_held("prepare_store", instance)),
                },
            )?;
        if let Some(slot) = reserved
            && self.planted(PlantedBug::WriteUnpublished)
        {
            self.l2_write_unpublished(slot, key);
        }
        Ok(value)
    }

    fn commit_store(
        &mut self,
        now: Instant,
        instance: InstanceId,
        key: &[u8],
        nbytes: u64,
    ) -> Result<Value, ProtocolError> {
        let value =
            self.with_strategy(now, instance, "commit_store", |strategy, l1| match strategy
                .commit_store(l1, key, nbytes)
            {
                CommitStore::Published => Ok(true.into()),
                CommitStore::NotReserved => Ok(false.into()),
                CommitStore::TooLarge { nbytes, slot_bytes } => Err(bad_args(format!(
                    "`commit_store`: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} \
                     bytes); commit at most one slot (the reservation is kept)"
                ))),
            })?;
        if value == Value::Boolean(true) {
            // Published: only now may it go to L2 (row 29).
            if let Some((slot, _)) = self.l1.pin(key) {
                self.l1.unpin(slot);
                self.l2_write_behind(now, slot);
            }
        }
        Ok(value)
    }

    /// `prepare_retrieve`: pins an L1 hit; a miss asks L2 (answered once it ends).
    fn prepare_retrieve(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        key: &[u8],
    ) -> Answer {
        let answer = self.prepare_retrieve_l1(now, instance, key);
        if answer != Ok(Value::Nil) || !self.l2_enabled() || self.l1_holds(key) {
            return Some(answer);
        }
        if !self.has_room(to.conn) {
            return Some(Err(overloaded()));
        }
        let tenant = self.tenant(to.conn);
        match self.l2_ask(now, key, tenant, ReadFor::PrepareRetrieve { to, instance }) {
            Ok(()) => {
                self.start_job(to.conn);
                None
            }
            Err(_) => Some(answer),
        }
    }

    /// The L1 part of `prepare_retrieve`.
    pub(super) fn prepare_retrieve_l1(
        &mut self,
        now: Instant,
        instance: InstanceId,
        key: &[u8],
    ) -> Result<Value, ProtocolError> {
        self.with_strategy(
            now,
            instance,
            "prepare_retrieve",
            |strategy, l1| match strategy.prepare_retrieve(l1, key) {
                PrepareRetrieve::Pinned(grant) => Ok(grant_value(grant, false)),
                PrepareRetrieve::Miss => Ok(Value::Nil),
                PrepareRetrieve::TooManyHeld => Err(too_many_held("prepare_retrieve", instance)),
            },
        )
    }

    fn register_blend(&mut self, to: ReplyTo, instance: InstanceId, rope: RopeSpec) -> Answer {
        let bytes = match blend::table_bytes(&rope) {
            Ok(bytes) => bytes,
            Err(message) => return Some(Err(bad_args(format!("`register_blend`: {message}")))),
        };
        let registered = Module::ALL
            .iter()
            .any(|&module| self.liveness.entry(instance, module).is_some());
        if !registered {
            return Some(Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                format!(
                    "`register_blend`: instance {instance} is not registered here, so there is \
                     nothing to attach rope state to; register it (register_kv_cache or \
                     register_engine_driven) first, then retry"
                ),
            )));
        }
        if self.blend.holds(instance, &rope) {
            return Some(Ok(true.into()));
        }
        let committed = self
            .blend
            .committed_bytes()
            .saturating_sub(self.blend.bytes_of(instance));
        if committed.saturating_add(bytes) > blend::MAX_TOTAL_BYTES {
            return Some(Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "`register_blend`: {bytes} more bytes of rope tables would take the server \
                     past its limit of {} bytes for all instances ({committed} held or being \
                     computed); retry later",
                    blend::MAX_TOTAL_BYTES
                ),
            )));
        }
        // One tenant's instances together stay within their share (failure mode 47).
        let tenant_of = |records: &BTreeMap<(InstanceId, Module), Record>, id: InstanceId| {
            Module::ALL
                .iter()
                .find_map(|&module| records.get(&(id, module)).map(|record| record.tenant))
        };
        if let Some(tenant) = tenant_of(&self.records, instance) {
            let records = &self.records;
            let tenant_committed = self.blend.committed_bytes_of(|other| {
                other != instance && tenant_of(records, other) == Some(tenant)
            });
            if tenant_committed.saturating_add(bytes) > blend::MAX_TENANT_BYTES {
                return Some(Err(ProtocolError::new(
                    ErrorCode::Overloaded,
                    format!(
                        "`register_blend`: {bytes} more bytes of rope tables would take tenant \
                         {:?} past its share of {} bytes ({tenant_committed} held or being \
                         computed by its other instances; a quarter of the server's {} is kept \
                         for other tenants); unregister instances it no longer uses, or lower \
                         max_positions",
                        self.trust.name(tenant),
                        blend::MAX_TENANT_BYTES,
                        blend::MAX_TOTAL_BYTES,
                    ),
                )));
            }
        }
        if !self.has_room(to.conn) {
            return Some(Err(overloaded()));
        }
        let id = BlendId(self.next_id());
        self.blend.begin(id, instance, rope.clone(), bytes);
        self.blends.insert(id, (to, instance));
        self.start_job(to.conn);
        self.outputs.push_back(Output::StartBlend {
            blend: id,
            instance,
            spec: rope,
        });
        None
    }
}

fn grant_value(grant: SlotGrant, with_slot: bool) -> Value {
    let mut map = Vec::with_capacity(3);
    if with_slot {
        map.push(("slot".into(), (grant.slot as u64).into()));
    }
    map.push(("offset".into(), grant.offset.into()));
    map.push(("nbytes".into(), grant.nbytes.into()));
    Value::Map(map)
}

fn too_many_held(op: &str, instance: InstanceId) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::Overloaded,
        format!(
            "`{op}`: instance {instance} already holds {MAX_HELD_SLOTS_PER_INSTANCE} slots \
             (reservations plus pinned keys) or {MAX_PINS_PER_KEY} pins of this key; commit \
             what it holds, then retry"
        ),
    )
}
