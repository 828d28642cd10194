//! Many connections (target R5): the server holds and answers every connection its
//! open-file limit allows, disconnects a peer that never reads once that peer's output
//! buffer is full while everyone else keeps being served, and its memory stays flat.
//!
//! CI runs this at 1,000 connections; `kvwarden bench connections N` measures larger N.
//! Figures are printed (`r5: ...` lines), never asserted against time.

use kvwarden_core::protocol::encode_request;
use kvwarden_tests::{PATIENCE, RawClient, Server, TempDir, kvwarden_bin, wait_for};
use rmpv::Value;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use serde_json::Value as Json;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::process::{Child, Command, Stdio};

/// Growth of the server's resident memory tolerated while it holds the connections
/// and sheds the slow reader: generous (the slow reader alone may buffer 4 MiB).
const RSS_GROWTH_BOUND_KIB: u64 = 64 * 1024;

/// Raises this test process's own open-file soft limit so that it can hold `needed`
/// fds; panics naming the hard limit when that is too low.
fn raise_own_fd_limit(needed: u64) {
    let limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    assert!(
        hard >= needed,
        "this test needs {needed} open files but the hard limit is {hard}; raise it \
         (ulimit -Hn, LimitNOFILE=)"
    );
    if limit.current.is_some_and(|soft| soft >= needed) {
        return;
    }
    let raised = Rlimit {
        current: Some(hard.min(1 << 20)),
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).expect("raising the open-file soft limit");
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

/// One ping on every connection at once, then every reply: all must say `true` (a nil
/// ping) and carry the id sent.
fn ping_all(clients: &mut [RawClient]) {
    let mut ids = Vec::with_capacity(clients.len());
    for client in clients.iter_mut() {
        let (id, frame) = client.frame("ping", vec![Value::Nil]);
        client.send_bytes(&frame).expect("sending a ping");
        ids.push(id);
    }
    for (n, (client, id)) in clients.iter_mut().zip(ids).enumerate() {
        let reply = client
            .read_reply()
            .unwrap_or_else(|e| panic!("connection {n} got no reply: {e}"));
        assert_eq!(reply.id, id, "connection {n}");
        assert_eq!(reply.result.expect("ping nil"), Value::Boolean(true));
    }
}

/// Sends pings and never reads a reply, until the server hangs up. Returns the bytes
/// sent; panics if the server neither disconnects nor reads within `PATIENCE`.
fn flood_without_reading(mut flooder: RawClient) -> usize {
    flooder
        .stream
        .set_write_timeout(Some(PATIENCE))
        .expect("a write timeout");
    let ping = encode_request(1, "ping", vec![Value::Nil]);
    let batch: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 10_000)
        .collect();
    let mut sent = 0usize;
    for _ in 0..10_000 {
        match flooder.send_bytes(&batch) {
            Ok(()) => sent += batch.len(),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("the server stopped reading the flooder without disconnecting it")
            }
            Err(_) => return sent, // reset or broken pipe: disconnected
        }
    }
    panic!("still connected after {sent} bytes of pings never read");
}

