//! `kvwarden-bench` (also run as `kvwarden bench`): the server figures S1–S7 of
//! `docs/targets.md`, the load figure R5 and the batch figure B1, measured against a
//! real server process.
//!
//! A crate of its own, beside the server as `redis-benchmark` ships beside
//! `redis-server`: it links the core and the worker client, not the server. Each figure
//! starts its own `kvwarden serve` (the `kvwarden` executable, see
//! [`process::kvwarden_exe`], on a temporary socket, `--http off` unless needed) unless
//! `--socket` names a running one, prints progress on stderr, and prints its figures on
//! stdout, one a line, in a stable form:
//! `ID name value unit (what it was measured under; the target)`. Figures are measured,
//! never asserted: the machines they run on are shared and noisy.

pub mod batch;
pub mod connections;
pub mod copy;
pub mod events;
mod figures;
pub mod floods;
pub mod kill;
pub mod l2;
pub mod latency;
pub mod load;
pub mod memory;
pub mod ping;
pub mod process;
pub mod raw;
pub mod reap;
mod redis;
pub mod redis_cluster;
pub mod restart;
pub mod slow_contexts;
pub mod stats;
pub mod stream;
pub mod target;

pub use figures::{BenchArgs, run};

use kvwarden_client::memfd;
use kvwarden_core::protocol;
use std::io::Write;
use thiserror::Error;

/// Why a benchmark could not measure.
#[derive(Debug, Error)]
pub enum BenchError {
    /// A system call or a child process failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The server answered something a benchmark cannot go on with.
    #[error("{0}")]
    Failed(String),
}

impl BenchError {
    /// An I/O error while doing `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
        let what = what.into();
        move |source| BenchError::Io { what, source }
    }

    /// A worker client's error while doing `what`.
    pub fn client(what: &str) -> impl FnOnce(kvwarden_client::ClientError) -> BenchError + '_ {
        move |error| BenchError::Failed(format!("{what}: {error}"))
    }
}

/// A worker client of the server at `socket`, registering nothing.
pub fn client(socket: &std::path::Path) -> Result<kvwarden_client::Client, BenchError> {
    use kvwarden_client::{Client, ClientConfig, Endpoint};
    Client::connect(ClientConfig::new(Endpoint::Unix(socket.to_path_buf())))
        .map_err(BenchError::client("connecting"))
}

/// A worker of the server at `socket` with one memfd buffer of `bytes` registered for
/// `model`.
pub fn registered(
    socket: &std::path::Path,
    bytes: u64,
    model: &str,
) -> Result<
    (
        kvwarden_client::Client,
        std::sync::Arc<kvwarden_client::MemfdBuffer>,
    ),
    BenchError,
> {
    let client = client(socket)?;
    let buffer = std::sync::Arc::new(
        kvwarden_client::MemfdBuffer::new(bytes as usize)
            .map_err(BenchError::client("a memfd buffer"))?,
    );
    client
        .register(vec![std::sync::Arc::clone(&buffer)], model, 1)
        .map_err(BenchError::client("registering"))?;
    Ok((client, buffer))
}

/// Prints one figure on stdout: `ID name value unit (note)`.
pub fn figure(id: &str, name: &str, value: impl std::fmt::Display, unit: &str, note: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{id} {name} {value} {unit} ({note})");
    let _ = out.flush();
}

/// Prints a progress line on stderr.
pub fn progress(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "bench: {line}");
    let _ = err.flush();
}

/// Raises this process's open-file soft limit to its hard limit (a benchmark that holds
/// thousands of connections needs one fd each); returns the soft limit now in force.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(error) = setrlimit(Resource::Nofile, raised) {
            progress(&format!(
                "raising the open-file soft limit to the hard limit {:?} failed: {error}",
                limit.maximum
            ));
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// The machine's load average over the last minute (shared machines: say it next to
/// every figure).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

/// Prints the machine context every figure is read against.
pub fn print_machine() {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    progress(&format!(
        "machine: {cores} cores, load average (1 min) {}",
        load_average()
    ));
}

/// `value` seconds of flag `flag` as a duration, or an error naming the bad value.
pub fn positive_seconds(flag: &str, value: f64) -> Result<std::time::Duration, BenchError> {
    std::time::Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            BenchError::Failed(format!(
                "invalid {flag} {value}: use a positive number of seconds, e.g. 2 or 0.5"
            ))
        })
}
