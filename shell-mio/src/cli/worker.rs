//! `kvwarden worker`: a real worker process for tests, demos and load.
//!
//! It prints `instance_id=<n>` first, then `exit_proof=<how the server will notice its
//! death>`, then one line per event (`registered outcome=…`,
//! `healthy=…`, `recoveries=… outcome=…`, `shutdown=clean`), so a test can follow it.

use crate::client::{Client, ClientBuffer, MemfdBuffer};
use crate::cuda::{CudaAllocator, ExportedBuffer, Gpu};
use kvwarden_core::InstanceId;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Flags of `kvwarden worker`.
#[derive(Debug, clap::Args)]
// A negative number after a space reaches the flag's own check, not "unexpected argument".
#[command(allow_negative_numbers = true)]
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
    /// Register this many bytes of GPU memory over CUDA IPC instead of memfd buffers:
    /// allocated with cuMemAlloc on `--device`, filled, exported with cuIpcGetMemHandle.
    /// The server must run on the same host with access to the GPU.
    #[arg(long, value_name = "BYTES", value_parser = super::parse_bytes)]
    cuda_bytes: Option<u64>,
    /// The CUDA device for `--cuda-bytes`.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    device: u32,
    /// How `--cuda-bytes` is allocated and shared: `malloc` (cuMemAlloc, sent as a
    /// cuda_ipc handle) or `vmm` (cuMemCreate, as PyTorch's expandable segments and
    /// vLLM's sleep mode allocate, sent as a cuda_vmm POSIX fd).
    #[arg(long, value_enum, default_value_t = CudaAllocator::Malloc, requires = "cuda_bytes")]
    cuda_allocator: CudaAllocator,
    /// Do not send the server a pidfd of this process in `hello` (as clients before it
    /// did): its death is then proven only by pid where the server can see it, else
    /// noticed only by the reap timeout.
    #[arg(long)]
    no_send_pidfd: bool,
}

/// Allocates and exports the worker's device buffer; the allocation lives as long as
/// the returned value (the whole process).
fn cuda_buffer(
    nbytes: u64,
    device: u32,
    allocator: CudaAllocator,
) -> Result<(ExportedBuffer, ClientBuffer), String> {
    let gpu = Gpu::probe_device(device).map_err(|e| format!("--cuda-bytes needs a GPU: {e}"))?;
    let len = usize::try_from(nbytes).map_err(|_| format!("--cuda-bytes {nbytes} is too large"))?;
    let exported = ExportedBuffer::allocate_with(allocator, &gpu, device, len, 0x5a)
        .map_err(|e| format!("allocating {nbytes} bytes on device {device}: {e}"))?;
    let buffer = exported.client_buffer();
    Ok((exported, buffer))
}

/// The secret of `KVWARDEN_WORKER_SECRET`: 64 hex digits. For the benchmarks and the
/// demo only, which watch a worker's instance from a connection of their own; a real
/// worker draws its secret and keeps it to itself.
fn parse_secret(hex: &str) -> Result<[u8; 32], String> {
    let hex = hex.trim();
    let mut secret = [0u8; 32];
    if hex.len() != 64 {
        return Err(format!(
            "expected 64 hex digits, got {} characters",
            hex.len()
        ));
    }
    for (byte, pair) in secret.iter_mut().zip(hex.as_bytes().chunks(2)) {
        let text = std::str::from_utf8(pair).map_err(|_| "not hex".to_string())?;
        *byte = u8::from_str_radix(text, 16).map_err(|_| format!("{text:?} is not hex"))?;
    }
    Ok(secret)
}

fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// Runs until SIGTERM/SIGINT, then shuts down cleanly.
pub fn run(args: WorkerArgs) -> ExitCode {
    match serve(&args) {
        Ok(code) | Err(code) => code,
    }
}

/// Connects, registers, then pings and moves traffic until told to stop; an error is
/// said on stderr and answered with its exit code.
fn serve(args: &WorkerArgs) -> Result<ExitCode, ExitCode> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            eprintln!("kvwarden worker: installing a signal handler failed: {error}");
            return Err(ExitCode::from(1));
        }
    }
    let client = match Client::connect(client_config(args)?) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("kvwarden worker: {}", super::connect_error(&error));
            return Err(ExitCode::from(1));
        }
    };
    say(&format!("instance_id={}", client.instance_id()));
    say(&format!(
        "exit_proof={}",
        client.exit_proof().as_deref().unwrap_or("unknown")
    ));
    // Kept alive to the end of the process: a SIGKILL leaves the device memory to
    // whoever still maps it.
    let (buffers, buffer_bytes, _device_buffer) = buffers(args)?;
    let registered_buffers = buffers.len();
    match client.register_buffers(buffers, &args.model_name, 1) {
        Ok(outcome) => say(&format!("registered outcome={outcome}")),
        Err(error) => {
            eprintln!("kvwarden worker: registering failed: {error}");
            return Err(ExitCode::from(1));
        }
    }
    if !args.lazy_heartbeat {
        client.start_heartbeat();
    }
    let buffer_len = buffer_bytes as u64;
    let chunk = args.chunk_bytes.min(buffer_len / 2);
    let traffic = (args.traffic_every_ms > 0 && registered_buffers > 0 && chunk > 0)
        .then_some((chunk, buffer_len));
    run_until_stopped(&client, args, &stop, traffic);
    match client.shutdown() {
        Ok(()) => {
            say("shutdown=clean");
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("kvwarden worker: unregister at shutdown failed: {error}");
            say("shutdown=unclean");
            Err(ExitCode::from(1))
        }
    }
}

