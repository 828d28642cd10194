//! What operators see: the HTTP listener, `/status`, `/metrics`.

use super::*;
use crate::server::status::{
    BlendStatus, ContextsStatus, DeathNoticeCounts, FreedTotals, InstanceStatus, L1Status,
    LimitsStatus, LivenessStatus, StatusReport,
};

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
                        continue; // dropped: closed
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

    pub(super) fn on_http(&mut self, token: Token) {
        let Some(connection) = self.http_connections.get_mut(&token) else {
            return;
        };
        let routed = connection.read();
        let response = match routed {
            Err(_) => {
                self.close_http(token);
                return;
            }
            Ok(None) => None,
            Ok(Some(Route::Status)) => Some(Response {
                code: 200,
                reason: "OK",
                content_type: "application/json",
                body: self.status().to_json_pretty(),
            }),
            Ok(Some(Route::Metrics)) => {
                self.refresh_metrics();
                Some(Response {
                    code: 200,
                    reason: "OK",
                    content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body: self.metrics.encode().into_bytes(),
                })
            }
            Ok(Some(Route::Healthz)) => Some(Response::text(200, "OK", "ok\n")),
            Ok(Some(Route::Other(response))) => Some(response),
        };
        let Some(connection) = self.http_connections.get_mut(&token) else {
            return;
        };
        if let Some(response) = response {
            connection.answer(&response);
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
        let status = self.liveness.status();
        self.metrics
            .tracked_instances
            .set(i64::try_from(status.tracked_instances).unwrap_or(i64::MAX));
        Metrics::mirror(&self.metrics.reaps, status.reaped_total);
        Metrics::mirror(&self.metrics.process_exits, status.process_exits_total);
        Metrics::mirror(&self.metrics.stalls, status.stalls_total);
        self.metrics.l1(self.l1.used_slots(), self.l1.num_slots());
        let occupancy = self.l1.occupancy();
        self.metrics.l1_held(occupancy.reserved, occupancy.pinned);
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics
            .blend_bytes
            .set(as_i64(self.blend.held_bytes()));
        self.metrics
            .blend_instances
            .set(as_i64(self.blend.instances() as u64));
        self.metrics.gpu_memory(&self.gpu.memory_samples());
        for (notice, count) in self.death_notice_counts() {
            self.metrics
                .instances_by_death_notice(notice.label(), as_i64(count as u64));
        }
    }

    /// Instances (not entries: an instance is one process) by how their death will be
    /// noticed.
    fn death_notice_counts(&self) -> [(peer::DeathNotice, usize); 3] {
        let instances: HashSet<InstanceId> =
            self.records.keys().map(|(instance, _)| *instance).collect();
        let mut counts = peer::DeathNotice::ALL.map(|notice| (notice, 0));
        for instance in instances {
            let notice = self.watches.notice_of(instance);
            for (kind, count) in &mut counts {
                if *kind == notice {
                    *count += 1;
                }
            }
        }
        counts
    }

    fn instances_by_death_notice(&self) -> DeathNoticeCounts {
        let mut counts = DeathNoticeCounts::default();
        for (notice, count) in self.death_notice_counts() {
            match notice {
                peer::DeathNotice::PidfdFromPeer => counts.pidfd_from_peer = count,
                peer::DeathNotice::PidfdByPid => counts.pidfd_by_pid = count,
                peer::DeathNotice::TimeoutOnly => counts.timeout_only = count,
            }
        }
        counts
    }

    pub(super) fn status(&self) -> StatusReport {
        let occupancy = self.l1.occupancy();
        let now = self.now();
        let status = self.liveness.status();
        let mut instances: Vec<InstanceStatus> = Vec::with_capacity(self.records.len());
        for ((instance, module), record) in &self.records {
            let Some(entry) = self.liveness.entry(*instance, *module) else {
                continue;
            };
            instances.push(InstanceStatus {
                instance_id: instance.get(),
                module: module.label(),
                age_seconds: now
                    .saturating_duration_since(record.registered_at)
                    .as_secs_f64(),
                silence_seconds: now.saturating_duration_since(entry.last_seen).as_secs_f64(),
                proven: entry.proven,
                building: entry.building,
                owner_uid: record.owner_uid,
                watched_pid: self.watches.pid_of(*instance),
                death_noticed_by: self.watches.notice_of(*instance).label(),
                model_name: record.model_name.clone(),
                blend_bytes: self.blend.bytes_of(*instance),
            });
        }
        instances.sort_by_key(|item| item.instance_id);
        let freed = |cause: &str| self.metrics.frees_for(cause);
        StatusReport {
            server: concat!("kvwarden ", env!("CARGO_PKG_VERSION")),
            protocol: PROTOCOL_VERSION,
            boot_id: self.boot_id,
            uptime_seconds: self.clock_origin.elapsed().as_secs_f64(),
            worker_liveness: LivenessStatus {
                enabled: status.enabled,
                reap_timeout_seconds: status.reap_timeout.as_secs_f64(),
                registration_grace_seconds: status.registration_grace.as_secs_f64(),
                resolution_seconds: self.liveness.config().resolution.as_secs_f64(),
                tracked_instances: status.tracked_instances,
                reaped_total: status.reaped_total,
                process_exits_total: status.process_exits_total,
                stalls_total: status.stalls_total,
                pings_total: self.metrics.requests_for("ping"),
                pings_answered_false_total: self.metrics.pings_answered_false.get(),
            },
            contexts: ContextsStatus {
                built_total: self.metrics.contexts_built.get(),
                freed_total: FreedTotals {
                    unregistered: freed("unregistered"),
                    reaped: freed("reaped"),
                    process_exited: freed("process_exited"),
                    cancelled: freed("cancelled"),
                    shutdown: freed("shutdown"),
                },
                frees_in_flight: self.frees.len(),
                frees_hung_total: self.metrics.frees_hung.get(),
            },
            l1: L1Status {
                slot_bytes: self.l1.slot_bytes(),
                slots_total: self.l1.num_slots(),
                slots_used: self.l1.used_slots(),
                slots_reserved: occupancy.reserved,
                slots_pinned: occupancy.pinned,
            },
            blend: BlendStatus {
                bytes_total: self.blend.held_bytes(),
                instances: self.blend.instances(),
                computing: self.blend.pending(),
            },
            gpu: self.gpu.status(),
            connections: self.connections.len(),
            limits: LimitsStatus {
                open_files_soft: self.fd_limit.soft,
                open_files_hard: self.fd_limit.hard,
                connection_capacity: self.fd_limit.connection_capacity(),
                max_connections: self.config.max_connections,
            },
            watched_processes: self.watches.len(),
            instances_by_death_notice: self.instances_by_death_notice(),
            instances,
        }
    }
}
