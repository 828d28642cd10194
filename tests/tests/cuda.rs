//! The CUDA path end to end, on every host.
//!
//! Without a GPU: the server starts and serves everything else, and a `cuda_ipc` buffer
//! is answered `unavailable` with the reason — both with no driver at all and with a
//! driver that loads but reports no device (a stub `libcuda.so`). On a GPU host these
//! tests print why they skip; `shell-mio/scripts/gpu-check.sh` is the check there.
//!
//! With a device: a stand-in driver (`tests/fixtures/libcuda_standin.c`, built here with
//! `cc` and put on `LD_LIBRARY_PATH` of the server, the workers and `kvwarden gpu`)
//! whose "device memory" is memfd-backed and whose IPC handles name the exporter's pid
//! and memfd, so the server's real CUDA code — open, window check, copies, close on free
//! — runs in every CI run, and "device memory back" is measured across processes
//! (`kvwarden gpu info` through the same driver). Each test names its failure-mode row
//! (`docs/failure-modes.md`). These run on GPU hosts too: `LD_LIBRARY_PATH` wins over
//! the installed driver.

use kvwarden_tests::*;
use rmpv::Value;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn cuda_buffer() -> Value {
    Value::Map(vec![
        ("kind".into(), "cuda_ipc".into()),
        ("device".into(), 0u64.into()),
        ("handle".into(), Value::Binary(vec![7u8; 64])),
        ("offset".into(), 0u64.into()),
        ("nbytes".into(), (1u64 << 20).into()),
    ])
}

fn register_cuda(server: &Server, instance: u64) -> kvwarden_core::protocol::Reply {
    let mut client = RawClient::connect_attached(&server.socket, instance);
    client
        .request(
            "register_kv_cache",
            vec![
                instance.into(),
                Value::Array(vec![cuda_buffer()]),
                "m".into(),
                1u64.into(),
            ],
        )
        .expect("reply")
}

fn host_has_libcuda() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu/libcuda.so",
        "/usr/lib64/libcuda.so",
        "/usr/lib/libcuda.so",
    ]
    .iter()
    .any(|p| Path::new(p).exists())
        || std::env::var_os("LD_LIBRARY_PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|dir| dir.join("libcuda.so").exists())
        })
}

/// Asserts the server answered `unavailable` naming `reason`, still serves pings, and
/// shows the reason in its status.
fn assert_unavailable_and_serving(server: &Server, reason: &str) {
    let reply = register_cuda(server, 4242);
    let error = reply
        .result
        .expect_err("a cuda_ipc buffer cannot be registered here");
    assert_eq!(error.code.as_str(), "unavailable", "{}", error.message);
    assert!(error.message.contains("cuda_ipc"), "{}", error.message);
    assert!(error.message.contains(reason), "{}", error.message);
    let status = server.status();
    assert_eq!(status["gpu"]["available"], false, "{status}");
    assert!(
        status["gpu"]["reason"]
            .as_str()
            .unwrap_or("")
            .contains(reason),
        "{status}"
    );
    assert!(
        find_instance(&status, 4242).is_none(),
        "nothing is held for the refused instance"
    );
    // Everything else is served: a memfd worker registers and pings.
    let mut worker = Worker::unix(server, &[]);
    worker.wait_line("registered", |l| l == "registered outcome=created");
}

#[test]
fn no_gpu_cuda_ipc_register_is_unavailable_naming_the_missing_driver() {
    if host_has_libcuda() {
        println!("SKIPPED: this host has libcuda; gpu-check.sh covers GPU hosts");
        return;
    }
    let dir = TempDir::new("cuda-nodriver");
    let server = Server::start(&dir, &[]);
    assert_unavailable_and_serving(&server, "libcuda");
}

