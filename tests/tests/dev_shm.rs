//! Row 22: a worker's shared memory never outlives it. Every segment kvwarden shares
//! (the L1 pool, workers' buffers) is an anonymous memfd: nothing is named in
//! `/dev/shm`, so once the server unmaps a dead worker's memory the pages are gone.

mod engine_support;

use engine_support::Helper;
use kvwarden_tests::{PATIENCE, Server, TempDir, Worker, freed, wait_for};
use std::collections::BTreeSet;
use std::path::Path;

/// The helper process (a no-op when run as a test).
#[test]
fn helper_process_shm_worker() {
    engine_support::run_helper_if_asked();
}

fn dev_shm() -> BTreeSet<String> {
    match std::fs::read_dir("/dev/shm") {
        Ok(entries) => entries
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => BTreeSet::new(), // no /dev/shm at all: nothing can be named there
    }
}

/// Every file a process maps or holds open, as the kernel names it.
fn files_of(pid: u32) -> Vec<String> {
    let proc = Path::new("/proc").join(pid.to_string());
    let mut files: Vec<String> = std::fs::read_to_string(proc.join("maps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5).map(str::to_owned))
        .collect();
    if let Ok(fds) = std::fs::read_dir(proc.join("fd")) {
        for fd in fds.filter_map(|fd| fd.ok()) {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                files.push(target.to_string_lossy().into_owned());
            }
        }
    }
    files
}

#[test]
fn row_22_nothing_of_kvwarden_appears_in_dev_shm_after_workers_are_sigkilled() {
    let before = dev_shm();
    let dir = TempDir::new("row22");
    let server = Server::start(&dir, &[]);
    let server_pid = server.child.id();
    let workers = [Worker::unix(&server, &[]), Worker::unix(&server, &[])];
    let engine = Helper::spawn(
        "helper_process_shm_worker",
        &server.socket,
        2201,
        "engine,store:k,reserve:half",
    );
    let pids: Vec<u32> = workers
        .iter()
        .map(|w| w.child.id())
        .chain([engine.pid(), server_pid])
        .collect();

    // While they run: the shared memory is there, and anonymous.
    let server_files = files_of(server_pid);
    assert!(
        server_files
            .iter()
            .any(|f| f.starts_with("/memfd:kvwarden-l1")),
        "the L1 pool is an anonymous memfd: {server_files:?}"
    );
    wait_for("the server maps the workers' buffers", PATIENCE, || {
        let maps = files_of(server_pid);
        let buffers = maps
            .iter()
            .filter(|f| f.starts_with("/memfd:kvwarden-worker-buffer"))
            .count();
        (buffers >= 2).then_some(())
    });
    let engine_files = files_of(engine.pid());
    assert!(
        engine_files
            .iter()
            .any(|f| f.starts_with("/memfd:kvwarden-l1")),
        "the engine maps the pool it received: {engine_files:?}"
    );
    for pid in &pids {
        let named: Vec<String> = files_of(*pid)
            .into_iter()
            .filter(|f| f.starts_with("/dev/shm"))
            .collect();
        assert!(
            named.is_empty(),
            "pid {pid} uses named shared memory: {named:?}"
        );
    }

    // SIGKILL every worker: the server frees them on the kernel's word and unmaps
    // their memory.
    let exits_before = freed(&server.status(), "process_exited");
    for worker in &workers {
        worker.signal(rustix::process::Signal::KILL);
    }
    engine.kill();
    server.wait_status("the three workers freed by their exits", |s| {
        freed(s, "process_exited") >= exits_before + 3
    });
    wait_for(
        "the server unmapped the dead workers' buffers",
        PATIENCE,
        || {
            let left = files_of(server_pid)
                .into_iter()
                .filter(|f| f.starts_with("/memfd:kvwarden-worker-buffer"))
                .count();
            (left == 0).then_some(())
        },
    );
    drop(workers);

    let after = dev_shm();
    let new: Vec<&String> = after.difference(&before).collect();
    let ours: Vec<&&String> = new
        .iter()
        .filter(|name| name.to_ascii_lowercase().contains("kvwarden"))
        .collect();
    assert!(
        ours.is_empty(),
        "kvwarden named these in /dev/shm: {ours:?}"
    );
    let server_files = files_of(server_pid);
    let held: Vec<&&String> = new
        .iter()
        .filter(|name| server_files.iter().any(|f| f.ends_with(name.as_str())))
        .collect();
    assert!(
        held.is_empty(),
        "the server holds new /dev/shm files: {held:?}"
    );
    // The server itself is still serving, with its own pool still anonymous.
    assert!(
        server_files
            .iter()
            .any(|f| f.starts_with("/memfd:kvwarden-l1")),
        "{server_files:?}"
    );
}
