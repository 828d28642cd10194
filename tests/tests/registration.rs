//! Registration semantics and ownership: rows 13, 14, 15 and 23 of docs/failure-modes.md.

use kvwarden_core::protocol::ErrorCode;
use kvwarden_tests::{
    PATIENCE, RawClient, Server, TempDir, Worker, built, find_instance, memfd_spec, wait_for,
};
use rmpv::Value;
use rustix::fd::AsFd;

#[test]
fn row_13_pre_liveness_ping_is_bad_args_naming_the_mismatch() {
    let dir = TempDir::new("row13");
    let server = Server::start(&dir, &[]);
    let mut client = RawClient::connect(&server.socket).unwrap();
    let reply = client.request("ping", vec![]).unwrap();
    let error = reply.result.unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    for words in [
        "`ping`",
        "[instance_id: uint | nil]",
        "0 arguments",
        "versions",
    ] {
        assert!(
            error.message.contains(words),
            "{words:?} missing: {}",
            error.message
        );
    }
    // Loud, never silent, and the connection stays usable.
    let reply = client.request("ping", vec![Value::Nil]).unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
}

#[test]
fn row_14_unregister_of_unknown_instance_answers_false() {
    let dir = TempDir::new("row14");
    let server = Server::start(&dir, &[]);
    let mut client = RawClient::connect(&server.socket).unwrap();
    // An id never registered can still be attached (claimed): the unregister is then
    // about registration, not about who may name the id.
    assert_eq!(client.attach(12345), "claimed");
    assert_eq!(client.attach(777), "claimed");
    let reply = client
        .request("unregister_kv_cache", vec![12345.into()])
        .unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(false));
    // Already freed: register, unregister, unregister again.
    let args = vec![777.into(), Value::Array(vec![]), "m".into(), 1.into()];
    let reply = client.request("register_kv_cache", args).unwrap();
    assert!(reply.result.is_ok());
    let reply = client
        .request("unregister_kv_cache", vec![777.into()])
        .unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let reply = client
        .request("unregister_kv_cache", vec![777.into()])
        .unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(false));
    let status = server.status();
    assert_eq!(status["worker_liveness"]["tracked_instances"], 0);
    assert!(server.log().contains("not registered here"));
}

#[test]
fn row_15_register_of_present_instance_refreshes_without_rebuilding() {
    let dir = TempDir::new("row15");
    let server = Server::start(&dir, &[]);
    let mut client = RawClient::connect_attached(&server.socket, 4242);
    let memfd = kvwarden::memfd::create("row15", 8192).unwrap();
    let register = |client: &mut RawClient| {
        let args = vec![
            4242.into(),
            Value::Array(vec![memfd_spec(0, 8192)]),
            "m".into(),
            1.into(),
        ];
        let reply = client
            .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
            .unwrap();
        let value = reply.result.unwrap();
        kvwarden::server::status::msgpack_to_json(&value)["outcome"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(register(&mut client), "created");
    assert_eq!(register(&mut client), "refreshed");
    let status = server.status();
    assert_eq!(built(&status), 1);
    assert_eq!(
        find_instance(&status, 4242).unwrap()["proven"],
        false,
        "proven unchanged"
    );
    let reply = client.request("ping", vec![4242.into()]).unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    assert_eq!(register(&mut client), "refreshed");
    let status = server.status();
    assert_eq!(
        find_instance(&status, 4242).unwrap()["proven"],
        true,
        "proven unchanged"
    );
    assert_eq!(built(&status), 1, "nothing rebuilt");
}

#[test]
fn row_23_other_uid_is_forbidden_and_instance_untouched() {
    let is_root = rustix::process::getuid().is_root();
    let setpriv = std::path::Path::new("/usr/bin/setpriv");
    if !is_root || !setpriv.exists() {
        println!("SKIPPED row 23: needs root and /usr/bin/setpriv to act as another uid");
        return;
    }
    let dir = TempDir::new("row23");
    let server = Server::start(&dir, &["--socket-mode", "666"]);
    let worker = Worker::unix(&server, &[]);
    let id = worker.instance_id.to_string();
    let socket = server.socket.to_string_lossy().into_owned();
    let as_nobody = |op: &str, args: &str| {
        let output = std::process::Command::new(setpriv)
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(kvwarden_tests::kvwarden_bin())
            .args(["call", "--socket", &socket, op, args])
            .output()
            .expect("running kvwarden call as nobody");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (stdout, stderr)
    };
    let (probe, stderr) = as_nobody("ping", "[null]");
    if !probe.contains("\"ok\":true") {
        println!(
            "SKIPPED row 23: nobody cannot run the binary or reach the socket: {probe} {stderr}"
        );
        return;
    }
    let before = server.status();
    for (op, args) in [
        ("unregister_kv_cache", format!("[{id}]")),
        ("ping", format!("[{id}]")),
        ("register_kv_cache", format!("[{id}, [], \"m\", 1]")),
        ("store", format!("[{id}, \"k\", 0, 0, 16]")),
    ] {
        let (reply, stderr) = as_nobody(op, &args);
        assert!(
            reply.contains("\"code\":\"forbidden\""),
            "{op}: {reply} {stderr}"
        );
        // Protocol 2: `kvwarden call` never attached the worker's id (only the worker
        // holds its secret).
        assert!(reply.contains("has not attached"), "{op}: {reply}");
    }
    let after = server.status();
    let entry = find_instance(&after, worker.instance_id).expect("instance untouched");
    assert_eq!(built(&after), built(&before));
    assert_eq!(entry["owner_uid"], 0);
    // Protocol 2 (row 30): the server's own uid may NOT act on an instance it has not
    // attached: root's ping of the worker's id is forbidden, and so is root's attach
    // of it with a secret other than the worker's.
    let mut root = RawClient::connect(&server.socket).unwrap();
    let error = root
        .request("ping", vec![worker.instance_id.into()])
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::Forbidden, "{}", error.message);
    let error = root
        .attach_with(worker.instance_id, &kvwarden_tests::instance_secret(1))
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::Forbidden, "{}", error.message);
    let error = root
        .request("unregister_kv_cache", vec![worker.instance_id.into()])
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::Forbidden, "{}", error.message);
    let after = server.status();
    assert!(find_instance(&after, worker.instance_id).is_some());
    assert_eq!(built(&after), built(&before));
}

