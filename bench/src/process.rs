//! Child processes of the benchmarks and the demo: `kvwarden serve` and `kvwarden
//! worker` (this same executable), each killed when its handle drops, and killed by
//! the kernel if this process dies first (`PR_SET_PDEATHSIG`), so that no benchmark
//! or demo ever leaves a server or a worker behind.

use super::BenchError;
use rustix::process::{Pid, Signal};
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long a child may take to start (a loaded 2-core machine is slow).
pub const START_BOUND: Duration = Duration::from_secs(30);

/// A private temporary directory (from `tempfile`: an unpredictable name, created
/// exclusively), removed on drop.
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// A fresh directory under the system temp dir, named after `tag`.
    pub fn new(tag: &str) -> Result<TempDir, BenchError> {
        let prefix = format!("kvwarden-{tag}-");
        tempfile::Builder::new()
            .prefix(&prefix)
            .tempdir()
            .map(TempDir)
            .map_err(BenchError::io(format!(
                "creating a temporary directory {prefix}* under {}",
                std::env::temp_dir().display()
            )))
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// The `kvwarden` executable the benchmarks spawn as server and workers: this one when
/// it is `kvwarden` (run as `kvwarden bench`), else `$KVWARDEN_BIN` when set, else the
/// `kvwarden` beside this executable (run as `kvwarden-bench`).
pub fn kvwarden_exe() -> Result<PathBuf, BenchError> {
    let this =
        std::env::current_exe().map_err(BenchError::io("finding this executable (current_exe)"))?;
    if this.file_name().is_some_and(|name| name == "kvwarden") {
        return Ok(this);
    }
    if let Some(path) = std::env::var_os("KVWARDEN_BIN") {
        return Ok(PathBuf::from(path));
    }
    let beside = this.with_file_name("kvwarden");
    if beside.exists() {
        return Ok(beside);
    }
    Err(BenchError::Failed(format!(
        "no `kvwarden` executable beside {}: build it (`cargo build --release -p kvwarden-cli`) \
         or set KVWARDEN_BIN to its path",
        this.display()
    )))
}

/// A command for this executable that dies with us.
pub fn kvwarden_command(subcommand: &str) -> Result<Command, BenchError> {
    let mut command = Command::new(kvwarden_exe()?);
    command.arg(subcommand);
    die_with_parent(&mut command);
    Ok(command)
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it exits, so that
/// a demo or benchmark killed by SIGKILL still leaves nothing behind.
pub fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec; it makes one prctl system call,
    // which is async-signal-safe, and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
                .map_err(std::io::Error::from)
        });
    }
}

/// Raises the child's `RLIMIT_NOFILE` (soft and hard) to `open_files` when that is
/// above this process's hard limit; a refusal (no privilege) is left to the child to
/// report.
fn raise_open_files_in_child(command: &mut Command, open_files: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit};
    use std::os::unix::process::CommandExt;
    let hard = getrlimit(Resource::Nofile).maximum.unwrap_or(u64::MAX);
    if open_files <= hard {
        return;
    }
    let raised = Rlimit {
        current: Some(open_files),
        maximum: Some(open_files),
    };
    // SAFETY: the closure runs between fork and exec; it makes one setrlimit system
    // call, which is async-signal-safe, and touches no memory of the parent.
    unsafe {
        command.pre_exec(move || {
            let _ = rustix::process::setrlimit(Resource::Nofile, raised);
            Ok(())
        });
    }
}

/// The `Max open files` soft and hard limits of process `pid` (`/proc/<pid>/limits`).
pub fn open_file_limits(pid: i32) -> Option<(String, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    Some((fields.next()?.to_string(), fields.next()?.to_string()))
}

/// Sends `signal` to `child` (ignoring a child that is already gone).
pub fn signal(child: &Child, signal: Signal) {
    let _ = rustix::process::kill_process(Pid::from_child(child), signal);
}

