//! KV events (issue 42, failure mode 74): `kv_events` tells a reader what entered and
//! left L1 in its tenant, in order, so that what it announces is what the server can
//! serve it. Real `kvwarden serve`, the Rust client, and a neighbour of another uid
//! (forked and setuid: the tests run as root).

mod engine_support;

use engine_support::{Helper, l1};
use kvwarden::client::{Client, ClientConfig, Endpoint, KvEvents};
use kvwarden_core::protocol::ReplyValue;
use kvwarden_tests::l2_worker::{chunk, store, worker};
use kvwarden_tests::{RawClient, Server, TempDir, find_instance, fork_as_uid};
use rmpv::Value;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A chunk: one slot (`--slot-bytes 64K`; 16 slots in `--l1-bytes 1M`).
const CHUNK: u64 = 64 << 10;
const SLOTS: u64 = 16;
/// The neighbour.
const NEIGHBOUR: u32 = 1001;

fn start(dir: &TempDir) -> Server {
    Server::start(
        dir,
        &[
            "--socket-mode",
            "666",
            "--l1-bytes",
            "1M",
            "--slot-bytes",
            "64K",
        ],
    )
}

fn key(n: u64) -> Vec<u8> {
    format!("chunk-{n}").into_bytes()
}

/// A reader's view: the keys it announces, kept by applying every page.
#[derive(Default)]
struct Reader {
    cursor: Vec<u8>,
    announced: BTreeSet<Vec<u8>>,
    resyncs: u64,
    /// Every change read, in order: (stored, key).
    changes: Vec<(bool, Vec<u8>)>,
    /// The description each announced key came with, where it had one.
    described: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Reader {
    fn apply(&mut self, page: KvEvents) -> bool {
        if page.resync {
            self.resyncs += 1;
            self.announced.clear();
            self.described.clear();
        }
        for event in page.events {
            if event.stored {
                self.announced.insert(event.key.clone());
                match event.meta {
                    Some(meta) => self.described.insert(event.key.clone(), meta),
                    None => self.described.remove(&event.key),
                };
            } else {
                self.announced.remove(&event.key);
                self.described.remove(&event.key);
            }
            self.changes.push((event.stored, event.key));
        }
        self.cursor = page.cursor;
        page.more
    }

    /// Reads until caught up.
    fn catch_up(&mut self, client: &Client) {
        while self.apply(client.kv_events(&self.cursor, 4).expect("kv_events")) {}
    }
}

fn reader_client(server: &Server) -> Client {
    Client::connect(ClientConfig::new(Endpoint::Unix(server.socket.clone()))).expect("connecting")
}

#[test]
fn row_74_a_reader_announces_exactly_what_l1_serves_through_stores_and_evictions() {
    let dir = TempDir::new("kv-events-74");
    let server = start(&dir);
    let (client, buffer) = worker(&server, "m");
    for n in 0..3 {
        store(&client, &buffer, &key(n), &chunk(n, CHUNK));
    }
    let events = reader_client(&server);
    let mut reader = Reader::default();
    reader.catch_up(&events);
    assert_eq!(reader.resyncs, 1, "a new reader starts with what is held");
    assert_eq!(reader.announced, (0..3).map(key).collect());
    let status = server.status();
    assert_eq!(status["l1"]["events"]["resyncs_total"], 1, "{status}");
    assert_eq!(status["l1"]["events"]["changes"], 3, "{status}");
    let (_, metrics) = server.http_get("/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "kvwarden_kv_events_resyncs_total 1"),
        "{metrics}"
    );

    // Twice the pool more: the oldest are evicted, and each eviction is told.
    for n in 3..3 + 2 * SLOTS {
        store(&client, &buffer, &key(n), &chunk(n, CHUNK));
    }
    reader.catch_up(&events);
    assert_eq!(reader.resyncs, 1, "nothing was missed: no resync");
    assert!(
        reader.changes.contains(&(false, key(0))),
        "chunk-0's eviction was told"
    );
    // What the reader announces is what the server serves: every announced key is a
    // hit, byte for byte, and every key never announced or withdrawn is a miss.
    assert_eq!(reader.announced.len() as u64, SLOTS);
    for n in 0..3 + 2 * SLOTS {
        let hit = client.retrieve(&key(n), 0, 0, CHUNK).expect("retrieve") == Some(CHUNK);
        assert_eq!(hit, reader.announced.contains(&key(n)), "chunk-{n}");
        if hit {
            let mut got = vec![0u8; CHUNK as usize];
            assert!(buffer.read(0, &mut got));
            assert!(got == chunk(n, CHUNK), "chunk-{n} bytes");
        }
    }

    // A cursor of a server process that is gone is a resync, whatever it says.
    drop(events);
    drop(client);
    let mut server = server;
    server.child.kill().expect("SIGKILL");
    server.child.wait().expect("reaped");
    let dir = TempDir::new("kv-events-74-restarted");
    let server = start(&dir);
    let events = reader_client(&server);
    let page = events.kv_events(&reader.cursor, 4).expect("kv_events");
    assert!(page.resync, "another server process: start over");
    assert!(page.events.is_empty(), "the new server holds nothing");
}

/// `raw`'s `kv_events` until caught up, from a new cursor: the keys announced.
fn announced_by(raw: &mut RawClient) -> BTreeSet<Vec<u8>> {
    read_through(raw).announced
}

/// A new reader's view, read through to the end.
fn read_through(raw: &mut RawClient) -> Reader {
    let mut reader = Reader::default();
    loop {
        let reply = raw
            .request(
                "kv_events",
                vec![Value::Binary(reader.cursor.clone()), 4.into()],
            )
            .expect("a reply")
            .result
            .expect("kv_events answered");
        let page = KvEvents::from_value(&reply).expect("a kv_events reply");
        if !reader.apply(page) {
            return reader;
        }
    }
}

/// Stores `chunk-<n>` from a raw connection of its own instance, registered with a
/// memfd of one chunk.
fn neighbour_stores(socket: &Path, n: u64) -> RawClient {
    use rustix::fd::AsFd;
    let instance = 7400 + n;
    let mut raw = RawClient::connect(socket).expect("connecting");
    raw.attach(instance);
    let fd = kvwarden::memfd::create("kv-events", CHUNK).expect("a memfd");
    let args = vec![
        instance.into(),
        Value::Array(vec![kvwarden_tests::memfd_spec(0, CHUNK)]),
        "m".into(),
        1.into(),
    ];
    raw.request_with_fds("register_kv_cache", args, &[fd.as_fd()])
        .expect("a reply")
        .result
        .expect("registered");
    let args = vec![
        instance.into(),
        Value::Binary(key(n)),
        0.into(),
        0.into(),
        CHUNK.into(),
    ];
    let stored = raw.request("store", args).expect("a reply").result;
    assert_eq!(stored, Ok(Value::Boolean(true)));
    raw
}

#[test]
fn row_74_a_neighbour_reads_its_own_tenants_events_and_none_of_anothers() {
    let dir = TempDir::new("kv-events-74-neighbour");
    let server = start(&dir);
    let (client, buffer) = worker(&server, "m");
    for n in 0..3 {
        store(&client, &buffer, &key(n), &chunk(n, CHUNK));
    }
    let socket = server.socket.clone();
    let mut neighbour = fork_as_uid(NEIGHBOUR, move |parent| {
        // Control: its own store is announced to it.
        let mut raw = neighbour_stores(&socket, 100);
        let announced: Vec<String> = announced_by(&mut raw)
            .into_iter()
            .map(|key| String::from_utf8_lossy(&key).into_owned())
            .collect();
        parent.send(json!(announced));
        json!(null)
    });
    assert_eq!(
        neighbour.recv("the neighbour's announced keys"),
        json!(["chunk-100"]),
        "its own chunk, and none of root's chunk-0..2 (the same names, another tenant)"
    );
    neighbour.finish("the neighbour");
    // And root's reader sees root's chunks, not the neighbour's.
    let mut reader = Reader::default();
    reader.catch_up(&reader_client(&server));
    assert_eq!(reader.announced, (0..3).map(key).collect());
}

/// `describe_keys` of one key from a raw connection: its answer.
fn describe(raw: &mut RawClient, key: &[u8], meta: &[u8]) -> Option<bool> {
    let item = Value::Array(vec![
        Value::Binary(key.to_vec()),
        Value::Binary(meta.to_vec()),
    ]);
    let answers = raw
        .request("describe_keys", vec![Value::Array(vec![item])])
        .expect("a reply")
        .result
        .expect("describe_keys answered");
    match answers.as_array().map(Vec::as_slice) {
        Some([answer]) => answer.as_bool(),
        _ => None,
    }
}

#[test]
fn row_74_a_neighbour_describes_its_own_keys_and_cannot_describe_anothers() {
    let dir = TempDir::new("kv-events-74-describe");
    let server = start(&dir);
    let (client, buffer) = worker(&server, "m");
    for n in 0..2 {
        store(&client, &buffer, &key(n), &chunk(n, CHUNK));
    }
    let root_meta: &[u8] = b"root's description";
    assert_eq!(
        client
            .describe_keys(&[(&key(0), root_meta)])
            .expect("describe_keys"),
        vec![true]
    );
    let socket = server.socket.clone();
    let mut neighbour = fork_as_uid(NEIGHBOUR, move |parent| {
        // Control: it describes its own chunk, and its reader gets the description.
        let mut raw = neighbour_stores(&socket, 100);
        let own = describe(&mut raw, &key(100), b"mine");
        // The attack: root's chunks, by their names (its tenant holds none of them).
        let forged_0 = describe(&mut raw, &key(0), b"forged");
        let forged_1 = describe(&mut raw, &key(1), b"forged");
        let seen: BTreeMap<String, String> = read_through(&mut raw)
            .described
            .into_iter()
            .map(|(k, m)| {
                (
                    String::from_utf8_lossy(&k).into(),
                    String::from_utf8_lossy(&m).into(),
                )
            })
            .collect();
        parent.send(json!([own, forged_0, forged_1, seen]));
        json!(null)
    });
    assert_eq!(
        neighbour.recv("the neighbour's answers and the descriptions it reads"),
        json!([true, false, false, {"chunk-100": "mine"}]),
        "its own key described and read back; root's keys refused, and none of root's \
         descriptions reach its reader"
    );
    neighbour.finish("the neighbour");
    // Root's reader: root's description on chunk-0, none on chunk-1, nothing forged.
    let mut reader = Reader::default();
    reader.catch_up(&reader_client(&server));
    assert_eq!(reader.announced, (0..2).map(key).collect());
    assert_eq!(
        reader.described,
        BTreeMap::from([(key(0), root_meta.to_vec())]),
        "only root's own description"
    );
}

/// The helper process of the process-exit test (a no-op when run as a test).
#[test]
fn helper_process_engine_worker() {
    engine_support::run_helper_if_asked();
}

#[test]
fn row_74_a_killed_engine_workers_unpublished_write_is_never_announced() {
    let dir = TempDir::new("kv-events-74-killed");
    let server = start(&dir);
    let client = reader_client(&server);
    let mut reader = Reader::default();
    reader.catch_up(&client);
    // An engine-driven worker publishes one key and reserves another (written, never
    // committed), then is SIGKILLed: the reservation is discarded with its context.
    let helper = Helper::spawn(
        "helper_process_engine_worker",
        &server.socket,
        7411,
        "engine,store:pub-k,reserve:half-k",
    );
    helper.kill();
    server.wait_status("7411 freed (process_exited)", |s| {
        find_instance(s, 7411).is_none() && l1(s, "slots_reserved") == 0
    });
    reader.catch_up(&client);
    assert!(
        reader.announced.contains(&b"pub-k"[..]),
        "control: the published key is announced"
    );
    assert!(
        !reader.changes.iter().any(|(_, key)| key == b"half-k"),
        "the unpublished write is never announced, nor withdrawn: {:?}",
        reader.changes
    );
    // Nor in a new reader's snapshot.
    let mut fresh = Reader::default();
    fresh.catch_up(&client);
    assert_eq!(fresh.announced, BTreeSet::from([b"pub-k".to_vec()]));
}

/// A version 3 description (`kvwarden.kv_announce.encode_meta`) of a one-shard block
/// whose key is `key` and whose hash is `hash`.
fn description(key: &[u8], hash: &str) -> Vec<u8> {
    let value = Value::Array(vec![
        3.into(),
        Value::Binary(key.to_vec()),
        Value::Binary(hash.as_bytes().to_vec()),
        Value::Nil,
        Value::Array(vec![1.into(), 2.into()]),
        Value::Nil,
        Value::Nil,
        Value::Array(vec![Value::Binary(key.to_vec())]),
        Value::Nil,
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &value).unwrap();
    bytes
}

/// The hashes a subscriber holds after replaying a node-scoped stream from its start:
/// `BlockStored` adds, `BlockRemoved` takes away, `AllBlocksCleared` empties (vLLM's
/// `KVEventBatch`, `[ts, [event, …]]`, each event a map tagged `type`).
fn replayed(replay: &str) -> BTreeSet<String> {
    let socket = zmq::Context::new().socket(zmq::DEALER).unwrap();
    socket.set_linger(0).unwrap();
    socket.connect(replay).unwrap();
    socket
        .send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
        .unwrap();
    let mut held = BTreeSet::new();
    loop {
        assert!(socket.poll(zmq::POLLIN, 30_000).unwrap() > 0, "no replay");
        let frames = socket.recv_multipart(0).unwrap();
        let [_, _topic, seq, payload] = &frames[..] else {
            panic!("a replay frame of 4 parts: {frames:?}")
        };
        if seq[..] == (-1i64).to_be_bytes() {
            return held;
        }
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        for event in batch[1].as_array().unwrap() {
            let field = |name: &str| {
                event
                    .as_map()
                    .unwrap()
                    .iter()
                    .find(|(k, _)| k.as_str() == Some(name))
                    .map(|(_, v)| v.clone())
            };
            let hashes = field("block_hashes")
                .map(|h| h.as_array().unwrap().clone())
                .unwrap_or_default();
            let hashes = hashes
                .iter()
                .map(|h| String::from_utf8_lossy(h.as_slice().unwrap()).into_owned());
            match field("type").unwrap().as_str().unwrap() {
                "BlockStored" => held.extend(hashes),
                "BlockRemoved" => hashes.for_each(|h| {
                    held.remove(&h);
                }),
                "AllBlocksCleared" => held.clear(),
                other => panic!("an event of type {other}"),
            }
        }
    }
}

/// Replays `replay` until it holds `want` (the stream's thread sends a batch shortly
/// after the request that made it).
fn stream_holds(replay: &str, want: &[&str]) -> BTreeSet<String> {
    let want: BTreeSet<String> = want.iter().map(|h| h.to_string()).collect();
    let mut held = replayed(replay);
    for _ in 0..100 {
        if held == want {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        held = replayed(replay);
    }
    held
}

#[test]
fn row_74_the_servers_stream_announces_its_tenants_blocks_and_none_of_a_neighbours() {
    let dir = TempDir::new("kv-events-74-stream");
    let at = |name: &str| format!("ipc://{}/{name}", dir.path().display());
    let (root, neighbour) = (
        format!("uid-0={},replay={}", at("root"), at("root-replay")),
        format!("uid-{NEIGHBOUR}={},replay={}", at("nb"), at("nb-replay")),
    );
    let mut flags = vec![
        "--socket-mode",
        "666",
        "--l1-bytes",
        "1M",
        "--slot-bytes",
        "64K",
    ];
    flags.extend(["--kv-events", &root, "--kv-events", &neighbour]);
    let server = Server::start(&dir, &flags);
    // A live subscriber, for the server's last batch.
    let live = zmq::Context::new().socket(zmq::SUB).unwrap();
    live.set_subscribe(b"").unwrap();
    live.connect(&at("root")).unwrap();
    let (client, buffer) = worker(&server, "m");
    store(&client, &buffer, &key(0), &chunk(0, CHUNK));
    let described = client.describe_keys(&[(&key(0), &description(&key(0), "root-0")[..])]);
    assert_eq!(described.expect("describe_keys"), vec![true]);
    let socket = server.socket.clone();
    let mut other = fork_as_uid(NEIGHBOUR, move |parent| {
        // Control: its own block, described, is announced on its tenant's stream.
        let mut raw = neighbour_stores(&socket, 100);
        let own = describe(&mut raw, &key(100), &description(&key(100), "nb-100"));
        // The attack: a description of root's chunk by its name, with a hash of its own.
        let forged = describe(&mut raw, &key(0), &description(&key(0), "forged"));
        parent.send(json!([own, forged]));
        json!(null)
    });
    assert_eq!(other.recv("the neighbour's answers"), json!([true, false]));
    other.finish("the neighbour");
    assert_eq!(
        stream_holds(&at("nb-replay"), &["nb-100"]),
        BTreeSet::from(["nb-100".to_string()]),
        "the neighbour's stream: its block"
    );
    assert_eq!(
        stream_holds(&at("root-replay"), &["root-0"]),
        BTreeSet::from(["root-0".to_string()]),
        "root's stream: root's block, none of the neighbour's, nothing forged"
    );
    // The chunk leaves L1 (16 more chunks evict it): withdrawn.
    for n in 1..=SLOTS {
        store(&client, &buffer, &key(n), &chunk(n, CHUNK));
    }
    assert_eq!(stream_holds(&at("root-replay"), &[]), BTreeSet::new());
    // A server that stops says so: its last batch ends with AllBlocksCleared.
    let (status, log) = server.terminate();
    assert!(status.success(), "{log}");
    let mut last = None;
    while live.poll(zmq::POLLIN, 2_000).unwrap() > 0 {
        last = live.recv_multipart(0).ok();
    }
    let payload = last
        .expect("the live subscriber got batches")
        .pop()
        .unwrap();
    let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let events = batch[1].as_array().unwrap();
    assert_eq!(
        events.last().unwrap()["type"],
        Value::from("AllBlocksCleared"),
        "{batch}"
    );
}

#[test]
fn a_stream_for_no_tenant_of_the_server_stops_its_start_naming_it() {
    let dir = TempDir::new("kv-events-no-tenant");
    let endpoint = format!("nobody=ipc://{}/ev", dir.path().display());
    // Control: a uid's tenant is one; the server starts.
    let control = format!("uid-0=ipc://{}/ok", dir.path().display());
    drop(Server::start(&dir, &["--kv-events", &control]));
    let output = std::process::Command::new(kvwarden_tests::kvwarden_bin())
        .args(["serve", "--http", "off", "--socket"])
        .arg(dir.path().join("other.sock"))
        .args(["--kv-events", &endpoint])
        .output()
        .expect("running kvwarden");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "started: {stderr}");
    assert!(
        stderr.contains("--kv-events nobody: no such tenant"),
        "names the tenant and the fix: {stderr}"
    );
}
