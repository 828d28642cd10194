//! S4: SIGKILL of a same-host `kvwarden worker` → its context freed, over N kills
//! (target: p99 ≤ 100 ms; the reference design takes 120–150 s).
//!
//! The server runs with the production reap timeout (120 s), so only the process-exit
//! proof (a pidfd of the registering peer) can free within the measurement. The free
//! is timestamped by a tight loop of `ping [instance]` from a control connection: the
//! first `false` is the first moment the server no longer holds the instance.

use super::process::WorkerProcess;
use super::raw::RawConnection;
use super::stats::Samples;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use kvwarden_core::protocol::StatusReport;
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
    /// Run the server in a PID namespace of its own (`unshare --pid --fork
    /// --mount-proc`; needs root), as a DaemonSet without `hostPID`: it cannot see the
    /// workers' pids, so only the pidfd each worker sends of itself can free them in
    /// time. A control worker started with `--no-send-pidfd` is then killed too, to
    /// show it is still held after the wait (freed only at the reap timeout).
    #[arg(long)]
    server_pid_namespace: bool,
}

/// How long the control worker (no pidfd, server in another PID namespace) is watched
/// after its SIGKILL: far above every pidfd free, far below the reap timeout.
const CONTROL_WAIT: Duration = Duration::from_secs(2);

/// Runs S4 and prints its figures.
pub fn run(args: &KillArgs) -> Result<(), BenchError> {
    let kills = args.kills.max(1);
    super::print_machine();
    let target = if args.server_pid_namespace {
        Target::start_in_pid_namespace(&args.target, "bench-kill", &[])?
    } else {
        Target::start(&args.target, "bench-kill", &[])?
    };
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
    let reap_timeout = status.worker_liveness.reap_timeout_seconds;
    let mut latencies = Vec::with_capacity(kills);
    let started = Instant::now();
    for kill in 1..=kills {
        let check = kill == 1 && args.server_pid_namespace;
        latencies.push(kill_one(&worker_args, &mut control, check)?);
        if kill % 20 == 0 && kill < kills {
            progress(&format!(
                "{kill}/{kills} kills ({:.1} s)",
                started.elapsed().as_secs_f64()
            ));
        }
    }
    let proven = process_exits(&control.status()?) - exits_before;
    let samples = Samples::from_durations(&latencies);
    let layout = if args.server_pid_namespace {
        "server in its own PID namespace (worker pid invisible to it: pid 0), each worker \
         sending its pidfd"
    } else {
        "same PID namespace"
    };
    let setting = format!(
        "{kills} SIGKILLs of a same-host `kvwarden worker`, {layout}, freed by the \
         process-exit proof ({proven} proofs counted), reap timeout {reap_timeout:.1} s"
    );
    print_figures(&samples, &setting);
    if args.server_pid_namespace {
        control_without_pidfd(&worker_args, &mut control, reap_timeout)?;
    }
    Ok(())
}

/// Starts a worker, checks that the server holds it (and, with `check`, that it
/// watches it by its pidfd), SIGKILLs it and times until the server frees it.
fn kill_one(
    worker_args: &[String],
    control: &mut RawConnection,
    check: bool,
) -> Result<Duration, BenchError> {
    let worker = WorkerProcess::start_watchable(worker_args, Stdio::null())?;
    let instance = worker.instance_id;
    if !control.ping(instance)? {
        return Err(BenchError::Failed(format!(
            "worker {instance} said it registered, but the server does not hold it"
        )));
    }
    if check {
        check_proof(&control.status()?, instance)?;
    }
    let killed_at = Instant::now();
    worker.signal(Signal::KILL);
    while control.ping(instance)? {
        if killed_at.elapsed() > FREE_BOUND {
            return Err(BenchError::Failed(format!(
                "worker {instance} was SIGKILLed {FREE_BOUND:?} ago and the server still \
                 holds it: is the process-exit proof available (a Unix socket, and a \
                 server that accepts the worker's pidfd or sees its pid)?"
            )));
        }
    }
    let latency = killed_at.elapsed();
    worker.reap();
    Ok(latency)
}

/// S4's lines: p50, p99 and the most.
fn print_figures(samples: &Samples, setting: &str) {
    for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
        let note = if name == "p99" {
            format!("{setting}; target p99 <= 100 ms")
        } else {
            setting.to_owned()
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
        setting,
    );
}

/// Checks that the server in another PID namespace watches the worker by the pidfd the
/// worker sent, without seeing its pid.
fn check_proof(status: &StatusReport, instance: u64) -> Result<(), BenchError> {
    let entry = status
        .instances
        .iter()
        .find(|item| item.instance_id == instance);
    let noticed_by = entry.map_or("?", |entry| entry.death_noticed_by.as_str());
    let watched_pid = entry.and_then(|entry| entry.watched_pid);
    if noticed_by != "pidfd_from_peer" || watched_pid.is_some() {
        return Err(BenchError::Failed(format!(
            "worker {instance}: the server says death_noticed_by {noticed_by:?}, watched_pid \
             {watched_pid:?}; expected pidfd_from_peer and no visible pid (a server in \
             another PID namespace)",
        )));
    }
    Ok(())
}

/// One `--no-send-pidfd` worker killed with the server in another PID namespace: no
/// proof, so it must still be held `CONTROL_WAIT` later (the reap timeout frees it).
fn control_without_pidfd(
    worker_args: &[String],
    control: &mut super::raw::RawConnection,
    reap_timeout: f64,
) -> Result<(), BenchError> {
    let mut args = worker_args.to_vec();
    args.push("--no-send-pidfd".into());
    let worker = WorkerProcess::start_watchable(&args, Stdio::null())?;
    let instance = worker.instance_id;
    let killed_at = Instant::now();
    worker.signal(Signal::KILL);
    let mut held = true;
    while held && killed_at.elapsed() < CONTROL_WAIT {
        held = control.ping(instance)?;
    }
    worker.reap();
    let verdict = if held {
        format!(
            "still held {:.1} s after its SIGKILL: the server cannot see its pid and got no \
             pidfd, so only the reap timeout ({reap_timeout:.1} s) frees it",
            CONTROL_WAIT.as_secs_f64()
        )
    } else {
        "FREED before the reap timeout without a pidfd: the server must have seen its pid \
         (is it really in another PID namespace?)"
            .to_string()
    };
    let (name, seconds) = if held {
        (
            "control_without_pidfd_held_at_least",
            CONTROL_WAIT.as_secs_f64(),
        )
    } else {
        (
            "control_without_pidfd_freed_after",
            killed_at.elapsed().as_secs_f64(),
        )
    };
    figure(
        "S4",
        name,
        format!("{seconds:.3}"),
        "s",
        &format!("1 `kvwarden worker --no-send-pidfd`, {verdict}"),
    );
    Ok(())
}

fn process_exits(status: &StatusReport) -> u64 {
    status.worker_liveness.process_exits_total
}
