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

use kvwarden_bench::process::Lines;
use kvwarden_core::protocol::{Reply, decode_reply, encode_request};
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd};
use serde_json::Value as Json;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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

/// Waits up to [`PATIENCE`] for a stdout line matching `pred`; panics naming `what`
/// and every line seen when none comes.
fn wait_line(lines: &mut Lines, what: &str, pred: impl Fn(&str) -> bool) -> String {
    lines
        .wait(what, PATIENCE, pred)
        .unwrap_or_else(|error| panic!("{error}"))
}

/// A running `kvwarden serve`.
pub struct Server {
    /// The process.
    pub child: Child,
    /// The Unix socket.
    pub socket: PathBuf,
    /// The HTTP address, when enabled.
    pub http: Option<SocketAddr>,
    /// The TCP address, when enabled.
    pub tcp: Option<SocketAddr>,
    /// The file holding the TCP token (`--tcp-token-file`), when TCP is enabled.
    pub tcp_token_file: Option<PathBuf>,
    stderr_path: PathBuf,
    status_client: Mutex<Option<RawClient>>,
    /// Why this test makes the server answer pings `false` on purpose, if it does.
    pings_answered_false_expected: Mutex<Option<String>>,
}

/// The flags every test server gets unless a test overrides them: T = 2 s,
/// G = 4 s, R = 0.1 s, small L1, HTTP on a random port.
pub const SHORT_TIMEOUTS: &[&str] = &[
    "--allow-short-timeouts",
    "--worker-reap-timeout-seconds",
    "2",
    "--worker-registration-grace-seconds",
    "4",
    "--resolution-seconds",
    "0.1",
    "--l1-bytes",
    "4M",
    "--slot-bytes",
    "64K",
    "--http",
    "127.0.0.1:0",
];

impl Server {
    /// Starts a server on `dir/kvwarden.sock` with [`SHORT_TIMEOUTS`] and `extra`
    /// flags (later flags win), and waits until it is ready.
    pub fn start(dir: &TempDir, extra: &[&str]) -> Server {
        Server::start_raw(dir, &merge_flags(SHORT_TIMEOUTS, extra))
    }

    /// Starts a server with exactly `args` (plus `--socket`).
    pub fn start_raw(dir: &TempDir, args: &[&str]) -> Server {
        Server::start_raw_env(dir, args, &[])
    }

    /// As [`Server::start`], with the reap timeout T (`--worker-reap-timeout-seconds`)
    /// and the registration grace G (`--worker-registration-grace-seconds`) given in
    /// whole seconds (0 turns reaping off), then `extra` flags.
    pub fn start_with_reaping(
        dir: &TempDir,
        reap_timeout_seconds: u64,
        registration_grace_seconds: u64,
        extra: &[&str],
    ) -> Server {
        let (reap, grace) = (
            reap_timeout_seconds.to_string(),
            registration_grace_seconds.to_string(),
        );
        let mut flags = vec![
            "--worker-reap-timeout-seconds",
            &reap,
            "--worker-registration-grace-seconds",
            &grace,
        ];
        flags.extend_from_slice(extra);
        Server::start(dir, &flags)
    }

    /// As [`Server::start`], with extra environment variables for the server process.
    pub fn start_with_env(dir: &TempDir, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_raw_env(dir, &merge_flags(SHORT_TIMEOUTS, extra), env)
    }

    /// Starts a server with exactly `args` (plus `--socket`) and `env`.
    pub fn start_raw_env(dir: &TempDir, args: &[&str], env: &[(&str, &str)]) -> Server {
        Server::spawn_as(dir, args, env, None, None)
    }

    /// As [`Server::start`], but the server process runs as `uid` (and gid `uid`, no
    /// supplementary groups: set in the child before `exec`, so it needs root). `dir`
    /// must be writable by `uid` ([`TempDir::chown`]).
    pub fn start_as_uid(dir: &TempDir, uid: u32, extra: &[&str]) -> Server {
        Server::spawn_as(
            dir,
            &merge_flags(SHORT_TIMEOUTS, extra),
            &[],
            None,
            Some(uid),
        )
    }

