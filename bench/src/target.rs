//! The server under measurement: one this benchmark starts (the default), or a running
//! one named by `--socket`.

use super::BenchError;
use super::process::ServerProcess;
use super::raw::RawConnection;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where to find the server (flags shared by every `kvwarden bench` figure).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TargetArgs {
    /// Measure the server already listening on this Unix socket instead of starting
    /// one (its own flags then apply, not the ones this benchmark would pass).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

/// The server a benchmark measures.
pub struct Target {
    /// Its Unix socket.
    pub socket: PathBuf,
    /// Its TCP address, when it listens on TCP.
    pub tcp: Option<SocketAddr>,
    /// The file holding its TCP token, for a server this benchmark started with TCP.
    pub tcp_token_file: Option<PathBuf>,
    /// Its process id.
    pub pid: i32,
    spawned: Option<ServerProcess>,
    /// Pings it had answered `false` before this benchmark (a running server's past).
    pings_answered_false_before: u64,
}

impl Target {
    /// The server of `args.socket`, or a fresh `kvwarden serve <serve_args>`
    /// (`RUST_LOG=warn`: a benchmark must not measure the log).
    pub fn start(args: &TargetArgs, tag: &str, serve_args: &[&str]) -> Result<Target, BenchError> {
        Target::start_with_open_files(args, tag, serve_args, None)
    }

    /// [`Target::start`], with a started server's open-file limit raised to
    /// `open_files` where this process may (see
    /// [`ServerProcess::start_with_open_files`]).
    pub fn start_with_open_files(
        args: &TargetArgs,
        tag: &str,
        serve_args: &[&str],
        open_files: Option<u64>,
    ) -> Result<Target, BenchError> {
        match &args.socket {
            Some(socket) => {
                let pid = RawConnection::connect(socket)?.server_pid()?;
                super::progress(&format!(
                    "measuring the running server at {} (pid {pid}); its own flags apply, \
                     this benchmark would have started one with {serve_args:?}",
                    socket.display()
                ));
                let mut target = Target {
                    socket: socket.clone(),
                    tcp: None,
                    tcp_token_file: None,
                    pid,
                    spawned: None,
                    pings_answered_false_before: 0,
                };
                target.pings_answered_false_before = target.pings_answered_false()?;
                Ok(target)
            }
            None => {
                let serve_args: Vec<String> = serve_args.iter().map(|s| s.to_string()).collect();
                let server =
                    ServerProcess::start_with_open_files(tag, &serve_args, "warn", open_files)?;
                let command = format!("kvwarden serve --http off {}", serve_args.join(" "));
                Ok(Target::spawned(server, &command, "pid"))
            }
        }
    }

    /// A fresh `kvwarden serve <serve_args>` in a PID namespace of its own (see
    /// [`ServerProcess::start_in_pid_namespace`]); a running server (`--socket`) cannot
    /// be moved into one.
    pub fn start_in_pid_namespace(
        args: &TargetArgs,
        tag: &str,
        serve_args: &[&str],
    ) -> Result<Target, BenchError> {
        if let Some(socket) = &args.socket {
            return Err(BenchError::Failed(format!(
                "--server-pid-namespace starts a server of its own in a new PID namespace, but \
                 --socket {} names a running one; drop one of the two",
                socket.display()
            )));
        }
        if !rustix::process::geteuid().is_root() {
            return Err(BenchError::Failed(
                "--server-pid-namespace needs root (unshare --pid needs CAP_SYS_ADMIN); run \
                 as root or drop the flag"
                    .into(),
            ));
        }
        let serve_args: Vec<String> = serve_args.iter().map(|s| s.to_string()).collect();
        let server = ServerProcess::start_in_pid_namespace(tag, &serve_args, "warn")?;
        let command = format!(
            "unshare --pid --fork --mount-proc --kill-child kvwarden serve --http off {}",
            serve_args.join(" ")
        );
        Ok(Target::spawned(server, &command, "unshare pid"))
    }

    /// The target of a server this benchmark started with `command` (said on stderr,
    /// with the process id as `pid_label`).
    fn spawned(server: ServerProcess, command: &str, pid_label: &str) -> Target {
        super::progress(&format!(
            "started `{}` ({pid_label} {}) on {}",
            command.trim_end(),
            server.pid(),
            server.socket.display()
        ));
        Target {
            socket: server.socket.clone(),
            tcp: server.tcp,
            tcp_token_file: server.tcp_token_file.clone(),
            pid: server.pid(),
            spawned: Some(server),
            pings_answered_false_before: 0,
        }
    }

    /// A control connection.
    pub fn connect(&self) -> Result<RawConnection, BenchError> {
        RawConnection::connect(&self.socket)
    }

    /// Pings the server has answered `false` so far.
    fn pings_answered_false(&self) -> Result<u64, BenchError> {
        let status = self.connect()?.status()?;
        Ok(status.worker_liveness.pings_answered_false_total)
    }

    /// Fails when the server answered a ping `false` during this benchmark. Every
    /// worker a benchmark runs is alive and registered, and nothing reaps or restarts
    /// it, so such an answer (a live worker told its instance is not held) is a bug to
    /// chase, never a figure to print.
    pub fn check_no_ping_answered_false(&self) -> Result<(), BenchError> {
        let answered_false = self
            .pings_answered_false()?
            .saturating_sub(self.pings_answered_false_before);
        if answered_false == 0 {
            return Ok(());
        }
        Err(BenchError::Failed(format!(
            "FAILED: the server answered {answered_false} ping(s) `false` during this \
             benchmark, although none of its workers was reaped, restarted or cut off: a live \
             worker was told that its instance is not held. The figures above are void; the \
             server's log ends:\n{}",
            self.log_tail(40)
        )))
    }

    /// Whether this benchmark started the server (so its flags are the ones asked for).
    pub fn is_spawned(&self) -> bool {
        self.spawned.is_some()
    }

    /// The last lines of the spawned server's log (empty for a running server).
    pub fn log_tail(&self, lines: usize) -> String {
        self.spawned
            .as_ref()
            .map(|s| s.log_tail(lines))
            .unwrap_or_default()
    }

    /// The spawned server's whole log (empty for a running server).
    pub fn log_text(&self) -> String {
        self.spawned
            .as_ref()
            .map(ServerProcess::log_text)
            .unwrap_or_default()
    }
}
