//! C1–C4 of `docs/targets.md`: `cargo bench -p kvwarden-core`.
//!
//! Prints one figure per line, `C<n> <name> <value> <unit> (target ...)`, so that runs
//! can be compared with `diff`. Timings are medians over many batches; the full-scan
//! baseline of C2 runs in the same process, right after, so machine drift cancels.

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

fn c2_idle_timeout_and_scan(entries: usize) {
    let ids = ids(entries, 3);
    let now = Instant::from_nanos(1_000_000_000);
    let mut liveness = registry(&ids, now);
    for &id in &ids {
        liveness.ping(now, Some(id));
    }
    // No bucket is due for another 120 s: the tick must cost O(1).
    let tick = now + Duration::from_millis(500);
    let idle_ns = per_call_ns(2000, 256, |_| liveness.handle_timeout(black_box(tick)));

    // The reference design: walk every entry and test its silence.
    let mut table: HashMap<(InstanceId, Module), (u64, bool)> = HashMap::new();
    for &id in &ids {
        table.insert((id, Module::ServerDriven), (now.as_nanos(), true));
    }
    let timeout = 120_000_000_000u64;
    let t = tick.as_nanos();
    let scan_ns = per_call_ns(5, 1, |_| {
        let due = table
            .values()
            .filter(|(last_seen, proven)| {
                let window = if *proven { timeout } else { 30 * timeout };
                t.saturating_sub(*last_seen) > window
            })
            .count();
        black_box(due);
    });
    println!("C2 handle_timeout_idle_1m {idle_ns:.1} ns (target <= 5000 ns)");
    println!("C2 full_scan_1m {scan_ns:.0} ns (the reference design's tick)");
    println!(
        "C2 speedup_vs_full_scan {:.0} x (target >= 300 x)",
        scan_ns / idle_ns
    );

    // The price of lazy re-checks, for context: each live entry is looked at again
    // about once per reap timeout. All entries here share one deadline bucket, so one
    // tick re-checks all of them (pinged since, so none is reaped).
    let mut clock = now;
    while clock < now + Duration::from_secs(119) {
        clock = clock + Duration::from_secs(2);
        liveness.handle_timeout(clock);
    }
    for &id in &ids {
        liveness.ping(clock, Some(id));
    }
    let began = std::time::Instant::now();
    liveness.handle_timeout(now + Duration::from_secs(121));
    let per_recheck = began.elapsed().as_nanos() as f64 / entries as f64;
    println!(
        "C2 recheck_per_live_entry {per_recheck:.1} ns (once per reap timeout: 1 M entries at T = 120 s cost {:.0} us per second of ticks)",
        per_recheck * entries as f64 / 120.0 / 1000.0
    );
    assert_eq!(liveness.status().reaped_total, 0);
}

fn c3_reap(entries: usize) {
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
    let start = std::time::Instant::now();
    liveness.handle_timeout(deadline);
    let mut freed = 0usize;
    while let Some(effect) = liveness.poll_effect() {
        if let Effect::FreeContext { .. } = effect {
            freed += 1;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / entries as f64;
    assert_eq!(freed, entries);
    println!("C3 reap_per_entry_1m {ns:.1} ns (target <= 300 ns; effects drained)");
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

fn main() {
    // `cargo test --benches` runs this with --test-like flags: stay quick then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        c4_memory(1000, "1k");
        return;
    }
    println!("kvwarden-core benchmarks (C1-C4 of docs/targets.md)");
    c1_ping(100_000, "100k", 50);
    c1_ping(1_000_000, "1m", 150);
    c2_idle_timeout_and_scan(1_000_000);
    c3_reap(1_000_000);
    c4_memory(100_000, "100k");
    c4_memory(1_000_000, "1m");
}
