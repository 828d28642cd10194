//! Requests: who is who first (the doors, [`super::trust`]), then one decision per op;
//! REGISTER, UNREGISTER and `register_blend` are `register.rs`'s.
//!
//! Evidence of life: every request of an instance's owner that names a tracked
//! instance refreshes it, whether it is acted on or refused for its arguments or the
//! connection's load (the worker's process sent it). A request the trust component
//! refuses (`forbidden`: not attached, not authenticated) never does.

use super::engine::{MAX_HELD_SLOTS_PER_INSTANCE, MAX_PINS_PER_KEY, SlotGrant};
use crate::node::{
    ConnId, DeathNotice, Node, Output, PeerAction, PlantedBug, ReplyTo, TenantId, Transport, trust,
};
use crate::protocol::{Answer, Op, OpKind, ProtocolError};
use crate::time::Instant;
use crate::{InstanceId, Module};
use std::time::Duration;

/// Where a retrieve wants its bytes: exactly `nbytes` at `offset` of `buffer`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Want {
    pub(super) buffer: u64,
    pub(super) offset: u64,
    pub(super) nbytes: u64,
}
use crate::protocol::{
    ErrorCode, HelloReply, MAX_KV_EVENTS, MAX_META_BYTES, PROTOCOL_VERSION, PinnedSlot,
    ReservedSlot,
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
        if to.op == OpKind::Ping {
            self.counters.ping_received(); // `pings_total`: admitted or not
        }
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
        self.doors
            .pass(to.conn, connection, &op, to.op.name(), trust_any)
            .map_err(Some)?;
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
                .map(|(key, meta)| {
                    let held = self.l1.slots.describe(&key, meta);
                    if let Some(meta) = self.l1.slots.meta_of(&key).filter(|_| held) {
                        self.events.described(&key, meta);
                    }
                    held
                })
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

    fn ping(&mut self, now: Instant, instance: Option<InstanceId>) -> bool {
        let tracked = if self.planted(PlantedBug::IgnorePings) {
            true
        } else {
            self.liveness.ping(now, instance)
        };
        self.counters.ping_answered(tracked);
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
