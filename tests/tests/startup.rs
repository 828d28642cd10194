//! A start that fails says which flag to change and leaves nothing behind; an ordinary
//! start logs no warning.

use kvwarden_bench::process::Lines;
use kvwarden_tests::{PATIENCE, TempDir, kvwarden_bin, signal, wait_exit};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

/// Runs `kvwarden serve` with `args` to its exit (bounded by [`PATIENCE`]).
fn serve_until_exit(args: &[&str]) -> Output {
    let mut child = Command::new(kvwarden_bin())
        .arg("serve")
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvwarden serve");
    if wait_exit(&mut child, PATIENCE).is_none() {
        let _ = child.kill();
        panic!("kvwarden serve {args:?} kept running; expected it to refuse to start");
    }
    child.wait_with_output().expect("collecting the output")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn http_port_taken_names_the_http_flag_and_leaves_no_socket_file() {
    let dir = TempDir::new("http-taken");
    let taken = TcpListener::bind("127.0.0.1:0").expect("binding a port to take");
    let addr = taken.local_addr().expect("its address").to_string();
    let socket = dir.path().join("kvwarden.sock");
    let socket_arg = socket.to_string_lossy().into_owned();
    let output = serve_until_exit(&["--socket", &socket_arg, "--http", &addr]);
    let message = stderr(&output);
    assert!(!output.status.success(), "started anyway:\n{message}");
    assert!(
        message.contains(&addr),
        "the address is not named:\n{message}"
    );
    assert!(
        message.contains("--http ADDR"),
        "no hint at --http:\n{message}"
    );
    assert!(
        message.contains("--http off"),
        "no hint at --http off:\n{message}"
    );
    assert!(
        !socket.exists(),
        "a failed start left its socket file {} behind",
        socket.display()
    );
}

#[test]
fn tcp_port_taken_names_the_tcp_flag_and_leaves_no_socket_file() {
    let dir = TempDir::new("tcp-taken");
    let taken = TcpListener::bind("127.0.0.1:0").expect("binding a port to take");
    let addr = taken.local_addr().expect("its address").to_string();
    let socket = dir.path().join("kvwarden.sock");
    let socket_arg = socket.to_string_lossy().into_owned();
    let token = dir.path().join("tcp-token");
    kvwarden_tests::write_token_file(&token, kvwarden_tests::TCP_TOKEN);
    let token_arg = token.to_string_lossy().into_owned();
    let output = serve_until_exit(&[
        "--socket",
        &socket_arg,
        "--http",
        "off",
        "--tcp",
        &addr,
        "--tcp-token-file",
        &token_arg,
    ]);
    let message = stderr(&output);
    assert!(!output.status.success(), "started anyway:\n{message}");
    assert!(
        message.contains("--tcp ADDR"),
        "no hint at --tcp:\n{message}"
    );
    assert!(
        !socket.exists(),
        "a failed start left its socket file behind"
    );
}

#[test]
fn socket_in_a_missing_directory_says_the_directory_is_missing() {
    let dir = TempDir::new("socket-dir");
    let missing = dir.path().join("not-created");
    let socket = missing.join("kvwarden.sock");
    let socket_arg = socket.to_string_lossy().into_owned();
    let output = serve_until_exit(&["--socket", &socket_arg, "--http", "off"]);
    let message = stderr(&output);
    assert!(!output.status.success(), "started anyway:\n{message}");
    assert!(
        message.contains(&format!("directory {} does not exist", missing.display())),
        "the missing directory is not named:\n{message}"
    );
    assert!(
        message.contains("--socket PATH"),
        "no hint at --socket:\n{message}"
    );
}

/// Starts `kvwarden serve` under an open-file hard limit of 1024 (too few for the
/// default 10,000 connections), waits until ready, stops it; returns its log.
fn serve_under_a_low_fd_limit(extra: &[&str]) -> String {
    let dir = TempDir::new("fd-limit");
    let socket = dir.path().join("kvwarden.sock");
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -n 1024 && exec "$0" "$@""#)
        .arg(kvwarden_bin())
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--http", "off"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvwarden serve under sh");
    let mut lines = Lines::spawn(child.stdout.take().expect("stdout"));
    let ready = lines.wait("ready", PATIENCE, |l| l == "ready");
    signal(&child, rustix::process::Signal::TERM);
    let exited = wait_exit(&mut child, PATIENCE);
    if exited.is_none() {
        let _ = child.kill();
    }
    let output = child.wait_with_output().expect("collecting the log");
    let log = stderr(&output);
    assert!(ready.is_ok(), "the server did not start:\n{log}");
    assert!(exited.is_some_and(|s| s.success()), "no clean exit:\n{log}");
    log
}

#[test]
fn default_connection_limit_lowered_by_the_fd_limit_is_info_not_a_warning() {
    let log = serve_under_a_low_fd_limit(&[]);
    let line = log
        .lines()
        .find(|l| l.contains("open-file limit holds"))
        .unwrap_or_else(|| panic!("the lowered limit is not reported:\n{log}"));
    assert!(line.contains("INFO"), "not at INFO: {line}");
    assert!(
        !log.lines().any(|l| l.contains(" WARN ")),
        "an ordinary start logged a warning:\n{log}"
    );
}

#[test]
fn explicit_max_connections_above_the_fd_limit_is_a_warning() {
    let log = serve_under_a_low_fd_limit(&["--max-connections", "5000"]);
    let line = log
        .lines()
        .find(|l| l.contains("--max-connections lowered"))
        .unwrap_or_else(|| panic!("the lowered flag is not reported:\n{log}"));
    assert!(line.contains("WARN"), "not a warning: {line}");
    assert!(line.contains("max_connections=5000"), "{line}");
}

/// Shared memory the process has resident (`RssShmem` of `/proc/<pid>/status`), in KiB.
fn resident_shmem_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("RssShmem:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no RssShmem in /proc/{pid}/status:\n{status}"))
}

#[test]
fn l1_prefault_makes_the_whole_pool_resident_at_start_and_without_it_none_is() {
    const POOL_KIB: u64 = 64 << 10;
    for prefault in [false, true] {
        let dir = TempDir::new("prefault");
        let mut extra = vec!["--l1-bytes", "64M", "--slot-bytes", "1M"];
        if prefault {
            extra.push("--l1-prefault");
        }
        let server = kvwarden_tests::Server::start(&dir, &extra);
        let resident = resident_shmem_kib(server.child.id());
        if prefault {
            assert!(
                resident >= POOL_KIB,
                "--l1-prefault: {resident} KiB of shared memory resident, the pool is {POOL_KIB} KiB"
            );
        } else {
            assert!(
                resident < POOL_KIB / 4,
                "without --l1-prefault: {resident} KiB resident before any store (pool {POOL_KIB} KiB)"
            );
        }
    }
}
