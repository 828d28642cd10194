//! A real `kvwarden serve` process with short timeouts, its stdout lines and logs.

use crate::{
    PATIENCE, RawClient, TCP_TOKEN, TempDir, find_instance, kvwarden_bin, merge_flags, signal,
    wait_exit, wait_for, write_token_file,
};
use kvwarden_bench::process::Lines;
use rustix::fd::BorrowedFd;
use serde_json::Value as Json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Waits up to [`PATIENCE`] for a stdout line matching `pred`; panics naming `what`
/// and every line seen when none comes.
pub(crate) fn wait_line(lines: &mut Lines, what: &str, pred: impl Fn(&str) -> bool) -> String {
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
        let mut command = kvwarden_command(wrapper);
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            // As root, std also drops the supplementary groups (setgroups(0)).
            command.uid(uid).gid(uid);
        }
        pass_listen_fds(&mut command, listen_fds);
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

/// Has `command`'s process receive `listen_fds` at 3, 4, … (systemd's socket passing).
fn pass_listen_fds(command: &mut Command, listen_fds: &[(BorrowedFd<'_>, &str)]) {
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
}

/// `kvwarden`, or `wrapper` running it (a program and its arguments).
fn kvwarden_command(wrapper: Option<&[&str]>) -> Command {
    match wrapper {
        Some([program, wrapper_args @ ..]) => {
            let mut command = Command::new(program);
            command.args(wrapper_args).arg(kvwarden_bin());
            command
        }
        _ => Command::new(kvwarden_bin()),
    }
}