/// Sends `register_kv_cache` for `instance` with one memfd of `actual` bytes claimed as
/// `claimed` bytes; returns the request id (the reply is read later).
fn send_register(client: &mut RawClient, instance: u64, actual: u64, claimed: u64) -> u64 {
    let memfd = kvwarden::memfd::create("row15-building", actual).unwrap();
    let args = vec![
        instance.into(),
        Value::Array(vec![memfd_spec(0, claimed)]),
        "m".into(),
        1.into(),
    ];
    let (id, frame) = client.frame("register_kv_cache", args);
    client.send_with_fds(&frame, &[memfd.as_fd()]).unwrap();
    id
}

#[test]
fn row_15_register_while_building_is_answered_after_the_build_succeeds() {
    let dir = TempDir::new("row15-building-ok");
    let server = Server::start(&dir, &["--fault-build-delay-ms", "300"]);
    let mut first = RawClient::connect_attached(&server.socket, 5151);
    let mut second = RawClient::connect_attached(&server.socket, 5151);
    send_register(&mut first, 5151, 8192, 8192);
    // The second REGISTER arrives while the first build sleeps.
    wait_for("the first build to start", PATIENCE, || {
        find_instance(&server.status(), 5151).filter(|i| i["building"] == true)
    });
    let id = send_register(&mut second, 5151, 8192, 8192);
    let reply = second.read_reply().unwrap();
    assert_eq!(reply.id, id);
    let value = kvwarden::server::status::msgpack_to_json(&reply.result.unwrap());
    assert_eq!(value["outcome"], "refreshed");
    // Answered only once the context it refers to exists.
    let status = server.status();
    assert_eq!(find_instance(&status, 5151).unwrap()["building"], false);
    assert_eq!(built(&status), 1, "one context, built once");
    let created = first.read_reply().unwrap().result.unwrap();
    assert_eq!(
        kvwarden::server::status::msgpack_to_json(&created)["outcome"],
        "created"
    );
}

#[test]
fn row_15_register_while_building_fails_with_the_build_it_joined() {
    let dir = TempDir::new("row15-building-fail");
    let server = Server::start(&dir, &["--fault-build-delay-ms", "300"]);
    let mut first = RawClient::connect_attached(&server.socket, 6161);
    let mut second = RawClient::connect_attached(&server.socket, 6161);
    // The first claims more bytes than its memfd holds: its build will fail.
    send_register(&mut first, 6161, 4096, 1 << 20);
    wait_for("the first build to start", PATIENCE, || {
        find_instance(&server.status(), 6161).filter(|i| i["building"] == true)
    });
    send_register(&mut second, 6161, 8192, 8192);
    let error = second.read_reply().unwrap().result.unwrap_err();
    assert_eq!(error.code.as_str(), "not_registered", "{}", error.message);
    assert!(
        error.message.contains("register again"),
        "{}",
        error.message
    );
    let error = first.read_reply().unwrap().result.unwrap_err();
    assert_eq!(error.code.as_str(), "bad_args", "{}", error.message);
    // Nothing is held, and a fresh REGISTER builds one context.
    assert!(find_instance(&server.status(), 6161).is_none());
    send_register(&mut second, 6161, 8192, 8192);
    let created = second.read_reply().unwrap().result.unwrap();
    assert_eq!(
        kvwarden::server::status::msgpack_to_json(&created)["outcome"],
        "created"
    );
}
