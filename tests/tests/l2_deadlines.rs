//! Nothing is written into a worker's memory after it stopped waiting (issue 52), and
//! an L2 read ends at its deadline over TLS too (row 59): a real `kvwarden serve` on a
//! real TLS Redis behind a proxy of the test's that sends each large burst of Redis's
//! replies at full speed but its last bytes one at a time, 40 ms apart. Over
//! `rediss://` the last TLS record then cannot be decrypted until its last byte is
//! there; rustls's own stream read on for all of it (30 s in the audit), and the chunk
//! then landed in a buffer the worker had long reused.
//!
//! Each destination is filled with a sentinel first. The control runs the same retrieve
//! through a proxy that does not trickle: a hit, its bytes in place.

use kvwarden::client::{Client, MemfdBuffer};
use kvwarden_bench::redis_cluster::{self as harness, Security};
use kvwarden_tests::l2_worker::{chunk, l2_counter, store, wait_written, worker};
use kvwarden_tests::{Server, TempDir};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One chunk: 1 MiB, as in the audit.
const CHUNK: u64 = 1 << 20;
/// The servers' `--l2-timeout-ms`.
const L2_TIMEOUT: Duration = Duration::from_millis(500);
/// Bytes at the end of each large burst that the proxy trickles (10 s of them).
const TRICKLED_BYTES: usize = 250;
/// A small chunk, read first so that each server's connections to Redis are up (its
/// reply is below the size the proxy trickles).
const WARM: u64 = 64 << 10;
/// Between two trickled bytes.
const TRICKLE_GAP: Duration = Duration::from_millis(40);
/// The sentinel a destination holds before a retrieve.
const UNTOUCHED: u8 = 0xA5;

/// A proxy from a local port to `upstream`. Client to Redis: as it comes. Redis to
/// client: collected into bursts (a burst ends when nothing came for 20 ms); with
/// `trickle`, a burst of 256 KiB or more goes at once but for its last
/// [`TRICKLED_BYTES`], which follow one every [`TRICKLE_GAP`].
struct TrickleProxy {
    addr: SocketAddr,
    scheme: &'static str,
    stop: Arc<AtomicBool>,
}

impl TrickleProxy {
    fn start(upstream: SocketAddr, scheme: &'static str, trickle: bool) -> TrickleProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a proxy port");
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut to_server, mut from_client) =
                    (server.try_clone().unwrap(), client.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_client, &mut to_server);
                    let _ = to_server.shutdown(std::net::Shutdown::Write);
                });
                std::thread::spawn(move || bursts(server, client, trickle));
            }
        });
        TrickleProxy { addr, scheme, stop }
    }

    fn seed(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }
}

impl Drop for TrickleProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

fn bursts(mut from: TcpStream, mut to: TcpStream, trickle: bool) {
    from.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let mut burst = Vec::new();
    let mut chunk = vec![0u8; 256 << 10];
    loop {
        match from.read(&mut chunk) {
            Ok(0) => {
                let _ = to.write_all(&burst);
                let _ = to.shutdown(std::net::Shutdown::Write);
                return;
            }
            Ok(n) => burst.extend_from_slice(&chunk[..n]),
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if burst.is_empty() {
                    continue;
                }
                let held = if trickle && burst.len() >= 256 << 10 {
                    TRICKLED_BYTES
                } else {
                    0
                };
                let at = burst.len() - held;
                if to.write_all(&burst[..at]).is_err() {
                    return;
                }
                for byte in &burst[at..] {
                    std::thread::sleep(TRICKLE_GAP);
                    if to.write_all(std::slice::from_ref(byte)).is_err() {
                        return;
                    }
                }
                burst.clear();
            }
            Err(_) => return,
        }
    }
}

/// One Redis, over TLS or plain TCP.
fn redis(tls: bool) -> harness::RedisCluster {
    if let Err(error) = harness::require(&harness::REDIS_PROGRAMS) {
        panic!("{error}. The L2 tests need a real Redis; `.ci/run` installs it by itself");
    }
    harness::RedisCluster::single_secured(Security {
        password: None,
        tls: tls.then_some(false),
    })
    .unwrap_or_else(|error| panic!("starting Redis: {error}"))
}

