//! S1: closed-loop PING throughput over the Unix socket, 50 connections with one request
//! in flight each, against a local `redis-server` on a Unix socket in the same run
//! (target: ≥ 1.0 × Redis).
//!
//! kvwarden is driven twice per round: by connections that say `hello` with
//! `sends_fds: false` (read with plain `read`, as Redis reads its clients; the headline
//! figures) and by the same generator without it (read with `recvmsg`, as a worker's
//! connection that carries memfds is; the `_recvmsg` figures).
//!
//! Redis is driven twice per round: by `redis-benchmark -t ping` (the target's own
//! wording) and by this load generator speaking RESP, so that both servers also face
//! the very same client. The ratio is taken against the better Redis figure, and the
//! CPU each server spends per ping (less disturbed by a busy machine than throughput)
//! is printed beside it.

use super::load::{Pacing, PingFleet, PingOutcome};
use super::process::cpu_time;
use super::raw::instance_ids;
use super::redis::{self, RedisServer};
use super::redis_cluster::on_path;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use std::time::Duration;

/// Warm-up of every measured round.
const WARMUP: Duration = Duration::from_millis(300);

/// Flags of `kvwarden bench ping`.
#[derive(Clone, Debug, clap::Args)]
pub struct PingArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Concurrent connections, one ping in flight each.
    #[arg(long, default_value_t = 50, value_name = "N")]
    connections: usize,
    /// Seconds measured per round (after a 0.3 s warm-up).
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    seconds: f64,
    /// Rounds, kvwarden then Redis each round; the best round of each is reported.
    #[arg(long, default_value_t = 3, value_name = "N")]
    rounds: usize,
    /// Skip the Redis comparison even when redis-server and redis-benchmark exist.
    #[arg(long)]
    no_redis: bool,
}

/// Runs S1 and prints its figures.
pub fn run(args: &PingArgs) -> Result<(), BenchError> {
    let seconds = super::positive_seconds("--seconds", args.seconds)?;
    let connections = args.connections.max(1);
    let rounds = args.rounds.max(1);
    super::print_machine();
    let target = Target::start(&args.target, "bench-ping", &[])?;
    // Every connection pings an instance of its own, registered (no buffers), so that
    // each ping is a real lookup in the liveness registry.
    let ids = instance_ids(connections);
    let mut control = target.connect()?;
    control.register_many(&ids, None)?;
    let instances: Vec<Option<u64>> = ids.iter().copied().map(Some).collect();
    // The load generator sends no fds, and says so (`hello` with `sends_fds: false`):
    // the server reads it with plain `read`, as Redis reads its clients. The same
    // generator without the promise is read with `recvmsg`, as a worker's connection
    // (which carries its memfds) is: measured beside it in every round.
    let mut plain = KvwardenFleet::new(PingFleet::connect_without_fds(&target.socket, &instances)?);
    let mut recvmsg = KvwardenFleet::new(PingFleet::connect(&target.socket, &instances)?);
    let mut redis = if args.no_redis {
        None
    } else if on_path("redis-server") && on_path("redis-benchmark") {
        Some(RedisBaseline::start(connections)?)
    } else {
        progress("redis-server or redis-benchmark is not on PATH: the Redis comparison is skipped");
        None
    };

    for round in 1..=rounds {
        let label = format!("round {round}/{rounds}");
        let throughput = plain.round(&target, &format!("{label}: kvwarden"), seconds)?;
        recvmsg.round(
            &target,
            &format!("{label}: kvwarden read with recvmsg"),
            seconds,
        )?;
        if let Some(redis) = &mut redis {
            let requests = ((throughput * seconds.as_secs_f64()) as u64).max(50_000);
            redis.round(&label, requests, seconds)?;
        }
    }
    control.unregister_many(&ids)?;
    let (Some(best), Some(best_recvmsg)) = (&plain.best, &recvmsg.best) else {
        return Err(BenchError::Failed("no round ran".into()));
    };

    let setting = format!(
        "{connections} connections, closed loop, each pinging its own registered instance, \
         best of {rounds} x {:.1} s",
        seconds.as_secs_f64()
    );
    plain.print(
        "",
        &format!("{setting}; hello sends_fds false: read with read(2)"),
    );
    recvmsg.print(
        "_recvmsg",
        &format!("{setting}; no hello: read with recvmsg(2), as a worker's connection"),
    );
    let rt = &best.round_trips;
    figure(
        "S1",
        "kvwarden_ping_round_trip_p50",
        format!("{:.1}", rt.quantile_us(0.5)),
        "us",
        &format!("same run, {} round trips", rt.len()),
    );
    match redis {
        Some(redis) => redis.print(best.throughput(), best_recvmsg.throughput(), rounds),
        None => figure(
            "S1",
            "ratio_vs_redis",
            "skipped",
            "-",
            "redis-server/redis-benchmark not on PATH, or --no-redis",
        ),
    }
    target.check_no_ping_answered_false()?;
    Ok(())
}

/// One kind of kvwarden connection, measured round by round.
struct KvwardenFleet {
    fleet: PingFleet,
    best: Option<PingOutcome>,
    cpu_us_per_ping: f64,
}

impl KvwardenFleet {
    fn new(fleet: PingFleet) -> KvwardenFleet {
        KvwardenFleet {
            fleet,
            best: None,
            cpu_us_per_ping: f64::INFINITY,
        }
    }

