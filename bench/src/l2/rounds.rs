//! L2: the throughput rounds (write-behind, read-through, batches) and their figures.

use crate::raw::RawConnection;
use crate::{BenchError, figure};
use kvwarden_core::l2::Namespace;
use std::time::Instant;

/// The L1 slot of both servers: the largest chunk.
use super::*;

/// One round of the L2 throughput phases, MiB/s each.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Round {
    pub(super) write_behind: f64,
    pub(super) set: f64,
    pub(super) read_through: f64,
    pub(super) get: f64,
    pub(super) batch_read_through: f64,
    pub(super) batch_get: f64,
    /// Retrieves through B of keys L2 held (singly and batched).
    pub(super) held_reads: u64,
    /// Of those, the ones that missed (a read past --l2-timeout-ms is a miss by design).
    pub(super) missed: u64,
    /// Of those, the ones of `retrieve_batch`es.
    pub(super) missed_batched: u64,
    /// Retrieves through B of keys L2 did not hold that were served (must be 0).
    pub(super) absent_served: u64,
    /// B's L2 `timeouts` and `errors` during the read phases.
    pub(super) b_timeouts: u64,
    pub(super) b_errors: u64,
    /// Writes through A that failed, timed out or were dropped.
    pub(super) failed: u64,
}

/// What every round shares: the two servers, the cluster, the sizes.
pub(super) struct Phases<'a> {
    pub(super) a: &'a crate::process::ServerProcess,
    pub(super) b: &'a crate::process::ServerProcess,
    pub(super) seeds: &'a [String],
    pub(super) namespace: &'a Namespace,
    pub(super) header_bytes: usize,
    /// Chunks per phase, split among the clients.
    pub(super) chunks: u64,
    /// Items per `retrieve_batch` (and GETs per pipeline).
    pub(super) batch: u64,
}