/// A server on `seeds`, trusting the CA file `ca` when there is one.
fn server(dir: &TempDir, seeds: &str, ca: Option<&str>) -> Server {
    let timeout = L2_TIMEOUT.as_millis().to_string();
    let mut flags = vec![
        "--worker-reap-timeout-seconds",
        "60",
        "--worker-registration-grace-seconds",
        "120",
        "--resolution-seconds",
        "1",
        "--l1-bytes",
        "8M",
        "--slot-bytes",
        "1M",
        "--l2",
        seeds,
        "--l2-namespace",
        "deadlines",
        "--l2-timeout-ms",
        &timeout,
    ];
    if let Some(ca) = ca {
        flags.extend(["--l2-tls-ca-file", ca]);
    }
    Server::start(dir, &flags)
}

/// Retrieves `key` into offset 0 of `buffer` (filled with [`UNTOUCHED`] first): the
/// reply, and how long it took.
fn retrieve(client: &Client, buffer: &MemfdBuffer, key: &[u8]) -> (Option<u64>, Duration) {
    assert!(buffer.write(0, &vec![UNTOUCHED; CHUNK as usize]));
    let started = Instant::now();
    let got = client.retrieve(key, 0, 0, CHUNK).expect("retrieve");
    (got, started.elapsed())
}

fn untouched(buffer: &MemfdBuffer) -> bool {
    let mut out = vec![0; CHUNK as usize];
    assert!(buffer.read(0, &mut out));
    out.iter().all(|byte| *byte == UNTOUCHED)
}

/// Row 59: over `rediss://`, a reply whose last bytes trickle in is given up at the
/// read's deadline: the retrieve is a miss within the L2 timeout plus slack (5 s, ten
/// times the 500 ms timeout; the trickle alone takes 10 s), counted as a timeout, and
/// the destination still holds its sentinel after the trickle has long ended. The
/// control, through a proxy that does not trickle: a hit with the chunk's bytes.
#[test]
fn row_59_a_tls_reply_that_trickles_is_given_up_at_the_deadline_and_never_lands() {
    trickled_reply_is_given_up_at_the_deadline(true);
}

/// Row 59 over plain TCP: the same.
#[test]
fn row_59_a_plain_reply_that_trickles_is_given_up_at_the_deadline_and_never_lands() {
    trickled_reply_is_given_up_at_the_deadline(false);
}

fn trickled_reply_is_given_up_at_the_deadline(tls: bool) {
    let redis = redis(tls);
    let ca = redis
        .tls_files()
        .map(|files| files.ca.to_str().expect("a UTF-8 path").to_string());
    let scheme = if tls { "rediss" } else { "redis" };
    let upstream: SocketAddr = redis.seeds()[0]
        .split("://")
        .nth(1)
        .and_then(|addr| addr.parse().ok())
        .expect("the seed's address");
    let (dir_w, dir_c, dir_r) = (
        TempDir::new("deadline-w"),
        TempDir::new("deadline-c"),
        TempDir::new("deadline-r"),
    );
    let writer_server = server(&dir_w, &redis.seeds()[0], ca.as_deref());
    let (writer, source) = worker(&writer_server, "deadlines");
    let bytes = chunk(59, CHUNK);
    store(&writer, &source, b"trickled", &bytes);
    store(&writer, &source, b"warm", &chunk(60, WARM));
    wait_written(&writer_server, 2);
    let warm = |client: &Client| {
        assert_eq!(
            client.retrieve(b"warm", 0, 0, WARM).expect("retrieve"),
            Some(WARM),
            "the warm-up read is a hit"
        );
    };

    // The control: the same read through a proxy that only collects bursts.
    let straight = TrickleProxy::start(upstream, scheme, false);
    let control_server = server(&dir_c, &straight.seed(), ca.as_deref());
    let (control, control_buffer) = worker(&control_server, "deadlines");
    warm(&control);
    let (got, _) = retrieve(&control, &control_buffer, b"trickled");
    assert_eq!(got, Some(CHUNK), "control: a hit");
    let mut out = vec![0; CHUNK as usize];
    assert!(control_buffer.read(0, &mut out));
    assert!(out == bytes, "control: the chunk's bytes in place");

    // The attack: the last 100 bytes of each large burst, 40 ms apart.
    let trickling = TrickleProxy::start(upstream, scheme, true);
    let reader_server = server(&dir_r, &trickling.seed(), ca.as_deref());
    let (reader, reader_buffer) = worker(&reader_server, "deadlines");
    warm(&reader);
    let (got, took) = retrieve(&reader, &reader_buffer, b"trickled");
    assert_eq!(got, None, "a miss, not a hit {took:?} late");
    assert!(
        took < L2_TIMEOUT * 10,
        "the retrieve ended {took:?} after it was asked (L2 timeout {L2_TIMEOUT:?})"
    );
    let status = reader_server.status();
    assert!(l2_counter(&status, "timeouts") >= 1, "{}", status["l2"]);
    // Well past the trickle's end: nothing landed in the worker's buffer.
    std::thread::sleep(TRICKLE_GAP * TRICKLED_BYTES as u32 + Duration::from_secs(1));
    assert!(
        untouched(&reader_buffer),
        "the late chunk was written into the buffer"
    );
}

