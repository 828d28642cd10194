//! What the node shows of itself: [`NodeStatus`] for the status page and metrics,
//! [`InstanceView`] per tracked entry, [`TenantStatus`] per tenant.

use crate::node::{DeathNotice, L2Status, L2Tier, Node, ProcessKey, TenantView};
use crate::time::Instant;
use crate::{InstanceId, Module, Status};
use std::collections::BTreeMap;
use std::time::Duration;
/// One tracked entry, for status pages.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceView {
    /// The instance.
    pub instance: InstanceId,
    /// The module.
    pub module: Module,
    /// When it was registered.
    pub registered_at: Instant,
    /// Its last evidence of life.
    pub last_seen: Instant,
    /// Whether it has pinged.
    pub proven: bool,
    /// Whether its context is being built.
    pub building: bool,
    /// The uid that registered it.
    pub owner_uid: Option<u32>,
    /// The tenant it acts for.
    pub tenant: String,
    /// The model.
    pub model_name: String,
    /// The process watched for it.
    pub process: Option<ProcessKey>,
    /// How its death will be noticed.
    pub death_notice: DeathNotice,
    /// Bytes of rope tables it holds.
    pub blend_bytes: u64,
}

/// The node's figures, for `/status` and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeStatus {
    /// The liveness registry's counters.
    pub liveness: Status,
    /// The liveness resolution.
    pub resolution: Duration,
    /// Pings answered.
    pub pings_total: u64,
    /// Pings answered `false`.
    pub pings_answered_false_total: u64,
    /// Contexts built.
    pub contexts_built_total: u64,
    /// Frees started, by label.
    pub freed_total: BTreeMap<&'static str, u64>,
    /// Frees running.
    pub frees_in_flight: usize,
    /// Frees that exceeded the watchdog.
    pub frees_hung_total: u64,
    /// Requests running (builds, copies, blends, L2 reads, batches).
    pub jobs_in_flight: usize,
    /// Builds, copies and blends the pool may run at once ([`jobs`](super::jobs)).
    pub pool_window: usize,
    /// Builds, copies and blends handed to the pool and not yet reported back.
    pub pool_running: usize,
    /// Builds, copies and blends waiting for their tenant's turn at the pool.
    pub pool_waiting: usize,
    /// Builds, copies and blends handed to the pool so far.
    pub pool_handed_out_total: u64,
    /// L1 slots: total, used, reserved, pinned.
    pub l1_slots: (usize, usize, usize, usize),
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// A restarted server's adoption of its pool file (None: not adopting).
    pub l1_adoption: Option<super::AdoptionView>,
    /// Committed values not sealed yet (a pool file's; 0 for an anonymous pool).
    pub l1_sealing: usize,
    /// Committed values whose seal could not be written (a key longer than a seal
    /// holds): served, but not adopted after a restart.
    pub l1_unsealed_total: u64,
    /// The KV events log (`kv_events`).
    pub kv_events: super::events::KvEventsView,
    /// Rope tables: bytes, instances, computations running.
    pub blend: (u64, usize, usize),
    /// Processes watched.
    pub watched_processes: usize,
    /// Connections open.
    pub connections: usize,
    /// Every tracked entry, by instance then module.
    pub instances: Vec<InstanceView>,
    /// L2's figures, None without `--l2`.
    pub l2: Option<L2Status>,
    /// Requests refused `forbidden` (not the owner, not attached, not authenticated).
    pub forbidden_total: u64,
    /// Instance ids bound to a secret now.
    pub bound_instances: usize,
    /// Every tenant known, with its L1 use.
    pub tenants: Vec<TenantStatus>,
    /// `retrieve`s (and batch items) answered as a miss because the stored value's
    /// length differs from the destination's.
    pub retrieve_length_mismatches: u64,
    /// Bytes of peers' memfds mapped now, all registrations together.
    pub mapped_bytes: u64,
    /// The caps on them.
    pub mapped_limits: super::mapped::MappedLimits,
    /// Registrations refused for a cap on mapped bytes.
    pub mapped_refused_total: u64,
    /// Copies into a worker's buffer not started because its worker had stopped
    /// waiting (`hello`'s `wait_ms`; row 60).
    pub copies_past_deadline_total: u64,
}

