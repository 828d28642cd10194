//! Garbage on the socket (row 24 of `docs/failure-modes.md`, target R4): every case is
//! answered as `protocol.md` says, only the hostile peer is affected, and afterwards the
//! server still serves a healthy worker (a separately registered `kvwarden worker`,
//! still tracked and never told `false`) and the test's own instance (registered on a
//! connection of its own with one 256 KiB memfd buffer: a fresh connection that
//! attaches it pings `true`), and holds no more fds or mappings than before.
//!
//! Cases that need an instance past the `attach` check (protocol 2) attach it first,
//! so that the refusal they look for is the one they name and not `forbidden`.
//!
//! Each test runs its case once to warm up (pool threads, allocator arenas and the
//! status connection come into being lazily), measures the server's
//! `/proc/<pid>/fd` entries and `/proc/<pid>/maps` lines, runs the case [`REPEATS`] more
//! times, and waits (bounded) until both are back at the baseline: a case that leaks one
//! fd or one mapping per run cannot pass.

use kvwarden_core::protocol::OP_NAMES;
use kvwarden_core::protocol::{ErrorCode, ProtocolError, encode_frame};
use kvwarden_tests::{PATIENCE, RawClient, Server, TempDir, Worker, find_instance, memfd_spec};
use rmpv::Value;
use rustix::fd::{AsFd, OwnedFd};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Runs of each case after the warm-up run.
const REPEATS: usize = 3;
/// `/proc/<pid>/maps` lines above the baseline tolerated after the repeats (the
/// allocator may split a region once); one leaked mapping per run exceeds it.
const MAPS_SLACK: usize = REPEATS - 1;

/// Bytes of the buffer the harness's own instance registers.
const OWNED_BUFFER_BYTES: u64 = 256 << 10;

/// A server with a healthy worker registered, to throw one kind of garbage at.
struct Harness {
    _dir: TempDir,
    server: Server,
    worker: Worker,
    /// The test's own instance (its secret is [`kvwarden_tests::instance_secret`]),
    /// registered with one [`OWNED_BUFFER_BYTES`] memfd buffer on `_owner`.
    owned: u64,
    _owner: RawClient,
    /// Worker connections the server holds when no hostile peer is connected.
    quiet_connections: u64,
}

impl Harness {
    fn start(tag: &str) -> Harness {
        let dir = TempDir::new(tag);
        // T and G long enough that the harness's own instance, which never pings on
        // its own, outlives the test.
        let server = Server::start(
            &dir,
            &[
                "--max-frame-bytes",
                "64K",
                "--worker-reap-timeout-seconds",
                "60",
                "--worker-registration-grace-seconds",
                "120",
            ],
        );
        let worker = Worker::unix(&server, &[]);
        let owned = fresh_instance();
        let mut owner = RawClient::connect_attached(&server.socket, owned);
        let memfd = kvwarden::memfd::create("hostile-owned", OWNED_BUFFER_BYTES).unwrap();
        let reply = owner
            .request_with_fds(
                "register_kv_cache",
                register_args(owned, vec![memfd_spec(0, OWNED_BUFFER_BYTES)]),
                &[memfd.as_fd()],
            )
            .unwrap();
        reply.result.expect("the harness's own instance registers");
        // The worker's heartbeat pings on a connection of its own: counted once it has.
        server.wait_status("the worker's first ping", |status| {
            status["worker_liveness"]["pings_total"].as_u64() >= Some(1)
        });
        let quiet_connections = server.status()["connections"].as_u64().unwrap_or(0);
        Harness {
            _dir: dir,
            server,
            worker,
            owned,
            _owner: owner,
            quiet_connections,
        }
    }

    /// Instances the server tracks when no case has registered anything: the worker's
    /// and the harness's own.
    const TRACKED: u64 = 2;

