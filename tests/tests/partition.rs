//! Partitions and server restarts: rows 7, 8 and 11 of docs/failure-modes.md.
//!
//! Partitions are made with a TCP proxy the test cuts and heals: the worker reaches the
//! server only through it (over TCP there is no process-exit proof, so only the
//! heartbeat rules decide).

use kvwarden_tests::{Proxy, Server, TempDir, Worker, built, find_instance, freed};
use std::time::{Duration, Instant};

#[test]
fn row_07_partition_shorter_than_timeout_refreshes_without_rebuilding() {
    let dir = TempDir::new("row07");
    let server = Server::start(
        &dir,
        &[
            "--tcp",
            "127.0.0.1:0",
            "--worker-reap-timeout-seconds",
            "4",
            "--worker-registration-grace-seconds",
            "8",
        ],
    );
    let proxy = Proxy::start(server.tcp.expect("tcp"));
    let mut worker = Worker::tcp(&server, proxy.addr);
    server.wait_status("proven", |s| {
        find_instance(s, worker.instance_id).is_some_and(|i| i["proven"] == true)
    });
    proxy.cut();
    worker.wait_line("unhealthy on the first failed ping", |l| {
        l == "healthy=false"
    });
    let cut_at = Instant::now();
    while cut_at.elapsed() < Duration::from_millis(1000) {
        let status = server.status();
        assert!(
            find_instance(&status, worker.instance_id).is_some(),
            "reaped during a partition shorter than T: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    proxy.heal();
    worker.wait_line("re-registered on the refreshed path", |l| {
        l == "recoveries=1 outcome=refreshed"
    });
    worker.wait_line("healthy again", |l| l == "healthy=true");
    let status = server.status();
    assert!(find_instance(&status, worker.instance_id).is_some());
    assert_eq!(
        built(&status),
        1,
        "zero contexts built by the recovery: {status:#}"
    );
    assert_eq!(freed(&status, "reaped"), 0);
}

#[test]
fn row_08_partition_longer_than_timeout_rebuilds_one_context() {
    let dir = TempDir::new("row08");
    let server = Server::start(&dir, &["--tcp", "127.0.0.1:0"]);
    server.expect_pings_answered_false("reaped during a partition longer than T");
    let proxy = Proxy::start(server.tcp.expect("tcp"));
    let mut worker = Worker::tcp(&server, proxy.addr);
    server.wait_status("proven", |s| {
        find_instance(s, worker.instance_id).is_some_and(|i| i["proven"] == true)
    });
    proxy.cut();
    let cut_at = Instant::now();
    let status = server.wait_status("reaped during the partition", |s| {
        find_instance(s, worker.instance_id).is_none()
    });
    assert!(
        cut_at.elapsed() >= Duration::from_millis(1700),
        "{:?}",
        cut_at.elapsed()
    );
    assert_eq!(freed(&status, "reaped"), 1);
    proxy.heal();
    worker.wait_line("re-registered with a fresh context", |l| {
        l == "recoveries=1 outcome=created"
    });
    let status = server.wait_status("back", |s| find_instance(s, worker.instance_id).is_some());
    assert_eq!(built(&status), 2, "exactly one fresh context: {status:#}");
    assert_eq!(status["worker_liveness"]["tracked_instances"], 1);
}

#[test]
fn row_11_server_restart_workers_reregister_once() {
    let dir = TempDir::new("row11");
    let server = Server::start(&dir, &[]);
    let mut workers = [Worker::unix(&server, &[]), Worker::unix(&server, &[])];
    let first_boot = server.status()["boot_id"].clone();
    drop(server); // SIGKILL: the socket file stays behind, stale
    let server = Server::start(&dir, &[]);
    server.expect_pings_answered_false("a restarted server holds nothing");
    assert_ne!(server.status()["boot_id"], first_boot);
    for worker in &mut workers {
        // The first recovery creates; a later one (a transfer answered not_registered
        // racing the heartbeat's) can only refresh: the server's count decides.
        worker.wait_line("re-registered on the new server", |l| {
            l.starts_with("recoveries=")
        });
    }
    let status = server.wait_status("both back", |s| {
        s["worker_liveness"]["tracked_instances"] == 2
    });
    assert_eq!(built(&status), 2, "exactly one context each: {status:#}");
    for worker in &workers {
        assert!(find_instance(&status, worker.instance_id).is_some());
    }
}