#[test]
fn stub_driver_without_devices_is_unavailable_naming_the_driver_error() {
    if host_has_libcuda() {
        println!("SKIPPED: this host has a real libcuda");
        return;
    }
    let dir = TempDir::new("cuda-stub");
    let stub_dir = dir.path().join("stub");
    std::fs::create_dir_all(&stub_dir).expect("stub dir");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/libcuda_stub.c");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(stub_dir.join("libcuda.so"))
        .arg(&source)
        .status();
    match built {
        Ok(status) if status.success() => {}
        other => {
            println!("SKIPPED: no C compiler to build the stub libcuda ({other:?})");
            return;
        }
    }
    let library_path = stub_dir.display().to_string();
    let server = Server::start_with_env(&dir, &[], &[("LD_LIBRARY_PATH", &library_path)]);
    assert_unavailable_and_serving(&server, "cuInit failed");
    assert!(
        server.status()["gpu"]["reason"]
            .as_str()
            .unwrap_or("")
            .contains("CUDA_ERROR_NO_DEVICE")
    );
}

#[test]
fn cuda_worker_without_gpu_exits_with_the_reason() {
    if host_has_libcuda() {
        println!("SKIPPED: this host has libcuda");
        return;
    }
    let dir = TempDir::new("cuda-worker");
    let server = Server::start(&dir, &[]);
    let output = Command::new(kvwarden_bin())
        .args(["worker", "--cuda-bytes", "1M", "--socket"])
        .arg(&server.socket)
        .output()
        .expect("run kvwarden worker");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--cuda-bytes needs a GPU") && stderr.contains("libcuda"),
        "{stderr}"
    );
    let gpu = Command::new(kvwarden_bin())
        .args(["gpu", "info"])
        .output()
        .expect("gpu info");
    assert_eq!(gpu.status.code(), Some(3), "no GPU: exit 3");
}

// ---------------------------------------------------------------------------------------
// The stand-in driver with one device.
// ---------------------------------------------------------------------------------------

/// The worker's stand-in "device memory": its memfd, opened through /proc (as the
/// stand-in's cuIpcOpenMemHandle does), and the fd number the handle names.
fn device_memory_of(pid: u32) -> (File, i32) {
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the worker's fds") {
        let path = entry.expect("an fd").path();
        let target = std::fs::read_link(&path).unwrap_or_default();
        if target
            .to_string_lossy()
            .contains("memfd:kvwarden-cuda-standin")
        {
            let fd = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse().ok())
                .expect("an fd number");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect("opening the worker's device memory");
            return (file, fd);
        }
    }
    panic!("process {pid} holds no stand-in device memory");
}

/// The allocation number of `pid`'s allocation, from the stand-in's accounting files
/// (`alloc-<device>-<pid>-<n>-<bytes>`).
fn allocation_number(standin: &StandIn, pid: u32) -> u64 {
    let prefix = format!("alloc-0-{pid}-");
    std::fs::read_dir(&standin.state_dir)
        .expect("the stand-in's state dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find_map(|name| name.strip_prefix(&prefix)?.split('-').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no allocation of process {pid}"))
}

/// A stand-in IPC handle, as its cuIpcGetMemHandle lays it out: magic, pid, fd, size,
/// allocation number, device.
fn standin_handle(pid: u32, fd: i32, size: u64, number: u64, device: i32) -> Vec<u8> {
    let mut handle = b"KVWSTDIN".to_vec();
    handle.extend_from_slice(&pid.to_le_bytes());
    handle.extend_from_slice(&fd.to_le_bytes());
    handle.extend_from_slice(&size.to_le_bytes());
    handle.extend_from_slice(&number.to_le_bytes());
    handle.extend_from_slice(&device.to_le_bytes());
    handle.resize(64, 0);
    handle
}

fn cuda_spec(device: u64, handle: Vec<u8>, offset: u64, nbytes: u64) -> Value {
    Value::Map(vec![
        ("kind".into(), "cuda_ipc".into()),
        ("device".into(), device.into()),
        ("handle".into(), Value::Binary(handle)),
        ("offset".into(), offset.into()),
        ("nbytes".into(), nbytes.into()),
    ])
}

fn register(raw: &mut RawClient, instance: u64, spec: Value) -> kvwarden_core::protocol::Reply {
    raw.request(
        "register_kv_cache",
        vec![
            instance.into(),
            Value::Array(vec![spec]),
            "m".into(),
            1u64.into(),
        ],
    )
    .expect("a reply to register_kv_cache")
}

