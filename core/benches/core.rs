//! C1–C4 and C6 of `docs/targets.md`: `cargo bench -p kvwarden-core`.
//!
//! Prints one figure per line, `C<n> <name> <value> <unit> (target ...)`, so that runs
//! can be compared with `diff`. C1 is a median over many batches. C2 is the CPU time of
//! every `handle_timeout` over a steady state (a turn every 100 ms and whenever
//! `poll_timeout` asks, deferred re-checks included), per second of run time, next to
//! a full scan of the same instances every R measured in the same process. C6 is the
//! longest single `handle_timeout` in that steady state and after a burst of
//! registrations in one second. C7 is a ping through the whole node (who-is-who checks,
//! the registry, the reply) on a connection that attached its instance, next to the
//! checks alone (`Trust::require_identity` + `Trust::check`): what proving an instance
//! costs per ping.

use kvwarden_core::{Config, Effect, InstanceId, Instant, Liveness, Module, Registration};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Counts live heap bytes, for C4.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// SplitMix64: a fixed, seedable sequence of ids and picks.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn ids(count: usize, seed: u64) -> Vec<InstanceId> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|_| InstanceId::new(rng.next() & InstanceId::MAX).unwrap())
        .collect()
}

fn registry(ids: &[InstanceId], now: Instant) -> Liveness<()> {
    let mut liveness = Liveness::new(Config::default(), now).unwrap();
    for &id in ids {
        if let Registration::Build(ticket) = liveness.register(now, id, Module::ServerDriven) {
            liveness.context_built(now, ticket, ());
        }
    }
    liveness
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Median nanoseconds per call of `op`, over `samples` batches of `batch` calls.
fn per_call_ns(samples: usize, batch: usize, mut op: impl FnMut(usize)) -> f64 {
    let mut results = Vec::with_capacity(samples);
    let mut i = 0;
    for _ in 0..samples {
        let start = std::time::Instant::now();
        for _ in 0..batch {
            op(i);
            i += 1;
        }
        results.push(start.elapsed().as_nanos() as f64 / batch as f64);
    }
    median(results)
}

fn c1_ping(entries: usize, label: &str, target_ns: u64) {
    let ids = ids(entries, 1);
    let now = Instant::from_nanos(1_000_000_000);
    let mut liveness = registry(&ids, now);
    let mut rng = Rng(2);
    let picks: Vec<InstanceId> = (0..1 << 20)
        .map(|_| ids[(rng.next() % entries as u64) as usize])
        .collect();
    let ns = per_call_ns(2000, 512, |i| {
        black_box(liveness.ping(now, Some(picks[i & ((1 << 20) - 1)])));
    });
    println!("C1 ping_median_{label} {ns:.1} ns (target <= {target_ns} ns)");
}

/// The reference design's tick: walk every instance and test its silence. Median
/// nanoseconds for one walk of `entries` instances.
fn full_scan_ns(ids: &[InstanceId], now: Instant) -> f64 {
    let mut table: HashMap<InstanceId, (u64, bool)> = HashMap::new();
    for &id in ids {
        table.insert(id, (now.as_nanos(), true));
    }
    let timeout = 120_000_000_000u64;
    let t = now.as_nanos() + 500_000_000;
    per_call_ns(7, 1, |_| {
        let due = table
            .values()
            .filter(|(last_seen, proven)| {
                let window = if *proven { timeout } else { 30 * timeout };
                t.saturating_sub(*last_seen) > window
            })
            .count();
        black_box(due);
    })
}

/// CPU nanoseconds this thread has run: a call timed with it does not count the time
/// the thread was preempted (the machines are shared).
fn thread_cpu_ns() -> u64 {
    let mut spec = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `spec` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut spec) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    spec.tv_sec as u64 * 1_000_000_000 + spec.tv_nsec as u64
}

