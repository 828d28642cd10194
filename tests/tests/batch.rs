//! `store_batch` and `retrieve_batch` end to end: one request moves many blocks, each
//! item answers as its single op would, and a bad item refuses the batch untouched.

use kvwarden::client::{Client, ClientConfig, Endpoint, MemfdBuffer};
use kvwarden_core::protocol::ErrorCode;
use kvwarden_tests::{RawClient, Server, TempDir, memfd_spec};
use rmpv::Value;
use rustix::fd::AsFd;
use std::sync::Arc;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

fn connect(server: &Server) -> (Client, Arc<MemfdBuffer>, Arc<MemfdBuffer>) {
    let client = Client::connect(ClientConfig::new(Endpoint::Unix(server.socket.clone())))
        .expect("connecting");
    let source = Arc::new(MemfdBuffer::new((BLOCK * BLOCKS) as usize).unwrap());
    let target = Arc::new(MemfdBuffer::new((BLOCK * BLOCKS) as usize).unwrap());
    client
        .register(vec![Arc::clone(&source), Arc::clone(&target)], "batch", 1)
        .expect("registering");
    (client, source, target)
}

/// Block `i`'s bytes: distinct per block and per byte.
fn pattern(i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|b| (b.wrapping_mul(31) ^ i.wrapping_mul(131)) as u8)
        .collect()
}

fn read(buffer: &MemfdBuffer, offset: u64) -> Vec<u8> {
    let mut out = vec![0; BLOCK as usize];
    assert!(buffer.read(offset, &mut out));
    out
}

fn l1(server: &Server, field: &str) -> u64 {
    server.status()["l1"][field].as_u64().unwrap()
}

#[test]
fn a_batch_of_stores_then_a_batch_of_retrieves_moves_every_block() {
    let dir = TempDir::new("batch-roundtrip");
    let server = Server::start(&dir, &[]);
    let (client, source, target) = connect(&server);
    for i in 0..BLOCKS {
        assert!(source.write(i * BLOCK, &pattern(i)));
    }
    let keys: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|i| format!("block-{i}").into_bytes())
        .collect();
    let stores: Vec<(&[u8], u64, u64, u64)> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| (key.as_slice(), 0, i as u64 * BLOCK, BLOCK))
        .collect();
    assert_eq!(
        client.store_batch(&stores).unwrap(),
        vec![true; BLOCKS as usize]
    );
    assert_eq!(client.lookup(&keys).unwrap(), BLOCKS);

    // Mixed hits and misses, each block to a reversed position in the target buffer.
    let missing: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|i| format!("absent-{i}").into_bytes())
        .collect();
    let mut retrieves: Vec<(&[u8], u64, u64, u64)> = Vec::new();
    for i in 0..BLOCKS {
        let key = if i % 4 == 3 {
            &missing[i as usize]
        } else {
            &keys[i as usize]
        };
        retrieves.push((key.as_slice(), 1, (BLOCKS - 1 - i) * BLOCK, BLOCK));
    }
    let answers = client.retrieve_batch(&retrieves).unwrap();
    for i in 0..BLOCKS {
        let at = (BLOCKS - 1 - i) * BLOCK;
        if i % 4 == 3 {
            assert_eq!(answers[i as usize], None, "item {i} is a miss");
            assert_eq!(
                read(&target, at),
                vec![0; BLOCK as usize],
                "a miss copies nothing"
            );
        } else {
            assert_eq!(answers[i as usize], Some(BLOCK), "item {i}");
            assert_eq!(read(&target, at), pattern(i), "block {i}'s bytes");
        }
    }
    // Storing the same keys again: already stored, answered true without a copy.
    assert_eq!(
        client.store_batch(&stores).unwrap(),
        vec![true; BLOCKS as usize]
    );
    assert_eq!(client.store_batch(&[]).unwrap(), Vec::<bool>::new());
    assert_eq!(
        client.retrieve_batch(&[]).unwrap(),
        Vec::<Option<u64>>::new()
    );
    assert_eq!(l1(&server, "slots_pinned"), 0, "every pin released");
    assert_eq!(
        l1(&server, "slots_reserved"),
        0,
        "every reservation settled"
    );
    // One request each, counted under its own op; no single transfer was sent (every
    // op's series exists from the start, at 0).
    assert_eq!(requests(&server, "store_batch"), Some(3.0));
    assert_eq!(requests(&server, "retrieve_batch"), Some(2.0));
    assert_eq!(requests(&server, "store"), Some(0.0));
    client.shutdown().unwrap();
}

fn requests(server: &Server, op: &str) -> Option<f64> {
    let (code, body) = server.http_get("/metrics");
    assert_eq!(code, 200);
    let start = format!("kvwarden_requests_total{{op=\"{op}\"}}");
    body.lines()
        .find_map(|line| line.strip_prefix(start.as_str()))
        .and_then(|value| value.trim().parse().ok())
}