/// The client's settings from the flags and `KVWARDEN_WORKER_SECRET`.
fn client_config(args: &WorkerArgs) -> Result<crate::client::ClientConfig, ExitCode> {
    let bad = |message: String| {
        eprintln!("kvwarden worker: {message}");
        ExitCode::from(2)
    };
    let Ok(interval) = Duration::try_from_secs_f64(args.heartbeat_interval_seconds) else {
        return Err(bad(format!(
            "invalid --heartbeat-interval-seconds {}",
            args.heartbeat_interval_seconds
        )));
    };
    let instance_id = args
        .instance_id
        .map(InstanceId::new)
        .transpose()
        .map_err(|error| bad(error.to_string()))?;
    let mut config = args.endpoint.client_config().map_err(bad)?;
    config.heartbeat_interval = interval;
    config.instance_id = instance_id;
    if let Ok(hex) = std::env::var("KVWARDEN_WORKER_SECRET") {
        config.instance_secret = Some(
            parse_secret(&hex)
                .map_err(|message| bad(format!("KVWARDEN_WORKER_SECRET: {message}")))?,
        );
    }
    config.client_name = concat!("kvwarden-worker ", env!("CARGO_PKG_VERSION")).to_string();
    config.send_pidfd = !args.no_send_pidfd;
    Ok(config)
}

/// The buffers to register: one CUDA buffer (`--cuda-bytes`), or `--buffers` memfds of
/// `--buffer-bytes` each, filled with a pattern; with the bytes of each, and the device
/// buffer to keep alive.
fn buffers(
    args: &WorkerArgs,
) -> Result<(Vec<ClientBuffer>, usize, Option<ExportedBuffer>), ExitCode> {
    let failed = |error: String| {
        eprintln!("kvwarden worker: {error}");
        ExitCode::from(1)
    };
    if let Some(nbytes) = args.cuda_bytes {
        let (exported, buffer) =
            cuda_buffer(nbytes, args.device, args.cuda_allocator).map_err(failed)?;
        say(&format!(
            "cuda_buffer device={} bytes={nbytes} allocator={}",
            args.device,
            args.cuda_allocator.label()
        ));
        let bytes = usize::try_from(nbytes).unwrap_or(usize::MAX);
        return Ok((vec![buffer], bytes, Some(exported)));
    }
    let buffer_bytes = usize::try_from(args.buffer_bytes).unwrap_or(usize::MAX);
    let count = if buffer_bytes == 0 { 0 } else { args.buffers };
    let mut buffers = Vec::with_capacity(count);
    for index in 0..count {
        let buffer = MemfdBuffer::new(buffer_bytes).map_err(|error| failed(error.to_string()))?;
        let pattern: Vec<u8> = (0..buffer_bytes.min(1 << 20))
            .map(|i| (i + index) as u8)
            .collect();
        buffer.write(0, &pattern);
        buffers.push(ClientBuffer::Memfd(Arc::new(buffer)));
    }
    Ok((buffers, buffer_bytes, None))
}

/// Says each change of health and each recovery, and with `traffic` (the chunk and the
/// buffer's bytes) stores and retrieves one chunk every `--traffic-every-ms`, until
/// `stop`.
fn run_until_stopped(
    client: &Client,
    args: &WorkerArgs,
    stop: &AtomicBool,
    traffic: Option<(u64, u64)>,
) {
    let tick = Duration::from_millis(if traffic.is_some() {
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
        if let Some((chunk, buffer_len)) = traffic
            && last_traffic.elapsed() >= Duration::from_millis(args.traffic_every_ms)
        {
            last_traffic = std::time::Instant::now();
            sent += 1;
            let key = format!("{}-{sent}", client.instance_id()).into_bytes();
            let result = client
                .store(&key, 0, 0, chunk)
                .and_then(|_| client.retrieve(&key, 0, buffer_len - chunk, chunk));
            if let Err(error) = result {
                eprintln!("kvwarden worker: traffic: {error}");
            }
        }
    }
}
