//! `kvwarden gpu`: the GPU checks of `docs/targets.md` (G1–G3), run by
//! `shell-mio/scripts/gpu-check.sh` on a host with an NVIDIA GPU.
//!
//! - `gpu info`: what the driver reports (exit 3 when there is no usable GPU).
//! - `gpu reclaim`: a worker registers N bytes over CUDA IPC and is SIGKILLed; how long
//!   until the device has the memory back (G1); `--workers 8`: eight at once (G3). `--control` runs the same against a
//!   server that cannot know (reaping disabled, worker over TCP: no process-exit proof).
//! - `gpu copy`: `store`/`retrieve` device ↔ L1 bandwidth against a plain pinned
//!   `cuMemcpyDtoH`/`HtoD` of the same chunks (G2).

use clap::builder::TypedValueParser as _;
use kvwarden::cuda::{CudaAllocator, ExportedBuffer, Gpu, PinnedHost};
use kvwarden_bench::process::{ServerProcess, WorkerProcess};
use kvwarden_bench::raw::RawConnection;
use kvwarden_client::{Client, ClientConfig, Endpoint};
use rustix::process::Signal;
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Starts `kvwarden serve` (HTTP off, a temporary socket) with `extra` flags.
fn start_server(extra: &[&str]) -> Result<ServerProcess, String> {
    let args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    ServerProcess::start("gpu", &args, "warn").map_err(|e| e.to_string())
}

/// Fails loudly when the server answered a ping `false`: nothing in these checks reaps,
/// restarts or cuts off a live worker, so a worker told that its instance is not held
/// is a bug (issue 16 was found this way), whatever the figures say.
fn check_no_ping_answered_false(server: &ServerProcess) -> Result<(), String> {
    let status = RawConnection::connect(&server.socket)
        .and_then(|mut control| control.status())
        .map_err(|e| format!("reading the server's status: {e}"))?;
    let liveness = &status.worker_liveness;
    match liveness.pings_answered_false_total {
        0 => Ok(()),
        answered_false => Err(format!(
            "FAILED: the server answered {answered_false} of {} pings `false`: a live worker \
             was told that its instance is not held, although nothing was reaped or \
             restarted. The figures above are void. The server's log ends:\n{}",
            liveness.pings_total,
            server.log_tail(40)
        )),
    }
}

/// Subcommands of `kvwarden gpu`.
#[derive(Debug, clap::Subcommand)]
pub enum GpuCommand {
    /// Print the devices and their memory (exit 3 when no GPU is usable).
    Info,
    /// G1: SIGKILL a worker holding N bytes over CUDA IPC; time until the memory is back
    /// (G3 with `--workers 8`: eight at once, timed from the last exit).
    Reclaim(ReclaimArgs),
    /// G2: store/retrieve device ↔ L1 bandwidth against plain pinned copies.
    Copy(GpuCopyArgs),
}

/// Flags of `kvwarden gpu reclaim`.
#[derive(Debug, clap::Args)]
pub struct ReclaimArgs {
    /// Bytes the worker allocates and registers.
    #[arg(long, default_value = "16G", value_parser = kvwarden_client::parse_bytes)]
    bytes: u64,
    /// The device.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Run the control instead: a server with reaping disabled and the worker on TCP,
    /// so nothing tells the server the worker died.
    #[arg(long)]
    control: bool,
    /// How long to wait for the memory to come back.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    wait_seconds: f64,
    /// Kills to measure (each with fresh workers).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1000).map(|n| n as usize))]
    rounds: usize,
    /// Workers that each register `--bytes` and are SIGKILLed together (an engine's
    /// ranks): 1 measures G1, more measure G3 (8 for an 8-rank engine), timed from the
    /// last worker's exit.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64).map(|n| n as usize))]
    workers: usize,
    /// How the workers allocate and share their memory: `malloc` (cuMemAlloc, cuda_ipc)
    /// or `vmm` (cuMemCreate, cuda_vmm: its fd travels over the Unix socket, so not with
    /// --control).
    #[arg(long, value_enum, default_value_t = CudaAllocator::Malloc)]
    cuda_allocator: CudaAllocator,
}

