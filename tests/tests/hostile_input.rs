//! Garbage on the socket (row 24, a first set): each case is answered as protocol.md
//! says, only that peer is affected, the server keeps serving a healthy worker, and no
//! fd leaks.

use kvwarden::protocol::{ErrorCode, encode_frame};
use kvwarden_tests::{RawClient, Server, TempDir, Worker, find_instance, memfd_spec};
use rmpv::Value;
use rustix::fd::AsFd;

fn open_fds(server: &Server) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", server.child.id()))
        .map(|dir| dir.count())
        .unwrap_or(0)
}

/// The server still answers a healthy worker.
fn still_serving(server: &Server, worker: &Worker) {
    let mut client = RawClient::connect(&server.socket).unwrap();
    let reply = client
        .request("ping", vec![worker.instance_id.into()])
        .unwrap();
    assert_eq!(
        reply.result.unwrap(),
        Value::Boolean(true),
        "the healthy worker is no longer tracked; server log:\n{}",
        server.log()
    );
    assert!(find_instance(&server.status(), worker.instance_id).is_some());
}

fn error_of(client: &mut RawClient) -> (u64, kvwarden::protocol::ProtocolError) {
    let reply = client.read_reply().expect("an error reply");
    (reply.id, reply.result.expect_err("an error"))
}

fn setup(tag: &str) -> (TempDir, Server, Worker) {
    let dir = TempDir::new(tag);
    let server = Server::start(&dir, &["--max-frame-bytes", "64K"]);
    let worker = Worker::unix(&server, &[]);
    (dir, server, worker)
}

#[test]
fn row_24_zero_length_frame_is_bad_frame_and_closes() {
    let (_dir, server, worker) = setup("row24-zero");
    let mut client = RawClient::connect(&server.socket).unwrap();
    client.send_bytes(&[0, 0, 0, 0]).unwrap();
    let (_, error) = error_of(&mut client);
    assert_eq!(error.code, ErrorCode::BadFrame);
    assert!(client.is_closed_by_server());
    still_serving(&server, &worker);
}

#[test]
fn row_24_length_above_the_limit_is_too_large_and_closes() {
    let (_dir, server, worker) = setup("row24-huge");
    let mut client = RawClient::connect(&server.socket).unwrap();
    client.send_bytes(&[0xff, 0xff, 0xff, 0xff]).unwrap();
    let (_, error) = error_of(&mut client);
    assert_eq!(error.code, ErrorCode::TooLarge);
    assert!(
        error.message.contains("4294967295") && error.message.contains("65536"),
        "{}",
        error.message
    );
    assert!(client.is_closed_by_server());
    still_serving(&server, &worker);
}

#[test]
fn row_24_non_msgpack_and_wrong_top_level_types_are_bad_frame() {
    let (_dir, server, worker) = setup("row24-garbage");
    for body in [
        &b"\xc1\xc1\xc1"[..],
        b"\x01",
        b"\xa3abc",
        b"\x92\x01\x02",
        b"\x93\xa1x\xa4ping\x90",
    ] {
        let mut client = RawClient::connect(&server.socket).unwrap();
        client.send_bytes(&encode_frame(body)).unwrap();
        let (_, error) = error_of(&mut client);
        assert_eq!(error.code, ErrorCode::BadFrame, "{body:?}");
        assert!(client.is_closed_by_server(), "{body:?}");
    }
    still_serving(&server, &worker);
}