    fn pid(&self) -> u32 {
        self.server.child.id()
    }

    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|dir| dir.count())
            .unwrap_or(0)
    }

    /// The server's mappings, less the caches of its threads (see [`caches`]): a
    /// thread started under load to run a free keeps its stack cached by the C library
    /// after it ends, and may have made a malloc arena of its own.
    fn mappings(&self) -> usize {
        let maps = self.maps();
        maps.lines().count() - caches(&maps)
    }

    fn maps(&self) -> String {
        std::fs::read_to_string(format!("/proc/{}/maps", self.pid())).unwrap_or_default()
    }

    fn fd_targets(&self) -> Vec<String> {
        let mut targets: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|dir| {
                dir.filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
                    .map(|target| target.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        targets.sort();
        targets
    }

    fn connect(&self) -> RawClient {
        RawClient::connect(&self.server.socket).expect("connecting to the server")
    }

    /// Waits until the server has let go of every hostile connection.
    fn settle(&self) {
        self.server
            .wait_status("hostile connections closed", |status| {
                status["connections"].as_u64() == Some(self.quiet_connections)
            });
    }

    /// The server still serves: a fresh connection that attaches the harness's own
    /// instance pings it `true`, and the healthy worker is still tracked and was never
    /// answered `false` (its process is checked alive at the end of [`Harness::check`]).
    fn still_serving(&self) {
        let mut client = self.connect();
        assert_eq!(client.attach(self.owned), "proven");
        let reply = client
            .request("ping", vec![self.owned.into()])
            .expect("the server answers a ping");
        assert_eq!(
            reply.result.expect("ping succeeds"),
            Value::Boolean(true),
            "the harness's instance is no longer tracked; server log:\n{}",
            self.server.log()
        );
        let status = self.server.status();
        assert!(
            find_instance(&status, self.worker.instance_id).is_some(),
            "the healthy worker is no longer tracked: {status:#}"
        );
        assert_eq!(
            status["worker_liveness"]["pings_answered_false_total"], 0,
            "{status:#}"
        );
    }

    /// Warm-up, baseline, [`REPEATS`] runs, then: still serving, no fd or mapping more.
    fn check(mut self, case: impl Fn(&Harness)) {
        case(&self);
        self.settle();
        self.still_serving();
        self.settle();
        let (fds, maps) = (self.open_fds(), self.mappings());
        let (fds_before, maps_before) = (self.fd_targets(), self.maps());
        for _ in 0..REPEATS {
            case(&self);
        }
        self.settle();
        self.still_serving();
        self.settle();
        let deadline = std::time::Instant::now() + PATIENCE;
        while self.open_fds() > fds || self.mappings() > maps + MAPS_SLACK {
            if std::time::Instant::now() > deadline {
                // What stayed, to tell a leak from a cache (a thread's stack, an arena).
                let was: std::collections::HashSet<&str> = maps_before.lines().collect();
                let now = self.maps();
                let added: Vec<&str> = now.lines().filter(|line| !was.contains(line)).collect();
                panic!(
                    "fds and mappings not back at the baseline after {PATIENCE:?}: fds {} \
                     (baseline {fds}), mappings {} (baseline {maps} + {MAPS_SLACK});\n\
                     fds before: {fds_before:?}\nfds now: {:?}\nmappings added:\n{}",
                    self.open_fds(),
                    self.mappings(),
                    self.fd_targets(),
                    added.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            self.worker.child.try_wait().ok().flatten(),
            None,
            "the healthy worker process died"
        );
    }
}

fn error_of(client: &mut RawClient) -> (u64, ProtocolError) {
    let reply = client.read_reply().expect("an error reply");
    (reply.id, reply.result.expect_err("an error"))
}

fn request_error(client: &mut RawClient, op: &str, args: Vec<Value>) -> ProtocolError {
    let reply = client.request(op, args.clone()).expect("a reply");
    reply
        .result
        .expect_err(&format!("`{op}` {args:?} must be refused"))
}

/// A `bad_frame` reply to request id 0, then the server closes the connection.
fn assert_bad_frame_and_closed(client: &mut RawClient, what: &str) {
    let (id, error) = error_of(client);
    assert_eq!(error.code, ErrorCode::BadFrame, "{what}: {}", error.message);
    assert_eq!(id, 0, "{what}");
    assert!(client.is_closed_by_server(), "{what}: still open");
}

/// The connection is still usable after an error that does not break the stream.
fn assert_still_usable(client: &mut RawClient) {
    let reply = client.request("ping", vec![Value::Nil]).expect("a reply");
    assert_eq!(reply.result.expect("ping nil"), Value::Boolean(true));
}

fn assert_bad_args(error: &ProtocolError, op: &str, needle: &str) {
    assert_eq!(error.code, ErrorCode::BadArgs, "{op}: {}", error.message);
    assert!(error.message.contains(op), "{op}: {}", error.message);
    assert!(error.message.contains(needle), "{op}: {}", error.message);
}

/// Instance ids no other case uses.
fn fresh_instance() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1_000_000);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn register_args(instance: u64, buffers: Vec<Value>) -> Vec<Value> {
    vec![instance.into(), Value::Array(buffers), "m".into(), 1.into()]
}

fn msgpack(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).expect("encoding into a Vec");
    out
}

/// The ops of `protocol.md` with their argument counts.
const OPS: [(&str, usize); 21] = [
    ("hello", 2),
    ("auth", 1),
    ("attach", 2),
    ("ping", 1),
    ("register_kv_cache", 4),
    ("unregister_kv_cache", 1),
    ("store", 5),
    ("retrieve", 5),
    ("store_batch", 2),
    ("retrieve_batch", 2),
    ("lookup", 1),
    ("register_engine_driven", 3),
    ("unregister_engine_driven", 1),
    ("prepare_store", 2),
    ("commit_store", 3),
    ("prepare_retrieve", 2),
    ("commit_retrieve", 2),
    ("register_blend", 2),
    ("status", 0),
    ("kv_events", 2),
    ("describe_keys", 1),
];

/// Lines of `/proc/<pid>/maps` that are thread caches, not resources a peer can make
/// the server hold: a thread's stack (an anonymous `rw-p` mapping right after its
/// one-page `---p` guard) and a malloc arena (an anonymous `rw-p` start and its `---p`
/// reserve, 64 MiB together from a 64 MiB boundary).
fn caches(maps: &str) -> usize {
    const ARENA: u64 = 64 << 20;
    let parsed: Vec<(u64, u64, &str, bool)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?;
            let anonymous = fields.nth(2).is_some_and(|inode| inode == "0")
                && line.split_whitespace().nth(5).is_none();
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            Some((start, end, perms, anonymous))
        })
        .collect();
    let mut cached = 0;
    for pair in parsed.windows(2) {
        let [
            (start_a, end_a, perms_a, anon_a),
            (start_b, end_b, perms_b, anon_b),
        ] = pair
        else {
            continue;
        };
        if !(*anon_a && *anon_b && end_a == start_b) {
            continue;
        }
        let stack = *perms_a == "---p" && end_a - start_a == 4096 && *perms_b == "rw-p";
        let arena = *perms_a == "rw-p"
            && *perms_b == "---p"
            && start_a % ARENA == 0
            && end_b - start_a == ARENA;
        if stack || arena {
            cached += 2;
        }
    }
    cached
}