/// Flags of `kvwarden gpu copy`.
#[derive(Debug, clap::Args)]
pub struct GpuCopyArgs {
    /// Bytes per store/retrieve (one L1 slot).
    #[arg(long, default_value = "2M", value_parser = kvwarden_client::parse_bytes)]
    chunk_bytes: u64,
    /// Bytes moved in each direction.
    #[arg(long, default_value = "2G", value_parser = kvwarden_client::parse_bytes)]
    total_bytes: u64,
    /// Concurrent clients (each its own device buffer and connection).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// The device.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// How each client's device buffer is allocated and shared: `malloc` (cuMemAlloc,
    /// cuda_ipc) or `vmm` (cuMemCreate, cuda_vmm).
    #[arg(long, value_enum, default_value_t = CudaAllocator::Malloc)]
    cuda_allocator: CudaAllocator,
}

/// Runs `kvwarden gpu …`.
pub fn run(command: GpuCommand) -> ExitCode {
    let device = match &command {
        GpuCommand::Info => None,
        GpuCommand::Reclaim(args) => Some(args.device),
        GpuCommand::Copy(args) => Some(args.device),
    };
    // A bench opens only the device it measures: every context costs device memory.
    let gpu = match device.map_or_else(Gpu::probe, Gpu::probe_device) {
        Ok(gpu) => gpu,
        Err(error) => {
            eprintln!("kvwarden gpu: {error}");
            return ExitCode::from(3);
        }
    };
    let result = match command {
        GpuCommand::Info => info(&gpu),
        GpuCommand::Reclaim(args) => reclaim(&gpu, &args),
        GpuCommand::Copy(args) => copy(&gpu, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvwarden gpu: {error}");
            ExitCode::from(1)
        }
    }
}

fn info(gpu: &Gpu) -> Result<(), String> {
    println!("devices {}", gpu.device_count());
    for memory in gpu.memory().map_err(|e| e.to_string())? {
        println!(
            "device {} free_bytes {} total_bytes {}",
            memory.device, memory.free_bytes, memory.total_bytes
        );
    }
    Ok(())
}

fn free_bytes(gpu: &Gpu, device: u32) -> Result<u64, String> {
    gpu.memory()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|m| m.device == device)
        .map(|m| m.free_bytes)
        .ok_or_else(|| format!("no device {device}"))
}

fn reclaim(gpu: &Gpu, args: &ReclaimArgs) -> Result<(), String> {
    let workers = args.workers.max(1);
    if args.control && workers > 1 {
        return Err("--control runs one worker; leave out --workers (or pass --workers 1)".into());
    }
    if args.control && args.cuda_allocator == CudaAllocator::Vmm {
        return Err(
            "--control runs its worker over TCP, which carries no fd, so not a cuda_vmm \
             buffer; leave out --cuda-allocator vmm (or --control)"
                .into(),
        );
    }
    let server = if args.control {
        start_server(&[
            "--worker-reap-timeout-seconds",
            "0",
            "--worker-registration-grace-seconds",
            "0",
            "--tcp",
            "127.0.0.1:0",
        ])?
    } else {
        start_server(&[])?
    };
    let endpoint: Vec<String> = match (&server.tcp, &server.tcp_token_file, args.control) {
        // A TCP worker presents the token the started server was given.
        (Some(addr), Some(token_file), true) => vec![
            "--tcp".into(),
            addr.to_string(),
            "--tcp-token-file".into(),
            token_file.display().to_string(),
        ],
        _ => vec!["--socket".into(), server.socket.display().to_string()],
    };
    let total_bytes = args.bytes.saturating_mul(workers as u64);
    // The driver's free memory moves a little on its own; never by half a worker's.
    let tolerance = (total_bytes / 16).max(64 << 20).min(args.bytes / 2);
    // Per round: from the first SIGKILL, and from the last worker's exit, to the memory back.
    let mut from_kill_ms = Vec::new();
    let mut from_last_exit_ms = Vec::new();
    for round in 1..=args.rounds {
        if let Some((ms, after_exit_ms)) = reclaim_round(gpu, args, round, &endpoint, tolerance)? {
            from_kill_ms.push(ms);
            from_last_exit_ms.push(after_exit_ms);
        }
        if args.control {
            break; // the control's memory stays until the server exits
        }
    }
    if args.control {
        let leaked = from_kill_ms.is_empty();
        return report_control(gpu, args, server, leaked);
    }
    check_no_ping_answered_false(&server)?;
    let missed = args.rounds - from_kill_ms.len();
    if missed > 0 {
        return Err(format!(
            "the memory did not come back within {} s in {missed} of {} rounds",
            args.wait_seconds, args.rounds
        ));
    }
    print_reclaim(args, &mut from_kill_ms, &mut from_last_exit_ms);
    drop(server);
    Ok(())
}

