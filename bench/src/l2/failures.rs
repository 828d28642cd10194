//! L3 and L4: every Redis node stopped, and a master killed.

use super::clients::{Keys, Worker};
use super::{L2Args, SLOT, failed_ops, l2_status, promoted_after, wait_l2_ops};
use crate::raw::{RawConnection, instance_ids};
use crate::redis_cluster::RedisCluster;
use crate::stats::Samples;
use crate::{BenchError, figure};
use std::time::{Duration, Instant};

/// L3: every Redis node SIGSTOPped for `stop`: pings, L2-only misses and L1 hits while
/// it is, and how soon L2 serves again after SIGCONT.
pub(super) fn stopped_cluster(
    args: &L2Args,
    cluster: &mut RedisCluster,
    (writer, reader): (&Worker, &Worker),
    (a_control, b_control): (&mut RawConnection, &mut RawConnection),
    (b_socket, in_l1, stop): (&std::path::Path, &[u8], Duration),
    keys: &mut Keys,
) -> Result<(), BenchError> {
    let l2_only = keys.fresh(8);
    for key in &l2_only {
        writer.store(key, SLOT)?;
    }
    wait_l2_ops(a_control, 0)?;
    let pinger_instance = instance_ids(1)[0];
    let mut pinger = RawConnection::connect(b_socket)?;
    pinger.register(pinger_instance, Vec::new(), &[])?;
    // The same ping loop with L2 up first: "unchanged" is read against it.
    let mut pings_before = Vec::new();
    let started = Instant::now();
    while started.elapsed() < stop {
        let sent = Instant::now();
        pinger.ping(pinger_instance)?;
        pings_before.push(sent.elapsed());
        if pings_before.len() % 20 == 0 {
            reader.retrieve(in_l1)?;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let pings_before = Samples::from_durations(&pings_before);
    cluster.signal_all(rustix::process::Signal::STOP);
    let stopped = Instant::now();
    let (mut pings, mut misses, mut l1_hits) = (Vec::new(), Vec::new(), 0u64);
    let mut next = 0;
    while stopped.elapsed() < stop {
        let started = Instant::now();
        if !pinger.ping(pinger_instance)? {
            return Err(BenchError::Failed(
                "a ping was answered false while L2 was stopped".into(),
            ));
        }
        pings.push(started.elapsed());
        if pings.len() % 20 == 0 {
            let key = &l2_only[next % l2_only.len()];
            next += 1;
            let started = Instant::now();
            let moved = reader.retrieve(key)?;
            misses.push(started.elapsed());
            if moved.is_some() {
                return Err(BenchError::Failed(
                    "an L2-only chunk was served while every Redis node was stopped".into(),
                ));
            }
            if reader.retrieve(in_l1)? == Some(SLOT) {
                l1_hits += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cluster.signal_all(rustix::process::Signal::CONT);
    let continued = Instant::now();
    let resumed = loop {
        if reader.retrieve(&l2_only[0])?.is_some() {
            break continued.elapsed();
        }
        if continued.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Failed(
                "L2 did not come back within 120 s of SIGCONT".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let reaped = b_control.status()?.worker_liveness.reaped_total;
    let measured = (pings, misses, pings_before, l1_hits, resumed, reaped);
    print_stopped(args, stop, measured);
    Ok(())
}

/// L3's lines.
fn print_stopped(
    args: &L2Args,
    stop: Duration,
    (pings, misses, pings_before, l1_hits, resumed, reaped): (
        Vec<Duration>,
        Vec<Duration>,
        Samples,
        u64,
        Duration,
        u64,
    ),
) {
    let (pings, misses) = (
        Samples::from_durations(&pings),
        Samples::from_durations(&misses),
    );
    let stopped_note = format!(
        "every Redis node SIGSTOPped for {:.0} s",
        stop.as_secs_f64()
    );
    figure(
        "L3",
        "ping_p99",
        format!("{:.3}", pings.quantile_ms(0.99)),
        "ms",
        &format!("{stopped_note}, {} pings; target <= 2", pings.len()),
    );
    figure(
        "L3",
        "ping_p99_l2_up",
        format!("{:.3}", pings_before.quantile_ms(0.99)),
        "ms",
        &format!(
            "the same loop just before, L2 up, {} pings (machine noise)",
            pings_before.len()
        ),
    );
    figure(
        "L3",
        "l2_only_retrieve_max",
        format!("{:.1}", misses.max_ms()),
        "ms",
        &format!(
            "{} misses, --l2-timeout-ms {} (p50 {:.1} ms)",
            misses.len(),
            args.l2_timeout_ms,
            misses.quantile_ms(0.5)
        ),
    );
    figure(
        "L3",
        "l1_hits_served",
        l1_hits,
        "retrieves",
        &format!("of {} tried while stopped", misses.len()),
    );
    figure("L3", "reaped", reaped, "workers", "target 0");
    figure(
        "L3",
        "resumed_after_sigcont",
        format!("{:.2}", resumed.as_secs_f64()),
        "s",
        "first L2 hit after SIGCONT (the breaker's probe back-off)",
    );
}

/// L4: a master SIGKILLed: how long until every write of a batch lands again, writes
/// failed or dropped meanwhile, corrupt values served; Redis's own failover beside it.
pub(super) fn killed_master(
    args: &L2Args,
    cluster: &mut RedisCluster,
    writer: &Worker,
    (a_control, b_control): (&mut RawConnection, &mut RawConnection),
    keys: &mut Keys,
) -> Result<(), BenchError> {
    let victim = cluster
        .masters()
        .first()
        .copied()
        .ok_or_else(|| BenchError::Failed("the cluster lists no master to kill".into()))?;
    let replica = cluster.replica_of(victim);
    let failed_before = failed_ops(a_control)?;
    cluster.kill(victim);
    let killed = Instant::now();
    // Redis's own part, watched beside kvwarden's: detection (cluster-node-timeout and
    // gossip) and the replica's election delay (500-1000 ms by Redis's design).
    let promoted = replica.map(|port| std::thread::spawn(move || promoted_after(port, killed)));
    let resumed = loop {
        let batch = keys.fresh(12);
        let before = l2_status(a_control)?.counters.writes;
        for key in &batch {
            writer.store(key, 256 << 10)?;
        }
        wait_l2_ops(a_control, 0)?;
        std::thread::sleep(Duration::from_millis(20));
        if l2_status(a_control)?.counters.writes >= before + batch.len() as u64 {
            break killed.elapsed();
        }
        if killed.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Failed(
                "writes did not land again within 120 s of killing a master".into(),
            ));
        }
    };
    let failed = failed_ops(a_control)? - failed_before;
    let corrupt = l2_status(a_control)?.counters.corrupt + l2_status(b_control)?.counters.corrupt;
    print_killed(args, promoted, (resumed, failed, corrupt));
    Ok(())
}

/// L4's lines.
fn print_killed(
    args: &L2Args,
    promoted: Option<std::thread::JoinHandle<Option<Duration>>>,
    (resumed, failed, corrupt): (Duration, u64, u64),
) {
    let promoted = promoted.and_then(|watch| watch.join().ok().flatten());
    match promoted {
        Some(promoted) => {
            figure(
                "L4",
                "redis_failover",
                format!("{:.2}", promoted.as_secs_f64()),
                "s",
                "the killed master's replica answered ROLE master (Redis's own detection and \
                 election, same run)",
            );
            figure(
                "L4",
                "resumed_after_promotion",
                format!("{:.2}", resumed.saturating_sub(promoted).as_secs_f64()),
                "s",
                "kvwarden's part: resumed_after_master_kill - redis_failover (includes this \
                 loop's 20 ms polling)",
            );
        }
        None => figure(
            "L4",
            "redis_failover",
            "-",
            "s",
            "the killed master's replica was not found or not seen promoted",
        ),
    }
    figure(
        "L4",
        "resumed_after_master_kill",
        format!("{:.2}", resumed.as_secs_f64()),
        "s",
        &format!(
            "every write of a batch landed again; target <= 2 x cluster-node-timeout = {:.1} s",
            2.0 * args.cluster_node_timeout_ms as f64 / 1000.0
        ),
    );
    figure(
        "L4",
        "writes_failed_or_dropped",
        failed,
        "writes",
        "errors + timeouts + drops during the failover, never retried",
    );
    figure("L4", "corrupt_served", corrupt, "values", "target 0");
}