/// No row of its own (the data path) and row 18: a worker's device memory, registered
/// over CUDA IPC, is copied into L1 by `store` and back by `retrieve` byte for byte
/// (the server's cuMemcpyDtoH/HtoD on its IPC mapping); a clean shutdown unregisters,
/// the mapping is closed exactly once, and the device has all its memory back.
#[test]
fn row_18_cuda_worker_stores_and_retrieves_bytes_intact_and_a_clean_exit_closes_the_mapping() {
    let dir = TempDir::new("cuda-standin-data");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let status = server.status();
    assert_eq!(status["gpu"]["available"], true, "{status}");
    assert_eq!(status["gpu"]["devices"], 1, "{status}");
    assert!(
        server.log().contains("L1 pool page-locked"),
        "{}",
        server.log()
    );

    let instance = 3101;
    let mut worker = cuda_worker(&server, &standin, "1M", Some(instance));
    assert_eq!(standin.used_bytes(), 1 << 20, "the worker's allocation");
    let pid = worker.child.id();
    let (device, _) = device_memory_of(pid);
    let mut raw = RawClient::connect_attached(&server.socket, instance);

    assert_device_round_trip(&mut raw, instance, &device, b"k1", 4096, 7);
    assert_store_past_the_end_refused(&mut raw, instance, 1 << 20);
    drop(raw);
    assert_clean_exit_gives_the_memory_back(&mut worker, &server, &standin, instance);
}

/// Row 24 (bad input) for `cuda_ipc` buffers: a handle that is not one, a window past
/// the allocation's end (cuMemGetAddressRange), a device this host does not have and the
/// handle of an exporter that has exited are `bad_args` naming the driver's error or the
/// values, and hold nothing; a window inside the allocation at an offset maps exactly
/// those bytes.
#[test]
fn row_24_cuda_ipc_register_refuses_bad_handles_windows_and_devices_with_the_driver_error() {
    let dir = TempDir::new("cuda-standin-args");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let worker = cuda_worker(&server, &standin, "1M", None);
    let pid = worker.child.id();
    let (device, fd) = device_memory_of(pid);
    let number = allocation_number(&standin, pid);
    let handle = standin_handle(pid, fd, 1 << 20, number, 0);

    let bad_args = |raw: &mut RawClient, instance: u64, spec: Value, names: &[&str]| {
        let reply = register(raw, instance, spec);
        let error = reply.result.expect_err("refused");
        assert_eq!(error.code.as_str(), "bad_args", "{}", error.message);
        for name in names {
            assert!(error.message.contains(name), "{name}: {}", error.message);
        }
        assert!(server.instance(instance).is_none(), "nothing held");
    };
    let mut raw = RawClient::connect(&server.socket).expect("connect");
    for instance in 3201..=3206 {
        raw.attach(instance);
    }
    bad_args(
        &mut raw,
        3201,
        cuda_spec(0, vec![7u8; 64], 0, 4096),
        &["cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_VALUE"],
    );
    bad_args(
        &mut raw,
        3202,
        cuda_spec(0, handle.clone(), 512 << 10, 1 << 20),
        &["outside", "offset 524288"],
    );
    bad_args(
        &mut raw,
        3203,
        cuda_spec(3, handle.clone(), 0, 4096),
        &["device 3", "1 CUDA device"],
    );
    // The handle of a process that has exited: the allocation went with it.
    let mut exited = Command::new("true").spawn().expect("spawn true");
    let gone = exited.id();
    exited.wait().expect("wait");
    bad_args(
        &mut raw,
        3204,
        cuda_spec(0, standin_handle(gone, fd, 1 << 20, number, 0), 0, 4096),
        &["CUDA_ERROR_INVALID_HANDLE"],
    );
    // A window at an offset: [256K, 256K + 64K) of the worker's allocation.
    let reply = register(&mut raw, 3205, cuda_spec(0, handle, 256 << 10, 64 << 10));
    reply.result.expect("a window inside the allocation");
    let written = pattern(64 << 10, 99);
    device
        .write_all_at(&written, 256 << 10)
        .expect("writing device memory");
    assert_eq!(
        transfer(&mut raw, "store", 3205, b"w", 0, 64 << 10),
        Value::Boolean(true)
    );
    device
        .write_all_at(&vec![0u8; 64 << 10], 256 << 10)
        .expect("clearing device memory");
    assert_eq!(
        transfer(&mut raw, "retrieve", 3205, b"w", 0, 64 << 10),
        Value::from(64u64 << 10)
    );
    let mut back = vec![0u8; 64 << 10];
    device
        .read_exact_at(&mut back, 256 << 10)
        .expect("reading device memory");
    assert!(
        back == written,
        "the window maps offset 256 KiB of the allocation"
    );
    assert!(!server.log().contains(CLOSE_FAILED), "{}", server.log());
}

