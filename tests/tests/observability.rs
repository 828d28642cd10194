//! What an operator sees: HTTP `/status`, `/metrics`, `/healthz`, `kvwarden status`,
//! a second server refused where one runs (its socket, its HTTP port), and reaping
//! disabled (row 17).

use kvwarden_tests::{Server, TempDir, Worker, find_instance, freed, kvwarden_bin};
use rustix::process::Signal;
use std::time::Duration;

#[test]
fn http_status_metrics_and_healthz_describe_the_server() {
    let dir = TempDir::new("http");
    let server = Server::start(&dir, &[]);
    let worker = Worker::unix(&server, &[]);
    server.wait_status("proven", |s| {
        find_instance(s, worker.instance_id).is_some_and(|i| i["proven"] == true)
    });
    let (code, body) = server.http_get("/healthz");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (code, body) = server.http_get("/status");
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let live = &status["worker_liveness"];
    assert_eq!(live["enabled"], true);
    assert_eq!(live["reap_timeout_seconds"], 2.0);
    assert_eq!(live["registration_grace_seconds"], 4.0);
    assert_eq!(live["tracked_instances"], 1);
    let instance = find_instance(&status, worker.instance_id).expect("the worker listed");
    // 63-bit ids are strings in JSON (a JSON number above 2^53 is rounded by jq and
    // JavaScript): exactly the worker's id, and the boot id likewise.
    assert_eq!(
        instance["instance_id"],
        serde_json::Value::String(worker.instance_id.to_string())
    );
    assert!(
        status["boot_id"]
            .as_str()
            .is_some_and(|id| id.parse::<u64>().is_ok())
    );
    for field in [
        "module",
        "age_seconds",
        "silence_seconds",
        "proven",
        "owner_uid",
    ] {
        assert!(!instance[field].is_null(), "{field} missing: {instance:#}");
    }
    let (code, metrics) = server.http_get("/metrics");
    assert_eq!(code, 200);
    for name in [
        "kvwarden_tracked_instances 1",
        "kvwarden_requests_total{op=\"ping\"}",
        "kvwarden_contexts_built_total 1",
        "kvwarden_ping_handling_seconds_bucket",
        "kvwarden_l1_slots",
        "kvwarden_process_exits_total 0",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    assert_eq!(server.http_get("/nope").0, 404);
}

#[test]
fn kvwarden_status_prints_a_table_and_json() {
    let dir = TempDir::new("statuscli");
    let server = Server::start(&dir, &[]);
    let worker = Worker::unix(&server, &[]);
    let socket = server.socket.to_string_lossy().into_owned();
    let output = std::process::Command::new(kvwarden_bin())
        .args(["status", "--socket", &socket])
        .output()
        .unwrap();
    assert!(output.status.success());
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("worker liveness: enabled"), "{table}");
    assert!(table.contains(&worker.instance_id.to_string()), "{table}");
    assert!(table.contains("server_driven"), "{table}");
    let output = std::process::Command::new(kvwarden_bin())
        .args(["status", "--socket", &socket, "--json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(find_instance(&json, worker.instance_id).is_some());
}

#[test]
fn status_json_ids_are_the_strings_of_get_status_and_the_log() {
    let dir = TempDir::new("status-ids");
    let server = Server::start(&dir, &[]);
    let worker = Worker::unix(&server, &[]);
    server.wait_status("proven", |s| {
        find_instance(s, worker.instance_id).is_some_and(|i| i["proven"] == true)
    });
    let socket = server.socket.to_string_lossy().into_owned();
    let output = std::process::Command::new(kvwarden_bin())
        .args(["status", "--socket", &socket, "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let cli: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let (code, body) = server.http_get("/status");
    assert_eq!(code, 200);
    let http: serde_json::Value = serde_json::from_str(&body).unwrap();
    // Strings, so that jq prints them exactly (a JSON number above 2^53 is rounded).
    let boot_id = cli["boot_id"]
        .as_str()
        .expect("boot_id a string")
        .to_string();
    assert_eq!(cli["boot_id"], http["boot_id"]);
    let logged = format!("boot_id={boot_id} ");
    assert!(
        server.log().contains(&logged),
        "{logged} not in:\n{}",
        server.log()
    );
    let id = worker.instance_id.to_string();
    for status in [&cli, &http] {
        assert!(
            status["instances"]
                .as_array()
                .is_some_and(|all| all.iter().any(|i| i["instance_id"] == id.as_str())),
            "instance {id} as a string: {status:#}"
        );
    }
    // `kvwarden call` prints ids as strings too (`hello` answers the boot id).
    let output = std::process::Command::new(kvwarden_bin())
        .args(["call", "--socket", &socket, "hello", "[2, \"test\"]"])
        .output()
        .unwrap();
    let reply: serde_json::Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {output:?}"));
    assert_eq!(reply["value"]["boot_id"], boot_id.as_str(), "{reply}");
}

#[test]
fn a_second_server_where_one_runs_is_refused_naming_its_socket_and_port() {
    let dir = TempDir::new("live-socket");
    let server = Server::start(&dir, &[]);
    let socket = server.socket.to_string_lossy().into_owned();
    let output = std::process::Command::new(kvwarden_bin())
        .args(["serve", "--socket", &socket, "--http", "off"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(
        message.contains(&format!(
            "a kvwarden server is already running on the socket {socket} ("
        )),
        "{message}"
    );
    // Its socket and its HTTP port: both named up front, in one message.
    let http = server
        .http
        .expect("the first server's HTTP address")
        .to_string();
    let output = std::process::Command::new(kvwarden_bin())
        .args(["serve", "--socket", &socket, "--http", &http])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(
        message.contains(&format!(
            "a kvwarden server is already running on the socket {socket} and HTTP {http} ("
        )) && message.contains("another --socket PATH and --http ADDR"),
        "{message}"
    );
    // Its HTTP port alone (another socket): named as a kvwarden server's, not as a bare
    // "Address already in use".
    let other = dir.path().join("other.sock");
    let output = std::process::Command::new(kvwarden_bin())
        .args(["serve", "--http", &http, "--socket"])
        .arg(&other)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(
        message.contains(&format!(
            "a kvwarden server is already running with HTTP on {http}"
        )),
        "{message}"
    );
    assert!(!other.exists(), "a refused start leaves no socket file");
    // The first server is untouched.
    assert_eq!(server.status()["worker_liveness"]["tracked_instances"], 0);
}

#[test]
fn row_17_reaping_disabled_reaps_nothing_but_process_exit_still_frees() {
    let dir = TempDir::new("row17");
    let server = Server::start_with_reaping(&dir, 0, 0, &["--tcp", "127.0.0.1:0"]);
    assert_eq!(server.status()["worker_liveness"]["enabled"], false);
    let invisible = Worker::tcp(&server, server.tcp.expect("tcp"));
    let visible = Worker::unix(&server, &[]);
    invisible.signal(Signal::KILL);
    visible.signal(Signal::KILL);
    let status = server.wait_status("the visible worker freed by its exit", |s| {
        find_instance(s, visible.instance_id).is_none()
    });
    assert_eq!(freed(&status, "process_exited"), 1);
    std::thread::sleep(Duration::from_millis(2500)); // past what T = 2 s would have been
    let status = server.status();
    assert!(
        find_instance(&status, invisible.instance_id).is_some(),
        "{status:#}"
    );
    assert_eq!(status["worker_liveness"]["reaped_total"], 0);
}