/// Waits up to `bound` for `child` to exit.
pub fn wait_exit(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if start.elapsed() >= bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The lines a child prints on stdout, collected by a thread.
pub struct Lines {
    receiver: Receiver<String>,
    seen: Vec<String>,
}

impl Lines {
    /// Starts reading `stdout`.
    pub fn spawn(stdout: impl Read + Send + 'static) -> Lines {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Lines {
            receiver,
            seen: Vec::new(),
        }
    }

    /// Every line received so far.
    pub fn seen(&mut self) -> &[String] {
        while let Ok(line) = self.receiver.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }

    /// Waits up to `bound` for a line matching `pred` (also among the lines already
    /// seen); `what` names it in the error.
    pub fn wait(
        &mut self,
        what: &str,
        bound: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, BenchError> {
        if let Some(line) = self.seen().iter().find(|l| pred(l)) {
            return Ok(line.clone());
        }
        let deadline = Instant::now() + bound;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.receiver.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(BenchError::Failed(format!(
                        "the process exited (closed its stdout) before printing {what}; it printed {:?}",
                        self.seen
                    )));
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(BenchError::Failed(format!(
                        "no line {what} within {bound:?}; the process printed {:?}",
                        self.seen
                    )));
                }
            }
        }
    }
}

/// A `kvwarden serve` child on a socket in its own temp dir.
pub struct ServerProcess {
    child: Child,
    /// The Unix socket.
    pub socket: PathBuf,
    /// The TCP address, when `--tcp` was given.
    pub tcp: Option<SocketAddr>,
    /// The file holding the TCP token, when `--tcp` was given (written here unless
    /// `args` named one).
    pub tcp_token_file: Option<PathBuf>,
    /// The HTTP address, when HTTP is on.
    pub http: Option<SocketAddr>,
    log: PathBuf,
    _dir: TempDir,
}

/// A fresh TCP token in `dir` for a server started with `--tcp` and no token file of
/// its own; None otherwise.
fn fresh_tcp_token(dir: &TempDir, args: &[String]) -> Result<Option<PathBuf>, BenchError> {
    if !args.iter().any(|a| a == "--tcp") || args.iter().any(|a| a == "--tcp-token-file") {
        return Ok(None);
    }
    let path = dir.path().join("tcp.token");
    let token: String = kvwarden_core::InstanceId::generate()
        .get()
        .to_be_bytes()
        .iter()
        .chain(&kvwarden_core::InstanceId::generate().get().to_be_bytes())
        .map(|byte| format!("{byte:02x}"))
        .collect();
    std::fs::write(&path, token).map_err(BenchError::io(format!("writing {}", path.display())))?;
    Ok(Some(path))
}

impl ServerProcess {
    /// Starts `kvwarden serve --socket <tmp> --http off <args>` (a later `--http` in
    /// `args` wins) with `RUST_LOG=<log_level>`, and waits until it says `ready`.
    pub fn start(tag: &str, args: &[String], log_level: &str) -> Result<ServerProcess, BenchError> {
        ServerProcess::start_with_open_files(tag, args, log_level, None)
    }

    /// [`ServerProcess::start`], with the server's open-file limit (soft and hard)
    /// raised to `open_files` first when that is above this process's hard limit, as
    /// an operator's `LimitNOFILE=` would; without the privilege to raise a hard limit
    /// the server runs with this process's limit (and logs what it can hold).
    pub fn start_with_open_files(
        tag: &str,
        args: &[String],
        log_level: &str,
        open_files: Option<u64>,
    ) -> Result<ServerProcess, BenchError> {
        ServerProcess::spawn(tag, args, log_level, open_files, false)
    }

    /// [`ServerProcess::start`], with the server in a PID namespace of its own (`unshare
    /// --pid --fork --mount-proc --kill-child`, which needs root), as in a container
    /// without `hostPID`: it sees every worker this process starts as pid 0. [`pid`]
    /// is then `unshare`'s.
    ///
    /// [`pid`]: ServerProcess::pid
    pub fn start_in_pid_namespace(
        tag: &str,
        args: &[String],
        log_level: &str,
    ) -> Result<ServerProcess, BenchError> {
        ServerProcess::spawn(tag, args, log_level, None, true)
    }

