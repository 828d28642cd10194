//! The `status` reply ([`StatusReport`]): the node's figures from its components, with
//! the few that only a shell knows ([`ShellFigures`]). Both shells answer `status`
//! with it, so what each key says is decided here once.

use crate::node::{AdoptionView, DeathNotice, InstanceView, L2Status, Node, NodeStatus};
use crate::node::{ProcessKey, TenantStatus};
use crate::protocol::PROTOCOL_VERSION;
use crate::protocol::status::{
    AdoptionDropped, AdoptionStatus, BlendStatus, ContextsStatus, DeathNoticeCounts, FreedTotals,
    GpuStatus, InstanceStatus, KvEventsStatus, L1Status, L2StatusReport, LimitsStatus,
    LivenessStatus, MAX_LISTED, MappedStatus, StatusReport, TenantStatusReport, TransfersStatus,
    TrustStatus,
};
use crate::time::Instant;
use std::collections::HashSet;

/// What only a shell knows of itself, for `status`.
#[derive(Clone, Debug)]
pub struct ShellFigures {
    /// `kvwarden <version>`.
    pub server: String,
    /// Seconds since the server started.
    pub uptime_seconds: f64,
    /// The GPUs, or why there are none.
    pub gpu: GpuStatus,
    /// File-descriptor and connection limits.
    pub limits: LimitsStatus,
    /// How the L1 pool started: `anonymous`, `adopted` or `cold`.
    pub pool: &'static str,
    /// Why a `cold` pool file started empty.
    pub cold_reason: Option<String>,
    /// The L2 client's side of `l2` (None without `--l2`).
    pub l2_link: Option<L2Link>,
}

/// The L2 client's side of `status.l2`: its connection and its configuration.
#[derive(Clone, Debug, Default)]
pub struct L2Link {
    /// Why the latest connection attempt failed.
    pub reason: Option<String>,
    /// The seeds of `--l2`.
    pub nodes: Vec<String>,
    /// The node whose slot map the data path uses now.
    pub map_from: Option<String>,
    /// `cluster` or `single` once a connection succeeded; None before.
    pub mode: Option<&'static str>,
    /// Whether L2 is reached over TLS.
    pub tls: bool,
    /// Whether values carry a MAC under the cluster secret.
    pub authenticated_values: bool,
}

impl Node {
    /// The `status` reply at `now`: the node's figures with the shell's, the pid of a
    /// watched process as `pid_of` tells it (None where the shell sees none). A scan:
    /// for status pages, not the request path.
    pub fn status_report(
        &self,
        now: Instant,
        shell: ShellFigures,
        pid_of: &dyn Fn(ProcessKey) -> Option<i32>,
    ) -> StatusReport {
        let node = self.status();
        let (instances, instances_omitted) = instances_report(&node, now, pid_of);
        let (tenants, tenants_omitted) = tenants_report(&node.tenants);
        let (bytes_total, blend_instances, computing) = node.blend;
        StatusReport {
            server: shell.server,
            protocol: PROTOCOL_VERSION,
            boot_id: self.config.boot_id,
            uptime_seconds: shell.uptime_seconds,
            worker_liveness: liveness_report(&node),
            contexts: contexts_report(&node),
            l1: l1_report(&node, now, shell.pool, shell.cold_reason),
            blend: BlendStatus {
                bytes_total,
                instances: blend_instances,
                computing,
            },
            gpu: shell.gpu,
            connections: node.connections,
            limits: shell.limits,
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
            instances_by_death_notice: node.death_notices(),
            instances,
            instances_omitted,
            trust: TrustStatus {
                forbidden_total: node.forbidden_total,
                bound_instances: node.bound_instances,
                retrieve_length_mismatches_total: node.retrieve_length_mismatches,
            },
            tenants,
            tenants_omitted,
            l2: node
                .l2
                .as_ref()
                .map(|l2| l2_report(l2, shell.l2_link.unwrap_or_default())),
        }
    }
}

/// Every registered instance, by id, the first [`MAX_LISTED`], and how many more.
fn instances_report(
    node: &NodeStatus,
    now: Instant,
    pid_of: &dyn Fn(ProcessKey) -> Option<i32>,
) -> (Vec<InstanceStatus>, usize) {
    let mut instances: Vec<InstanceStatus> = node
        .instances
        .iter()
        .map(|view: &InstanceView| InstanceStatus {
            instance_id: view.instance.get(),
            module: view.module.label().to_owned(),
            age_seconds: now
                .saturating_duration_since(view.registered_at)
                .as_secs_f64(),
            silence_seconds: now.saturating_duration_since(view.last_seen).as_secs_f64(),
            proven: view.proven,
            building: view.building,
            owner_uid: view.owner_uid,
            tenant: view.tenant.clone(),
            watched_pid: view.process.and_then(pid_of),
            death_noticed_by: view.death_notice.label().to_owned(),
            model_name: view.model_name.clone(),
            blend_bytes: view.blend_bytes,
        })
        .collect();
    instances.sort_by_key(|item| item.instance_id);
    let instances_omitted = instances.len().saturating_sub(MAX_LISTED);
    instances.truncate(MAX_LISTED);
    (instances, instances_omitted)
}

