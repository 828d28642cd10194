//! F1: a victim's latency under each flood of issue 51 over the same victim without
//! it, in the same run (`docs/failure-modes.md` rows 67, 66 and 68):
//!
//! - **tcp**: a TCP worker's whole session (connect, `auth`, `hello` with its proof,
//!   `ping`, close) while another thread holds `--hold` tokenless TCP connections,
//!   reopening each one the server closes (`--max-connections 40`);
//! - **http**: `GET /healthz` while two threads each hold 60 HTTP connections that
//!   send nothing;
//! - **copy**: a 4 KiB `retrieve` while a process under uid 1001 keeps 8 connections'
//!   worth of `retrieve_batch`es of 1 MiB copies queued (2 × 1,024 items each); as root
//!   only (a tenant of another uid), else skipped and said so.
//!
//! Each prints p50 and p99 of `--probes` victim requests without and with the flood,
//! the ratio of the p50s, and how many victim requests failed.

use super::process::{ServerProcess, kvwarden_command};
use super::raw::{RawConnection, memfd_spec};
use super::stats::Samples;
use super::{BenchError, figure, progress};
use rmpv::Value;
use rustix::fd::AsFd;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Flags of `kvwarden bench floods`.
#[derive(Clone, Debug, clap::Args)]
pub struct FloodsArgs {
    /// Victim requests measured without, and again with, each flood.
    #[arg(long, default_value_t = 50, value_name = "N")]
    probes: usize,
    /// Tokenless TCP connections the TCP flood holds.
    #[arg(long, default_value_t = 30, value_name = "N")]
    hold: usize,
    /// Run as the copy flood's process against this socket (the benchmark starts it).
    #[arg(long, hide = true, value_name = "SOCKET")]
    flooder: Option<std::path::PathBuf>,
}

/// The uid the copy flood runs as.
const FLOODER_UID: u32 = 1001;
/// Bytes of one flood copy (a slot).
const MIB: u64 = 1 << 20;

/// Runs F1 and prints its figures.
pub fn run(args: &FloodsArgs) -> Result<(), BenchError> {
    if let Some(socket) = &args.flooder {
        return copy_flooder(socket);
    }
    if args.probes == 0 {
        return Err(BenchError::Failed(
            "invalid --probes 0: measure at least one victim request".into(),
        ));
    }
    super::print_machine();
    tcp_flood(args)?;
    http_flood(args)?;
    copy_flood(args)
}

/// Latencies of `probes` calls of `probe` (each Ok when the victim was served) and how
/// many failed, after a tenth as many (at least 3) not counted: a warm-up.
fn measure(probes: usize, mut probe: impl FnMut() -> bool) -> (Vec<Duration>, usize) {
    for _ in 0..(probes / 10).max(3) {
        probe();
    }
    let mut times = Vec::with_capacity(probes);
    let mut failed = 0;
    for _ in 0..probes {
        let start = Instant::now();
        if probe() {
            times.push(start.elapsed());
        } else {
            failed += 1;
        }
    }
    (times, failed)
}

/// Prints one flood's figures.
fn report(name: &str, what: &str, without: (Vec<Duration>, usize), with: (Vec<Duration>, usize)) {
    let ms = |times: &[Duration], q: f64| {
        let samples = Samples::from_durations(times);
        if samples.is_empty() {
            f64::NAN
        } else {
            samples.quantile_ms(q)
        }
    };
    let probes = without.0.len() + without.1;
    let (p50, p99) = (ms(&without.0, 0.5), ms(&without.0, 0.99));
    let (f50, f99) = (ms(&with.0, 0.5), ms(&with.0, 0.99));
    figure(
        "F1",
        &format!("{name}_flood_victim_p50_ratio"),
        format!("{:.2}", f50 / p50),
        "x",
        &format!(
            "{what}: p50 {f50:.2} ms under the flood / {p50:.2} ms without; p99 {f99:.2} / \
             {p99:.2} ms; failed {} of {probes} under it, {} without",
            with.1, without.1
        ),
    );
}

