//! `kvwarden-bench`: see `kvwarden-bench --help` (the same as `kvwarden bench`).

use clap::Parser;

/// Measure the kvwarden server figures S1-S7 and R5 (one figure per line; targets and
/// latest figures: docs/targets.md in the repository). Spawns the `kvwarden` beside
/// this executable (or $KVWARDEN_BIN) as server and workers.
#[derive(Debug, Parser)]
#[command(name = "kvwarden-bench", version)]
struct Cli {
    #[command(flatten)]
    args: kvwarden_bench::BenchArgs,
}

fn main() -> std::process::ExitCode {
    kvwarden_bench::run(Cli::parse().args)
}
