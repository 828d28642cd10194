//! Pool results and the core's effects: built contexts, frees (with their watchdog),
//! process exits.

use super::*;

impl Server {
    // ---------------------------------------------------------------- pool results

    pub(super) fn take_completions(&mut self) {
        let done = self.pool.completions().drain();
        for item in done {
            match item {
                Done::Built {
                    ticket,
                    reply,
                    result,
                } => self.on_built(ticket, reply, result),
                Done::Freed { free_id } => {
                    if let Some(free) = self.frees.remove(&free_id)
                        && free.reported
                    {
                        tracing::warn!(
                            instance = %free.instance,
                            module = free.module.label(),
                            seconds = free.started.elapsed().as_secs_f64(),
                            "a free that exceeded the watchdog finished at last"
                        );
                    }
                }
                Done::Stored {
                    reply,
                    slot,
                    copied,
                } => {
                    self.end_job(reply.token);
                    let result = match copied {
                        Ok(nbytes) => {
                            self.l1.commit(slot, nbytes);
                            Ok(true.into())
                        }
                        Err(error) => {
                            self.l1.abort(slot);
                            Err(error)
                        }
                    };
                    self.reply(reply.token, reply.request_id, reply.op, result);
                }
                Done::Retrieved {
                    reply,
                    slot,
                    copied,
                } => {
                    self.end_job(reply.token);
                    self.l1.unpin(slot);
                    self.reply(
                        reply.token,
                        reply.request_id,
                        reply.op,
                        copied.map(Value::from),
                    );
                }
                Done::BatchStored(done) => self.on_batch_stored(done),
                Done::BatchRetrieved(done) => self.on_batch_retrieved(done),
                Done::BlendComputed {
                    reply,
                    ticket,
                    result,
                } => self.on_blend_computed(reply, ticket, result),
                Done::Discarded => {}
            }
        }
    }

    pub(super) fn on_built(
        &mut self,
        ticket: BuildTicket,
        reply: ReplyTo,
        result: Result<Context, ProtocolError>,
    ) {
        self.end_job(reply.token);
        let now = self.now();
        let (instance, module) = (ticket.instance(), ticket.module());
        let answer = match result {
            Ok(context) => {
                self.metrics.contexts_built.inc();
                self.liveness.context_built(now, ticket, Arc::new(context));
                match self.liveness.entry(instance, module) {
                    Some(entry) if !entry.building => {
                        tracing::info!(%instance, module = module.label(), "context built");
                        Ok(Value::Map(vec![("outcome".into(), "created".into())]))
                    }
                    _ => Err(ProtocolError::new(
                        ErrorCode::NotRegistered,
                        format!(
                            "instance {instance} was removed (unregistered, reaped or its process \
                             exited) while its context was being built; register again"
                        ),
                    )),
                }
            }
            Err(error) => {
                tracing::warn!(%instance, %error, "building a context failed");
                self.liveness.context_build_failed(now, ticket);
                Err(error)
            }
        };
        self.forget_if_gone(instance);
        let waiting = self
            .refreshes_waiting
            .remove(&(instance, module))
            .unwrap_or_default();
        for refresh in waiting {
            match &answer {
                Ok(_) => self.reply_refreshed(refresh, module),
                Err(error) => {
                    let error = ProtocolError::new(
                        ErrorCode::NotRegistered,
                        format!(
                            "instance {instance} is not registered: the registration this one \
                             joined while it was being built failed ({}); register again",
                            error.message
                        ),
                    );
                    self.reply(refresh.token, refresh.request_id, refresh.op, Err(error));
                }
            }
        }
        if module == Module::EngineDriven && answer.is_ok() {
            self.reply_engine_registration(reply, "created");
        } else {
            self.reply(reply.token, reply.request_id, reply.op, answer);
        }
    }