impl Phases<'_> {
    /// Write-behind through A against SET, read-through through B against GET, then
    /// `retrieve_batch` through B against pipelined GETs; every key deleted after.
    pub(super) fn round(
        &self,
        keys: &mut Keys,
        a_control: &mut RawConnection,
        b_control: &mut RawConnection,
        redis: &Redis,
        chunk: u64,
        clients: usize,
    ) -> Result<Round, BenchError> {
        let per_client = (self.chunks / clients as u64).max(1);
        let total = per_client * clients as u64;
        let singles: Vec<Vec<Vec<u8>>> = (0..clients).map(|_| keys.fresh(per_client)).collect();
        let batch = self.batch.min(per_client).max(1);
        let batches_per_client = (per_client / 2 / batch).max(1);
        let batched: Vec<Vec<Vec<u8>>> = (0..clients)
            .map(|_| keys.fresh(batches_per_client * batch))
            .collect();
        let batched_total = batches_per_client * batch * clients as u64;
        let failed_before = failed_ops(a_control)?;

        let (write_behind, failed) = self.write(
            a_control,
            (&singles, &batched),
            chunk,
            (total, batched_total),
            failed_before,
        )?;

        let totals = (total, batched_total);
        let (single_reads, batched_reads, measured) = self.read(
            keys,
            b_control,
            (&singles, &batched),
            (chunk, batch),
            totals,
        )?;
        let phase = Reads {
            singles: &singles,
            batched: &batched,
            single_reads: &single_reads,
            batched_reads: &batched_reads,
            chunk,
            batch,
            totals: (total, batched_total),
        };
        let (set, get, batch_get, set_names, batch_names) = self.baselines(&phase)?;
        self.clean_up(redis, (set_names, batch_names), (&singles, &batched))?;
        Ok(Round {
            write_behind,
            set,
            get,
            batch_get,
            failed,
            ..measured
        })
    }

    /// The reads through B, one in 4 of a key L2 does not hold (first in each 4): singly,
    /// then in batches. The reads made, and what they measured.
    fn read(
        &self,
        keys: &mut Keys,
        b_control: &mut RawConnection,
        (singles, batched): (&PerClient, &PerClient),
        (chunk, batch): (u64, u64),
        (total, batched_total): (u64, u64),
    ) -> Result<(ReadsPerClient, ReadsPerClient, Round), BenchError> {
        let single_reads: Vec<Vec<Read>> = singles.iter().map(|held| mixed(keys, held)).collect();
        let batched_reads: Vec<Vec<Read>> = batched.iter().map(|held| mixed(keys, held)).collect();
        let (b_timeouts, b_errors) = (
            l2_status(b_control)?.counters.timeouts,
            l2_status(b_control)?.counters.errors,
        );
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let (missed, absent_served) = (AtomicU64::new(0), AtomicU64::new(0));
        let tally = |read: &Read, moved: Option<u64>| {
            if read.held && moved != Some(chunk) {
                missed.fetch_add(1, Relaxed);
            } else if !read.held && moved.is_some() {
                absent_served.fetch_add(1, Relaxed);
            }
        };
        let started = Instant::now();
        in_clients(&single_reads, |reads| {
            let worker = Worker::new(&self.b.socket, chunk, 1)?;
            for read in reads {
                tally(read, worker.retrieve(&read.key)?);
            }
            Ok(())
        })?;
        let missed_singles = missed.load(Relaxed);
        // Bytes of held keys served: a held key that missed counts against the figure.
        let read_through = rate((total - missed_singles) * chunk, started.elapsed());
        let started = Instant::now();
        in_clients(&batched_reads, |reads| {
            let worker = Worker::new(&self.b.socket, chunk, batch)?;
            for group in reads.chunks(batch as usize) {
                let keys: Vec<Vec<u8>> = group.iter().map(|read| read.key.clone()).collect();
                let answers = worker.retrieve_batch(&keys)?;
                for (read, moved) in group.iter().zip(answers) {
                    tally(read, moved);
                }
            }
            Ok(())
        })?;
        let missed_batched = missed.load(Relaxed) - missed_singles;
        let batch_read_through = rate((batched_total - missed_batched) * chunk, started.elapsed());
        let (b_timeouts, b_errors) = (
            l2_status(b_control)?.counters.timeouts - b_timeouts,
            l2_status(b_control)?.counters.errors - b_errors,
        );
        let measured = Round {
            read_through,
            batch_read_through,
            held_reads: total + batched_total,
            missed: missed.into_inner(),
            missed_batched,
            absent_served: absent_served.into_inner(),
            b_timeouts,
            b_errors,
            ..Round::default()
        };
        Ok((single_reads, batched_reads, measured))
    }

    /// Write-behind: stores through A until L2 holds them (MiB/s), then the batch phase's
    /// chunks, untimed; writes failed or dropped since `failed_before`.
    fn write(
        &self,
        a_control: &mut RawConnection,
        (singles, batched): (&PerClient, &PerClient),
        chunk: u64,
        (total, batched_total): (u64, u64),
        failed_before: u64,
    ) -> Result<(f64, u64), BenchError> {
        let before = l2_ops(a_control)?;
        let started = Instant::now();
        in_clients(singles, |keys| {
            let worker = Worker::new(&self.a.socket, chunk, 1)?;
            keys.iter().try_for_each(|key| worker.store(key, chunk))
        })?;
        wait_l2_ops(a_control, before + total)?;
        let write_behind = rate(total * chunk, started.elapsed());
        // The batch phase's chunks, stored untimed.
        let before = l2_ops(a_control)?;
        in_clients(batched, |keys| {
            let worker = Worker::new(&self.a.socket, chunk, 1)?;
            keys.iter().try_for_each(|key| worker.store(key, chunk))
        })?;
        wait_l2_ops(a_control, before + batched_total)?;
        let failed = failed_ops(a_control)? - failed_before;
        Ok((write_behind, failed))
    }

    /// Deletes everything the round put in Redis: the next one starts as empty.
    fn clean_up(
        &self,
        redis: &Redis,
        (set_names, batch_names): (PerClient, PerClient),
        (singles, batched): (&PerClient, &PerClient),
    ) -> Result<(), BenchError> {
        let mut names: Vec<Vec<u8>> = set_names.into_iter().chain(batch_names).flatten().collect();
        names.extend(
            singles
                .iter()
                .chain(batched)
                .flatten()
                .map(|key| self.namespace.redis_key(&own_tenant_key(key))),
        );
        redis.del(&names)?;
        Ok(())
    }

    /// The same round through a Redis Cluster client: SET, GET of the same mix, and
    /// pipelined GETs; the names it set, to delete.
    fn baselines(&self, phase: &Reads<'_>) -> Result<Baselines, BenchError> {
        let (chunk, batch) = (phase.chunk, phase.batch);
        let (total, batched_total) = phase.totals;
        let value = vec![7u8; chunk as usize + self.header_bytes];
        let baseline_name = |key: &[u8]| {
            let mut name = self.namespace.redis_key(&own_tenant_key(key));
            name.extend_from_slice(b":baseline");
            name
        };
        let baseline = |keys: &PerClient| -> Vec<Vec<Vec<u8>>> {
            keys.iter()
                .map(|keys| keys.iter().map(|key| baseline_name(key)).collect())
                .collect()
        };
        // GETs of the same mix: held names, and one in 4 never set.
        let baseline_reads = |reads: &Vec<Vec<Read>>| -> Vec<Vec<Vec<u8>>> {
            reads
                .iter()
                .map(|reads| reads.iter().map(|read| baseline_name(&read.key)).collect())
                .collect()
        };
        let (set_names, batch_names) = (baseline(phase.singles), baseline(phase.batched));
        let (get_names, batch_get_names) = (
            baseline_reads(phase.single_reads),
            baseline_reads(phase.batched_reads),
        );
        let started = Instant::now();
        in_clients(&set_names, |names| {
            let redis = Redis::connect(self.seeds)?;
            names.iter().try_for_each(|name| redis.set(name, &value))
        })?;
        let set = rate(total * chunk, started.elapsed());
        in_clients(&batch_names, |names| {
            let redis = Redis::connect(self.seeds)?;
            names.iter().try_for_each(|name| redis.set(name, &value))
        })?;
        let started = Instant::now();
        in_clients(&get_names, |names| {
            let redis = Redis::connect(self.seeds)?;
            names.iter().try_for_each(|name| redis.get(name).map(drop))
        })?;
        let get = rate(total * chunk, started.elapsed());
        let started = Instant::now();
        in_clients(&batch_get_names, |names| {
            let redis = Redis::connect(self.seeds)?;
            names
                .chunks(batch as usize)
                .try_for_each(|group| redis.get_pipelined(group))
        })?;
        let batch_get = rate(batched_total * chunk, started.elapsed());
        Ok((set, get, batch_get, set_names, batch_names))
    }
}

