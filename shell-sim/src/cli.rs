//! The command line: `run` scenario files, `swarm` seeds, `bench` the speed.
//!
//! Exit codes: 0 pass; 2 a bad command line or scenario file; 127 a panic or internal
//! assertion; 128 a liveness violation; 129 a safety violation. With several failures
//! the first one (in file or seed order) decides.

use crate::config::{
    Action, FaultEvent, HeartbeatStart, InjectedBug, LinkSpec, ServerSpec, SimConfig, WorkerSpec,
};
use crate::expect;
use crate::rng::Rng;
use crate::scenario;
use crate::swarm;
use crate::time::{MILLISECOND, SECOND, as_seconds};
use crate::violation::{Class, Violation};
use crate::world::run_config;
use clap::{Parser, Subcommand};
use kvwarden_core::Module;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant as WallClock;

/// Exit code for a bad command line or scenario file.
pub const EXIT_BAD_INPUT: i32 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "kvwarden-sim",
    about = "Deterministic simulator of kvwarden: every failure mode as a scenario, and seeded swarms",
    after_help = "Exit codes: 0 pass, 2 bad input, 127 panic or internal assertion, 128 liveness violation, 129 safety violation."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run scenario files; print pass/fail per file.
    Run {
        /// Print each run's timeline.
        #[arg(short, long)]
        verbose: bool,
        /// Scenario files (TOML).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Run seeds, each drawing its own fault profile.
    Swarm {
        /// Seeds `A..B` (B excluded) or one seed `N`.
        #[arg(long)]
        seeds: Option<String>,
        /// A regression list: one seed per line, `#` comments.
        #[arg(long)]
        seeds_file: Option<PathBuf>,
        /// Run seeds twice and compare the trace hashes.
        #[arg(long)]
        check_determinism: bool,
        /// With --check-determinism, only every Nth seed (a sample).
        #[arg(long, default_value_t = 1)]
        determinism_every: u64,
        /// Worker threads (default: the machine's parallelism).
        #[arg(long)]
        jobs: Option<usize>,
        /// Print each seed's drawn parameters and timeline (use with one seed).
        #[arg(short, long)]
        verbose: bool,
        /// Print throughput figures.
        #[arg(long)]
        stats: bool,
        /// Inject a bug into the server model of every seed (to see the swarm catch it):
        /// skip_handle_timeout, double_free, keep_blend_state, keep_pins,
        /// timeout_before_input, ignore_pings, panic, late_wake, wall_clock,
        /// register_after_unregister, refresh_while_building, trust_any_connection,
        /// shared_keyspace, adopt_taken (the node's bugs need --features planted-bugs).
        #[arg(long)]
        inject_bug: Option<String>,
    },
    /// Measure virtual hours simulated per CPU second with many workers and faults.
    Bench {
        /// Workers.
        #[arg(long, default_value_t = 1000)]
        workers: usize,
        /// Virtual hours.
        #[arg(long, default_value_t = 1.0)]
        hours: f64,
        /// Seed of the fault profile.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// Parses the command line, runs it and returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    match cli.command {
        Command::Run { verbose, files } => run_files(&files, verbose),
        Command::Swarm {
            seeds,
            seeds_file,
            check_determinism,
            determinism_every,
            jobs,
            verbose,
            stats,
            inject_bug,
        } => {
            let bug = match injected_bug(inject_bug.as_deref()) {
                Ok(bug) => bug,
                Err(code) => return code,
            };
            let list = match seed_list(seeds, seeds_file) {
                Ok(list) => list,
                Err(code) => return code,
            };
            let options = SwarmOptions {
                check_determinism,
                determinism_every: determinism_every.max(1),
                jobs: jobs
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
                verbose,
                stats,
                bug,
            };
            run_swarm(&list, &options)
        }
        Command::Bench {
            workers,
            hours,
            seed,
        } => bench(workers, hours, seed),
    }
}

