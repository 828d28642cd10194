//! `kvwarden demo`: the point of kvwarden in under a minute, with real processes.
//!
//! A server with short (demo-only) timeouts and three `kvwarden worker` processes
//! exchanging traffic; one worker is SIGKILLed (freed within milliseconds by the
//! process-exit proof), one is frozen with SIGSTOP past the reap timeout (reaped) and
//! thawed (it re-registers with exactly one fresh context), one is left alone. Every
//! wait is on a condition with a bound, never a bare sleep, so a loaded machine only
//! makes it slower. Every child is killed when the demo ends, however it ends.

use kvwarden::protocol::StatusReport;
use kvwarden::protocol::status::InstanceStatus;
use kvwarden_bench::BenchError;
use kvwarden_bench::process::{ServerProcess, TempDir, WorkerProcess};
use kvwarden_bench::raw::RawConnection;
use std::io::{Read, Write};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The bound of every wait for something that should take milliseconds to seconds.
const PATIENCE: Duration = Duration::from_secs(30);

/// Flags of `kvwarden demo`.
#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct DemoArgs {
    /// The demo server's reap timeout T (a demo setting: production uses 120 s and
    /// refuses anything under 30 s). The flag `kvwarden serve` takes for it.
    // `--reap-timeout-seconds` was this flag's name before it took serve's.
    #[arg(
        long,
        alias = "reap-timeout-seconds",
        default_value_t = 3.0,
        value_name = "SECONDS"
    )]
    worker_reap_timeout_seconds: f64,
}

/// Runs the demo; exit 0 when everything happened as kvwarden promises.
pub fn run(args: DemoArgs) -> ExitCode {
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&interrupted)) {
            eprintln!("kvwarden demo: installing a signal handler failed: {error}");
            return ExitCode::from(1);
        }
    }
    let t = args.worker_reap_timeout_seconds;
    if !(0.5..=30.0).contains(&t) {
        eprintln!(
            "kvwarden demo: invalid --worker-reap-timeout-seconds {t}: use 0.5 to 30 seconds (the demo \
             waits out one timeout)"
        );
        return ExitCode::from(2);
    }
    let mut demo = Demo {
        timeline: Timeline::new(),
        interrupted,
        reap_timeout_seconds: t,
    };
    match demo.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvwarden demo: {error}");
            eprintln!("kvwarden demo: every child process has been stopped");
            ExitCode::from(1)
        }
    }
}

/// Elapsed time + event, printed once, as it happens.
struct Timeline {
    origin: Instant,
}

impl Timeline {
    fn new() -> Timeline {
        Timeline {
            origin: Instant::now(),
        }
    }

