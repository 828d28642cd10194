//! S5: a worker the server cannot see (TCP: no pidfd, no process-exit proof), silent
//! (SIGSTOP) → reaped; the reap time minus its last evidence, against T + R.
//!
//! The last evidence is read from the server's own status: an instance's
//! `silence_seconds` at a status reply says when the server last heard from it. The
//! status is polled every few milliseconds (it never refreshes anyone's liveness, unlike
//! a ping); the reap lies between the last poll that still showed the instance and the
//! first that did not, and the later of the two is taken (a bound from above).

use super::process::WorkerProcess;
use super::raw::RawConnection;
use super::stats::Samples;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use kvwarden_core::protocol::status::{InstanceStatus, StatusReport};
use rustix::process::Signal;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench reap`.
#[derive(Clone, Debug, clap::Args)]
pub struct ReapArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// The running server's TCP address (with --socket; a started server gets one).
    #[arg(long, value_name = "ADDR", requires_all = ["socket", "tcp_token_file"])]
    tcp: Option<SocketAddr>,
    /// The running server's TCP token file (its --tcp-token-file), with --tcp.
    #[arg(long, value_name = "PATH", requires = "tcp")]
    tcp_token_file: Option<std::path::PathBuf>,
    /// Workers frozen, 100 ms apart (one sample each).
    #[arg(long, default_value_t = 5, value_name = "N")]
    samples: usize,
    /// The reap timeout T of the started server (short timeouts are a test setting).
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    reap_timeout_seconds: f64,
    /// The resolution R of the started server.
    #[arg(long, default_value_t = 0.1, value_name = "SECONDS")]
    resolution_seconds: f64,
}

/// What the polls saw of one frozen worker.
struct Frozen {
    worker: WorkerProcess,
    /// The latest "last heard from" the status showed, on this process's clock.
    last_evidence: Option<Instant>,
    reaped_by: Option<Instant>,
}

/// Runs S5 and prints its figures.
pub fn run(args: &ReapArgs) -> Result<(), BenchError> {
    let samples = args.samples.max(1);
    super::positive_seconds("--reap-timeout-seconds", args.reap_timeout_seconds)?;
    super::positive_seconds("--resolution-seconds", args.resolution_seconds)?;
    super::print_machine();
    let reap = args.reap_timeout_seconds.to_string();
    let grace = (args.reap_timeout_seconds * 2.0).to_string();
    let resolution = args.resolution_seconds.to_string();
    let target = Target::start(
        &args.target,
        "bench-reap",
        &[
            "--allow-short-timeouts",
            "--worker-reap-timeout-seconds",
            &reap,
            "--worker-registration-grace-seconds",
            &grace,
            "--resolution-seconds",
            &resolution,
            "--tcp",
            "127.0.0.1:0",
        ],
    )?;
    let (tcp, token_file) = tcp_of(args, &target)?;
    let mut control = target.connect()?;
    let status = control.status()?;
    let t = status.worker_liveness.reap_timeout_seconds;
    let r = status.worker_liveness.resolution_seconds;
    if t <= 0.0 {
        return Err(BenchError::Failed(
            "the server's reaping is disabled (reap timeout 0): nothing to measure".into(),
        ));
    }
    let heartbeat = (t / 4.0).min(1.0).to_string();
    let token_file = token_file.display().to_string();
    let worker_args = worker_args(tcp, &token_file, &heartbeat);
    let reaped_before = status.contexts.freed_total.reaped;
    let mut frozen = Vec::with_capacity(samples);
    for _ in 0..samples {
        frozen.push(Frozen {
            worker: WorkerProcess::start(&worker_args, Stdio::null())?,
            last_evidence: None,
            reaped_by: None,
        });
    }
    // Proven: each has pinged at least once over TCP.
    wait_until(&mut control, Duration::from_secs(30), |status| {
        frozen
            .iter()
            .all(|f| instance(status, f.worker.instance_id).is_some_and(|i| i.proven))
    })?;
    progress(&format!(
        "{samples} TCP workers (heartbeat {heartbeat} s) proven; freezing them 100 ms apart \
         (T = {t} s, R = {r} s)"
    ));
    freeze_until_reaped(&mut control, &mut frozen, t)?;
    let status = control.status()?;
    let reaped = status.contexts.freed_total.reaped - reaped_before;
    let delays: Vec<Duration> = frozen
        .iter()
        .filter_map(|f| Some(f.reaped_by? - f.last_evidence?))
        .collect();
    for f in &frozen {
        f.worker.signal(Signal::CONT);
    }
    print_figures(&delays, reaped, t, r);
    Ok(())
}

/// The server's TCP address and token file: given, or the spawned server's.
fn tcp_of(
    args: &ReapArgs,
    target: &Target,
) -> Result<(std::net::SocketAddr, std::path::PathBuf), BenchError> {
    let Some(tcp) = args.tcp.or(target.tcp) else {
        return Err(BenchError::Failed(
            "the server listens on no TCP address: give --tcp ADDR with --socket".into(),
        ));
    };
    let Some(token_file) = args
        .tcp_token_file
        .clone()
        .or(target.tcp_token_file.clone())
    else {
        return Err(BenchError::Failed(
            "the server's TCP token file is unknown: give --tcp-token-file PATH with --tcp".into(),
        ));
    };
    Ok((tcp, token_file))
}

/// A frozen-to-be TCP worker's flags: no buffer, no traffic, pings every `heartbeat`.
fn worker_args(tcp: std::net::SocketAddr, token_file: &str, heartbeat: &str) -> Vec<String> {
    [
        "--tcp",
        &tcp.to_string(),
        "--tcp-token-file",
        token_file,
        "--heartbeat-interval-seconds",
        heartbeat,
        "--buffer-bytes",
        "0",
        "--traffic-every-ms",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Stops the workers 100 ms apart and polls the status until each is reaped: when the
/// server last heard from each (its silence, seen from above) and when it was gone.
fn freeze_until_reaped(
    control: &mut RawConnection,
    frozen: &mut [Frozen],
    t: f64,
) -> Result<(), BenchError> {
    let samples = frozen.len();
    let mut next_stop = Instant::now();
    let mut stopped = 0;
    let bound = Instant::now() + Duration::from_secs_f64(t * 4.0 + 30.0);
    while frozen.iter().any(|f| f.reaped_by.is_none()) {
        if stopped < samples && Instant::now() >= next_stop {
            frozen[stopped].worker.signal(Signal::STOP);
            stopped += 1;
            next_stop += Duration::from_millis(100);
        }
        if Instant::now() > bound {
            return Err(BenchError::Failed(format!(
                "frozen TCP workers not reaped within {:.0} s (T = {t} s)",
                t * 4.0 + 30.0
            )));
        }
        let asked = Instant::now();
        let status = control.status()?;
        let answered = Instant::now();
        let seen_at = asked + (answered - asked) / 2;
        for f in frozen.iter_mut().filter(|f| f.reaped_by.is_none()) {
            match instance(&status, f.worker.instance_id) {
                Some(item) => {
                    let silence = item.silence_seconds;
                    let heard = seen_at
                        .checked_sub(Duration::from_secs_f64(silence.max(0.0)))
                        .unwrap_or(seen_at);
                    f.last_evidence = Some(f.last_evidence.map_or(heard, |l| l.max(heard)));
                }
                None => f.reaped_by = Some(answered),
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// S5's lines.
fn print_figures(delays: &[Duration], reaped: u64, t: f64, r: f64) {
    let samples_seen = Samples::from_durations(delays);
    let t_plus_r = t + r;
    let max_s = samples_seen.max_ms() / 1e3;
    let min_s = samples_seen.quantile_ms(0.0) / 1e3;
    let setting = format!(
        "{} TCP workers frozen by SIGSTOP, {reaped} reaped by timeout; T = {t} s, R = {r} s; \
         reap time measured from above (status polled every ~2 ms)",
        delays.len()
    );
    figure(
        "S5",
        "reap_after_last_evidence_min",
        format!("{min_s:.3}"),
        "s",
        &format!("{setting}; never before T = {t} s"),
    );
    figure(
        "S5",
        "reap_after_last_evidence_max",
        format!("{max_s:.3}"),
        "s",
        &format!("{setting}; target <= T + R = {t_plus_r:.3} s"),
    );
    figure(
        "S5",
        "reap_lateness_past_t_max",
        format!("{:.1}", (max_s - t) * 1e3),
        "ms",
        &format!("target <= R = {:.0} ms", r * 1e3),
    );
}

fn instance(status: &StatusReport, id: u64) -> Option<&InstanceStatus> {
    status.instances.iter().find(|item| item.instance_id == id)
}

fn wait_until(
    control: &mut super::raw::RawConnection,
    bound: Duration,
    condition: impl Fn(&StatusReport) -> bool,
) -> Result<(), BenchError> {
    let start = Instant::now();
    loop {
        if condition(&control.status()?) {
            return Ok(());
        }
        if start.elapsed() > bound {
            return Err(BenchError::Failed(format!(
                "the workers were not all proven (pinged) within {bound:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