#[test]
fn r5_thousand_connections_held_and_slow_reader_disconnected() {
    // KVWARDEN_R5_CONNECTIONS=10000 measures the R5 figure by hand (raise `ulimit -n`).
    let connections: usize = std::env::var("KVWARDEN_R5_CONNECTIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000);
    raise_own_fd_limit(connections as u64 + 512);
    let dir = TempDir::new("r5-load");
    let server = Server::start(&dir, &["--max-frame-bytes", "64K"]);
    let pid = server.child.id();
    let status = server.status();
    let capacity = status["limits"]["connection_capacity"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        status["limits"]["max_connections"].as_u64() >= Some(connections as u64 + 2),
        "the server's open-file limit holds only {capacity} connections: {:#}",
        status["limits"]
    );
    // Warm-up: the allocator and the connection table grow once.
    let mut warm: Vec<RawClient> = (0..100)
        .map(|_| RawClient::connect(&server.socket).expect("connecting"))
        .collect();
    ping_all(&mut warm);
    drop(warm);
    let quiet = 1; // the status connection
    server.wait_status("warm-up connections closed", |s| {
        s["connections"].as_u64() == Some(quiet)
    });
    let rss_start = rss_kib(pid);

    let mut clients: Vec<RawClient> = (0..connections)
        .map(|n| {
            RawClient::connect(&server.socket)
                .unwrap_or_else(|e| panic!("connection {n} refused: {e}"))
        })
        .collect();
    server.wait_status("every connection held", |s| {
        s["connections"].as_u64() == Some(quiet + connections as u64)
    });
    ping_all(&mut clients);
    ping_all(&mut clients);
    let rss_held = rss_kib(pid);

    // A peer that floods pings and never reads, while every other connection keeps
    // pinging.
    let flooder = RawClient::connect(&server.socket).expect("connecting the flooder");
    let flood = std::thread::spawn(move || flood_without_reading(flooder));
    let mut rounds_during_flood = 0u32;
    while !flood.is_finished() {
        ping_all(&mut clients);
        rounds_during_flood += 1;
    }
    let flooded_bytes = flood
        .join()
        .expect("the flood thread finished without a panic");
    assert!(
        server.log().contains("does not read its replies"),
        "the disconnect is logged as a slow reader's"
    );
    server.wait_status("the flooder is gone, the others held", |s| {
        s["connections"].as_u64() == Some(quiet + connections as u64)
    });
    ping_all(&mut clients);
    let rss_end = rss_kib(pid);

    eprintln!(
        "r5: connections={connections} capacity={capacity} rss_start_kib={rss_start} \
         rss_held_kib={rss_held} rss_end_kib={rss_end} flooder_bytes_before_disconnect={flooded_bytes} \
         ping_rounds_during_flood={rounds_during_flood}"
    );
    for (what, rss) in [("holding", rss_held), ("after the flood", rss_end)] {
        assert!(
            rss <= rss_start + RSS_GROWTH_BOUND_KIB,
            "server RSS grew from {rss_start} KiB to {rss} KiB {what} {connections} connections"
        );
    }
    drop(clients);
    server.wait_status("every connection closed", |s| {
        s["connections"].as_u64() == Some(quiet)
    });
}

/// A `kvwarden serve` started under `ulimit -n FDS` (soft and hard), so that it cannot
/// raise its open-file limit.
struct LimitedServer {
    child: Child,
    log: std::path::PathBuf,
}

impl LimitedServer {
    fn start(dir: &TempDir, fds: u64) -> LimitedServer {
        let socket = dir.path().join("kvwarden.sock");
        let log = dir.path().join("server.log");
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -n {fds} && exec \"$@\""))
            .arg("sh")
            .arg(kvwarden_bin())
            .args([
                "serve",
                "--http",
                "off",
                "--l1-bytes",
                "4M",
                "--slot-bytes",
                "64K",
                // One uid holds every connection here on purpose: the node-wide cap is
                // what these tests measure, not the per-uid share (rows 44).
                "--max-connections-per-uid",
                "1000000",
            ])
            .arg("--socket")
            .arg(&socket)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .expect("spawning sh -c 'ulimit -n …; exec kvwarden serve …'");
        let stdout = child.stdout.take().expect("stdout");
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if line == "ready" {
                    let _ = sender.send(());
                }
            }
        });
        let server = LimitedServer { child, log };
        if receiver.recv_timeout(PATIENCE).is_err() {
            panic!("the server did not start: {}", server.log());
        }
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LimitedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn status_of(client: &mut RawClient) -> Json {
    let reply = client.request("status", vec![]).expect("a status reply");
    kvwarden::server::status::msgpack_to_json(&reply.result.expect("the status map"))
}

#[test]
fn r5_max_connections_is_capped_by_the_open_file_limit_and_says_so() {
    const FDS: u64 = 600;
    let dir = TempDir::new("r5-capped");
    let server = LimitedServer::start(&dir, FDS);
    let socket = dir.path().join("kvwarden.sock");
    let mut first = RawClient::connect(&socket).expect("connecting");
    let status = status_of(&mut first);
    let limits = &status["limits"];
    let capacity = kvwarden::server::listen::FdLimit {
        soft_at_start: FDS,
        soft: FDS,
        hard: FDS,
    }
    .connection_capacity() as u64;
    assert_eq!(limits["open_files_soft"], FDS, "{limits:#}");
    assert_eq!(limits["open_files_hard"], FDS, "{limits:#}");
    assert_eq!(limits["connection_capacity"], capacity, "{limits:#}");
    assert_eq!(
        limits["max_connections"], capacity,
        "lowered from 10,000: {limits:#}"
    );
    let log = server.log();
    // The default was lowered: a line at INFO (an explicit flag would be a WARN).
    assert!(log.contains("open-file limit holds"), "{log}");
    assert!(
        log.contains(&format!("connection_capacity={capacity}")),
        "{log}"
    );

    // Every connection up to the cap is held and answered...
    let mut clients: Vec<RawClient> = (1..capacity)
        .map(|_| RawClient::connect(&socket).expect("connecting"))
        .collect();
    clients.push(first);
    ping_all(&mut clients);
    // ...the next one is closed at once, without a reply...
    let mut extra = RawClient::connect(&socket).expect("the kernel accepts the connect");
    let (_, frame) = extra.frame("ping", vec![Value::Nil]);
    let _ = extra.send_bytes(&frame); // may already fail: the server hung up
    let mut byte = [0u8; 1];
    let answered = matches!(extra.stream.read(&mut byte), Ok(n) if n > 0);
    assert!(!answered, "a connection beyond the cap was served");
    wait_for("the refusal logged", PATIENCE, || {
        server
            .log()
            .contains("--max-connections reached")
            .then_some(())
    });
    // ...and the held ones are still served.
    ping_all(&mut clients);
    let status = status_of(&mut clients[0]);
    assert_eq!(status["connections"], capacity, "{status:#}");
}