    fn event(&mut self, text: impl Into<String>) {
        let at = self.origin.elapsed();
        say(&format!("[{:>6.3} s] {}", at.as_secs_f64(), text.into()));
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

struct Demo {
    timeline: Timeline,
    interrupted: Arc<AtomicBool>,
    reap_timeout_seconds: f64,
}

/// The worker roles.
const VICTIM: &str = "A";
const FROZEN: &str = "B";
const BYSTANDER: &str = "C";

impl Demo {
    fn run(&mut self) -> Result<(), BenchError> {
        let t = self.reap_timeout_seconds;
        let heartbeat = (t / 6.0).min(10.0);
        let resolution = 0.1f64.min(t / 8.0);
        say(
            "kvwarden demo: a server and three workers; A is SIGKILLed, B frozen (SIGSTOP) past \
             the reap timeout then thawed, C left alone.",
        );
        say(&format!(
            "DEMO SETTINGS (--allow-short-timeouts, never in production): reap timeout T = {t} s, \
             worker heartbeat {heartbeat:.2} s, resolution R = {resolution} s."
        ));
        say("Production defaults: T = 120 s (30 s at the least), heartbeat 10 s, R = 1 s.\n");

        let server_args: Vec<String> = [
            "--allow-short-timeouts",
            "--worker-reap-timeout-seconds",
            &t.to_string(),
            "--worker-registration-grace-seconds",
            &(2.0 * t).to_string(),
            "--resolution-seconds",
            &resolution.to_string(),
            "--l1-bytes",
            "64M",
            "--slot-bytes",
            "64K",
            "--http",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let server = ServerProcess::start("demo", &server_args, "info")?;
        let result = self.with_server(&server, heartbeat);
        let interrupted = self.interrupted.load(Ordering::Relaxed);
        let result = result.map_err(|error| match interrupted {
            true => error,
            false => BenchError::Failed(format!(
                "{error}\nthe server's last log lines:\n{}",
                server.log_tail(15)
            )),
        });
        match server.terminate(PATIENCE) {
            Some(status) if status.success() && result.is_ok() => {
                self.timeline.event(
                    "server stopped (SIGTERM): every remaining context freed once, socket removed, exit 0",
                );
            }
            Some(status) if result.is_ok() => {
                return Err(BenchError::Failed(format!(
                    "the server exited with {status} after SIGTERM; expected 0"
                )));
            }
            _ => {}
        }
        result
    }

    fn with_server(&mut self, server: &ServerProcess, heartbeat: f64) -> Result<(), BenchError> {
        self.timeline.event(format!(
            "server up (pid {}) on {}",
            server.pid(),
            server.socket.display()
        ));
        let logs = TempDir::new("demo-workers")?;
        let socket = server.socket.to_string_lossy().into_owned();
        let mut control = RawConnection::connect(&server.socket)?;
        let mut workers = Vec::new();
        for role in [VICTIM, FROZEN, BYSTANDER] {
            let log = std::fs::File::create(logs.path().join(format!("worker-{role}.log")))
                .map_err(BenchError::io("creating a worker log"))?;
            let args: Vec<String> = [
                "--socket",
                &socket,
                "--heartbeat-interval-seconds",
                &format!("{heartbeat:.3}"),
                "--buffer-bytes",
                "1M",
                "--chunk-bytes",
                "16K",
                "--traffic-every-ms",
                "100",
                "--model-name",
                &format!("demo-model-{role}"),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let worker = WorkerProcess::start_watchable(&args, Stdio::from(log))?;
            self.timeline.event(format!(
                "worker {role} (pid {}) registered instance {}: one context built",
                worker.pid(),
                worker.instance_id
            ));
            workers.push(worker);
        }
        let mut frozen = workers.remove(1);
        let victim = workers.remove(0);
        let bystander = workers.remove(0);
        let (victim_id, frozen_id, bystander_id) = (
            victim.instance_id,
            frozen.instance_id,
            bystander.instance_id,
        );

        self.act_traffic(&mut control, server, [victim_id, frozen_id, bystander_id])?;
        let status = self.act_kill(&mut control, victim, victim_id)?;
        let built_before = built(&status);
        self.act_freeze(&mut control, &frozen, frozen_id, bystander_id)?;
        self.act_thaw(&mut control, &mut frozen, frozen_id, built_before)?;

        let clean = [frozen, bystander]
            .into_iter()
            .map(|w| w.stop(PATIENCE))
            .filter(|clean| *clean)
            .count();
        self.timeline.event(format!(
            "SIGTERM workers {FROZEN} and {BYSTANDER}: {clean} of 2 shut down cleanly \
             (heartbeat stopped, then unregister)"
        ));
        // Two pings may be answered `false`: the one that saw worker A gone, and worker
        // B's first ping after its reap. A `false` to any live worker is the bug this
        // project prevents.
        let status = control.status()?;
        let answered_false = status.worker_liveness.pings_answered_false_total;
        if answered_false > 2 {
            return Err(BenchError::Failed(format!(
                "the server answered {answered_false} pings `false`; only the ping that saw \
                 worker {VICTIM} gone and worker {FROZEN}'s first ping after its reap may be: \
                 a live worker was told its instance is not held"
            )));
        }
        Ok(())
    }

    /// Traffic: every worker stores and retrieves every 100 ms and pings; what 1.5 s of it
    /// amounts to, once every worker has pinged.
    fn act_traffic(
        &mut self,
        control: &mut RawConnection,
        server: &ServerProcess,
        ids: [u64; 3],
    ) -> Result<(), BenchError> {
        self.wait_status(control, "every worker's first ping", |s| {
            ids.iter()
                .all(|id| instance(s, *id).is_some_and(|i| i.proven))
        })?;
        let window = Duration::from_millis(1500);
        let before = server.http.and_then(request_counts);
        self.pause(window)?;
        let after = server.http.and_then(request_counts);
        let status = control.status()?;
        let traffic = match (before, after) {
            (Some(b), Some(a)) => format!(
                "{} stores, {} retrieves, {} pings",
                a.store.saturating_sub(b.store),
                a.retrieve.saturating_sub(b.retrieve),
                a.ping.saturating_sub(b.ping)
            ),
            _ => "requests (metrics unavailable)".to_string(),
        };
        self.timeline.event(format!(
            "traffic: {traffic} in {:.1} s from 3 workers; L1 holds {} slots; all 3 have pinged (proven)",
            window.as_secs_f64(),
            status.l1.slots_used
        ));
        Ok(())
    }

    /// SIGKILL: the kernel's word (a pidfd) frees the victim at once; the status after.
    fn act_kill(
        &mut self,
        control: &mut RawConnection,
        victim: WorkerProcess,
        victim_id: u64,
    ) -> Result<StatusReport, BenchError> {
        let killed_at = Instant::now();
        victim.signal(rustix::process::Signal::KILL);
        self.timeline
            .event(format!("SIGKILL worker {VICTIM} (pid {})", victim.pid()));
        while control.ping(victim_id)? {
            self.check_bound(killed_at, "worker A to be freed after SIGKILL")?;
        }
        let freed_after = killed_at.elapsed();
        victim.reap();
        let status = control.status()?;
        let freed = &status.contexts.freed_total;
        if freed.process_exited != 1 || freed.reaped != 0 {
            return Err(BenchError::Failed(format!(
                "worker A was freed, but not by the process-exit proof: {freed:?}"
            )));
        }
        self.timeline.event(format!(
            "worker {VICTIM} freed {:.1} ms after SIGKILL: the kernel said its process exited \
             (the process-exit proof, a pidfd); no timeout needed (T = {} s here, 120 s in \
             production)",
            freed_after.as_secs_f64() * 1e3,
            self.reap_timeout_seconds
        ));
        Ok(status)
    }

    /// SIGSTOP: silent, but its process has not exited: reaped at T (+ R), the
    /// bystander untouched.
    fn act_freeze(
        &mut self,
        control: &mut RawConnection,
        frozen: &WorkerProcess,
        frozen_id: u64,
        bystander_id: u64,
    ) -> Result<(), BenchError> {
        let stopped_at = Instant::now();
        frozen.signal(rustix::process::Signal::STOP);
        self.timeline.event(format!(
            "SIGSTOP worker {FROZEN} (pid {}): frozen, no heartbeat, no traffic",
            frozen.pid()
        ));
        let status = self.wait_status(control, "worker B to be reaped", |s| {
            instance(s, frozen_id).is_none()
        })?;
        let silent_for = stopped_at.elapsed();
        if status.contexts.freed_total.reaped != 1 || instance(&status, bystander_id).is_none() {
            return Err(BenchError::Failed(format!(
                "expected worker B reaped by timeout and C untouched; freed {:?}, C present: {}",
                status.contexts.freed_total,
                instance(&status, bystander_id).is_some()
            )));
        }
        self.timeline.event(format!(
            "worker {FROZEN} reaped {:.2} s after SIGSTOP: silent past the reap timeout \
             (T = {} s, R = {} s); a stopped process has not exited, so only the timeout frees \
             it. Worker {BYSTANDER} untouched",
            silent_for.as_secs_f64(),
            self.reap_timeout_seconds,
            status.worker_liveness.resolution_seconds
        ));
        Ok(())
    }

    /// SIGCONT: the thawed worker's first ping is answered false; it re-registers, and
    /// exactly one fresh context is built. Then the final status.
    fn act_thaw(
        &mut self,
        control: &mut RawConnection,
        frozen: &mut WorkerProcess,
        frozen_id: u64,
        built_before: u64,
    ) -> Result<(), BenchError> {
        frozen.signal(rustix::process::Signal::CONT);
        self.timeline
            .event(format!("SIGCONT worker {FROZEN}: thawed"));
        // Its heartbeat (ping answered false) and its traffic (not_registered) may both
        // learn of the reap; the second re-registration then takes the `refreshed` path.
        let line = frozen.wait_line("`recoveries=`", |l| l.starts_with("recoveries="))?;
        let status = self.wait_status(control, "worker B back and pinging", |s| {
            instance(s, frozen_id).is_some_and(|i| i.proven && !i.building)
        })?;
        let rebuilt = built(&status) - built_before;
        let entries = count_instance(&status, frozen_id);
        if rebuilt != 1 || entries != 1 {
            return Err(BenchError::Failed(format!(
                "worker B came back with {rebuilt} contexts built and {entries} entries \
                 (worker said {line:?}); expected exactly one fresh context"
            )));
        }
        self.timeline.event(format!(
            "worker {FROZEN} re-registered instance {frozen_id}: the server said it no longer \
             held it (a ping answered false, or not_registered); exactly one fresh context \
             built (outcome=created)"
        ));
        // The worker prints its count of re-registrations when it changes: two when its
        // heartbeat and its traffic both noticed the reap; the later one built nothing.
        if !line.starts_with("recoveries=1 ") {
            self.timeline.event(format!(
                "worker {FROZEN}'s heartbeat and its traffic both noticed; its second \
                 re-registration found the entry already back and built nothing \
                 (outcome=refreshed)"
            ));
        }
        say("\nFinal status:");
        let status = control.status()?;
        say(&kvwarden::cli::status::table(&status));
        if built(&status) != built_before + 1 {
            return Err(BenchError::Failed(format!(
                "contexts built went from {built_before} to {} after the thaw; expected exactly \
                 one more",
                built(&status)
            )));
        }
        Ok(())
    }

    /// Polls the status every 10 ms until `condition` holds (bounded).
    fn wait_status(
        &self,
        control: &mut RawConnection,
        what: &str,
        condition: impl Fn(&StatusReport) -> bool,
    ) -> Result<StatusReport, BenchError> {
        let start = Instant::now();
        loop {
            let status = control.status()?;
            if condition(&status) {
                return Ok(status);
            }
            self.check_bound(start, what)?;
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits `length` (interruptible): the window traffic is counted over.
    fn pause(&self, length: Duration) -> Result<(), BenchError> {
        let start = Instant::now();
        while start.elapsed() < length {
            self.check_bound(start, "a pause")?;
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn check_bound(&self, since: Instant, what: &str) -> Result<(), BenchError> {
        if self.interrupted.load(Ordering::Relaxed) {
            return Err(BenchError::Failed("interrupted".into()));
        }
        let bound = PATIENCE + Duration::from_secs_f64(self.reap_timeout_seconds * 2.0);
        if since.elapsed() > bound {
            return Err(BenchError::Failed(format!(
                "gave up after {bound:?} waiting for {what}"
            )));
        }
        Ok(())
    }
}

fn instance(status: &StatusReport, id: u64) -> Option<&InstanceStatus> {
    status.instances.iter().find(|item| item.instance_id == id)
}

fn count_instance(status: &StatusReport, id: u64) -> usize {
    status
        .instances
        .iter()
        .filter(|item| item.instance_id == id)
        .count()
}

fn built(status: &StatusReport) -> u64 {
    status.contexts.built_total
}

/// Requests served so far, by op, from `GET /metrics`.
#[derive(Copy, Clone, Default)]
struct RequestCounts {
    store: u64,
    retrieve: u64,
    ping: u64,
}

fn request_counts(http: std::net::SocketAddr) -> Option<RequestCounts> {
    let mut stream = std::net::TcpStream::connect_timeout(&http, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: kvwarden\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let count = |op: &str| {
        let label = format!("op=\"{op}\"");
        text.lines()
            .filter(|l| l.starts_with("kvwarden_requests_total{") && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .sum()
    };
    Some(RequestCounts {
        store: count("store"),
        retrieve: count("retrieve"),
        ping: count("ping"),
    })
}
