//! The S1 baseline: `redis-benchmark -t ping` against a local `redis-server` on a Unix
//! socket, in the same run as the kvwarden figure (so that machine drift cancels).

use super::BenchError;
use super::process::{TempDir, die_with_parent, wait_exit};
use super::redis_cluster::{server_command, wait_until};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `redis-server` with no TCP port, no persistence, on a Unix socket.
pub struct RedisServer {
    child: Child,
    /// Its Unix socket.
    pub socket: PathBuf,
    _dir: TempDir,
}

impl RedisServer {
    /// Starts `redis-server --port 0 --unixsocket <tmp> --save '' --appendonly no` and
    /// waits until its socket answers.
    pub fn start() -> Result<RedisServer, BenchError> {
        let dir = TempDir::new("redis")?;
        let socket = dir.path().join("redis.sock");
        let mut command = server_command(dir.path());
        command
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args(["--unixsocketperm", "700"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command
            .spawn()
            .map_err(BenchError::io("spawning redis-server"))?;
        let server = RedisServer {
            child,
            socket,
            _dir: dir,
        };
        wait_until(
            &format!("redis-server to open {}", server.socket.display()),
            || std::os::unix::net::UnixStream::connect(&server.socket).ok(),
        )?;
        Ok(server)
    }
}

impl RedisServer {
    /// Its process id.
    pub fn pid(&self) -> i32 {
        rustix::process::Pid::from_child(&self.child)
            .as_raw_nonzero()
            .get()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        super::process::signal(&self.child, rustix::process::Signal::TERM);
        if wait_exit(&mut self.child, Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The throughput `redis-benchmark` reports per test (`PING_INLINE`, `PING_MBULK`).
#[derive(Clone, Debug)]
pub struct RedisFigures {
    /// `(test, requests per second)`.
    pub tests: Vec<(String, f64)>,
}

impl RedisFigures {
    /// The best test (the stricter baseline).
    pub fn best(&self) -> f64 {
        self.tests.iter().map(|(_, rps)| *rps).fold(0.0, f64::max)
    }
}

/// Runs `redis-benchmark -s <socket> -t ping -c <connections> -n <requests> -q`.
pub fn benchmark(
    socket: &Path,
    connections: usize,
    requests: u64,
) -> Result<RedisFigures, BenchError> {
    let mut command = Command::new("redis-benchmark");
    command
        .arg("-s")
        .arg(socket)
        .args(["-t", "ping", "-c", &connections.to_string()])
        .args(["-n", &requests.to_string(), "-q"])
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    die_with_parent(&mut command);
    let output = command
        .output()
        .map_err(BenchError::io("running redis-benchmark"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let figures = parse(&text);
    if figures.tests.is_empty() {
        return Err(BenchError::Failed(format!(
            "redis-benchmark printed no `requests per second` line (exit {}); its output: {text:?}",
            output.status
        )));
    }
    Ok(figures)
}

/// Reads `PING_INLINE: 63653.72 requests per second, p50=…` segments (progress updates
/// are separated by carriage returns).
fn parse(text: &str) -> RedisFigures {
    let tests = text
        .split(['\r', '\n'])
        .filter_map(|segment| {
            let (test, rest) = segment.trim().split_once(':')?;
            let (number, _) = rest.split_once("requests per second")?;
            Some((test.to_string(), number.trim().parse().ok()?))
        })
        .collect();
    RedisFigures { tests }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_both_ping_tests_past_progress_updates() {
        let text = "\rPING_INLINE: rps=0.0 (overall: -nan) avg_msec=-nan\r   \r\
                    PING_INLINE: 63653.72 requests per second, p50=0.327 msec\n\
                    \rPING_MBULK: rps=7.0\rPING_MBULK: 63979.53 requests per second, p50=0.311 msec\n";
        let figures = super::parse(text);
        assert_eq!(figures.tests.len(), 2, "{figures:?}");
        assert_eq!(figures.best(), 63979.53);
    }
}
