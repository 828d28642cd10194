//! Requests: who is who first ([`super::trust`]), then one decision per op.
//!
//! Evidence of life: every request of an instance's owner that names a tracked
//! instance refreshes it, whether it is acted on or refused for its arguments or the
//! connection's load (the worker's process sent it). A request the trust component
//! refuses (`forbidden`: not attached, not authenticated) never does.

use super::engine::{MAX_HELD_SLOTS_PER_INSTANCE, MAX_PINS_PER_KEY, SlotGrant};
use crate::node::{
    BlendId, ConnId, ContextId, DeathNotice, EntryDetails, Job, MAX_BUFFERS_PER_REGISTRATION, Node,
    Note, Output, PeerAction, PlantedBug, ReplyTo, TenantId, Transport, admission, blend, trust,
};
use crate::protocol::{Answer, BufferSpec, Op, OpKind, ProtocolError, RopeSpec};
use crate::time::Instant;
use crate::{InstanceId, Module};
use std::collections::BTreeMap;
use std::time::Duration;

/// Where a retrieve wants its bytes: exactly `nbytes` at `offset` of `buffer`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Want {
    pub(super) buffer: u64,
    pub(super) offset: u64,
    pub(super) nbytes: u64,
}
use crate::liveness::Registration;
use crate::protocol::{
    ErrorCode, HelloReply, MAX_KV_EVENTS, MAX_META_BYTES, Outcome, PROTOCOL_VERSION, PinnedSlot,
    PoolGeometry, Registered, ReservedSlot,
};

/// A request answered now (`Some`), or once the work it started is done (`None`).
pub(super) type Immediate = Option<Result<Answer, ProtocolError>>;

/// A request that passed [`Node::admit`]: its keys scoped to the connection's tenant.
struct Admitted {
    op: Op,
    transport: Transport,
    tenant: Option<TenantId>,
}

/// A transfer's first step is the registry's `transfer`, which refreshes the instance
/// before any check can refuse it; the other ops can be refused before they reach the
/// registry, so the dispatcher refreshes them first (and an UNREGISTER of one module is
/// evidence for the instance's other one).
fn reaches_the_registry_first(op: &Op) -> bool {
    matches!(
        op,
        Op::Store { .. }
            | Op::Retrieve { .. }
            | Op::StoreBatch { .. }
            | Op::RetrieveBatch { .. }
            | Op::PrepareStore { .. }
            | Op::CommitStore { .. }
            | Op::PrepareRetrieve { .. }
            | Op::CommitRetrieve { .. }
    )
}

