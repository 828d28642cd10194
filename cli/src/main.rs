//! `kvwarden`: see `kvwarden --help`.
//!
//! The server's commands come from the server crate (`kvwarden-shell-mio`); this binary
//! adds the drivers that spawn servers and workers of their own: the demo, the bench
//! (`kvwarden-bench`) and the GPU checks. The server crate links none of them.

mod demo;
mod gpu;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// kvwarden: the KV-cache server of a GPU node, which frees a dead worker's state
/// precisely and never takes a live worker's.
#[derive(Debug, Parser)]
#[command(name = "kvwarden", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Server(kvwarden::cli::Command),
    /// See the point of kvwarden in under a minute: a demo server (short timeouts) and
    /// three workers; one SIGKILLed, one frozen past the timeout and thawed.
    Demo(demo::DemoArgs),
    /// Measure the server figures S1-S7 and R5 (one figure per line; targets and latest
    /// figures: docs/targets.md in the repository).
    Bench(kvwarden_bench::BenchArgs),
    /// GPU checks (G1, G2 of docs/targets.md): device info, reclaim after SIGKILL, copy bandwidth.
    #[command(subcommand)]
    Gpu(gpu::GpuCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    kvwarden::cli::init_logging(match &cli.command {
        Command::Server(command) => command.default_log_level(),
        Command::Demo(_) | Command::Bench(_) | Command::Gpu(_) => "warn",
    });
    match cli.command {
        Command::Server(command) => command.run(),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => kvwarden_bench::run(args),
        Command::Gpu(command) => gpu::run(command),
    }
}