    fn spawn(
        tag: &str,
        args: &[String],
        log_level: &str,
        open_files: Option<u64>,
        pid_namespace: bool,
    ) -> Result<ServerProcess, BenchError> {
        let dir = TempDir::new(tag)?;
        let socket = dir.path().join("kvwarden.sock");
        let log = dir.path().join("server.log");
        let stderr = std::fs::File::create(&log)
            .map_err(BenchError::io(format!("creating {}", log.display())))?;
        let mut command = if pid_namespace {
            let mut command = Command::new("unshare");
            command
                .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
                .arg(kvwarden_exe()?)
                .arg("serve");
            die_with_parent(&mut command);
            command
        } else {
            kvwarden_command("serve")?
        };
        if let Some(open_files) = open_files {
            raise_open_files_in_child(&mut command, open_files);
        }
        command.arg("--socket").arg(&socket);
        if !args.iter().any(|a| a == "--http") {
            command.args(["--http", "off"]);
        }
        // TCP peers present a token: a server with `--tcp` gets a fresh one of its own.
        let tcp_token_file = fresh_tcp_token(&dir, args)?;
        if let Some(path) = &tcp_token_file {
            command.arg("--tcp-token-file").arg(path);
        }
        command
            .args(args)
            .env("RUST_LOG", log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = command.spawn().map_err(BenchError::io(if pid_namespace {
            "spawning `unshare --pid --fork --mount-proc --kill-child kvwarden serve` (is \
             util-linux installed?)"
        } else {
            "spawning `kvwarden serve`"
        }))?;
        let stdout = child.stdout.take();
        let mut server = ServerProcess {
            child,
            socket,
            tcp: None,
            tcp_token_file,
            http: None,
            log,
            _dir: dir,
        };
        let Some(stdout) = stdout else {
            return Err(BenchError::Failed(
                "the server's stdout was not piped".into(),
            ));
        };
        let mut lines = Lines::spawn(stdout);
        if let Err(error) = lines.wait("`ready`", START_BOUND, |l| l == "ready") {
            return Err(BenchError::Failed(format!(
                "the server did not start ({error}); its log:\n{}",
                server.log_text()
            )));
        }
        let address = |lines: &mut Lines, prefix: &str| {
            lines
                .seen()
                .iter()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|a| a.parse().ok())
        };
        server.tcp = address(&mut lines, "tcp=");
        server.http = address(&mut lines, "http=");
        Ok(server)
    }

    /// Its process id.
    pub fn pid(&self) -> i32 {
        Pid::from_child(&self.child).as_raw_nonzero().get()
    }

