//! E1: KV events (issue 42) at store load. A worker stores chunks (2 MiB, a vLLM block
//! record's size for a Llama-3-8B-shaped cache) in batches of 64 into a pool that evicts,
//! first with nobody reading `kv_events`, then (new keys) with a reader asking every
//! `--poll-ms` as a router's feed would. Printed: the changes per second the reader
//! got; the server's CPU time with the reader over without it (target <= 1.02 x); the
//! lag from a store's request to its change at the reader, p50 and p99 (target p99 <=
//! 100 ms); what logging one change costs, in process, as a share of a store's server
//! CPU; and, after a SIGKILL of the server, how long until the reader knows (target
//! <= 1 s: the connector withdraws every block then).

use super::process::{ServerProcess, cpu_time};
use super::stats::Samples;
use super::{BenchError, client, figure, progress, registered};
use kvwarden_client::Client;
use kvwarden_core::node::events::KvEventLog;
use kvwarden_core::protocol::KvTier;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench events`.
#[derive(Clone, Debug, clap::Args)]
pub struct EventsArgs {
    /// Chunks stored in each phase (into a pool of 512 of them: evictions too).
    #[arg(long, default_value_t = 2048)]
    chunks: u64,
    /// Bytes of a chunk (and of a slot).
    #[arg(long, default_value = "2M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    chunk_bytes: u64,
    /// How often the reader asks for changes when it has caught up.
    #[arg(long, default_value_t = 10, value_name = "MS")]
    poll_ms: u64,
    /// A tiny run (256 chunks of {kib} KiB a phase): checks that every figure is printed.
    #[arg(long)]
    smoke: bool,
}

/// A `store_batch`: when it was asked, and its keys.
type Asked = (Instant, Vec<Vec<u8>>);

/// Slots of the pool.
const POOL_CHUNKS: u64 = 512;
/// Rounds without and with a reader.
const ROUNDS: u64 = 3;
const BATCH: u64 = 64;
/// How long the reader may take to catch up before the benchmark gives up.
const BOUND: Duration = Duration::from_secs(120);

fn key(n: u64) -> Vec<u8> {
    format!("events-{n}").into_bytes()
}

/// Stores chunks `range` (the buffer's bytes) in batches; returns when each batch was
/// asked, by its keys.
fn store(
    client: &Client,
    range: std::ops::Range<u64>,
    chunk: u64,
) -> Result<Vec<Asked>, BenchError> {
    let mut asked = Vec::new();
    let mut first = range.start;
    while first < range.end {
        let count = BATCH.min(range.end - first);
        let keys: Vec<Vec<u8>> = (first..first + count).map(key).collect();
        let items: Vec<(&[u8], u64, u64, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (key.as_slice(), 0, i as u64 * chunk, chunk))
            .collect();
        let at = Instant::now();
        client
            .store_batch(&items)
            .map_err(BenchError::client("store_batch"))?;
        asked.push((at, keys));
        first += count;
    }
    Ok(asked)
}

/// A reader asking `kv_events` until `stop`: when it first saw each stored key, and
/// how many changes it got.
struct Reader {
    seen: Arc<Mutex<HashMap<Vec<u8>, Instant>>>,
    changes: Arc<Mutex<u64>>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl Reader {
    fn start(socket: &Path, poll: Duration) -> Result<Reader, BenchError> {
        let client = client(socket)?;
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let changes = Arc::new(Mutex::new(0u64));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen_in, changes_in, stop_in) = (seen.clone(), changes.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut cursor = Vec::new();
            while !stop_in.load(Ordering::Acquire) {
                let page = client.kv_events(&cursor, 1024).map_err(|e| e.to_string())?;
                let now = Instant::now();
                *changes_in.lock().unwrap() += page.events.len() as u64;
                let mut seen = seen_in.lock().unwrap();
                for event in page.events.into_iter().filter(|e| e.stored) {
                    seen.entry(event.key).or_insert(now);
                }
                drop(seen);
                cursor = page.cursor;
                if !page.more {
                    std::thread::sleep(poll);
                }
            }
            Ok(())
        });
        Ok(Reader {
            seen,
            changes,
            stop,
            thread,
        })
    }

    fn finish(self) -> Result<u64, BenchError> {
        self.stop.store(true, Ordering::Release);
        self.thread
            .join()
            .map_err(|_| BenchError::Failed("the reader panicked".into()))?
            .map_err(|e| BenchError::Failed(format!("the reader: {e}")))?;
        Ok(*self.changes.lock().unwrap())
    }
}

/// Waits until the reader has seen every key stored in `asked`.
fn caught_up(reader: &Reader, asked: &[Asked]) -> Result<(), BenchError> {
    let waited = Instant::now();
    loop {
        let seen = reader.seen.lock().unwrap();
        if asked
            .iter()
            .flat_map(|(_, keys)| keys)
            .all(|k| seen.contains_key(k))
        {
            return Ok(());
        }
        drop(seen);
        if waited.elapsed() > BOUND {
            return Err(BenchError::Failed(
                "the reader did not see every store within 120 s".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Nanoseconds one change costs the log, in process (mean over many).
fn record_ns() -> f64 {
    let mut log = KvEventLog::new(1, &[]);
    let keys: Vec<Vec<u8>> = (0..4096u32)
        .map(|n| {
            let mut key = vec![8u8];
            key.extend_from_slice(b"uid-1000");
            key.extend_from_slice(format!("chunk-key-{n:08}-{:016x}", n * 7919).as_bytes());
            key
        })
        .collect();
    let rounds = 64;
    let started = Instant::now();
    for round in 0..rounds {
        for key in &keys {
            log.record(key, round % 2 == 0, KvTier::L1);
        }
    }
    started.elapsed().as_nanos() as f64 / (rounds * keys.len()) as f64
}

/// Runs E1 and prints its figures.
pub fn run(args: &EventsArgs) -> Result<(), BenchError> {
    let (chunks, chunk) = if args.smoke {
        (256, 64 << 10)
    } else {
        (args.chunks.max(BATCH), args.chunk_bytes.max(4096))
    };
    let kib = chunk >> 10;
    let poll = Duration::from_millis(args.poll_ms);
    super::print_machine();
    let flags: Vec<String> = vec![
        "--l1-bytes".into(),
        (POOL_CHUNKS * chunk).to_string(),
        "--slot-bytes".into(),
        chunk.to_string(),
    ];
    let server = ServerProcess::start("bench-events", &flags, "warn")?;
    let pid = server.pid();
    let (client, _buffer) = registered(&server.socket, BATCH * chunk, "bench-events")?;
    // Warm-up: every page of the pool written once, the server's threads started.
    store(&client, 1 << 40..(1 << 40) + POOL_CHUNKS, chunk)?;
    let cpu = || cpu_time(pid).unwrap_or_default();
    // Rounds of the same stores without and with a reader, alternated: the ratio is of
    // the sums, so that one noisy round weighs as little as it can. The last round's
    // reader gives the lags and the changes per second.
    let (mut cpu_alone, mut wall_alone) = (Duration::ZERO, Duration::ZERO);
    let (mut cpu_read, mut wall_read) = (Duration::ZERO, Duration::ZERO);
    let mut next = 0;
    let mut last = None;
    for round in 1..=ROUNDS {
        progress(&format!(
            "round {round}/{ROUNDS}: {chunks} stores of {kib} KiB, nobody reading kv_events"
        ));
        let (cpu_0, wall_0) = (cpu(), Instant::now());
        store(&client, next..next + chunks, chunk)?;
        cpu_alone += cpu() - cpu_0;
        wall_alone += wall_0.elapsed();
        next += chunks;
        progress(&format!(
            "round {round}/{ROUNDS}: {chunks} more with a reader asking every {} ms",
            args.poll_ms
        ));
        let reader = Reader::start(&server.socket, poll)?;
        std::thread::sleep(poll * 2); // its resync (the snapshot of what is held) first
        let (cpu_1, wall_1) = (cpu(), Instant::now());
        let asked = store(&client, next..next + chunks, chunk)?;
        let wall = wall_1.elapsed();
        caught_up(&reader, &asked)?;
        cpu_read += cpu() - cpu_1;
        wall_read += wall;
        next += chunks;
        if round == ROUNDS {
            last = Some((reader, asked, wall));
        } else {
            reader.finish()?;
        }
    }
    let Some((reader, asked, wall_last)) = last else {
        return Err(BenchError::Failed("no round ran".into()));
    };
    let lags: Vec<Duration> = {
        let seen = reader.seen.lock().unwrap();
        asked
            .iter()
            .flat_map(|(at, keys)| keys.iter().map(move |k| (at, k)))
            .map(|(at, k)| seen[k].saturating_duration_since(*at))
            .collect()
    };
    let changes = reader.finish()?;
    let lags = Samples::from_durations(&lags);
    let per_store_ns = cpu_alone.as_nanos() as f64 / (chunks * ROUNDS) as f64;
    let record = record_ns();

    let known = server_gone_known_after(server, poll)?;

    let spent = [(cpu_read, wall_read), (cpu_alone, wall_alone)];
    let run = (chunks, chunk, changes, wall_last);
    print_figures(args, run, spent, &lags, (per_store_ns, record, known));
    Ok(())
}

/// A reader of a server that dies (SIGKILL): how long until it knows.
fn server_gone_known_after(server: ServerProcess, poll: Duration) -> Result<Duration, BenchError> {
    let watcher = super::client(&server.socket)?;
    let mut cursor = watcher
        .kv_events(&[], 1024)
        .map_err(BenchError::client("kv_events"))?
        .cursor;
    let killed = Instant::now();
    drop(server);
    let known = loop {
        match watcher.kv_events(&cursor, 1024) {
            Ok(page) => cursor = page.cursor,
            Err(_) => break killed.elapsed(),
        }
        if killed.elapsed() > BOUND {
            return Err(BenchError::Failed(
                "the reader never saw the server go".into(),
            ));
        }
        std::thread::sleep(poll);
    };
    Ok(known)
}

/// E1's lines.
fn print_figures(
    args: &EventsArgs,
    (chunks, chunk, changes, wall_last): (u64, u64, u64, Duration),
    [(cpu_read, wall_read), (cpu_alone, wall_alone)]: [(Duration, Duration); 2],
    lags: &Samples,
    (per_store_ns, record, known): (f64, f64, Duration),
) {
    let kib = chunk >> 10;
    figure(
        "E1",
        "changes_per_second",
        format!("{:.0}", changes as f64 / wall_last.as_secs_f64().max(1e-9)),
        "/s",
        &format!(
            "{changes} changes read (stores and evictions) while {chunks} chunks of {kib} KiB \
             were stored in {:.2} s, polling every {} ms when caught up",
            wall_last.as_secs_f64(),
            args.poll_ms
        ),
    );
    figure(
        "E1",
        "server_cpu_with_reader_over_without",
        format!(
            "{:.3}",
            cpu_read.as_secs_f64() / cpu_alone.as_secs_f64().max(1e-9)
        ),
        "x",
        &format!(
            "server CPU for {ROUNDS} rounds of {chunks} stores of {kib} KiB, alternated: \
             {:.3} s with the reader ({:.2} s of stores), {:.3} s without ({:.2} s); \
             target <= 1.02",
            cpu_read.as_secs_f64(),
            wall_read.as_secs_f64(),
            cpu_alone.as_secs_f64(),
            wall_alone.as_secs_f64()
        ),
    );
    figure(
        "E1",
        "store_to_change_p50",
        format!("{:.2}", lags.quantile_ms(0.5)),
        "ms",
        "from a store_batch's request to the reader holding the change",
    );
    figure(
        "E1",
        "store_to_change_p99",
        format!("{:.2}", lags.quantile_ms(0.99)),
        "ms",
        &format!("the same, p99 of {} stores; target <= 100", lags.len()),
    );
    figure(
        "E1",
        "record_share_of_a_store",
        format!("{:.4}", record / per_store_ns.max(1e-9)),
        "x",
        &format!(
            "logging one change costs {record:.0} ns in process; a {kib} KiB store costs the \
             server {:.0} ns of CPU here",
            per_store_ns
        ),
    );
    figure(
        "E1",
        "server_gone_known_after",
        format!("{:.1}", known.as_secs_f64() * 1e3),
        "ms",
        &format!(
            "a reader asking every {} ms after the server's SIGKILL; the connector \
             withdraws every block then; target <= 1000",
            args.poll_ms
        ),
    );
}
