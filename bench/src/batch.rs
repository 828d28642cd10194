//! B1: a step's blocks in one `store_batch` / `retrieve_batch` against one `store` /
//! `retrieve` a block, one request at a time (how the vLLM connector moved a step
//! before the batch ops).
//!
//! Each round moves `--blocks` blocks of `--block-bytes` (one L1 slot each) between the
//! worker's memfd and L1; stores always take fresh keys (a key already stored copies
//! nothing), retrieves the keys of the last stored round. The figure is end to end:
//! requests, the copies on the server's pool, replies.

use super::raw::{RawConnection, instance_ids, memfd_spec};
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use kvwarden_core::InstanceId;
use kvwarden_core::protocol::{MAX_BATCH_ITEMS, Op, RetrieveItem, StoreItem};
use rmpv::Value;
use rustix::fd::AsFd;
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench batch`.
#[derive(Clone, Debug, clap::Args)]
pub struct BatchArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Blocks per round (one batch, or as many single requests).
    #[arg(long, default_value_t = 64, value_name = "N")]
    blocks: u64,
    /// Bytes per block (the L1 slot size of the started server).
    #[arg(long, default_value = "256K", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    block_bytes: u64,
    /// The L1 of the started server.
    #[arg(long, default_value = "256M", value_name = "BYTES", value_parser = kvwarden_client::parse_bytes)]
    l1_bytes: u64,
    /// Seconds per direction and per way of sending.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    seconds: f64,
}

/// Rounds run and the time they took.
#[derive(Copy, Clone, Debug, Default)]
struct Rounds {
    rounds: u64,
    elapsed: Duration,
}

/// Runs B1 and prints its figures.
pub fn run(args: &BatchArgs) -> Result<(), BenchError> {
    let seconds = super::positive_seconds("--seconds", args.seconds)?;
    let (blocks, block) = (args.blocks, args.block_bytes);
    if blocks == 0 || blocks > MAX_BATCH_ITEMS as u64 || block == 0 {
        return Err(BenchError::Failed(format!(
            "invalid sizes: --blocks {blocks} must be 1..={MAX_BATCH_ITEMS} and --block-bytes \
             {block} > 0"
        )));
    }
    if args.l1_bytes < 2 * blocks * block {
        return Err(BenchError::Failed(format!(
            "--l1-bytes {} must hold two rounds ({} bytes): retrieves read the last round's keys",
            args.l1_bytes,
            2 * blocks * block
        )));
    }
    super::print_machine();
    let (l1, slot) = (args.l1_bytes.to_string(), block.to_string());
    let target = Target::start(
        &args.target,
        "bench-batch",
        &["--l1-bytes", &l1, "--slot-bytes", &slot],
    )?;
    // The source blocks, then where retrieves put them.
    let buffer_bytes = 2 * blocks * block;
    let memfd = crate::memfd::create("kvwarden-bench-batch", buffer_bytes)
        .map_err(BenchError::io("creating the worker's memfd buffer"))?;
    let mapping = crate::memfd::SharedMapping::map(&memfd, buffer_bytes as usize)
        .map_err(BenchError::io("mapping the worker's memfd buffer"))?;
    let pattern: Vec<u8> = (0..block).map(|i| (i * 7 + 1) as u8).collect();
    for index in 0..2 * blocks {
        mapping.write(index * block, &pattern); // resident, like a worker's real buffer
    }
    let raw_instance = instance_ids(1)[0];
    let instance = InstanceId::new(raw_instance)
        .map_err(|e| BenchError::Failed(format!("instance id: {e}")))?;
    let mut connection = target.connect()?;
    connection.register(
        raw_instance,
        vec![memfd_spec(0, buffer_bytes)],
        &[memfd.as_fd()],
    )?;
    let mut mover = Mover {
        connection: &mut connection,
        instance,
        blocks,
        block,
        next_round: 0,
    };
    // Warm-up: every way taken, the L1 slots touched.
    for batched in [false, true] {
        mover.measure(Direction::Store, batched, Duration::ZERO)?;
        mover.measure(Direction::Retrieve, batched, Duration::ZERO)?;
    }
    let mut results = Vec::new();
    for direction in [Direction::Store, Direction::Retrieve] {
        let single = mover.measure(direction, false, seconds)?;
        let batch = mover.measure(direction, true, seconds)?;
        progress(&format!(
            "{}: {:.0} rounds/s single, {:.0} rounds/s batched",
            direction.op(),
            single.rounds as f64 / single.elapsed.as_secs_f64(),
            batch.rounds as f64 / batch.elapsed.as_secs_f64()
        ));
        results.push((direction, single, batch));
    }
    connection.unregister(raw_instance)?;

    print_figures(results, blocks, block);
    target.check_no_ping_answered_false()?;
    Ok(())
}

/// B1's lines: each direction batched and single, and the speedup.
fn print_figures(results: Vec<(Direction, Rounds, Rounds)>, blocks: u64, block: u64) {
    let gib_per_s = |r: Rounds| {
        (r.rounds * blocks * block) as f64 / (1u64 << 30) as f64 / r.elapsed.as_secs_f64().max(1e-9)
    };
    let micros_per_round = |r: Rounds| r.elapsed.as_secs_f64() * 1e6 / r.rounds.max(1) as f64;
    let sizes = format!("{blocks} blocks of {} KiB a round", block >> 10);
    for (direction, single, batch) in results {
        let op = direction.op();
        figure(
            "B1",
            &format!("{op}_batch_{blocks}"),
            format!("{:.2}", gib_per_s(batch)),
            "GiB/s",
            &format!(
                "one {op}_batch a round, {sizes}, {:.0} us a round",
                micros_per_round(batch)
            ),
        );
        figure(
            "B1",
            &format!("{op}_single_{blocks}"),
            format!("{:.2}", gib_per_s(single)),
            "GiB/s",
            &format!(
                "{blocks} {op} requests a round, one at a time, {sizes}, {:.0} us a round",
                micros_per_round(single)
            ),
        );
        figure(
            "B1",
            &format!("{op}_batch_speedup"),
            format!("{:.2}", gib_per_s(batch) / gib_per_s(single).max(1e-9)),
            "x",
            &format!("{op}_batch_{blocks} / {op}_single_{blocks}"),
        );
    }
}

#[derive(Copy, Clone, Debug)]
enum Direction {
    Store,
    Retrieve,
}

impl Direction {
    fn op(self) -> &'static str {
        match self {
            Direction::Store => "store",
            Direction::Retrieve => "retrieve",
        }
    }
}

/// Rounds of one instance's blocks.
struct Mover<'c> {
    connection: &'c mut RawConnection,
    instance: InstanceId,
    blocks: u64,
    block: u64,
    /// Stores of round `r` use keys `r * blocks ..`; the next store round's `r`.
    next_round: u64,
}

impl Mover<'_> {
    /// Rounds for `duration` (at least one).
    fn measure(
        &mut self,
        direction: Direction,
        batched: bool,
        duration: Duration,
    ) -> Result<Rounds, BenchError> {
        let started = Instant::now();
        let mut rounds = 0;
        loop {
            match direction {
                Direction::Store => {
                    let round = self.next_round;
                    self.next_round += 1;
                    self.round(self.stores(round), batched)?;
                }
                Direction::Retrieve => {
                    let round = self.next_round.checked_sub(1).ok_or_else(|| {
                        BenchError::Failed("retrieves before any store round".into())
                    })?;
                    self.round(self.retrieves(round), batched)?;
                }
            }
            rounds += 1;
            if started.elapsed() >= duration {
                return Ok(Rounds {
                    rounds,
                    elapsed: started.elapsed(),
                });
            }
        }
    }

    fn key(round: u64, block: u64, blocks: u64) -> Vec<u8> {
        (round * blocks + block).to_le_bytes().to_vec()
    }

    /// The single ops of a store round (their batch is the same items).
    fn stores(&self, round: u64) -> Vec<Op> {
        (0..self.blocks)
            .map(|b| Op::Store {
                instance: self.instance,
                key: Self::key(round, b, self.blocks),
                buffer: 0,
                offset: b * self.block,
                nbytes: self.block,
            })
            .collect()
    }

    /// The single ops of a retrieve round, into the buffer's second half.
    fn retrieves(&self, round: u64) -> Vec<Op> {
        (0..self.blocks)
            .map(|b| Op::Retrieve {
                instance: self.instance,
                key: Self::key(round, b, self.blocks),
                buffer: 0,
                offset: (self.blocks + b) * self.block,
                nbytes: self.block,
            })
            .collect()
    }

    /// Sends `singles` one at a time, or as one batch; every block must move whole.
    fn round(&mut self, singles: Vec<Op>, batched: bool) -> Result<(), BenchError> {
        if !batched {
            for op in singles {
                let name = op.name();
                let value = self.connection.call(name, op.args())?;
                self.check(name, &value)?;
            }
            return Ok(());
        }
        let batch = batch_of(self.instance, singles);
        let name = batch.name();
        let value = self.connection.call(name, batch.args())?;
        match value {
            Value::Array(answers) if answers.len() as u64 == self.blocks => {
                for answer in &answers {
                    self.check(name, answer)?;
                }
                Ok(())
            }
            other => Err(BenchError::Failed(format!(
                "`{name}` of {} blocks answered {other}",
                self.blocks
            ))),
        }
    }

    fn check(&self, op: &str, answer: &Value) -> Result<(), BenchError> {
        let moved = match answer {
            Value::Boolean(true) => self.block,
            other => other.as_u64().unwrap_or(0),
        };
        if moved != self.block {
            return Err(BenchError::Failed(format!(
                "`{op}` of a {} byte block answered {answer} (L1 full of pinned data, or a miss?)",
                self.block
            )));
        }
        Ok(())
    }
}

/// The batch op carrying the same items as `singles` (all stores or all retrieves).
fn batch_of(instance: InstanceId, singles: Vec<Op>) -> Op {
    let mut stores = Vec::new();
    let mut retrieves = Vec::new();
    for op in singles {
        match op {
            Op::Store {
                key,
                buffer,
                offset,
                nbytes,
                ..
            } => stores.push(StoreItem {
                key,
                buffer,
                offset,
                nbytes,
            }),
            Op::Retrieve {
                key,
                buffer,
                offset,
                nbytes,
                ..
            } => retrieves.push(RetrieveItem {
                key,
                buffer,
                offset,
                nbytes,
            }),
            _ => {}
        }
    }
    if retrieves.is_empty() {
        Op::StoreBatch {
            instance,
            items: stores,
        }
    } else {
        Op::RetrieveBatch {
            instance,
            items: retrieves,
        }
    }
}