#[test]
fn row_24_unknown_op_and_wrong_args_keep_the_connection() {
    let (_dir, server, worker) = setup("row24-args");
    let mut client = RawClient::connect(&server.socket).unwrap();
    let cases: Vec<(&str, Vec<Value>, ErrorCode)> = vec![
        ("fly", vec![], ErrorCode::UnknownOp),
        (
            "register_kv_cache",
            vec![1.into(), 2.into()],
            ErrorCode::BadArgs,
        ),
        ("ping", vec!["seven".into()], ErrorCode::BadArgs),
        ("ping", vec![Value::from(1u64 << 63)], ErrorCode::BadArgs),
        ("ping", vec![Value::from(-5)], ErrorCode::BadArgs),
        (
            "store",
            vec![1.into(), 2.into(), 3.into(), 4.into(), 5.into()],
            ErrorCode::BadArgs,
        ),
        (
            "lookup",
            vec![Value::Array(vec![1.into()])],
            ErrorCode::BadArgs,
        ),
        ("status", vec![1.into()], ErrorCode::BadArgs),
    ];
    for (op, args, code) in cases {
        let reply = client.request(op, args.clone()).unwrap();
        let error = reply.result.expect_err(op);
        assert_eq!(error.code, code, "{op} {args:?}: {}", error.message);
        if code == ErrorCode::BadArgs {
            assert!(error.message.contains(op), "{}", error.message);
        }
    }
    let reply = client.request("ping", vec![Value::Nil]).unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true), "still usable");
    still_serving(&server, &worker);
}

#[test]
fn row_24_bad_fds_are_refused_and_unused_fds_closed() {
    let (_dir, server, worker) = setup("row24-fds");
    server.status(); // its persistent connection counts in the baseline
    let baseline = open_fds(&server);
    let mut client = RawClient::connect(&server.socket).unwrap();
    // An fd index that was not sent.
    let args = vec![
        1.into(),
        Value::Array(vec![memfd_spec(0, 4096)]),
        "m".into(),
        1.into(),
    ];
    let error = client
        .request("register_kv_cache", args)
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains("fd_index 0"), "{}", error.message);
    // A memfd smaller than claimed.
    let small = kvwarden::memfd::create("small", 4096).unwrap();
    let args = vec![
        2.into(),
        Value::Array(vec![memfd_spec(0, 8192)]),
        "m".into(),
        1.into(),
    ];
    let error = client
        .request_with_fds("register_kv_cache", args, &[small.as_fd()])
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(
        error.message.contains("4096") && error.message.contains("8192"),
        "{}",
        error.message
    );
    // Not a memfd at all.
    let (pipe_read, _pipe_write) = rustix::pipe::pipe().unwrap();
    let args = vec![
        3.into(),
        Value::Array(vec![memfd_spec(0, 16)]),
        "m".into(),
        1.into(),
    ];
    let error = client
        .request_with_fds("register_kv_cache", args, &[pipe_read.as_fd()])
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains("not a memfd"), "{}", error.message);
    // fds with a frame that does not use them.
    for _ in 0..20 {
        let reply = client
            .request_with_fds(
                "ping",
                vec![Value::Nil],
                &[small.as_fd(), pipe_read.as_fd()],
            )
            .unwrap();
        assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    }
    let status = server.status();
    assert_eq!(
        status["worker_liveness"]["tracked_instances"], 1,
        "{status:#}"
    );
    drop(client);
    kvwarden_tests::wait_for("fds back to the baseline", kvwarden_tests::PATIENCE, || {
        (open_fds(&server) <= baseline).then_some(())
    });
    still_serving(&server, &worker);
}

#[test]
fn row_24_out_of_range_transfers_and_cuda_buffers_are_refused() {
    let (_dir, server, worker) = setup("row24-range");
    let mut client = RawClient::connect(&server.socket).unwrap();
    let id: Value = worker.instance_id.into();
    let key = Value::Binary(b"k".to_vec());
    let error = client
        .request(
            "store",
            vec![
                id.clone(),
                key.clone(),
                0.into(),
                (256u64 << 10).into(),
                16.into(),
            ],
        )
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains("262144"), "{}", error.message);
    let error = client
        .request(
            "store",
            vec![id.clone(), key.clone(), 9.into(), 0.into(), 16.into()],
        )
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(
        error.message.contains("buffer index 9"),
        "{}",
        error.message
    );
    let error = client
        .request(
            "store",
            vec![id.clone(), key, 0.into(), 0.into(), (1u64 << 20).into()],
        )
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    let error = client
        .request(
            "retrieve",
            vec![
                4_000_000.into(),
                Value::Binary(b"k".to_vec()),
                0.into(),
                0.into(),
            ],
        )
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::NotRegistered);
    let cuda = Value::Map(vec![
        ("kind".into(), "cuda_ipc".into()),
        ("device".into(), 0.into()),
        ("handle".into(), Value::Binary(vec![0; 64])),
        ("offset".into(), 0.into()),
        ("nbytes".into(), 1024.into()),
    ]);
    let args = vec![99.into(), Value::Array(vec![cuda]), "m".into(), 1.into()];
    let error = client
        .request("register_kv_cache", args)
        .unwrap()
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::Unavailable);
    assert!(error.message.contains("CUDA"), "{}", error.message);
    still_serving(&server, &worker);
}