/// G1's line (one worker) or G3's two (several): the slowest and median times from the
/// SIGKILL, and for G3 from the last exit, to the memory back (ms, one per round).
fn print_reclaim(args: &ReclaimArgs, from_kill_ms: &mut [f64], from_last_exit_ms: &mut [f64]) {
    let workers = args.workers.max(1);
    let gib = args.bytes as f64 / f64::from(1u32 << 30);
    let (max, median) = max_and_median(from_kill_ms);
    let (max_after_exit, median_after_exit) = max_and_median(from_last_exit_ms);
    let vmm = figure_prefix(args.cuda_allocator);
    if workers == 1 {
        println!(
            "G1 {vmm}reclaim_after_sigkill_ms_max {max:.1} ms (target <= 100 ms; {gib:.1} GiB, {} rounds, median {median:.1} ms)",
            args.rounds
        );
    } else {
        println!(
            "G3 {vmm}reclaim_all_after_last_exit_ms_max {max_after_exit:.1} ms (target <= 50 ms; {workers} workers x {gib:.1} GiB, {} rounds, median {median_after_exit:.1} ms)",
            args.rounds
        );
        println!(
            "G3 {vmm}reclaim_all_after_sigkill_ms_max {max:.1} ms ({workers} workers x {gib:.1} GiB, {} rounds, median {median:.1} ms)",
            args.rounds
        );
    }
}

/// One round: `--workers` workers register `--bytes` of device memory each and are
/// SIGKILLed together; how long until the device's free memory is back (from the kill,
/// and from the last exit, in ms), or None when it is not back within `--wait-seconds`.
fn reclaim_round(
    gpu: &Gpu,
    args: &ReclaimArgs,
    round: usize,
    endpoint: &[String],
    tolerance: u64,
) -> Result<Option<(f64, f64)>, String> {
    let workers = args.workers.max(1);
    let gib = args.bytes as f64 / f64::from(1u32 << 30);
    let gib_of = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let baseline = free_bytes(gpu, args.device)?;
    let mut worker_args: Vec<String> = endpoint.to_vec();
    worker_args.extend([
        "--cuda-bytes".into(),
        args.bytes.to_string(),
        "--device".into(),
        args.device.to_string(),
        "--traffic-every-ms".into(),
        "0".into(),
        "--cuda-allocator".into(),
        args.cuda_allocator.label().into(),
    ]);
    // Each returns once its worker has registered its device memory.
    let mut started = Vec::with_capacity(workers);
    for _ in 0..workers {
        started
            .push(WorkerProcess::start(&worker_args, Stdio::inherit()).map_err(|e| e.to_string())?);
    }
    let held = free_bytes(gpu, args.device)?;
    println!(
        "round {round}: {workers} worker(s) registered {gib:.1} GiB each; device free {:.2} -> {:.2} GiB",
        gib_of(baseline),
        gib_of(held)
    );
    // SIGKILL them all before reaping any: an engine's ranks die together.
    let killed = Instant::now();
    for worker in &started {
        worker.signal(Signal::KILL);
    }
    for worker in started {
        worker.reap();
    }
    let last_exit = killed.elapsed();
    let wait = Duration::from_secs_f64(args.wait_seconds);
    let back = loop {
        let free = free_bytes(gpu, args.device)?;
        if free + tolerance >= baseline {
            break Some(killed.elapsed());
        }
        if killed.elapsed() > wait {
            break None;
        }
        std::thread::sleep(Duration::from_micros(500));
    };
    let exited_ms = last_exit.as_secs_f64() * 1e3;
    match back {
        Some(after) => {
            let ms = after.as_secs_f64() * 1e3;
            let after_exit_ms = after.saturating_sub(last_exit).as_secs_f64() * 1e3;
            println!(
                "round {round}: exited after {exited_ms:.1} ms; memory back after {ms:.1} ms ({after_exit_ms:.1} ms after the last exit)"
            );
            return Ok(Some((ms, after_exit_ms)));
        }
        None => {
            let free = free_bytes(gpu, args.device)?;
            println!(
                "round {round}: memory NOT back after {:.1} s (device free {:.2} GiB, baseline {:.2} GiB)",
                args.wait_seconds,
                gib_of(free),
                gib_of(baseline)
            );
        }
    }
    Ok(None)
}

