//! Row 20 and the test-only fault switches of `kvwarden serve`: a free that never
//! returns (a hung CUDA call) and slow builds must not hold up pings, registers or
//! other frees; the hung free is reported after `--free-watchdog-seconds`.

use kvwarden_tests::{
    PATIENCE, RawClient, Server, TempDir, find_instance, freed, kvwarden_bin, wait_for,
};
use rmpv::Value;

fn register_kv(raw: &mut RawClient, instance: u64) -> Value {
    raw.request(
        "register_kv_cache",
        vec![instance.into(), Value::Array(vec![]), "m".into(), 1.into()],
    )
    .unwrap()
    .result
    .expect("register_kv_cache")
}

fn unregister_kv(raw: &mut RawClient, instance: u64) -> bool {
    let reply = raw
        .request("unregister_kv_cache", vec![instance.into()])
        .unwrap();
    reply.result.unwrap().as_bool().unwrap()
}

fn outcome(value: &Value) -> &str {
    value
        .as_map()
        .and_then(|map| map.iter().find(|(k, _)| k.as_str() == Some("outcome")))
        .and_then(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no outcome in {value}"))
}

fn frees_in_flight(status: &serde_json::Value) -> u64 {
    status["contexts"]["frees_in_flight"].as_u64().unwrap()
}

fn frees_hung(status: &serde_json::Value) -> u64 {
    status["contexts"]["frees_hung_total"].as_u64().unwrap()
}

#[test]
fn row_20_hung_free_does_not_block_pings_or_other_frees() {
    let dir = TempDir::new("row20");
    let server = Server::start(
        &dir,
        &[
            "--fault-free-hang-instances",
            "1",
            "--free-watchdog-seconds",
            "0.5",
        ],
    );
    wait_for("the loud fault-injection log line", PATIENCE, || {
        server.log().contains("FAULT INJECTION ON").then_some(())
    });
    let mut raw = RawClient::connect(&server.socket).unwrap();
    for instance in [2001, 2002, 2003] {
        raw.attach(instance);
    }

    // The first free hangs for good.
    register_kv(&mut raw, 2001);
    assert!(unregister_kv(&mut raw, 2001));
    let status = server.status();
    assert_eq!(frees_in_flight(&status), 1, "{status}");

    // The loop keeps serving: pings, registers (builds), other frees.
    for _ in 0..100 {
        let reply = raw.request("ping", vec![Value::Nil]).unwrap();
        assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    }
    for instance in [2002, 2003] {
        let registered = register_kv(&mut raw, instance);
        assert_eq!(outcome(&registered), "created");
        let reply = raw.request("ping", vec![instance.into()]).unwrap();
        assert_eq!(reply.result.unwrap(), Value::Boolean(true));
        assert!(unregister_kv(&mut raw, instance));
    }
    let status = server.wait_status("the other frees finished", |s| {
        freed(s, "unregistered") == 3 && frees_in_flight(s) == 1
    });
    assert!(find_instance(&status, 2002).is_none());

    // The hung one is reported once the watchdog period has passed: log and metric.
    server.wait_status("the hung free reported", |s| frees_hung(s) == 1);
    let metrics = server.http_get("/metrics").1;
    assert!(metrics.contains("kvwarden_frees_hung_total 1"), "{metrics}");
    wait_for("the watchdog's log line", PATIENCE, || {
        server
            .log()
            .contains("still running after the watchdog period")
            .then_some(())
    });
    // ... and the loop still turns afterwards, with the hung free still in flight.
    assert!(server.http_get("/healthz").1.contains("ok"));
    let reply = raw.request("ping", vec![Value::Nil]).unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let status = server.status();
    assert_eq!((frees_in_flight(&status), frees_hung(&status)), (1, 1));
}

#[test]
fn slow_builds_do_not_hold_up_pings() {
    let dir = TempDir::new("slow-builds");
    let server = Server::start(&dir, &["--fault-build-delay-ms", "1500"]);
    let mut registering = RawClient::connect_attached(&server.socket, 2101);
    let (id, frame) = registering.frame(
        "register_kv_cache",
        vec![2101.into(), Value::Array(vec![]), "m".into(), 1.into()],
    );
    registering.send_bytes(&frame).unwrap();
    // While the build sleeps, the entry is building and pings are answered.
    let status = server.wait_status("2101 building", |s| {
        find_instance(s, 2101).is_some_and(|entry| entry["building"] == true)
    });
    assert_eq!(kvwarden_tests::built(&status), 0);
    // Another connection of the same worker proves the same secret.
    let mut pinger = RawClient::connect_attached(&server.socket, 2101);
    let reply = pinger.request("ping", vec![2101.into()]).unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let error = pinger
        .request(
            "store",
            vec![
                2101.into(),
                Value::Binary(b"k".to_vec()),
                0.into(),
                0.into(),
                1.into(),
            ],
        )
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code.as_str(), "not_ready");
    let reply = registering.read_reply().unwrap();
    assert_eq!(reply.id, id);
    assert_eq!(outcome(&reply.result.unwrap()), "created");
    assert_eq!(kvwarden_tests::built(&server.status()), 1);
}

#[test]
fn fault_switches_are_hidden_and_refused_without_allow_short_timeouts() {
    let help = std::process::Command::new(kvwarden_bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--allow-short-timeouts"), "{help}");
    assert!(!help.contains("--fault"), "hidden from --help: {help}");

    let dir = TempDir::new("fault-refused");
    let socket = dir.path().join("kvwarden.sock");
    for flag in ["--fault-free-hang-instances", "--fault-build-delay-ms"] {
        let output = std::process::Command::new(kvwarden_bin())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(["--http", "off", flag, "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag}: {stderr}");
        assert!(
            stderr.contains("--allow-short-timeouts"),
            "{flag}: {stderr}"
        );
        assert!(!socket.exists(), "{flag}: the server never started");
    }
    // Without faults the same command line starts (and is stopped at once).
    let mut child = std::process::Command::new(kvwarden_bin())
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--http", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the plain server's socket", PATIENCE, || {
        socket.exists().then_some(())
    });
    kvwarden_tests::signal(&child, rustix::process::Signal::TERM);
    let status = kvwarden_tests::wait_exit(&mut child, PATIENCE).expect("exits");
    assert!(status.success());
}