    /// Its log (stderr) so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGTERM, then waits up to `bound` for a clean exit; SIGKILL after that.
    pub fn terminate(mut self, bound: Duration) -> Option<ExitStatus> {
        signal(&self.child, Signal::TERM);
        let status = wait_exit(&mut self.child, bound);
        if status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        status
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        signal(&self.child, Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvwarden worker` child, registered.
pub struct WorkerProcess {
    child: Child,
    /// Its instance id.
    pub instance_id: u64,
    lines: Lines,
}

impl WorkerProcess {
    /// Starts `kvwarden worker <args>` (stderr to `stderr`, e.g. a log file or null)
    /// and waits until it has registered.
    pub fn start(args: &[String], stderr: Stdio) -> Result<WorkerProcess, BenchError> {
        WorkerProcess::spawn(args, stderr, None)
    }

    /// [`WorkerProcess::start`] under an instance id drawn here and its
    /// [`super::raw::bench_secret`] (`KVWARDEN_WORKER_SECRET`), so that a control
    /// connection of this process may attach the worker's instance and ping it.
    pub fn start_watchable(args: &[String], stderr: Stdio) -> Result<WorkerProcess, BenchError> {
        let instance = super::raw::instance_ids(1)[0];
        let mut args = args.to_vec();
        args.extend(["--instance-id".to_string(), instance.to_string()]);
        let hex: String = super::raw::bench_secret(instance)
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        WorkerProcess::spawn(&args, stderr, Some(hex))
    }

    fn spawn(
        args: &[String],
        stderr: Stdio,
        secret_hex: Option<String>,
    ) -> Result<WorkerProcess, BenchError> {
        let mut command = kvwarden_command("worker")?;
        if let Some(hex) = secret_hex {
            command.env("KVWARDEN_WORKER_SECRET", hex);
        }
        command
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = command
            .spawn()
            .map_err(BenchError::io("spawning `kvwarden worker`"))?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(BenchError::Failed(
                "the worker's stdout was not piped".into(),
            ));
        };
        let mut worker = WorkerProcess {
            child,
            instance_id: 0,
            lines: Lines::spawn(stdout),
        };
        let line = worker.wait_line("`instance_id=`", |l| l.starts_with("instance_id="))?;
        worker.instance_id = line["instance_id=".len()..].parse().map_err(|_| {
            BenchError::Failed(format!(
                "the worker printed a bad instance id line {line:?}"
            ))
        })?;
        worker.wait_line("`registered outcome=`", |l| {
            l.starts_with("registered outcome=")
        })?;
        Ok(worker)
    }

    /// Its process id.
    pub fn pid(&self) -> i32 {
        Pid::from_child(&self.child).as_raw_nonzero().get()
    }

    /// Sends `sig`.
    pub fn signal(&self, sig: Signal) {
        signal(&self.child, sig);
    }

    /// Waits (bounded by [`START_BOUND`]) for a stdout line matching `pred`.
    pub fn wait_line(
        &mut self,
        what: &str,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String, BenchError> {
        self.lines.wait(what, START_BOUND, pred)
    }

    /// Every stdout line so far.
    pub fn lines_seen(&mut self) -> &[String] {
        self.lines.seen()
    }

    /// Reaps the process after a SIGKILL (so that it leaves no zombie).
    pub fn reap(mut self) {
        let _ = self.child.wait();
    }

    /// SIGTERM (a clean shutdown: heartbeat stopped, then unregister), waiting up to
    /// `bound`; SIGKILL after that. Returns whether it exited cleanly.
    pub fn stop(mut self, bound: Duration) -> bool {
        signal(&self.child, Signal::CONT);
        signal(&self.child, Signal::TERM);
        match wait_exit(&mut self.child, bound) {
            Some(status) => status.success(),
            None => false, // Drop kills it
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        signal(&self.child, Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CPU time the live threads of process `pid` have used so far (the sum of
/// `/proc/<pid>/task/*/schedstat`, nanoseconds), or None where the kernel does not say.
pub fn cpu_time(pid: i32) -> Option<Duration> {
    let mut nanos: u64 = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let path = task.ok()?.path().join("schedstat");
        let Ok(text) = std::fs::read_to_string(path) else {
            continue; // the thread ended meanwhile
        };
        nanos += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(nanos))
}

/// A process's memory as `/proc/<pid>/status` reports it, in KiB.
#[derive(Copy, Clone, Debug, Default)]
pub struct MemoryUse {
    /// VmRSS: everything resident.
    pub rss_kib: u64,
    /// RssAnon: the heap and stacks.
    pub anon_kib: u64,
    /// RssFile: the executable and libraries.
    pub file_kib: u64,
    /// RssShmem: shared memory (the L1 memfd and workers' buffers, where touched).
    pub shmem_kib: u64,
}

impl MemoryUse {
    /// Reads `/proc/<pid>/status`.
    pub fn of(pid: i32) -> Result<MemoryUse, BenchError> {
        let path = format!("/proc/{pid}/status");
        let text =
            std::fs::read_to_string(&path).map_err(BenchError::io(format!("reading {path}")))?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse().ok())
                .unwrap_or(0)
        };
        Ok(MemoryUse {
            rss_kib: field("VmRSS:"),
            anon_kib: field("RssAnon:"),
            file_kib: field("RssFile:"),
            shmem_kib: field("RssShmem:"),
        })
    }

    /// VmRSS in MiB.
    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    /// `VmRSS x MiB (anon a, file f, shmem s MiB)`.
    pub fn describe(&self) -> String {
        format!(
            "VmRSS {:.1} MiB (anon {:.1}, file {:.1}, shmem {:.1} MiB)",
            self.rss_mib(),
            self.anon_kib as f64 / 1024.0,
            self.file_kib as f64 / 1024.0,
            self.shmem_kib as f64 / 1024.0
        )
    }
}