/// Row 1 with device memory: a worker holding 64 MiB over CUDA IPC is SIGKILLed; the
/// server's mapping alone would keep the memory allocated (the exporter is gone), and
/// the process-exit proof closes it within milliseconds: the device has it all back.
#[test]
fn row_1_sigkilled_cuda_worker_mapping_closed_on_exit_and_device_memory_back() {
    let dir = TempDir::new("cuda-standin-row1");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let worker = cuda_worker(&server, &standin, "64M", None);
    let instance = worker.instance_id;
    assert_eq!(standin.used_bytes(), 64 << 20);
    worker.signal(rustix::process::Signal::KILL);
    drop(worker);
    let status = server.wait_status("the worker freed on exit", |s| {
        find_instance(s, instance).is_none()
    });
    assert_eq!(freed(&status, "process_exited"), 1, "{status}");
    standin.wait_used("the dead worker's device memory back", 0);
    assert!(!server.log().contains(CLOSE_FAILED), "{}", server.log());
}

/// Row 1, eight at once: eight CUDA workers (8 MiB each) SIGKILLed together are all
/// freed on their exits, each mapping closed once, all 64 MiB back.
#[test]
fn row_1_eight_cuda_workers_sigkilled_at_once_all_mappings_closed() {
    let dir = TempDir::new("cuda-standin-eight");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let workers: Vec<Worker> = (0..8)
        .map(|_| cuda_worker(&server, &standin, "8M", None))
        .collect();
    assert_eq!(standin.used_bytes(), 64 << 20);
    let ids: Vec<u64> = workers.iter().map(|w| w.instance_id).collect();
    for worker in &workers {
        worker.signal(rustix::process::Signal::KILL);
    }
    drop(workers);
    let status = server.wait_status("all eight freed", |s| {
        ids.iter().all(|&id| find_instance(s, id).is_none())
    });
    assert_eq!(freed(&status, "process_exited"), 8, "{status}");
    standin.wait_used("all eight workers' device memory back", 0);
    assert!(!server.log().contains(CLOSE_FAILED), "{}", server.log());
}