/// The bug `--inject-bug` names, if any; else the exit code of a bad name.
fn injected_bug(name: Option<&str>) -> Result<Option<InjectedBug>, i32> {
    let found = name.map(|name| {
        InjectedBug::ALL
            .iter()
            .find(|(_, label)| *label == name)
            .map(|(bug, _)| *bug)
            .ok_or(name)
    });
    match found {
        None => Ok(None),
        Some(Ok(bug)) if bug.available() => Ok(Some(bug)),
        Some(Ok(bug)) => {
            eprintln!(
                "kvwarden-sim: --inject-bug {} is a bug of the node: build with \
                 --features planted-bugs",
                bug.label()
            );
            Err(EXIT_BAD_INPUT)
        }
        Some(Err(name)) => {
            eprintln!("kvwarden-sim: --inject-bug {name:?} is not a known bug (see --help)");
            Err(EXIT_BAD_INPUT)
        }
    }
}

/// The seeds of `--seeds A..B` and `--seeds-file FILE`, at least one; else the exit
/// code of what is wrong.
fn seed_list(seeds: Option<String>, seeds_file: Option<PathBuf>) -> Result<Vec<u64>, i32> {
    let mut list = Vec::new();
    if let Some(range) = seeds {
        match swarm::parse_range(&range) {
            Ok(range) => list.extend(range),
            Err(error) => {
                eprintln!("kvwarden-sim: {error}");
                return Err(EXIT_BAD_INPUT);
            }
        }
    }
    if let Some(file) = seeds_file {
        let parsed = std::fs::read_to_string(&file)
            .map_err(|e| e.to_string())
            .and_then(|text| swarm::parse_seed_list(&text));
        match parsed {
            Ok(seeds) => list.extend(seeds),
            Err(error) => {
                eprintln!("kvwarden-sim: --seeds-file {}: {error}", file.display());
                return Err(EXIT_BAD_INPUT);
            }
        }
    }
    if list.is_empty() {
        eprintln!("kvwarden-sim: swarm needs --seeds A..B or --seeds-file FILE");
        return Err(EXIT_BAD_INPUT);
    }
    Ok(list)
}

/// Runs scenario files and prints one line per file; returns the exit code.
pub fn run_files(files: &[PathBuf], verbose: bool) -> i32 {
    let mut code = 0;
    let mut bad_input = false;
    for file in files {
        let scenario = match scenario::load(file) {
            Ok(scenario) => scenario,
            Err(error) => {
                eprintln!("ERROR {error}");
                bad_input = true;
                continue;
            }
        };
        let started = WallClock::now();
        let outcome = run_scenario(&scenario, verbose);
        let wall = started.elapsed();
        let name = file.display();
        if verbose {
            for line in &outcome.timeline {
                println!("  {line}");
            }
        }
        match &outcome.failure {
            None => println!(
                "PASS {name} ({} events, {:.0} virtual s, {:.1} ms)",
                outcome.events,
                as_seconds(outcome.end),
                wall.as_secs_f64() * 1e3
            ),
            Some((class, lines)) => {
                println!("FAIL {name} [{}]", class.label());
                for line in lines {
                    println!("  {line}");
                }
                println!("  replay: cargo run --release -p kvwarden-shell-sim -- run -v {name}");
                if code == 0 {
                    code = class.exit_code();
                }
            }
        }
    }
    if bad_input { EXIT_BAD_INPUT } else { code }
}

/// The result of a scenario: its failure class and lines, if it failed.
#[derive(Clone, Debug)]
pub struct ScenarioOutcome {
    /// The class of the first failure and every failure line.
    pub failure: Option<(Class, Vec<String>)>,
    /// Events processed.
    pub events: u64,
    /// Virtual time reached.
    pub end: u64,
    /// The timeline (verbose only).
    pub timeline: Vec<String>,
    /// The trace hash.
    pub trace_hash: u64,
}

/// Runs one scenario and judges its invariants and expectations.
pub fn run_scenario(scenario: &scenario::Scenario, verbose: bool) -> ScenarioOutcome {
    let checkpoints = expect::checkpoints(&scenario.expectations);
    let report = run_config(scenario.config.clone(), checkpoints, verbose);
    let mut lines = Vec::new();
    let mut class = None;
    if let Some(violation) = &report.violation {
        lines.push(violation.to_string());
        class = Some(violation.class);
    } else {
        for failure in expect::judge(&scenario.expectations, &report) {
            class.get_or_insert(failure.class);
            lines.push(failure.detail);
        }
    }
    ScenarioOutcome {
        failure: class.map(|c| (c, lines)),
        events: report.events,
        end: report.end,
        timeline: report.timeline,
        trace_hash: report.trace_hash,
    }
}