#[test]
fn thread_caches_are_told_from_other_mappings() {
    let stack = "7feb951cb000-7feb951cc000 ---p 00000000 00:00 0 \n\
                 7feb951cc000-7feb953cc000 rw-p 00000000 00:00 0 \n";
    let arena = "7feb78000000-7feb78021000 rw-p 00000000 00:00 0 \n\
                 7feb78021000-7feb7c000000 ---p 00000000 00:00 0 \n";
    let memfd = "7feb95000000-7feb95100000 rw-s 00000000 00:01 1234 /memfd:peer (deleted)\n";
    let lone = "7feb96000000-7feb96100000 rw-p 00000000 00:00 0 \n";
    assert_eq!(caches(&format!("{stack}{arena}")), 4);
    assert_eq!(
        caches(&format!("{memfd}{lone}")),
        0,
        "a peer's memfd, an anonymous map"
    );
}

// ------------------------------------------------------------------ framing

#[test]
fn row_24_truncated_length_prefix_gets_no_reply_and_only_that_peer_is_closed() {
    Harness::start("row24-trunc-len").check(|h| {
        let mut client = h.connect();
        client.send_bytes(&[0, 0]).unwrap();
        h.still_serving(); // a peer stuck mid-prefix blocks nobody
        client.stream.shutdown(Shutdown::Write).unwrap();
        assert!(client.is_closed_by_server(), "no reply, then EOF");
    });
}

#[test]
fn row_24_truncated_body_gets_no_reply_and_only_that_peer_is_closed() {
    Harness::start("row24-trunc-body").check(|h| {
        let mut client = h.connect();
        client.send_bytes(&[0, 0, 0, 50, 0x93, 0x01]).unwrap();
        h.still_serving();
        drop(client); // the peer goes away mid-frame
    });
}

#[test]
fn row_24_zero_length_frame_is_bad_frame_and_closes() {
    Harness::start("row24-zero").check(|h| {
        let mut client = h.connect();
        client.send_bytes(&[0, 0, 0, 0]).unwrap();
        assert_bad_frame_and_closed(&mut client, "N = 0");
    });
}

#[test]
fn row_24_length_above_the_limit_is_too_large_and_closes() {
    Harness::start("row24-huge").check(|h| {
        for length in [65_537u32, u32::MAX] {
            let mut client = h.connect();
            client.send_bytes(&length.to_be_bytes()).unwrap();
            let (id, error) = error_of(&mut client);
            assert_eq!((id, error.code), (0, ErrorCode::TooLarge));
            assert!(
                error.message.contains(&length.to_string()) && error.message.contains("65536"),
                "{}",
                error.message
            );
            assert!(client.is_closed_by_server());
        }
        // Exactly at the limit is accepted (and is garbage here, so bad_frame).
        let mut client = h.connect();
        client
            .send_bytes(&encode_frame(&vec![0xc1; 65_536]))
            .unwrap();
        assert_bad_frame_and_closed(&mut client, "a frame of exactly the limit");
    });
}

#[test]
fn row_24_non_msgpack_body_is_bad_frame_and_closes() {
    Harness::start("row24-not-msgpack").check(|h| {
        for body in [
            &b"\xc1\xc1\xc1"[..],            // reserved marker
            b"\x93\x01\xa4pi",               // a string cut short
            b"GET / HTTP/1.1\r\n\r\n",       // another protocol
            b"\x93\x01\xa4ping\x91\xc0\xc0", // trailing bytes after the request
            b"\xdd\xff\xff\xff\xff",         // an array claiming 4 G items
            b"\xc6\xff\xff\xff\xf0\x00\x00", // a bin claiming 4 GiB
        ] {
            let mut client = h.connect();
            client.send_bytes(&encode_frame(body)).unwrap();
            assert_bad_frame_and_closed(&mut client, &format!("{body:?}"));
        }
    });
}

#[test]
fn row_24_wrong_top_level_type_is_bad_frame_and_closes() {
    Harness::start("row24-top-level").check(|h| {
        let bodies = [
            Value::from(1),
            Value::from("ping"),
            Value::Map(vec![("op".into(), "ping".into())]),
            Value::Array(vec![1.into(), "ping".into()]),
            Value::Array(vec![
                1.into(),
                "ping".into(),
                Value::Array(vec![]),
                4.into(),
            ]),
            // request_id not an unsigned integer
            Value::Array(vec![
                "one".into(),
                "ping".into(),
                Value::Array(vec![Value::Nil]),
            ]),
            Value::Array(vec![
                (-1).into(),
                "ping".into(),
                Value::Array(vec![Value::Nil]),
            ]),
        ];
        for body in bodies {
            let mut client = h.connect();
            client.send_bytes(&encode_frame(&msgpack(&body))).unwrap();
            assert_bad_frame_and_closed(&mut client, &format!("{body}"));
        }
    });
}

