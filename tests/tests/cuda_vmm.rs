//! CUDA virtual-memory allocations (`cuMemCreate`: PyTorch's expandable segments,
//! vLLM's sleep-mode pool) registered as `cuda_vmm` buffers: the worker sends the POSIX
//! fd of `cuMemExportToShareableHandle` with the frame, the server imports and maps it.
//! Run against the stand-in driver (`tests/fixtures/libcuda_standin.c`), whose VMM
//! allocation is a memfd named after its accounting file, so the server's real import,
//! map, copies and unmap run here and "device memory back" is measured from another
//! process. Each test names its failure-mode row (`docs/failure-modes.md`).

use kvwarden_tests::*;
use rmpv::Value;
use rustix::fd::AsFd;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The stand-in's allocation granularity: a 1 MiB request is a 2 MiB allocation.
const GRANULARITY: u64 = 2 << 20;

fn vmm_worker(server: &Server, standin: &StandIn, bytes: &str, instance: Option<u64>) -> Worker {
    cuda_worker_with(
        server,
        standin,
        bytes,
        instance,
        &["--cuda-allocator", "vmm"],
    )
}

/// The worker's VMM allocation, opened through /proc (the same memfd the driver
/// exported, and what the stand-in's import recognises by name).
fn vmm_memory_of(pid: u32) -> File {
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the worker's fds") {
        let path = entry.expect("an fd").path();
        let target = std::fs::read_link(&path).unwrap_or_default();
        if target
            .to_string_lossy()
            .contains("memfd:kvwarden-standin-vmm:")
        {
            return std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect("opening the worker's device memory");
        }
    }
    panic!("process {pid} holds no stand-in VMM allocation");
}

fn vmm_spec(fd_index: u64, allocation_bytes: u64, offset: u64, nbytes: u64) -> Value {
    Value::Map(vec![
        ("kind".into(), "cuda_vmm".into()),
        ("fd_index".into(), fd_index.into()),
        ("device".into(), 0u64.into()),
        ("allocation_bytes".into(), allocation_bytes.into()),
        ("offset".into(), offset.into()),
        ("nbytes".into(), nbytes.into()),
    ])
}

fn register_with_fd(
    raw: &mut RawClient,
    instance: u64,
    spec: Value,
    fd: Option<&dyn AsFd>,
) -> kvwarden_core::protocol::Reply {
    let fds: Vec<_> = fd.map(|f| f.as_fd()).into_iter().collect();
    raw.request_with_fds(
        "register_kv_cache",
        vec![
            instance.into(),
            Value::Array(vec![spec]),
            "m".into(),
            1u64.into(),
        ],
        &fds,
    )
    .expect("a reply to register_kv_cache")
}

/// Row 18 with a VMM allocation: `kvwarden worker --cuda-allocator vmm` registers its
/// cuMemCreate memory as a cuda_vmm fd; `store` copies from the server's own mapping of
/// it into L1 and `retrieve` back, byte for byte, at the window asked and nowhere else;
/// a clean exit unregisters, the server unmaps, and the device has all its memory back.
#[test]
fn row_18_vmm_worker_stores_and_retrieves_bytes_intact_and_a_clean_exit_unmaps() {
    let dir = TempDir::new("cuda-vmm-data");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let instance = 3401;
    let mut worker = vmm_worker(&server, &standin, "1M", Some(instance));
    assert_eq!(standin.used_bytes(), GRANULARITY, "one granule");
    let device = vmm_memory_of(worker.child.id());
    let mut raw = RawClient::connect_attached(&server.socket, instance);

    assert_device_round_trip(&mut raw, instance, &device, b"v1", 8192, 11);
    // The buffer is the 1 MiB the worker registered, not the whole 2 MiB allocation.
    assert_store_past_the_end_refused(&mut raw, instance, 1 << 20);
    drop(raw);
    assert_clean_exit_gives_the_memory_back(&mut worker, &server, &standin, instance);
}

/// Row 1 with a VMM allocation: the server's mapping alone keeps a SIGKILLed exporter's
/// cuMemCreate memory allocated; the exit proof frees the context, the server unmaps,
/// and the device has all 64 MiB back. Before the kill, the memory is still there while
/// the worker lives (not freed early).
#[test]
fn row_1_sigkilled_vmm_worker_unmapped_on_exit_and_device_memory_back() {
    let dir = TempDir::new("cuda-vmm-row1");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let worker = vmm_worker(&server, &standin, "64M", None);
    let instance = worker.instance_id;
    assert!(server.instance(instance).is_some(), "registered and held");
    assert_eq!(standin.used_bytes(), 64 << 20);
    worker.signal(rustix::process::Signal::KILL);
    drop(worker);
    let status = server.wait_status("the worker freed on exit", |s| {
        find_instance(s, instance).is_none()
    });
    assert_eq!(freed(&status, "process_exited"), 1, "{status}");
    standin.wait_used("the dead worker's device memory back", 0);
}