/// How a swarm runs.
#[derive(Clone, Debug)]
pub struct SwarmOptions {
    /// Run seeds twice and compare trace hashes.
    pub check_determinism: bool,
    /// Only every Nth seed is run twice.
    pub determinism_every: u64,
    /// Threads.
    pub jobs: usize,
    /// Print drawn parameters and the timeline.
    pub verbose: bool,
    /// Print throughput.
    pub stats: bool,
    /// A bug injected into every seed's server model.
    pub bug: Option<InjectedBug>,
}

/// One seed's result.
#[derive(Clone, Debug)]
pub struct SeedOutcome {
    /// The seed.
    pub seed: u64,
    /// Its first violation (a determinism mismatch is an internal one).
    pub violation: Option<Violation>,
    /// Events processed.
    pub events: u64,
    /// Virtual nanoseconds.
    pub virtual_nanos: u64,
    /// Timeline (verbose only).
    pub timeline: Vec<String>,
    /// L2 (rows 27–29): whether the profile ran with L2, writes carried out, reads
    /// answered with a hit, reads answered `Corrupt`, operations failed or timed out.
    pub l2: [u64; 5],
    /// Who is who (rows 30–33): whether the profile drew an adversary, `forbidden`
    /// replies to requests naming an instance, `forbidden` replies on TCP, reads
    /// answered as a miss for another tenant's key, fresh ids drawn after a squat.
    pub trust: [u64; 5],
    /// The pool file (rows 71–72): whether the profile ran with one, values adopted,
    /// reads served from adopted values, values dropped as torn, values lost to a store
    /// during the scan.
    pub pool: [u64; 5],
}

/// Runs one seed (twice when `twice`).
pub fn run_seed(seed: u64, twice: bool, verbose: bool) -> SeedOutcome {
    run_seed_with(seed, twice, verbose, None)
}

/// Runs one seed with a bug injected into its server model.
pub fn run_seed_with(
    seed: u64,
    twice: bool,
    verbose: bool,
    bug: Option<InjectedBug>,
) -> SeedOutcome {
    let mut cfg = swarm::draw(seed);
    cfg.bug = bug;
    let virtual_nanos = cfg.duration;
    let l2_enabled = cfg.server.l2.enabled;
    let pool_file = cfg.server.pool_file;
    let adversary = cfg.events.iter().any(|e| {
        matches!(
            e.action,
            Action::Poach(_) | Action::Impersonate(_) | Action::TcpProbe(_) | Action::Intrude(..)
        )
    });
    let report = run_config(cfg.clone(), Vec::new(), verbose);
    let mut violation = report.violation.clone();
    if twice && violation.is_none() {
        let again = run_config(cfg, Vec::new(), false);
        if again.trace_hash != report.trace_hash || again.events != report.events {
            violation = Some(Violation {
                class: Class::Internal,
                invariant: "nondeterministic",
                at: report.end,
                detail: format!(
                    "the same seed gave trace hashes {:#018x} ({} events) and {:#018x} ({} events)",
                    report.trace_hash, report.events, again.trace_hash, again.events
                ),
            });
        }
    }
    let stats = &report.last.server;
    SeedOutcome {
        seed,
        violation,
        events: report.events,
        virtual_nanos,
        timeline: report.timeline,
        l2: [
            u64::from(l2_enabled),
            stats.l2_written,
            stats.l2_hits,
            stats.l2_corrupt,
            stats.l2_failed,
        ],
        pool: [
            u64::from(pool_file),
            stats.adopted,
            stats.adopted_served,
            stats.dropped_torn,
            stats.dropped_taken,
        ],
        trust: [
            u64::from(adversary),
            stats.forbidden,
            stats.tcp_forbidden,
            stats.foreign_misses,
            report
                .last
                .workers
                .iter()
                .map(|w| w.stats.identity_changes)
                .sum(),
        ],
    }
}

