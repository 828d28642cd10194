//! Clean shutdowns: rows 18 (worker) and 19 (server) of docs/failure-modes.md.

use kvwarden_tests::{PATIENCE, Server, TempDir, Worker, built, find_instance, freed, wait_exit};
use rustix::process::Signal;
use std::time::Duration;

#[test]
fn row_18_worker_clean_shutdown_unregisters_and_never_recreates() {
    let dir = TempDir::new("row18");
    let server = Server::start(&dir, &[]);
    let mut worker = Worker::unix(&server, &["--traffic-every-ms", "20"]);
    server.wait_status("proven", |s| {
        find_instance(s, worker.instance_id).is_some_and(|i| i["proven"] == true)
    });
    worker.signal(Signal::TERM);
    worker.wait_line("a clean shutdown", |l| l == "shutdown=clean");
    let exit = wait_exit(&mut worker.child, PATIENCE).expect("the worker exits");
    assert!(exit.success(), "{exit:?}");
    let status = server.wait_status("unregistered", |s| {
        find_instance(s, worker.instance_id).is_none()
    });
    assert_eq!(freed(&status, "unregistered"), 1, "{status:#}");
    assert_eq!(
        freed(&status, "process_exited"),
        0,
        "gone before its exit: nothing left to prove"
    );
    // No ghost context is re-created afterwards.
    std::thread::sleep(Duration::from_millis(500));
    let status = server.status();
    assert!(find_instance(&status, worker.instance_id).is_none());
    assert_eq!(built(&status), 1);
}

#[test]
fn row_19_server_sigterm_frees_every_context_and_removes_socket() {
    let dir = TempDir::new("row19");
    let server = Server::start(&dir, &[]);
    let workers = [Worker::unix(&server, &[]), Worker::unix(&server, &[])];
    server.wait_status("both registered", |s| {
        s["worker_liveness"]["tracked_instances"] == 2
    });
    let socket = server.socket.clone();
    let (exit, log) = server.terminate();
    assert!(exit.success(), "exit 0 expected: {exit:?}\n{log}");
    assert!(!socket.exists(), "the socket file is removed");
    assert!(log.contains("shutdown complete: freed 2 contexts"), "{log}");
    assert_eq!(
        log.matches("cause=\"shutdown\"").count(),
        2,
        "each context freed once:\n{log}"
    );
    drop(workers);
}

#[test]
fn shutdown_with_one_context_says_context_in_the_singular() {
    let dir = TempDir::new("one-context");
    let server = Server::start(&dir, &[]);
    let worker = Worker::unix(&server, &[]);
    server.wait_status("registered", |s| {
        s["worker_liveness"]["tracked_instances"] == 1
    });
    let (exit, log) = server.terminate();
    assert!(exit.success(), "exit 0 expected: {exit:?}\n{log}");
    assert!(log.contains("shutdown complete: freed 1 context "), "{log}");
    drop(worker);
}

/// Issue 16 (seen on an H200 in `kvwarden gpu copy`): a worker's first ping, due when
/// its first transfer started, waited behind back-to-back transfers on the shared
/// connection until the worker's own shutdown had unregistered it, and was then
/// answered `false`: a live worker told it was not held. Here with memfd buffers, the
/// same sequence and chunk size as `gpu copy` (register, 8 MiB stores, retrieves,
/// shutdown), many times over: the server must never answer a ping `false`.
#[test]
fn row_18_a_ping_due_at_shutdown_goes_out_before_the_unregister() {
    const CHUNK: u64 = 8 << 20;
    const CHUNKS: u64 = 2;
    const ROUNDS: usize = 64;
    let dir = TempDir::new("row18-ping");
    let server = Server::start(&dir, &["--l1-bytes", "64M", "--slot-bytes", "8M"]);
    let endpoint = kvwarden::client::Endpoint::Unix(server.socket.clone());
    for round in 0..ROUNDS {
        let client = kvwarden::client::Client::connect(kvwarden::client::ClientConfig::new(
            endpoint.clone(),
        ))
        .expect("connecting");
        let buffer = std::sync::Arc::new(
            kvwarden::client::MemfdBuffer::new((CHUNK * CHUNKS) as usize).expect("a memfd"),
        );
        client
            .register(vec![buffer], "row18", 1)
            .expect("registering");
        for i in 0..CHUNKS {
            let key = format!("{round}-{i}");
            assert!(client.store(key.as_bytes(), 0, i * CHUNK, CHUNK).unwrap());
        }
        for i in 0..CHUNKS {
            let key = format!("{round}-{i}");
            let copied = client
                .retrieve(key.as_bytes(), 0, i * CHUNK, CHUNK)
                .unwrap();
            assert_eq!(copied, Some(CHUNK));
        }
        assert_eq!(client.pings_answered_false(), 0, "round {round}");
        client.shutdown().expect("a clean shutdown");
    }
    let status = server.status();
    let pings = status["worker_liveness"]["pings_total"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(
        status["worker_liveness"]["pings_answered_false_total"], 0,
        "live workers' pings were answered false ({pings} pings in {ROUNDS} rounds)"
    );
    assert!(
        pings >= 1,
        "no ping was sent at all: the test proves nothing"
    );
    assert_eq!(freed(&status, "unregistered"), ROUNDS as u64);
}
