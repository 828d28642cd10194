//! R5: N concurrent connections that ping are held; a peer that never reads its
//! replies is disconnected once its output buffer is full; memory stays flat.
//!
//! The N connections are untracked probers (`ping [nil]`), so that the memory figures
//! are the connections' own (S7 measures instances). Each pings once a second.

use super::load::PingOutcome;
use super::load::{Pacing, PingFleet};
use super::process::MemoryUse;
use super::raw::RawConnection;
use super::target::{Target, TargetArgs};
use super::{BenchError, figure, progress};
use crate::protocol::encode_request;
use kvwarden_core::protocol::status::LimitsStatus;
use rmpv::Value;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long the peer that never reads may go on sending before the benchmark gives up.
const SLOW_PEER_BOUND: Duration = Duration::from_secs(60);

/// Flags of `kvwarden bench connections`.
#[derive(Clone, Debug, clap::Args)]
pub struct ConnectionsArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Connections held at once.
    #[arg(value_name = "N", default_value_t = 1_000)]
    connections: usize,
    /// Seconds the connections ping (once a second each), before and while the slow
    /// peer floods.
    #[arg(long, default_value_t = 3.0, value_name = "SECONDS")]
    seconds: f64,
}

/// What the peer that never reads saw.
struct SlowPeer {
    pings_sent: u64,
    bytes_sent: u64,
    elapsed: Duration,
    disconnected: Option<String>,
}

/// Runs R5 and prints its figures.
pub fn run(args: &ConnectionsArgs) -> Result<(), BenchError> {
    let seconds = super::positive_seconds("--seconds", args.seconds)?;
    let count = args.connections.max(1);
    let limit = open_file_limit(count)?;
    super::print_machine();
    let (target, server_open_files) = start_target(args, count)?;
    let (soft, hard) =
        super::process::open_file_limits(target.pid).unwrap_or_else(|| ("?".into(), "?".into()));
    progress(&format!(
        "server open-file limit: soft {soft}, hard {hard} (asked for {server_open_files})"
    ));
    let mut control = target.connect()?;
    let (held_count, capped) = capped(count, &control.status()?.limits);
    if let Some(capped) = &capped {
        progress(capped);
    }
    let idle = MemoryUse::of(target.pid)?;
    progress(&format!("server idle: {}", idle.describe()));
    let started = Instant::now();
    let mut fleet = PingFleet::connect(&target.socket, &vec![None; held_count])?;
    let count = held_count;
    progress(&format!(
        "{count} connections open in {:.1} s; pinging once a second each for {:.1} s",
        started.elapsed().as_secs_f64(),
        seconds.as_secs_f64()
    ));
    // A connect returns once the kernel queued it; wait until the server took them all.
    let accepted = Instant::now();
    wait_connections(
        &mut control,
        |n| n > count,
        &format!("had not accepted all {count} connections after 60 s"),
        60,
    )?;
    progress(&format!(
        "the server holds all {count} (accepted {:.2} s after the last connect)",
        accepted.elapsed().as_secs_f64()
    ));
    let every = Pacing::Every(Duration::from_secs(1));
    let held = fleet.run(every, Duration::from_secs(1), seconds)?;
    let held_connections = control.status()?.connections;
    let with_connections = MemoryUse::of(target.pid)?;
    progress(&format!(
        "server holding {held_connections} connections: {}",
        with_connections.describe()
    ));

    progress("a peer that never reads its replies floods pings, while the others go on pinging");
    let socket = target.socket.clone();
    let flood = std::thread::spawn(move || slow_peer(&socket));
    let during_flood = fleet.run(every, Duration::ZERO, seconds);
    let slow = flood
        .join()
        .map_err(|_| BenchError::Failed("the slow peer's thread panicked".into()))??;
    let during_flood = during_flood?;
    let after_flood = MemoryUse::of(target.pid)?;
    drop(fleet);
    wait_connections(
        &mut control,
        |n| n <= 1,
        "still counts the closed connections after 30 s",
        30,
    )?;
    let after_close = MemoryUse::of(target.pid)?;

    for (what, outcome) in [("held", &held), ("during the flood", &during_flood)] {
        if outcome.errors > 0 {
            return Err(BenchError::Failed(format!(
                "{} error replies to pings {what}",
                outcome.errors
            )));
        }
    }
    let memory = [idle, with_connections, after_flood, after_close];
    let outcomes = (&held, &during_flood, &slow);
    let setting = (count, held_connections, limit, (soft, hard), capped);
    print_figures(args, setting, outcomes, memory);
    target.check_no_ping_answered_false()?;
    Ok(())
}

