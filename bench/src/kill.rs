//! S4: SIGKILL of a same-host `kvwarden worker` → its context freed, over N kills
//! (target: p99 ≤ 100 ms; the reference design takes 120–150 s).
//!
//! The server runs with the production reap timeout (120 s), so only the process-exit
//! proof (a pidfd of the registering peer) can free within the measurement. The free
//! is timestamped by a tight loop of `ping [instance]` from a control connection: the
//! first `false` is the first moment the server no longer holds the instance.

use super::process::WorkerProcess;
use super::stats::Samples;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use rustix::process::Signal;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How long a killed worker's instance may stay before the benchmark gives up.
const FREE_BOUND: Duration = Duration::from_secs(30);

/// Flags of `kvwarden bench kill`.
#[derive(Clone, Debug, clap::Args)]
pub struct KillArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Workers started and SIGKILLed, one at a time.
    #[arg(long, default_value_t = 100, value_name = "N")]
    kills: usize,
}

/// Runs S4 and prints its figures.
pub fn run(args: &KillArgs) -> Result<(), BenchError> {
    let kills = args.kills.max(1);
    super::print_machine();
    let target = Target::start(&args.target, "bench-kill", &[])?;
    let socket = target.socket.to_string_lossy().into_owned();
    let worker_args: Vec<String> = [
        "--socket",
        &socket,
        "--buffer-bytes",
        "64K",
        "--traffic-every-ms",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut control = target.connect()?;
    let status = control.status()?;
    let exits_before = process_exits(&status);
    let reap_timeout = status["worker_liveness"]["reap_timeout_seconds"].clone();
    let mut latencies = Vec::with_capacity(kills);
    let started = Instant::now();
    for kill in 1..=kills {
        let worker = WorkerProcess::start(&worker_args, Stdio::null())?;
        let instance = worker.instance_id;
        if !control.ping(instance)? {
            return Err(BenchError::Failed(format!(
                "worker {instance} said it registered, but the server does not hold it"
            )));
        }
        let killed_at = Instant::now();
        worker.signal(Signal::KILL);
        while control.ping(instance)? {
            if killed_at.elapsed() > FREE_BOUND {
                return Err(BenchError::Failed(format!(
                    "worker {instance} was SIGKILLed {FREE_BOUND:?} ago and the server still \
                     holds it: is the process-exit proof available (the worker's pid visible \
                     to the server, a Unix socket)?"
                )));
            }
        }
        latencies.push(killed_at.elapsed());
        worker.reap();
        if kill % 20 == 0 && kill < kills {
            progress(&format!(
                "{kill}/{kills} kills ({:.1} s)",
                started.elapsed().as_secs_f64()
            ));
        }
    }
    let proven = process_exits(&control.status()?) - exits_before;
    let samples = Samples::from_durations(&latencies);
    let setting = format!(
        "{kills} SIGKILLs of a same-host `kvwarden worker`, freed by the process-exit proof \
         ({proven} proofs counted), reap timeout {reap_timeout} s"
    );
    for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
        let note = if name == "p99" {
            format!("{setting}; target p99 <= 100 ms")
        } else {
            setting.clone()
        };
        figure(
            "S4",
            &format!("sigkill_to_free_{name}"),
            format!("{:.3}", samples.quantile_ms(q)),
            "ms",
            &note,
        );
    }
    figure(
        "S4",
        "sigkill_to_free_max",
        format!("{:.3}", samples.max_ms()),
        "ms",
        &setting,
    );
    Ok(())
}

fn process_exits(status: &serde_json::Value) -> u64 {
    status["worker_liveness"]["process_exits_total"]
        .as_u64()
        .unwrap_or(0)
}
