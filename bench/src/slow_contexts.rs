//! S3: PING round trips while contexts take 200 ms to build and some frees hang
//! (target: p99 ≤ 2 ms: builds and frees never run on the event loop).
//!
//! The server runs with the test-only faults `--fault-build-delay-ms` and
//! `--fault-free-hang-instances`; the ping load of S2 runs while churn connections
//! register and unregister instances (each with a memfd buffer) without pause.

use super::load::{PacedPingArgs, Pacing, PingFleet};
use super::raw::{RawConnection, instance_ids, memfd_spec};
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use rustix::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Flags of `kvwarden bench slow-contexts`.
#[derive(Clone, Debug, clap::Args)]
pub struct SlowContextsArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Connected workers pinging.
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    workers: usize,
    #[command(flatten)]
    paced: PacedPingArgs,
    /// How long every context build takes (the server's --fault-build-delay-ms).
    #[arg(long, default_value_t = 200, value_name = "MS")]
    build_delay_ms: u64,
    /// How many frees never return (the server's --fault-free-hang-instances).
    #[arg(long, default_value_t = 8, value_name = "N")]
    hung_frees: u64,
    /// Connections that register and unregister instances without pause.
    #[arg(long, default_value_t = 8, value_name = "N")]
    churners: usize,
}

/// Register/unregister counts of the churn threads.
#[derive(Default)]
struct Churn {
    registered: AtomicU64,
    unregistered: AtomicU64,
    failures: AtomicU64,
}

/// The server, with the build delay and the hung frees of `args` (when it spawns one).
fn start_target(args: &SlowContextsArgs) -> Result<Target, BenchError> {
    let build_delay = args.build_delay_ms.to_string();
    let hung = args.hung_frees.to_string();
    Target::start(
        &args.target,
        "bench-slow-contexts",
        &[
            "--allow-short-timeouts",
            "--fault-build-delay-ms",
            &build_delay,
            "--fault-free-hang-instances",
            &hung,
            "--free-watchdog-seconds",
            "1",
            // Every build takes the fault's delay, the pingers' registrations too: a
            // pool wide enough to build 1,000 of them in seconds, not minutes.
            "--pool-threads",
            "64",
        ],
    )
}

/// Runs S3 and prints its figures.
pub fn run(args: &SlowContextsArgs) -> Result<(), BenchError> {
    let (seconds, interval) = args.paced.begin()?;
    let workers = args.workers.max(1);
    let target = start_target(args)?;
    let ids = instance_ids(workers);
    target.connect()?.register_many(&ids, None)?;
    let instances: Vec<Option<u64>> = ids.iter().copied().map(Some).collect();
    let mut fleet = PingFleet::connect(&target.socket, &instances)?;

    let stop = Arc::new(AtomicBool::new(false));
    let churn = Arc::new(Churn::default());
    let mut threads = Vec::new();
    for _ in 0..args.churners {
        let (socket, stop, churn) = (target.socket.clone(), Arc::clone(&stop), Arc::clone(&churn));
        threads.push(std::thread::spawn(move || {
            churn_loop(&socket, &stop, &churn)
        }));
    }
    progress(&format!(
        "{workers} workers pinging every {} ms for {:.1} s while {} connections register \
         (builds take {} ms) and unregister (the first {} frees hang)",
        interval.as_millis(),
        seconds.as_secs_f64(),
        args.churners,
        args.build_delay_ms,
        args.hung_frees
    ));
    let outcome = fleet.run(Pacing::Every(interval), interval, seconds);
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        if let Ok(Err(error)) = thread.join() {
            progress(&format!("a churn connection stopped early: {error}"));
        }
    }
    let outcome = outcome?;
    drop(fleet);
    let mut control = target.connect()?;
    let status = control.status()?;
    control.unregister_many(&ids)?;
    let faults = if target.is_spawned() {
        format!(
            "builds take {} ms (64 pool threads), the first {} frees hang",
            args.build_delay_ms, args.hung_frees
        )
    } else {
        "faults as the running server was started".to_string()
    };
    let setting = format!(
        "{workers} workers pinging every {} ms; {} churn connections; {faults}",
        interval.as_millis(),
        args.churners
    );
    super::latency::print_percentiles("S3", &outcome, &setting, "target p99 <= 2 ms")?;
    figure(
        "S3",
        "registrations_during_run",
        churn.registered.load(Ordering::Relaxed),
        "registrations",
        &format!(
            "{} unregistrations, {} refused; contexts built {}, frees hung {} (server status)",
            churn.unregistered.load(Ordering::Relaxed),
            churn.failures.load(Ordering::Relaxed),
            status.contexts.built_total,
            status.contexts.frees_hung_total,
        ),
    );
    target.check_no_ping_answered_false()?;
    Ok(())
}

/// Registers a fresh instance with a 64 KiB memfd, waits for the (slow) build, then
/// unregisters it; again and again until `stop`.
fn churn_loop(socket: &Path, stop: &AtomicBool, churn: &Churn) -> Result<(), BenchError> {
    const BUFFER_BYTES: u64 = 64 << 10;
    let memfd = crate::memfd::create("kvwarden-bench-churn", BUFFER_BYTES)
        .map_err(BenchError::io("creating a memfd"))?;
    let mut connection = RawConnection::connect(socket)?;
    while !stop.load(Ordering::Relaxed) {
        let instance = instance_ids(1)[0];
        let registered = connection.register(
            instance,
            vec![memfd_spec(0, BUFFER_BYTES)],
            &[memfd.as_fd()],
        );
        match registered {
            Ok(_) => {
                churn.registered.fetch_add(1, Ordering::Relaxed);
                connection.unregister(instance)?;
                churn.unregistered.fetch_add(1, Ordering::Relaxed);
            }
            Err(BenchError::Failed(_)) => {
                churn.failures.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}
