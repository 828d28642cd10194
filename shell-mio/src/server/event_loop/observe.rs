//! What operators see: the HTTP listener, `/status`, `/metrics`.

use super::{HTTP_FULL_LOG_EVERY, MAX_HTTP_CONNECTIONS, SERVER_NAME, Server};
use crate::server::http::HttpConnection;
use crate::server::http::Response;
use crate::server::http::Route;
use crate::server::l1::PoolStart;
use crate::server::metrics::Metrics;
use crate::server::status::to_json_pretty;
use kvwarden_core::node::{L2Link, ShellFigures};
use kvwarden_core::protocol::StatusReport;
use kvwarden_core::protocol::status::LimitsStatus;
use mio::Interest;
use mio::Token;
use std::io;

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
                        to_json_pretty(&self.status())
                    } else {
                        to_json_pretty(&self.status().without_local_identities())
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
        for (notice, count) in node.death_notices().by_notice() {
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
        let shell = ShellFigures {
            server: SERVER_NAME.to_owned(),
            uptime_seconds: self.clock_origin.elapsed().as_secs_f64(),
            gpu: self.gpu.status(),
            limits: LimitsStatus {
                open_files_soft: self.fd_limit.soft,
                open_files_hard: self.fd_limit.hard,
                connection_capacity: self.fd_limit.connection_capacity(),
                max_connections: self.config.max_connections,
                closes_pending: crate::server::closer::pending(),
            },
            pool: match &self.pool_start {
                PoolStart::Anonymous => "anonymous",
                PoolStart::Adopt => "adopted",
                PoolStart::Cold(_) => "cold",
            },
            cold_reason: match &self.pool_start {
                PoolStart::Cold(why) => Some(why.clone()),
                _ => None,
            },
            l2_link: self.l2_link(),
        };
        let pid_of = |key| self.processes.pid_of(key);
        self.node.status_report(self.now(), shell, &pid_of)
    }

    /// The L2 client's side of `status.l2` (`--l2`): its connection, its flags.
    fn l2_link(&self) -> Option<L2Link> {
        let config = self.config.l2.as_ref()?;
        let client = self.l2.as_ref();
        Some(L2Link {
            reason: client.and_then(|client| client.last_error()),
            nodes: config.seeds.clone(),
            map_from: client.and_then(|client| client.map_from()),
            mode: client
                .and_then(|client| client.mode())
                .map(|mode| match mode {
                    crate::l2::Mode::Cluster => "cluster",
                    crate::l2::Mode::Single => "single",
                }),
            tls: config.uses_tls(),
            authenticated_values: config.format.authenticated(),
        })
    }
}