#[test]
fn row_24_deep_nesting_is_bad_frame_and_closes() {
    Harness::start("row24-nesting").check(|h| {
        // 60,000 nested one-item arrays: fits a 64 KiB frame, far past the depth limit.
        let mut body = vec![0x91u8; 60_000];
        body.push(0xc0);
        let mut client = h.connect();
        client.send_bytes(&encode_frame(&body)).unwrap();
        assert_bad_frame_and_closed(&mut client, "deep nesting");
        // Nesting inside the arguments of a known op is refused too.
        let mut inner = vec![0x93, 0x05, 0xa4, b'p', b'i', b'n', b'g', 0x91];
        inner.extend(std::iter::repeat_n(0x91, 40));
        inner.push(0xc0);
        let mut client = h.connect();
        client.send_bytes(&encode_frame(&inner)).unwrap();
        assert_bad_frame_and_closed(&mut client, "deep nesting inside args");
    });
}

// ------------------------------------------------------------------ messages

#[test]
fn row_24_wrong_arity_for_every_op_is_bad_args_naming_the_op() {
    let mut listed: Vec<&str> = OPS.iter().map(|(op, _)| *op).collect();
    let mut known = OP_NAMES.to_vec();
    listed.sort_unstable();
    known.sort_unstable();
    assert_eq!(
        listed, known,
        "protocol.md's op table and the server disagree"
    );
    Harness::start("row24-arity").check(|h| {
        let mut client = h.connect();
        for (op, count) in OPS {
            // `hello` takes an optional third argument (its options map).
            let most = if op == "hello" { count + 1 } else { count };
            let mut wrong = vec![most + 1];
            if count > 0 {
                wrong.push(count - 1);
            }
            for n in wrong {
                let args = vec![Value::Nil; n];
                let error = request_error(&mut client, op, args);
                assert_bad_args(&error, op, &format!("{n} arguments instead of {count}"));
                assert!(error.message.contains("version"), "{}", error.message);
            }
        }
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_pre_liveness_ping_without_arguments_is_bad_args_naming_the_mismatch() {
    Harness::start("row24-mixed-version").check(|h| {
        let mut client = h.connect();
        let error = request_error(&mut client, "ping", vec![]);
        assert_bad_args(&error, "ping", "[instance_id: uint | nil]");
        assert!(error.message.contains("versions"), "{}", error.message);
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_wrong_types_are_bad_args_and_keep_the_connection() {
    Harness::start("row24-types").check(|h| {
        let mut client = h.connect();
        let id = Value::from(fresh_instance());
        let key = Value::Binary(b"k".to_vec());
        let cases: Vec<(&str, Vec<Value>, &str)> = vec![
            ("hello", vec!["one".into(), "c".into()], "`protocol`"),
            ("hello", vec![1.into(), 2.into()], "`client`"),
            ("ping", vec!["seven".into()], "`instance_id`"),
            ("ping", vec![Value::F64(1.0)], "`instance_id`"),
            (
                "register_kv_cache",
                vec![id.clone(), 2.into(), "m".into(), 1.into()],
                "`buffers`",
            ),
            (
                "register_kv_cache",
                register_args(7, vec![1.into()]),
                "buffers[0]",
            ),
            (
                "register_kv_cache",
                register_args(7, vec![Value::Map(vec![("kind".into(), "disk".into())])]),
                "buffers[0].kind",
            ),
            (
                "store",
                vec![id.clone(), 5.into(), 0.into(), 0.into(), 1.into()],
                "`key`",
            ),
            (
                "store",
                vec![id.clone(), key.clone(), "0".into(), 0.into(), 1.into()],
                "`buffer`",
            ),
            (
                "retrieve",
                vec![id.clone(), key.clone(), 0.into(), Value::Nil, 1.into()],
                "`offset`",
            ),
            (
                "retrieve",
                vec![id.clone(), key.clone(), 0.into(), 0.into(), "1".into()],
                "`nbytes`",
            ),
            ("attach", vec![id.clone(), 5.into()], "`secret`"),
            (
                "attach",
                vec!["7".into(), Value::Binary(vec![1; 32])],
                "`instance_id`",
            ),
            ("lookup", vec![Value::Array(vec![1.into()])], "`keys`"),
            ("lookup", vec![key.clone()], "`keys`"),
            (
                "commit_store",
                vec![id.clone(), key.clone(), true.into()],
                "`nbytes`",
            ),
            (
                "register_blend",
                vec![
                    id.clone(),
                    Value::Map(vec![("rotary_dim".into(), 1.into())]),
                ],
                "rope.",
            ),
        ];
        for (op, args, needle) in cases {
            let error = request_error(&mut client, op, args);
            assert_bad_args(&error, op, needle);
        }
        // The op itself not a string.
        let mut body = msgpack(&Value::Array(vec![
            77.into(),
            5.into(),
            Value::Array(vec![]),
        ]));
        client.send_bytes(&encode_frame(&body)).unwrap();
        let (request_id, error) = error_of(&mut client);
        assert_eq!((request_id, error.code), (77, ErrorCode::BadArgs));
        // args not an array.
        body = msgpack(&Value::Array(vec![78.into(), "ping".into(), Value::Nil]));
        client.send_bytes(&encode_frame(&body)).unwrap();
        let (request_id, error) = error_of(&mut client);
        assert_eq!((request_id, error.code), (78, ErrorCode::BadArgs));
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_instance_id_at_or_above_2_pow_63_is_bad_args_for_every_op_naming_one() {
    Harness::start("row24-big-id").check(|h| {
        let mut client = h.connect();
        let key = Value::Binary(b"k".to_vec());
        for big in [1u64 << 63, u64::MAX] {
            let id = Value::from(big);
            let cases: Vec<(&str, Vec<Value>)> = vec![
                ("ping", vec![id.clone()]),
                (
                    "register_kv_cache",
                    vec![id.clone(), Value::Array(vec![]), "m".into(), 1.into()],
                ),
                ("unregister_kv_cache", vec![id.clone()]),
                (
                    "store",
                    vec![id.clone(), key.clone(), 0.into(), 0.into(), 1.into()],
                ),
                (
                    "retrieve",
                    vec![id.clone(), key.clone(), 0.into(), 0.into(), 1.into()],
                ),
                ("attach", vec![id.clone(), Value::Binary(vec![1; 32])]),
                (
                    "register_engine_driven",
                    vec![id.clone(), "m".into(), 1.into()],
                ),
                ("unregister_engine_driven", vec![id.clone()]),
                ("prepare_store", vec![id.clone(), key.clone()]),
                ("commit_store", vec![id.clone(), key.clone(), 1.into()]),
                ("prepare_retrieve", vec![id.clone(), key.clone()]),
                ("commit_retrieve", vec![id.clone(), key.clone()]),
                ("register_blend", vec![id.clone(), Value::Map(vec![])]),
            ];
            for (op, args) in cases {
                let error = request_error(&mut client, op, args);
                assert_bad_args(&error, op, &big.to_string());
            }
        }
        let status = h.server.status();
        assert_eq!(
            status["worker_liveness"]["tracked_instances"],
            Harness::TRACKED,
            "{status:#}"
        );
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_negative_numbers_are_bad_args() {
    Harness::start("row24-negative").check(|h| {
        let mut client = h.connect();
        client.attach(h.owned);
        let id = Value::from(h.owned);
        let key = Value::Binary(b"k".to_vec());
        let cases: Vec<(&str, Vec<Value>, &str)> = vec![
            ("ping", vec![(-5).into()], "negative int -5"),
            ("hello", vec![(-1).into(), "c".into()], "negative int -1"),
            (
                "store",
                vec![id.clone(), key.clone(), 0.into(), (-1).into(), 1.into()],
                "`offset`",
            ),
            (
                "store",
                vec![id.clone(), key.clone(), 0.into(), 0.into(), (-8).into()],
                "`nbytes`",
            ),
            (
                "retrieve",
                vec![id.clone(), key.clone(), (-1).into(), 0.into(), 1.into()],
                "`buffer`",
            ),
            (
                "retrieve",
                vec![id.clone(), key.clone(), 0.into(), 0.into(), (-4).into()],
                "`nbytes`",
            ),
            (
                "attach",
                vec![(-3).into(), Value::Binary(vec![1; 32])],
                "negative int -3",
            ),
            (
                "register_kv_cache",
                vec![7.into(), Value::Array(vec![]), "m".into(), (-2).into()],
                "`world_size`",
            ),
            (
                "commit_store",
                vec![id.clone(), key.clone(), Value::from(i64::MIN)],
                "`nbytes`",
            ),
        ];
        for (op, args, needle) in cases {
            let error = request_error(&mut client, op, args);
            assert_bad_args(&error, op, needle);
        }
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_unknown_op_is_unknown_op_and_keeps_the_connection() {
    Harness::start("row24-unknown-op").check(|h| {
        let mut client = h.connect();
        for op in ["fly", "PING", "", &"x".repeat(10_000)] {
            let (id, frame) = client.frame(op, vec![Value::Nil]);
            client.send_bytes(&frame).unwrap();
            let (reply_id, error) = error_of(&mut client);
            assert_eq!((reply_id, error.code), (id, ErrorCode::UnknownOp));
            assert!(
                error.message.contains("ping"),
                "lists the known ops: {}",
                error.message
            );
            assert!(error.message.len() < 2_000, "echoes a bounded name");
        }
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_too_many_buffers_in_one_registration_is_bad_args() {
    Harness::start("row24-buffers").check(|h| {
        let mut client = h.connect();
        let instance = fresh_instance();
        client.attach(instance);
        let buffers = vec![memfd_spec(0, 4096); 1025];
        let error = request_error(
            &mut client,
            "register_kv_cache",
            register_args(instance, buffers),
        );
        assert_bad_args(&error, "register_kv_cache", "1025 buffers");
        assert_still_usable(&mut client);
    });
}

// ------------------------------------------------------------------ fds and buffers

#[test]
fn row_24_fds_sent_with_no_use_are_closed() {
    Harness::start("row24-unused-fds").check(|h| {
        let mut client = h.connect();
        let memfd = kvwarden::memfd::create("unused", 4096).unwrap();
        let (pipe_read, pipe_write) = rustix::pipe::pipe().unwrap();
        for _ in 0..20 {
            let fds = [memfd.as_fd(), pipe_read.as_fd(), pipe_write.as_fd()];
            let reply = client
                .request_with_fds("ping", vec![Value::Nil], &fds)
                .unwrap();
            assert_eq!(reply.result.unwrap(), Value::Boolean(true));
        }
        // fds with a frame that never completes, then the peer leaves.
        client
            .send_with_fds(&[0, 0, 0, 40, 0x93], &[memfd.as_fd(), pipe_write.as_fd()])
            .unwrap();
        drop(client);
        // And fds with a frame the server refuses outright.
        let mut client = h.connect();
        client
            .send_with_fds(&[0, 0, 0, 0], &[memfd.as_fd()])
            .unwrap();
        assert_bad_frame_and_closed(&mut client, "N = 0 with an fd");
    });
}

#[test]
fn row_24_fd_index_that_was_not_sent_is_bad_args() {
    Harness::start("row24-fd-index").check(|h| {
        let mut client = h.connect();
        let ids = [fresh_instance(), fresh_instance(), fresh_instance()];
        for instance in ids {
            client.attach(instance);
        }
        let error = request_error(
            &mut client,
            "register_kv_cache",
            register_args(ids[0], vec![memfd_spec(0, 4096)]),
        );
        assert_bad_args(&error, "register_kv_cache", "fd_index 0");
        assert!(error.message.contains("carried 0"), "{}", error.message);
        let memfd = kvwarden::memfd::create("one", 4096).unwrap();
        let args = register_args(ids[1], vec![memfd_spec(0, 4096), memfd_spec(1, 4096)]);
        let error = client
            .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
            .unwrap()
            .result
            .unwrap_err();
        assert_bad_args(&error, "register_kv_cache", "fd_index 1");
        let args = register_args(ids[2], vec![memfd_spec(u64::MAX, 4096)]);
        let error = client
            .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
            .unwrap()
            .result
            .unwrap_err();
        assert_bad_args(&error, "register_kv_cache", &u64::MAX.to_string());
        let status = h.server.status();
        assert_eq!(
            status["worker_liveness"]["tracked_instances"],
            Harness::TRACKED,
            "{status:#}"
        );
        assert_still_usable(&mut client);
    });
}

/// A peer that says `hello` with `sends_fds: false` and then sends fds anyway: the
/// kernel refuses them (`SO_PASSRIGHTS` off: the `sendmsg` fails with `EPERM`; on a
/// kernel without it they arrive and go as strays), the registration that needed one
/// is refused naming the promise, and the connection goes on answering. The same
/// registration on a connection that made no promise goes through.
#[test]
fn row_24_fds_sent_after_promising_none_never_reach_the_server() {
    Harness::start("row24-broken-promise").check(|h| {
        let memfd = kvwarden::memfd::create("promised-away", 4096).unwrap();
        let mut client = h.connect();
        let options = Value::Map(vec![("sends_fds".into(), false.into())]);
        let reply = client
            .request("hello", vec![1.into(), "hostile".into(), options])
            .expect("hello answered");
        let hello = kvwarden::server::status::msgpack_to_json(&reply.result.expect("hello"));
        assert_eq!(hello["sends_fds"], false, "{hello}");
        for _ in 0..5 {
            let instance = fresh_instance();
            client.attach(instance);
            let args = register_args(instance, vec![memfd_spec(0, 4096)]);
            let (id, frame) = client.frame("register_kv_cache", args);
            match client.send_with_fds(&frame, &[memfd.as_fd()]) {
                Ok(()) => {} // a kernel before 6.16: the fd arrives, as a stray
                Err(error) if error.raw_os_error() == Some(libc::EPERM) => {
                    client.send_bytes(&frame).unwrap();
                }
                Err(error) => panic!("sending the registration: {error}"),
            }
            let reply = client.read_reply().expect("the registration's reply");
            assert_eq!(reply.id, id);
            let error = reply.result.unwrap_err();
            assert_bad_args(&error, "register_kv_cache", "`sends_fds: false`");
        }
        assert_still_usable(&mut client);
        assert_eq!(
            h.server.status()["worker_liveness"]["tracked_instances"],
            Harness::TRACKED,
            "nothing registered"
        );
        // Both ways: without the promise the same memfd registers.
        let mut keeps_fds = h.connect();
        let instance = fresh_instance();
        keeps_fds.attach(instance);
        let reply = keeps_fds
            .request_with_fds(
                "register_kv_cache",
                register_args(instance, vec![memfd_spec(0, 4096)]),
                &[memfd.as_fd()],
            )
            .unwrap();
        assert!(reply.result.is_ok(), "{reply:?}");
        let reply = keeps_fds
            .request("unregister_kv_cache", vec![instance.into()])
            .unwrap();
        assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    });
}

fn sealed_memfd() -> OwnedFd {
    let fd = kvwarden::memfd::create("sealed", 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SEAL).unwrap();
    fd
}

#[test]
fn row_24_fd_that_is_not_a_usable_memfd_is_bad_args() {
    Harness::start("row24-not-memfd").check(|h| {
        let mut client = h.connect();
        let (pipe_read, _pipe_write) = rustix::pipe::pipe().unwrap();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let (socket, _other) = std::os::unix::net::UnixStream::pair().unwrap();
        let sealed = sealed_memfd();
        let candidates: [(&str, rustix::fd::BorrowedFd<'_>); 4] = [
            ("a pipe", pipe_read.as_fd()),
            ("a file", file.as_fd()),
            ("a socket", socket.as_fd()),
            ("a memfd sealed against sealing", sealed.as_fd()),
        ];
        for (what, fd) in candidates {
            let instance = fresh_instance();
            client.attach(instance);
            let args = register_args(instance, vec![memfd_spec(0, 16)]);
            let error = client
                .request_with_fds("register_kv_cache", args, &[fd])
                .unwrap()
                .result
                .expect_err(what);
            assert_eq!(error.code, ErrorCode::BadArgs, "{what}: {}", error.message);
            assert!(error.message.contains("memfd"), "{what}: {}", error.message);
            assert!(
                h.server.instance(instance).is_none(),
                "{what}: nothing registered"
            );
        }
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_buffer_smaller_than_claimed_is_bad_args() {
    Harness::start("row24-small-buffer").check(|h| {
        let mut client = h.connect();
        let small = kvwarden::memfd::create("small", 4096).unwrap();
        for claimed in [8192u64, u64::MAX] {
            let instance = fresh_instance();
            client.attach(instance);
            let args = register_args(instance, vec![memfd_spec(0, claimed)]);
            let error = client
                .request_with_fds("register_kv_cache", args, &[small.as_fd()])
                .unwrap()
                .result
                .unwrap_err();
            assert_eq!(error.code, ErrorCode::BadArgs, "{}", error.message);
            // A claim past the cap on mapped bytes never reaches the file (row 57).
            let named = if claimed == u64::MAX {
                "--max-mapped-bytes-per-instance"
            } else {
                "4096"
            };
            assert!(
                error.message.contains(named) && error.message.contains(&claimed.to_string()),
                "{}",
                error.message
            );
            assert!(h.server.instance(instance).is_none());
        }
        assert_still_usable(&mut client);
    });
}

#[test]
fn row_24_offsets_past_the_end_are_bad_args() {
    Harness::start("row24-range").check(|h| {
        let mut client = h.connect();
        client.attach(h.owned);
        let id = Value::from(h.owned);
        let key = Value::Binary(b"k".to_vec());
        // The harness's instance registered one buffer of 256 KiB; slots are 64 KiB.
        let store = |offset: u64, nbytes: u64| {
            vec![
                id.clone(),
                key.clone(),
                0.into(),
                offset.into(),
                nbytes.into(),
            ]
        };
        let cases: Vec<(&str, Vec<Value>, &str)> = vec![
            ("store", store(256 << 10, 16), "262144"),
            ("store", store((256 << 10) - 8, 16), "runs past the end"),
            ("store", store(u64::MAX, 16), "runs past the end"),
            ("store", store(8, u64::MAX), "runs past the end"),
            ("store", store(0, 128 << 10), "L1 slot"),
            (
                "store",
                vec![id.clone(), key.clone(), 9.into(), 0.into(), 16.into()],
                "buffer index 9",
            ),
            (
                "retrieve",
                vec![
                    id.clone(),
                    key.clone(),
                    0.into(),
                    (1u64 << 40).into(),
                    16.into(),
                ],
                "runs past the end",
            ),
            (
                "retrieve",
                vec![
                    id.clone(),
                    key.clone(),
                    0.into(),
                    ((256u64 << 10) - 8).into(),
                    16.into(),
                ],
                "runs past the end",
            ),
            (
                "retrieve",
                vec![
                    id.clone(),
                    key.clone(),
                    u64::MAX.into(),
                    0.into(),
                    16.into(),
                ],
                "buffer index",
            ),
        ];
        for (op, args, needle) in cases {
            let error = request_error(&mut client, op, args);
            assert_bad_args(&error, op, needle);
        }
        // A transfer for an instance the server does not hold is not_registered.
        let unknown = fresh_instance();
        client.attach(unknown);
        let error = request_error(
            &mut client,
            "retrieve",
            vec![unknown.into(), key.clone(), 0.into(), 0.into(), 16.into()],
        );
        assert_eq!(error.code, ErrorCode::NotRegistered, "{}", error.message);
        let status = h.server.status();
        assert_eq!(
            status["l1"]["slots_used"], 0,
            "nothing was stored: {status:#}"
        );
        assert_still_usable(&mut client);
    });
}

/// Not hostile: fds reach the registration they were sent with even when pipelined
/// requests sent just before it are still unread (the kernel then hands out those
/// frames and the fd-carrying one in a single read).
#[test]
fn fds_reach_their_frame_when_requests_are_pipelined_before_it() {
    Harness::start("fds-pipelined").check(|h| {
        let mut client = h.connect();
        let memfd = kvwarden::memfd::create("pipelined", 4096).unwrap();
        let instance = fresh_instance();
        client.attach(instance);
        let mut pings = Vec::new();
        for _ in 0..50 {
            pings.extend(client.frame("ping", vec![Value::Nil]).1);
        }
        let (register_id, register) = client.frame(
            "register_kv_cache",
            register_args(instance, vec![memfd_spec(0, 4096)]),
        );
        client.send_bytes(&pings).unwrap();
        client.send_with_fds(&register, &[memfd.as_fd()]).unwrap();
        for _ in 0..50 {
            let reply = client.read_reply().unwrap();
            assert_eq!(reply.result.unwrap(), Value::Boolean(true));
        }
        let reply = client.read_reply().unwrap();
        assert_eq!(reply.id, register_id);
        let outcome = reply
            .result
            .unwrap_or_else(|e| panic!("register refused: {e}"));
        assert_eq!(outcome["outcome"].as_str(), Some("created"));
        let was = client
            .request("unregister_kv_cache", vec![instance.into()])
            .unwrap()
            .result
            .unwrap();
        assert_eq!(was, Value::Boolean(true));
        h.server.wait_status("the context freed", |s| {
            kvwarden_tests::find_instance(s, instance).is_none()
        });
    });
}

/// Not hostile: the transfer path the refusals above guard, used as intended.
#[test]
fn store_then_retrieve_round_trips_through_l1() {
    let dir = TempDir::new("l1");
    let server = Server::start(&dir, &[]);
    let mut client = RawClient::connect_attached(&server.socket, 5);
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
        .request(
            "retrieve",
            vec![5.into(), key, 0.into(), 4000.into(), 14.into()],
        )
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
                14.into(),
            ],
        )
        .unwrap()
        .result
        .unwrap();
    assert_eq!(miss, Value::Nil);
}

// ------------------------------------------------------------------ peers that misbehave

#[test]
fn row_24_a_flood_without_reading_replies_disconnects_only_that_peer() {
    Harness::start("row24-flood").check(|h| {
        let mut flooder = h.connect();
        flooder.stream.set_write_timeout(Some(PATIENCE)).unwrap();
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
        assert!(h.server.log().contains("does not read its replies"));
    });
}

#[test]
fn row_24_half_open_connection_mid_frame_is_closed_without_a_reply() {
    Harness::start("row24-half-open").check(|h| {
        let frame = kvwarden_core::protocol::encode_request(1, "ping", vec![Value::Nil]);
        let mut client = h.connect();
        client.send_bytes(&frame[..frame.len() - 2]).unwrap();
        client.stream.shutdown(Shutdown::Write).unwrap();
        assert!(
            client.is_closed_by_server(),
            "EOF, no reply to half a frame"
        );
    });
}

#[test]
fn row_24_half_open_connection_after_whole_frames_still_gets_every_reply() {
    Harness::start("row24-half-close").check(|h| {
        let mut client = h.connect();
        client.attach(h.owned);
        let mut ids = Vec::new();
        let mut bytes = Vec::new();
        for _ in 0..3 {
            let (id, frame) = client.frame("ping", vec![h.owned.into()]);
            ids.push(id);
            bytes.extend(frame);
        }
        client.send_bytes(&bytes).unwrap();
        client.stream.shutdown(Shutdown::Write).unwrap();
        for id in ids {
            let reply = client
                .read_reply()
                .expect("a reply after the peer half-closed");
            assert_eq!(reply.id, id);
            assert_eq!(reply.result.unwrap(), Value::Boolean(true));
        }
        assert!(client.is_closed_by_server());
    });
}

// ------------------------------------------------------------------ HTTP

/// Sends `request` to the HTTP listener and reads the whole answer.
fn http(h: &Harness, request: &[u8]) -> String {
    let addr = h.server.http.expect("the test server listens on HTTP");
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .expect("the whole answer, then EOF");
    String::from_utf8_lossy(&answer).into_owned()
}

fn assert_healthz(h: &Harness) {
    let answer = http(h, b"GET /healthz HTTP/1.1\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
}

#[test]
fn row_24_http_garbage_is_answered_400_405_404() {
    Harness::start("row24-http-garbage").check(|h| {
        let cases: [(&[u8], &str); 5] = [
            (b"\x00\x01garbage\r\n\r\n", "HTTP/1.1 400 "),
            (b"GET /status HTTP/9.9\r\n\r\n", "HTTP/1.1 400 "),
            (
                b"GET /status HTTP/1.1\r\nBad Header\r\n\r\n",
                "HTTP/1.1 400 ",
            ),
            (b"DELETE /status HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "),
            (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", "HTTP/1.1 404 "),
        ];
        for (request, expected) in cases {
            let answer = http(h, request);
            assert!(answer.starts_with(expected), "{request:?}: {answer}");
        }
        // A peer that sends half a head and leaves.
        let addr = h.server.http.unwrap();
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.write_all(b"GET /sta").unwrap();
        drop(stream);
        assert_healthz(h);
    });
}

#[test]
fn row_24_oversized_http_request_is_431() {
    Harness::start("row24-http-huge").check(|h| {
        // Exactly the 8 KiB head limit with no end of head: the server has read it all
        // when it answers, so the answer is never lost to a reset.
        let mut request = b"GET /status HTTP/1.1\r\nX-Filler: ".to_vec();
        request.resize(kvwarden::server::http::MAX_REQUEST_BYTES, b'a');
        let answer = http(h, &request);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert_healthz(h);
    });
}
