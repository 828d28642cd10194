//! Prometheus metrics (`GET /metrics`), exposed with `prometheus-client`.

use kvwarden_core::protocol::OP_NAMES;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// Every `(transport, reason)` of `kvwarden_connections_cut_total`.
pub const CONNECTION_CUTS: &[(&str, &[&str])] = &[
    (
        "unix",
        &[
            "frame_timeout",
            "fds_held",
            "fd_budget",
            "memory_budget",
            "uid_share",
            "max_connections",
        ],
    ),
    (
        "tcp",
        &[
            "frame_timeout",
            "memory_budget",
            "uid_share",
            "stranger_share",
            "max_connections",
            "unauthenticated",
        ],
    ),
    ("http", &["frame_timeout", "listener_full"]),
];

fn cut_labels(transport: &str, reason: &str) -> Labels {
    vec![
        ("transport".to_string(), transport.to_string()),
        ("reason".to_string(), reason.to_string()),
    ]
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Per-op request counters, indexed by [`Op::index`](kvwarden_core::protocol::Op::index)
    /// and resolved once at start: counting a request looks nothing up and allocates
    /// nothing.
    request_counters: [Counter; OP_NAMES.len()],
    /// Requests that did not decode (`op="invalid"`), resolved once at start.
    invalid_requests: Counter,
    /// Requests by op.
    pub requests: Family<Labels, Counter>,
    /// Error replies by op and code.
    pub errors: Family<Labels, Counter>,
    /// Contexts freed by cause (`reaped`, `process_exited`, `unregistered`, `cancelled`,
    /// `shutdown`).
    pub frees: Family<Labels, Counter>,
    /// Contexts built.
    pub contexts_built: Counter,
    /// Frees that exceeded the watchdog.
    pub frees_hung: Counter,
    /// Entries the core tracks (set at scrape).
    pub tracked_instances: Gauge,
    /// Entries reaped (mirrors the core's counter).
    pub reaps: Counter,
    /// Process exits proven (mirrors the core's counter).
    pub process_exits: Counter,
    /// Server stalls detected (mirrors the core's counter).
    pub stalls: Counter,
    /// Pings answered `false`: the instance was not held (reaped, freed, never
    /// registered, or registered with an earlier server). A live worker that was not
    /// reaped is never told this.
    pub pings_answered_false: Counter,
    /// Time from a ping's decode to its reply being queued, in seconds.
    pub ping_seconds: Histogram,
    /// L1 slots by state (`used`, `total`).
    pub l1_slots: Family<Labels, Gauge>,
    /// Open worker connections.
    pub connections: Gauge,
    /// Connections the server cut, by `transport` (`unix`, `tcp`, `http`) and `reason`
    /// (`frame_timeout`, `fds_held`, `fd_budget`, `memory_budget`, `uid_share`,
    /// `max_connections`, `unauthenticated`, `listener_full`).
    pub connections_cut: Family<Labels, Counter>,
    /// Bytes of CacheBlend rope tables held, all instances together (set at scrape).
    pub blend_bytes: Gauge,
    /// Instances holding CacheBlend rope tables (set at scrape).
    pub blend_instances: Gauge,
    /// Device memory by `device` and `state` (`free`, `total`), on hosts with a GPU
    /// (set at scrape from the last sample; absent without one).
    pub gpu_memory_bytes: Family<Labels, Gauge>,
    /// Instances by how their death will be noticed (`pidfd_from_peer`,
    /// `pidfd_by_pid`, `timeout_only`; set at scrape).
    pub instances_by_death_notice: Family<Labels, Gauge>,
    /// The L2 tier's metrics, registered only with `--l2`.
    pub l2: Option<L2Metrics>,
    /// Requests refused `forbidden` (set at scrape from the node's count).
    pub forbidden: Counter,
    /// Retrieves (and batch items) answered as a miss for a stored value of another
    /// length than the destination's (set at scrape).
    pub retrieve_length_mismatches: Counter,
    /// Bytes of workers' memfds the server maps (set at scrape).
    pub mapped_bytes: Gauge,
    /// Registrations refused for a cap on mapped bytes (set at scrape).
    pub mapped_refused: Counter,
    /// fds peers handed over, not closed yet (set at scrape).
    pub closes_pending: Gauge,
    /// Copies into a worker's buffer not started: its worker had stopped waiting (set
    /// at scrape).
    pub copies_past_deadline: Counter,
    /// A restarted server's pool file: values adopted and dropped, by outcome (set at
    /// scrape).
    pub l1_adoption: Family<Labels, Counter>,
    /// Values committed to a pool file whose seal could not be written.
    pub l1_unsealed: Counter,
    /// `kv_events` pages that started a reader over.
    pub kv_events_resyncs: Counter,
    /// L1 slots charged to each tenant, and its quota, by `tenant` and `state`
    /// (`used`, `quota`; set at scrape).
    pub tenant_slots: Family<Labels2, Gauge>,
    /// The tenants `tenant_slots` shows: one the node forgot (made for a uid, it held
    /// nothing; row 70) loses its gauges at the next scrape.
    tenants_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// Two labels.
pub type Labels2 = Vec<(&'static str, String)>;

/// `kvwarden_l2_*`: the `l2` section of `/status` (set at scrape from the node's counters).
#[derive(Default)]
pub struct L2Metrics {
    /// 1 for the breaker's state (`up`, `degraded`, `down`), 0 for the others.
    pub state: Family<Labels, Gauge>,
    /// Bytes in the write-behind queue.
    pub queue_bytes: Gauge,
    /// Values written.
    pub writes: Counter,
    /// Writes dropped (queue full, or L2 down).
    pub write_drops: Counter,
    /// Reads served from L2.
    pub hits: Counter,
    /// Reads that were not hits.
    pub misses: Counter,
    /// Values that failed their header's checks (deleted).
    pub corrupt: Counter,
    /// Operations with no answer within --l2-timeout-ms.
    pub timeouts: Counter,
    /// Operations Redis or the connection failed.
    pub errors: Counter,
}

impl L2Metrics {
    /// Sets every series from the node's figures.
    pub fn mirror(&self, state: &str, counters: &kvwarden_core::l2::L2Counters) {
        for name in ["up", "degraded", "down"] {
            self.state
                .get_or_create(&label("state", name))
                .set(i64::from(name == state));
        }
        self.queue_bytes
            .set(i64::try_from(counters.queue_bytes).unwrap_or(i64::MAX));
        Metrics::mirror(&self.writes, counters.writes);
        Metrics::mirror(&self.write_drops, counters.write_drops);
        Metrics::mirror(&self.hits, counters.hits);
        Metrics::mirror(&self.misses, counters.misses);
        Metrics::mirror(&self.corrupt, counters.corrupt);
        Metrics::mirror(&self.timeouts, counters.timeouts);
        Metrics::mirror(&self.errors, counters.errors);
    }
}

/// Every cause a context is freed for: each series exists from the start, so that
/// `rate()` and `increase()` see the first free of each.
pub const FREE_CAUSES: [&str; 5] = [
    "unregistered",
    "reaped",
    "process_exited",
    "cancelled",
    "shutdown",
];

fn label(key: &str, value: &str) -> Labels {
    vec![(key.to_string(), value.to_string())]
}

/// One series every server exports: its name (after `kvwarden_`), its help, and the
/// field that holds it. `Metrics::new` registers the tables below in their order.
type Row<M> = (&'static str, &'static str, fn(&Metrics) -> &M);

/// Counters.
const COUNTERS: &[Row<Counter>] = &[
    ("contexts_built", "Contexts built", |m| &m.contexts_built),
    (
        "frees_hung",
        "Frees still running after --free-watchdog-seconds",
        |m| &m.frees_hung,
    ),
    ("reaps", "Entries reaped for silence", |m| &m.reaps),
    (
        "process_exits",
        "Instances freed because the kernel proved their process exited",
        |m| &m.process_exits,
    ),
    ("stalls", "Stalls of the server itself detected", |m| {
        &m.stalls
    }),
    (
        "pings_answered_false",
        "Pings answered false: the instance is not held here (reaped, freed by its \
             process exit or unregister, or registered with an earlier server); the worker \
             re-registers",
        |m| &m.pings_answered_false,
    ),
    (
        "forbidden",
        "Requests refused forbidden: a connection that had not attached the instance it \
             named (or proved another secret), a TCP peer without the token, a tenant not \
             trusted with engine-driven",
        |m| &m.forbidden,
    ),
    (
        "retrieve_length_mismatches",
        "Retrieves answered as a miss because the stored value's length differs from \
             the destination's (nothing was written)",
        |m| &m.retrieve_length_mismatches,
    ),
    (
        "mapped_refused",
        "Registrations refused because their memfd buffers passed a cap on mapped \
             bytes (per instance, per tenant, or in all)",
        |m| &m.mapped_refused,
    ),
    (
        "copies_past_deadline",
        "Copies into a worker's buffer never started because its worker had stopped \
             waiting (its hello's wait_ms passed): the chunk stays in L1, the buffer untouched",
        |m| &m.copies_past_deadline,
    ),
    (
        "l1_unsealed",
        "Values committed to a pool file whose seal could not be written: a key longer \
             than a seal holds (464 bytes with the tenant's name). Served, but not adopted \
             after a restart",
        |m| &m.l1_unsealed,
    ),
    (
        "kv_events_resyncs",
        "kv_events pages that started a reader over: a new reader, a server restart, or \
             a reader behind changes that left the log (rising fast: readers do not keep up)",
        |m| &m.kv_events_resyncs,
    ),
];

/// Gauges.
const GAUGES: &[Row<Gauge>] = &[
    (
        "tracked_instances",
        "Entries tracked by the liveness registry (building included)",
        |m| &m.tracked_instances,
    ),
    ("connections", "Open worker connections", |m| &m.connections),
    ("blend_bytes", "Bytes of CacheBlend rope tables held", |m| {
        &m.blend_bytes
    }),
    (
        "blend_instances",
        "Instances holding CacheBlend rope tables",
        |m| &m.blend_instances,
    ),
    (
        "mapped_bytes",
        "Bytes of workers' memfds the server maps, all registrations together (capped \
             by --max-mapped-bytes; pages a copy writes into a sparse one are charged to \
             the server)",
        |m| &m.mapped_bytes,
    ),
    (
        "closes_pending",
        "fds workers handed over that the closer threads have not closed yet (a \
             steady rise: a peer's files take long to close)",
        |m| &m.closes_pending,
    ),
];

/// Counters by label.
const COUNTER_FAMILIES: &[Row<Family<Labels, Counter>>] = &[
    ("requests", "Requests by op", |m| &m.requests),
    ("errors", "Error replies by op and code", |m| &m.errors),
    ("frees", "Contexts freed, by cause", |m| &m.frees),
    (
        "connections_cut",
        "Connections the server cut or refused, by transport and reason: frame_timeout \
             (a frame or HTTP request not whole within --frame-timeout-seconds), fds_held \
             (more fds than one frame may carry), fd_budget (fds held for incomplete frames \
             over the budget), memory_budget (connection buffers over their budget), \
             uid_share (a uid, or a TCP tenant, over --max-connections-per-uid), \
             stranger_share (TCP peers that have not authenticated over their eighth of \
             --max-connections), \
             max_connections (every connection held), unauthenticated (a TCP peer without \
             the token past --frame-timeout-seconds), listener_full (the oldest HTTP \
             connection closed for a new one)",
        |m| &m.connections_cut,
    ),
    (
        "l1_adoption",
        "Values a restarted server found in its pool file (--l1-file), by outcome: \
             adopted (served again), torn (the seal did not verify), malformed, tenant (no \
             tenant of the key's name now), duplicate, taken (a store took the slot first)",
        |m| &m.l1_adoption,
    ),
];

/// Gauges by label.
const GAUGE_FAMILIES: &[Row<Family<Labels, Gauge>>] = &[
    ("l1_slots", "L1 slots by state", |m| &m.l1_slots),
    (
        "gpu_memory_bytes",
        "Device memory by device and state (free, total), on hosts with a GPU",
        |m| &m.gpu_memory_bytes,
    ),
    (
        "instances_by_death_notice",
        "Registered instances by how their process's death will be noticed: a pidfd \
             the worker sent, a pidfd opened by its pid, or only the reap timeout",
        |m| &m.instances_by_death_notice,
    ),
];

impl Metrics {
    /// Registers every metric under the `kvwarden_` prefix.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvwarden");
        let metrics = Metrics {
            requests: Family::default(),
            errors: Family::default(),
            frees: Family::default(),
            contexts_built: Counter::default(),
            frees_hung: Counter::default(),
            tracked_instances: Gauge::default(),
            reaps: Counter::default(),
            process_exits: Counter::default(),
            stalls: Counter::default(),
            pings_answered_false: Counter::default(),
            ping_seconds: Histogram::new(exponential_buckets(1e-6, 4.0, 10)),
            l1_slots: Family::default(),
            connections: Gauge::default(),
            connections_cut: Family::default(),
            blend_bytes: Gauge::default(),
            blend_instances: Gauge::default(),
            gpu_memory_bytes: Family::default(),
            instances_by_death_notice: Family::default(),
            forbidden: Counter::default(),
            retrieve_length_mismatches: Counter::default(),
            mapped_bytes: Gauge::default(),
            mapped_refused: Counter::default(),
            closes_pending: Gauge::default(),
            copies_past_deadline: Counter::default(),
            l1_adoption: Family::default(),
            l1_unsealed: Counter::default(),
            kv_events_resyncs: Counter::default(),
            tenant_slots: Family::default(),
            tenants_shown: Default::default(),
            l2: None,
            registry: Registry::default(),
            request_counters: Default::default(),
            invalid_requests: Counter::default(),
        };
        metrics.register(&mut registry);
        // Every cut's series exists from the start (at 0), so that a rate over it is
        // defined before the first cut.
        for (transport, reasons) in CONNECTION_CUTS {
            for reason in *reasons {
                let _ = metrics
                    .connections_cut
                    .get_or_create(&cut_labels(transport, reason));
            }
        }
        for cause in FREE_CAUSES {
            let _ = metrics.frees.get_or_create(&label("cause", cause));
        }
        // Every op's series exists from the start, and the counters the loop bumps
        // are the family's own (a Counter is a shared handle).
        let request_counters =
            OP_NAMES.map(|op| metrics.requests.get_or_create(&label("op", op)).clone());
        let invalid_requests = metrics
            .requests
            .get_or_create(&label("op", "invalid"))
            .clone();
        Metrics {
            registry,
            request_counters,
            invalid_requests,
            ..metrics
        }
    }

    /// Registers every series of the tables above, then the histogram and the tenants'
    /// slots (their labels are their own).
    fn register(&self, registry: &mut Registry) {
        for (name, help, metric) in COUNTERS {
            registry.register(*name, *help, metric(self).clone());
        }
        for (name, help, metric) in GAUGES {
            registry.register(*name, *help, metric(self).clone());
        }
        for (name, help, metric) in COUNTER_FAMILIES {
            registry.register(*name, *help, metric(self).clone());
        }
        for (name, help, metric) in GAUGE_FAMILIES {
            registry.register(*name, *help, metric(self).clone());
        }
        registry.register(
            "ping_handling_seconds",
            "Time to handle a ping on the event loop",
            self.ping_seconds.clone(),
        );
        registry.register(
            "tenant_slots",
            "L1 slots by tenant and state: used (charged to it) and quota (its share now)",
            self.tenant_slots.clone(),
        );
    }

    /// Registers the `kvwarden_l2_*` series (the server runs with `--l2`).
    pub fn enable_l2(&mut self) {
        let l2 = L2Metrics::default();
        let registry = &mut self.registry;
        registry.register(
            "l2_state",
            "L2 breaker state (1 for the current one)",
            l2.state.clone(),
        );
        registry.register(
            "l2_queue_bytes",
            "Bytes in the L2 write-behind queue",
            l2.queue_bytes.clone(),
        );
        registry.register("l2_writes", "Values written to L2", l2.writes.clone());
        registry.register(
            "l2_write_drops",
            "Writes to L2 dropped: the queue was full or L2 was down",
            l2.write_drops.clone(),
        );
        registry.register("l2_hits", "Reads served from L2", l2.hits.clone());
        registry.register(
            "l2_misses",
            "L2 reads that were not hits",
            l2.misses.clone(),
        );
        registry.register(
            "l2_corrupt",
            "L2 values that failed their header's checks (answered as misses, deleted)",
            l2.corrupt.clone(),
        );
        registry.register(
            "l2_timeouts",
            "L2 operations with no answer within --l2-timeout-ms",
            l2.timeouts.clone(),
        );
        registry.register("l2_errors", "L2 operations that failed", l2.errors.clone());
        self.l2 = Some(l2);
    }

    /// Counts a request of the op at `op_index` in [`OP_NAMES`].
    pub fn request(&self, op_index: usize) {
        if let Some(counter) = self.request_counters.get(op_index) {
            counter.inc();
        }
    }

    /// Counts a request that did not decode.
    pub fn invalid_request(&self) {
        self.invalid_requests.inc();
    }

    /// Counts a connection the server cut or refused (`kvwarden_connections_cut_total`):
    /// one of [`CONNECTION_CUTS`].
    pub fn connection_cut(&self, transport: &str, reason: &str) {
        self.connections_cut
            .get_or_create(&cut_labels(transport, reason))
            .inc();
    }

    /// Counts an error reply.
    pub fn error(&self, op: &str, code: &str) {
        let labels = vec![
            ("op".to_string(), op.to_string()),
            ("code".to_string(), code.to_string()),
        ];
        self.errors.get_or_create(&labels).inc();
    }

    /// Counts a free.
    pub fn free(&self, cause: &str) {
        self.frees.get_or_create(&label("cause", cause)).inc();
    }

    /// Sets a mirrored counter to `value` (it only ever grows).
    pub fn mirror(counter: &Counter, value: u64) {
        let seen = counter.get();
        if value > seen {
            counter.inc_by(value - seen);
        }
    }

    /// Sets the gauges of L1 slots that LRU may not evict: `reserved` (being written,
    /// or reserved by an engine-driven worker) and `pinned` (being read).
    pub fn l1_held(&self, reserved: usize, pinned: usize) {
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.l1_slots
            .get_or_create(&label("state", "reserved"))
            .set(as_i64(reserved));
        self.l1_slots
            .get_or_create(&label("state", "pinned"))
            .set(as_i64(pinned));
    }

    /// Sets the gauge of instances whose death will be noticed by `notice`.
    pub fn instances_by_death_notice(&self, notice: &str, count: i64) {
        self.instances_by_death_notice
            .get_or_create(&label("noticed_by", notice))
            .set(count);
    }

    /// Sets the L1 gauges of every tenant the node tracks, `(name, used, quota)`, and
    /// drops those of tenants it no longer tracks (row 70: uids that came and went
    /// leave no series behind).
    pub fn tenants<'a>(&self, tenants: impl IntoIterator<Item = (&'a str, usize, usize)>) {
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let labels = |tenant: &str, state: &str| {
            vec![("tenant", tenant.to_owned()), ("state", state.to_owned())]
        };
        let mut shown = std::collections::BTreeSet::new();
        for (tenant, used, quota) in tenants {
            for (state, value) in [("used", used), ("quota", quota)] {
                self.tenant_slots
                    .get_or_create(&labels(tenant, state))
                    .set(as_i64(value));
            }
            shown.insert(tenant.to_owned());
        }
        let mut before = self
            .tenants_shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in before.difference(&shown) {
            for state in ["used", "quota"] {
                self.tenant_slots.remove(&labels(gone, state));
            }
        }
        *before = shown;
    }

    /// Mirrors a pool file's adoption, by outcome.
    pub fn l1_adoption(&self, view: &kvwarden_core::node::AdoptionView) {
        for (outcome, value) in [
            ("adopted", view.adopted),
            ("torn", view.dropped_torn),
            ("malformed", view.dropped_malformed),
            ("tenant", view.dropped_tenant),
            ("duplicate", view.dropped_duplicate),
            ("taken", view.dropped_taken),
        ] {
            Metrics::mirror(
                &self.l1_adoption.get_or_create(&label("outcome", outcome)),
                value,
            );
        }
    }

    /// Sets the L1 gauges.
    pub fn l1(&self, used: usize, total: usize) {
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.l1_slots
            .get_or_create(&label("state", "used"))
            .set(as_i64(used));
        self.l1_slots
            .get_or_create(&label("state", "total"))
            .set(as_i64(total));
    }

    /// Sets the device-memory gauges from the last sample.
    pub fn gpu_memory(&self, samples: &[crate::cuda::DeviceMemory]) {
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for sample in samples {
            let device = sample.device.to_string();
            for (state, bytes) in [("free", sample.free_bytes), ("total", sample.total_bytes)] {
                let labels = vec![
                    ("device".to_string(), device.clone()),
                    ("state".to_string(), state.to_string()),
                ];
                self.gpu_memory_bytes
                    .get_or_create(&labels)
                    .set(as_i64(bytes));
            }
        }
    }

    /// The OpenMetrics text exposition (what `prometheus-client` writes).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(error) = encode(&mut out, &self.registry) {
            out = format!("# encoding metrics failed: {error}\n");
        }
        out
    }

    /// The classic Prometheus text format (0.0.4), what `promtool check metrics` and a
    /// scraper that does not ask for OpenMetrics read: see [`openmetrics_to_classic`].
    pub fn encode_classic(&self) -> String {
        openmetrics_to_classic(&self.encode())
    }
}

/// OpenMetrics text → the classic format: a counter family `x` (whose samples are
/// `x_total`) is named `x_total` in its `HELP` and `TYPE` lines, `# UNIT` and `# EOF`
/// lines go. Everything else is the same in both.
pub fn openmetrics_to_classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(line) => out.push_str(line.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_classic_format_names_counters_by_their_samples_and_has_no_eof() {
        let metrics = Metrics::new();
        metrics.request(0);
        let classic = metrics.encode_classic();
        assert!(
            classic.contains("# TYPE kvwarden_requests_total counter\n"),
            "{classic}"
        );
        assert!(
            classic.contains("kvwarden_requests_total{op=\"hello\"} 1"),
            "{classic}"
        );
        assert!(
            classic.contains("# TYPE kvwarden_tracked_instances gauge"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"), "{classic}");
        assert!(
            metrics
                .encode()
                .contains("# TYPE kvwarden_requests counter")
        );
    }
}