/// This process's open-file limit, raised; an error naming the fix when `count`
/// connections cannot fit in it.
fn open_file_limit(count: usize) -> Result<u64, BenchError> {
    let limit = super::raise_open_file_limit();
    let needed = count as u64 + 64;
    if limit < needed {
        return Err(BenchError::Failed(format!(
            "holding {count} connections needs about {needed} open files, but this process may \
             open only {limit} (the hard limit): raise it (`ulimit -Hn`, or LimitNOFILE= in a \
             unit) or ask for fewer connections"
        )));
    }
    Ok(limit)
}

/// The server, allowed `count` connections and the open files they need.
fn start_target(args: &ConnectionsArgs, count: usize) -> Result<(Target, u64), BenchError> {
    let max_connections = (count + 64).to_string();
    // The server needs two fds per connection (the socket and the peer's pidfd) and
    // keeps 256 and a quarter of its limit aside: give it that, as an operator's
    // LimitNOFILE= would.
    let server_open_files = (2 * (count as u64 + 64) + 256 + 1024) * 4 / 3 + 1;
    // Every connection is this process's (one uid): the node-wide bound is measured,
    // not one uid's share of it.
    let target = Target::start_with_open_files(
        &args.target,
        "bench-connections",
        &[
            "--max-connections",
            &max_connections,
            "--max-connections-per-uid",
            &max_connections,
        ],
        Some(server_open_files),
    )?;
    Ok((target, server_open_files))
}

