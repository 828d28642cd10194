//! CUDA IPC on a host without a GPU: the server starts and serves everything else, and a
//! `cuda_ipc` buffer is answered `unavailable` with the reason — both with no driver at
//! all and with a driver that loads but reports no device (a stub `libcuda.so`).
//! On a GPU host these tests print why they skip; `shell-mio/scripts/gpu-check.sh` is
//! the check there.

use kvwarden_tests::*;
use rmpv::Value;
use std::path::Path;
use std::process::Command;

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