/// Keeps `held` connections to `connect` open until `stop`, reopening each one the
/// server closed.
fn hold_connections(
    held: usize,
    stop: Arc<AtomicBool>,
    connect: impl Fn() -> Option<TcpStream> + Send + 'static,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut open: Vec<TcpStream> = Vec::new();
        let mut opened = 0;
        while !stop.load(Ordering::Relaxed) {
            open.retain(|stream| {
                let mut byte = [0u8; 1];
                let _ = stream.set_nonblocking(true);
                !matches!((&*stream).read(&mut byte), Ok(0))
            });
            while open.len() < held {
                match connect() {
                    Some(stream) => {
                        open.push(stream);
                        opened += 1;
                    }
                    None => break,
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        opened
    })
}

fn tcp_flood(args: &FloodsArgs) -> Result<(), BenchError> {
    let server = ServerProcess::start(
        "bench-floods-tcp",
        &["--tcp", "127.0.0.1:0", "--max-connections", "40"].map(String::from),
        "warn",
    )?;
    let (Some(tcp), Some(token_file)) = (server.tcp, server.tcp_token_file.clone()) else {
        return Err(BenchError::Failed(
            "the server did not say its TCP address".into(),
        ));
    };
    let token = kvwarden_client::ClientConfig::read_tcp_token_file(&token_file)
        .map_err(|e| BenchError::Failed(format!("reading the TCP token: {e}")))?;
    let session = || {
        let mut config = kvwarden_client::ClientConfig::new(kvwarden_client::Endpoint::Tcp(tcp));
        config.tcp_token = Some(token.clone());
        let Ok(client) = kvwarden_client::Client::connect(config) else {
            return false;
        };
        let served = matches!(
            client.call("ping", vec![Value::Nil]),
            Ok(Value::Boolean(true))
        );
        let _ = client.shutdown();
        served
    };
    progress("tcp: victim sessions without the flood");
    let without = measure(args.probes, session);
    let stop = Arc::new(AtomicBool::new(false));
    let flood = hold_connections(args.hold, Arc::clone(&stop), move || {
        TcpStream::connect(tcp).ok()
    });
    std::thread::sleep(Duration::from_millis(200));
    progress(&format!(
        "tcp: the same with {} tokenless connections held",
        args.hold
    ));
    let with = measure(args.probes, session);
    stop.store(true, Ordering::Relaxed);
    let opened = flood.join().unwrap_or(0);
    report(
        "tcp",
        &format!(
            "a TCP worker's session (auth, hello, ping) while {} tokenless connections are \
             held against --max-connections 40 ({opened} opened)",
            args.hold
        ),
        without,
        with,
    );
    Ok(())
}

/// `GET /healthz` on a new connection: whether it answered 200.
fn healthz(address: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(address) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    answer.starts_with(b"HTTP/1.1 200")
}

fn http_flood(args: &FloodsArgs) -> Result<(), BenchError> {
    let server = ServerProcess::start(
        "bench-floods-http",
        &["--http", "127.0.0.1:0"].map(String::from),
        "warn",
    )?;
    let Some(http) = server.http else {
        return Err(BenchError::Failed(
            "the server did not say its HTTP address".into(),
        ));
    };
    progress("http: /healthz without the flood");
    let without = measure(args.probes, || healthz(http));
    let stop = Arc::new(AtomicBool::new(false));
    let floods: Vec<_> = (0..2)
        .map(|_| hold_connections(60, Arc::clone(&stop), move || TcpStream::connect(http).ok()))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    progress("http: the same with two flooders holding 60 silent connections each");
    let with = measure(args.probes, || healthz(http));
    stop.store(true, Ordering::Relaxed);
    let opened: u64 = floods.into_iter().map(|f| f.join().unwrap_or(0)).sum();
    report(
        "http",
        &format!(
            "GET /healthz while two flooders hold 60 connections each that send nothing \
             ({opened} opened)"
        ),
        without,
        with,
    );
    Ok(())
}

/// Registers `instance` with a memfd of `nbytes` on a new attached connection and
/// stores its first `stored` bytes under `key`.
fn register_and_store(
    socket: &Path,
    instance: u64,
    nbytes: u64,
    key: &[u8],
    stored: u64,
) -> Result<RawConnection, BenchError> {
    let mut raw = RawConnection::connect(socket)?;
    raw.attach(instance)?;
    let memfd = crate::memfd::create("kvwarden-bench-floods", nbytes)
        .map_err(BenchError::io("creating a memfd"))?;
    let args = vec![
        instance.into(),
        Value::Array(vec![memfd_spec(0, nbytes)]),
        "bench".into(),
        1.into(),
    ];
    raw.call_with_fds("register_kv_cache", args, &[memfd.as_fd()])?;
    let args = vec![
        instance.into(),
        Value::Binary(key.to_vec()),
        0.into(),
        0.into(),
        stored.into(),
    ];
    raw.call("store", args)?;
    Ok(raw)
}

/// The copy flood's process (uid 1001): 8 connections, each keeping two
/// `retrieve_batch`es of 1,024 copies of 1 MiB in flight, until it is killed.
fn copy_flooder(socket: &Path) -> Result<(), BenchError> {
    let instance = super::raw::instance_ids(1)[0];
    register_and_store(socket, instance, MIB, b"flood", MIB)?;
    let item = Value::Array(vec![
        Value::Binary(b"flood".to_vec()),
        0.into(),
        0.into(),
        MIB.into(),
    ]);
    let batch = Value::Array(vec![item; 1024]);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (socket, batch) = (socket.to_path_buf(), batch.clone());
            std::thread::spawn(move || -> Result<(), BenchError> {
                let mut raw = RawConnection::connect(&socket)?;
                raw.attach(instance)?;
                let args = || vec![instance.into(), batch.clone()];
                raw.send("retrieve_batch", args(), &[])?;
                raw.send("retrieve_batch", args(), &[])?;
                loop {
                    raw.receive()?;
                    raw.send("retrieve_batch", args(), &[])?;
                }
            })
        })
        .collect();
    println!("flooding");
    for thread in threads {
        if let Ok(Err(error)) = thread.join() {
            return Err(error);
        }
    }
    Ok(())
}