/// Polls the server's connection count until `done` says so, at most `bound_s` seconds.
fn wait_connections(
    control: &mut RawConnection,
    done: impl Fn(usize) -> bool,
    failure: &str,
    bound_s: u64,
) -> Result<(), BenchError> {
    let started = Instant::now();
    while !done(control.status()?.connections) {
        if started.elapsed() > Duration::from_secs(bound_s) {
            return Err(BenchError::Failed(format!("the server {failure}")));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// How many connections the server admits of `count`, and why fewer when it does.
fn capped(count: usize, limits: &LimitsStatus) -> (usize, Option<String>) {
    // The control connection and the slow peer count too.
    let admitted = limits.max_connections;
    let held_count = count.min(admitted.saturating_sub(2)).max(1);
    let capped = (held_count < count).then(|| {
        format!(
            "capped at {held_count}: the server admits {admitted} connections (open files soft \
             {}, hard {}, 2 fds per connection + 256 and a quarter of the limit kept aside); \
             raise its hard limit \
             (LimitNOFILE=, ulimit -Hn; raising it needs CAP_SYS_RESOURCE) to hold {count}",
            limits.open_files_soft, limits.open_files_hard
        )
    });
    (held_count, capped)
}

/// R5's memory lines.
fn print_memory([idle, with_connections, after_flood, after_close]: [MemoryUse; 4]) {
    let rows = [
        ("server_rss_idle", idle, "before any connection"),
        ("server_rss_holding", with_connections, "while holding them"),
        ("server_rss_after_flood", after_flood, "after the flood"),
        ("server_rss_after_close", after_close, "after all closed"),
    ];
    for (name, memory, when) in rows {
        figure(
            "R5",
            name,
            format!("{:.1}", memory.rss_mib()),
            "MiB",
            &format!("{when}; {}", memory.describe()),
        );
    }
}

/// R5's lines.
fn print_figures(
    args: &ConnectionsArgs,
    (count, held_connections, limit, (soft, hard), capped): (
        usize,
        usize,
        u64,
        (String, String),
        Option<String>,
    ),
    (held, during_flood, slow): (&PingOutcome, &PingOutcome, &SlowPeer),
    [idle, with_connections, after_flood, after_close]: [MemoryUse; 4],
) {
    figure(
        "R5",
        "connections_held",
        held_connections.saturating_sub(1),
        "connections",
        &format!(
            "{} asked{}; {} pings answered in {:.1} s, 0 errors; open files: bench {limit}, \
             server soft {soft} hard {hard}",
            args.connections,
            capped.map(|c| format!(", {c}")).unwrap_or_default(),
            held.replies,
            held.elapsed.as_secs_f64()
        ),
    );
    figure(
        "R5",
        "ping_round_trip_p99",
        format!("{:.3}", held.round_trips.quantile_ms(0.99)),
        "ms",
        &format!("{count} connections, one ping a second each"),
    );
    figure(
        "R5",
        "ping_round_trip_p99_during_flood",
        format!("{:.3}", during_flood.round_trips.quantile_ms(0.99)),
        "ms",
        &format!(
            "the same, while one peer floods and never reads ({} pings answered)",
            during_flood.replies
        ),
    );
    let slow_note = format!(
        "sent {} pings ({:.1} MiB) in {:.2} s without reading a reply",
        slow.pings_sent,
        slow.bytes_sent as f64 / (1 << 20) as f64,
        slow.elapsed.as_secs_f64()
    );
    match &slow.disconnected {
        Some(how) => figure(
            "R5",
            "slow_peer_disconnected",
            "yes",
            "-",
            &format!("{slow_note}; then the server closed it ({how})"),
        ),
        None => figure(
            "R5",
            "slow_peer_disconnected",
            "NO",
            "-",
            &format!("{slow_note}; still connected after {SLOW_PEER_BOUND:?}"),
        ),
    }
    print_memory([idle, with_connections, after_flood, after_close]);
    let per_connection =
        (with_connections.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64 / count.max(1) as f64;
    figure(
        "R5",
        "rss_per_connection",
        format!("{per_connection:.0}"),
        "bytes",
        "(VmRSS holding - idle) / connections",
    );
}

/// Connects and sends pings in large batches, never reading, until the server closes
/// the connection (the write fails) or [`SLOW_PEER_BOUND`] passes.
fn slow_peer(socket: &Path) -> Result<SlowPeer, BenchError> {
    let mut stream =
        UnixStream::connect(socket).map_err(BenchError::io("connecting the slow peer"))?;
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .map_err(BenchError::io("setting a write timeout"))?;
    // Large request ids make every reply 16 bytes, so the output buffer fills sooner.
    const BATCH: u64 = 4_096;
    let started = Instant::now();
    let mut peer = SlowPeer {
        pings_sent: 0,
        bytes_sent: 0,
        elapsed: Duration::ZERO,
        disconnected: None,
    };
    let mut batch = Vec::new();
    let mut written = 0;
    'flood: while started.elapsed() < SLOW_PEER_BOUND {
        if written == batch.len() {
            batch.clear();
            written = 0;
            for i in 0..BATCH {
                let id = u64::MAX - peer.pings_sent - i;
                batch.extend_from_slice(&encode_request(id, "ping", vec![Value::Nil]));
            }
            peer.pings_sent += BATCH;
        }
        match stream.write(&batch[written..]) {
            Ok(0) => {
                peer.disconnected = Some("the socket accepts no more bytes".into());
                break 'flood;
            }
            Ok(n) => {
                written += n;
                peer.bytes_sent += n as u64;
            }
            // The server stopped reading for a while: not a disconnect; go on (a partial
            // frame is never abandoned, so the stream stays well-formed).
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => {
                peer.disconnected = Some(error.to_string());
                break 'flood;
            }
        }
    }
    peer.elapsed = started.elapsed();
    Ok(peer)
}