/// The control's verdict: with reaping off and no proof of exit (TCP), the dead
/// worker's memory must stay held until the server stops.
fn report_control(
    gpu: &Gpu,
    args: &ReclaimArgs,
    server: ServerProcess,
    leaked: bool,
) -> Result<(), String> {
    let gib = args.bytes as f64 / f64::from(1u32 << 30);
    let gib_of = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    println!(
        "G1 control_memory_held_after_sigkill {} ({gib:.1} GiB; reaping disabled, TCP worker: no proof; {})",
        if leaked { "yes" } else { "no" },
        if leaked {
            "the server's IPC mapping keeps the dead worker's memory"
        } else {
            "unexpected: the memory came back without a free"
        }
    );
    drop(server);
    let after_exit = Instant::now();
    let base = free_bytes(gpu, args.device)?;
    println!(
        "control: server stopped; device free now {:.2} GiB ({:.0} ms after the stop)",
        gib_of(base),
        after_exit.elapsed().as_secs_f64() * 1e3
    );
    if leaked {
        Ok(())
    } else {
        Err("the control's memory came back although the server could not know".into())
    }
}

/// The largest and the median of `samples` (not empty).
fn max_and_median(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    (samples[samples.len() - 1], samples[samples.len() / 2])
}

fn copy(gpu: &Gpu, args: &GpuCopyArgs) -> Result<(), String> {
    let chunk = usize::try_from(args.chunk_bytes).map_err(|_| "chunk too large")?;
    let clients = args.clients.max(1);
    let per_client_bytes = 256usize << 20;
    let chunks_per_buffer = (per_client_bytes / chunk).max(1);
    let rounds = (args.total_bytes as usize / chunk / clients).max(1);
    // L1 holds every chunk stored, so no retrieve misses for eviction.
    let l1 = (clients * rounds * chunk).max(chunk).to_string();
    let slot = chunk.to_string();
    let server = start_server(&["--l1-bytes", &l1, "--slot-bytes", &slot])?;

    let total = rounds * clients;
    let (dtoh, htod) = pinned_baseline(gpu, args.device, per_client_bytes, chunk, total)?;

    // Through the server: each client stores then retrieves its chunks.
    let socket = server.socket.clone();
    let phase = std::sync::Barrier::new(clients);
    let results: Vec<Result<(Duration, Duration), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let socket = socket.clone();
                let phase = &phase;
                scope.spawn(move || -> Result<(Duration, Duration), String> {
                    // Every thread reaches the barrier, failed or not, so none waits forever.
                    let stored =
                        store_phase(gpu, args, &socket, c, rounds, chunk, per_client_bytes);
                    phase.wait();
                    let (client, buffer, stored) = stored?;
                    let started = Instant::now();
                    for i in 0..rounds {
                        let offset = ((i % chunks_per_buffer) * chunk) as u64;
                        let copied = client
                            .retrieve(&chunk_key(c, i), 0, offset, chunk as u64)
                            .map_err(|e| e.to_string())?;
                        if copied != Some(chunk as u64) {
                            return Err(format!(
                                "retrieve of chunk {i} answered {copied:?}, expected {chunk} bytes"
                            ));
                        }
                    }
                    let retrieved = started.elapsed();
                    verify_retrieved(&buffer, c, rounds.min(chunks_per_buffer), chunk)?;
                    let _ = client.shutdown();
                    Ok((stored, retrieved))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect()
    });
    let mut slowest = (Duration::ZERO, Duration::ZERO);
    for result in results {
        let (stored, retrieved) = result?;
        slowest.0 = slowest.0.max(stored);
        slowest.1 = slowest.1.max(retrieved);
    }
    let compared = rounds.min(chunks_per_buffer) * clients;
    let moved = |took| bandwidth(total * chunk, took);
    print_g2(
        args,
        (dtoh, htod),
        (moved(slowest.0), moved(slowest.1)),
        compared,
    );
    check_no_ping_answered_false(&server)?;
    drop(server);
    Ok(())
}

