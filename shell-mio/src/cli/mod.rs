//! The command line: `kvwarden serve | status | worker | call`.

mod bench;
mod call;
mod demo;
mod gpu;
mod serve;
mod status;
mod worker;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// kvwarden: the KV-cache server of a GPU node, which frees a dead worker's state
/// precisely and never takes a live worker's.
#[derive(Debug, Parser)]
#[command(name = "kvwarden", version)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server (Unix socket, optional TCP, HTTP status/metrics).
    Serve(serve::ServeArgs),
    /// Print a running server's status as a table (or JSON).
    Status(status::StatusArgs),
    /// Run a worker process: memfd buffers, heartbeat, store/retrieve traffic.
    Worker(worker::WorkerArgs),
    /// Send one raw request and print the reply as JSON (for debugging and tests).
    Call(call::CallArgs),
    /// See the point of kvwarden in under a minute: a demo server (short timeouts) and
    /// three workers; one SIGKILLed, one frozen past the timeout and thawed.
    Demo(demo::DemoArgs),
    /// Measure the server figures S1-S7 and R5 (one figure per line; targets and latest
    /// figures: docs/targets.md in the repository).
    Bench(bench::BenchArgs),
    /// GPU checks (G1, G2 of docs/targets.md): device info, reclaim after SIGKILL, copy bandwidth.
    #[command(subcommand)]
    Gpu(gpu::GpuCommand),
}

/// Parses the command line and runs the command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match &cli.command {
        Command::Serve(_) | Command::Worker(_) => "info",
        Command::Status(_)
        | Command::Call(_)
        | Command::Demo(_)
        | Command::Bench(_)
        | Command::Gpu(_) => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Status(args) => status::run(args),
        Command::Worker(args) => worker::run(args),
        Command::Call(args) => call::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Gpu(command) => gpu::run(command),
    }
}

/// The endpoint flags shared by the client commands.
#[derive(Debug, clap::Args)]
pub struct EndpointArgs {
    /// The server's Unix socket [default: $XDG_RUNTIME_DIR/kvwarden.sock, else
    /// /tmp/kvwarden-<uid>.sock].
    #[arg(long, conflicts_with = "tcp")]
    socket: Option<std::path::PathBuf>,
    /// Connect over TCP instead (no memfd buffers, no process-exit proof).
    #[arg(long)]
    tcp: Option<std::net::SocketAddr>,
}

impl EndpointArgs {
    fn endpoint(&self) -> crate::client::Endpoint {
        match (&self.tcp, &self.socket) {
            (Some(addr), _) => crate::client::Endpoint::Tcp(*addr),
            (None, Some(path)) => crate::client::Endpoint::Unix(path.clone()),
            (None, None) => {
                crate::client::Endpoint::Unix(crate::server::listen::default_socket_path())
            }
        }
    }
}

/// Parses sizes like `4096`, `64K`, `2M`, `1G` (powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {text:?}: use a number of bytes, optionally with K, M or G (powers of 1024)"))?;
    let scale: u64 = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return Err(format!("invalid size unit in {text:?}: use K, M or G")),
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2M"), Ok(2 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("3T").is_err());
    }
}
