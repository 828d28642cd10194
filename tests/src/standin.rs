//! The stand-in libcuda (`tests/fixtures/libcuda_standin.c`): built with `cc` into a
//! test's directory and put on `LD_LIBRARY_PATH` of the server, the workers and
//! `kvwarden gpu`, so the server's real CUDA code runs on hosts without a GPU.

use crate::{
    PATIENCE, RawClient, Server, TempDir, Worker, instance_secret, kvwarden_bin, wait_for,
};
use rmpv::Value;
use std::path::Path;
use std::process::Command;

/// What the server logs when closing a worker's device mapping fails (a test that sees it
/// has a mapping left open).
pub const CLOSE_FAILED: &str = "closing a CUDA mapping failed";

/// Device memory the stand-in reports (`KVWARDEN_CUDA_STANDIN_TOTAL_BYTES`).
pub const STANDIN_TOTAL_BYTES: u64 = 1 << 30;

/// The stand-in libcuda built into a test's directory, with its accounting directory
/// (every process of one test shares it, so one test's device memory is its own).
pub struct StandIn {
    /// The directory holding `libcuda.so`.
    pub library_path: String,
    /// The accounting directory.
    pub state_dir: String,
    total: String,
}

impl StandIn {
    /// Builds `tests/fixtures/libcuda_standin.c` as `dir/standin/libcuda.so`; None (the
    /// test prints why and passes) when there is no C compiler.
    pub fn build(dir: &TempDir) -> Option<StandIn> {
        let lib_dir = dir.path().join("standin");
        let state_dir = dir.path().join("standin-state");
        std::fs::create_dir_all(&lib_dir).expect("stand-in dir");
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/libcuda_standin.c");
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(lib_dir.join("libcuda.so"))
            .arg(&source)
            .output();
        match built {
            Ok(output) if output.status.success() => {}
            Ok(output) if which_cc() => panic!(
                "the stand-in libcuda does not compile: {}",
                String::from_utf8_lossy(&output.stderr)
            ),
            other => {
                println!("SKIPPED: no C compiler to build the stand-in libcuda ({other:?})");
                return None;
            }
        }
        Some(StandIn {
            library_path: lib_dir.display().to_string(),
            state_dir: state_dir.display().to_string(),
            total: STANDIN_TOTAL_BYTES.to_string(),
        })
    }

    /// The environment that makes a process use the stand-in.
    pub fn env(&self) -> Vec<(&str, &str)> {
        vec![
            ("LD_LIBRARY_PATH", self.library_path.as_str()),
            ("KVWARDEN_CUDA_STANDIN_DIR", self.state_dir.as_str()),
            ("KVWARDEN_CUDA_STANDIN_TOTAL_BYTES", self.total.as_str()),
        ]
    }

    /// A `kvwarden` command (`gpu …`) run with the stand-in.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(kvwarden_bin());
        command.args(args).envs(self.env());
        command
    }

    /// Device 0's memory still allocated or mapped by any process, as the driver reports
    /// it to another process (`kvwarden gpu info`: cuMemGetInfo).
    pub fn used_bytes(&self) -> u64 {
        let output = self.command(&["gpu", "info"]).output().expect("gpu info");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "gpu info: {stdout} {output:?}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("device 0 "))
            .unwrap_or_else(|| panic!("no device 0 in {stdout}"));
        let field = |name: &str| -> u64 {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.iter().position(|w| *w == name).expect(name);
            words[at + 1].parse().expect("a number")
        };
        assert_eq!(field("total_bytes"), STANDIN_TOTAL_BYTES, "{line}");
        STANDIN_TOTAL_BYTES - field("free_bytes")
    }

    /// Waits until the device's used memory is `bytes`.
    pub fn wait_used(&self, what: &str, bytes: u64) {
        let mut last = 0;
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(what, PATIENCE, || {
                last = self.used_bytes();
                (last == bytes).then_some(())
            })
        }));
        if waited.is_err() {
            panic!("{what}: device memory in use stayed {last} bytes, expected {bytes}");
        }
    }
}

