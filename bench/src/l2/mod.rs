//! L1–L4: the L2 tier on a real Redis Cluster (`targets.md`, "Beyond one node"). Two
//! `kvwarden serve --l2` processes ("node A" and "node B") share one cluster, started
//! here on loopback (3 masters, 1 replica each) unless `--l2` names one; the baselines
//! (`GET`/`SET` of the same values through a Redis Cluster client) run in the same run
//! against the same cluster.
//!
//! - L1: a 2 MiB chunk stored through A, retrieved through B (read-through from L2),
//!   checksum verified; p50 against a plain cluster `GET` of the same value.
//! - L2: throughput at 256 KiB and 2 MiB, with 1 client and with `--clients` (4), each
//!   figure the median of `--rounds` (3) rounds of `--chunks` (512) chunks a phase:
//!   write-behind (stores through A until L2 holds them) against `SET`, read-through
//!   (first retrieves through B) against `GET`, and `retrieve_batch` of `--batch` (64) L1
//!   misses through B against pipelines of as many `GET`s. One read in 4 of the
//!   read-through and batch phases (and of their `GET` baselines) names a key L2 does
//!   not hold, as a cache's reads do; each phase's figure counts the bytes of held keys
//!   served, so a held key that missed counts against it, and `hit_rate_held` says
//!   which share of held keys was served (target 1.0; `failure-modes.md` row 58). Every
//!   key of a round is deleted after it, so each starts against the same cluster.
//! - L3: every Redis node SIGSTOPped: ping p99, the latency of an L2-only retrieve (a
//!   miss), L1 still serving, nothing reaped. Needs a cluster started here.
//! - L4: a master SIGKILLed: how long until every write lands again, writes counted as
//!   failed or dropped meanwhile, corrupt values served (must be 0). Needs a cluster
//!   started here.

use super::process::ServerProcess;
use super::raw::RawConnection;
use super::stats::Samples;
use super::{BenchError, figure, progress};
use kvwarden_core::l2::{ClusterSecret, HEADER_BYTES, MAC_HEADER_BYTES, Namespace, ValueFormat};
use kvwarden_core::node::l2::WRITE_BEHIND_SLOTS_SHARE;
use kvwarden_core::protocol::status::L2StatusReport;
use rmpv::Value;
use std::time::{Duration, Instant};

/// The L1 slot of both servers: the largest chunk.
mod clients;
mod failures;
mod rounds;

use clients::*;
use failures::*;
use rounds::*;

const SLOT: u64 = 2 << 20;

/// Flags of `kvwarden bench l2`.
#[derive(Clone, Debug, clap::Args)]
pub struct L2Args {
    /// Measure against this Redis Cluster (seeds as for `kvwarden serve --l2`) instead
    /// of starting one; the fault figures L3 and L4 are then skipped (they stop and
    /// kill Redis processes).
    #[arg(long, value_name = "redis://HOST:PORT[,HOST:PORT...]")]
    l2: Option<String>,
    /// Chunks in each throughput phase (L2), split among its clients (the batch phase
    /// reads half as many), and chunks timed for L1.
    #[arg(long, default_value_t = 512, value_name = "N")]
    chunks: u64,
    /// Clients of the second set of throughput phases (the first has 1).
    #[arg(long, default_value_t = 4, value_name = "N")]
    clients: usize,
    /// Rounds of the throughput phases; each figure is their median.
    #[arg(long, default_value_t = 3, value_name = "N")]
    rounds: usize,
    /// Items of each `retrieve_batch` (and GETs of each pipeline) of the batch phase.
    #[arg(long, default_value_t = 64, value_name = "N")]
    batch: u64,
    /// How long every Redis node stays SIGSTOPped (L3).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    stop_seconds: f64,
    /// `--l2-timeout-ms` of both servers.
    #[arg(long, default_value_t = 50, value_name = "MS")]
    l2_timeout_ms: u64,
    /// `cluster-node-timeout` of the cluster started here; L4's target is 2 x this.
    /// Redis's own failover (redis_failover, printed beside kvwarden's part) took 2.4 s at
    /// 1000 ms and 3.3-4.1 s at 2000 ms here: about 1.5 x this plus 0.5-1 s of election
    /// delay, so only from about 3000 ms does it leave the client a margin.
    #[arg(long, default_value_t = 3000, value_name = "MS")]
    cluster_node_timeout_ms: u64,
    /// A tiny run (2 chunks, 1 s stop): checks that every figure is printed.
    #[arg(long)]
    smoke: bool,
    /// `--l2-secret-file` of both servers: every value carries a MAC (compare a run with
    /// and one without it).
    #[arg(long, value_name = "PATH")]
    l2_secret_file: Option<std::path::PathBuf>,
}