/// Row 20 with the driver: cuIpcCloseMemHandle never returns (the stand-in's
/// `KVWARDEN_CUDA_STANDIN_HANG_CLOSE`). The SIGKILLed worker's free hangs in it; the
/// watchdog reports it (`kvwarden_frees_hung_total 1`, a log line); pings, registers and
/// other frees go on; and the dead exporter's memory stays allocated, held by the
/// mapping that could not be closed (what the real driver does).
#[test]
fn row_20_hung_cuda_ipc_close_is_reported_by_the_watchdog_and_pings_go_on() {
    let dir = TempDir::new("cuda-standin-row20");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let mut env = standin.env();
    env.push(("KVWARDEN_CUDA_STANDIN_HANG_CLOSE", "1"));
    let server = Server::start_with_env(&dir, &["--free-watchdog-seconds", "0.5"], &env);
    let worker = cuda_worker(&server, &standin, "16M", None);
    let instance = worker.instance_id;
    worker.signal(rustix::process::Signal::KILL);
    drop(worker);
    let status = server.wait_status("the hung free reported", |s| {
        s["contexts"]["frees_hung_total"].as_u64() == Some(1)
    });
    assert!(find_instance(&status, instance).is_none(), "{status}");
    assert_eq!(status["contexts"]["frees_in_flight"], 1, "{status}");
    let metrics = server.http_get("/metrics").1;
    assert!(metrics.contains("kvwarden_frees_hung_total 1"), "{metrics}");
    wait_for("the watchdog's log line", PATIENCE, || {
        server
            .log()
            .contains("still running after the watchdog period")
            .then_some(())
    });
    // The exporter is dead; the mapping the server could not close still holds its memory.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(standin.used_bytes(), 16 << 20);
    // The loop still turns: pings, and a memfd worker registers and is freed.
    let mut raw = RawClient::connect(&server.socket).expect("connect");
    for _ in 0..20 {
        let reply = raw.request("ping", vec![Value::Nil]).expect("a reply");
        assert_eq!(reply.result.expect("ping"), Value::Boolean(true));
    }
    let memfd_worker = Worker::unix(&server, &[]);
    let other = memfd_worker.instance_id;
    memfd_worker.signal(rustix::process::Signal::KILL);
    drop(memfd_worker);
    // Its free finishes while the hung one still hangs.
    let status = server.wait_status("the other worker's free finished", |s| {
        find_instance(s, other).is_none() && s["contexts"]["frees_in_flight"] == 1
    });
    assert_eq!(freed(&status, "process_exited"), 2, "{status}");
    assert_eq!(status["contexts"]["frees_hung_total"], 1, "{status}");
    assert!(server.http_get("/healthz").1.contains("ok"));
}