/// SET, GET and pipelined GET rates (MiB/s), and the names set, singly and for batches.
type Baselines = (f64, f64, f64, PerClient, PerClient);

/// Each client's keys (or names).
type PerClient = Vec<Vec<Vec<u8>>>;

/// Each client's reads.
type ReadsPerClient = Vec<Vec<Read>>;

/// A round's keys and reads, for its baselines.
pub(super) struct Reads<'a> {
    singles: &'a Vec<Vec<Vec<u8>>>,
    batched: &'a Vec<Vec<Vec<u8>>>,
    single_reads: &'a Vec<Vec<Read>>,
    batched_reads: &'a Vec<Vec<Read>>,
    chunk: u64,
    batch: u64,
    /// Held keys read singly, and in batches.
    totals: (u64, u64),
}

/// One read of a read phase: a key L2 holds, or one it does not.
pub(super) struct Read {
    pub(super) key: Vec<u8>,
    pub(super) held: bool,
}

/// The reads of `held`, with a fresh key L2 does not hold before every 3 of them.
pub(super) fn mixed(keys: &mut Keys, held: &[Vec<u8>]) -> Vec<Read> {
    let mut reads = Vec::new();
    for group in held.chunks(3) {
        for key in keys.fresh(1) {
            reads.push(Read { key, held: false });
        }
        reads.extend(group.iter().map(|key| Read {
            key: key.clone(),
            held: true,
        }));
    }
    reads
}

/// One figure of a round.
type Pick = fn(&Round) -> f64;

