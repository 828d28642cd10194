//! Engine-driven requests: registration hands the worker the L1 pool's memfd; the
//! worker then reserves, writes and publishes slots (`prepare_store`/`commit_store`)
//! and pins and reads them (`prepare_retrieve`/`commit_retrieve`) itself. Every
//! prepare/commit is a transfer for the core (it refreshes liveness); the reservations
//! and pins are the instance's context, released when the core frees it (row 21).

use super::*;
use crate::server::context::EngineDrivenContext;
use crate::server::engine_driven::{
    CommitStore, MAX_HELD_SLOTS_PER_INSTANCE, MAX_PINS_PER_KEY, PrepareRetrieve, PrepareStore,
    SlotGrant,
};
use crate::server::fault;

type Answer = Option<Result<Value, ProtocolError>>;

impl Server {
    pub(super) fn register_engine_driven(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        model_name: String,
    ) -> Answer {
        let connection = self.connections.get(&reply.token)?;
        if !matches!(connection.stream, Stream::Unix(_)) {
            return Some(Err(ProtocolError::new(
                ErrorCode::BadArgs,
                "register_engine_driven: the L1 pool's memfd travels only over the Unix \
                 socket (SCM_RIGHTS), and this connection is TCP; connect over the Unix \
                 socket, or use register_kv_cache with store/retrieve over TCP",
            )));
        }
        if connection.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(overloaded_connection()));
        }
        let peer_uid = connection.peer.uid;
        let now = self.now();
        self.watch_peer(reply.token, instance);
        match self.liveness.register(now, instance, Module::EngineDriven) {
            Registration::Refreshed => {
                self.answer_refresh(reply, instance, Module::EngineDriven);
                None
            }
            Registration::Build(ticket) => {
                self.records.insert(
                    (instance, Module::EngineDriven),
                    Record {
                        owner_uid: peer_uid,
                        registered_at: now,
                        model_name: model_name.clone(),
                    },
                );
                let delay = self.faults.build_delay();
                self.start_job(reply.token);
                // Nothing to map or open, but the context is built like any other (off
                // the loop, through the core's two phases), so that the build-delay
                // fault and a removal during the build behave the same for both modules.
                self.pool.submit(move || {
                    fault::delay_build(delay);
                    Done::Built {
                        ticket,
                        reply,
                        result: Ok(Context::EngineDriven(EngineDrivenContext::new(model_name))),
                    }
                });
                None
            }
        }
    }

    /// The registration reply: outcome, slot geometry, and the pool's memfd as
    /// `SCM_RIGHTS` (on `refreshed` too: a recovering worker may have lost its mapping).
    pub(super) fn reply_engine_registration(&mut self, reply: ReplyTo, outcome: &str) {
        let fd = match self.l1.pool_fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(error) => {
                let error = ProtocolError::new(
                    ErrorCode::Internal,
                    format!(
                        "register_engine_driven: duplicating the L1 pool's fd failed ({error}); \
                         the server may be out of file descriptors; retry later"
                    ),
                );
                self.reply(reply.token, reply.request_id, reply.op, Err(error));
                return;
            }
        };
        let value = Value::Map(vec![
            ("outcome".into(), outcome.into()),
            ("slot_bytes".into(), self.l1.slot_bytes().into()),
            ("num_slots".into(), (self.l1.num_slots() as u64).into()),
            ("pool_fd_index".into(), 0u64.into()),
        ]);
        let bytes = encode_reply(reply.request_id, &Ok(value));
        let Some(connection) = self.connections.get_mut(&reply.token) else {
            return; // the peer left; the fd closes here
        };
        if !connection.has_room_for_fd_reply() {
            // Replies pipelined within one loop turn: send what the socket takes now,
            // so that only a peer that does not read is ever cut off.
            if let Err(error) = connection.flush() {
                self.close(reply.token, &format!("write failed: {error}"));
                return;
            }
        }
        let Some(connection) = self.connections.get_mut(&reply.token) else {
            return;
        };
        if connection.queue_with_fds(&bytes, vec![fd]) {
            self.dirty.insert(reply.token);
        } else {
            tracing::warn!(
                token = reply.token.0,
                "disconnecting a peer that does not read its replies (output buffer or \
                 pool-fd replies queued full)"
            );
            self.close(reply.token, "output full");
        }
    }

    pub(super) fn unregister_engine_driven(&mut self, instance: InstanceId) -> Answer {
        let now = self.now();
        let was = self
            .liveness
            .unregister(now, instance, Module::EngineDriven);
        if !was {
            tracing::warn!(%instance, "unregister_engine_driven of an instance that is not registered here (unknown or already freed)");
        }
        Some(Ok(was.into()))
    }

    /// The engine-driven context of a prepare/commit, refreshing the instance's liveness.
    fn engine_transfer(
        &mut self,
        instance: InstanceId,
        op: &str,
    ) -> Result<Arc<Context>, ProtocolError> {
        let now = self.now();
        match self.liveness.transfer(now, instance, Module::EngineDriven) {
            Ok(context) => Ok(Arc::clone(context)),
            Err(TransferError::NotRegistered) => Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                format!(
                    "`{op}`: instance {instance} is not registered for engine-driven transfers \
                     here; re-register it (register_engine_driven) and retry"
                ),
            )),
            Err(TransferError::NotReady) => Err(ProtocolError::new(
                ErrorCode::NotReady,
                format!("`{op}`: instance {instance} is still being registered; retry shortly"),
            )),
        }
    }

    /// Runs `step` on the instance's transfer strategy and the L1 pool.
    fn with_strategy<T>(
        &mut self,
        instance: InstanceId,
        op: &str,
        step: impl FnOnce(&mut crate::server::engine_driven::TransferStrategy, &mut L1) -> T,
    ) -> Result<T, ProtocolError> {
        let context = self.engine_transfer(instance, op)?;
        let Some(engine) = context.engine_driven() else {
            return Err(ProtocolError::new(
                ErrorCode::Internal,
                format!("`{op}`: instance {instance}'s engine-driven entry holds another context"),
            ));
        };
        let mut strategy = engine.strategy();
        Ok(step(&mut strategy, &mut self.l1))
    }

    pub(super) fn prepare_store(&mut self, instance: InstanceId, key: &[u8]) -> Answer {
        let prepared = self.with_strategy(instance, "prepare_store", |strategy, l1| {
            strategy.prepare_store(l1, key)
        });
        Some(match prepared {
            Err(error) => Err(error),
            Ok(PrepareStore::Reserved(grant)) => Ok(grant_value(grant, true)),
            Ok(PrepareStore::AlreadyStored) => Ok(Value::Nil),
            Ok(PrepareStore::PoolFull) => Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "`prepare_store`: every one of the {} L1 slots is reserved or pinned; \
                     commit what you prepared and retry later",
                    self.l1.num_slots()
                ),
            )),
            Ok(PrepareStore::TooManyHeld) => Err(too_many_held("prepare_store", instance)),
        })
    }

    pub(super) fn commit_store(&mut self, instance: InstanceId, key: &[u8], nbytes: u64) -> Answer {
        let committed = self.with_strategy(instance, "commit_store", |strategy, l1| {
            strategy.commit_store(l1, key, nbytes)
        });
        Some(match committed {
            Err(error) => Err(error),
            Ok(CommitStore::Published) => Ok(true.into()),
            Ok(CommitStore::NotReserved) => {
                tracing::debug!(%instance, "commit_store of a key this instance has not reserved");
                Ok(false.into())
            }
            Ok(CommitStore::TooLarge { nbytes, slot_bytes }) => Err(ProtocolError::new(
                ErrorCode::BadArgs,
                format!(
                    "`commit_store`: nbytes {nbytes} is larger than an L1 slot ({slot_bytes} \
                     bytes); commit at most one slot (the reservation is kept)"
                ),
            )),
        })
    }

    pub(super) fn prepare_retrieve(&mut self, instance: InstanceId, key: &[u8]) -> Answer {
        let prepared = self.with_strategy(instance, "prepare_retrieve", |strategy, l1| {
            strategy.prepare_retrieve(l1, key)
        });
        Some(match prepared {
            Err(error) => Err(error),
            Ok(PrepareRetrieve::Pinned(grant)) => Ok(grant_value(grant, false)),
            Ok(PrepareRetrieve::Miss) => Ok(Value::Nil),
            Ok(PrepareRetrieve::TooManyHeld) => Err(too_many_held("prepare_retrieve", instance)),
        })
    }

    pub(super) fn commit_retrieve(&mut self, instance: InstanceId, key: &[u8]) -> Answer {
        let committed = self.with_strategy(instance, "commit_retrieve", |strategy, l1| {
            strategy.commit_retrieve(l1, key)
        });
        Some(committed.map(Value::from))
    }

    /// A context is being freed: an engine-driven one gives back its reservations
    /// (discarded, never published) and pins now, on the loop, whatever becomes of the
    /// rest of the free.
    pub(super) fn release_transfer_strategy(
        &mut self,
        instance: InstanceId,
        context: &Context,
        cause: &str,
    ) {
        let Some(engine) = context.engine_driven() else {
            return;
        };
        let released = engine.strategy().release(&mut self.l1);
        if released.reservations_discarded > 0 || released.pins_released > 0 {
            tracing::info!(
                %instance,
                cause,
                reservations_discarded = released.reservations_discarded,
                pins_released = released.pins_released,
                "engine-driven context freed: unpublished reservations discarded, pins released"
            );
        }
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

fn overloaded_connection() -> ProtocolError {
    ProtocolError::new(
        ErrorCode::Overloaded,
        format!(
            "this connection already has {MAX_IN_FLIGHT_PER_CONNECTION} requests running; wait \
             for replies before sending more"
        ),
    )
}
