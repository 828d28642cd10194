//! E2: the server's own KV-event stream (`kvwarden serve --kv-events`, issue 42) at
//! store load. A worker stores chunks (2 MiB) in batches of 64 into a pool of 512 that
//! evicts, and describes each as a one-shard block (`describe_keys`, version 3), as the
//! connector's schedulers do, into two servers alike but for the stream, in alternated
//! rounds; a ZMQ subscriber decodes the stream's `KVEventBatch`es. Printed: the events
//! per second it got; the server's CPU with the stream over without it (target <=
//! 1.02 x); the lag from a block's `describe_keys` request to its `BlockStored` at the
//! subscriber, p50 and p99 (target p99 <= 100 ms); and from the store that evicted a
//! block to its `BlockRemoved`, p99 (target <= 1 s: the server knows at once).

use super::process::{ServerProcess, cpu_time};
use super::stats::Samples;
use super::{BenchError, figure, progress, registered};
use kvwarden_client::Client;
use rmpv::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench stream`.
#[derive(Clone, Debug, clap::Args)]
pub struct StreamArgs {
    /// Chunks stored in each round (into a pool of 512 of them: evictions too).
    #[arg(long, default_value_t = 2048)]
    chunks: u64,
    /// Bytes of a chunk (and of a slot).
    #[arg(long, default_value = "2M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    chunk_bytes: u64,
    /// A tiny run (256 chunks of 64 KiB a round): checks that every figure is printed.
    #[arg(long)]
    smoke: bool,
}

/// Slots of the pool.
const POOL_CHUNKS: u64 = 512;
/// Rounds on each server.
const ROUNDS: u64 = 3;
const BATCH: u64 = 64;
/// How long the subscriber may take to see the last round before the benchmark gives up.
const BOUND: Duration = Duration::from_secs(120);

/// A one-shard block's description, version 3: its key is its chain, shard and hash.
fn description(key: &[u8]) -> Vec<u8> {
    let value = Value::Array(vec![
        3.into(),
        Value::Binary(key.to_vec()),
        Value::Binary(key.to_vec()),
        Value::Nil,
        Value::Array((0..16).map(Value::from).collect()),
        Value::Nil,
        Value::Nil,
        Value::Array(vec![Value::Binary(key.to_vec())]),
        Value::Nil,
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &value).expect("writing to a Vec");
    bytes
}

/// Stores and describes blocks `range` in batches: when each block's batch was asked.
fn store(
    client: &Client,
    range: std::ops::Range<u64>,
    chunk: u64,
) -> Result<Vec<(Instant, Vec<u8>)>, BenchError> {
    let mut asked = Vec::new();
    let mut first = range.start;
    while first < range.end {
        let keys: Vec<Vec<u8>> = (first..(first + BATCH).min(range.end))
            .map(|n| format!("stream-{n}").into_bytes())
            .collect();
        let items: Vec<(&[u8], u64, u64, u64)> = (keys.iter().enumerate())
            .map(|(i, key)| (key.as_slice(), 0, i as u64 * chunk, chunk))
            .collect();
        let at = Instant::now();
        client
            .store_batch(&items)
            .map_err(BenchError::client("store_batch"))?;
        let metas: Vec<Vec<u8>> = keys.iter().map(|k| description(k)).collect();
        let described: Vec<(&[u8], &[u8])> = (keys.iter().zip(&metas))
            .map(|(k, m)| (k.as_slice(), m.as_slice()))
            .collect();
        client
            .describe_keys(&described)
            .map_err(BenchError::client("describe_keys"))?;
        asked.extend(keys.into_iter().map(|k| (at, k)));
        first += BATCH;
    }
    Ok(asked)
}

/// When the subscriber first saw each hash stored and removed.
#[derive(Default)]
struct Seen {
    stored: HashMap<Vec<u8>, Instant>,
    removed: HashMap<Vec<u8>, Instant>,
}

/// Each message the subscriber received, and when.
type Received = Arc<Mutex<Vec<(Instant, Vec<u8>)>>>;

/// A ZMQ subscriber on the stream until `stop`. It only receives while the rounds run
/// (decoding then would take the CPU of this 2-core VM from the server with the stream
/// only); it decodes when it is finished.
struct Subscriber {
    received: Received,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Subscriber {
    fn start(endpoint: &str) -> Result<Subscriber, BenchError> {
        let failed = |e: zmq::Error| BenchError::Failed(format!("the subscriber: {e}"));
        let socket = zmq::Context::new().socket(zmq::SUB).map_err(failed)?;
        socket.set_subscribe(b"").map_err(failed)?;
        socket.set_rcvhwm(0).map_err(failed)?;
        socket.connect(endpoint).map_err(failed)?;
        let (received, stop): (Received, _) = Default::default();
        let stop: Arc<AtomicBool> = stop;
        let (received_in, stop_in) = (received.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !stop_in.load(Ordering::Acquire) {
                if socket.poll(zmq::POLLIN, 10).unwrap_or(0) > 0
                    && let Ok(mut frames) = socket.recv_multipart(0)
                    && frames.len() == 3
                {
                    let payload = frames.pop().unwrap_or_default();
                    received_in.lock().unwrap().push((Instant::now(), payload));
                }
            }
        });
        std::thread::sleep(Duration::from_millis(300)); // connected before the stores
        Ok(Subscriber {
            received,
            stop,
            thread,
        })
    }

    /// Waits until nothing has arrived for a while (the stream caught up).
    fn quiet(&self) -> Result<(), BenchError> {
        let (started, mut count, mut since) = (Instant::now(), usize::MAX, Instant::now());
        while since.elapsed() < Duration::from_millis(500) {
            let now = self.received.lock().unwrap().len();
            if now != count {
                (count, since) = (now, Instant::now());
            }
            if started.elapsed() > BOUND {
                return Err(BenchError::Failed("the stream never went quiet".into()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Stops, and decodes what arrived: when each hash was first stored and removed.
    fn finish(self) -> Seen {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
        let mut seen = Seen::default();
        for (at, payload) in self.received.lock().unwrap().iter() {
            let batch = rmpv::decode::read_value(&mut &payload[..]).ok();
            let events = batch
                .as_ref()
                .and_then(|b| b[1].as_array().cloned())
                .unwrap_or_default();
            for event in &events {
                let (kind, hash) = kind_and_hash(event);
                let into = if kind == "BlockStored" {
                    &mut seen.stored
                } else {
                    &mut seen.removed
                };
                if let Some(hash) = hash {
                    into.entry(hash).or_insert(*at);
                }
            }
        }
        seen
    }
}

/// An event's `type` and its first block hash.
fn kind_and_hash(event: &Value) -> (String, Option<Vec<u8>>) {
    let field = |name: &str| {
        event
            .as_map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    };
    let kind = field("type")
        .and_then(|t| t.as_str().map(str::to_owned))
        .unwrap_or_default();
    let hash =
        field("block_hashes").and_then(|h| h.as_array()?.first()?.as_slice().map(<[u8]>::to_vec));
    (kind, hash)
}

/// Server CPU and wall time for rounds of stores into one server.
#[derive(Default)]
struct Spent {
    cpu: Duration,
    wall: Duration,
}

/// A server of the benchmark: its worker's client, its pid, what its rounds cost.
type Measured = (Client, i32, Spent);

/// Alternated rounds of `chunks` blocks into each server, after a warm-up that writes
/// every page of their pools: every block the last server was given, in order.
fn rounds(
    servers: &mut [Measured],
    chunks: u64,
    chunk: u64,
) -> Result<Vec<(Instant, Vec<u8>)>, BenchError> {
    let mut all = Vec::new();
    for (client, _, _) in servers.iter() {
        all = store(client, 1 << 40..(1 << 40) + POOL_CHUNKS, chunk)?;
    }
    let (mut next, last) = (0, servers.len() - 1);
    for round in 1..=ROUNDS {
        for (n, (client, pid, spent)) in servers.iter_mut().enumerate() {
            let with = ["without", "with"][n.min(1)];
            progress(&format!(
                "round {round}/{ROUNDS}: {chunks} blocks stored and described, {with} the stream"
            ));
            let (cpu, wall) = (cpu_time(*pid).unwrap_or_default(), Instant::now());
            let asked = store(client, next..next + chunks, chunk)?;
            spent.wall += wall.elapsed();
            spent.cpu += cpu_time(*pid).unwrap_or_default() - cpu;
            if n == last {
                all.extend(asked);
            }
        }
        next += chunks;
    }
    Ok(all)
}

/// Nanoseconds the server's rule costs a block, in process (mean over many): its
/// description read and applied, its store and its eviction told to the announcer.
fn announce_ns() -> f64 {
    use kvwarden_core::kv_publish::{Announcer, BlockMeta};
    use kvwarden_core::protocol::KvTier;
    let keys: Vec<Vec<u8>> = (0..4096u32)
        .map(|n| format!("chunk-key-{n:08}-{:016x}", n * 7919).into_bytes())
        .collect();
    let metas: Vec<Vec<u8>> = keys.iter().map(|k| description(k)).collect();
    let mut announcer = Announcer::new();
    let rounds = 16;
    let started = Instant::now();
    for _ in 0..rounds {
        for (key, meta) in keys.iter().zip(&metas) {
            announcer.change(key, true, KvTier::L1);
            if let Some(block) = BlockMeta::decode(meta) {
                announcer.describe(key, block);
            }
        }
        for key in &keys {
            announcer.change(key, false, KvTier::L1);
        }
        std::hint::black_box(announcer.take());
    }
    started.elapsed().as_nanos() as f64 / (rounds * keys.len()) as f64
}

/// Runs E2 and prints its figures.
pub fn run(args: &StreamArgs) -> Result<(), BenchError> {
    let (chunks, chunk) = if args.smoke {
        (256, 64 << 10)
    } else {
        (args.chunks.max(BATCH), args.chunk_bytes.max(4096))
    };
    super::print_machine();
    let dir = tempfile::tempdir().map_err(|e| BenchError::Failed(format!("a temp dir: {e}")))?;
    let endpoint = format!("ipc://{}/stream", dir.path().display());
    let tenant = format!("uid-{}", rustix::process::getuid().as_raw());
    let pool = (POOL_CHUNKS * chunk).to_string();
    let mut flags: Vec<String> = ["--l1-bytes", &pool, "--slot-bytes", &chunk.to_string()]
        .map(str::to_owned)
        .to_vec();
    let plain = ServerProcess::start("bench-stream-off", &flags, "warn")?;
    flags.extend(["--kv-events".to_owned(), format!("{tenant}={endpoint}")]);
    let streamed = ServerProcess::start("bench-stream-on", &flags, "warn")?;
    let subscriber = Subscriber::start(&endpoint)?;
    let mut servers = Vec::new();
    for server in [&plain, &streamed] {
        let (client, _buffer) = registered(&server.socket, BATCH * chunk, "bench-stream")?;
        servers.push((client, server.pid(), Spent::default()));
    }
    let all = rounds(&mut servers, chunks, chunk)?;
    subscriber.quiet()?;
    let seen = subscriber.finish();
    if let Some((_, missed)) = all.iter().find(|(_, k)| !seen.stored.contains_key(k)) {
        let missed = String::from_utf8_lossy(missed);
        return Err(BenchError::Failed(format!("{missed} was never announced")));
    }
    let asked = &all[all.len() - chunks as usize..];
    let in_rounds = (all.iter().skip(POOL_CHUNKS as usize))
        .filter(|(_, k)| seen.stored.contains_key(k))
        .count() as u64;
    // Block k leaves when block k + POOL_CHUNKS is stored (one tenant, LRU).
    let withdrawals: Vec<Duration> = (all.iter().zip(all.iter().skip(POOL_CHUNKS as usize)))
        .filter_map(|((_, gone), (at, _))| {
            Some(seen.removed.get(gone)?.saturating_duration_since(*at))
        })
        .collect();
    let events = 2 * in_rounds; // each block of the rounds: stored, and one evicted
    print_figures(
        &seen,
        events,
        asked,
        &withdrawals,
        (&servers[0].2, &servers[1].2),
        chunks,
        chunk,
    );
    Ok(())
}

fn print_figures(
    seen: &Seen,
    events: u64,
    asked: &[(Instant, Vec<u8>)],
    withdrawals: &[Duration],
    (plain, streamed): (&Spent, &Spent),
    chunks: u64,
    chunk: u64,
) {
    let kib = chunk >> 10;
    let lags: Vec<Duration> = (asked.iter())
        .map(|(at, k)| seen.stored[k].saturating_duration_since(*at))
        .collect();
    let (lags, withdrawals) = (
        Samples::from_durations(&lags),
        Samples::from_durations(withdrawals),
    );
    figure(
        "E2",
        "events_per_second",
        format!(
            "{:.0}",
            events as f64 / (streamed.wall.as_secs_f64().max(1e-9))
        ),
        "/s",
        &format!(
            "{events} events (BlockStored, BlockRemoved) while {ROUNDS} rounds of {chunks} blocks of {kib} KiB were stored and described in {:.2} s",
            streamed.wall.as_secs_f64()
        ),
    );
    figure(
        "E2",
        "server_cpu_with_stream_over_without",
        format!(
            "{:.3}",
            streamed.cpu.as_secs_f64() / plain.cpu.as_secs_f64().max(1e-9)
        ),
        "x",
        &format!(
            "server CPU for {ROUNDS} alternated rounds of {chunks} stores and descriptions: {:.3} s with the stream ({:.2} s of requests), {:.3} s without ({:.2} s); target <= 1.02",
            streamed.cpu.as_secs_f64(),
            streamed.wall.as_secs_f64(),
            plain.cpu.as_secs_f64(),
            plain.wall.as_secs_f64()
        ),
    );
    figure(
        "E2",
        "describe_to_stored_p50",
        format!("{:.2}", lags.quantile_ms(0.5)),
        "ms",
        "from a block's store_batch request to its BlockStored at the subscriber (the last round)",
    );
    figure(
        "E2",
        "describe_to_stored_p99",
        format!("{:.2}", lags.quantile_ms(0.99)),
        "ms",
        &format!("the same, p99 of {} blocks; target <= 100", lags.len()),
    );
    figure(
        "E2",
        "eviction_to_removed_p99",
        format!("{:.2}", withdrawals.quantile_ms(0.99)),
        "ms",
        &format!(
            "from the store_batch request that evicted a block to its BlockRemoved, p99 of {}; target <= 1000",
            withdrawals.len()
        ),
    );
    print_rule_cost(plain, chunks);
}

/// What the server's rule costs a block in process, as a share of a store.
fn print_rule_cost(plain: &Spent, chunks: u64) {
    let per_store = plain.cpu.as_nanos() as f64 / (ROUNDS * chunks) as f64;
    let rule = announce_ns();
    figure(
        "E2",
        "announce_share_of_a_store",
        format!("{:.4}", rule / per_store.max(1e-9)),
        "x",
        &format!(
            "the server's rule costs a block {rule:.0} ns in process (its description read, \
             its store and eviction applied); a store and its description cost the server \
             {per_store:.0} ns of CPU here"
        ),
    );
}
