//! Helpers for the end-to-end tests: a real `kvwarden serve` process with short
//! timeouts, real `kvwarden worker` processes, a raw protocol client, a TCP proxy that
//! can cut a connection, condition waits with generous bounds, and a real Redis Cluster
//! on loopback for the L2 tests ([`RedisCluster`]).
//!
//! The `kvwarden` binary is found next to the test executable (`target/<profile>/`):
//! `cargo test --workspace` builds it because the `kvwarden` package has integration
//! tests of its own. Running only this package needs `cargo build -p kvwarden` first,
//! or `KVWARDEN_BIN=/path/to/kvwarden`.

pub mod redis_cluster;

pub use redis_cluster::RedisCluster;

use kvwarden::bench::process::Lines;
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
         `cargo build -p kvwarden` first, or set KVWARDEN_BIN",
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
        Server::spawn(dir, args, env, None)
    }

    /// As [`Server::start`], but the server runs in a PID namespace of its own (and a
    /// `/proc` of that namespace), as in a container without `hostPID`: every worker
    /// started by the test is outside it, so `SO_PEERCRED` shows it pid 0. Check
    /// [`pid_namespace_unavailable`] first.
    pub fn start_in_pid_namespace(dir: &TempDir, extra: &[&str]) -> Server {
        let unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
        Server::spawn(
            dir,
            &merge_flags(SHORT_TIMEOUTS, extra),
            &[],
            Some(&unshare),
        )
    }

    /// Starts `kvwarden serve`, under `wrapper` (a command that runs the rest) if given.
    fn spawn(
        dir: &TempDir,
        args: &[&str],
        env: &[(&str, &str)],
        wrapper: Option<&[&str]>,
    ) -> Server {
        let socket = dir.path().join("kvwarden.sock");
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let stderr_path = dir.path().join(format!(
            "server-{}.log",
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        let stderr = std::fs::File::create(&stderr_path).expect("server log");
        let mut command = match wrapper {
            Some([program, wrapper_args @ ..]) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(kvwarden_bin());
                command
            }
            _ => Command::new(kvwarden_bin()),
        };
        let mut child = command
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(args)
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
        .find(|item| item["instance_id"].as_u64() == Some(instance))
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
        let mut child = Command::new(kvwarden_bin())
            .arg("worker")
            .args(args)
            .env("RUST_LOG", "warn")
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

    /// Starts a worker over TCP to `address` with a fast heartbeat and no buffer (the
    /// server cannot see a TCP peer's process: only the heartbeat rules apply to it).
    pub fn tcp(address: SocketAddr) -> Worker {
        let address = address.to_string();
        Worker::start(&[
            "--tcp",
            &address,
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