#[test]
fn a_bad_item_refuses_the_whole_batch_and_copies_nothing() {
    let dir = TempDir::new("batch-bad-item");
    let server = Server::start(&dir, &[]);
    let (client, source, target) = connect(&server);
    assert!(source.write(0, &pattern(1)));
    let good: &[u8] = b"good";
    let other: &[u8] = b"other";
    for (items, says) in [
        (
            vec![(good, 0, 0, BLOCK), (other, 7, 0, BLOCK)],
            "items[1]: buffer index 7",
        ),
        (
            vec![
                (good, 0, 0, BLOCK),
                (other, 0, 0, BLOCK),
                (b"x".as_slice(), 0, BLOCK * BLOCKS, 1),
            ],
            "items[2]: offset",
        ),
        (
            vec![(good, 0, 0, 1 << 17)],
            "items[0]: nbytes 131072 is larger than an L1 slot",
        ),
    ] {
        let error = client.store_batch(&items).unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadArgs), "{error}");
        assert!(
            error.to_string().contains(says),
            "{says:?} missing: {error}"
        );
        assert!(error.to_string().contains("`store_batch`"), "{error}");
        assert_eq!(
            client.lookup(&[good.to_vec()]).unwrap(),
            0,
            "nothing stored"
        );
    }

    assert_eq!(
        client.store_batch(&[(good, 0, 0, BLOCK)]).unwrap(),
        vec![true]
    );
    // The value fits at offset 0, not at the last byte: known only once pinned.
    let last = BLOCK * BLOCKS - 1;
    for (items, says) in [
        (
            vec![(good, 1, 0, BLOCK), (good, 9, 0, BLOCK)],
            "items[1]: buffer index 9",
        ),
        (
            vec![(good, 1, 0, BLOCK), (good, 1, last, BLOCK)],
            "items[1]: offset",
        ),
    ] {
        let error = client.retrieve_batch(&items).unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::BadArgs), "{error}");
        assert!(
            error.to_string().contains(says),
            "{says:?} missing: {error}"
        );
        assert_eq!(read(&target, 0), vec![0; BLOCK as usize], "nothing copied");
    }
    assert_eq!(
        l1(&server, "slots_pinned"),
        0,
        "a refused batch leaves no pin"
    );
    assert_eq!(
        client.retrieve_batch(&[(good, 1, 0, BLOCK)]).unwrap(),
        vec![Some(BLOCK)]
    );
    assert_eq!(read(&target, 0), pattern(1));
    client.shutdown().unwrap();
}

#[test]
fn a_batch_for_an_unregistered_instance_is_not_registered() {
    let dir = TempDir::new("batch-unregistered");
    let server = Server::start(&dir, &[]);
    let mut raw = RawClient::connect(&server.socket).unwrap();
    let item = |parts: Vec<Value>| Value::Array(vec![Value::Array(parts)]);
    let store_item = || {
        item(vec![
            Value::Binary(b"k".to_vec()),
            0.into(),
            0.into(),
            8.into(),
        ])
    };
    let retrieve_item = || {
        item(vec![
            Value::Binary(b"k".to_vec()),
            0.into(),
            0.into(),
            8.into(),
        ])
    };
    // Before `attach` the id may not be named at all (protocol 2).
    for (op, items) in [
        ("store_batch", store_item()),
        ("retrieve_batch", retrieve_item()),
    ] {
        let reply = raw.request(op, vec![31337.into(), items]).unwrap();
        let error = reply.result.unwrap_err();
        assert_eq!(error.code, ErrorCode::Forbidden, "{op}: {}", error.message);
        assert!(error.message.contains("attach"), "{}", error.message);
    }
    assert_eq!(raw.attach(31337), "claimed");
    for (op, items) in [
        ("store_batch", store_item()),
        ("retrieve_batch", retrieve_item()),
    ] {
        let reply = raw.request(op, vec![31337.into(), items]).unwrap();
        let error = reply.result.unwrap_err();
        assert_eq!(
            error.code,
            ErrorCode::NotRegistered,
            "{op}: {}",
            error.message
        );
        assert!(error.message.contains(op), "{}", error.message);
    }

    // A registered one answers per item over the raw protocol too.
    let memfd = kvwarden::memfd::create("batch-raw", 8192).unwrap();
    let args = vec![
        31337.into(),
        Value::Array(vec![memfd_spec(0, 8192)]),
        "m".into(),
        1.into(),
    ];
    let reply = raw
        .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
        .unwrap();
    assert!(reply.result.is_ok());
    let reply = raw
        .request("retrieve_batch", vec![31337.into(), retrieve_item()])
        .unwrap();
    assert_eq!(reply.result.unwrap(), Value::Array(vec![Value::Nil]));
}

#[test]
fn a_batch_for_an_instance_the_server_forgot_re_registers_and_goes_through() {
    let dir = TempDir::new("batch-recover");
    // T = 2 s, G = 4 s: a registration that never pings is reaped at G (only the worker
    // holds its secret, so nobody else can unregister it behind its back any more).
    let server = Server::start(&dir, &[]);
    server.expect_pings_answered_false(
        "the instance is reaped behind the client's back: the heartbeat's first ping \
         may ask before the batch has re-registered it (an unknown id, rightly told)",
    );
    let (client, source, _) = connect(&server);
    assert!(source.write(0, &pattern(7)));
    let instance = client.instance_id().get();
    // No transfer yet, so no heartbeat: the registration is reaped at G.
    server.wait_status("the silent registration reaped", |status| {
        kvwarden_tests::find_instance(status, instance).is_none()
            && kvwarden_tests::freed(status, "reaped") == 1
    });
    assert_eq!(
        client.store_batch(&[(b"after", 0, 0, BLOCK)]).unwrap(),
        vec![true],
        "answered not_registered, re-registered, sent again"
    );
    // The batch's own recovery, and possibly the heartbeat's: the batch starts the
    // heartbeat, whose first ping races it and answers false when it lands between the
    // reap and the batch's re-registration (then the heartbeat recovers too, and finds
    // the registration there).
    let recoveries = client.recoveries();
    assert!((1..=2).contains(&recoveries), "{recoveries} recoveries");
    assert_eq!(client.identity_changes(), 0, "the same id all along");
    assert_eq!(client.instance_id().get(), instance);
    assert_eq!(
        client.retrieve_batch(&[(b"after", 1, 0, BLOCK)]).unwrap(),
        vec![Some(BLOCK)]
    );
    client.shutdown().unwrap();
}