/// Runs every seed on `options.jobs` threads; prints failures in seed order; returns
/// the exit code.
pub fn run_swarm(seeds: &[u64], options: &SwarmOptions) -> i32 {
    let started = WallClock::now();
    let results = run_seeds(seeds, options);
    let mut code = 0;
    let mut failures = 0;
    let mut totals = Totals::default();
    let mut by_invariant: std::collections::BTreeMap<&'static str, u64> = Default::default();
    for outcome in results.into_iter().flatten() {
        totals.add(&outcome);
        if options.verbose {
            println!(
                "SEED={} drawn parameters:\n{}",
                outcome.seed,
                swarm::describe(&swarm::draw(outcome.seed))
            );
            for line in &outcome.timeline {
                println!("  {line}");
            }
        }
        let Some(violation) = outcome.violation else {
            continue;
        };
        failures += 1;
        *by_invariant.entry(violation.invariant).or_default() += 1;
        if failures <= 20 {
            println!("SEED={} FAIL {violation}", outcome.seed);
            print!("{}", swarm::describe(&swarm::draw(outcome.seed)));
            println!(
                "  replay: cargo run --release -p kvwarden-shell-sim -- swarm --seeds {} -v{}",
                outcome.seed,
                options.bug.map_or(String::new(), |bug| format!(
                    " --inject-bug {}",
                    bug.label()
                ))
            );
        }
        if code == 0 {
            code = violation.class.exit_code();
        }
    }
    let wall = started.elapsed().as_secs_f64();
    if failures > 0 {
        let list: Vec<String> = by_invariant
            .iter()
            .map(|(name, n)| format!("{name}: {n}"))
            .collect();
        println!("failures by invariant: {}", list.join(", "));
    }
    println!(
        "swarm: {} seeds, {failures} failed, {:.1} s wall{}",
        seeds.len(),
        wall,
        if options.check_determinism {
            format!(
                ", determinism checked on every {} seed(s)",
                options.determinism_every
            )
        } else {
            String::new()
        }
    );
    if options.stats {
        totals.print(seeds.len() as f64 / wall, options.jobs);
    }
    code
}

/// Runs every seed on `options.jobs` threads; the outcomes in the seeds' order.
fn run_seeds(seeds: &[u64], options: &SwarmOptions) -> Vec<Option<SeedOutcome>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<SeedOutcome>>> = Mutex::new(vec![None; seeds.len()]);
    std::thread::scope(|scope| {
        for _ in 0..options.jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = seeds.get(index) else {
                        break;
                    };
                    let twice = options.check_determinism
                        && (index as u64).is_multiple_of(options.determinism_every);
                    let outcome = run_seed_with(seed, twice, options.verbose, options.bug);
                    results.lock().expect("no thread panics while holding it")[index] =
                        Some(outcome);
                }
            });
        }
    });
    results.into_inner().expect("threads joined")
}

/// What a swarm's seeds did together (`--stats`).
#[derive(Default)]
struct Totals {
    events: u64,
    virtual_nanos: u64,
    l2: [u64; 5],
    trust: [u64; 5],
    pool: [u64; 5],
}

impl Totals {
    fn add(&mut self, outcome: &SeedOutcome) {
        for (total, value) in self.trust.iter_mut().zip(outcome.trust) {
            *total += value;
        }
        for (total, value) in self.pool.iter_mut().zip(outcome.pool) {
            *total += value;
        }
        self.events += outcome.events;
        for (total, value) in self.l2.iter_mut().zip(outcome.l2) {
            *total += value;
        }
        self.virtual_nanos += outcome.virtual_nanos;
    }

    fn print(&self, seeds_per_second: f64, jobs: usize) {
        let (l2, trust, pool) = (self.l2, self.trust, self.pool);
        println!(
            "stats: seeds_per_second={seeds_per_second:.0} events={} virtual_hours={:.1} jobs={jobs}",
            self.events,
            as_seconds(self.virtual_nanos) / 3600.0,
        );
        println!(
            "stats: l2_runs={} l2_written={} l2_hits={} l2_corrupt={} l2_failed={}",
            l2[0], l2[1], l2[2], l2[3], l2[4]
        );
        println!(
            "stats: adversary_runs={} forbidden={} tcp_forbidden={} foreign_misses={} identity_changes={}",
            trust[0], trust[1], trust[2], trust[3], trust[4]
        );
        println!(
            "stats: pool_file_runs={} adopted={} adopted_served={} dropped_torn={} dropped_taken={}",
            pool[0], pool[1], pool[2], pool[3], pool[4]
        );
    }
}