/// Rows 1 and 20's checks on a GPU host, `kvwarden gpu reclaim` (G1, G3 with
/// `--workers`, and G1's control) and `kvwarden gpu copy` (G2), run against the stand-in
/// so that they cannot rot between GPU runs: the SIGKILLed workers' memory comes back
/// every round (and stays held where the server cannot know), and every chunk stored
/// through the server is retrieved byte for byte. (Their figures mean nothing here: the
/// "device" is host memory.)
#[test]
fn row_1_gpu_reclaim_and_gpu_copy_run_against_the_standin() {
    let dir = TempDir::new("cuda-standin-gpu-tools");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let reclaim = standin
        .command(&["gpu", "reclaim", "--bytes", "128M", "--rounds", "2"])
        .output()
        .expect("gpu reclaim");
    let stdout = String::from_utf8_lossy(&reclaim.stdout);
    let stderr = String::from_utf8_lossy(&reclaim.stderr);
    assert!(reclaim.status.success(), "{stdout}\n{stderr}");
    for round in [1, 2] {
        assert!(
            stdout.contains(&format!("round {round}: exited after"))
                && stdout.contains("memory back after"),
            "{stdout}"
        );
    }
    assert!(!stdout.contains("NOT back"), "{stdout}");
    assert!(
        stdout.contains("G1 reclaim_after_sigkill_ms_max"),
        "{stdout}"
    );
    standin.wait_used("nothing left after gpu reclaim", 0);

    // G3's form: three workers SIGKILLed together, every one's memory back each round.
    let ranks = standin
        .command(&[
            "gpu",
            "reclaim",
            "--bytes",
            "64M",
            "--workers",
            "3",
            "--rounds",
            "2",
        ])
        .output()
        .expect("gpu reclaim --workers 3");
    let stdout = String::from_utf8_lossy(&ranks.stdout);
    let stderr = String::from_utf8_lossy(&ranks.stderr);
    assert!(ranks.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("round 2: 3 worker(s) registered") && !stdout.contains("NOT back"),
        "{stdout}"
    );
    assert!(
        stdout.contains("G3 reclaim_all_after_last_exit_ms_max"),
        "{stdout}"
    );
    standin.wait_used("nothing left after gpu reclaim --workers 3", 0);

    // The other direction, G1's control: a server that cannot know the worker died
    // (reaping off, the worker on TCP, no exit proof) keeps its mapping, so the memory
    // stays held until that server stops.
    let control = standin
        .command(&[
            "gpu",
            "reclaim",
            "--bytes",
            "64M",
            "--control",
            "--wait-seconds",
            "1",
        ])
        .output()
        .expect("gpu reclaim --control");
    let stdout = String::from_utf8_lossy(&control.stdout);
    let stderr = String::from_utf8_lossy(&control.stderr);
    assert!(control.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("round 1: memory NOT back")
            && stdout.contains("G1 control_memory_held_after_sigkill yes"),
        "{stdout}"
    );
    standin.wait_used("the control's memory back once its server stopped", 0);

    let copy = standin
        .command(&[
            "gpu",
            "copy",
            "--clients",
            "2",
            "--chunk-bytes",
            "1M",
            "--total-bytes",
            "16M",
        ])
        .output()
        .expect("gpu copy");
    let stdout = String::from_utf8_lossy(&copy.stdout);
    let stderr = String::from_utf8_lossy(&copy.stderr);
    assert!(copy.status.success(), "{stdout}\n{stderr}");
    for line in [
        "G2 store_ratio",
        "G2 retrieve_ratio",
        "G2 baseline_dtoh_pinned",
        "G2 retrieved_bytes_identical yes",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    standin.wait_used("nothing left after gpu copy", 0);
}

/// Issue 30's prepared GPU job, `shell-mio/scripts/gpu-all.sh`, run scaled down on the
/// stand-in so that the one script a lent GPU host runs cannot rot: every G1–G3 figure
/// line is printed and gpu-check passes (the kv check is skipped: no torch with CUDA
/// here, exit 3). Then the other direction: with a driver that has no device, the job
/// fails loudly (exit 1, `gpu-check FAILED`).
#[test]
fn row_1_the_prepared_gpu_job_prints_g1_to_g3_and_fails_loudly_without_a_device() {
    let dir = TempDir::new("cuda-standin-gpu-all");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shell-mio/scripts/gpu-all.sh");
    let run = |devices: &str, log: &str| {
        Command::new("bash")
            .arg(&script)
            .envs(standin.env())
            .env(
                "KVWARDEN_CUDA_STANDIN_TOTAL_BYTES",
                (2u64 << 30).to_string(),
            )
            .env("KVWARDEN_CUDA_STANDIN_DEVICES", devices)
            .env("KVWARDEN_BIN", kvwarden_bin())
            .env("GPU_CHECK_BYTES", "64M")
            .env("GPU_CHECK_RANKS", "3")
            .env("GPU_CHECK_COPY_BYTES", "32M")
            .env("GPU_CHECK_SMALL_COPY_BYTES", "2M")
            .env("GPU_ALL_LOG", dir.path().join(log))
            // No torch here whatever python3 is: the kv check says so and is skipped.
            .env("PYTHON", dir.path().join("no-python"))
            .output()
            .expect("gpu-all.sh")
    };
    let passed = run("1", "pass.log");
    let stdout = String::from_utf8_lossy(&passed.stdout);
    let stderr = String::from_utf8_lossy(&passed.stderr);
    assert_eq!(passed.status.code(), Some(3), "{stdout}\n{stderr}");
    for line in [
        "G1 reclaim_after_sigkill_ms_max ",
        "G1 control_memory_held_after_sigkill yes",
        "G3 reclaim_all_after_last_exit_ms_max ",
        "G2 store_ratio ",
        "G2 retrieve_ratio ",
        "G2 retrieved_bytes_identical yes",
        "G1 vmm_reclaim_after_sigkill_ms_max ",
        "G2 vmm_store_ratio ",
        "gpu-check passed",
        "gpu-kv-check SKIPPED",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}\n{stderr}");
    }
    standin.wait_used("nothing left after the prepared job", 0);

    let failed = run("0", "fail.log");
    let stdout = String::from_utf8_lossy(&failed.stdout);
    assert_eq!(failed.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("gpu-check FAILED"), "{stdout}");
    assert!(stdout.contains("no G1-G3 figures were printed"), "{stdout}");
}