#[test]
fn row_24_truncated_frame_and_half_open_peer_affect_only_that_peer() {
    let (_dir, server, worker) = setup("row24-trunc");
    let mut client = RawClient::connect(&server.socket).unwrap();
    client.send_bytes(&[0, 0, 0, 50, 0x93, 0x01]).unwrap();
    still_serving(&server, &worker);
    drop(client);
    still_serving(&server, &worker);
}

#[test]
fn store_then_retrieve_round_trips_through_l1() {
    let dir = TempDir::new("l1");
    let server = Server::start(&dir, &[]);
    let mut client = RawClient::connect(&server.socket).unwrap();
    let memfd = kvwarden::memfd::create("l1", 8192).unwrap();
    let mapping = kvwarden::memfd::SharedMapping::map(&memfd, 8192).unwrap();
    assert!(mapping.write(100, b"kv-cache-bytes"));
    let args = vec![
        5.into(),
        Value::Array(vec![memfd_spec(0, 8192)]),
        "m".into(),
        1.into(),
    ];
    client
        .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
        .unwrap()
        .result
        .unwrap();
    let key = Value::Binary(b"chunk-1".to_vec());
    let stored = client
        .request(
            "store",
            vec![5.into(), key.clone(), 0.into(), 100.into(), 14.into()],
        )
        .unwrap()
        .result
        .unwrap();
    assert_eq!(stored, Value::Boolean(true));
    let found = client
        .request(
            "lookup",
            vec![Value::Array(vec![
                key.clone(),
                Value::Binary(b"nope".to_vec()),
            ])],
        )
        .unwrap()
        .result
        .unwrap();
    assert_eq!(found.as_u64(), Some(1));
    let copied = client
        .request("retrieve", vec![5.into(), key, 0.into(), 4000.into()])
        .unwrap()
        .result
        .unwrap();
    assert_eq!(copied.as_u64(), Some(14));
    let mut out = [0u8; 14];
    assert!(mapping.read(4000, &mut out));
    assert_eq!(&out, b"kv-cache-bytes");
    let miss = client
        .request(
            "retrieve",
            vec![
                5.into(),
                Value::Binary(b"nope".to_vec()),
                0.into(),
                0.into(),
            ],
        )
        .unwrap()
        .result
        .unwrap();
    assert_eq!(miss, Value::Nil);
}

#[test]
fn row_24_a_flood_without_reading_replies_disconnects_only_that_peer() {
    let (_dir, server, worker) = setup("row24-flood");
    let mut flooder = RawClient::connect(&server.socket).unwrap();
    flooder
        .stream
        .set_write_timeout(Some(kvwarden_tests::PATIENCE))
        .unwrap();
    let (_, ping) = flooder.frame("ping", vec![Value::Nil]);
    let batch: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 10_000)
        .collect();
    // Never read: the server's output buffer for this peer fills, and it hangs up.
    let mut sent = 0usize;
    let disconnected = (0..2_000).any(|_| {
        let failed = flooder.send_bytes(&batch).is_err();
        sent += batch.len();
        failed
    });
    assert!(
        disconnected,
        "still connected after {sent} bytes of pings never read"
    );
    still_serving(&server, &worker);
    assert!(server.log().contains("does not read its replies"));
}