/// One tenant's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantStatus {
    /// Its name, quota setting and rights.
    pub view: TenantView,
    /// L1 slots charged to it.
    pub slots_used: usize,
    /// Its quota in slots now.
    pub quota_slots: usize,
    /// Bytes of its registrations' memfds the server maps.
    pub mapped_bytes: u64,
}

impl Node {
    /// The node's figures at `now` (a scan: for status pages, not the request path).
    pub fn status(&self) -> NodeStatus {
        let occupancy = self.l1.slots.occupancy();
        let mut instances = Vec::with_capacity(self.registry.records.len());
        for (&(instance, module), record) in &self.registry.records {
            let Some(entry) = self.liveness.entry(instance, module) else {
                continue;
            };
            let watch = self.registry.watches.of(instance);
            instances.push(InstanceView {
                instance,
                module,
                registered_at: record.registered_at,
                last_seen: entry.last_seen,
                proven: entry.proven,
                building: entry.building,
                owner_uid: record.owner_uid,
                tenant: self.doors.trust.name(record.tenant).to_owned(),
                model_name: record.model_name.clone(),
                process: watch.map(|(process, _)| process),
                death_notice: watch.map_or(DeathNotice::TimeoutOnly, |(_, notice)| notice),
                blend_bytes: self.blend.bytes_of(instance),
            });
        }
        NodeStatus {
            liveness: self.liveness.status(),
            resolution: self.liveness.config().resolution,
            pings_total: self.counters.pings().0,
            pings_answered_false_total: self.counters.pings().1,
            contexts_built_total: self.counters.contexts_built(),
            freed_total: self.registry.frees.started_by_label().clone(),
            frees_in_flight: self.frees_unfinished(),
            frees_hung_total: self.registry.frees.hung_total(),
            jobs_in_flight: self.conns.jobs_in_flight(),
            pool_window: self.work.jobs.window(),
            pool_running: self.work.jobs.running(),
            pool_waiting: self.work.jobs.waiting(),
            pool_handed_out_total: self.work.jobs.handed_out(),
            l1_slots: (
                self.l1.slots.num_slots(),
                self.l1.slots.used_slots(),
                occupancy.reserved,
                occupancy.pinned,
            ),
            slot_bytes: self.l1.slots.slot_bytes(),
            l1_adoption: self.adoption().cloned(),
            l1_sealing: self.l1.slots.sealing(),
            l1_unsealed_total: self.l1.slots.unsealed_total(),
            kv_events: self.events.view(),
            blend: (
                self.blend.held_bytes(),
                self.blend.instances(),
                self.blend.pending(),
            ),
            watched_processes: self.registry.watches.processes(),
            connections: self.conns.len(),
            instances,
            l2: self.l2.as_ref().map(L2Tier::status),
            forbidden_total: self.doors.trust.forbidden_total(),
            bound_instances: self.doors.trust.bindings(),
            tenants: self
                .doors
                .trust
                .tenants()
                .into_iter()
                .map(|view| TenantStatus {
                    slots_used: self.l1.slots.tenant_slots(view.tenant),
                    quota_slots: self.l1.slots.quota_slots(view.tenant),
                    mapped_bytes: self.doors.mapped.of_tenant(view.tenant),
                    view,
                })
                .collect(),
            retrieve_length_mismatches: self.counters.length_mismatches(),
            mapped_bytes: self.doors.mapped.total(),
            mapped_limits: self.doors.mapped.limits(),
            mapped_refused_total: self.doors.mapped.refused(),
            copies_past_deadline_total: self.counters.copies_past_deadline(),
        }
    }
}
