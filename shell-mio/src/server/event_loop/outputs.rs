//! The node's outputs carried out (replies, pool jobs, watches, logs and metrics), and
//! the pool's results and process exits handed back to it.

use super::connections::token_of;
use super::{Done, Server};
use crate::protocol::ErrorCode;
use crate::protocol::ProtocolError;
use crate::server::blend::RopeTables;
use crate::server::closer::PeerFd;
use crate::server::context::{self, BuildRequest};
use crate::server::fault;
use kvwarden_core::InstanceId;
use kvwarden_core::node::ConnId;
use kvwarden_core::node::ContextId;
use kvwarden_core::node::FreeId;
use kvwarden_core::node::Input;
use kvwarden_core::node::Output;
use kvwarden_core::node::l1::SlotId;
use kvwarden_core::node::{BlendChange, Job, L2Request, PeerAction};
use kvwarden_core::node::{Built, CopyId, Direction, Note, ProcessKey};
use kvwarden_core::protocol::{BufferSpec, ReplyValue};
use kvwarden_core::{FreeCause, Module};
use mio::Token;
use rustix::fd::AsFd;
use std::sync::Arc;

fn internal(message: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::Internal, message)
}

impl Server {
    /// Drains the node's outputs, carrying out each; inputs they produced (a job that
    /// could not start) go to the node in turn, until nothing is left.
    pub(super) fn carry_out(&mut self) {
        loop {
            while let Some(output) = self.node.poll_output() {
                self.apply(output);
            }
            let Some(input) = self.inputs.pop_front() else {
                return;
            };
            let now = self.now();
            self.node.handle_input(now, input);
        }
    }

    fn apply(&mut self, output: Output) {
        match output {
            Output::Reply {
                conn,
                request_id,
                op,
                result,
                pool_fd,
            } => match result.map(|answer| answer.to_value()) {
                Ok(value) if pool_fd => {
                    self.reply_with_pool_fd(token_of(conn), request_id, op.name(), value)
                }
                result => self.reply(token_of(conn), request_id, op.name(), result),
            },
            Output::ReplyStatus { conn, request_id } => {
                let status = self.status().to_value();
                self.reply(token_of(conn), request_id, "status", Ok(status));
            }
            Output::Job(job) => self.start(job),
            Output::Blend(change) => self.change_blend(change),
            Output::Peer(action) => self.act_on_peer(action),
            Output::L2(request) => self.l2_request(request),
            Output::Note(note) => self.note(note),
            Output::Publish { stream, events } => self.kv_streams.send(stream, events),
            Output::Stopped {
                contexts_freed,
                frees_unfinished,
            } => {
                tracing::info!(
                    contexts_freed,
                    frees_unfinished,
                    "shutdown complete: freed {contexts_freed} context{}",
                    if contexts_freed == 1 { "" } else { "s" }
                );
                self.stopped = true;
            }
        }
    }

    /// Starts a job off the loop; it reports back through `Done`.
    fn start(&mut self, job: Job) {
        match job {
            Job::Build {
                context,
                conn,
                request_id,
                instance: _,
                module,
                buffers,
                model_name,
            } => {
                let fds = self
                    .fd_stash
                    .remove(&(conn, request_id))
                    .unwrap_or_default();
                self.start_build(context, module, buffers, fds, model_name);
            }
            Job::Copy {
                copy,
                context,
                direction,
                buffer,
                offset,
                slot,
                nbytes,
                not_after,
            } => {
                let not_after = not_after.map(|at| self.clock_of(at));
                let at = CopyAt {
                    buffer,
                    offset,
                    slot,
                    nbytes,
                };
                self.start_copy(copy, context, direction, at, not_after)
            }
            Job::Blend {
                blend,
                instance: _,
                spec,
            } => self.pool.submit(
                move || Done::Blend {
                    blend,
                    result: RopeTables::compute(&spec),
                },
                move |panic| Done::Blend {
                    blend,
                    result: Err(format!("computing the rope tables failed: {panic}")),
                },
            ),
            Job::Free {
                free,
                context,
                instance,
                module,
                cause,
                label,
            } => self.start_free(free, context, instance, module, cause, label),
            Job::Seal { slot, key, len } => self.start_seal(slot, key, len),
            Job::Scan { first, count } => self.start_scan(first, count),
        }
    }