    /// Answers a REGISTER that refreshed a present entry: now when the entry is built,
    /// else once its build is done (it may yet fail).
    pub(super) fn answer_refresh(&mut self, reply: ReplyTo, instance: InstanceId, module: Module) {
        if self
            .liveness
            .entry(instance, module)
            .is_some_and(|entry| entry.building)
        {
            self.refreshes_waiting
                .entry((instance, module))
                .or_default()
                .push(reply);
            return;
        }
        self.reply_refreshed(reply, module);
    }

    fn reply_refreshed(&mut self, reply: ReplyTo, module: Module) {
        match module {
            Module::EngineDriven => self.reply_engine_registration(reply, "refreshed"),
            Module::ServerDriven => self.reply(
                reply.token,
                reply.request_id,
                reply.op,
                Ok(Value::Map(vec![("outcome".into(), "refreshed".into())])),
            ),
        }
    }

    // ---------------------------------------------------------------- effects

    pub(super) fn drain_effects(&mut self) {
        while let Some(effect) = self.liveness.poll_effect() {
            match effect {
                Effect::FreeContext {
                    instance,
                    module,
                    context,
                    cause,
                } => self.free(instance, module, context, cause),
                Effect::DropBlendState { instance } => {
                    self.drop_blend_state(instance);
                    self.forget_if_gone(instance);
                }
                Effect::StallDetected { gap } => {
                    tracing::warn!(
                        gap_seconds = gap.as_secs_f64(),
                        "the server itself was stalled (paused or starved); the gap does not count as any worker's silence"
                    );
                }
            }
        }
    }

    pub(super) fn free(
        &mut self,
        instance: InstanceId,
        module: Module,
        context: Arc<Context>,
        cause: FreeCause,
    ) {
        let label = if self.shutdown.is_some() && cause == FreeCause::Unregistered {
            "shutdown"
        } else {
            cause.label()
        };
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
        if self.shutdown.is_some() {
            self.freed_at_shutdown += 1;
        }
        self.forget_if_gone(instance);
        self.release_transfer_strategy(instance, &context, label);
        let free_id = self.next_free_id;
        self.next_free_id += 1;
        self.frees.insert(
            free_id,
            FreeWatch {
                instance,
                module,
                started: std::time::Instant::now(),
                reported: false,
            },
        );
        let hang = self.faults.next_free_hang();
        self.pool.submit_detached("kvwarden-free", move || {
            if let Some(hang) = hang {
                hang.block(); // --fault-free-hang-instances: a free that never returns
            }
            drop(context); // unmaps, unless a transfer still holds it: then when it ends
            Done::Freed { free_id }
        });
    }

    /// Drops the shell's records of an instance's entries that the core no longer holds.
    pub(super) fn forget_if_gone(&mut self, instance: InstanceId) {
        let mut any = false;
        for module in Module::ALL {
            if self.liveness.entry(instance, module).is_none() {
                self.records.remove(&(instance, module));
            } else {
                any = true;
            }
        }
        if !any {
            self.watches.forget(self.poll.registry(), instance);
        }
    }

    pub(super) fn on_process_exit(&mut self, token: Token) {
        let Some((pid, instances)) = self.watches.exited(self.poll.registry(), token) else {
            return;
        };
        let now = self.now();
        for instance in instances {
            if self.liveness.process_exited(now, instance) {
                tracing::info!(?pid, %instance, "process exited; freeing its entries now");
            }
        }
        self.drain_effects();
    }

    pub(super) fn check_free_watchdog(&mut self) {
        let watchdog = self.config.free_watchdog;
        for free in self.frees.values_mut() {
            if !free.reported && free.started.elapsed() > watchdog {
                free.reported = true;
                self.metrics.frees_hung.inc();
                tracing::error!(
                    instance = %free.instance,
                    module = free.module.label(),
                    watchdog_seconds = watchdog.as_secs_f64(),
                    "a context free is still running after the watchdog period; pings and other frees go on"
                );
            }
        }
    }
}
