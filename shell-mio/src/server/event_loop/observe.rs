//! What operators see: the HTTP listener, `/status`, `/metrics`.

use super::*;
use crate::protocol::PROTOCOL_VERSION;
use crate::server::status::{
    AdoptionStatus, BlendStatus, ContextsStatus, DeathNoticeCounts, FreedTotals, InstanceStatus,
    L1Status, L2StatusReport, LimitsStatus, LivenessStatus, MAX_LISTED, MappedStatus, StatusReport,
    TenantStatusReport, TransfersStatus, TrustStatus,
};
use kvwarden_core::node::NodeStatus;

impl Server {
    // ---------------------------------------------------------------- http

    pub(super) fn accept_http(&mut self) {
        loop {
            let Some(listener) = &self.http_listener else {
                return;
            };
            match listener.accept() {
                Ok((mut stream, _)) => {
                    if self.http_connections.len() >= MAX_HTTP_CONNECTIONS {
                        self.make_room_for_http();
                    }
                    let token = self.token();
                    let interest = Interest::READABLE | Interest::WRITABLE;
                    if self
                        .poll
                        .registry()
                        .register(&mut stream, token, interest)
                        .is_ok()
                    {
                        self.http_connections
                            .insert(token, HttpConnection::new(stream));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the HTTP socket failed");
                    return;
                }
            }
        }
    }

    /// A full HTTP listener and a new connection (rows 42 and 66): first every request
    /// that has arrived is read and answered (a probe's request waiting in the kernel
    /// is served, not closed); then, if still full, one connection goes, never the
    /// newcomer: one that sent nothing before one whose answer its peer does not read,
    /// before one with part of a request pending, the oldest first within each.
    /// Counted in `kvwarden_connections_cut_total{transport="http",
    /// reason="listener_full"}`; the WARNING is at most one per 10 s, with the count.
    fn make_room_for_http(&mut self) {
        let tokens: Vec<Token> = self.http_connections.keys().copied().collect();
        for token in tokens {
            self.on_http(token);
        }
        if self.http_connections.len() < MAX_HTTP_CONNECTIONS {
            return;
        }
        let victim = self
            .http_connections
            .iter()
            .min_by_key(|(_, connection)| (connection.pending_rank(), connection.accepted))
            .map(|(token, _)| *token);
        let Some(victim) = victim else {
            return;
        };
        self.cut("http", "listener_full");
        self.close_http(victim);
        self.http_full_unlogged += 1;
        let now = std::time::Instant::now();
        if self
            .http_full_logged_at
            .is_none_or(|at| now.duration_since(at) >= HTTP_FULL_LOG_EVERY)
        {
            tracing::warn!(
                max_http_connections = MAX_HTTP_CONNECTIONS,
                closed = self.http_full_unlogged,
                "HTTP listener full: closed connections that had sent no request (or the \
                 oldest pending) to make room; repeated at most every 10 s"
            );
            self.http_full_unlogged = 0;
            self.http_full_logged_at = Some(now);
        }
    }

    pub(super) fn on_http(&mut self, token: Token) {
        let Some(connection) = self.http_connections.get_mut(&token) else {
            return;
        };
        let routed = match connection.read() {
            Err(_) => {
                self.close_http(token);
                return;
            }
            Ok(routed) => routed,
        };
        let response = routed.map(|routed| {
            let response = match routed.route {
                Route::Status => Response {
                    code: 200,
                    reason: "OK",
                    content_type: "application/json",
                    body: if self.http_is_loopback {
                        self.status().to_json_pretty()
                    } else {
                        self.status().without_local_identities().to_json_pretty()
                    },
                },
                Route::Metrics => {
                    self.refresh_metrics();
                    let (content_type, body) = if routed.openmetrics {
                        (
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            self.metrics.encode(),
                        )
                    } else {
                        (
                            "text/plain; version=0.0.4; charset=utf-8",
                            self.metrics.encode_classic(),
                        )
                    };
                    Response {
                        code: 200,
                        reason: "OK",
                        content_type,
                        body: body.into_bytes(),
                    }
                }
                Route::Healthz => Response::text(200, "OK", "ok\n"),
                Route::Other(response) => response,
            };
            (response, routed.head)
        });
        let Some(connection) = self.http_connections.get_mut(&token) else {
            return;
        };
        if let Some((response, head)) = response {
            connection.answer(&response, head);
        }
        match connection.flush() {
            Ok(true) | Err(_) => self.close_http(token),
            Ok(false) => {}
        }
    }

    pub(super) fn close_http(&mut self, token: Token) {
        if let Some(mut connection) = self.http_connections.remove(&token) {
            let _ = self.poll.registry().deregister(&mut connection.stream);
        }
    }

    // ---------------------------------------------------------------- status

    pub(super) fn refresh_metrics(&self) {
        let node = self.node.status();
        let status = &node.liveness;
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics
            .tracked_instances
            .set(as_i64(status.tracked_entries as u64));
        Metrics::mirror(&self.metrics.reaps, status.reaped_total);
        Metrics::mirror(&self.metrics.process_exits, status.process_exits_total);
        Metrics::mirror(&self.metrics.stalls, status.stalls_total);
        Metrics::mirror(
            &self.metrics.pings_answered_false,
            node.pings_answered_false_total,
        );
        let (total, used, reserved, pinned) = node.l1_slots;
        self.metrics.l1(used, total);
        self.metrics.l1_held(reserved, pinned);
        if let Some(adoption) = &node.l1_adoption {
            self.metrics.l1_adoption(adoption);
        }
        Metrics::mirror(&self.metrics.l1_unsealed, node.l1_unsealed_total);
        Metrics::mirror(
            &self.metrics.kv_events_resyncs,
            node.kv_events.resyncs_total,
        );
        let (blend_bytes, blend_instances, _) = node.blend;
        self.metrics.blend_bytes.set(as_i64(blend_bytes));
        self.metrics
            .blend_instances
            .set(as_i64(blend_instances as u64));
        self.metrics.gpu_memory(&self.gpu.memory_samples());
        for (notice, count) in death_notice_counts(&node) {
            self.metrics
                .instances_by_death_notice(notice.label(), as_i64(count as u64));
        }
        if let (Some(metrics), Some(l2)) = (&self.metrics.l2, &node.l2) {
            metrics.mirror(l2.state.as_str(), &l2.counters);
        }
        Metrics::mirror(&self.metrics.forbidden, node.forbidden_total);
        self.metrics.mapped_bytes.set(as_i64(node.mapped_bytes));
        Metrics::mirror(&self.metrics.mapped_refused, node.mapped_refused_total);
        Metrics::mirror(
            &self.metrics.copies_past_deadline,
            node.copies_past_deadline_total,
        );
        self.metrics
            .closes_pending
            .set(as_i64(crate::server::closer::pending() as u64));
        Metrics::mirror(
            &self.metrics.retrieve_length_mismatches,
            node.retrieve_length_mismatches,
        );
        self.metrics.tenants(
            node.tenants
                .iter()
                .map(|t| (t.view.name.as_str(), t.slots_used, t.quota_slots)),
        );
    }

    pub(super) fn status(&self) -> StatusReport {
        let node = self.node.status();
        let (instances, instances_omitted) = self.instances_report(&node);
        let (tenants, tenants_omitted) = tenants_report(&node);
        let counts = death_notice_counts(&node);
        let count_of = |notice: peer::DeathNotice| {
            counts
                .iter()
                .find(|(kind, _)| *kind == notice)
                .map_or(0, |(_, count)| *count)
        };
        let (bytes_total, blend_instances, computing) = node.blend;
        StatusReport {
            server: SERVER_NAME,
            protocol: PROTOCOL_VERSION,
            boot_id: self.boot_id,
            uptime_seconds: self.clock_origin.elapsed().as_secs_f64(),
            worker_liveness: self.liveness_report(&node),
            contexts: self.contexts_report(&node),
            l1: self.l1_report(&node),
            blend: BlendStatus {
                bytes_total,
                instances: blend_instances,
                computing,
            },
            gpu: self.gpu.status(),
            connections: self.connections.len(),
            limits: LimitsStatus {
                open_files_soft: self.fd_limit.soft,
                open_files_hard: self.fd_limit.hard,
                connection_capacity: self.fd_limit.connection_capacity(),
                max_connections: self.config.max_connections,
                closes_pending: crate::server::closer::pending(),
            },
            mapped: MappedStatus {
                bytes: node.mapped_bytes,
                max_bytes: node.mapped_limits.total_bytes,
                max_bytes_per_tenant: node.mapped_limits.per_tenant_bytes,
                max_bytes_per_instance: node.mapped_limits.per_instance_bytes,
                refused_total: node.mapped_refused_total,
            },
            transfers: TransfersStatus {
                copies_past_deadline_total: node.copies_past_deadline_total,
                pool_window: node.pool_window,
                pool_running: node.pool_running,
                pool_waiting: node.pool_waiting,
                pool_handed_out_total: node.pool_handed_out_total,
            },
            watched_processes: node.watched_processes,
            instances_by_death_notice: DeathNoticeCounts {
                pidfd_from_peer: count_of(peer::DeathNotice::PidfdFromPeer),
                pidfd_by_pid: count_of(peer::DeathNotice::PidfdByPid),
                timeout_only: count_of(peer::DeathNotice::TimeoutOnly),
            },
            instances,
            instances_omitted,
            trust: TrustStatus {
                forbidden_total: node.forbidden_total,
                bound_instances: node.bound_instances,
                retrieve_length_mismatches_total: node.retrieve_length_mismatches,
            },
            tenants,
            tenants_omitted,
            l2: self.l2_report(&node),
        }
    }

    /// Every registered instance, by id, the first [`MAX_LISTED`], and how many more.
    fn instances_report(&self, node: &NodeStatus) -> (Vec<InstanceStatus>, usize) {
        let now = self.now();
        let mut instances: Vec<InstanceStatus> = node
            .instances
            .iter()
            .map(|view| InstanceStatus {
                instance_id: view.instance.get(),
                module: view.module.label(),
                age_seconds: now
                    .saturating_duration_since(view.registered_at)
                    .as_secs_f64(),
                silence_seconds: now.saturating_duration_since(view.last_seen).as_secs_f64(),
                proven: view.proven,
                building: view.building,
                owner_uid: view.owner_uid,
                tenant: view.tenant.clone(),
                watched_pid: view.process.and_then(|key| self.processes.pid_of(key)),
                death_noticed_by: view.death_notice.label(),
                model_name: view.model_name.clone(),
                blend_bytes: view.blend_bytes,
            })
            .collect();
        instances.sort_by_key(|item| item.instance_id);
        let instances_omitted = instances.len().saturating_sub(MAX_LISTED);
        instances.truncate(MAX_LISTED);
        (instances, instances_omitted)
    }

    fn liveness_report(&self, node: &NodeStatus) -> LivenessStatus {
        let status = &node.liveness;
        LivenessStatus {
            enabled: status.enabled,
            reap_timeout_seconds: status.reap_timeout.as_secs_f64(),
            registration_grace_seconds: status.registration_grace.as_secs_f64(),
            resolution_seconds: node.resolution.as_secs_f64(),
            tracked_instances: status.tracked_entries,
            reaped_total: status.reaped_total,
            process_exits_total: status.process_exits_total,
            stalls_total: status.stalls_total,
            pings_total: self.metrics.requests_for("ping"),
            pings_answered_false_total: node.pings_answered_false_total,
        }
    }

    fn contexts_report(&self, node: &NodeStatus) -> ContextsStatus {
        let freed = |cause: &str| self.metrics.frees_for(cause);
        ContextsStatus {
            built_total: node.contexts_built_total,
            freed_total: FreedTotals {
                unregistered: freed("unregistered"),
                reaped: freed("reaped"),
                process_exited: freed("process_exited"),
                cancelled: freed("cancelled"),
                shutdown: freed("shutdown"),
            },
            frees_in_flight: node.frees_in_flight,
            frees_hung_total: node.frees_hung_total,
        }
    }

    fn l1_report(&self, node: &NodeStatus) -> L1Status {
        let (slots_total, slots_used, slots_reserved, slots_pinned) = node.l1_slots;
        L1Status {
            slot_bytes: node.slot_bytes,
            slots_total,
            slots_used,
            slots_reserved,
            slots_pinned,
            pool: match &self.pool_start {
                PoolStart::Anonymous => "anonymous",
                PoolStart::Adopt => "adopted",
                PoolStart::Cold(_) => "cold",
            },
            cold_reason: match &self.pool_start {
                PoolStart::Cold(why) => Some(why.clone()),
                _ => None,
            },
            sealing: node.l1_sealing,
            unsealed_total: node.l1_unsealed_total,
            events: crate::server::status::KvEventsStatus {
                changes: node.kv_events.changes,
                bytes: node.kv_events.bytes,
                tenants: node.kv_events.tenants,
                epoch: node.kv_events.epoch,
                resyncs_total: node.kv_events.resyncs_total,
            },
            adoption: node
                .l1_adoption
                .as_ref()
                .map(|view| AdoptionStatus::of(view, self.now())),
        }
    }

    /// L2's state and counters (`--l2`): the node's breaker, the client's connection.
    fn l2_report(&self, node: &NodeStatus) -> Option<L2StatusReport> {
        node.l2.as_ref().map(|l2| {
            let c = l2.counters;
            let client = self.l2.as_ref();
            let reason = client.and_then(|client| client.last_error());
            let connected = client.is_some_and(|client| client.mode().is_some());
            L2StatusReport {
                // Before any connection the breaker has not judged anything yet.
                state: match (connected, &reason) {
                    (false, None) => "connecting",
                    (false, Some(_)) => "down",
                    (true, _) => l2.state.as_str(),
                },
                reason,
                nodes: self
                    .config
                    .l2
                    .as_ref()
                    .map(|config| config.seeds.clone())
                    .unwrap_or_default(),
                map_from: client.and_then(|client| client.map_from()),
                mode: self
                    .l2
                    .as_ref()
                    .and_then(|client| client.mode())
                    .map(|mode| match mode {
                        crate::l2::Mode::Cluster => "cluster",
                        crate::l2::Mode::Single => "single",
                    }),
                tls: self
                    .config
                    .l2
                    .as_ref()
                    .is_some_and(|config| config.uses_tls()),
                authenticated_values: self
                    .config
                    .l2
                    .as_ref()
                    .is_some_and(|config| config.format.authenticated()),
                queue_bytes: c.queue_bytes,
                writes: c.writes,
                write_drops: c.write_drops,
                hits: c.hits,
                misses: c.misses,
                corrupt: c.corrupt,
                timeouts: c.timeouts,
                errors: c.errors,
            }
        })
    }
}

/// Every tenant, the busiest first, then by name (what an operator looks for when the
/// list is long): the first [`MAX_LISTED`], and how many more.
fn tenants_report(node: &NodeStatus) -> (Vec<TenantStatusReport>, usize) {
    let mut tenants: Vec<TenantStatusReport> = node
        .tenants
        .iter()
        .map(|tenant| TenantStatusReport {
            name: tenant.view.name.clone(),
            slots_used: tenant.slots_used,
            quota_slots: tenant.quota_slots,
            mapped_bytes: tenant.mapped_bytes,
            quota_percent: tenant.view.quota_percent,
            engine_driven: tenant.view.engine_driven,
        })
        .collect();
    // The busiest first, then by name: what an operator looks for when it is long.
    tenants.sort_by(|a, b| b.slots_used.cmp(&a.slots_used).then(a.name.cmp(&b.name)));
    let tenants_omitted = tenants.len().saturating_sub(MAX_LISTED);
    tenants.truncate(MAX_LISTED);
    (tenants, tenants_omitted)
}

/// Instances (not entries: an instance is one process) by how their death will be
/// noticed.
fn death_notice_counts(node: &NodeStatus) -> [(peer::DeathNotice, usize); 3] {
    let mut seen = HashSet::default();
    let mut counts = peer::DeathNotice::ALL.map(|notice| (notice, 0));
    for view in &node.instances {
        if !seen.insert(view.instance) {
            continue;
        }
        for (kind, count) in &mut counts {
            if *kind == view.death_notice {
                *count += 1;
            }
        }
    }
    counts
}
