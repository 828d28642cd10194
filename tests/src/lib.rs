//! Helpers for the end-to-end tests: a real `kvwarden serve` process with short
//! timeouts, real `kvwarden worker` processes, a raw protocol client, a TCP proxy that
//! can cut a connection, condition waits with generous bounds, and a real Redis Cluster
//! on loopback for the L2 tests ([`RedisCluster`]).
//!
//! Protocol 2 ("who is who"): a connection names an instance only once it has attached
//! it with the instance's secret. The raw client's instances use [`instance_secret`]
//! (derived from the id, so every connection of a test proves the same one):
//! [`RawClient::attach`] before naming an instance. A server started with `--tcp` gets a
//! token file of its own ([`Server::tcp_token_file`]) unless the test names one.
//!
//! The `kvwarden` binary is found next to the test executable (`target/<profile>/`):
//! `cargo test --workspace` builds it because the `kvwarden` package has integration
//! tests of its own. Running only this package needs `cargo build -p kvwarden-cli` first,
//! or `KVWARDEN_BIN=/path/to/kvwarden`.

pub mod l2_worker;
pub mod redis_cluster;

pub use redis_cluster::RedisCluster;

mod fork;
mod raw;
mod server;
mod standin;

pub use fork::*;
pub use raw::*;
pub use server::*;
pub use standin::*;

use kvwarden_bench::process::Lines;
use serde_json::Value as Json;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The bound every wait uses unless it says otherwise: generous, for loaded CI.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The TCP token a test server gets with `--tcp` unless the test gives its own
/// `--tcp-token-file` (written to `tcp-token` in the server's directory, mode 600).
pub const TCP_TOKEN: &str = "kvwarden-tests-tcp-token-5f0c2a9d81e4b7c3";

/// The secret the tests' raw clients draw with `instance` (32 bytes, derived from the
/// id): every connection of a test that attaches `instance` proves the same one. A
/// real worker draws its secret from the OS; a test only needs it to be known to the
/// test and to differ between ids.
pub fn instance_secret(instance: u64) -> Vec<u8> {
    let mut secret = Vec::with_capacity(32);
    for round in 0..2u64 {
        let half = xxhash_rust::xxh3::xxh3_128_with_seed(
            &instance.to_le_bytes(),
            0x6b76_7761_7264_656e ^ round,
        );
        secret.extend_from_slice(&half.to_le_bytes());
    }
    secret
}

/// The tenant a Unix peer of this test process acts for by default: `uid-<uid>`.
pub fn own_tenant() -> String {
    format!("uid-{}", rustix::process::getuid().as_raw())
}

/// The node's name of a worker's `key` in `tenant`'s keyspace (protocol 2: every key is
/// scoped per tenant, `[len(name)] ++ name ++ key`): what L2 stores it under.
pub fn tenant_scoped_key(tenant: &str, key: &[u8]) -> Vec<u8> {
    kvwarden_core::node::trust::scoped_key(tenant, key)
}

/// Writes `token` to `path` with mode 600 (a token file for `--tcp-token-file`).
pub fn write_token_file(path: &Path, token: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("{token}\n")).expect("writing a token file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod 600 of the token file");
}

/// The `kvwarden` binary.
pub fn kvwarden_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("KVWARDEN_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/kvwarden
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable lives in target/<profile>/deps");
    let bin = profile_dir.join("kvwarden");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test --workspace` (which builds it), or \
         `cargo build -p kvwarden-cli` first, or set KVWARDEN_BIN",
        bin.display()
    );
    bin
}

/// Waits until `condition` returns Some, polling every few milliseconds; panics
/// naming `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut condition: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = condition() {
            return value;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A private temporary directory (from `tempfile`: an unpredictable name, created
/// exclusively), removed on drop.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory (mode 0755, so other users can reach a socket in it).
    pub fn new(tag: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("kvwarden-test-{tag}-"))
            .tempdir()
            .expect("creating a temp dir");
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755));
        TempDir(dir)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Hands the directory to `uid` (group `uid` too), for a server running as that
    /// uid to create its socket in (needs root).
    pub fn chown(&self, uid: u32) {
        std::os::unix::fs::chown(self.path(), Some(uid), Some(uid))
            .expect("chown of the temp dir (the tests that act as other uids run as root)");
    }
}

/// Sends `signal` to a child process.
pub fn signal(child: &Child, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_child(child);
    let _ = rustix::process::kill_process(pid, signal);
}

