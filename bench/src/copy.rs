//! S6: `store` + `retrieve` bandwidth for 2 MiB chunks (memfd ↔ L1), against a
//! single-thread `memcpy` (`copy_from_slice`) of the same chunk sizes over the same
//! working-set sizes, in the same run (target: ≥ 0.5 × memcpy).
//!
//! The kvwarden figure is end to end: request, the copy on the server's pool, reply.
//! The headline runs one request at a time (so the server copies on one thread, like
//! the baseline); a pipelined figure shows what a worker gets with several in flight.

use super::raw::{RawConnection, instance_ids, memfd_spec};
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use rmpv::Value;
use rustix::fd::AsFd;
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench copy`.
#[derive(Clone, Debug, clap::Args)]
pub struct CopyArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Bytes per store/retrieve (the L1 slot size of the started server).
    #[arg(long, default_value = "2M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    chunk_bytes: u64,
    /// The worker's memfd buffer (chunks are taken from it round robin).
    #[arg(long, default_value = "64M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    buffer_bytes: u64,
    /// The L1 of the started server.
    #[arg(long, default_value = "256M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    l1_bytes: u64,
    /// Seconds per direction and per setting.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    seconds: f64,
    /// Requests in flight for the pipelined figure.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pipelined: usize,
}

/// Bytes copied and the time it took.
#[derive(Copy, Clone, Debug, Default)]
struct Bandwidth {
    bytes: u64,
    elapsed: Duration,
}

impl Bandwidth {
    fn gib_per_s(self) -> f64 {
        self.bytes as f64 / (1u64 << 30) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Both directions together: total bytes over total time.
    fn plus(self, other: Bandwidth) -> Bandwidth {
        Bandwidth {
            bytes: self.bytes + other.bytes,
            elapsed: self.elapsed + other.elapsed,
        }
    }
}

/// Runs S6 and prints its figures.
pub fn run(args: &CopyArgs) -> Result<(), BenchError> {
    let seconds = super::positive_seconds("--seconds", args.seconds)?;
    let chunk = chunk_bytes(args)?;
    super::print_machine();
    let (l1, slot) = (args.l1_bytes.to_string(), chunk.to_string());
    let target = Target::start(
        &args.target,
        "bench-copy",
        &["--l1-bytes", &l1, "--slot-bytes", &slot],
    )?;
    let buffer_chunks = args.buffer_bytes / chunk;
    let l1_chunks = args.l1_bytes / chunk;
    let (memfd, _mapping) = worker_buffer(args.buffer_bytes, chunk)?;
    let instance = instance_ids(1)[0];
    let mut connection = target.connect()?;
    connection.register(
        instance,
        vec![memfd_spec(0, args.buffer_bytes)],
        &[memfd.as_fd()],
    )?;
    let mut copier = Copier {
        connection: &mut connection,
        instance,
        chunk,
        buffer_chunks,
        l1_chunks,
        next_key: 0,
    };
    // Warm-up: every L1 slot written once (its pages faulted in), every path taken.
    copier.stores(1, Duration::ZERO, l1_chunks)?;
    copier.retrieves(1, Duration::ZERO, l1_chunks)?;

    let memcpy_before = memcpy_bandwidth(chunk, buffer_chunks, l1_chunks, seconds);
    progress(&format!(
        "memcpy baseline: {:.2} GiB/s",
        memcpy_before.gib_per_s()
    ));
    let store_1 = copier.stores(1, seconds, u64::MAX)?;
    let retrieve_1 = copier.retrieves(1, seconds, u64::MAX)?;
    progress(&format!(
        "one in flight: store {:.2} GiB/s, retrieve {:.2} GiB/s",
        store_1.gib_per_s(),
        retrieve_1.gib_per_s()
    ));
    let depth = args.pipelined.clamp(1, super::raw::PIPELINE_DEPTH);
    progress(&format!("{depth} in flight..."));
    let store_n = copier.stores(depth, seconds, u64::MAX)?;
    let retrieve_n = copier.retrieves(depth, seconds, u64::MAX)?;
    let memcpy_after = memcpy_bandwidth(chunk, buffer_chunks, l1_chunks, seconds);
    progress(&format!(
        "memcpy baseline again: {:.2} GiB/s",
        memcpy_after.gib_per_s()
    ));
    connection.unregister(instance)?;

    let memcpy = if memcpy_before.gib_per_s() >= memcpy_after.gib_per_s() {
        memcpy_before
    } else {
        memcpy_after
    };
    let sizes = format!(
        "{} KiB chunks, worker buffer {} MiB, L1 {} MiB",
        chunk >> 10,
        args.buffer_bytes >> 20,
        args.l1_bytes >> 20
    );
    print_figures(
        [store_1, retrieve_1, store_n, retrieve_n],
        memcpy,
        depth,
        &sizes,
    );
    target.check_no_ping_answered_false()?;
    Ok(())
}

/// `--chunk-bytes`, when it is above 0 and fits the buffer and L1.
fn chunk_bytes(args: &CopyArgs) -> Result<u64, BenchError> {
    let chunk = args.chunk_bytes;
    if chunk == 0 || args.buffer_bytes < chunk || args.l1_bytes < chunk {
        return Err(BenchError::Failed(format!(
            "invalid sizes: --chunk-bytes {chunk} must be > 0 and fit both --buffer-bytes {} \
             and --l1-bytes {}",
            args.buffer_bytes, args.l1_bytes
        )));
    }
    Ok(chunk)
}

/// The worker's memfd buffer of `bytes`, every chunk written (resident, like a
/// worker's real buffer), and its mapping.
fn worker_buffer(
    bytes: u64,
    chunk: u64,
) -> Result<(std::os::fd::OwnedFd, crate::memfd::SharedMapping), BenchError> {
    let memfd = crate::memfd::create("kvwarden-bench-copy", bytes)
        .map_err(BenchError::io("creating the worker's memfd buffer"))?;
    let mapping = crate::memfd::SharedMapping::map(&memfd, bytes as usize)
        .map_err(BenchError::io("mapping the worker's memfd buffer"))?;
    let pattern: Vec<u8> = (0..chunk).map(|i| (i * 7 + 1) as u8).collect();
    for index in 0..bytes / chunk {
        mapping.write(index * chunk, &pattern);
    }
    Ok((memfd, mapping))
}

/// S6's lines: store, retrieve (one and `depth` in flight) and memcpy, and the ratios.
fn print_figures(measured: [Bandwidth; 4], memcpy: Bandwidth, depth: usize, sizes: &str) {
    let [store_1, retrieve_1, store_n, retrieve_n] = measured;
    let both_1 = store_1.plus(retrieve_1);
    let both_n = store_n.plus(retrieve_n);
    let rows = [
        ("store_bandwidth", store_1, "one request in flight"),
        ("retrieve_bandwidth", retrieve_1, "one request in flight"),
        ("store_retrieve_bandwidth", both_1, "one request in flight"),
    ];
    for (name, bandwidth, how) in rows {
        figure(
            "S6",
            name,
            format!("{:.2}", bandwidth.gib_per_s()),
            "GiB/s",
            &format!("{how}, {sizes}"),
        );
    }
    figure(
        "S6",
        "store_retrieve_bandwidth_pipelined",
        format!("{:.2}", both_n.gib_per_s()),
        "GiB/s",
        &format!("{depth} requests in flight, {sizes}"),
    );
    figure(
        "S6",
        "memcpy_bandwidth",
        format!("{:.2}", memcpy.gib_per_s()),
        "GiB/s",
        &format!("single-thread copy_from_slice, same sizes, better of two runs ({sizes})"),
    );
    figure(
        "S6",
        "ratio_vs_memcpy",
        format!("{:.2}", both_1.gib_per_s() / memcpy.gib_per_s().max(1e-9)),
        "x",
        "store+retrieve one in flight / memcpy; target >= 0.5",
    );
    figure(
        "S6",
        "ratio_vs_memcpy_pipelined",
        format!("{:.2}", both_n.gib_per_s() / memcpy.gib_per_s().max(1e-9)),
        "x",
        &format!("{depth} in flight (the server's pool copies in parallel)"),
    );
}

/// Stores and retrieves of one instance's buffer, chunk by chunk.
struct Copier<'c> {
    connection: &'c mut RawConnection,
    instance: u64,
    chunk: u64,
    buffer_chunks: u64,
    l1_chunks: u64,
    next_key: u64,
}

impl Copier<'_> {
    /// Stores fresh keys (each a real copy: a key already in L1 copies nothing) for
    /// `duration` or `limit` stores, `depth` in flight.
    fn stores(
        &mut self,
        depth: usize,
        duration: Duration,
        limit: u64,
    ) -> Result<Bandwidth, BenchError> {
        let (instance, chunk, buffer_chunks) = (self.instance, self.chunk, self.buffer_chunks);
        let first_key = self.next_key;
        let result = self.pipeline("store", depth, duration, limit, |n| {
            let key = first_key + n;
            vec![
                instance.into(),
                Value::Binary(key.to_le_bytes().to_vec()),
                0u64.into(),
                ((key % buffer_chunks) * chunk).into(),
                chunk.into(),
            ]
        });
        if let Ok((_, sent)) = &result {
            self.next_key += sent;
        }
        result.map(|(bandwidth, _)| bandwidth)
    }

    /// Retrieves the newer half of the L1's worth of stored keys round robin (all
    /// still held: LRU evicts the older ones first).
    fn retrieves(
        &mut self,
        depth: usize,
        duration: Duration,
        limit: u64,
    ) -> Result<Bandwidth, BenchError> {
        let (instance, chunk, buffer_chunks) = (self.instance, self.chunk, self.buffer_chunks);
        let resident = (self.l1_chunks / 2).min(self.next_key).max(1);
        let newest = self.next_key;
        self.pipeline("retrieve", depth, duration, limit, |n| {
            let key = newest - resident + n % resident;
            vec![
                instance.into(),
                Value::Binary(key.to_le_bytes().to_vec()),
                0u64.into(),
                ((n % buffer_chunks) * chunk).into(),
                chunk.into(),
            ]
        })
        .map(|(bandwidth, _)| bandwidth)
    }

    /// Sends requests `args(0..)` of `op`, `depth` in flight, until `duration` has
    /// passed (then waits for those out) or `limit` were sent; every reply must say
    /// the whole chunk moved. Returns the bandwidth and how many were sent.
    fn pipeline(
        &mut self,
        op: &str,
        depth: usize,
        duration: Duration,
        limit: u64,
        args: impl Fn(u64) -> Vec<Value>,
    ) -> Result<(Bandwidth, u64), BenchError> {
        let started = Instant::now();
        let (mut sent, mut answered) = (0u64, 0u64);
        loop {
            let open = started.elapsed() < duration || duration.is_zero();
            while open && sent < limit && sent - answered < depth as u64 {
                self.connection.send(op, args(sent), &[])?;
                sent += 1;
            }
            if answered == sent {
                break;
            }
            let reply = self.connection.receive()?;
            answered += 1;
            let moved = match reply.result {
                Ok(Value::Boolean(true)) => self.chunk,
                Ok(value) => value.as_u64().unwrap_or(0),
                Err(error) => {
                    return Err(BenchError::Failed(format!(
                        "the server refused `{op}`: {error}"
                    )));
                }
            };
            if moved != self.chunk {
                return Err(BenchError::Failed(format!(
                    "`{op}` of a {} byte chunk moved {moved} bytes (L1 full of pinned data, or a \
                     miss?)",
                    self.chunk
                )));
            }
        }
        Ok((
            Bandwidth {
                bytes: answered * self.chunk,
                elapsed: started.elapsed(),
            },
            sent,
        ))
    }
}

/// Single-thread `copy_from_slice` of `chunk`-byte pieces, worker-buffer-sized source
/// into an L1-sized destination and back, for `duration` per direction.
fn memcpy_bandwidth(
    chunk: u64,
    buffer_chunks: u64,
    l1_chunks: u64,
    duration: Duration,
) -> Bandwidth {
    let chunk = chunk as usize;
    let mut buffer = vec![1u8; chunk * buffer_chunks as usize];
    let mut l1 = vec![2u8; chunk * l1_chunks as usize];
    let mut total = Bandwidth::default();
    for to_l1 in [true, false] {
        let started = Instant::now();
        let mut n = 0u64;
        while started.elapsed() < duration {
            let b = (n % buffer_chunks) as usize * chunk;
            let l = (n % l1_chunks) as usize * chunk;
            if to_l1 {
                l1[l..l + chunk].copy_from_slice(&buffer[b..b + chunk]);
            } else {
                buffer[b..b + chunk].copy_from_slice(&l1[l..l + chunk]);
            }
            n += 1;
        }
        std::hint::black_box((&buffer, &l1));
        total = total.plus(Bandwidth {
            bytes: n * chunk as u64,
            elapsed: started.elapsed(),
        });
    }
    total
}