/// Row 61 with a slow L2: a worker's retrieve held for the L2 timeout (3 s) by a reply
/// that trickles in goes on pinging on the heartbeat's own connection: at least five of
/// about fifteen pings (every 200 ms) are answered during the hold, and the worker
/// stays healthy throughout. The control: the retrieve ends (a timed-out miss).
#[test]
fn row_61_a_worker_whose_retrieve_is_held_by_a_slow_l2_goes_on_pinging() {
    let redis = redis(false);
    let upstream: SocketAddr = redis.seeds()[0]
        .split("://")
        .nth(1)
        .and_then(|addr| addr.parse().ok())
        .expect("the seed's address");
    let (dir_w, dir_r) = (TempDir::new("held-w"), TempDir::new("held-r"));
    let writer_server = server(&dir_w, &redis.seeds()[0], None);
    let (writer, source) = worker(&writer_server, "deadlines");
    store(&writer, &source, b"held", &chunk(61, CHUNK));
    store(&writer, &source, b"warm", &chunk(62, WARM));
    wait_written(&writer_server, 2);

    let trickling = TrickleProxy::start(upstream, "redis", true);
    let reader_server = Server::start(
        &dir_r,
        &[
            "--worker-reap-timeout-seconds",
            "60",
            "--worker-registration-grace-seconds",
            "120",
            "--l1-bytes",
            "8M",
            "--slot-bytes",
            "1M",
            "--l2",
            &trickling.seed(),
            "--l2-namespace",
            "deadlines",
            "--l2-timeout-ms",
            "3000",
        ],
    );
    let mut config = kvwarden::client::ClientConfig::new(kvwarden::client::Endpoint::Unix(
        reader_server.socket.clone(),
    ));
    config.heartbeat_interval = Duration::from_millis(200);
    let reader = Arc::new(Client::connect(config).expect("connecting"));
    let buffer = Arc::new(MemfdBuffer::new(1 << 20).expect("a memfd"));
    reader
        .register(vec![Arc::clone(&buffer)], "deadlines", 1)
        .expect("registering");
    assert_eq!(
        reader.retrieve(b"warm", 0, 0, WARM).expect("retrieve"),
        Some(WARM),
        "the warm-up read is a hit"
    );
    kvwarden_tests::wait_for("healthy", Duration::from_secs(10), || {
        reader.is_healthy().then_some(())
    });
    let pings = || {
        reader_server.status()["worker_liveness"]["pings_total"]
            .as_u64()
            .expect("pings_total")
    };
    let before = pings();
    let held = {
        let reader = Arc::clone(&reader);
        std::thread::spawn(move || reader.retrieve(b"held", 0, 0, CHUNK))
    };
    let mut unhealthy = 0;
    while !held.is_finished() {
        unhealthy += usize::from(!reader.is_healthy());
        std::thread::sleep(Duration::from_millis(50));
    }
    let pinged = pings() - before;
    assert_eq!(
        held.join().expect("the retrieve").expect("answered"),
        None,
        "the held read ended as a timed-out miss"
    );
    assert!(
        pinged >= 5,
        "{pinged} pings answered while the retrieve was held"
    );
    assert_eq!(unhealthy, 0, "healthy while its own retrieve was held");
}