    /// Seals a committed value of a pool file (`--l1-file`, `--l1-fdstore`).
    fn start_seal(&mut self, slot: SlotId, key: Vec<u8>, len: u64) {
        let pool = Arc::clone(self.l1.mapping());
        let seals = self.l1.seals().cloned();
        self.pool.submit(
            move || {
                let written = seals.is_some_and(|seals| seals.seal(&pool, slot, &key, len));
                Done::Sealed { slot, written }
            },
            move |_| Done::Sealed {
                slot,
                written: false,
            },
        );
    }

    /// Scans `count` slots of a pool file from `first` for values to adopt.
    fn start_scan(&mut self, first: SlotId, count: usize) {
        let pool = Arc::clone(self.l1.mapping());
        let seals = self.l1.seals().cloned();
        self.pool.submit(
            move || Done::Scanned {
                first,
                found: match seals {
                    Some(seals) => seals.scan(&pool, first, count),
                    None => vec![kvwarden_core::node::Scanned::Blank; count],
                },
            },
            move |_| Done::Scanned {
                first,
                found: vec![
                    kvwarden_core::node::Scanned::Unsealed(
                        kvwarden_core::seal::Unsealed::Malformed
                    );
                    count
                ],
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn start_copy(
        &mut self,
        copy: CopyId,
        context: ContextId,
        direction: Direction,
        at: CopyAt,
        not_after: Option<std::time::Instant>,
    ) {
        let CopyAt {
            buffer,
            offset,
            slot,
            nbytes,
        } = at;
        let Some(context) = self.contexts.get(&context).cloned() else {
            self.inputs.push_back(Input::CopyDone {
                copy,
                result: Err(internal(format!(
                    "a copy named context {context:?}, which the server does not hold"
                ))),
            });
            return;
        };
        let pool = Arc::clone(self.l1.mapping());
        let slot_offset = self.l1.offset(slot);
        self.pool.submit(
            move || {
                // Started on a pool thread that may have been busy: past the node's
                // deadline the worker has stopped waiting, and its buffer may be reused.
                if not_after.is_some_and(|at| std::time::Instant::now() > at) {
                    return Done::Copied {
                        copy,
                        result: Err(ProtocolError::new(
                            ErrorCode::Overloaded,
                            "the copy into the worker's buffer did not start before the worker \
                             stopped waiting (hello's wait_ms); nothing was written",
                        )),
                    };
                }
                let copied = context
                    .buffers
                    .get(buffer)
                    .is_some_and(|b| match direction {
                        Direction::ToL1 => b.copy_to_l1(offset, &pool, slot_offset, nbytes),
                        Direction::FromL1 => b.copy_from_l1(&pool, slot_offset, offset, nbytes),
                    });
                let result = if copied {
                    Ok(nbytes)
                } else {
                    Err(internal(
                        "a copy between a registered buffer and L1 went out of bounds after \
                         validation"
                            .into(),
                    ))
                };
                Done::Copied { copy, result }
            },
            move |panic| Done::Copied {
                copy,
                result: Err(internal(format!("the copy failed: {panic}"))),
            },
        );
    }

    /// Keeps, discards or drops computed rope tables (dropped off the loop).
    fn change_blend(&mut self, change: BlendChange) {
        let old = match change {
            BlendChange::Keep { blend, instance } => self
                .blends_computed
                .remove(&blend)
                .and_then(|tables| self.blend_tables.insert(instance, tables)),
            BlendChange::Discard { blend } => self.blends_computed.remove(&blend),
            BlendChange::Drop { instance } => self.blend_tables.remove(&instance),
        };
        if let Some(tables) = old {
            self.drop_off_loop(tables);
        }
    }

    /// Watches or unwatches a process, reads a connection without fds, or closes it.
    fn act_on_peer(&mut self, action: PeerAction) {
        match action {
            PeerAction::Watch { process, conn } => self.watch(process, conn),
            PeerAction::Unwatch { process } => {
                self.processes.unwatch(self.poll.registry(), process)
            }
            PeerAction::ReadWithoutFds { conn } => {
                if let Some(connection) = self.connections.get_mut(&token_of(conn))
                    && !connection.promise_no_fds()
                {
                    tracing::debug!(
                        token = conn.0,
                        "this kernel cannot refuse fds to a socket (SO_PASSRIGHTS, Linux \
                         6.16): the connection stays on recvmsg"
                    );
                }
            }
            PeerAction::Disconnect { conn, why, reason } => {
                if reason == "unauthenticated" {
                    tracing::warn!(token = conn.0, "closing a connection: {why}");
                } else {
                    tracing::debug!(token = conn.0, "closing a connection: {why}");
                }
                self.cut("tcp", reason);
                self.close(token_of(conn), why);
            }
        }
    }

    fn watch(&mut self, process: ProcessKey, conn: ConnId) {
        let token = token_of(conn);
        let Some(pidfd) = self
            .connections
            .get(&token)
            .and_then(|connection| connection.peer.pidfd.as_ref())
        else {
            return;
        };
        let next_token = &mut self.next_token;
        let watched = self
            .processes
            .watch(self.poll.registry(), process, pidfd, || {
                let token = Token(*next_token);
                *next_token += 1;
                token
            });
        if let Err(error) = watched {
            let pid = self.processes.pid_of(process);
            tracing::warn!(pid = %shown_pid(pid), %error, "watching a pidfd failed; its instances are left to the heartbeat rules");
        }
    }

    fn l2_request(&mut self, request: L2Request) {
        match request {
            L2Request::Write {
                write,
                key,
                slot,
                nbytes,
            } => self.l2_write(write, key, slot, nbytes),
            L2Request::Get {
                read,
                key,
                slot,
                deliver,
            } => self.l2_get(read, key, slot, deliver),
            L2Request::Cancel { read } => self.l2_cancel(read),
            L2Request::Exists { read, keys } => self.l2_exists(read, keys),
        }
    }

    fn start_build(
        &mut self,
        context: ContextId,
        module: Module,
        buffers: Vec<BufferSpec>,
        fds: Vec<PeerFd>,
        model_name: String,
    ) {
        let delay = self.faults.build_delay();
        let gpu = self.gpu.gpu().ok().cloned();
        let allow_hugetlb = self.config.allow_hugetlb_buffers;
        self.pool.submit(
            move || {
                fault::delay_build(delay); // --fault-build-delay-ms
                // Nothing to map for an engine-driven context, but it is built like any
                // other (off the loop), so that the build-delay fault and a removal
                // during the build behave the same for both modules.
                let result = match module {
                    Module::EngineDriven => Ok(None),
                    Module::ServerDriven => with_fds(buffers, fds)
                        .and_then(|buffers| {
                            context::build(BuildRequest {
                                buffers,
                                model_name,
                                gpu,
                                allow_hugetlb,
                            })
                        })
                        .map(Some),
                };
                Done::Built { context, result }
            },
            move |panic| Done::Built {
                context,
                result: Err(internal(format!("building the context failed: {panic}"))),
            },
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn start_free(
        &mut self,
        free: FreeId,
        context: ContextId,
        instance: InstanceId,
        module: Module,
        cause: FreeCause,
        label: &'static str,
    ) {
        match cause {
            FreeCause::Reaped { silence, proven } => tracing::warn!(
                %instance,
                module = module.label(),
                silence_seconds = silence.as_secs_f64(),
                proven,
                "reaped: silent longer than its window{}",
                if proven { " (reap timeout)" } else { " (registration grace; it never pinged)" }
            ),
            FreeCause::ProcessExited => tracing::warn!(
                %instance,
                module = module.label(),
                "freed: the kernel proved its process exited"
            ),
            FreeCause::Unregistered | FreeCause::Cancelled => {
                tracing::info!(%instance, module = module.label(), cause = label, "freed");
            }
        }
        self.metrics.free(label);
        let context = self.contexts.remove(&context);
        let hang = self.faults.next_free_hang();
        self.pool.submit_detached(
            "kvwarden-free",
            move || {
                if let Some(hang) = hang {
                    hang.block(); // --fault-free-hang-instances: a free that never returns
                }
                drop(context); // unmaps (no copy uses it: the node waited for them)
                Done::Freed { free }
            },
            move |_| Done::Freed { free },
        );
    }

    /// Frees big tables on the pool: returning hundreds of MiB to the allocator can
    /// take longer than a loop turn.
    fn drop_off_loop(&mut self, tables: RopeTables) {
        self.pool.submit(
            move || {
                drop(tables);
                Done::Discarded
            },
            |_| Done::Discarded,
        );
    }

    /// What the node reports, as logs and metrics.
    fn note(&mut self, note: Note) {
        match note {
            Note::ContextBuilt { instance, module } => {
                self.metrics.contexts_built.inc();
                tracing::info!(%instance, module = module.label(), "context built");
            }
            Note::BuildFailed { instance, error } => {
                tracing::warn!(%instance, %error, "building a context failed");
            }
            Note::OverMappedCap { instance, over } => {
                tracing::warn!(%instance, cap = over.label(), "refusing a registration: {over}");
            }
            Note::PoolAdopted(view) => log_pool_adopted(&view),
            Note::Stall { gap } => tracing::warn!(
                gap_seconds = gap.as_secs_f64(),
                "the server itself was stalled (paused or starved); the gap does not count as any worker's silence"
            ),
            Note::ProcessExited { instance, held } => {
                if held {
                    let pid = self.exiting_pid;
                    tracing::info!(pid = %shown_pid(pid), %instance, "process exited; freeing its entries now");
                }
            }
            Note::UnregisterUnknown { instance, module } => {
                let op = match module {
                    Module::ServerDriven => "unregister_kv_cache",
                    Module::EngineDriven => "unregister_engine_driven",
                };
                tracing::warn!(%instance, "{op} of an instance that is not registered here (unknown or already freed)");
            }
            Note::EngineReleased {
                instance,
                label,
                reservations_discarded,
                pins_released,
            } => tracing::info!(
                %instance,
                cause = label,
                reservations_discarded,
                pins_released,
                "engine-driven context freed: unpublished reservations discarded, pins released"
            ),
            Note::FreeHung {
                instance,
                module,
                watchdog,
            } => {
                self.metrics.frees_hung.inc();
                tracing::error!(
                    %instance,
                    module = module.label(),
                    watchdog_seconds = watchdog.as_secs_f64(),
                    "a context free is still running after the watchdog period; pings and other frees go on"
                );
            }
            Note::FreeFinishedLate {
                instance,
                module,
                after,
            } => tracing::warn!(
                %instance,
                module = module.label(),
                seconds = after.as_secs_f64(),
                "a free that exceeded the watchdog finished at last"
            ),
            Note::BlendHeld { instance, bytes } => {
                tracing::info!(%instance, bytes, "CacheBlend rope tables held");
            }
            Note::BlendDropped { instance, bytes } => {
                tracing::info!(%instance, bytes, "CacheBlend rope tables dropped");
            }
            Note::ShutdownStarted => {}
            Note::L2StateChanged { from, to } => self.l2_state_changed(from, to),
        }
    }

    /// Hands the pool's results to the node.
    pub(super) fn take_completions(&mut self) {
        let done = self.pool.completions().drain();
        for item in done {
            let input = match item {
                Done::Built { context, result } => Input::BuildDone {
                    context,
                    result: result.map(|built| match built {
                        Some(built) => {
                            let buffer_lens = built.buffers.iter().map(|b| b.len()).collect();
                            self.contexts.insert(context, Arc::new(built));
                            Built::ServerDriven { buffer_lens }
                        }
                        None => Built::EngineDriven,
                    }),
                },
                Done::Copied { copy, result } => Input::CopyDone { copy, result },
                Done::Blend { blend, result } => Input::BlendDone {
                    blend,
                    result: result.map(|tables| {
                        self.blends_computed.insert(blend, tables);
                    }),
                },
                Done::Freed { free } => Input::FreeDone { free },
                Done::L2Placed { read, fetched } => Input::L2Got { read, fetched },
                Done::Sealed { slot, written } => Input::Sealed { slot, written },
                Done::Scanned { first, found } => Input::Scanned { first, found },
                Done::Discarded => continue,
            };
            self.input(input);
        }
        self.take_l2_completions();
    }

    /// A watched pidfd turned readable: the kernel proved that process exited.
    pub(super) fn on_process_exit(&mut self, token: Token) {
        let Some(process) = self.processes.watched_by(token) else {
            return;
        };
        self.exiting_pid = self.processes.pid_of(process);
        self.input(Input::ProcessExited { process });
        self.exiting_pid = None;
        // The node unwatches it; should it not, the pidfd stays readable for nothing.
        self.processes.unwatch(self.poll.registry(), process);
    }
}

/// Pairs each buffer sent as an fd (memfd, CUDA VMM) with its fd from the frame (a duplicate where two buffers
/// name the same one).
fn with_fds(
    buffers: Vec<BufferSpec>,
    fds: Vec<PeerFd>,
) -> Result<Vec<(BufferSpec, Option<PeerFd>)>, ProtocolError> {
    let mut paired = Vec::with_capacity(buffers.len());
    for (index, spec) in buffers.into_iter().enumerate() {
        let fd = match spec.fd_index() {
            Some(fd_index) => {
                let fd = usize::try_from(fd_index).ok().and_then(|i| fds.get(i));
                let Some(fd) = fd else {
                    return Err(internal(format!(
                        "register_kv_cache: buffers[{index}].fd_index {fd_index} reached the \
                         build without its fd"
                    )));
                };
                let copy = fd.as_fd().try_clone_to_owned().map_err(|e| {
                    internal(format!(
                        "register_kv_cache: duplicating buffers[{index}]'s fd failed: {e}"
                    ))
                })?;
                Some(PeerFd::new(copy))
            }
            None => None,
        };
        paired.push((spec, fd));
    }
    Ok(paired)
}

/// A watched process's pid for a log line: the number, or `unknown` for one the server
/// cannot see (another PID namespace).
fn shown_pid(pid: Option<i32>) -> String {
    pid.map_or_else(|| "unknown".to_string(), |pid| pid.to_string())
}

/// Where a copy goes: a buffer of the context, an offset in it, an L1 slot, a length.
struct CopyAt {
    buffer: usize,
    offset: u64,
    slot: SlotId,
    nbytes: u64,
}

/// The adoption of a restarted server's pool file, done: what was served again and what
/// dropped, and how long it took.
fn log_pool_adopted(view: &kvwarden_core::node::AdoptionView) {
    let seconds = view
        .finished
        .unwrap_or(view.started)
        .saturating_duration_since(view.started)
        .as_secs_f64();
    tracing::info!(
        adopted = view.adopted,
        adopted_bytes = view.adopted_bytes,
        dropped_torn = view.dropped_torn,
        dropped_malformed = view.dropped_malformed,
        dropped_tenant = view.dropped_tenant,
        dropped_duplicate = view.dropped_duplicate,
        dropped_taken = view.dropped_taken,
        seconds,
        "L1 pool adopted: {} values served again, {} dropped",
        view.adopted,
        view.dropped()
    );
}