/// Prints what the value check costs per value, on this CPU and in this build: the
/// keyed-BLAKE3 MAC of `--l2-secret-file` and the xxh3 checksum without it (each value is
/// checked once when written and once when read).
fn print_value_check_cost(smoke: bool) {
    let build = if cfg!(debug_assertions) {
        "debug build: compare only with each other"
    } else {
        "release build"
    };
    let namespace = Namespace::default();
    let secret = ClusterSecret::from_file_bytes("bench", &[0x42; 32]).ok();
    for (label, size) in [("256KiB", 256u64 << 10), ("2MiB", SLOT)] {
        let payload = vec![0x5a_u8; size as usize];
        let rounds: u32 = if smoke { 2 } else { 64 };
        for (name, format) in [
            ("mac_ns_per_value", ValueFormat::new(secret.clone(), SLOT)),
            ("checksum_ns_per_value", ValueFormat::new(None, SLOT)),
        ] {
            let started = Instant::now();
            for round in 0..rounds {
                let header = format.header(&namespace, &round.to_le_bytes(), &payload);
                std::hint::black_box(header);
            }
            let ns = started.elapsed().as_nanos() / u128::from(rounds);
            figure(
                "L2",
                &format!("{name} {label}"),
                ns,
                "ns",
                &format!("one value's header computed, mean of {rounds}; {build}"),
            );
        }
    }
}

/// Runs L1–L4 and prints their figures.
pub fn run(args: &L2Args) -> Result<(), BenchError> {
    let args = checked(args)?;
    let stop = super::positive_seconds("--stop-seconds", args.stop_seconds)?;
    super::print_machine();
    print_value_check_cost(args.smoke);
    let header_bytes = if args.l2_secret_file.is_some() {
        MAC_HEADER_BYTES
    } else {
        HEADER_BYTES
    };
    let mut cluster = match &args.l2 {
        Some(_) => None,
        None => Some(start_cluster(args.cluster_node_timeout_ms)?),
    };
    let seeds: Vec<String> = match (&args.l2, &cluster) {
        (Some(seeds), _) => seeds.split(',').map(|s| s.trim().to_string()).collect(),
        (None, Some(cluster)) => cluster.seeds(),
        (None, None) => Vec::new(),
    };
    let namespace = format!("bench-{}", std::process::id());
    let (a, b) = start_servers(&args, &seeds, &namespace)?;
    progress(&format!(
        "two servers on {} (namespace {namespace})",
        seeds.join(",")
    ));
    let redis = Redis::connect(&seeds)?;
    let namespace = Namespace::new(&namespace)
        .map_err(|error| BenchError::Failed(format!("the bench namespace: {error}")))?;
    let mut keys = Keys::default();
    warm_up(&a, &b)?;
    let writer = Worker::new(&a.socket, SLOT, 1)?;
    let reader = Worker::new(&b.socket, SLOT, 1)?;
    let mut a_control = RawConnection::connect(&a.socket)?;
    let mut b_control = RawConnection::connect(&b.socket)?;
    let l2 = (&redis, &namespace, header_bytes);
    let batch = cross_node(&args, (&writer, &reader), &mut a_control, l2, &mut keys)?;

    let controls = (&mut a_control, &mut b_control);
    throughput(&args, (&a, &b), &seeds, l2, controls, &mut keys)?;

    let Some(cluster) = cluster.as_mut() else {
        for id in ["L3", "L4"] {
            figure(
                id,
                "skipped",
                "-",
                "-",
                "--l2 names a cluster this benchmark must not stop or kill",
            );
        }
        return Ok(());
    };

    let controls = (&mut a_control, &mut b_control);
    let l3 = (b.socket.as_path(), batch[0].as_slice(), stop);
    stopped_cluster(&args, cluster, (&writer, &reader), controls, l3, &mut keys)?;
    let controls = (&mut a_control, &mut b_control);
    killed_master(&args, cluster, &writer, controls, &mut keys)?;
    drop((a, b));
    Ok(())
}

/// L2: throughput at 256 KiB and 2 MiB, with 1 and `--clients` clients, the median
/// of `--rounds` rounds each.
fn throughput(
    args: &L2Args,
    (a, b): (&ServerProcess, &ServerProcess),
    seeds: &[String],
    (redis, namespace, header_bytes): (&Redis, &Namespace, usize),
    (a_control, b_control): (&mut RawConnection, &mut RawConnection),
    keys: &mut Keys,
) -> Result<(), BenchError> {
    let phases = Phases {
        a,
        b,
        seeds,
        namespace,
        header_bytes,
        chunks: args.chunks,
        batch: args.batch,
    };
    let mut client_counts = vec![1, args.clients];
    client_counts.dedup();
    for chunk in [256 << 10, SLOT] {
        for &clients in &client_counts {
            let mut rounds = Vec::new();
            for round in 0..args.rounds {
                progress(&format!(
                    "L2 {} KiB, {clients} client(s): round {} of {}",
                    chunk >> 10,
                    round + 1,
                    args.rounds
                ));
                rounds.push(phases.round(keys, a_control, b_control, redis, chunk, clients)?);
            }
            print_rounds(&rounds, chunk, clients, args.chunks, args.batch);
        }
    }
    Ok(())
}