    /// One measured round: its throughput.
    fn round(
        &mut self,
        target: &Target,
        label: &str,
        seconds: Duration,
    ) -> Result<f64, BenchError> {
        let cpu_before = cpu_time(target.pid);
        let outcome = self.fleet.run(Pacing::ClosedLoop, WARMUP, seconds)?;
        if let Some(cost) = cpu_us_per_reply(target.pid, cpu_before, outcome.all_replies) {
            self.cpu_us_per_ping = self.cpu_us_per_ping.min(cost);
        }
        if outcome.errors > 0 || outcome.untracked > 0 {
            return Err(BenchError::Failed(format!(
                "{} error replies and {} `false` answers to pings of registered instances",
                outcome.errors, outcome.untracked
            )));
        }
        let throughput = outcome.throughput();
        progress(&format!("{label} {throughput:.0} req/s"));
        if self
            .best
            .as_ref()
            .is_none_or(|b| throughput > b.throughput())
        {
            self.best = Some(outcome);
        }
        Ok(throughput)
    }

    /// Its throughput and CPU figures, their names ending in `suffix`.
    fn print(&self, suffix: &str, setting: &str) {
        if let Some(best) = &self.best {
            figure(
                "S1",
                &format!("kvwarden_ping_throughput{suffix}"),
                format!("{:.0}", best.throughput()),
                "req/s",
                setting,
            );
        }
        if self.cpu_us_per_ping.is_finite() {
            figure(
                "S1",
                &format!("kvwarden_server_cpu_per_ping{suffix}"),
                format!("{:.2}", self.cpu_us_per_ping),
                "us",
                "CPU time of the server process (all threads) / pings answered, best round",
            );
        }
    }
}

/// Redis, measured beside kvwarden round by round.
struct RedisBaseline {
    server: RedisServer,
    fleet: PingFleet,
    connections: usize,
    /// Best `redis-benchmark` figure (the better of its two PING tests).
    best_benchmark: f64,
    /// Best figure with this load generator.
    best_same_generator: f64,
    cpu_us_per_ping: f64,
}

impl RedisBaseline {
    fn start(connections: usize) -> Result<RedisBaseline, BenchError> {
        let server = RedisServer::start()?;
        let fleet = PingFleet::connect_resp(&server.socket, connections)?;
        Ok(RedisBaseline {
            server,
            fleet,
            connections,
            best_benchmark: 0.0,
            best_same_generator: 0.0,
            cpu_us_per_ping: f64::INFINITY,
        })
    }

    /// `redis-benchmark` with `requests`, then this generator for `seconds`.
    fn round(&mut self, label: &str, requests: u64, seconds: Duration) -> Result<(), BenchError> {
        let figures = redis::benchmark(&self.server.socket, self.connections, requests)?;
        progress(&format!(
            "{label}: redis-benchmark {} ({requests} requests)",
            figures
                .tests
                .iter()
                .map(|(test, rps)| format!("{test} {rps:.0} req/s"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        self.best_benchmark = self.best_benchmark.max(figures.best());
        let pid = self.server.pid();
        let cpu_before = cpu_time(pid);
        let same = self.fleet.run(Pacing::ClosedLoop, WARMUP, seconds)?;
        if same.errors > 0 {
            return Err(BenchError::Failed(format!(
                "redis-server answered {} pings with something other than +PONG",
                same.errors
            )));
        }
        if let Some(cost) = cpu_us_per_reply(pid, cpu_before, same.all_replies) {
            self.cpu_us_per_ping = self.cpu_us_per_ping.min(cost);
        }
        progress(&format!(
            "{label}: redis with this load generator {:.0} req/s",
            same.throughput()
        ));
        self.best_same_generator = self.best_same_generator.max(same.throughput());
        Ok(())
    }

    /// The Redis figures and the ratios of `kvwarden_throughput` (and of `recvmsg`'s,
    /// connections read with `recvmsg`) to the better one.
    fn print(&self, kvwarden_throughput: f64, recvmsg_throughput: f64, rounds: usize) {
        let connections = self.connections;
        figure(
            "S1",
            "redis_ping_throughput",
            format!("{:.0}", self.best_benchmark),
            "req/s",
            &format!(
                "redis-benchmark -t ping -c {connections} over a Unix socket, the better of \
                 PING_INLINE and PING_MBULK, best of {rounds}"
            ),
        );
        figure(
            "S1",
            "redis_ping_throughput_same_generator",
            format!("{:.0}", self.best_same_generator),
            "req/s",
            &format!(
                "this load generator speaking RESP PING, {connections} connections, closed loop, \
                 best of {rounds}"
            ),
        );
        if self.cpu_us_per_ping.is_finite() {
            figure(
                "S1",
                "redis_server_cpu_per_ping",
                format!("{:.2}", self.cpu_us_per_ping),
                "us",
                "CPU time of redis-server / PINGs answered (this load generator), best round",
            );
        }
        let baseline = self.best_benchmark.max(self.best_same_generator).max(1.0);
        figure(
            "S1",
            "ratio_vs_redis",
            format!("{:.2}", kvwarden_throughput / baseline),
            "x",
            "against the better Redis figure of the two; target >= 1.0",
        );
        figure(
            "S1",
            "ratio_vs_redis_recvmsg",
            format!("{:.2}", recvmsg_throughput / baseline),
            "x",
            "the same, connections read with recvmsg (no hello)",
        );
    }
}

/// Microseconds of `pid`'s CPU time since `before`, per reply.
fn cpu_us_per_reply(pid: i32, before: Option<Duration>, replies: u64) -> Option<f64> {
    let used = cpu_time(pid)?.checked_sub(before?)?;
    (replies > 0).then(|| used.as_secs_f64() * 1e6 / replies as f64)
}