/// The median of `values` (the upper one of an even count).
pub(super) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Prints the median of each figure of `rounds`, and each ratio's median with every
/// round's ratio.
pub(super) fn print_rounds(rounds: &[Round], chunk: u64, clients: usize, chunks: u64, batch: u64) {
    let tag = format!("{}k_c{clients}", chunk >> 10);
    let how = format!(
        "{clients} client(s), {chunks} chunks of {} KiB a phase, median of {} rounds",
        chunk >> 10,
        rounds.len()
    );
    let failed: u64 = rounds.iter().map(|round| round.failed).sum();
    let of = |pick: fn(&Round) -> f64| median(rounds.iter().map(pick).collect());
    let lines: [(&str, Pick, String); 6] = [
        (
            "write_behind",
            |r| r.write_behind,
            format!("{how}, stores through A until L2 held them ({failed} failed or dropped)"),
        ),
        (
            "redis_set",
            |r| r.set,
            format!("{how}, cluster SET, same run"),
        ),
        (
            "read_through",
            |r| r.read_through,
            format!(
                "{how}, first retrieves through B, 1 in 4 of an absent key; bytes of held keys served"
            ),
        ),
        (
            "redis_get",
            |r| r.get,
            format!("{how}, cluster GET of the same mix, same run"),
        ),
        (
            "batch_read_through",
            |r| r.batch_read_through,
            format!("{how}, retrieve_batch of {batch} L1 misses through B, 1 in 4 absent"),
        ),
        (
            "redis_batch_get",
            |r| r.batch_get,
            format!("{how}, pipelines of {batch} cluster GETs of the same mix, same run"),
        ),
    ];
    for (name, pick, note) in &lines {
        figure(
            "L2",
            &format!("{name}_{tag}"),
            format!("{:.1}", of(*pick)),
            "MiB/s",
            note,
        );
    }
    print_hit_rate(rounds, &tag);
    print_ratios(rounds, &tag);
}

/// The share of held keys' reads that were served, over all rounds (target 1.0).
fn print_hit_rate(rounds: &[Round], tag: &str) {
    let missed: u64 = rounds.iter().map(|round| round.missed).sum();
    let held: u64 = rounds.iter().map(|round| round.held_reads).sum();
    let absent_served: u64 = rounds.iter().map(|round| round.absent_served).sum();
    let timeouts: u64 = rounds.iter().map(|round| round.b_timeouts).sum();
    let missed_batched: u64 = rounds.iter().map(|round| round.missed_batched).sum();
    let errors: u64 = rounds.iter().map(|round| round.b_errors).sum();
    figure(
        "L2",
        &format!("hit_rate_held_{tag}"),
        format!("{:.3}", (held - missed) as f64 / held.max(1) as f64),
        "x",
        &format!(
            "{} of {held} reads of held keys served in all rounds ({missed} missed, \
             {missed_batched} of them in batches; B's L2 timeouts {timeouts}, errors \
             {errors}); absent keys served {absent_served}; target 1.0",
            held - missed
        ),
    );
}

/// Each phase over its Redis baseline, the median of the rounds (target 0.9).
fn print_ratios(rounds: &[Round], tag: &str) {
    let of = |pick: fn(&Round) -> f64| median(rounds.iter().map(pick).collect());
    let ratios: [(&str, Pick, &str); 3] = [
        (
            "ratio_write_behind",
            |r| r.write_behind / r.set.max(1e-9),
            "write-behind / SET",
        ),
        (
            "ratio_read_through",
            |r| r.read_through / r.get.max(1e-9),
            "read-through / GET",
        ),
        (
            "ratio_batch",
            |r| r.batch_read_through / r.batch_get.max(1e-9),
            "retrieve_batch / pipelined GETs",
        ),
    ];
    for (name, pick, what) in ratios {
        let each: Vec<String> = rounds.iter().map(|r| format!("{:.2}", pick(r))).collect();
        figure(
            "L2",
            &format!("{name}_{tag}"),
            format!("{:.2}", of(pick)),
            "x",
            &format!("{what}, median of rounds {}; target >= 0.9", each.join(" ")),
        );
    }
}