/// `args` as this run uses them (a smoke run's small sizes), checked.
fn checked(args: &L2Args) -> Result<L2Args, BenchError> {
    let mut args = args.clone();
    if args.smoke {
        args.chunks = args.chunks.min(4);
        args.clients = args.clients.min(2);
        args.rounds = 1;
        args.batch = args.batch.min(2);
        args.stop_seconds = args.stop_seconds.min(1.0);
    }
    if args.cluster_node_timeout_ms < 100 {
        return Err(BenchError::Failed(format!(
            "invalid --cluster-node-timeout-ms {}: use at least 100 (Redis's default is 15000)",
            args.cluster_node_timeout_ms
        )));
    }
    if args.chunks == 0 || args.clients == 0 || args.rounds == 0 || args.batch == 0 {
        return Err(BenchError::Failed(format!(
            "invalid --chunks {} / --clients {} / --rounds {} / --batch {}: use at least 1 of each",
            args.chunks, args.clients, args.rounds, args.batch
        )));
    }
    if args.batch > kvwarden_core::protocol::MAX_BATCH_ITEMS as u64 {
        return Err(BenchError::Failed(format!(
            "invalid --batch {}: a retrieve_batch holds at most {} items",
            args.batch,
            kvwarden_core::protocol::MAX_BATCH_ITEMS
        )));
    }
    Ok(args)
}