fn liveness_report(node: &NodeStatus) -> LivenessStatus {
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
        pings_total: node.pings_total,
        pings_answered_false_total: node.pings_answered_false_total,
    }
}

fn contexts_report(node: &NodeStatus) -> ContextsStatus {
    let freed = |label: &str| node.freed_total.get(label).copied().unwrap_or(0);
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

fn l1_report(
    node: &NodeStatus,
    now: Instant,
    pool: &'static str,
    cold_reason: Option<String>,
) -> L1Status {
    let (slots_total, slots_used, slots_reserved, slots_pinned) = node.l1_slots;
    let events = &node.kv_events;
    L1Status {
        slot_bytes: node.slot_bytes,
        slots_total,
        slots_used,
        slots_reserved,
        slots_pinned,
        pool: pool.to_owned(),
        cold_reason,
        sealing: node.l1_sealing,
        unsealed_total: node.l1_unsealed_total,
        events: KvEventsStatus {
            changes: events.changes,
            bytes: events.bytes,
            tenants: events.tenants,
            epoch: events.epoch,
            resyncs_total: events.resyncs_total,
        },
        adoption: node
            .l1_adoption
            .as_ref()
            .map(|view| adoption_report(view, now)),
    }
}

/// A restarted server's scan of its pool file; `now` ends `seconds` while scanning.
fn adoption_report(view: &AdoptionView, now: Instant) -> AdoptionStatus {
    AdoptionStatus {
        state: if view.finished.is_some() {
            "done"
        } else {
            "scanning"
        }
        .to_owned(),
        slots: view.slots,
        scanned: view.scanned,
        adopted: view.adopted,
        adopted_bytes: view.adopted_bytes,
        dropped: AdoptionDropped {
            torn: view.dropped_torn,
            malformed: view.dropped_malformed,
            tenant: view.dropped_tenant,
            duplicate: view.dropped_duplicate,
            taken: view.dropped_taken,
        },
        seconds: view
            .finished
            .unwrap_or(now)
            .saturating_duration_since(view.started)
            .as_secs_f64(),
    }
}

/// L2's state and counters: the node's breaker, the client's connection.
fn l2_report(l2: &L2Status, link: L2Link) -> L2StatusReport {
    L2StatusReport {
        // Before any connection the breaker has not judged anything yet.
        state: match (link.mode, &link.reason) {
            (None, None) => "connecting",
            (None, Some(_)) => "down",
            (Some(_), _) => l2.state.as_str(),
        }
        .to_owned(),
        reason: link.reason,
        nodes: link.nodes,
        map_from: link.map_from,
        mode: link.mode.map(str::to_owned),
        tls: link.tls,
        authenticated_values: link.authenticated_values,
        counters: l2.counters,
    }
}

/// Every tenant, the busiest first, then by name (what an operator looks for when the
/// list is long): the first [`MAX_LISTED`], and how many more.
fn tenants_report(tenants: &[TenantStatus]) -> (Vec<TenantStatusReport>, usize) {
    let mut tenants: Vec<TenantStatusReport> = tenants
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
    tenants.sort_by(|a, b| b.slots_used.cmp(&a.slots_used).then(a.name.cmp(&b.name)));
    let tenants_omitted = tenants.len().saturating_sub(MAX_LISTED);
    tenants.truncate(MAX_LISTED);
    (tenants, tenants_omitted)
}

impl NodeStatus {
    /// Instances (not entries: an instance is one process) by how their death will be
    /// noticed.
    pub fn death_notices(&self) -> DeathNoticeCounts {
        let mut seen = HashSet::new();
        let mut counts = DeathNoticeCounts::default();
        for view in &self.instances {
            if seen.insert(view.instance) {
                *counts.of_mut(view.death_notice) += 1;
            }
        }
        counts
    }
}

impl DeathNoticeCounts {
    /// Each notice with its count, for metrics labelled by [`DeathNotice::label`].
    pub fn by_notice(&self) -> [(DeathNotice, usize); 3] {
        let mut counts = self.clone();
        DeathNotice::ALL.map(|notice| (notice, *counts.of_mut(notice)))
    }

    fn of_mut(&mut self, notice: DeathNotice) -> &mut usize {
        match notice {
            DeathNotice::PidfdFromPeer => &mut self.pidfd_from_peer,
            DeathNotice::PidfdByPid => &mut self.pidfd_by_pid,
            DeathNotice::TimeoutOnly => &mut self.timeout_only,
        }
    }
}
