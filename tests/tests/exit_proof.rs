//! The kernel's proof of death in every PID-namespace layout: a worker hands the server
//! a pidfd of itself in `hello` (rows 1 and 2 of failure-modes.md).
//!
//! The namespace tests put the server in a PID namespace of its own (`unshare --pid
//! --fork --mount-proc`), as a DaemonSet without `hostPID` is: every worker the test
//! starts is outside it, and `SO_PEERCRED` shows the server pid 0. They need root and
//! util-linux `unshare`; without them they print why and check nothing.
//!
//! No timing is asserted: the reap timeout is far beyond the waits where only the
//! process-exit proof may free, and the cause of every free is read from `/status`.

use kvwarden::protocol::ErrorCode;
use kvwarden_tests::{
    PATIENCE, RawClient, Server, TempDir, Worker, find_instance, freed, pid_namespace_unavailable,
    wait_for,
};
use rmpv::Value;
use rustix::fd::AsFd;
use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open};
use std::process::{Command, Stdio};

/// Far beyond any wait of these tests: a free seen within them is not a reap.
const LONG_TIMEOUTS: &[&str] = &[
    "--worker-reap-timeout-seconds",
    "300",
    "--worker-registration-grace-seconds",
    "600",
];

fn skip_without_pid_namespace(test: &str) -> bool {
    match pid_namespace_unavailable() {
        Some(reason) => {
            println!("SKIPPED {test}: {reason}");
            true
        }
        None => false,
    }
}

fn hello_with_pidfd(index: u64) -> Vec<Value> {
    vec![
        1.into(),
        "exit-proof-test".into(),
        Value::Map(vec![("pidfd_index".into(), index.into())]),
    ]
}

fn metric(server: &Server, line_start: &str) -> Option<f64> {
    let (code, body) = server.http_get("/metrics");
    assert_eq!(code, 200);
    body.lines()
        .find_map(|line| line.strip_prefix(line_start))
        .and_then(|value| value.trim().parse().ok())
}

fn instances_noticed_by(server: &Server, notice: &str) -> Option<f64> {
    metric(
        server,
        &format!("kvwarden_instances_by_death_notice{{noticed_by=\"{notice}\"}}"),
    )
}

#[test]
fn row_02_server_in_another_pid_namespace_frees_a_worker_that_sent_its_pidfd_by_process_exit() {
    if skip_without_pid_namespace("row_02 with pidfd") {
        return;
    }
    let dir = TempDir::new("exit-proof-ns-pidfd");
    let server = Server::start_in_pid_namespace(&dir, LONG_TIMEOUTS);
    let mut victim = Worker::unix(&server, &[]);
    let bystander = Worker::unix(&server, &[]);
    victim.wait_line("the server's word on the pidfd", |l| {
        l == "exit_proof=pidfd_from_peer"
    });
    let status = server.wait_status("the victim registered", |s| {
        find_instance(s, victim.instance_id).is_some_and(|i| i["building"] == false)
    });
    let entry = find_instance(&status, victim.instance_id).expect("the victim's entry");
    assert_eq!(entry["death_noticed_by"], "pidfd_from_peer", "{entry:#}");
    // The server cannot see the worker's pid: the pidfd is the only proof it has.
    assert!(entry["watched_pid"].is_null(), "{entry:#}");
    assert_eq!(status["instances_by_death_notice"]["pidfd_from_peer"], 2);
    assert_eq!(status["instances_by_death_notice"]["pidfd_by_pid"], 0);
    assert_eq!(instances_noticed_by(&server, "pidfd_from_peer"), Some(2.0));
    assert_eq!(instances_noticed_by(&server, "timeout_only"), Some(0.0));

    victim.signal(Signal::KILL);
    let status = server.wait_status("the victim freed", |s| {
        find_instance(s, victim.instance_id).is_none()
    });
    assert_eq!(freed(&status, "process_exited"), 1, "{status:#}");
    assert_eq!(freed(&status, "reaped"), 0, "{status:#}");
    assert_eq!(status["worker_liveness"]["process_exits_total"], 1);
    assert!(find_instance(&status, bystander.instance_id).is_some());
    assert!(
        server
            .log()
            .contains("the kernel proved its process exited")
    );
}

#[test]
fn row_02_server_in_another_pid_namespace_reaps_a_worker_without_its_pidfd_at_the_timeout() {
    if skip_without_pid_namespace("row_02 without pidfd") {
        return;
    }
    let dir = TempDir::new("exit-proof-ns-none");
    // T = 2 s, R = 0.1 s (the test defaults).
    let server = Server::start_in_pid_namespace(&dir, &[]);
    let mut old = Worker::unix(&server, &["--no-send-pidfd"]);
    old.wait_line("the server's word on the proof", |l| {
        l == "exit_proof=timeout_only"
    });
    let status = server.wait_status("the worker proven", |s| {
        find_instance(s, old.instance_id).is_some_and(|i| i["proven"] == true)
    });
    let entry = find_instance(&status, old.instance_id).expect("the worker's entry");
    assert_eq!(entry["death_noticed_by"], "timeout_only", "{entry:#}");
    assert_eq!(status["watched_processes"], 0);
    assert_eq!(instances_noticed_by(&server, "timeout_only"), Some(1.0));

    old.signal(Signal::KILL);
    let status = server.wait_status("the worker reaped", |s| {
        find_instance(s, old.instance_id).is_none()
    });
    assert_eq!(freed(&status, "reaped"), 1, "{status:#}");
    assert_eq!(freed(&status, "process_exited"), 0, "{status:#}");
    assert_eq!(status["worker_liveness"]["process_exits_total"], 0);
    assert!(
        server
            .log()
            .contains("reaped: silent longer than its window")
    );
}