    /// As [`Server::start`], but under an open-file limit of `fds` (soft and hard,
    /// `prlimit`), so that the fd budget derived from it is small enough to reach.
    pub fn start_with_open_files(dir: &TempDir, fds: u64, extra: &[&str]) -> Server {
        let nofile = format!("--nofile={fds}:{fds}");
        let wrapper = ["prlimit", nofile.as_str(), "--"];
        Server::spawn_as(
            dir,
            &merge_flags(SHORT_TIMEOUTS, extra),
            &[],
            Some(&wrapper),
            None,
        )
    }

    /// The fds the server process holds now (`/proc/<pid>/fd`).
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .map(|entries| entries.count())
            .unwrap_or(0)
    }

    /// The value of the counter `name` (a full sample name, `…_total`) whose labels
    /// include every `label="value"` of `labels`, from `/metrics`; 0 when absent.
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let (code, body) = self.http_get("/metrics");
        assert_eq!(code, 200, "{body}");
        body.lines()
            .filter(|line| line.starts_with(name) && line[name.len()..].starts_with('{'))
            .filter(|line| {
                labels
                    .iter()
                    .all(|(label, value)| line.contains(&format!("{label}=\"{value}\"")))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|value| value as u64)
            .sum()
    }

    /// As [`Server::start`], but the server runs in a PID namespace of its own (and a
    /// `/proc` of that namespace), as in a container without `hostPID`: every worker
    /// started by the test is outside it, so `SO_PEERCRED` shows it pid 0. Check
    /// [`pid_namespace_unavailable`] first.
    pub fn start_in_pid_namespace(dir: &TempDir, extra: &[&str]) -> Server {
        let unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
        Server::spawn_as(
            dir,
            &merge_flags(SHORT_TIMEOUTS, extra),
            &[],
            Some(&unshare),
            None,
        )
    }

    /// Starts `kvwarden serve`, under `wrapper` (a command that runs the rest) if given,
    /// as `uid` if given.
    fn spawn_as(
        dir: &TempDir,
        args: &[&str],
        env: &[(&str, &str)],
        wrapper: Option<&[&str]>,
        uid: Option<u32>,
    ) -> Server {
        Server::spawn_with_fds(dir, args, env, wrapper, uid, &[])
    }

    /// As [`Server::start_with_env`], playing systemd's part of a start: `fds` are
    /// passed as fds 3, 4, … with `LISTEN_FDS`, their names in `LISTEN_FDNAMES` and
    /// `LISTEN_PID` the server's own pid (set by `sh` just before it execs the server).
    pub fn start_with_listen_fds(
        dir: &TempDir,
        extra: &[&str],
        env: &[(&str, &str)],
        fds: &[(BorrowedFd<'_>, &str)],
    ) -> Server {
        let count = fds.len().to_string();
        let names = fds
            .iter()
            .map(|(_, name)| *name)
            .collect::<Vec<_>>()
            .join(":");
        let mut env = env.to_vec();
        env.extend([
            ("LISTEN_FDS", count.as_str()),
            ("LISTEN_FDNAMES", names.as_str()),
        ]);
        Server::spawn_with_fds(
            dir,
            &merge_flags(SHORT_TIMEOUTS, extra),
            &env,
            Some(&["sh", "-c", "LISTEN_PID=$$ exec \"$0\" \"$@\""]),
            None,
            fds,
        )
    }

    fn spawn_with_fds(
        dir: &TempDir,
        args: &[&str],
        env: &[(&str, &str)],
        wrapper: Option<&[&str]>,
        uid: Option<u32>,
        listen_fds: &[(BorrowedFd<'_>, &str)],
    ) -> Server {
        let socket = dir.path().join("kvwarden.sock");
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let stderr_path = dir.path().join(format!(
            "server-{}.log",
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        let stderr = std::fs::File::create(&stderr_path).expect("server log");
        // `--tcp` needs a token file (protocol 2); one of the test's own wins.
        let token_path = dir.path().join("tcp-token");
        let token_arg = token_path.to_string_lossy().into_owned();
        let mut args: Vec<&str> = args.to_vec();
        let tcp_token_file = if let Some(at) = args.iter().position(|a| *a == "--tcp-token-file") {
            args.get(at + 1).map(PathBuf::from)
        } else if args.contains(&"--tcp") {
            write_token_file(&token_path, TCP_TOKEN);
            args.extend(["--tcp-token-file", token_arg.as_str()]);
            Some(token_path.clone())
        } else {
            None
        };
        let mut command = match wrapper {
            Some([program, wrapper_args @ ..]) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(kvwarden_bin());
                command
            }
            _ => Command::new(kvwarden_bin()),
        };
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            // As root, std also drops the supplementary groups (setgroups(0)).
            command.uid(uid).gid(uid);
        }
        assert!(listen_fds.len() <= 16, "at most 16 fds are passed");
        if !listen_fds.is_empty() {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let raw: Vec<i32> = listen_fds.iter().map(|(fd, _)| fd.as_raw_fd()).collect();
            // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec.
            unsafe {
                command.pre_exec(move || {
                    // Out of the way first (a source may sit at 3 or 4 itself), then
                    // into place, without FD_CLOEXEC (dup2 clears it).
                    // No allocation here (another thread may hold malloc's lock).
                    let mut high = [0i32; 16];
                    for (slot, &fd) in high.iter_mut().zip(&raw) {
                        let moved = libc::fcntl(fd, libc::F_DUPFD, 100);
                        if moved < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        *slot = moved;
                    }
                    for (i, &fd) in high[..raw.len()].iter().enumerate() {
                        if libc::dup2(fd, 3 + i as i32) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let mut child = command
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(&args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawning kvwarden serve");
        let mut lines = Lines::spawn(child.stdout.take().expect("stdout"));
        let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_line(&mut lines, "ready", |l| l == "ready")
        }));
        if ready.is_err() {
            let _ = child.kill();
            panic!(
                "the server did not start: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        let seen = lines.seen();
        let addr = |prefix: &str| {
            seen.iter()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|a| a.parse().ok())
        };
        Server {
            http: addr("http="),
            tcp: addr("tcp="),
            tcp_token_file,
            child,
            socket,
            stderr_path,
            status_client: Mutex::new(None),
            pings_answered_false_expected: Mutex::new(None),
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The status map (the `status` op), as JSON.
    pub fn status(&self) -> Json {
        let mut client = self.status_client.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..3 {
            if client.is_none() {
                *client = RawClient::connect(&self.socket).ok();
            }
            if let Some(raw) = client.as_mut()
                && let Ok(reply) = raw.request("status", vec![])
                && let Ok(value) = reply.result
            {
                return kvwarden::server::status::msgpack_to_json(&value);
            }
            *client = None;
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the server does not answer `status`; log:\n{}", self.log());
    }

    /// `GET path` on the HTTP listener: the status code and the body.
    pub fn http_get(&self, path: &str) -> (u16, String) {
        let address = self.http.expect("the server's HTTP address (--http)");
        let mut stream = TcpStream::connect(address).expect("connecting to the HTTP listener");
        stream
            .set_read_timeout(Some(PATIENCE))
            .expect("a read timeout");
        write!(stream, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").expect("the request");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("the response");
        let code = response
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default();
        (code, body)
    }

    /// The status entry of `instance`, if tracked.
    pub fn instance(&self, instance: u64) -> Option<Json> {
        find_instance(&self.status(), instance)
    }

    /// Waits until `condition` holds on the status; returns that status.
    pub fn wait_status(&self, what: &str, condition: impl Fn(&Json) -> bool) -> Json {
        wait_for(what, PATIENCE, || {
            let status = self.status();
            condition(&status).then_some(status)
        })
    }

    /// Declares that this test makes the server answer pings `false` on purpose: a
    /// reap, a server restart, a partition longer than T, a ping of an id never
    /// registered. Without it, the server answering any ping `false` fails the test
    /// when the server is dropped or terminated: a live worker told that its instance
    /// is not held is the failure kvwarden exists to prevent (issue 16).
    pub fn expect_pings_answered_false(&self, why: &str) {
        *self
            .pings_answered_false_expected
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
    }

    /// The check [`Server::expect_pings_answered_false`] turns off: while the server
    /// still runs, it must not have answered any ping `false`.
    fn check_no_ping_answered_false(&mut self) {
        let expected = self
            .pings_answered_false_expected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if expected || std::thread::panicking() || !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        signal(&self.child, rustix::process::Signal::CONT); // a test may have paused it
        let Some(status) = self.try_status() else {
            return; // not answering: the test is about something else
        };
        let liveness = &status["worker_liveness"];
        let answered_false = liveness["pings_answered_false_total"].as_u64().unwrap_or(0);
        if answered_false > 0 {
            let _ = self.child.kill();
            let _ = self.child.wait();
            panic!(
                "the server answered {answered_false} of {} pings `false` in a test that \
                 declared no reap, restart, partition or unknown id \
                 (Server::expect_pings_answered_false): a live worker was told its instance \
                 is not held; log:\n{}",
                liveness["pings_total"],
                self.log()
            );
        }
    }

    /// The status map, or None when the server does not answer within a few seconds.
    fn try_status(&self) -> Option<Json> {
        let mut raw = RawClient::connect(&self.socket).ok()?;
        raw.stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .ok()?;
        let value = raw.request("status", vec![]).ok()?.result.ok()?;
        Some(kvwarden::server::status::msgpack_to_json(&value))
    }

    /// SIGTERM, then wait for the exit.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        self.check_no_ping_answered_false();
        signal(&self.child, rustix::process::Signal::TERM);
        let status = wait_exit(&mut self.child, PATIENCE).expect("the server exits after SIGTERM");
        (status, self.log())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.check_no_ping_answered_false();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// A raw protocol client over the Unix socket: arbitrary bytes, fds, requests.
pub struct RawClient {
    /// The socket.
    pub stream: UnixStream,
    next_id: u64,
}

impl RawClient {
    /// Connects (no hello).
    pub fn connect(path: &Path) -> std::io::Result<RawClient> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawClient { stream, next_id: 1 })
    }

    /// Connects and attaches `instance` (with [`instance_secret`]).
    pub fn connect_attached(path: &Path, instance: u64) -> RawClient {
        let mut client = RawClient::connect(path).expect("connecting to the server");
        client.attach(instance);
        client
    }

    /// `attach [instance, instance_secret(instance)]`; panics unless the server answers
    /// `claimed` or `proven`, which it returns.
    pub fn attach(&mut self, instance: u64) -> String {
        let reply = self
            .attach_with(instance, &instance_secret(instance))
            .expect("a reply to attach");
        let value = reply
            .result
            .unwrap_or_else(|e| panic!("attach of instance {instance} refused: {e}"));
        let outcome = kvwarden::server::status::msgpack_to_json(&value)["outcome"]
            .as_str()
            .map(str::to_owned);
        match outcome.as_deref() {
            Some("claimed" | "proven") => outcome.unwrap_or_default(),
            _ => panic!("attach of instance {instance}: unexpected reply {value}"),
        }
    }

    /// `attach [instance, secret]`: the raw reply.
    pub fn attach_with(&mut self, instance: u64, secret: &[u8]) -> std::io::Result<Reply> {
        self.request(
            "attach",
            vec![instance.into(), Value::Binary(secret.to_vec())],
        )
    }

    /// Sends raw bytes.
    pub fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends raw bytes with fds on the first byte.
    pub fn send_with_fds(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut space =
            vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        let sent = rustix::net::sendmsg(
            self.stream.as_fd(),
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        self.stream.write_all(&bytes[sent..])
    }

    /// Reads one reply frame.
    pub fn read_reply(&mut self) -> std::io::Result<Reply> {
        let mut prefix = [0u8; 4];
        self.stream.read_exact(&mut prefix)?;
        let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
        self.stream.read_exact(&mut body)?;
        decode_reply(&body).map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// Whether the server closed the connection (EOF within the read timeout).
    pub fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        matches!(self.stream.read(&mut byte), Ok(0))
    }

    /// The framed request with a fresh id.
    pub fn frame(&mut self, op: &str, args: Vec<Value>) -> (u64, Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        (id, encode_request(id, op, args))
    }

    /// Sends a request and reads its reply.
    pub fn request(&mut self, op: &str, args: Vec<Value>) -> std::io::Result<Reply> {
        let (id, frame) = self.frame(op, args);
        self.send_bytes(&frame)?;
        let reply = self.read_reply()?;
        assert_eq!(reply.id, id, "reply to the request just sent");
        Ok(reply)
    }

    /// Sends a request with fds and reads its reply.
    pub fn request_with_fds(
        &mut self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
    ) -> std::io::Result<Reply> {
        let (id, frame) = self.frame(op, args);
        self.send_with_fds(&frame, fds)?;
        let reply = self.read_reply()?;
        assert_eq!(reply.id, id, "reply to the request just sent");
        Ok(reply)
    }
}

/// A memfd buffer spec for `register_kv_cache`.
pub fn memfd_spec(fd_index: u64, nbytes: u64) -> Value {
    kvwarden_core::protocol::BufferSpec::Memfd { fd_index, nbytes }.to_value()
}

/// A TCP proxy between workers and the server's TCP listener that a test can cut
/// (every connection dropped, new ones refused) and heal.
pub struct Proxy {
    /// Where workers connect.
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// A proxy to `upstream`.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let addr = listener.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::new(Mutex::new(Vec::new()));
        let (cut2, live2) = (Arc::clone(&cut), Arc::clone(&live));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut2.load(Ordering::SeqCst) {
                    continue; // dropped: the partition refuses everyone
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let pipes = [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ];
                {
                    let mut live = live2.lock().unwrap_or_else(|e| e.into_inner());
                    live.push(client);
                    live.push(server);
                }
                for (from, to) in pipes {
                    if let (Ok(mut from), Ok(mut to)) = (from, to) {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                }
            }
        });
        Proxy { addr, cut, live }
    }

    /// Starts a partition: every connection broken, new ones dropped.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for stream in live.drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Ends the partition.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------------ other uids

/// A child process forked from this test process that runs as another uid (setgid,
/// setuid, no supplementary groups: the tests that use it run as root) and talks to
/// its parent over two pipes, one JSON value a line. Its body is a closure of the
/// test, run right after the fork and the privilege drop; the child then exits with
/// `_exit` (no destructor of the parent's state runs twice).
///
/// Right after the fork the child closes every fd but stdin/stdout/stderr and its two
/// pipe ends: it holds no copy of another test's sockets (which would keep the server
/// from seeing them close). Its body must touch no lock another thread of the test
/// process could have held at the fork: it builds its own connections, memfds and
/// clients, and uses nothing of the parent's but plain values it captured.
pub struct Forked {
    pid: libc::pid_t,
    uid: u32,
    from_child: std::fs::File,
    to_child: Option<std::fs::File>,
    pending: Vec<u8>,
    exited: bool,
}

/// The child's end of a [`Forked`]: what it sends and receives.
pub struct ToParent {
    to_parent: std::fs::File,
    from_parent: std::io::BufReader<std::fs::File>,
}

impl ToParent {
    /// Sends `value` to the parent (one line).
    pub fn send(&mut self, value: Json) {
        let line = serde_json::json!({ "message": value }).to_string();
        let _ = writeln!(self.to_parent, "{line}");
    }

    /// Waits for the parent's next value ([`Forked::send`]); `Null` once the parent
    /// closed its end.
    pub fn recv(&mut self) -> Json {
        use std::io::BufRead;
        let mut line = String::new();
        match self.from_parent.read_line(&mut line) {
            Ok(n) if n > 0 => serde_json::from_str(&line).unwrap_or(Json::Null),
            _ => Json::Null,
        }
    }
}

/// Forks a child that drops to `uid` and runs `body`; its return value is what
/// [`Forked::finish`] returns. A panic in the body is reported to the parent, which
/// panics with it.
pub fn fork_as_uid(uid: u32, body: impl FnOnce(&mut ToParent) -> Json) -> Forked {
    use rustix::fd::{AsRawFd, FromRawFd, IntoRawFd};
    use rustix::pipe::{PipeFlags, pipe_with};
    assert!(
        rustix::process::geteuid().is_root(),
        "acting as uid {uid} needs root: run the who-is-who tests as root"
    );
    let (up_read, up_write) = pipe_with(PipeFlags::CLOEXEC).expect("a pipe to the parent");
    let (down_read, down_write) = pipe_with(PipeFlags::CLOEXEC).expect("a pipe to the child");
    // SAFETY: the child only runs `child_main`, which closes fds, drops privileges, runs
    // the test's body (see the type's docs for what it may touch) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let keep = [up_write.as_raw_fd(), down_read.as_raw_fd()];
        // SAFETY: the fds were just created and are owned here.
        let to_parent = unsafe { std::fs::File::from_raw_fd(up_write.into_raw_fd()) };
        let from_parent = unsafe { std::fs::File::from_raw_fd(down_read.into_raw_fd()) };
        let code = child_main(uid, &keep, to_parent, from_parent, body);
        // SAFETY: ends the child without running the parent's destructors or atexit.
        unsafe { libc::_exit(code) };
    }
    drop(up_write);
    drop(down_read);
    Forked {
        pid,
        uid,
        from_child: std::fs::File::from(up_read),
        to_child: Some(std::fs::File::from(down_write)),
        pending: Vec::new(),
        exited: false,
    }
}

fn child_main(
    uid: u32,
    keep: &[i32],
    to_parent: std::fs::File,
    from_parent: std::fs::File,
    body: impl FnOnce(&mut ToParent) -> Json,
) -> i32 {
    close_fds_but(keep);
    let mut channel = ToParent {
        to_parent,
        from_parent: std::io::BufReader::new(from_parent),
    };
    // SAFETY: plain syscalls on this (single-threaded) child.
    let dropped = unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(uid) == 0
            && libc::setuid(uid) == 0
            && libc::getuid() == uid
            && libc::geteuid() == uid
    };
    if !dropped {
        let error = std::io::Error::last_os_error();
        let line = serde_json::json!({ "panic": format!("dropping to uid {uid}: {error}") });
        let _ = writeln!(channel.to_parent, "{line}");
        return 1;
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut channel)));
    let line = match outcome {
        Ok(value) => serde_json::json!({ "result": value }),
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "a panic".to_string());
            serde_json::json!({ "panic": text })
        }
    };
    let _ = writeln!(channel.to_parent, "{line}");
    0
}

/// Closes every fd above 2 but `keep` (read from `/proc/self/fd` first, then closed).
fn close_fds_but(keep: &[i32]) {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing an fd of this child; nothing here uses it again (the
            // parent's objects owning it are never dropped in the child).
            unsafe { libc::close(fd) };
        }
    }
}

impl Forked {
    /// The uid it runs as.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// Sends `value` to the child ([`ToParent::recv`]).
    pub fn send(&mut self, value: Json) {
        let to_child = self
            .to_child
            .as_mut()
            .expect("the pipe to the child is open");
        writeln!(to_child, "{value}").expect("writing to the child");
    }

    /// The next line from the child, waiting up to [`PATIENCE`].
    fn line(&mut self, what: &str) -> Json {
        use rustix::fd::AsRawFd;
        let start = Instant::now();
        loop {
            if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=at).collect();
                return serde_json::from_slice(&line).unwrap_or_else(|error| {
                    panic!(
                        "uid {}'s child sent a line that is not JSON ({error}): {}",
                        self.uid,
                        String::from_utf8_lossy(&line)
                    )
                });
            }
            let left = PATIENCE.saturating_sub(start.elapsed());
            assert!(
                !left.is_zero(),
                "uid {}'s child said nothing within {PATIENCE:?} ({what})",
                self.uid
            );
            let mut poll = libc::pollfd {
                fd: self.from_child.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut poll, 1, millis) };
            if ready <= 0 {
                continue;
            }
            let mut chunk = [0u8; 4096];
            match self.from_child.read(&mut chunk) {
                Ok(0) => panic!(
                    "uid {}'s child exited without a word ({what}); partial output: {}",
                    self.uid,
                    String::from_utf8_lossy(&self.pending)
                ),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => panic!("reading from uid {}'s child: {error}", self.uid),
            }
        }
    }

    /// The child's next [`ToParent::send`]; panics if it panicked or finished instead.
    pub fn recv(&mut self, what: &str) -> Json {
        let line = self.line(what);
        if let Some(message) = line.get("message") {
            return message.clone();
        }
        self.fail(&line, what)
    }

    /// Closes the pipe to the child, waits for its body's result and its exit.
    pub fn finish(mut self, what: &str) -> Json {
        self.to_child = None;
        let line = loop {
            let line = self.line(what);
            if line.get("message").is_none() {
                break line;
            }
        };
        let Some(result) = line.get("result").cloned() else {
            self.fail(&line, what)
        };
        self.reap();
        result
    }

    fn fail(&mut self, line: &Json, what: &str) -> ! {
        match line.get("panic") {
            Some(panic) => panic!("uid {}'s child failed ({what}): {panic}", self.uid),
            None => panic!("uid {}'s child: unexpected line {line} ({what})", self.uid),
        }
    }

    fn reap(&mut self) {
        if self.exited {
            return;
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
        self.exited = true;
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        if !self.exited {
            // SAFETY: our own child.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            self.reap();
        }
    }
}

/// Runs `body` in a child forked as `uid` (see [`Forked`]) and returns its result.
pub fn run_as_uid(uid: u32, what: &str, body: impl FnOnce() -> Json) -> Json {
    fork_as_uid(uid, |_| body()).finish(what)
}
