//! S2: PING round-trip percentiles with 1,000 connected workers each pinging every
//! 100 ms (target: p99 ≤ 1 ms).
//!
//! The workers are connections of one load generator, each with its own registered
//! instance id (no buffers): the server sees exactly the heartbeat traffic of 1,000
//! workers without 1,000 processes competing for the benchmark machine's cores.

use super::load::{PacedPingArgs, Pacing, PingFleet, PingOutcome};
use super::raw::instance_ids;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};

/// Flags of `kvwarden bench latency`.
#[derive(Clone, Debug, clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Connected workers.
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    workers: usize,
    #[command(flatten)]
    paced: PacedPingArgs,
}

/// Runs S2 and prints its figures.
pub fn run(args: &LatencyArgs) -> Result<(), BenchError> {
    let (seconds, interval) = args.paced.begin()?;
    let workers = args.workers.max(1);
    let target = Target::start(&args.target, "bench-latency", &[])?;
    let ids = instance_ids(workers);
    target.connect()?.register_many(&ids, None)?;
    let instances: Vec<Option<u64>> = ids.iter().copied().map(Some).collect();
    let mut fleet = PingFleet::connect(&target.socket, &instances)?;
    progress(&format!(
        "{workers} workers pinging every {} ms for {:.1} s",
        interval.as_millis(),
        seconds.as_secs_f64()
    ));
    let outcome = fleet.run(Pacing::Every(interval), interval, seconds)?;
    drop(fleet);
    target.connect()?.unregister_many(&ids)?;
    let setting = format!(
        "{workers} workers, each its own registered instance, one ping every {} ms",
        interval.as_millis()
    );
    print_percentiles("S2", &outcome, &setting, "target p99 <= 1 ms")
}

/// Prints `ID ping_round_trip_p50/p99/p999/max` and the sample count of `outcome`.
pub fn print_percentiles(
    id: &str,
    outcome: &PingOutcome,
    setting: &str,
    target: &str,
) -> Result<(), BenchError> {
    if outcome.errors > 0 || outcome.untracked > 0 {
        return Err(BenchError::Failed(format!(
            "{} error replies and {} `false` answers to pings of registered instances",
            outcome.errors, outcome.untracked
        )));
    }
    let rt = &outcome.round_trips;
    if rt.is_empty() {
        return Err(BenchError::Failed(
            "no ping came back inside the measured window".into(),
        ));
    }
    for (name, q) in [("p50", 0.5), ("p99", 0.99), ("p999", 0.999)] {
        let note = if name == "p99" {
            format!("{setting}; {target}")
        } else {
            setting.to_string()
        };
        figure(
            id,
            &format!("ping_round_trip_{name}"),
            format!("{:.3}", rt.quantile_ms(q)),
            "ms",
            &note,
        );
    }
    figure(
        id,
        "ping_round_trip_max",
        format!("{:.3}", rt.max_ms()),
        "ms",
        setting,
    );
    figure(
        id,
        "pings_measured",
        rt.len(),
        "round trips",
        &format!("{:.0} pings/s", outcome.throughput()),
    );
    Ok(())
}