/// Whether a C compiler runs here.
pub fn which_cc() -> bool {
    Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `kvwarden worker --cuda-bytes BYTES` on the server's socket, with the stand-in, no
/// traffic, and `instance` with [`instance_secret`] when given (so that a raw client of
/// the test can attach the same instance).
pub fn cuda_worker(
    server: &Server,
    standin: &StandIn,
    bytes: &str,
    instance: Option<u64>,
) -> Worker {
    cuda_worker_with(server, standin, bytes, instance, &[])
}

/// As [`cuda_worker`], with more flags (`--cuda-allocator vmm`).
pub fn cuda_worker_with(
    server: &Server,
    standin: &StandIn,
    bytes: &str,
    instance: Option<u64>,
    extra: &[&str],
) -> Worker {
    let socket = server.socket.display().to_string();
    let id = instance.map(|i| i.to_string());
    let secret: Option<String> = instance.map(|i| {
        instance_secret(i)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    });
    let mut args = vec![
        "--socket",
        socket.as_str(),
        "--heartbeat-interval-seconds",
        "0.2",
        "--cuda-bytes",
        bytes,
        "--traffic-every-ms",
        "0",
    ];
    args.extend(extra);
    let mut env = standin.env();
    if let (Some(id), Some(secret)) = (&id, &secret) {
        args.extend(["--instance-id", id.as_str()]);
        env.push(("KVWARDEN_WORKER_SECRET", secret.as_str()));
    }
    let mut worker = Worker::start_with_env(&args, &env);
    worker.wait_line("the device buffer", |l| {
        l.starts_with("cuda_buffer device=0")
    });
    worker
}

/// `store`/`retrieve [instance, key, 0, offset, nbytes]`: the raw result.
pub fn transfer(
    raw: &mut RawClient,
    op: &str,
    instance: u64,
    key: &[u8],
    offset: u64,
    n: u64,
) -> Value {
    raw.request(
        op,
        vec![
            instance.into(),
            Value::Binary(key.to_vec()),
            0u64.into(),
            offset.into(),
            n.into(),
        ],
    )
    .expect("a reply")
    .result
    .unwrap_or_else(|e| panic!("{op} refused: {e}"))
}

/// Distinct bytes for a window.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A registered device buffer's bytes through L1 and back (row 18): `chunk` distinct
/// bytes written at `store_at` of the worker's device memory (`device`, the worker's
/// allocation as a file) are stored under `key` (buffer 0 of `instance`), then retrieved
/// into `[512 KiB, 512 KiB + chunk)`, which still holds the worker's fill (0x5a): that
/// window gets exactly the stored bytes, and the bytes either side of it stay untouched.
pub fn assert_device_round_trip(
    raw: &mut RawClient,
    instance: u64,
    device: &std::fs::File,
    key: &[u8],
    store_at: u64,
    seed: u8,
) {
    use std::os::unix::fs::FileExt;
    let chunk = 64 << 10; // one L1 slot
    let into = 512 << 10;
    let written = pattern(chunk, seed);
    device
        .write_all_at(&written, store_at)
        .expect("writing device memory");
    assert_eq!(
        transfer(raw, "store", instance, key, store_at, chunk as u64),
        Value::Boolean(true)
    );
    let mut before = vec![0u8; chunk + 2];
    device
        .read_exact_at(&mut before, into - 1)
        .expect("reading device memory");
    assert!(before.iter().all(|&b| b == 0x5a), "the worker filled it");
    assert_eq!(
        transfer(raw, "retrieve", instance, key, into, chunk as u64),
        Value::from(chunk as u64)
    );
    let mut after = vec![0u8; chunk + 2];
    device
        .read_exact_at(&mut after, into - 1)
        .expect("reading device memory");
    assert_eq!(after[0], 0x5a, "the byte before the window is untouched");
    assert_eq!(
        after[chunk + 1],
        0x5a,
        "the byte after the window is untouched"
    );
    assert!(
        after[1..=chunk] == written[..],
        "retrieved bytes differ from stored ones"
    );
}

/// A store of a window that ends past a registered buffer of `len` bytes is refused
/// before any copy.
pub fn assert_store_past_the_end_refused(raw: &mut RawClient, instance: u64, len: u64) {
    let chunk = 64u64 << 10;
    let past = raw
        .request(
            "store",
            vec![
                instance.into(),
                Value::Binary(b"past".to_vec()),
                0u64.into(),
                (len - 4096).into(),
                chunk.into(),
            ],
        )
        .expect("a reply");
    assert!(past.result.is_err(), "{past:?}");
}

/// The CUDA worker stops cleanly on SIGTERM: it unregisters, the server frees its context
/// (closing its mapping), and the device has all its memory back.
pub fn assert_clean_exit_gives_the_memory_back(
    worker: &mut Worker,
    server: &Server,
    standin: &StandIn,
    instance: u64,
) {
    worker.signal(rustix::process::Signal::TERM);
    worker.wait_line("a clean shutdown", |l| l == "shutdown=clean");
    standin.wait_used("the device memory back after a clean exit", 0);
    let status = server.wait_status("the context freed", |s| {
        crate::find_instance(s, instance).is_none()
    });
    assert_eq!(crate::freed(&status, "unregistered"), 1, "{status}");
    assert!(!server.log().contains(CLOSE_FAILED), "{}", server.log());
}
