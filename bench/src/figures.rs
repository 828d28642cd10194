//! `kvwarden-bench <figure>` (and `kvwarden bench <figure>`): the server figures S1–S7,
//! W1, E1 and R5 of `docs/targets.md`, one a line on stdout; progress on stderr.

use crate as bench;
use std::process::ExitCode;

/// Flags of `kvwarden bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    figure: Figure,
}

#[derive(Debug, clap::Subcommand)]
enum Figure {
    /// S1: closed-loop ping throughput, 50 connections with one ping in flight each, and
    /// in the same run redis-server on a Unix socket, driven by redis-benchmark and by
    /// this load generator speaking RESP, when both are on PATH (else skipped, said so).
    /// Target: >= 1.0 x Redis.
    Ping(bench::ping::PingArgs),
    /// S2: ping round-trip p50/p99/p999 with 1,000 connected workers (each its own
    /// registered instance) pinging every 100 ms. Target: p99 <= 1 ms.
    Latency(bench::latency::LatencyArgs),
    /// S3: ping round trips as in S2 while context builds take 200 ms, the first frees
    /// hang for good, and instances are registered and unregistered without pause
    /// (test-only server faults). Target: p99 <= 2 ms.
    SlowContexts(bench::slow_contexts::SlowContextsArgs),
    /// S4: SIGKILL of a same-host `kvwarden worker` -> its context freed (process-exit
    /// proof), p50/p99/max over N kills. Target: p99 <= 100 ms.
    Kill(bench::kill::KillArgs),
    /// S5: a TCP worker (no process-exit proof) frozen by SIGSTOP -> reaped; the reap
    /// time minus its last evidence. Target: within T + R (test timeouts T = 2 s,
    /// R = 0.1 s).
    Reap(bench::reap::ReapArgs),
    /// S6: store + retrieve bandwidth of 2 MiB chunks (memfd <-> L1) against a
    /// single-thread memcpy in the same run. Target: >= 0.5 x memcpy.
    Copy(bench::copy::CopyArgs),
    /// B1: 64 blocks in one store_batch / retrieve_batch against 64 single store /
    /// retrieve requests one at a time (how the vLLM connector moved a step before).
    Batch(bench::batch::BatchArgs),
    /// S7: server RSS with 10,000 registered instances, L1 excluded (a one-slot L1 that
    /// is never stored into). Target: <= 64 MiB.
    Memory(bench::memory::MemoryArgs),
    /// R5: hold N concurrent connections that ping; a peer that never reads is
    /// disconnected once its output buffer is full; server RSS before, while and after.
    /// Target: N = 10,000 held, the slow peer disconnected, memory flat.
    Connections(bench::connections::ConnectionsArgs),
    /// L1-L4: the L2 tier on a real Redis Cluster (started on loopback, or --l2): a
    /// chunk stored through node A and retrieved through node B against a plain GET;
    /// write-behind and read-through throughput (256 KiB, 2 MiB) against SET/GET; every
    /// Redis node SIGSTOPped; a master SIGKILLed.
    L2(bench::l2::L2Args),
    /// F1: a victim's latency under each neighbour's flood of issue 51 over the same
    /// without it: a TCP worker's session under tokenless connections, /healthz under
    /// silent HTTP connections, a retrieve under another tenant's queued copies (as
    /// root: the flood runs as uid 1001).
    Floods(bench::floods::FloodsArgs),
    /// W1: a server on a pool file (--l1-file) filled by stores, SIGKILLed and started
    /// again: chunks adopted over stored (target >= 0.99), the time to ready and to the
    /// pool adopted, the adoption rate over a sequential read of the pool file (target
    /// >= 0.5 x).
    Restart(bench::restart::RestartArgs),
    /// E1: KV events at store load: the changes a kv_events reader gets per second, the
    /// server's CPU with the reader over without it (target <= 1.02 x), the lag from a
    /// store to its change at the reader (target p99 <= 100 ms), what one change costs
    /// the log, and how long a reader takes to know the server is gone (target <= 1 s).
    Events(bench::events::EventsArgs),
    /// E2: the server's own KV-event stream (--kv-events) at store load: events per
    /// second, the server's CPU with the stream over without it (target <= 1.02 x), the
    /// lag from a block described to its BlockStored (target p99 <= 100 ms) and from its
    /// eviction to its BlockRemoved (target p99 <= 1 s).
    Stream(bench::stream::StreamArgs),
}

/// Runs one figure; exit 0 when it was measured (whether or not it meets its target).
pub fn run(args: BenchArgs) -> ExitCode {
    let result = match &args.figure {
        Figure::Ping(args) => bench::ping::run(args),
        Figure::Latency(args) => bench::latency::run(args),
        Figure::SlowContexts(args) => bench::slow_contexts::run(args),
        Figure::Kill(args) => bench::kill::run(args),
        Figure::Reap(args) => bench::reap::run(args),
        Figure::Copy(args) => bench::copy::run(args),
        Figure::Batch(args) => bench::batch::run(args),
        Figure::Memory(args) => bench::memory::run(args),
        Figure::Connections(args) => bench::connections::run(args),
        Figure::L2(args) => bench::l2::run(args),
        Figure::Floods(args) => bench::floods::run(args),
        Figure::Restart(args) => bench::restart::run(args),
        Figure::Events(args) => bench::events::run(args),
        Figure::Stream(args) => bench::stream::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvwarden bench: {error}");
            ExitCode::from(1)
        }
    }
}