/// G2's lines: the pinned baselines, then the store and retrieve rates (GB/s) and their
/// ratios to them, and how many chunks were compared.
fn print_g2(
    args: &GpuCopyArgs,
    (dtoh, htod): (f64, f64),
    (store, retrieve): (f64, f64),
    compared: usize,
) {
    let clients = args.clients.max(1);
    let chunks = match args.chunk_bytes {
        bytes if bytes >= 1 << 20 => format!("{} MiB chunks", bytes >> 20),
        bytes => format!("{} KiB chunks", bytes >> 10),
    };
    // G2's target is for 2 MiB chunks and up; smaller ones show what a copy's fixed cost does.
    let target = if args.chunk_bytes >= 2 << 20 {
        "target >= 0.8"
    } else {
        "no target below 2 MiB chunks"
    };
    let vmm = figure_prefix(args.cuda_allocator);
    println!("G2 baseline_dtoh_pinned {dtoh:.2} GB/s ({chunks}, one stream)");
    println!("G2 baseline_htod_pinned {htod:.2} GB/s ({chunks}, one stream)");
    println!("G2 {vmm}store_device_to_l1 {store:.2} GB/s ({clients} clients, {chunks})");
    println!("G2 {vmm}retrieve_l1_to_device {retrieve:.2} GB/s ({clients} clients, {chunks})");
    println!("G2 {vmm}store_ratio {:.2} ({target})", store / dtoh);
    println!("G2 {vmm}retrieve_ratio {:.2} ({target})", retrieve / htod);
    println!(
        "G2 retrieved_bytes_identical yes ({compared} chunks of {clients} clients compared byte for byte)"
    );
}

/// What a figure's name starts with for `allocator`'s memory: the cuMemCreate figures
/// are lines of their own (`vmm_…`), as the targets are measured on cuMemAlloc memory.
fn figure_prefix(allocator: CudaAllocator) -> &'static str {
    match allocator {
        CudaAllocator::Malloc => "",
        CudaAllocator::Vmm => "vmm_",
    }
}

/// The baseline: `total` plain copies of `chunk` bytes each way between one client's
/// device buffer (of `buffer_bytes`) and pinned host memory, in GB/s (to the host, from).
fn pinned_baseline(
    gpu: &Gpu,
    device: u32,
    buffer_bytes: usize,
    chunk: usize,
    total: usize,
) -> Result<(f64, f64), String> {
    let chunks_per_buffer = (buffer_bytes / chunk).max(1);
    let buffer =
        ExportedBuffer::allocate(gpu, device, buffer_bytes, 1).map_err(|e| e.to_string())?;
    let mut pinned = PinnedHost::allocate(gpu, device, chunk).map_err(|e| e.to_string())?;
    let started = Instant::now();
    for i in 0..total {
        buffer
            .copy_to_pinned((i % chunks_per_buffer) * chunk, &mut pinned, chunk)
            .map_err(|e| e.to_string())?;
    }
    let dtoh = bandwidth(total * chunk, started.elapsed());
    let started = Instant::now();
    for i in 0..total {
        buffer
            .copy_from_pinned((i % chunks_per_buffer) * chunk, &pinned, chunk)
            .map_err(|e| e.to_string())?;
    }
    Ok((dtoh, bandwidth(total * chunk, started.elapsed())))
}

