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
