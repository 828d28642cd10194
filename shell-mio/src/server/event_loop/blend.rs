//! `register_blend`: CacheBlend rope tables computed on the context pool, held per
//! instance, dropped with the instance's last entry (`Effect::DropBlendState`).

use super::*;
use crate::protocol::RopeSpec;
use crate::server::blend::{self, BlendTicket, Finished, RopeTables};

impl Server {
    pub(super) fn register_blend(
        &mut self,
        reply: ReplyTo,
        instance: InstanceId,
        rope: RopeSpec,
    ) -> Option<Result<Value, ProtocolError>> {
        let bytes = match blend::table_bytes(&rope) {
            Ok(bytes) => bytes,
            Err(message) => {
                return Some(Err(ProtocolError::new(
                    ErrorCode::BadArgs,
                    format!("`register_blend`: {message}"),
                )));
            }
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
        if self.connections.get(&reply.token)?.in_flight >= MAX_IN_FLIGHT_PER_CONNECTION {
            return Some(Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "this connection already has {MAX_IN_FLIGHT_PER_CONNECTION} requests \
                     running; wait for replies before sending more"
                ),
            )));
        }
        let ticket = self.blend.begin(instance, bytes);
        self.start_job(reply.token);
        self.pool.submit(move || Done::BlendComputed {
            reply,
            ticket,
            result: RopeTables::compute(&rope),
        });
        None
    }

    pub(super) fn on_blend_computed(
        &mut self,
        reply: ReplyTo,
        ticket: BlendTicket,
        result: Result<RopeTables, String>,
    ) {
        self.end_job(reply.token);
        let instance = ticket.instance();
        let answer = match result {
            Err(message) => {
                self.blend.abandon(ticket);
                Err(ProtocolError::new(
                    ErrorCode::Unavailable,
                    format!("`register_blend`: {message}"),
                ))
            }
            Ok(tables) => match self.blend.finish(ticket, tables) {
                Finished::Installed { replaced } => {
                    tracing::info!(
                        %instance,
                        bytes = self.blend.bytes_of(instance),
                        "CacheBlend rope tables held"
                    );
                    if let Some(old) = replaced {
                        self.drop_off_loop(old);
                    }
                    Ok(true.into())
                }
                Finished::Superseded(tables) => {
                    self.drop_off_loop(tables);
                    Ok(true.into())
                }
                Finished::Freed(tables) => {
                    self.drop_off_loop(tables);
                    Err(ProtocolError::new(
                        ErrorCode::NotRegistered,
                        format!(
                            "`register_blend`: instance {instance} was freed (unregistered, \
                             reaped or its process exited) while its rope tables were \
                             computed; register again"
                        ),
                    ))
                }
            },
        };
        self.reply(reply.token, reply.request_id, reply.op, answer);
    }

    /// `Effect::DropBlendState`: the instance has no entry left in any module.
    pub(super) fn drop_blend_state(&mut self, instance: InstanceId) {
        if let Some(tables) = self.blend.drop_instance(instance) {
            tracing::info!(%instance, bytes = tables.bytes(), "CacheBlend rope tables dropped");
            self.drop_off_loop(tables);
        }
    }

    /// Frees big tables on the pool: returning hundreds of MiB to the allocator can
    /// take longer than a loop turn.
    fn drop_off_loop(&mut self, tables: RopeTables) {
        self.pool.submit(move || {
            drop(tables);
            Done::Discarded
        });
    }
}