pub(super) fn bad_args(message: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::BadArgs, message)
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
        let kind = op.kind();
        let deadline = match kind {
            OpKind::Retrieve | OpKind::RetrieveBatch => self
                .conns
                .get(&conn)
                .and_then(|connection| connection.wait)
                .map(|wait| now + wait),
            _ => None,
        };
        let to = ReplyTo {
            conn,
            request_id,
            op: kind,
            deadline,
        };
        if let Some(answer) = self.dispatch(now, to, op, fds) {
            self.reply(to, answer);
        }
    }

    /// Answers now (`Some`) or once the work it started is done (`None`).
    fn dispatch(&mut self, now: Instant, to: ReplyTo, op: Op, fds: usize) -> Immediate {
        let Admitted {
            op,
            transport,
            tenant,
        } = match self.admit(to, op) {
            Ok(admitted) => admitted,
            Err(answer) => return answer,
        };
        if let Op::Ping { instance } = op {
            return self.answer_ping(now, to, instance);
        }
        // Refused or not, the owner's request is evidence of life (see the module docs).
        if let Some(instance) = op.instance()
            && !reaches_the_registry_first(&op)
        {
            self.evidence(now, instance);
        }
        self.act(now, to, op, transport, tenant, fds)
    }

    /// Who is who (trust.rs), before anything else: a TCP peer is nobody until its
    /// `hello` presents a token; a request naming an instance needs the connection to
    /// have attached it. A refused request refreshes nothing. `attach` is answered
    /// here; an admitted request comes back with its keys scoped to its tenant.
    fn admit(&mut self, to: ReplyTo, mut op: Op) -> Result<Admitted, Immediate> {
        if self.shutdown.begun() {
            return Err(Some(Err(ProtocolError::new(
                ErrorCode::Unavailable,
                "the server is shutting down; reconnect to its successor and register again",
            ))));
        }
        let trust_any = self.planted(PlantedBug::TrustAnyConnection);
        let Some(connection) = self.conns.get_mut(&to.conn) else {
            return Err(None); // a request of a connection the shell never announced
        };
        let transport = connection.transport;
        if let Op::Auth { id, nonce } = &op {
            return Err(Some(if transport == Transport::Tcp {
                self.doors
                    .trust
                    .challenge(&mut connection.peer, id, nonce)
                    .map(Answer::Challenge)
            } else {
                Err(ProtocolError::new(
                    ErrorCode::BadArgs,
                    "`auth` is for TCP connections: over the Unix socket the server knows its \
                     peer by its uid; say `hello`",
                ))
            }));
        }
        let checked = match &op {
            Op::Hello { proof, token, .. } if transport == Transport::Tcp => self
                .doors
                .trust
                .authenticate(&mut connection.peer, proof.as_deref(), token.as_deref()),
            Op::Hello { .. } => Ok(()),
            Op::Attach { .. } => self
                .doors
                .trust
                .require_identity(&connection.peer, to.op.name()),
            _ => self
                .doors
                .trust
                .require_identity(&connection.peer, to.op.name())
                .and_then(|()| match op.instance() {
                    Some(_) if trust_any => Ok(()),
                    Some(instance) => {
                        self.doors
                            .trust
                            .check(&connection.peer, instance, to.op.name())
                    }
                    None => Ok(()),
                }),
        };
        checked.map_err(|error| Some(Err(error)))?;
        // A TCP peer that just proved a token leaves the strangers' share for its
        // tenant's (row 67), or stays a stranger when that share is full.
        if transport == Transport::Tcp
            && connection.holder == admission::Holder::Stranger
            && let Some(tenant) = connection.peer.tenant()
        {
            match self.doors.admission.authenticated(to.conn, tenant.0) {
                Ok(holder) => connection.holder = holder,
                Err(refused) => {
                    self.doors.trust.forget_identity(&mut connection.peer);
                    return Err(Some(Err(ProtocolError::new(
                        ErrorCode::Overloaded,
                        format!(
                            "`hello`: {refused}; close one of its connections, or raise \
                             --max-connections-per-uid"
                        ),
                    ))));
                }
            }
        }
        if let Op::Attach { instance, secret } = &op {
            return Err(Some(
                self.doors
                    .trust
                    .attach(&mut connection.peer, *instance, secret)
                    .map(Answer::Attached),
            ));
        }
        let tenant = connection.peer.tenant();
        if let Some(tenant) = tenant
            && !self.planted(PlantedBug::SharedKeyspace)
        {
            trust::scope_keys(&mut op, self.doors.trust.key_prefix(tenant));
        }
        Ok(Admitted {
            op,
            transport,
            tenant,
        })
    }

    fn answer_ping(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: Option<InstanceId>,
    ) -> Immediate {
        let answer = Answer::Flag(self.ping(now, instance));
        #[cfg(feature = "planted-bugs")]
        if self.planted(PlantedBug::PingWaitsForL2) && self.l2_enabled() {
            self.plants.held_pings.push((to, answer));
            return None;
        }
        let _ = to;
        Some(Ok(answer))
    }

    /// One decision per op, on an admitted request.
    fn act(
        &mut self,
        now: Instant,
        to: ReplyTo,
        op: Op,
        transport: Transport,
        tenant: Option<TenantId>,
        fds: usize,
    ) -> Immediate {
        match op {
            // Answered when admitted.
            Op::Ping { .. } | Op::Attach { .. } | Op::Auth { .. } => None,
            Op::Hello {
                sends_fds, wait_ms, ..
            } => self.hello(to.conn, sends_fds, wait_ms).map(Ok),
            Op::Status => {
                self.out.queue.push_back(Output::ReplyStatus {
                    conn: to.conn,
                    request_id: to.request_id,
                });
                None
            }
            Op::Lookup { keys } => self.lookup(now, to, &keys),
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
            } => self.register_engine_driven(now, to, transport, tenant, instance, model_name),
            Op::UnregisterKvCache { instance } => Some(Ok(Answer::Flag(self.unregister(
                now,
                instance,
                Module::ServerDriven,
            )))),
            Op::UnregisterEngineDriven { instance } => Some(Ok(Answer::Flag(self.unregister(
                now,
                instance,
                Module::EngineDriven,
            )))),
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
                |strategy, l1| Ok(Answer::Flag(strategy.commit_retrieve(l1, &key))),
            )),
            Op::RegisterBlend { instance, rope } => self.register_blend(to, instance, rope),
            Op::KvEvents { cursor, max } => Some(self.kv_events(tenant, &cursor, max)),
            Op::DescribeKeys { items } => Some(self.describe_keys(items)),
        }
    }

    /// `describe_keys`: attaches each item's description to its key, where L1 holds it.
    fn describe_keys(&mut self, items: Vec<(Vec<u8>, Vec<u8>)>) -> Result<Answer, ProtocolError> {
        if let Some(index) = items
            .iter()
            .position(|(_, meta)| meta.len() > MAX_META_BYTES)
        {
            return Err(ProtocolError::new(
                ErrorCode::BadArgs,
                format!(
                    "`describe_keys` items[{index}].meta is {} bytes; a description holds at \
                     most {MAX_META_BYTES}: describe less (a block's hashes and tokens fit)",
                    items[index].1.len()
                ),
            ));
        }
        Ok(Answer::Stored(
            items
                .into_iter()
                .map(|(key, meta)| self.l1.slots.describe(&key, meta))
                .collect(),
        ))
    }

    /// `kv_events`: the caller's tenant's changes to L1 since `cursor`.
    fn kv_events(
        &mut self,
        tenant: Option<TenantId>,
        cursor: &[u8],
        max: u64,
    ) -> Result<Answer, ProtocolError> {
        let prefix = tenant.map_or(&[][..], |tenant| self.doors.trust.key_prefix(tenant));
        let max = usize::try_from(max).map_or(MAX_KV_EVENTS, |max| max.min(MAX_KV_EVENTS));
        Ok(Answer::Events(self.events.read(
            &self.l1.slots,
            prefix,
            cursor,
            max,
        )))
    }

    fn lookup(&mut self, now: Instant, to: ReplyTo, keys: &[Vec<u8>]) -> Immediate {
        let l1_count = self.l1.slots.lookup_prefix(keys);
        // Its L2 remainder runs as a job: counted in the connection's cap, as every
        // transfer is (failure mode 46).
        if self.l2.is_some() && (l1_count as usize) < keys.len() && !self.conns.has_room(to.conn, 1)
        {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        self.l2_lookup(now, to, keys, l1_count)
            .map(|count| Ok(Answer::Count(count)))
    }

    fn register_engine_driven(
        &mut self,
        now: Instant,
        to: ReplyTo,
        transport: Transport,
        tenant: Option<TenantId>,
        instance: InstanceId,
        model_name: String,
    ) -> Immediate {
        if let Some(tenant) = tenant
            && !self.doors.trust.engine_driven_allowed(tenant)
        {
            return Some(Err(ProtocolError::new(
                ErrorCode::Forbidden,
                format!(
                    "register_engine_driven: tenant {:?} may not register engine-driven: such \
                     a worker maps the whole L1 pool read-write, every tenant's slots \
                     included. Use register_kv_cache with store/retrieve, or have the \
                     operator trust its uids (serve --tenant NAME=uid:N,engine-driven)",
                    self.doors.trust.name(tenant),
                ),
            )));
        }
        if transport != Transport::Unix {
            return Some(Err(bad_args(
                "register_engine_driven: the L1 pool's memfd travels only over the Unix socket \
                 (SCM_RIGHTS), and this connection is TCP; connect over the Unix socket, or \
                 use register_kv_cache with store/retrieve over TCP"
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

    fn ping(&mut self, now: Instant, instance: Option<InstanceId>) -> bool {
        let tracked = if self.planted(PlantedBug::IgnorePings) {
            true
        } else {
            self.liveness.ping(now, instance)
        };
        self.counters.ping(tracked);
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
    fn hello(&mut self, conn: ConnId, sends_fds: bool, wait_ms: Option<u64>) -> Option<Answer> {
        let connection = self.conns.get_mut(&conn)?; // admit found it
        if let Some(wait) = wait_ms {
            connection.wait = Some(Duration::from_millis(wait));
        }
        let promised_now = connection.sends_fds && !sends_fds;
        connection.sends_fds &= sends_fds;
        let sends_fds = connection.sends_fds;
        let notice = connection
            .process
            .map_or(DeathNotice::TimeoutOnly, |(_, notice)| notice);
        let tenant = connection
            .peer
            .tenant()
            .map(|tenant| self.doors.trust.name(tenant).to_owned());
        if promised_now {
            self.out
                .queue
                .push_back(Output::Peer(PeerAction::ReadWithoutFds { conn }));
        }
        let status = self.liveness.status();
        Some(Answer::Hello(HelloReply {
            protocol: PROTOCOL_VERSION,
            server: self.config.server_name.clone(),
            boot_id: self.config.boot_id,
            reap_timeout_seconds: status.reap_timeout.as_secs_f64(),
            registration_grace_seconds: status.registration_grace.as_secs_f64(),
            exit_proof: notice.label().to_owned(),
            sends_fds,
            tenant,
        }))
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
    ) -> Immediate {
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
                    // The promise holds whether or not the kernel could enforce it.
                    if self.conns.get(&to.conn).is_some_and(|c| !c.sends_fds) {
                        return Some(Err(bad_args(format!(
                            "register_kv_cache: buffers[{index}] is a memfd, but this connection \
                             said `sends_fds: false` in `hello`, so the server takes no fd on it \
                             (the kernel refuses them); register over a connection that sends fds"
                        ))));
                    }
                    if usize::try_from(*fd_index).map_or(true, |i| i >= fds) {
                        return Some(Err(bad_args(format!(
                            "register_kv_cache: buffers[{index}].fd_index {fd_index} names an fd \
                             this frame did not carry (it carried {fds}); send the memfds as \
                             SCM_RIGHTS with the frame's first byte"
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
    ) -> Immediate {
        let owner_uid = self.conns.get(&to.conn)?.uid;
        if !self.conns.has_room(to.conn, 1) {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        let tenant = self.conns.tenant(to.conn);
        self.watch(to.conn, instance);
        match self.liveness.register(now, instance, module) {
            Registration::Refreshed => {
                self.answer_refresh(to, instance, module);
                None
            }
            Registration::Build(ticket) => {
                let context = ContextId(self.out.next_id());
                let bytes = mapped_bytes(&buffers);
                if let Err(over) = self.doors.mapped.charge(context, tenant, bytes) {
                    // Nothing was built: the entry goes as after a failed build.
                    self.liveness.context_build_failed(now, ticket);
                    self.drain_effects();
                    self.forget_if_gone(instance);
                    self.note(Note::OverMappedCap { instance, over });
                    let code = if over.may_fit_later() {
                        ErrorCode::Overloaded
                    } else {
                        ErrorCode::BadArgs
                    };
                    return Some(Err(ProtocolError::new(
                        code,
                        format!("{}: {over}", to.op.name()),
                    )));
                }
                self.registry.records.insert(
                    (instance, module),
                    EntryDetails {
                        owner_uid,
                        tenant,
                        registered_at: now,
                        model_name: model_name.clone(),
                    },
                );
                self.registry.builds.start(context, ticket, to);
                self.conns.start_job(to.conn, 1);
                self.submit_now(Job::Build {
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
            && self.registry.builds.join(instance, module, to)
        {
            return;
        }
        self.reply_registered(to, module, Outcome::Refreshed);
    }

    /// The reply to a REGISTER that holds: `{outcome}` (engine-driven: with the pool's
    /// geometry and memfd).
    pub(super) fn reply_registered(&mut self, to: ReplyTo, module: Module, outcome: Outcome) {
        let pool = (module == Module::EngineDriven).then(|| PoolGeometry {
            slot_bytes: self.l1.slots.slot_bytes(),
            num_slots: self.l1.slots.num_slots() as u64,
        });
        let answer = Answer::Registered(Registered { outcome, pool });
        self.reply_with(to, Ok(answer), pool.is_some());
    }

    fn unregister(&mut self, now: Instant, instance: InstanceId, module: Module) -> bool {
        let was = self.liveness.unregister(now, instance, module);
        if !was {
            self.note(Note::UnregisterUnknown { instance, module });
        }
        was
    }

    fn register_blend(&mut self, to: ReplyTo, instance: InstanceId, rope: RopeSpec) -> Immediate {
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
            return Some(Ok(Answer::Flag(true)));
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
        let tenant_of = |records: &BTreeMap<(InstanceId, Module), EntryDetails>, id: InstanceId| {
            Module::ALL
                .iter()
                .find_map(|&module| records.get(&(id, module)).map(|record| record.tenant))
        };
        if let Some(tenant) = tenant_of(&self.registry.records, instance) {
            let records = &self.registry.records;
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
                        self.doors.trust.name(tenant),
                        blend::MAX_TENANT_BYTES,
                        blend::MAX_TOTAL_BYTES,
                    ),
                )));
            }
        }
        if !self.conns.has_room(to.conn, 1) {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        let id = BlendId(self.out.next_id());
        self.blend.begin(id, to, instance, rope.clone(), bytes);
        self.conns.start_job(to.conn, 1);
        self.submit_now(Job::Blend {
            blend: id,
            instance,
            spec: rope,
        });
        None
    }
}

/// `prepare_store`'s answer: the slot reserved.
pub(super) fn reserved(grant: SlotGrant) -> Answer {
    Answer::Reserved(Some(ReservedSlot {
        slot: grant.slot as u64,
        offset: grant.offset,
        nbytes: grant.nbytes,
    }))
}

/// `prepare_retrieve`'s answer: the slot pinned.
pub(super) fn pinned(grant: SlotGrant) -> Answer {
    Answer::Pinned(Some(PinnedSlot {
        offset: grant.offset,
        nbytes: grant.nbytes,
    }))
}

pub(super) fn too_many_held(op: &str, instance: InstanceId) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::Overloaded,
        format!(
            "`{op}`: instance {instance} already holds {MAX_HELD_SLOTS_PER_INSTANCE} slots \
             (reservations plus pinned keys) or {MAX_PINS_PER_KEY} pins of this key; commit \
             what it holds, then retry"
        ),
    )
}

/// Bytes of peers' files a registration makes the server map: its memfd buffers' sizes
/// (a CUDA IPC buffer maps device memory its exporter pays for).
fn mapped_bytes(buffers: &[BufferSpec]) -> u64 {
    buffers
        .iter()
        .map(|spec| match spec {
            BufferSpec::Memfd { nbytes, .. } => *nbytes,
            BufferSpec::CudaIpc { .. } => 0,
        })
        .fold(0, u64::saturating_add)
}
