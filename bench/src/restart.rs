//! W1: a restart that keeps the node's cache warm (issue 48). A server on a pool file
//! (`--l1-file` on tmpfs, `--l1-secret-file`) is filled by real stores, SIGKILLed and
//! started again on the same file: the chunks it adopts over those it stored (target
//! ≥ 0.99), the time to `ready` and to the pool fully adopted, and the adoption rate
//! against a plain sequential read of the same pool file in the same run (target
//! ≥ 0.5 ×). A sample of the adopted chunks is retrieved and compared byte for byte.

use super::process::ServerProcess;
use super::raw::RawConnection;
use super::{BenchError, figure, progress, registered};
use kvwarden_core::protocol::StatusReport;
use kvwarden_core::protocol::status::AdoptionStatus;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench restart`.
#[derive(Clone, Debug, clap::Args)]
pub struct RestartArgs {
    /// The L1 pool, filled by stores before the SIGKILL.
    #[arg(long, default_value = "4G", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    l1_bytes: u64,
    /// Bytes per slot, and per stored chunk.
    #[arg(long, default_value = "2M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    slot_bytes: u64,
    /// Where the pool file goes (a tmpfs, as in production).
    #[arg(long, default_value = "/dev/shm", value_name = "DIR")]
    dir: std::path::PathBuf,
    /// A tiny run (16 MiB of 64 KiB chunks): checks that every figure is printed.
    #[arg(long)]
    smoke: bool,
}

/// How long a phase may take before the benchmark gives up.
const BOUND: Duration = Duration::from_secs(600);

/// Chunks of one `store_batch`.
const BATCH: u64 = 64;

/// The bytes of chunk `n` (distinct per chunk and per byte).
fn chunk(n: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ n.wrapping_mul(40_503)) as u8)
        .collect()
}

fn key(n: u64) -> Vec<u8> {
    format!("restart-{n}").into_bytes()
}

/// Runs W1 and prints its figures.
pub fn run(args: &RestartArgs) -> Result<(), BenchError> {
    let (l1_bytes, slot_bytes) = if args.smoke {
        (16 << 20, 64 << 10)
    } else {
        (args.l1_bytes, args.slot_bytes)
    };
    if slot_bytes == 0 || l1_bytes < slot_bytes * BATCH {
        return Err(BenchError::Failed(format!(
            "invalid sizes: --l1-bytes {l1_bytes} must hold at least {BATCH} slots of \
             --slot-bytes {slot_bytes}"
        )));
    }
    super::print_machine();
    let (_dir, pool, flags) = pool_flags(args, l1_bytes, slot_bytes)?;

    let chunks = l1_bytes / slot_bytes;
    // What sealing costs the stores: the same fill into an anonymous pool first.
    let anonymous = ServerProcess::start("bench-restart", &flags[4..], "warn")?;
    let fill_started = Instant::now();
    fill(&anonymous.socket, chunks, slot_bytes)?;
    let anonymous_fill = fill_started.elapsed();
    drop(anonymous);

    let server = ServerProcess::start("bench-restart", &flags, "warn")?;
    progress(&format!(
        "storing {chunks} chunks of {} KiB ({} MiB) into a pool file under {}",
        slot_bytes >> 10,
        (chunks * slot_bytes) >> 20,
        args.dir.display()
    ));
    let fill_started = Instant::now();
    let stored = fill(&server.socket, chunks, slot_bytes)?;
    wait_status(&server.socket, "every stored chunk sealed", |status| {
        status.l1.sealing == 0
    })?;
    let sealed_fill = fill_started.elapsed();
    progress(&format!("{stored} stored and sealed; SIGKILL"));
    drop(server);

    let read_seconds = sequential_read(&pool)?;
    let pool_bytes = chunks * slot_bytes;
    let read_gbps = pool_bytes as f64 / 1e9 / read_seconds.max(1e-9);

    let started = Instant::now();
    let server = ServerProcess::start("bench-restart", &flags, "warn")?;
    let ready = started.elapsed();
    let adoption = wait_adopted(&server.socket)?;
    let adopted_wall = started.elapsed();
    let adopted = adoption.adopted;
    let adopted_bytes = adoption.adopted_bytes;
    let scan_seconds = adoption.seconds;
    let adoption_gbps = pool_bytes as f64 / 1e9 / scan_seconds.max(1e-9);
    let (checked, identical) = verify(&server.socket, stored, slot_bytes)?;

    let measured = Restarted {
        stored,
        adopted,
        adopted_bytes,
        dropped: serde_json::to_value(&adoption.dropped).unwrap_or_default(),
        ready,
        adopted_wall,
        scan_seconds,
        adoption_gbps,
        read_gbps,
        pool_bytes,
        fills: (sealed_fill, anonymous_fill),
        checked: (checked, identical),
    };
    measured.print(slot_bytes);
    if identical != checked {
        return Err(BenchError::Failed(format!(
            "{} of {checked} chunks retrieved after the restart differ from what was stored",
            checked - identical
        )));
    }
    Ok(())
}

/// A directory under `--dir` for the pool file and its secret, and the server's flags.
fn pool_flags(
    args: &RestartArgs,
    l1_bytes: u64,
    slot_bytes: u64,
) -> Result<(tempfile::TempDir, std::path::PathBuf, Vec<String>), BenchError> {
    let dir = tempfile::Builder::new()
        .prefix("kvwarden-bench-restart-")
        .tempdir_in(&args.dir)
        .map_err(BenchError::io(format!(
            "creating a directory under {} (name a tmpfs with --dir)",
            args.dir.display()
        )))?;
    let pool = dir.path().join("l1.pool");
    let secret = dir.path().join("l1.secret");
    let secret_bytes: Vec<u8> = (0..4)
        .flat_map(|_| kvwarden_core::InstanceId::generate().get().to_le_bytes())
        .collect();
    std::fs::write(&secret, secret_bytes)
        .map_err(BenchError::io(format!("writing {}", secret.display())))?;
    let flags: Vec<String> = [
        "--l1-file",
        &pool.display().to_string(),
        "--l1-secret-file",
        &secret.display().to_string(),
        "--l1-bytes",
        &l1_bytes.to_string(),
        "--slot-bytes",
        &slot_bytes.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    Ok((dir, pool, flags))
}

/// What a restart on the pool file measured.
struct Restarted {
    stored: u64,
    adopted: u64,
    adopted_bytes: u64,
    dropped: serde_json::Value,
    ready: Duration,
    adopted_wall: Duration,
    scan_seconds: f64,
    adoption_gbps: f64,
    read_gbps: f64,
    pool_bytes: u64,
    /// The fill onto the pool file (every seal written) and into an anonymous pool.
    fills: (Duration, Duration),
    /// Chunks retrieved after the restart, and those identical to what was stored.
    checked: (u64, u64),
}

impl Restarted {
    /// W1's lines.
    fn print(&self, slot_bytes: u64) {
        self.print_adoption(slot_bytes);
        self.print_rates();
    }

    /// What was adopted, and how soon.
    fn print_adoption(&self, slot_bytes: u64) {
        let Restarted {
            stored,
            adopted,
            adopted_bytes,
            ref dropped,
            ready,
            adopted_wall,
            scan_seconds,
            ..
        } = *self;
        let note = format!(
            "{stored} chunks of {} KiB stored, SIGKILL, restarted on the same pool file",
            slot_bytes >> 10
        );
        figure(
            "W1",
            "adopted_over_stored",
            format!("{:.4}", adopted as f64 / stored.max(1) as f64),
            "x",
            &format!(
                "{adopted} adopted ({} MiB), dropped {}; {note}; target >= 0.99",
                adopted_bytes >> 20,
                dropped
            ),
        );
        figure(
            "W1",
            "seconds_to_ready",
            format!("{:.3}", ready.as_secs_f64()),
            "s",
            "from spawning the restarted server to its `ready` line",
        );
        figure(
            "W1",
            "seconds_to_adopted",
            format!("{:.3}", adopted_wall.as_secs_f64()),
            "s",
            &format!(
                "from spawning it to /status saying the scan is done (the scan itself: {scan_seconds:.3} s)"
            ),
        );
    }

    /// The rates: the scan, the read, the fills; and the chunks compared.
    fn print_rates(&self) {
        let Restarted {
            adoption_gbps,
            read_gbps,
            pool_bytes,
            fills: (sealed_fill, anonymous_fill),
            checked: (checked, identical),
            ..
        } = *self;
        figure(
            "W1",
            "adoption_gb_per_s",
            format!("{adoption_gbps:.2}"),
            "GB/s",
            &format!(
                "{} MiB of pool scanned (every seal checked over its value) on the server's pool threads",
                pool_bytes >> 20
            ),
        );
        figure(
            "W1",
            "sequential_read_gb_per_s",
            format!("{read_gbps:.2}"),
            "GB/s",
            "the same pool file read once, 8 MiB at a time, one thread, same run",
        );
        figure(
            "W1",
            "ratio_adoption_over_read",
            format!("{:.2}", adoption_gbps / read_gbps.max(1e-9)),
            "x",
            "adoption rate over the sequential read; target >= 0.5",
        );
        let gbps = |elapsed: Duration| pool_bytes as f64 / 1e9 / elapsed.as_secs_f64().max(1e-9);
        figure(
            "W1",
            "store_sealed_over_anonymous",
            format!("{:.2}", gbps(sealed_fill) / gbps(anonymous_fill)),
            "x",
            &format!(
                "filling the pool with store_batch of {BATCH}: {:.2} GB/s onto the pool file, every \
                 seal written, against {:.2} GB/s into an anonymous pool, same run",
                gbps(sealed_fill),
                gbps(anonymous_fill)
            ),
        );
        figure(
            "W1",
            "adopted_chunks_identical",
            format!("{identical}/{checked}"),
            "chunks",
            "a sample of the stored chunks retrieved after the restart, compared byte for byte",
        );
    }
}

/// Stores `chunks` chunks in batches of [`BATCH`]; returns how many were stored.
fn fill(socket: &Path, chunks: u64, slot_bytes: u64) -> Result<u64, BenchError> {
    let (client, buffer) = registered(socket, BATCH * slot_bytes, "bench-restart")?;
    let mut stored = 0;
    let mut first = 0;
    while first < chunks {
        let count = BATCH.min(chunks - first);
        for i in 0..count {
            buffer.write(i * slot_bytes, &chunk(first + i, slot_bytes));
        }
        let keys: Vec<Vec<u8>> = (first..first + count).map(key).collect();
        let items: Vec<(&[u8], u64, u64, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (key.as_slice(), 0, i as u64 * slot_bytes, slot_bytes))
            .collect();
        let answers = client
            .store_batch(&items)
            .map_err(BenchError::client("store_batch"))?;
        stored += answers.iter().filter(|&&ok| ok).count() as u64;
        first += count;
    }
    Ok(stored)
}

/// Retrieves up to 64 of the `stored` chunks, spread over them: (checked, identical).
fn verify(socket: &Path, stored: u64, slot_bytes: u64) -> Result<(u64, u64), BenchError> {
    let (client, buffer) = registered(socket, slot_bytes, "bench-restart")?;
    let step = (stored / 64).max(1);
    let (mut checked, mut identical) = (0, 0);
    let mut got = vec![0u8; slot_bytes as usize];
    for n in (0..stored).step_by(step as usize) {
        checked += 1;
        if client
            .retrieve(&key(n), 0, 0, slot_bytes)
            .map_err(BenchError::client("retrieve"))?
            == Some(slot_bytes)
            && buffer.read(0, &mut got)
            && got == chunk(n, slot_bytes)
        {
            identical += 1;
        }
    }
    Ok((checked, identical))
}

/// Seconds to read `path` once from start to end, 8 MiB at a time.
fn sequential_read(path: &Path) -> Result<f64, BenchError> {
    let mut file =
        std::fs::File::open(path).map_err(BenchError::io(format!("opening {}", path.display())))?;
    let mut buffer = vec![0u8; 8 << 20];
    let started = Instant::now();
    let mut checksum = 0u8;
    loop {
        let n = file
            .read(&mut buffer)
            .map_err(BenchError::io(format!("reading {}", path.display())))?;
        if n == 0 {
            break;
        }
        // Touch what was read, as the scan does.
        checksum ^= buffer[..n].iter().fold(0u8, |a, &b| a ^ b);
    }
    let elapsed = started.elapsed().as_secs_f64();
    std::hint::black_box(checksum);
    Ok(elapsed)
}

/// Waits until the restarted server's scan of its pool file is done: its figures.
fn wait_adopted(socket: &Path) -> Result<AdoptionStatus, BenchError> {
    let status = wait_status(socket, "the pool adopted", |status| {
        status
            .l1
            .adoption
            .as_ref()
            .is_some_and(|adoption| adoption.state == "done")
    })?;
    status
        .l1
        .adoption
        .ok_or_else(|| BenchError::Failed("the status says no adoption".into()))
}

/// Polls the server's `/status` until `done` holds (at most [`BOUND`]): that status.
fn wait_status(
    socket: &Path,
    what: &str,
    done: impl Fn(&StatusReport) -> bool,
) -> Result<StatusReport, BenchError> {
    let mut connection = RawConnection::connect(socket)?;
    let started = Instant::now();
    loop {
        let status = connection.status()?;
        if done(&status) {
            return Ok(status);
        }
        if started.elapsed() > BOUND {
            return Err(BenchError::Failed(format!(
                "waited {BOUND:?} for {what}; the last status: {:?}",
                status.l1
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