/// The cost of reading the thread's CPU clock twice (a system call each), median: it
/// is subtracted from every timed call, so that C2 counts the core's work only.
fn timer_overhead_ns() -> u64 {
    let mut samples: Vec<u64> = (0..10_001)
        .map(|_| {
            let began = thread_cpu_ns();
            thread_cpu_ns() - began
        })
        .collect();
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// Drives `liveness` like a shell: `handle_timeout` at `now`, and again at once for as
/// long as `poll_timeout` asks. Returns the CPU nanoseconds of the calls and the
/// longest single call (thread CPU time, so preemption by other work is not counted).
fn turn(liveness: &mut Liveness<()>, now: Instant, overhead_ns: u64) -> (u64, u64) {
    let mut total = 0u64;
    let mut longest = 0u64;
    loop {
        let began = thread_cpu_ns();
        liveness.handle_timeout(now);
        let ns = (thread_cpu_ns() - began).saturating_sub(overhead_ns);
        total += ns;
        longest = longest.max(ns);
        while liveness.poll_effect().is_some() {}
        if liveness.poll_timeout().is_none_or(|wake| wake > now) {
            return (total, longest);
        }
    }
}

/// C2 and C6 in steady state: `entries` instances, registered one after another over
/// one reap timeout (T = 120 s), each pinging every 10 s from then on; a turn every
/// 100 ms. The figures cover two whole reap timeouts after the first, so every deferred
/// re-check of every instance is in them, twice.
fn c2_c6_steady_state(entries: usize, label: &str, scan_ns: f64, overhead_ns: u64) {
    const TURN_MS: u64 = 100;
    const PING_EVERY_TURNS: usize = 100; // 10 s
    let ids = ids(entries, 3);
    let timeout_turns = 1200; // T = 120 s
    let mut liveness: Liveness<()> = Liveness::new(Config::default(), Instant::ZERO).unwrap();
    // Instance i registers at turn i * 1200 / n and pings every 100 turns from then on.
    let registers_at = |i: usize| i * timeout_turns / entries;
    let mut by_phase: Vec<Vec<InstanceId>> = vec![Vec::new(); PING_EVERY_TURNS];
    let mut next_registration = 0usize;
    let (mut measured_ns, mut longest_ns, mut rechecks_window_s) = (0u64, 0u64, 0f64);
    let end_turn = 3 * timeout_turns;
    for turn_index in 0..end_turn {
        let now = Instant::from_nanos(turn_index as u64 * TURN_MS * 1_000_000);
        while next_registration < entries && registers_at(next_registration) <= turn_index {
            let id = ids[next_registration];
            if let Registration::Build(ticket) = liveness.register(now, id, Module::ServerDriven) {
                liveness.context_built(now, ticket, ());
            }
            by_phase[turn_index % PING_EVERY_TURNS].push(id);
            next_registration += 1;
        }
        for &id in &by_phase[turn_index % PING_EVERY_TURNS] {
            black_box(liveness.ping(now, Some(id)));
        }
        let (ns, longest) = turn(&mut liveness, now, overhead_ns);
        if turn_index >= timeout_turns {
            measured_ns += ns;
            longest_ns = longest_ns.max(longest);
            rechecks_window_s += TURN_MS as f64 / 1000.0;
        }
    }
    assert_eq!(liveness.status().reaped_total, 0);
    let ms_per_s = measured_ns as f64 / 1e6 / rechecks_window_s;
    // A full scan every R (1 s) of the same instances.
    let scan_ms_per_s = scan_ns / 1e6;
    println!(
        "C2 reaper_cpu_steady_{label} {ms_per_s:.4} ms/s (target <= 0.1 ms/s; {rechecks_window_s:.0} s of turns every 100 ms, re-checks included)"
    );
    println!(
        "C2 full_scan_every_r_{label} {scan_ms_per_s:.3} ms/s (the reference design at R = 1 s)"
    );
    println!(
        "C2 ratio_to_scan_{label} {:.1} x (target >= 10 x)",
        scan_ms_per_s / ms_per_s
    );
    println!(
        "C6 longest_handle_timeout_steady_{label} {:.3} ms (target <= 1 ms)",
        longest_ns as f64 / 1e6
    );
}

/// C6 after a server restart: `entries` instances register within one second, then
/// ping every 10 s; their re-checks all fall in one tick one reap timeout later.
fn c6_after_restart(entries: usize, label: &str, overhead_ns: u64) {
    const TURN_MS: u64 = 100;
    let ids = ids(entries, 6);
    let mut liveness: Liveness<()> = Liveness::new(Config::default(), Instant::ZERO).unwrap();
    let per_turn = entries.div_ceil(10);
    let mut longest_ns = 0u64;
    for turn_index in 0..(1300 + 20) {
        let now = Instant::from_nanos(turn_index as u64 * TURN_MS * 1_000_000);
        let phase = turn_index % 100;
        if turn_index < 10 {
            for &id in &ids[phase * per_turn..((phase + 1) * per_turn).min(entries)] {
                if let Registration::Build(ticket) =
                    liveness.register(now, id, Module::ServerDriven)
                {
                    liveness.context_built(now, ticket, ());
                }
            }
        }
        if phase < 10 {
            for &id in &ids[(phase * per_turn).min(entries)..((phase + 1) * per_turn).min(entries)]
            {
                black_box(liveness.ping(now, Some(id)));
            }
        }
        let (_, longest) = turn(&mut liveness, now, overhead_ns);
        longest_ns = longest_ns.max(longest);
    }
    assert_eq!(liveness.status().reaped_total, 0);
    println!(
        "C6 longest_handle_timeout_after_restart_{label} {:.3} ms (target <= 1 ms; {entries} registered in 1 s)",
        longest_ns as f64 / 1e6
    );
}

fn c3_reap(entries: usize, label: &str) {
    let ids = ids(entries, 4);
    let now = Instant::from_nanos(1_000_000_000);
    let mut liveness = registry(&ids, now);
    for &id in &ids {
        liveness.ping(now, Some(id));
    }
    // Walk to the deadline as a shell would (the stall guard wants regular ticks).
    let deadline = now + Duration::from_secs(121);
    let mut clock = now;
    while clock + Duration::from_secs(2) < deadline {
        clock = clock + Duration::from_secs(2);
        liveness.handle_timeout(clock);
    }
    // Every turn the core asks for, effects drained after each.
    let start = std::time::Instant::now();
    let mut freed = 0usize;
    loop {
        liveness.handle_timeout(deadline);
        while let Some(effect) = liveness.poll_effect() {
            if let Effect::FreeContext { .. } = effect {
                freed += 1;
            }
        }
        if liveness.poll_timeout().is_none_or(|wake| wake > deadline) {
            break;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / entries as f64;
    assert_eq!(freed, entries);
    println!("C3 reap_per_entry_{label} {ns:.1} ns (target <= 300 ns; effects drained)");
}

fn c4_memory(entries: usize, label: &str) {
    let ids = ids(entries, 5);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let liveness = registry(&ids, Instant::ZERO);
    let after = LIVE_BYTES.load(Ordering::Relaxed);
    let per_entry = (after - before) as f64 / entries as f64;
    println!("C4 bytes_per_entry_{label} {per_entry:.1} bytes (target <= 128; context excluded)");
    drop(liveness);
}

fn c7_node_ping() {
    use kvwarden_core::node::trust::{Trust, TrustConfig};
    use kvwarden_core::node::{ConnId, Input, Node, NodeConfig, Output, Transport};
    use kvwarden_core::protocol::Op;
    let config = NodeConfig {
        liveness: Config {
            reap_timeout: Duration::from_secs(120),
            ..Config::default()
        },
        reap_timeout_floor: Duration::ZERO,
        num_slots: 4,
        slot_bytes: 4096,
        server_uid: 1000,
        trust: TrustConfig::default(),
        boot_id: 1,
        server_name: "bench".into(),
        free_watchdog: Duration::from_secs(10),
        shutdown_drain: Duration::from_secs(10),
        cuda_devices: Err("none".into()),
        l2: None,
        connections: kvwarden_core::node::admission::ConnectionLimits::unbounded(),
        mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
        pool_window: kvwarden_core::node::jobs::UNBOUNDED,
        kv_publish: Vec::new(),
    };
    let now = Instant::from_nanos(1_000_000_000);
    let mut node = Node::new(config, now).unwrap();
    let conn = ConnId(1);
    let instance = InstanceId::new(42).unwrap();
    node.handle_input(
        now,
        Input::Connected {
            conn,
            uid: Some(1000),
            transport: Transport::Unix,
            process: None,
        },
    );
    let send = |node: &mut Node, request_id: u64, op: Op| {
        node.handle_input(
            now,
            Input::Request {
                conn,
                request_id,
                op,
                fds: 0,
            },
        );
        while let Some(output) = node.poll_output() {
            black_box(matches!(output, Output::Reply { .. }));
        }
    };
    send(
        &mut node,
        1,
        Op::Attach {
            instance,
            secret: vec![7; 32],
        },
    );
    send(
        &mut node,
        2,
        Op::RegisterEngineDriven {
            instance,
            model_name: "m".into(),
            world_size: 1,
        },
    );
    let ns = per_call_ns(2000, 512, |i| {
        send(
            &mut node,
            3 + i as u64,
            Op::Ping {
                instance: Some(instance),
            },
        );
    });
    println!(
        "C7 node_ping_median {ns:.1} ns (a ping through the node on a connection that attached its instance)"
    );
    let mut trust = Trust::new(&TrustConfig::default(), 1000).unwrap();
    let mut peer = trust.connect(Some(1000));
    trust.attach(&mut peer, instance, &[7; 32]).unwrap();
    let check_ns = per_call_ns(2000, 512, |_| {
        black_box(trust.require_identity(&peer, "ping").is_ok());
        black_box(trust.check(&peer, black_box(instance), "ping").is_ok());
    });
    println!(
        "C7 trust_check_median {check_ns:.1} ns (require_identity + check: what proving an instance costs a ping)"
    );
}

fn main() {
    // `cargo test --benches` runs this with --test-like flags: stay quick then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        c4_memory(1000, "1k");
        return;
    }
    // `KVWARDEN_BENCH_ONLY=C1` (or C2, C3, C4, C6; C2 and C6 run together) runs one.
    let only = std::env::var("KVWARDEN_BENCH_ONLY").ok();
    let wanted = |id: &str| only.as_deref().is_none_or(|only| only == id);
    println!("kvwarden-core benchmarks (C1-C4, C6 and C7 of docs/targets.md)");
    if wanted("C1") {
        c1_ping(100_000, "100k", 50);
        c1_ping(1_000_000, "1m", 150);
    }
    if wanted("C7") {
        c7_node_ping();
    }
    let overhead_ns = timer_overhead_ns();
    println!("-- timer overhead {overhead_ns} ns per timed call (thread CPU clock; subtracted)");
    for (entries, label) in [(100_000, "100k"), (1_000_000, "1m")] {
        if wanted("C2") || wanted("C6") {
            let scan_ns = full_scan_ns(&ids(entries, 7), Instant::from_nanos(1_000_000_000));
            c2_c6_steady_state(entries, label, scan_ns, overhead_ns);
            c6_after_restart(entries, label, overhead_ns);
        }
        if wanted("C3") {
            c3_reap(entries, label);
        }
        if wanted("C4") {
            c4_memory(entries, label);
        }
    }
}