fn chunk_key(client: usize, chunk: usize) -> Vec<u8> {
    format!("{client}-{chunk}").into_bytes()
}

/// One client of `gpu copy`: its own device buffer and connection, then `rounds`
/// stores of distinct keys (so that every store copies).
fn store_phase(
    gpu: &Gpu,
    args: &GpuCopyArgs,
    socket: &Path,
    c: usize,
    rounds: usize,
    chunk: usize,
    buffer_bytes: usize,
) -> Result<(Client, ExportedBuffer, Duration), String> {
    let exported =
        ExportedBuffer::allocate_with(args.cuda_allocator, gpu, args.device, buffer_bytes, c as u8)
            .map_err(|e| e.to_string())?;
    let client = Client::connect(ClientConfig::new(Endpoint::Unix(socket.to_path_buf())))
        .map_err(|e| e.to_string())?;
    client
        .register_buffers(vec![exported.client_buffer()], "gpu-copy", 1)
        .map_err(|e| e.to_string())?;
    let chunks_per_buffer = (buffer_bytes / chunk).max(1);
    // Every slot the stores read holds its own bytes, so a chunk retrieved to the wrong
    // place, or not at all, shows in `verify_retrieved`.
    for slot in 0..rounds.min(chunks_per_buffer) {
        exported
            .write(slot * chunk, &chunk_pattern(c, slot, chunk))
            .map_err(|e| e.to_string())?;
    }
    let started = Instant::now();
    for i in 0..rounds {
        let offset = ((i % chunks_per_buffer) * chunk) as u64;
        let stored = client
            .store(&chunk_key(c, i), 0, offset, chunk as u64)
            .map_err(|e| e.to_string())?;
        if !stored {
            return Err(format!("store {i} refused: L1 full of pinned data"));
        }
    }
    let elapsed = started.elapsed();
    // Zeroed before the retrieves, so every byte compared afterwards came from L1.
    exported.fill(0).map_err(|e| e.to_string())?;
    Ok((client, exported, elapsed))
}

/// The bytes of client `c`'s buffer slot `slot`: distinct per client, slot and word.
fn chunk_pattern(c: usize, slot: usize, chunk: usize) -> Vec<u8> {
    let tag = ((c as u64 + 1) << 48) | ((slot as u64) << 24);
    let mut bytes = Vec::with_capacity(chunk + 8);
    for word in 0..chunk.div_ceil(8) {
        bytes.extend_from_slice(&(tag | word as u64).to_le_bytes());
    }
    bytes.truncate(chunk);
    bytes
}

/// Fails naming the first differing byte when a retrieved slot does not hold what was
/// stored from it.
fn verify_retrieved(
    buffer: &ExportedBuffer,
    c: usize,
    slots: usize,
    chunk: usize,
) -> Result<(), String> {
    let mut read = vec![0u8; chunk];
    for slot in 0..slots {
        buffer
            .read(slot * chunk, &mut read)
            .map_err(|e| e.to_string())?;
        let expected = chunk_pattern(c, slot, chunk);
        if let Some(at) = read.iter().zip(&expected).position(|(a, b)| a != b) {
            return Err(format!(
                "FAILED: client {c}'s slot {slot} differs at byte {at} after retrieve \
                 (read {:#04x}, stored {:#04x}): a retrieve wrote the wrong bytes",
                read[at], expected[at]
            ));
        }
    }
    Ok(())
}

fn bandwidth(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}
