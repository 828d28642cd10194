//! `kvwarden worker`: a real worker process for tests, demos and load.
//!
//! It prints `instance_id=<n>` first, then one line per event (`registered outcome=…`,
//! `healthy=…`, `recoveries=… outcome=…`, `shutdown=clean`), so a test can follow it.

use crate::client::{Client, ClientConfig, MemfdBuffer};
use kvwarden_core::InstanceId;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Flags of `kvwarden worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    endpoint: super::EndpointArgs,
    /// Seconds between pings (also a ping's timeout). The server's reap timeout must be
    /// at least 3 × this.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    heartbeat_interval_seconds: f64,
    /// Bytes per memfd buffer (0: register no buffers, e.g. over TCP).
    #[arg(long, default_value = "1M", value_name = "BYTES", value_parser = super::parse_bytes)]
    buffer_bytes: u64,
    /// How many memfd buffers to register.
    #[arg(long, default_value_t = 1, value_name = "N")]
    buffers: usize,
    /// A store + retrieve every this many milliseconds (0: no traffic).
    #[arg(long, default_value_t = 100, value_name = "MS")]
    traffic_every_ms: u64,
    /// Bytes per store.
    #[arg(long, default_value = "4K", value_name = "BYTES", value_parser = super::parse_bytes)]
    chunk_bytes: u64,
    /// Use this instance id instead of drawing a fresh one.
    #[arg(long, value_name = "ID")]
    instance_id: Option<u64>,
    /// The model name to register.
    #[arg(long, default_value = "demo-model")]
    model_name: String,
    /// Start the heartbeat only with the first store/retrieve (the client's lazy start),
    /// instead of right after registering.
    #[arg(long)]
    lazy_heartbeat: bool,
}

fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// Runs until SIGTERM/SIGINT, then shuts down cleanly.
pub fn run(args: WorkerArgs) -> ExitCode {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            eprintln!("kvwarden worker: installing a signal handler failed: {error}");
            return ExitCode::from(1);
        }
    }
    let Ok(interval) = Duration::try_from_secs_f64(args.heartbeat_interval_seconds) else {
        eprintln!(
            "kvwarden worker: invalid --heartbeat-interval-seconds {}",
            args.heartbeat_interval_seconds
        );
        return ExitCode::from(2);
    };
    let instance_id = match args.instance_id.map(InstanceId::new).transpose() {
        Ok(id) => id,
        Err(error) => {
            eprintln!("kvwarden worker: {error}");
            return ExitCode::from(2);
        }
    };
    let mut config = ClientConfig::new(args.endpoint.endpoint());
    config.heartbeat_interval = interval;
    config.instance_id = instance_id;
    config.client_name = concat!("kvwarden-worker ", env!("CARGO_PKG_VERSION")).to_string();
    let client = match Client::connect(config) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("kvwarden worker: {error}");
            return ExitCode::from(1);
        }
    };
    say(&format!("instance_id={}", client.instance_id()));
    let buffer_bytes = usize::try_from(args.buffer_bytes).unwrap_or(usize::MAX);
    let count = if buffer_bytes == 0 { 0 } else { args.buffers };
    let mut buffers = Vec::with_capacity(count);
    for index in 0..count {
        match MemfdBuffer::new(buffer_bytes) {
            Ok(buffer) => {
                let pattern: Vec<u8> = (0..buffer_bytes.min(1 << 20))
                    .map(|i| (i + index) as u8)
                    .collect();
                buffer.write(0, &pattern);
                buffers.push(Arc::new(buffer));
            }
            Err(error) => {
                eprintln!("kvwarden worker: {error}");
                return ExitCode::from(1);
            }
        }
    }
    match client.register(buffers, &args.model_name, 1) {
        Ok(outcome) => say(&format!("registered outcome={outcome}")),
        Err(error) => {
            eprintln!("kvwarden worker: registering failed: {error}");
            return ExitCode::from(1);
        }
    }
    if !args.lazy_heartbeat {
        client.start_heartbeat();
    }
    let chunk = args.chunk_bytes.min(args.buffer_bytes / 2);
    let traffic = args.traffic_every_ms > 0 && count > 0 && chunk > 0;
    let tick = Duration::from_millis(if traffic {
        args.traffic_every_ms.min(50)
    } else {
        20
    });
    let mut healthy = true;
    let mut recoveries = 0;
    let mut sent: u64 = 0;
    let mut last_traffic = std::time::Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(tick);
        if client.is_healthy() != healthy {
            healthy = client.is_healthy();
            say(&format!("healthy={healthy}"));
        }
        if client.recoveries() != recoveries {
            recoveries = client.recoveries();
            say(&format!(
                "recoveries={recoveries} outcome={}",
                client.last_outcome().unwrap_or_default()
            ));
        }
        if traffic && last_traffic.elapsed() >= Duration::from_millis(args.traffic_every_ms) {
            last_traffic = std::time::Instant::now();
            sent += 1;
            let key = format!("{}-{sent}", client.instance_id()).into_bytes();
            let result = client
                .store(&key, 0, 0, chunk)
                .and_then(|_| client.retrieve(&key, 0, args.buffer_bytes - chunk));
            if let Err(error) = result {
                eprintln!("kvwarden worker: traffic: {error}");
            }
        }
    }
    match client.shutdown() {
        Ok(()) => {
            say("shutdown=clean");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("kvwarden worker: unregister at shutdown failed: {error}");
            say("shutdown=unclean");
            ExitCode::from(1)
        }
    }
}