/// The bench profile: `workers` workers with mixed traffic and a steady drizzle of
/// faults (crashes, restarts, partitions, freezes, starvation, a server pause).
pub fn bench_config(workers: usize, hours: f64, seed: u64) -> SimConfig {
    let mut rng = Rng::new(seed);
    let duration = (hours * 3600.0 * SECOND as f64) as u64;
    let mut specs = Vec::with_capacity(workers);
    for slot in 0..workers {
        let mut spec = WorkerSpec::new(format!("w{slot}"));
        spec.start_at = rng.between(0, 10_000) * MILLISECOND;
        spec.same_host = slot % 2 == 0;
        if slot % 3 == 0 {
            spec.traffic_every = Some(rng.between(5, 30) * SECOND);
            spec.heartbeat_start = HeartbeatStart::OnFirstTransfer;
        }
        if slot % 5 == 0 {
            spec.modules = vec![Module::ServerDriven, Module::EngineDriven];
        }
        spec.blend = slot % 7 == 0;
        spec.link = LinkSpec {
            delay: 200_000,
            jitter: 2 * MILLISECOND,
            loss: 0.001,
            duplicate: 0.001,
        };
        specs.push(spec);
    }
    let mut events = Vec::new();
    let mut at = 30 * SECOND;
    while at < duration.saturating_sub(300 * SECOND) {
        let slot = rng.between(0, workers as u64 - 1) as usize;
        let lasting = rng.between(10, 300) * SECOND;
        let (action, undo) = match rng.between(0, 5) {
            0 => (Action::Crash(vec![slot]), None),
            1 => (Action::Restart(vec![slot]), None),
            2 => (
                Action::Partition(vec![slot], crate::config::CutDirection::Both),
                Some(Action::Heal(vec![slot])),
            ),
            3 => (Action::Freeze(vec![slot]), Some(Action::Thaw(vec![slot]))),
            4 => (
                Action::StarveHeartbeat(vec![slot]),
                Some(Action::FeedHeartbeat(vec![slot])),
            ),
            _ => (Action::Register(vec![slot]), None),
        };
        events.push(FaultEvent { at, action });
        if let Some(undo) = undo {
            events.push(FaultEvent {
                at: at + lasting,
                action: undo,
            });
        }
        at += rng.between(1, 10) * SECOND;
    }
    events.push(FaultEvent {
        at: duration / 2,
        action: Action::ServerPause,
    });
    events.push(FaultEvent {
        at: duration / 2 + 200 * SECOND,
        action: Action::ServerResume,
    });
    events.sort_by_key(|e| e.at);
    SimConfig {
        name: format!("bench {workers} workers"),
        seed: rng.next_u64(),
        duration,
        server: ServerSpec::default(),
        workers: specs,
        events,
        bug: None,
        converge_at_end: false,
    }
}

fn bench(workers: usize, hours: f64, seed: u64) -> i32 {
    if workers == 0 || !(hours > 0.0 && hours.is_finite()) {
        eprintln!(
            "kvwarden-sim: bench needs --workers ≥ 1 and --hours > 0 (got {workers}, {hours})"
        );
        return EXIT_BAD_INPUT;
    }
    let cfg = bench_config(workers, hours, seed);
    let faults = cfg.events.len();
    let started = WallClock::now();
    let cpu_before = thread_cpu_nanos();
    let report = run_config(cfg, Vec::new(), false);
    let wall = started.elapsed().as_secs_f64();
    // The run is single-threaded: its thread's CPU time where Linux tells it, else wall.
    let cpu = match (cpu_before, thread_cpu_nanos()) {
        (Some(before), Some(after)) if after > before => (after - before) as f64 / 1e9,
        _ => wall,
    };
    let virtual_hours = as_seconds(report.end) / 3600.0;
    println!(
        "bench workers={workers} faults={faults} virtual_hours={virtual_hours:.3} events={} cpu_seconds={cpu:.3} wall_seconds={wall:.3}",
        report.events
    );
    println!(
        "bench virtual_hours_per_cpu_second={:.3}",
        virtual_hours / cpu
    );
    println!(
        "bench events_per_cpu_second={:.0}",
        report.events as f64 / cpu
    );
    match report.violation {
        None => 0,
        Some(violation) => {
            println!("FAIL {violation}");
            violation.class.exit_code()
        }
    }
}

/// CPU time of the calling thread in nanoseconds, from `/proc/thread-self/schedstat`
/// (Linux); None elsewhere.
fn thread_cpu_nanos() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}