/// Node A and node B, sharing L2 at `seeds` under `namespace`.
fn start_servers(
    args: &L2Args,
    seeds: &[String],
    namespace: &str,
) -> Result<(ServerProcess, ServerProcess), BenchError> {
    // L1 and the write queue hold a whole throughput phase: write-behind pins at most
    // a quarter of L1's slots, and a write past that (or past the queue) is dropped,
    // which would measure drops instead of L2. With --l1-prefault all of L1 is
    // allocated at start, so it is no larger than that.
    // The largest burst of writes is a throughput phase or L1's batch (at least 8); a
    // few more slots hold the clients' reservations and L3/L4's chunks.
    let phase = args.chunks.max(8);
    let l1_slots = phase * WRITE_BEHIND_SLOTS_SHARE as u64 + 2 * args.clients as u64 + 16;
    let l1_bytes = (l1_slots * SLOT).to_string();
    let queue_bytes = (phase * (SLOT + HEADER_BYTES as u64))
        .max(512 << 20)
        .to_string();
    let serve = |tag: &str| -> Result<ServerProcess, BenchError> {
        let mut flags: Vec<String> = [
            "--l1-bytes",
            &l1_bytes,
            "--slot-bytes",
            &SLOT.to_string(),
            // Steady state, as on a GPU node where L1 is page-locked: no figure pays for
            // a slot's first page faults.
            "--l1-prefault",
            "--l2",
            &seeds.join(","),
            "--l2-namespace",
            namespace,
            "--l2-timeout-ms",
            &args.l2_timeout_ms.to_string(),
            "--l2-write-queue-bytes",
            &queue_bytes,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(path) = &args.l2_secret_file {
            flags.push("--l2-secret-file".into());
            flags.push(path.display().to_string());
        }
        ServerProcess::start(tag, &flags, "warn")
    };
    let a = serve("bench-l2-a")?;
    let b = serve("bench-l2-b")?;
    Ok((a, b))
}

/// Each L2 thread connects on its first job: warm them all on both servers (lookups
/// of absent keys, many at once) so that no figure pays for a connect.
fn warm_up(a: &ServerProcess, b: &ServerProcess) -> Result<(), BenchError> {
    for server in [&a, &b] {
        let lookups: Vec<u64> = (0..16).collect();
        in_clients(&lookups, |_| {
            let mut connection = RawConnection::connect(&server.socket)?;
            for n in 0..4u64 {
                let absent = format!("warm-up-{n}").into_bytes();
                connection.call("lookup", vec![Value::Array(vec![Value::Binary(absent)])])?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// L1: cross-node latency, 2 MiB: stored through A, retrieved through B, against a
/// cluster GET of the same value. The keys it stored.
fn cross_node(
    args: &L2Args,
    (writer, reader): (&Worker, &Worker),
    a_control: &mut RawConnection,
    (redis, namespace, header_bytes): (&Redis, &Namespace, usize),
    keys: &mut Keys,
) -> Result<Vec<Vec<u8>>, BenchError> {
    let batch = keys.fresh(args.chunks.clamp(8, 128));
    for key in &batch {
        writer.store(key, SLOT)?;
    }
    wait_l2_ops(a_control, batch.len() as u64)?;
    let (mut through_b, mut get) = (Vec::new(), Vec::new());
    for key in &batch {
        let started = Instant::now();
        let value = redis.get(&namespace.redis_key(&own_tenant_key(key)))?;
        get.push(started.elapsed());
        if value.map(|v| v.len()) != Some(SLOT as usize + header_bytes) {
            return Err(BenchError::Failed(format!(
                "GET of {} found no {SLOT}-byte value with its header in L2 (did node A's write \
                 fail?)",
                String::from_utf8_lossy(key)
            )));
        }
        let started = Instant::now();
        let moved = reader.retrieve(key)?;
        through_b.push(started.elapsed());
        if moved != Some(SLOT) || reader.read_back(SLOT) != pattern(key, SLOT) {
            return Err(BenchError::Failed(format!(
                "retrieving {} through node B: {moved:?} bytes, or different bytes than node A \
                 stored",
                String::from_utf8_lossy(key)
            )));
        }
    }
    let (through_b, get) = (
        Samples::from_durations(&through_b),
        Samples::from_durations(&get),
    );
    let note = format!(
        "{} chunks of 2 MiB stored through A, retrieved through B, checksums equal",
        batch.len()
    );
    figure(
        "L1",
        "cross_node_retrieve_p50",
        format!("{:.3}", through_b.quantile_ms(0.5)),
        "ms",
        &note,
    );
    figure(
        "L1",
        "redis_get_p50",
        format!("{:.3}", get.quantile_ms(0.5)),
        "ms",
        "a cluster GET of the same value, same run",
    );
    figure(
        "L1",
        "ratio_vs_get",
        format!(
            "{:.2}",
            through_b.quantile_ms(0.5) / get.quantile_ms(0.5).max(1e-9)
        ),
        "x",
        "target <= 2",
    );
    Ok(batch)
}

/// MiB/s.
fn rate(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / (1u64 << 20) as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Runs `work` on each part in a thread of its own; the first error wins.
fn in_clients<T: Sync>(
    parts: &[T],
    work: impl Fn(&T) -> Result<(), BenchError> + Sync,
) -> Result<(), BenchError> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .map(|part| scope.spawn(|| work(part)))
            .collect();
        handles.into_iter().try_for_each(|handle| {
            handle
                .join()
                .unwrap_or_else(|_| Err(BenchError::Failed("a client thread panicked".into())))
        })
    })
}

fn l2_status(control: &mut RawConnection) -> Result<L2StatusReport, BenchError> {
    control.status()?.l2.ok_or_else(|| {
        BenchError::Failed("the server's status has no l2 section (started without --l2?)".into())
    })
}

/// Writes that ended, however: written, failed, timed out or dropped.
fn l2_ops(control: &mut RawConnection) -> Result<u64, BenchError> {
    Ok(l2_status(control)?.counters.writes + failed_ops(control)?)
}

fn failed_ops(control: &mut RawConnection) -> Result<u64, BenchError> {
    Ok(l2_status(control)?.counters.write_drops
        + l2_status(control)?.counters.errors
        + l2_status(control)?.counters.timeouts)
}

/// How long after `since` the Redis on `port` answered `ROLE` as a master (polled every
/// 10 ms for at most 60 s); None when it never did.
fn promoted_after(port: u16, since: Instant) -> Option<Duration> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut connection = client.get_connection().ok()?;
    while since.elapsed() < Duration::from_secs(60) {
        let role: Result<Vec<redis::Value>, _> = redis::cmd("ROLE").query(&mut connection);
        if let Ok(role) = role
            && matches!(role.first(), Some(redis::Value::BulkString(kind)) if kind == b"master")
        {
            return Some(since.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Waits until at least `ops` writes ended and the write-behind queue is empty.
fn wait_l2_ops(control: &mut RawConnection, ops: u64) -> Result<(), BenchError> {
    let started = Instant::now();
    loop {
        if l2_ops(control)? >= ops && l2_status(control)?.counters.queue_bytes == 0 {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Failed(format!(
                "the write-behind queue did not drain within 120 s ({} of {ops} writes ended)",
                l2_ops(control)?
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The bytes stored under `key`: derived from the key, so any reader can check them.
fn pattern(key: &[u8], nbytes: u64) -> Vec<u8> {
    let seed = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..nbytes)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u8)
        .collect()
}