fn copy_flood(args: &FloodsArgs) -> Result<(), BenchError> {
    if !rustix::process::geteuid().is_root() {
        progress("copy: skipped: the copy flood runs as uid 1001, another tenant (run as root)");
        return Ok(());
    }
    let server = ServerProcess::start(
        "bench-floods-copy",
        &[
            "--socket-mode",
            "666",
            "--pool-threads",
            "1",
            "--slot-bytes",
            "1M",
            "--l1-bytes",
            "16M",
        ]
        .map(String::from),
        "warn",
    )?;
    // Uid 1001 must reach the socket in the server's private directory.
    if let Some(dir) = server.socket.parent() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .map_err(BenchError::io("opening the socket's directory to uid 1001"))?;
    }
    let instance = super::raw::instance_ids(1)[0];
    let mut victim = register_and_store(&server.socket, instance, 64 << 10, b"victim", 4096)?;
    let mut retrieve = || {
        let args = vec![
            instance.into(),
            Value::Binary(b"victim".to_vec()),
            0.into(),
            0.into(),
            4096u64.into(),
        ];
        matches!(victim.call("retrieve", args), Ok(Value::Integer(n)) if n.as_u64() == Some(4096))
    };
    progress("copy: the victim's retrieve without the flood");
    let without = measure(args.probes, &mut retrieve);
    let mut command = kvwarden_command("bench")?;
    command
        .args(["floods", "--flooder"])
        .arg(&server.socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    std::os::unix::process::CommandExt::uid(&mut command, FLOODER_UID);
    std::os::unix::process::CommandExt::gid(&mut command, FLOODER_UID);
    let mut flooder = command
        .spawn()
        .map_err(BenchError::io("starting the copy flood as uid 1001"))?;
    let mut said = String::new();
    if let Some(stdout) = flooder.stdout.as_mut() {
        let mut byte = [0u8; 1];
        while !said.ends_with('\n') && stdout.read(&mut byte).unwrap_or(0) == 1 {
            said.push(byte[0] as char);
        }
    }
    if said.trim() != "flooding" {
        let _ = flooder.kill();
        return Err(BenchError::Failed(format!(
            "the copy flood did not start (it said {said:?})"
        )));
    }
    std::thread::sleep(Duration::from_millis(300));
    progress("copy: the same while uid 1001 keeps 16,384 copies of 1 MiB queued");
    let with = measure(args.probes, &mut retrieve);
    let _ = flooder.kill();
    let _ = flooder.wait();
    report(
        "copy",
        "a 4 KiB retrieve while another tenant (uid 1001) keeps 8 connections of two \
         retrieve_batches of 1,024 copies of 1 MiB queued, --pool-threads 1",
        without,
        with,
    );
    Ok(())
}