/// Why a server cannot be put in a PID namespace of its own here, or None when it
/// can: that takes root (CAP_SYS_ADMIN) and util-linux `unshare`. Tests that need one
/// print the reason and pass without checking anything.
pub fn pid_namespace_unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not running as root: unshare --pid needs CAP_SYS_ADMIN".into());
    }
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match probe {
        Err(error) => Some(format!(
            "`unshare` (util-linux) cannot be run: {error}; install util-linux"
        )),
        Ok(output) if !output.status.success() => Some(format!(
            "`unshare --pid --fork --mount-proc --kill-child true` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// `defaults` then `extra`, where a flag in `extra` replaces the default of the same
/// name and its value (clap refuses repeated flags).
pub fn merge_flags<'a>(defaults: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = Vec::new();
    let mut defaults = defaults.iter().copied().peekable();
    while let Some(flag) = defaults.next() {
        let value = defaults.next_if(|v| !v.starts_with("--"));
        if !extra.contains(&flag) {
            args.push(flag);
            args.extend(value);
        }
    }
    args.extend_from_slice(extra);
    args
}

/// The status entry of `instance` in `status`.
pub fn find_instance(status: &Json, instance: u64) -> Option<Json> {
    status["instances"]
        .as_array()?
        .iter()
        .find(|item| {
            // The `status` op's map has the id as an integer, `GET /status` as a string.
            item["instance_id"].as_u64() == Some(instance)
                || item["instance_id"].as_str() == Some(instance.to_string().as_str())
        })
        .cloned()
}

/// `status.contexts.freed_total.<cause>`.
pub fn freed(status: &Json, cause: &str) -> u64 {
    status["contexts"]["freed_total"][cause]
        .as_u64()
        .unwrap_or(0)
}

/// `status.contexts.built_total`.
pub fn built(status: &Json) -> u64 {
    status["contexts"]["built_total"].as_u64().unwrap_or(0)
}

/// Waits for a child to exit, up to `timeout`.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// A running `kvwarden worker`.
pub struct Worker {
    /// The process.
    pub child: Child,
    /// Its instance id.
    pub instance_id: u64,
    lines: Lines,
}

impl Worker {
    /// Starts `kvwarden worker` with `args` and waits until it has registered.
    pub fn start(args: &[&str]) -> Worker {
        Worker::start_with_env(args, &[])
    }

    /// As [`Worker::start`], with extra environment variables for the worker process
    /// (e.g. `LD_LIBRARY_PATH` naming the stand-in libcuda of `tests/tests/cuda.rs`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Worker {
        let mut child = Command::new(kvwarden_bin())
            .arg("worker")
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kvwarden worker");
        let mut lines = Lines::spawn(child.stdout.take().expect("stdout"));
        let mut stderr = child.stderr.take().expect("stderr");
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_line(&mut lines, "instance_id=", |l| {
                l.starts_with("instance_id=")
            })
        }));
        let Ok(line) = started else {
            let _ = child.kill();
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            panic!("the worker did not start with {args:?}: {text}");
        };
        // Drain stderr so the worker never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        let instance_id = line["instance_id=".len()..]
            .parse()
            .expect("a numeric instance id");
        wait_line(&mut lines, "registered", |l| {
            l.starts_with("registered outcome=")
        });
        Worker {
            child,
            instance_id,
            lines,
        }
    }

    /// Starts a worker on the server's Unix socket with a fast heartbeat.
    pub fn unix(server: &Server, extra: &[&str]) -> Worker {
        let socket = server.socket.to_string_lossy().into_owned();
        let defaults = [
            "--socket",
            &socket,
            "--heartbeat-interval-seconds",
            "0.2",
            "--buffer-bytes",
            "256K",
            "--chunk-bytes",
            "4K",
        ];
        Worker::start(&merge_flags(&defaults, extra))
    }

    /// Starts a worker over TCP to `address` (the server's TCP listener, or a proxy to
    /// it) with the server's token, a fast heartbeat and no buffer (the server cannot
    /// see a TCP peer's process: only the heartbeat rules apply to it).
    pub fn tcp(server: &Server, address: SocketAddr) -> Worker {
        let address = address.to_string();
        let token = server
            .tcp_token_file
            .as_ref()
            .expect("the server listens on TCP (--tcp), with a token file")
            .to_string_lossy()
            .into_owned();
        Worker::start(&[
            "--tcp",
            &address,
            "--tcp-token-file",
            &token,
            "--heartbeat-interval-seconds",
            "0.2",
            "--buffer-bytes",
            "0",
        ])
    }

    /// Waits for a stdout line matching `pred`.
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        wait_line(&mut self.lines, what, pred)
    }

    /// Every line seen so far.
    pub fn lines_seen(&mut self) -> &[String] {
        self.lines.seen()
    }

    /// Sends a signal.
    pub fn signal(&self, sig: rustix::process::Signal) {
        signal(&self.child, sig);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        signal(&self.child, rustix::process::Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