/// Row 75 (and row 24, bad input) for `cuda_vmm` buffers. The control first: the worker's own
/// allocation, sent by a raw client as its fd, registers and maps exactly the window
/// asked. Then each lie is `bad_args` naming it and holds nothing: a window past the
/// allocation, an allocation size larger than the allocation (the driver's cuMemMap
/// refuses), a size the device could not have made (granularity), an fd that is a pipe
/// (refused before the driver sees it), a pidfd and a plain memfd (kinds the driver
/// is asked about; its import refuses them), and an fd_index naming no fd.
#[test]
fn row_75_cuda_vmm_register_refuses_lying_sizes_and_fds_after_its_control() {
    let dir = TempDir::new("cuda-vmm-args");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let server = Server::start_with_env(&dir, &[], &standin.env());
    let worker = vmm_worker(&server, &standin, "2M", None);
    let device = vmm_memory_of(worker.child.id());
    let mut raw = RawClient::connect(&server.socket).expect("connect");
    for instance in 3501..=3509 {
        raw.attach(instance);
    }

    // The control: [256K, 256K + 64K) of the worker's allocation, by its fd.
    let reply = register_with_fd(
        &mut raw,
        3501,
        vmm_spec(0, GRANULARITY, 256 << 10, 64 << 10),
        Some(&device),
    );
    reply.result.expect("the control registers");
    let written = pattern(64 << 10, 42);
    device
        .write_all_at(&written, 256 << 10)
        .expect("writing device memory");
    assert_eq!(
        transfer(&mut raw, "store", 3501, b"w", 0, 64 << 10),
        Value::Boolean(true)
    );
    device
        .write_all_at(&vec![0u8; 64 << 10], 256 << 10)
        .expect("clearing device memory");
    assert_eq!(
        transfer(&mut raw, "retrieve", 3501, b"w", 0, 64 << 10),
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

    let refused =
        |raw: &mut RawClient, instance: u64, spec: Value, fd: Option<&dyn AsFd>, names: &[&str]| {
            let reply = register_with_fd(raw, instance, spec, fd);
            let error = reply.result.expect_err("refused");
            assert_eq!(error.code.as_str(), "bad_args", "{}", error.message);
            for name in names {
                assert!(error.message.contains(name), "{name}: {}", error.message);
            }
            assert!(server.instance(instance).is_none(), "nothing held");
        };
    refused(
        &mut raw,
        3502,
        vmm_spec(0, GRANULARITY, GRANULARITY - 4096, 64 << 10),
        Some(&device),
        &["outside", "offset 2093056"],
    );
    refused(
        &mut raw,
        3503,
        vmm_spec(0, 2 * GRANULARITY, 0, 4096),
        Some(&device),
        &[
            "cuMemMap",
            "CUDA_ERROR_INVALID_VALUE",
            "allocation_bytes 4194304",
        ],
    );
    refused(
        &mut raw,
        3504,
        vmm_spec(0, GRANULARITY + 4096, 0, 4096),
        Some(&device),
        &["granularity", "2097152", "allocation_bytes 2101248"],
    );
    let (pipe_read, _pipe_write) = rustix::pipe::pipe().expect("a pipe");
    refused(
        &mut raw,
        3505,
        vmm_spec(0, GRANULARITY, 0, 4096),
        Some(&pipe_read),
        &["its fd is a pipe", "cuMemExportToShareableHandle"],
    );
    // An anonymous inode (the kind a driver may export) goes to the driver, which
    // refuses what it did not export.
    let pidfd = rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("a pidfd");
    refused(
        &mut raw,
        3508,
        vmm_spec(0, GRANULARITY, 0, 4096),
        Some(&pidfd),
        &["cuMemImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE"],
    );
    let plain = kvwarden::memfd::create("not-a-cuda-export", GRANULARITY).expect("a memfd");
    refused(
        &mut raw,
        3506,
        vmm_spec(0, GRANULARITY, 0, 4096),
        Some(&plain),
        &["cuMemImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE"],
    );
    refused(
        &mut raw,
        3507,
        vmm_spec(0, GRANULARITY, 0, 4096),
        None,
        &["fd_index 0 names an fd this frame did not carry"],
    );
    // Still serving, and the control's mapping still works.
    assert_eq!(
        transfer(&mut raw, "retrieve", 3501, b"w", 0, 64 << 10),
        Value::from(64u64 << 10)
    );
    drop(worker);
}

/// Row 1 with VMM memory, as the GPU job measures it: `kvwarden gpu reclaim
/// --cuda-allocator vmm` SIGKILLs a worker holding cuMemCreate memory each round and sees
/// it all back (`G1 vmm_reclaim_after_sigkill_ms_max`); `gpu copy --cuda-allocator vmm`
/// moves every chunk through L1 byte for byte (`G2 vmm_store_ratio`). Its control runs
/// over TCP, which carries no fd: asked for with VMM memory it is refused, naming why.
#[test]
fn row_1_gpu_reclaim_and_gpu_copy_run_with_vmm_memory_against_the_standin() {
    let dir = TempDir::new("cuda-vmm-gpu-tools");
    let Some(standin) = StandIn::build(&dir) else {
        return;
    };
    let run = |args: &[&str]| {
        let output = standin.command(args).output().expect("kvwarden gpu");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status, stdout, stderr)
    };
    let vmm = ["--cuda-allocator", "vmm"];
    let (status, stdout, stderr) = run(&[
        &["gpu", "reclaim", "--bytes", "64M", "--rounds", "2"][..],
        &vmm,
    ]
    .concat());
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("round 2: exited after") && !stdout.contains("NOT back"),
        "{stdout}"
    );
    assert!(
        stdout.contains("G1 vmm_reclaim_after_sigkill_ms_max"),
        "{stdout}"
    );
    standin.wait_used("nothing left after gpu reclaim with VMM memory", 0);

    let copy = [
        "gpu",
        "copy",
        "--clients",
        "2",
        "--chunk-bytes",
        "1M",
        "--total-bytes",
        "16M",
    ];
    let (status, stdout, stderr) = run(&[&copy[..], &vmm].concat());
    assert!(status.success(), "{stdout}\n{stderr}");
    for line in [
        "G2 vmm_store_ratio",
        "G2 vmm_retrieve_ratio",
        "G2 retrieved_bytes_identical yes",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    standin.wait_used("nothing left after gpu copy with VMM memory", 0);

    let (status, stdout, stderr) =
        run(&[&["gpu", "reclaim", "--bytes", "64M", "--control"][..], &vmm].concat());
    assert!(!status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("carries no fd"), "{stderr}");
}