#[test]
fn row_01_forked_child_holding_the_socket_does_not_keep_its_parent_alive() {
    if skip_without_pid_namespace("row_01 forked child") {
        return;
    }
    let dir = TempDir::new("exit-proof-fork");
    // In its own PID namespace the server has no pid to go by: only the pidfd the
    // worker sent can prove anything, and it must name the parent, not the socket.
    let server = Server::start_in_pid_namespace(&dir, LONG_TIMEOUTS);
    let mut parent = Command::new(env!("CARGO_BIN_EXE_kvwarden-fork-worker"))
        .arg(&server.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning kvwarden-fork-worker");
    let mut lines = kvwarden_bench::process::Lines::spawn(parent.stdout.take().expect("stdout"));
    let line = lines
        .wait("the forked worker's line", PATIENCE, |l| {
            l.starts_with("instance_id=")
        })
        .unwrap_or_else(|error| panic!("{error}"));
    let field = |name: &str| -> String {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
            .to_string()
    };
    let instance: u64 = field("instance_id=").parse().expect("an instance id");
    let child_pid: i32 = field("child_pid=").parse().expect("the child's pid");
    struct KillOnDrop(i32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if let Some(pid) = Pid::from_raw(self.0) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
    }
    let _child = KillOnDrop(child_pid);
    assert_eq!(field("exit_proof="), "pidfd_from_peer");
    let child_alive = || {
        std::fs::read_to_string(format!("/proc/{child_pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "))
    };
    assert!(child_alive(), "the forked child runs");

    parent.kill().expect("SIGKILL the parent");
    let _ = parent.wait();
    let status = server.wait_status("the parent's instance freed", |s| {
        find_instance(s, instance).is_none()
    });
    assert_eq!(freed(&status, "process_exited"), 1, "{status:#}");
    assert_eq!(freed(&status, "reaped"), 0, "{status:#}");
    // Freed while the child that holds the socket (and a pidfd) still lives.
    assert!(child_alive(), "the forked child must outlive the free");
    assert_eq!(
        status["connections"].as_u64().map(|n| n >= 1),
        Some(true),
        "{status:#}"
    );
}

#[test]
fn row_01_pidfd_of_another_process_is_refused_naming_both_pids() {
    let dir = TempDir::new("exit-proof-liar");
    let server = Server::start(&dir, LONG_TIMEOUTS);
    let mut someone_else = Command::new("sleep")
        .arg("60")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawning sleep");
    let other_pid = someone_else.id() as i32;
    let own_pid = std::process::id();
    let other = pidfd_open(
        Pid::from_raw(other_pid).expect("a pid"),
        PidfdFlags::empty(),
    )
    .expect("pidfd_open of the other process");
    let own = pidfd_open(rustix::process::getpid(), PidfdFlags::empty()).expect("own pidfd");

    let mut client = RawClient::connect(&server.socket).expect("connect");
    let reply = client
        .request_with_fds("hello", hello_with_pidfd(0), &[other.as_fd()])
        .expect("a reply");
    let error = reply.result.expect_err("someone else's pidfd is refused");
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(
        error.message.contains(&format!("pid {other_pid}")),
        "{}",
        error.message
    );
    assert!(
        error.message.contains(&format!("pid {own_pid}")),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("pidfd_open(getpid()"),
        "{}",
        error.message
    );

    // Not a pidfd at all: refused, naming what would be right.
    let memfd = kvwarden::memfd::create("not-a-pidfd", 16).expect("a memfd");
    let error = client
        .request_with_fds("hello", hello_with_pidfd(0), &[memfd.as_fd()])
        .expect("a reply")
        .result
        .expect_err("a memfd is not a pidfd");
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(
        error.message.contains("is not a pidfd"),
        "{}",
        error.message
    );
    // An index the frame did not carry.
    let error = client
        .request("hello", hello_with_pidfd(0))
        .expect("a reply")
        .result
        .expect_err("no fd came");
    assert!(error.message.contains("carried 0"), "{}", error.message);

    // The other direction: its own pidfd is taken, once per connection.
    let value = client
        .request_with_fds("hello", hello_with_pidfd(0), &[own.as_fd()])
        .expect("a reply")
        .result
        .expect("its own pidfd is accepted");
    let exit_proof = match &value {
        Value::Map(map) => map
            .iter()
            .find(|(k, _)| k.as_str() == Some("exit_proof"))
            .and_then(|(_, v)| v.as_str().map(str::to_owned)),
        _ => None,
    };
    assert_eq!(exit_proof.as_deref(), Some("pidfd_from_peer"), "{value}");
    let error = client
        .request_with_fds("hello", hello_with_pidfd(0), &[own.as_fd()])
        .expect("a reply")
        .result
        .expect_err("a second pidfd on one connection");
    assert!(
        error.message.contains("already sent its pidfd"),
        "{}",
        error.message
    );
    // Without a pidfd, a connection whose pid the server sees is proven by pid.
    let mut plain = RawClient::connect(&server.socket).expect("connect");
    let value = plain
        .request("hello", vec![1.into(), "old-client".into()])
        .expect("a reply")
        .result
        .expect("the two-argument hello of older clients");
    assert!(value.to_string().contains("pidfd_by_pid"), "{value}");

    let _ = someone_else.kill();
    let _ = someone_else.wait();
    wait_for("the server still serving", PATIENCE, || {
        server.status()["server"].as_str().map(|_| ())
    });
}
