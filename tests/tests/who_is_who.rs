//! Who is who (issue 24, protocol 3): failure-mode rows 30–37 and 65 end to end, with a real
//! `kvwarden serve`, real sockets, real TCP and real processes: an attacker is a
//! process of its own, forked from the test and, where the row is about another user,
//! running as another uid (1001, 1002, …: the test runs as root and drops to them with
//! setuid; servers that other uids reach get `--socket-mode 666` in a world-searchable
//! directory).
//!
//! Every attack is preceded by its control: the attacker performs the same operation on
//! its own instance (or with its own key, its own token), and that must succeed, so a
//! refusal is the security check and not a malformed request. After the attack the
//! victim is checked: it keeps working (its ping `true`, its data intact), and the
//! attacker's requests neither changed nor refreshed its state. Counts and states only,
//! never durations.

mod engine_support;

use kvwarden::client::{Client, ClientConfig, ClientError, Endpoint, MemfdBuffer};
use kvwarden::memfd::SharedMapping;
use kvwarden::server::status::msgpack_to_json;
use kvwarden_core::protocol::tcp_auth::TcpKey;
use kvwarden_core::protocol::{PROTOCOL_VERSION, decode_reply, encode_request};
use kvwarden_tests::{
    PATIENCE, RawClient, Server, TCP_TOKEN, TempDir, built, find_instance, fork_as_uid, freed,
    instance_secret, kvwarden_bin, memfd_spec, run_as_uid, wait_exit, wait_for, write_token_file,
};
use rmpv::Value;
use rustix::fd::{AsFd, OwnedFd};
use serde_json::{Value as Json, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

/// Two users other than root.
const ALICE: u32 = 1001;
const BOB: u32 = 1002;

/// One chunk, and the buffers the raw workers register.
const CHUNK: u64 = 4096;
const BUFFER: u64 = 256 << 10;

/// This process's uid (root).
fn own_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// Flags of a server that other uids reach and whose instances are never reaped while
/// a test runs (registrations here often never ping on purpose).
const SHARED: &[&str] = &[
    "--socket-mode",
    "666",
    "--worker-reap-timeout-seconds",
    "60",
    "--worker-registration-grace-seconds",
    "120",
];

fn shared_server(dir: &TempDir, extra: &[&str]) -> Server {
    let mut flags = SHARED.to_vec();
    flags.extend_from_slice(extra);
    Server::start(dir, &flags)
}

/// `len` bytes, distinct per `seed` and per byte.
fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|b| (b.wrapping_mul(31) ^ seed.wrapping_mul(131) ^ (b >> 8)) as u8)
        .collect()
}

fn bin(bytes: &[u8]) -> Value {
    Value::Binary(bytes.to_vec())
}

/// A reply as JSON: `{"ok": value}` or `{"code": ..., "message": ...}`.
fn answer_of(result: Result<Value, kvwarden_core::protocol::ProtocolError>) -> Json {
    match result {
        Ok(value) => json!({ "ok": msgpack_to_json(&value) }),
        Err(error) => json!({ "code": error.code.as_str(), "message": error.message }),
    }
}

/// `answer["ok"]`, or a panic naming `what` and the answer.
fn ok<'a>(answer: &'a Json, what: &str) -> &'a Json {
    answer
        .get("ok")
        .unwrap_or_else(|| panic!("{what}: the control must succeed, got {answer}"))
}

/// Asserts `answer` is `forbidden` and its message contains `needle`.
fn assert_forbidden(answer: &Json, what: &str, needle: &str) {
    assert_eq!(
        answer["code"], "forbidden",
        "{what}: must be forbidden, got {answer}"
    );
    let message = answer["message"].as_str().unwrap_or("");
    assert!(
        message.contains(needle),
        "{what}: {needle:?} missing from {message:?}"
    );
}

fn forbidden_total(status: &Json) -> u64 {
    status["trust"]["forbidden_total"].as_u64().unwrap_or(0)
}

fn tenant<'a>(status: &'a Json, name: &str) -> Option<&'a Json> {
    status["tenants"]
        .as_array()?
        .iter()
        .find(|tenant| tenant["name"] == name)
}

/// The value of the `/metrics` series `series` (name and labels, as printed).
fn metric(server: &Server, series: &str) -> Option<f64> {
    let (code, body) = server.http_get("/metrics");
    assert_eq!(code, 200);
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// A rope parameter map for `register_blend`.
fn rope() -> Value {
    engine_support::rope(64, 1024, 10_000.0)
}

/// A worker on the raw protocol: one connection that attached its instance (with
/// [`instance_secret`]) and registered one memfd buffer of `nbytes` (none for 0),
/// mapped here too.
struct RawWorker {
    raw: RawClient,
    instance: u64,
    buffer: Option<(OwnedFd, SharedMapping)>,
}

impl RawWorker {
    fn register(socket: &Path, instance: u64, nbytes: u64) -> RawWorker {
        let mut raw = RawClient::connect_attached(socket, instance);
        let (buffers, memfd) = if nbytes == 0 {
            (vec![], None)
        } else {
            let fd = kvwarden::memfd::create("who-is-who", nbytes).expect("a memfd");
            let mapping = SharedMapping::map(&fd, nbytes as usize).expect("mapping it");
            (vec![memfd_spec(0, nbytes)], Some((fd, mapping)))
        };
        let args = vec![
            instance.into(),
            Value::Array(buffers),
            "who".into(),
            1.into(),
        ];
        let fds: Vec<_> = memfd.iter().map(|(fd, _)| fd.as_fd()).collect();
        let reply = raw
            .request_with_fds("register_kv_cache", args, &fds)
            .expect("a reply to register");
        let value = reply
            .result
            .unwrap_or_else(|e| panic!("instance {instance} registers: {e}"));
        assert_eq!(msgpack_to_json(&value)["outcome"], "created");
        RawWorker {
            raw,
            instance,
            buffer: memfd,
        }
    }

    fn call(&mut self, op: &str, args: Vec<Value>) -> Json {
        answer_of(self.raw.request(op, args).expect("a reply").result)
    }

    fn mapping(&self) -> &SharedMapping {
        &self.buffer.as_ref().expect("a registered buffer").1
    }

    fn write(&self, offset: u64, bytes: &[u8]) {
        assert!(self.mapping().write(offset, bytes));
    }

    fn read(&self, offset: u64, nbytes: u64) -> Vec<u8> {
        let mut out = vec![0; nbytes as usize];
        assert!(self.mapping().read(offset, &mut out));
        out
    }

    /// `store [instance, key, 0, offset, nbytes]` for `instance`.
    fn store_as(&mut self, instance: u64, key: &[u8], offset: u64, nbytes: u64) -> Json {
        let args = vec![
            instance.into(),
            bin(key),
            0.into(),
            offset.into(),
            nbytes.into(),
        ];
        self.call("store", args)
    }

    /// `retrieve [instance, key, 0, offset, nbytes]` for `instance`.
    fn retrieve_as(&mut self, instance: u64, key: &[u8], offset: u64, nbytes: u64) -> Json {
        let args = vec![
            instance.into(),
            bin(key),
            0.into(),
            offset.into(),
            nbytes.into(),
        ];
        self.call("retrieve", args)
    }

    fn store(&mut self, key: &[u8], offset: u64, nbytes: u64) -> Json {
        self.store_as(self.instance, key, offset, nbytes)
    }

    fn retrieve(&mut self, key: &[u8], offset: u64, nbytes: u64) -> Json {
        self.retrieve_as(self.instance, key, offset, nbytes)
    }

    fn lookup(&mut self, keys: &[&[u8]]) -> Json {
        let keys = keys.iter().map(|key| bin(key)).collect();
        self.call("lookup", vec![Value::Array(keys)])
    }

    fn ping(&mut self) -> Json {
        self.call("ping", vec![self.instance.into()])
    }

    fn status(&mut self) -> Json {
        let status = self.call("status", vec![]);
        ok(&status, "status").clone()
    }
}

/// Every instance id in `status` but `except`.
fn other_instances(status: &Json, except: u64) -> Vec<u64> {
    status["instances"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter_map(|entry| entry["instance_id"].as_u64())
                .filter(|&id| id != except)
                .collect()
        })
        .unwrap_or_default()
}

// ------------------------------------------------------------------ row 30

/// The victim of row 30: registered with a buffer full of `pattern(id, BUFFER)`, one
/// chunk stored from its start; never pings until the parent says `check`, then
/// reports what it finds.
fn row_30_victim(socket: PathBuf, id: u64) -> impl FnOnce(&mut kvwarden_tests::ToParent) -> Json {
    move |parent| {
        let mut me = RawWorker::register(&socket, id, BUFFER);
        let original = pattern(id, BUFFER);
        me.write(0, &original);
        let stored = me.store(b"victim-chunk", 0, CHUNK);
        parent.send(json!({ "stored": stored }));
        assert_eq!(parent.recv(), json!("check"));
        let buffer_intact = me.read(0, BUFFER) == original;
        let ping = me.ping();
        let retrieved = me.retrieve(b"victim-chunk", 2 * CHUNK, CHUNK);
        let chunk_intact = me.read(2 * CHUNK, CHUNK) == original[..CHUNK as usize];
        let stolen = me.lookup(&[b"stolen"]);
        json!({
            "buffer_intact": buffer_intact,
            "ping": ping,
            "retrieve": retrieved,
            "chunk_intact": chunk_intact,
            "lookup_stolen": stolen,
        })
    }
}

/// The attacker of row 30: a process of the victim's uid with an instance of its own.
/// Each operation first on its own instance (the control), then on the victim's id,
/// which it reads from the status like anyone could.
fn row_30_attack(socket: &Path, own: u64) -> Json {
    let mut me = RawWorker::register(socket, own, BUFFER);
    me.write(0, &pattern(own, CHUNK));
    let victims = other_instances(&me.status(), own);
    assert_eq!(victims.len(), 1, "exactly one other instance: {victims:?}");
    let victim = victims[0];
    let mut out = serde_json::Map::new();
    let mut put = |name: &str, answer: Json| {
        out.insert(name.to_string(), answer);
    };
    put("ping_own", me.ping());
    put("ping_victim", me.call("ping", vec![victim.into()]));
    put("store_own", me.store(b"own-chunk", 0, CHUNK));
    // Reading the victim's buffer: copy it into L1 under a key of the attacker's.
    put(
        "store_from_victim",
        me.store_as(victim, b"stolen", 0, CHUNK),
    );
    put("retrieve_own", me.retrieve(b"own-chunk", CHUNK, CHUNK));
    // Writing the victim's buffer: copy the attacker's chunk into it.
    put(
        "retrieve_into_victim",
        me.retrieve_as(victim, b"own-chunk", 0, CHUNK),
    );
    put(
        "blend_own",
        me.call("register_blend", vec![own.into(), rope()]),
    );
    put(
        "blend_victim",
        me.call("register_blend", vec![victim.into(), rope()]),
    );
    let register = |instance: u64| {
        vec![
            instance.into(),
            Value::Array(vec![]),
            "who".into(),
            1.into(),
        ]
    };
    put(
        "register_own_again",
        me.call("register_kv_cache", register(own)),
    );
    put(
        "register_victim",
        me.call("register_kv_cache", register(victim)),
    );
    // Guessing a secret does not help: the attacker's own secret for the victim's id.
    let guess = me
        .raw
        .attach_with(victim, &instance_secret(own))
        .expect("a reply")
        .result;
    put("attach_victim", answer_of(guess));
    put(
        "ping_victim_after_attach",
        me.call("ping", vec![victim.into()]),
    );
    put(
        "unregister_own",
        me.call("unregister_kv_cache", vec![own.into()]),
    );
    put(
        "unregister_victim",
        me.call("unregister_kv_cache", vec![victim.into()]),
    );
    Json::Object(out)
}

/// Row 30 for a victim and an attacker both of `uid`, on `server`.
fn row_30_case(server: &Server, uid: u32, victim_id: u64, attacker_id: u64) {
    let socket = server.socket.clone();
    let mut victim = fork_as_uid(uid, row_30_victim(socket.clone(), victim_id));
    let stored = victim.recv("the victim registered and stored");
    assert_eq!(stored["stored"]["ok"], true, "{stored}");
    // Silent long enough that a refresh by the attacker would show.
    let before = server.wait_status("the victim silent a while", |s| {
        find_instance(s, victim_id)
            .and_then(|entry| entry["silence_seconds"].as_f64())
            .is_some_and(|silence| silence >= 0.3)
    });
    let entry_before = find_instance(&before, victim_id).expect("the victim's entry");
    assert_eq!(entry_before["proven"], false, "it never pinged");
    assert_eq!(entry_before["owner_uid"], uid);

    let report = run_as_uid(uid, "the row 30 attacker", || {
        row_30_attack(&socket, attacker_id)
    });

    // Controls: every operation works on the attacker's own instance.
    assert_eq!(ok(&report["ping_own"], "ping own"), true);
    assert_eq!(ok(&report["store_own"], "store own"), true);
    assert_eq!(ok(&report["retrieve_own"], "retrieve own"), CHUNK);
    assert_eq!(ok(&report["blend_own"], "blend own"), true);
    assert_eq!(
        ok(&report["register_own_again"], "register own")["outcome"],
        "refreshed"
    );
    assert_eq!(ok(&report["unregister_own"], "unregister own"), true);
    // Attacks: every one forbidden, for want of the victim's secret.
    let attacks = [
        "ping_victim",
        "store_from_victim",
        "retrieve_into_victim",
        "blend_victim",
        "register_victim",
        "ping_victim_after_attach",
        "unregister_victim",
    ];
    for attack in attacks {
        assert_forbidden(&report[attack], attack, "has not attached");
    }
    assert_forbidden(
        &report["attach_victim"],
        "attach_victim",
        "bound to another secret",
    );

    // Nothing of the victim changed or was refreshed.
    let after = server.status();
    let entry = find_instance(&after, victim_id).expect("the victim's entry is still held");
    assert_eq!(
        entry["proven"], false,
        "the attacker's ping did not prove it: {entry}"
    );
    // Its silence only grew (unless the server itself stalled meanwhile: a stall is
    // credited to every instance, row 12, and says nothing about the attacker).
    let stalls = |status: &Json| status["worker_liveness"]["stalls_total"].as_u64();
    if stalls(&after) == stalls(&before) {
        assert!(
            entry["silence_seconds"].as_f64() >= entry_before["silence_seconds"].as_f64(),
            "the attacker's requests refreshed the victim: {entry_before} then {entry}"
        );
    }
    assert_eq!(entry["blend_bytes"], 0, "no rope tables for the victim");
    assert_eq!(
        forbidden_total(&after),
        forbidden_total(&before) + attacks.len() as u64 + 1,
        "each attack refused and counted once"
    );
    assert_eq!(
        built(&after),
        built(&before) + 1,
        "one context built: the attacker's own"
    );
    assert_eq!(
        freed(&after, "unregistered"),
        freed(&before, "unregistered") + 1,
        "one context unregistered: the attacker's own"
    );

    // The victim keeps working, its buffer untouched, nothing of it stolen.
    victim.send(json!("check"));
    let check = victim.finish("the victim checks itself");
    assert_eq!(check["buffer_intact"], true, "{check}");
    assert_eq!(check["ping"]["ok"], true, "{check}");
    assert_eq!(check["retrieve"]["ok"], CHUNK, "{check}");
    assert_eq!(check["chunk_intact"], true, "{check}");
    assert_eq!(check["lookup_stolen"]["ok"], 0, "{check}");
    // Both processes gone: their instances are freed by their exits.
    server.wait_status("both processes' instances freed", |s| {
        s["worker_liveness"]["tracked_instances"] == 0
    });
}

/// Row 30: a process of the victim's own uid (root, which is also the server's uid;
/// then uid 1001) names the victim's instance, read from the status: ping, store from
/// and retrieve into its buffer, register_blend, register, unregister, and attach with
/// a guessed secret are all `forbidden`, counted, and leave the victim untouched and
/// unrefreshed; the same operations on the attacker's own instance succeed.
#[test]
fn row_30_a_same_uid_process_cannot_unregister_or_read_another_workers_instance() {
    let dir = TempDir::new("row30");
    let server = shared_server(&dir, &[]);
    row_30_case(&server, own_uid(), 3001, 3002);
    row_30_case(&server, ALICE, 3011, 3012);
}

// ------------------------------------------------------------------ row 31

/// An attacker of `uid` that knows `victim`'s id: its control attaches its own id on
/// two connections and pings it; then it attaches the victim's id with a guessed
/// secret and, where `stolen`, with the victim's real one.
fn row_31_wrong_secret(socket: &Path, own: u64, victim: u64, stolen: bool) -> Json {
    let mut me = RawWorker::register(socket, own, 0);
    let mut second = RawClient::connect(socket).expect("a second connection");
    let mut out = serde_json::Map::new();
    out.insert(
        "attach_own_again".into(),
        answer_of(
            second
                .attach_with(own, &instance_secret(own))
                .unwrap()
                .result,
        ),
    );
    out.insert(
        "ping_own".into(),
        answer_of(second.request("ping", vec![own.into()]).unwrap().result),
    );
    let guess = me.raw.attach_with(victim, &[0x5a; 32]).unwrap().result;
    out.insert("attach_guessed".into(), answer_of(guess));
    out.insert(
        "ping_after_guess".into(),
        me.call("ping", vec![victim.into()]),
    );
    if stolen {
        let real = me
            .raw
            .attach_with(victim, &instance_secret(victim))
            .unwrap()
            .result;
        out.insert("attach_stolen".into(), answer_of(real));
        out.insert(
            "ping_after_stolen".into(),
            me.call("ping", vec![victim.into()]),
        );
    }
    Json::Object(out)
}

/// `client.store` after a server restart: the first call finds the old connection
/// dead (an I/O error), the second reconnects, attaches, re-registers and stores.
fn store_after_restart(client: &Client, key: &[u8]) -> bool {
    match client.store(key, 0, 0, CHUNK) {
        Ok(stored) => stored,
        Err(ClientError::Io { .. }) => client.store(key, 0, 0, CHUNK).expect("the retry"),
        Err(other) => panic!("store after a restart: {other}"),
    }
}

/// Row 31: a peer that knows an instance id but not its secret. A wrong secret (from
/// uid 1001, from the victim's own uid, and even the victim's real secret from another
/// uid) is `forbidden`, counted and grants nothing; the controls attach the attacker's
/// own id. Then an id squatted after a server restart: the victim's Rust client finds
/// its id taken, draws a fresh id and secret (`identity_changes() == 1`) and carries
/// on with exactly one context; the same restart without a squatter (the control)
/// keeps the id.
#[test]
fn row_31_a_wrong_secret_is_forbidden_and_a_squatted_id_costs_the_victim_nothing() {
    // --- a wrong secret
    let dir = TempDir::new("row31-secret");
    let server = shared_server(&dir, &[]);
    let victim_id = 3101;
    let mut victim = RawWorker::register(&server.socket, victim_id, 0);
    let before = server.status();
    let socket = server.socket.clone();
    let alice = run_as_uid(ALICE, "uid 1001 guesses", || {
        row_31_wrong_secret(&socket, 3102, victim_id, true)
    });
    assert_eq!(
        ok(
            &alice["attach_own_again"],
            "alice attaches her own id again"
        )["outcome"],
        "proven"
    );
    assert_eq!(ok(&alice["ping_own"], "alice pings her own id"), true);
    assert_forbidden(
        &alice["attach_guessed"],
        "a guessed secret",
        "bound to another peer",
    );
    assert_forbidden(
        &alice["attach_stolen"],
        "the real secret from another uid",
        "uid 0",
    );
    assert_forbidden(
        &alice["ping_after_guess"],
        "ping after a refused attach",
        "has not attached",
    );
    assert_forbidden(
        &alice["ping_after_stolen"],
        "ping after a refused attach",
        "has not attached",
    );
    let same = run_as_uid(own_uid(), "the victim's uid guesses", || {
        row_31_wrong_secret(&socket, 3103, victim_id, false)
    });
    assert_eq!(ok(&same["ping_own"], "its own id"), true);
    assert_forbidden(
        &same["attach_guessed"],
        "a guessed secret",
        "bound to another secret",
    );
    assert_forbidden(
        &same["ping_after_guess"],
        "ping after a refused attach",
        "has not attached",
    );
    let after = server.status();
    assert_eq!(forbidden_total(&after), forbidden_total(&before) + 6);
    let entry = find_instance(&after, victim_id).expect("the victim is held");
    assert_eq!(entry["proven"], false, "nobody pinged it: {entry}");
    assert_eq!(victim.ping()["ok"], true, "the victim keeps working");
    // The bindings: the attackers' processes exited, so their instances were freed and
    // their ids unbound; the victim's stays bound. A freed id is free again: anyone may
    // claim it with any secret.
    server.wait_status("only the victim's id bound", |s| {
        s["worker_liveness"]["tracked_instances"] == 1 && s["trust"]["bound_instances"] == 1
    });
    let mut anyone = RawClient::connect(&server.socket).unwrap();
    let reply = anyone.attach_with(3102, &[0x77; 32]).unwrap();
    assert_eq!(
        msgpack_to_json(&reply.result.expect("a freed id is claimed by anyone"))["outcome"],
        "claimed"
    );
    let refused = anyone.attach_with(victim_id, &[0x77; 32]).unwrap();
    assert!(refused.result.is_err(), "the victim's id stays bound");

    // --- a squatter after a server restart
    let dir = TempDir::new("row31-squat");
    let server = shared_server(&dir, &[]);
    let mut config = ClientConfig::new(Endpoint::Unix(server.socket.clone()));
    // Its heartbeat pings once, at the first transfer, and not again during the test:
    // what reconnects after each restart is the test's own call, never a ping racing
    // the squatter.
    config.heartbeat_interval = Duration::from_secs(3600);
    let client = Client::connect(config).expect("connecting");
    let buffer = Arc::new(MemfdBuffer::new(BUFFER as usize).expect("a memfd"));
    let chunk = pattern(31, CHUNK);
    assert!(buffer.write(0, &chunk));
    assert_eq!(
        client
            .register(vec![Arc::clone(&buffer)], "row31", 1)
            .unwrap(),
        "created"
    );
    assert!(client.store(b"before", 0, 0, CHUNK).unwrap());
    server.wait_status("the heartbeat's first ping", |s| {
        s["worker_liveness"]["pings_total"].as_u64() >= Some(1)
    });
    let first_id = client.instance_id().get();

    // The control: a restart with nobody squatting keeps the id.
    let (exit, log) = server.terminate();
    assert!(exit.success(), "{log}");
    let server = shared_server(&dir, &[]);
    assert!(store_after_restart(&client, b"control"));
    assert_eq!(client.identity_changes(), 0, "nobody squatted: the same id");
    assert_eq!(client.instance_id().get(), first_id);
    assert_eq!(client.recoveries(), 1);
    let status = server.status();
    assert!(find_instance(&status, first_id).is_some(), "{status:#}");
    assert_eq!(built(&status), 1);
    assert_eq!(forbidden_total(&status), 0);

    // The attack: after the next restart uid 1001 claims the id first and holds it.
    let (exit, log) = server.terminate();
    assert!(exit.success(), "{log}");
    let server = shared_server(&dir, &[]);
    let socket = server.socket.clone();
    let mut squatter = fork_as_uid(ALICE, move |parent| {
        let mut raw = RawClient::connect(&socket).expect("connecting");
        let claim = raw
            .attach_with(first_id, &[0x66; 32])
            .expect("a reply")
            .result;
        parent.send(answer_of(claim));
        parent.recv(); // holds the claim (its connection) until the parent is done
        json!(null)
    });
    let claim = squatter.recv("the squatter claims the id");
    assert_eq!(ok(&claim, "the squat")["outcome"], "claimed");
    assert!(store_after_restart(&client, b"after-squat"));
    assert_eq!(client.identity_changes(), 1, "one fresh id and secret");
    let second_id = client.instance_id().get();
    assert_ne!(second_id, first_id);
    let status = server.status();
    assert_eq!(
        status["worker_liveness"]["tracked_instances"], 1,
        "{status:#}"
    );
    let entry = find_instance(&status, second_id).expect("the victim under its new id");
    assert_eq!(entry["owner_uid"], 0);
    assert!(find_instance(&status, first_id).is_none(), "{status:#}");
    assert_eq!(built(&status), 1, "exactly one context: {status:#}");
    assert_eq!(
        forbidden_total(&status),
        1,
        "the victim's attach of its squatted id"
    );
    // Working: its chunk reads back, its ping is true.
    assert_eq!(
        client.retrieve(b"after-squat", 0, CHUNK, CHUNK).unwrap(),
        Some(CHUNK)
    );
    let mut read = vec![0; CHUNK as usize];
    assert!(buffer.read(CHUNK, &mut read));
    assert_eq!(read, chunk);
    let ping = client
        .call("ping", vec![second_id.into()])
        .expect("its ping");
    assert_eq!(ping, Value::Boolean(true));
    squatter.send(json!("done"));
    squatter.finish("the squatter");
    client.shutdown().expect("a clean shutdown");
}

// ------------------------------------------------------------------ row 32

/// The raw protocol over TCP.
struct TcpRaw {
    stream: TcpStream,
    next_id: u64,
}

impl TcpRaw {
    fn connect(address: SocketAddr) -> TcpRaw {
        let stream = TcpStream::connect(address).expect("connecting over TCP");
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        TcpRaw { stream, next_id: 1 }
    }

    fn call(&mut self, op: &str, args: Vec<Value>) -> Json {
        let id = self.next_id;
        self.next_id += 1;
        self.stream
            .write_all(&encode_request(id, op, args))
            .expect("sending");
        let mut prefix = [0u8; 4];
        self.stream.read_exact(&mut prefix).expect("a reply");
        let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
        self.stream.read_exact(&mut body).expect("a reply body");
        let reply = decode_reply(&body).expect("a reply frame");
        assert_eq!(reply.id, id);
        answer_of(reply.result)
    }

    /// `hello` with these options (none: a bare `hello`).
    fn hello(&mut self, options: Vec<(Value, Value)>) -> Json {
        let mut args = vec![PROTOCOL_VERSION.into(), "row32".into()];
        if !options.is_empty() {
            args.push(Value::Map(options));
        }
        self.call("hello", args)
    }

    /// `auth` with `token`'s key id: the answer, and the client's proof when the
    /// server's proof checks.
    fn auth(&mut self, token: &[u8]) -> (Json, Option<Vec<u8>>) {
        let key = TcpKey::from_token(token);
        let nonce = [7u8; 32];
        let answer = self.call(
            "auth",
            vec![Value::Map(vec![
                ("id".into(), bin(&key.id())),
                ("nonce".into(), bin(&nonce)),
            ])],
        );
        let proof = answer["ok"].as_object().map(|challenge| {
            // Bins come back as hex.
            let bytes = |name: &str| -> Vec<u8> {
                let hex = challenge[name].as_str().expect("a bin");
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect()
            };
            let (server, proof) = (bytes("nonce"), bytes("proof"));
            let server: [u8; 32] = server.try_into().expect("a 32-byte nonce");
            assert!(
                key.check_server(&nonce, &server, &proof),
                "the server proves it holds the token"
            );
            key.client_proof(&nonce, &server).to_vec()
        });
        (answer, proof)
    }

    /// The whole handshake with `token`: `auth`, then `hello` with the proof.
    fn handshake(&mut self, token: &[u8]) -> Json {
        let (answer, proof) = self.auth(token);
        let proof = proof.unwrap_or_else(|| panic!("`auth` answered {answer}"));
        self.hello(vec![("proof".into(), bin(&proof))])
    }
}

/// Every request naming nothing or something, on a connection that has not
/// authenticated: each must be `forbidden`.
fn unauthenticated_requests(raw: &mut TcpRaw, victim: u64) -> Vec<(&'static str, Json)> {
    vec![
        ("ping nil", raw.call("ping", vec![Value::Nil])),
        ("status", raw.call("status", vec![])),
        (
            "lookup",
            raw.call("lookup", vec![Value::Array(vec![bin(b"k")])]),
        ),
        (
            "attach",
            raw.call("attach", vec![3202.into(), bin(&instance_secret(3202))]),
        ),
        (
            "register",
            raw.call(
                "register_kv_cache",
                vec![3202.into(), Value::Array(vec![]), "m".into(), 1.into()],
            ),
        ),
        ("ping victim", raw.call("ping", vec![victim.into()])),
    ]
}

fn tcp_client(address: SocketAddr, token: Option<&[u8]>) -> Result<Client, ClientError> {
    let mut config = ClientConfig::new(Endpoint::Tcp(address));
    config.tcp_token = token.map(<[u8]>::to_vec);
    Client::connect(config)
}

/// Row 65: TCP clients hand their token to nobody. Another uid binds a TCP port (the
/// server's, while it is down) and answers like a server that does not hold the token;
/// the Rust client connecting there with the token file is refused with a message
/// naming why, sends nothing after its `auth`, and none of the bytes the impostor
/// received holds the token or the key made from it. The control: the same client
/// and token against the real server connect, register and ping.
#[test]
fn row_65_a_tcp_client_refuses_a_server_that_cannot_prove_the_token_and_never_sends_it() {
    let dir = TempDir::new("row65");
    let server = shared_server(&dir, &["--tcp", "127.0.0.1:0"]);
    let address = server.tcp.expect("the TCP address");
    let token =
        ClientConfig::read_tcp_token_file(&server.tcp_token_file.clone().expect("the token file"))
            .expect("the token");

    // The control: the real server proves the token; the client is served.
    let client = tcp_client(address, Some(&token)).expect("the real server admits");
    assert_eq!(client.register(vec![], "tcp", 1).unwrap(), "created");
    let own = client.instance_id().get();
    assert_eq!(
        client.call("ping", vec![own.into()]).unwrap(),
        Value::Boolean(true)
    );
    client.shutdown().unwrap();

    // The impostor: another uid's listener that answers `auth` with a made-up
    // challenge and records every byte until the client hangs up.
    let mut impostor = fork_as_uid(BOB, |parent| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding");
        parent.send(json!(listener.local_addr().unwrap().port()));
        let (mut stream, _) = listener.accept().expect("the client");
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut received = Vec::new();
        let mut answered = false;
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
            if !answered && received.len() >= 4 {
                let length = u32::from_be_bytes(received[..4].try_into().unwrap()) as usize;
                if received.len() >= 4 + length {
                    let request: Value =
                        rmpv::decode::read_value(&mut &received[4..4 + length]).expect("a request");
                    let id = request
                        .as_array()
                        .and_then(|items| items.first())
                        .and_then(Value::as_u64)
                        .expect("a request id");
                    let challenge = Value::Map(vec![
                        ("nonce".into(), Value::Binary(vec![9; 32])),
                        ("proof".into(), Value::Binary(vec![6; 32])),
                    ]);
                    let frame = kvwarden_core::protocol::encode_reply(id, &Ok(challenge));
                    stream.write_all(&frame).expect("answering");
                    answered = true;
                }
            }
        }
        json!(
            received
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    });
    let port = impostor
        .recv("the impostor's port")
        .as_u64()
        .expect("a port") as u16;
    let refused = tcp_client(SocketAddr::from(([127, 0, 0, 1], port)), Some(&token))
        .err()
        .expect("the client refuses the impostor");
    assert!(
        matches!(refused, ClientError::ServerNotProven { .. }),
        "{refused}"
    );
    let message = refused.to_string();
    assert!(
        message.contains("could not prove it holds") && message.contains("was not sent"),
        "{message}"
    );
    let received = impostor.finish("the impostor");
    let received = received.as_str().expect("hex");
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert!(
        received.contains(&hex(b"auth")),
        "the client asked `auth`: {received}"
    );
    assert!(
        !received.contains(&hex(&token)),
        "the token reached the impostor: {received}"
    );
    assert!(
        !received.contains(&hex(b"hello")),
        "the client said `hello` to a server that did not prove the token"
    );
    // The frame it got is the `auth` alone: one request, nothing after it.
    let bytes: Vec<u8> = (0..received.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&received[i..i + 2], 16).unwrap())
        .collect();
    let length = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
    assert_eq!(bytes.len(), 4 + length, "one frame, the `auth`");
}

/// Row 32: over TCP a `hello` without a proof, an `auth` with another token's key id,
/// or a `hello` carrying the token itself (protocol 2's way) is `forbidden`, and so is
/// every request after it on that connection until the handshake with the right token
/// (the control, on a fresh connection and on one refused before); the Rust client
/// without or with a wrong token is refused, with the token file it registers and
/// pings. `--tcp` without `--tcp-token-file` refuses to start, naming the flag.
#[test]
fn row_32_a_tcp_peer_without_the_token_is_forbidden_everything() {
    let dir = TempDir::new("row32");
    let server = shared_server(&dir, &["--tcp", "127.0.0.1:0"]);
    let address = server.tcp.expect("the TCP address");

    // The control: the right token.
    let victim = 3201;
    let mut good = TcpRaw::connect(address);
    let hello = good.handshake(TCP_TOKEN.as_bytes());
    assert_eq!(ok(&hello, "hello with the token's proof")["tenant"], "tcp");
    assert_eq!(hello["ok"]["protocol"], PROTOCOL_VERSION);
    let attached = good.call("attach", vec![victim.into(), bin(&instance_secret(victim))]);
    assert_eq!(ok(&attached, "attach")["outcome"], "claimed");
    let registered = good.call(
        "register_kv_cache",
        vec![victim.into(), Value::Array(vec![]), "m".into(), 1.into()],
    );
    assert_eq!(ok(&registered, "register")["outcome"], "created");
    assert_eq!(ok(&good.call("ping", vec![victim.into()]), "ping"), true);
    let before = server.status();

    // No token.
    let mut bare = TcpRaw::connect(address);
    assert_forbidden(&bare.hello(vec![]), "hello without a proof", "`auth`");
    for (what, answer) in unauthenticated_requests(&mut bare, victim) {
        assert_forbidden(&answer, what, "has not authenticated");
    }
    // A wrong token: its key id is none of the server's.
    let mut wrong = TcpRaw::connect(address);
    let (answer, proof) = wrong.auth(b"not-the-token-0123456789abcdef");
    assert!(proof.is_none());
    assert_forbidden(
        &answer,
        "auth with a wrong token",
        "not one the server accepts",
    );
    for (what, answer) in unauthenticated_requests(&mut wrong, victim) {
        assert_forbidden(&answer, what, "has not authenticated");
    }
    // The token itself in `hello`, as protocol 2 sent it: refused, naming the change.
    let mut old = TcpRaw::connect(address);
    assert_forbidden(
        &old.hello(vec![("token".into(), TCP_TOKEN.into())]),
        "hello with the token",
        "takes no token",
    );
    let after = server.status();
    assert_eq!(
        forbidden_total(&after),
        forbidden_total(&before) + 15,
        "every refusal counted"
    );
    assert!(
        find_instance(&after, 3202).is_none(),
        "nothing registered: {after:#}"
    );
    // The same connection, once it proves the right token, is served.
    let hello = bare.handshake(TCP_TOKEN.as_bytes());
    assert_eq!(ok(&hello, "the handshake, late")["tenant"], "tcp");
    assert_eq!(ok(&bare.call("ping", vec![Value::Nil]), "ping nil"), true);

    // The Rust client: without a token, with a wrong one, with the token file.
    let refused = tcp_client(address, None)
        .err()
        .expect("refused without a token");
    assert!(
        matches!(refused, ClientError::NoTcpToken { .. }),
        "{refused}"
    );
    let refused = tcp_client(address, Some(b"not-the-token-0123456789abcdef"))
        .err()
        .expect("refused with a wrong token");
    assert_eq!(
        refused.code(),
        Some(kvwarden_core::protocol::ErrorCode::Forbidden),
        "{refused}"
    );
    let token_file = server.tcp_token_file.clone().expect("the token file");
    let token = ClientConfig::read_tcp_token_file(&token_file).expect("the token");
    let client = tcp_client(address, Some(&token)).expect("the token admits");
    assert_eq!(client.register(vec![], "tcp", 1).unwrap(), "created");
    let own = client.instance_id().get();
    let ping = client.call("ping", vec![own.into()]).unwrap();
    assert_eq!(ping, Value::Boolean(true));
    let status = server.status();
    assert_eq!(
        find_instance(&status, own).expect("registered")["tenant"],
        "tcp"
    );
    assert_eq!(
        find_instance(&status, victim).expect("the victim is held")["tenant"],
        "tcp"
    );
    assert_eq!(
        ok(&good.call("ping", vec![victim.into()]), "the victim pings"),
        true
    );
    client.shutdown().unwrap();

    // `--tcp` without a token file refuses to start, naming the flag; a token file too
    // short to be a secret too.
    let socket = dir.path().join("second.sock");
    let serve = |extra: &[&str]| {
        let mut child = Command::new(kvwarden_bin())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(["--http", "off", "--tcp", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kvwarden serve");
        if wait_exit(&mut child, PATIENCE).is_none() {
            let _ = child.kill();
            panic!("kvwarden serve {extra:?} kept running; it must refuse to start");
        }
        child.wait_with_output().expect("its output")
    };
    let output = serve(&[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "started without a token: {stderr}"
    );
    assert!(stderr.contains("--tcp-token-file"), "{stderr}");
    assert!(!socket.exists(), "a refused start leaves no socket");
    let short = dir.path().join("short-token");
    write_token_file(&short, "too-short");
    let short_arg = short.to_string_lossy().into_owned();
    let output = serve(&["--tcp-token-file", &short_arg]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "started with a short token: {stderr}"
    );
    assert!(
        stderr.contains("--tcp-token-file") && stderr.contains(&short_arg),
        "{stderr}"
    );
}

// ------------------------------------------------------------------ row 33

/// The owner of `shared-key` in row 33: stores it (bytes `pattern(1, CHUNK)`), says so
/// with its hello's tenant, then on `check` reads it back and reports the bytes.
fn row_33_owner(socket: PathBuf, id: u64) -> impl FnOnce(&mut kvwarden_tests::ToParent) -> Json {
    move |parent| {
        let mut me = RawWorker::register(&socket, id, BUFFER);
        let hello = me.call("hello", vec![2.into(), "row33-owner".into()]);
        me.write(0, &pattern(1, CHUNK));
        let stored = me.store(b"shared-key", 0, CHUNK);
        parent.send(json!({ "hello": hello, "stored": stored }));
        parent.recv();
        let retrieved = me.retrieve(b"shared-key", CHUNK, CHUNK);
        let intact = me.read(CHUNK, CHUNK) == pattern(1, CHUNK);
        let lookup = me.lookup(&[b"shared-key"]);
        json!({ "retrieve": retrieved, "intact": intact, "lookup": lookup })
    }
}

/// The other user of row 33: its control stores and reads its own key; then it looks
/// up and retrieves the owner's key, and stores the same key itself ("poisons" it).
fn row_33_other(socket: &Path, id: u64) -> Json {
    let mut me = RawWorker::register(socket, id, BUFFER);
    let hello = me.call("hello", vec![2.into(), "row33-other".into()]);
    me.write(0, &pattern(2, CHUNK));
    let own_store = me.store(b"own-key", 0, CHUNK);
    let own_retrieve = me.retrieve(b"own-key", CHUNK, CHUNK);
    let own_intact = me.read(CHUNK, CHUNK) == pattern(2, CHUNK);
    let own_lookup = me.lookup(&[b"own-key"]);
    let lookup = me.lookup(&[b"shared-key"]);
    let retrieve = me.retrieve(b"shared-key", 2 * CHUNK, CHUNK);
    let batch = me.call(
        "retrieve_batch",
        vec![
            id.into(),
            Value::Array(vec![Value::Array(vec![
                bin(b"shared-key"),
                0.into(),
                (2 * CHUNK).into(),
                CHUNK.into(),
            ])]),
        ],
    );
    let untouched = me.read(2 * CHUNK, CHUNK) == vec![0; CHUNK as usize];
    let read_shared = me.read(2 * CHUNK, CHUNK) == pattern(1, CHUNK);
    me.write(3 * CHUNK, &pattern(3, CHUNK));
    let poison = me.store(b"shared-key", 3 * CHUNK, CHUNK);
    let poisoned_read = me.retrieve(b"shared-key", 4 * CHUNK, CHUNK);
    let reads_its_own = me.read(4 * CHUNK, CHUNK) == pattern(3, CHUNK);
    json!({
        "hello": hello,
        "own_store": own_store,
        "own_retrieve": own_retrieve,
        "own_intact": own_intact,
        "own_lookup": own_lookup,
        "lookup": lookup,
        "retrieve": retrieve,
        "batch": batch,
        "untouched": untouched,
        "read_shared": read_shared,
        "poison": poison,
        "poisoned_read": poisoned_read,
        "reads_its_own": reads_its_own,
    })
}

/// Row 33: uid 1001 and uid 1002 use the same key. By default each uid is a tenant of
/// its own: 1002's lookup and retrieve (single and batch) of 1001's key miss and write
/// nothing, its store of the key lands in its own keyspace, and 1001 still reads its
/// own bytes. The control: joined by the operator (`--tenant team=uid:1001,uid:1002`)
/// they do share the key.
#[test]
fn row_33_another_tenants_key_is_another_chunk() {
    // Default tenants.
    let dir = TempDir::new("row33");
    let server = shared_server(&dir, &[]);
    let socket = server.socket.clone();
    let mut owner = fork_as_uid(ALICE, row_33_owner(socket.clone(), 3301));
    let stored = owner.recv("uid 1001 stores its key");
    assert_eq!(stored["hello"]["ok"]["tenant"], "uid-1001", "{stored}");
    assert_eq!(stored["stored"]["ok"], true, "{stored}");
    let other = run_as_uid(BOB, "uid 1002 tries the key", || {
        row_33_other(&socket, 3302)
    });
    assert_eq!(other["hello"]["ok"]["tenant"], "uid-1002", "{other}");
    // Controls: its own key works every way.
    assert_eq!(ok(&other["own_store"], "own store"), true);
    assert_eq!(ok(&other["own_retrieve"], "own retrieve"), CHUNK);
    assert_eq!(other["own_intact"], true);
    assert_eq!(ok(&other["own_lookup"], "own lookup"), 1);
    // The other tenant's key: not there for it.
    assert_eq!(ok(&other["lookup"], "lookup"), 0, "{other}");
    assert_eq!(ok(&other["retrieve"], "retrieve"), &Json::Null, "{other}");
    assert_eq!(
        ok(&other["batch"], "retrieve_batch"),
        &json!([null]),
        "{other}"
    );
    assert_eq!(other["untouched"], true, "a miss writes nothing: {other}");
    assert_eq!(other["read_shared"], false);
    // Its store of the same key is its own chunk.
    assert_eq!(ok(&other["poison"], "its store"), true);
    assert_eq!(ok(&other["poisoned_read"], "its read"), CHUNK);
    assert_eq!(other["reads_its_own"], true);
    // The owner reads its own bytes.
    owner.send(json!("check"));
    let check = owner.finish("uid 1001 reads its key");
    assert_eq!(check["retrieve"]["ok"], CHUNK, "{check}");
    assert_eq!(
        check["intact"], true,
        "the other tenant's store never reached it"
    );
    assert_eq!(check["lookup"]["ok"], 1);
    let status = server.status();
    assert_eq!(
        tenant(&status, "uid-1001").expect("listed")["slots_used"],
        1
    );
    assert_eq!(
        tenant(&status, "uid-1002").expect("listed")["slots_used"],
        2
    );

    // The control: the operator joins both uids into one tenant.
    let dir = TempDir::new("row33-team");
    let server = shared_server(&dir, &["--tenant", "team=uid:1001,uid:1002"]);
    let socket = server.socket.clone();
    let mut owner = fork_as_uid(ALICE, row_33_owner(socket.clone(), 3311));
    let stored = owner.recv("uid 1001 stores its key");
    assert_eq!(stored["hello"]["ok"]["tenant"], "team", "{stored}");
    assert_eq!(stored["stored"]["ok"], true, "{stored}");
    let shared = run_as_uid(BOB, "uid 1002 reads the team's key", || {
        let mut me = RawWorker::register(&socket, 3312, BUFFER);
        let lookup = me.lookup(&[b"shared-key"]);
        let retrieve = me.retrieve(b"shared-key", 0, CHUNK);
        let same = me.read(0, CHUNK) == pattern(1, CHUNK);
        json!({ "lookup": lookup, "retrieve": retrieve, "same": same })
    });
    assert_eq!(ok(&shared["lookup"], "a teammate's lookup"), 1);
    assert_eq!(ok(&shared["retrieve"], "a teammate's retrieve"), CHUNK);
    assert_eq!(shared["same"], true);
    owner.send(json!("check"));
    owner.finish("uid 1001 reads its key");
    let status = server.status();
    assert_eq!(tenant(&status, "team").expect("listed")["slots_used"], 1);
}

// ------------------------------------------------------------------ row 34

/// Row 34: uid 1002 floods L1 (4 MiB, 64 slots) with stores of fresh keys while the
/// victim's tenant holds 8 chunks, within its fair share. The pool fills and the flood
/// goes on recycling the flooder's own slots: every flood store is answered `true`,
/// most of its early chunks are gone (the control: the pool was full and evicting),
/// and every one of the victim's chunks stays with its bytes. `/status` shows each
/// tenant's slots and quota.
#[test]
fn row_34_a_flooding_tenant_evicts_its_own_slots_first() {
    const VICTIM_CHUNKS: u64 = 8;
    const FLOOD: u64 = 200;
    let dir = TempDir::new("row34");
    let server = shared_server(&dir, &[]);
    let slots = server.status()["l1"]["slots_total"].as_u64().unwrap();
    assert_eq!(slots, 64, "--l1-bytes 4M / --slot-bytes 64K");
    let mut victim = RawWorker::register(&server.socket, 3401, BUFFER);
    for n in 0..VICTIM_CHUNKS {
        victim.write(n * CHUNK, &pattern(100 + n, CHUNK));
        let key = format!("victim-{n}");
        assert_eq!(victim.store(key.as_bytes(), n * CHUNK, CHUNK)["ok"], true);
    }
    let socket = server.socket.clone();
    let flood = run_as_uid(BOB, "uid 1002 floods", || {
        let mut me = RawWorker::register(&socket, 3402, BUFFER);
        me.write(0, &pattern(9, CHUNK));
        let mut stored = 0u64;
        for n in 0..FLOOD {
            let key = format!("flood-{n}");
            if me.store(key.as_bytes(), 0, CHUNK)["ok"] == true {
                stored += 1;
            }
        }
        let mut held = 0u64;
        for n in 0..FLOOD {
            let key = format!("flood-{n}");
            if me.lookup(&[key.as_bytes()])["ok"] == 1 {
                held += 1;
            }
        }
        let last = format!("flood-{}", FLOOD - 1);
        let last_held = me.lookup(&[last.as_bytes()]);
        json!({ "stored": stored, "held": held, "last_held": last_held })
    });
    assert_eq!(
        flood["stored"], FLOOD,
        "every flood store answered true: {flood}"
    );
    assert_eq!(
        flood["last_held"]["ok"], 1,
        "its latest chunk is held: {flood}"
    );
    let held = flood["held"].as_u64().unwrap();
    assert_eq!(
        held,
        slots - VICTIM_CHUNKS,
        "the flooder holds every slot but the victim's: it recycled its own"
    );
    // The victim's chunks, every one, with its bytes.
    for n in 0..VICTIM_CHUNKS {
        let key = format!("victim-{n}");
        let at = BUFFER / 2 + n * CHUNK;
        assert_eq!(
            victim.retrieve(key.as_bytes(), at, CHUNK)["ok"],
            CHUNK,
            "{key}"
        );
        assert_eq!(
            victim.read(at, CHUNK),
            pattern(100 + n, CHUNK),
            "{key}'s bytes"
        );
    }
    let (code, body) = server.http_get("/status");
    assert_eq!(code, 200);
    let status: Json = serde_json::from_str(&body).unwrap();
    let own = tenant(&status, &kvwarden_tests::own_tenant()).expect("the victim's tenant");
    let flooder = tenant(&status, "uid-1002").expect("the flooder's tenant");
    assert_eq!(own["slots_used"], VICTIM_CHUNKS, "{status:#}");
    assert_eq!(flooder["slots_used"], held, "{status:#}");
    let (own_quota, flooder_quota) = (
        own["quota_slots"].as_u64().unwrap(),
        flooder["quota_slots"].as_u64().unwrap(),
    );
    assert!(
        VICTIM_CHUNKS <= own_quota,
        "the victim is within its share: {status:#}"
    );
    assert!(
        held > flooder_quota,
        "the flooder is over its share: {status:#}"
    );
    assert_eq!(victim.ping()["ok"], true);
}

// ------------------------------------------------------------------ row 35

/// `register_engine_driven` from uid 1001 on `socket`, after the control (a
/// server-driven registration of the same id on the same connection): the answer and
/// the fds that came with it.
fn row_35_try(socket: &Path, id: u64) -> Json {
    let mut me = RawWorker::register(socket, id, 0);
    let (reply, fds) = engine_support::request_receiving_fds(
        &mut me.raw,
        "register_engine_driven",
        vec![id.into(), "engine".into(), 1.into()],
    );
    json!({ "engine": answer_of(reply.result), "fds": fds.len() })
}

/// Row 35: uid 1001 may register server-driven (the control) but not engine-driven
/// (it would map the whole L1 pool): `forbidden` naming its tenant and the flag, and
/// no pool fd reaches it; the server's own uid may (the control of a trusted tenant).
/// With `--tenant t=uid:1001,engine-driven` uid 1001 may, and gets the pool.
#[test]
fn row_35_an_untrusted_tenant_may_not_register_engine_driven() {
    let dir = TempDir::new("row35");
    let server = shared_server(&dir, &[]);
    let socket = server.socket.clone();
    let refused = run_as_uid(ALICE, "uid 1001 registers engine-driven", || {
        row_35_try(&socket, 3501)
    });
    assert_forbidden(
        &refused["engine"],
        "engine-driven from uid 1001",
        "uid-1001",
    );
    let message = refused["engine"]["message"].as_str().unwrap();
    assert!(
        message.contains("--tenant") && message.contains("engine-driven"),
        "the fix is named: {message}"
    );
    assert_eq!(refused["fds"], 0, "no pool fd reached it");
    let status = server.status();
    let modules: Vec<&Json> = status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|entry| entry["instance_id"] == 3501)
        .map(|entry| &entry["module"])
        .collect();
    assert!(
        modules.iter().all(|module| **module == "server_driven"),
        "{status:#}"
    );
    // The server's own uid's tenant is trusted.
    let root = engine_support::EngineWorker::register(&server.socket, 3502);
    assert_eq!(root.outcome, "created");
    let own = tenant(&status, &kvwarden_tests::own_tenant()).expect("own tenant");
    assert_eq!(own["engine_driven"], true);
    // Its tenant is forgotten once its process left, if that was seen before the status
    // (row 70); while it is tracked, it is not engine-driven.
    if let Some(untrusted) = tenant(&status, "uid-1001") {
        assert_eq!(untrusted["engine_driven"], false);
    }

    // Marked engine-driven by the operator: allowed.
    let dir = TempDir::new("row35-trusted");
    let server = shared_server(&dir, &["--tenant", "t=uid:1001,engine-driven"]);
    let socket = server.socket.clone();
    let allowed = run_as_uid(ALICE, "uid 1001 of a trusted tenant", || {
        row_35_try(&socket, 3511)
    });
    assert_eq!(
        ok(&allowed["engine"], "engine-driven from a trusted tenant")["outcome"],
        "created"
    );
    assert_eq!(allowed["fds"], 1, "the pool's memfd");
    assert_eq!(
        tenant(&server.status(), "t").unwrap()["engine_driven"],
        true
    );
}

// ------------------------------------------------------------------ row 36

fn mismatches(status: &Json) -> u64 {
    status["trust"]["retrieve_length_mismatches_total"]
        .as_u64()
        .unwrap_or(0)
}

/// Row 36: another process of the victim's tenant stores a 64 KiB value under a key
/// the victim expects as a 4 KiB block (its control reads it back with the right
/// length). The victim's retrieve of 4096 bytes into the middle of its buffer is a
/// miss that writes not one byte (single and batch item), counted in the status and
/// the metrics; a shorter value than asked is a miss too; the right length hits.
#[test]
fn row_36_a_value_of_another_length_is_a_miss_that_writes_nothing() {
    const BIG: u64 = 64 << 10;
    let dir = TempDir::new("row36");
    let server = shared_server(&dir, &[]);
    let client = Client::connect(ClientConfig::new(Endpoint::Unix(server.socket.clone())))
        .expect("connecting");
    let buffer = Arc::new(MemfdBuffer::new(1 << 20).expect("a memfd"));
    assert_eq!(
        client
            .register(vec![Arc::clone(&buffer)], "row36", 1)
            .unwrap(),
        "created"
    );
    let socket = server.socket.clone();
    let planted = run_as_uid(own_uid(), "a 64 KiB value planted", || {
        let mut me = RawWorker::register(&socket, 3602, BUFFER);
        me.write(0, &pattern(64, BIG));
        let stored = me.store(b"block-7", 0, BIG);
        let control = me.retrieve(b"block-7", BIG, BIG);
        let same = me.read(BIG, BIG) == pattern(64, BIG);
        json!({ "stored": stored, "control": control, "same": same })
    });
    assert_eq!(ok(&planted["stored"], "the 64 KiB store"), true);
    assert_eq!(ok(&planted["control"], "its retrieve of 64 KiB"), BIG);
    assert_eq!(planted["same"], true);
    assert_eq!(mismatches(&server.status()), 0);

    let fill = vec![0xa5u8; 1 << 20];
    assert!(buffer.write(0, &fill));
    let snapshot = |buffer: &MemfdBuffer| {
        let mut all = vec![0u8; 1 << 20];
        assert!(buffer.read(0, &mut all));
        all
    };
    let middle = 512 << 10;
    // A single retrieve of 4096 bytes: a miss, nothing written.
    assert_eq!(client.retrieve(b"block-7", 0, middle, CHUNK).unwrap(), None);
    assert!(snapshot(&buffer) == fill, "a byte of the buffer changed");
    assert_eq!(mismatches(&server.status()), 1);
    // A batch: the 4096-byte item misses, the 64 KiB item hits.
    let hit_at = 600 << 10;
    let answers = client
        .retrieve_batch(&[
            (b"block-7".as_slice(), 0, middle, CHUNK),
            (b"block-7".as_slice(), 0, hit_at, BIG),
        ])
        .unwrap();
    assert_eq!(answers, vec![None, Some(BIG)]);
    let mut expected = fill.clone();
    expected[hit_at as usize..(hit_at + BIG) as usize].copy_from_slice(&pattern(64, BIG));
    assert!(
        snapshot(&buffer) == expected,
        "only the hit's bytes changed"
    );
    assert_eq!(mismatches(&server.status()), 2);
    // A value shorter than asked: a miss too.
    assert!(buffer.write(0, &pattern(4, CHUNK)));
    assert!(client.store(b"small", 0, 0, CHUNK).unwrap());
    expected[..CHUNK as usize].copy_from_slice(&pattern(4, CHUNK));
    assert_eq!(client.retrieve(b"small", 0, middle, BIG).unwrap(), None);
    assert!(
        snapshot(&buffer) == expected,
        "a byte of the buffer changed"
    );
    assert_eq!(mismatches(&server.status()), 3);
    assert_eq!(
        metric(&server, "kvwarden_retrieve_length_mismatches_total"),
        Some(3.0)
    );
    // The right lengths hit.
    assert_eq!(
        client.retrieve(b"small", 0, middle, CHUNK).unwrap(),
        Some(CHUNK)
    );
    assert_eq!(
        client.retrieve(b"block-7", 0, middle + CHUNK, BIG).unwrap(),
        Some(BIG)
    );
    let mut read = vec![0u8; BIG as usize];
    assert!(buffer.read(middle + CHUNK, &mut read));
    assert_eq!(read, pattern(64, BIG));
    assert_eq!(mismatches(&server.status()), 3, "hits are not counted");
    client.shutdown().unwrap();
}

// ------------------------------------------------------------------ row 37

/// Runs `kvwarden serve` as `uid` with its default socket (no `--socket`, no
/// `XDG_RUNTIME_DIR`) until it says `ready` (then stops it) or exits: whether it got
/// ready, and its stderr.
fn serve_default_socket_as(uid: u32) -> (bool, String) {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(kvwarden_bin())
        .args(["serve", "--http", "off"])
        .env_remove("XDG_RUNTIME_DIR")
        .env("RUST_LOG", "info")
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvwarden serve");
    let mut lines = kvwarden_bench::process::Lines::spawn(child.stdout.take().unwrap());
    let ready = lines
        .wait("ready", PATIENCE, |line| line == "ready")
        .is_ok();
    let expected_socket = format!("socket=/tmp/kvwarden-{uid}/kvwarden.sock");
    if ready {
        assert!(
            lines.seen().contains(&expected_socket),
            "{:?}",
            lines.seen()
        );
        kvwarden_tests::signal(&child, rustix::process::Signal::TERM);
    }
    if wait_exit(&mut child, PATIENCE).is_none() {
        let _ = child.kill();
        panic!("kvwarden serve as uid {uid} neither got ready nor exited");
    }
    let output = child.wait_with_output().expect("its output");
    (ready, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// The default socket directory of uid 1003 (literally `/tmp/kvwarden-1003`).
fn fresh_private_dir(uid: u32) -> PathBuf {
    let dir = PathBuf::from(format!("/tmp/kvwarden-{uid}"));
    match std::fs::symlink_metadata(&dir) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&dir).unwrap(),
        Ok(_) => std::fs::remove_file(&dir).unwrap(),
        Err(_) => {}
    }
    dir
}

fn make_dir(dir: &Path, owner: u32, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(dir).unwrap();
    std::os::unix::fs::chown(dir, Some(owner), Some(owner)).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A Rust client of `uid` connecting to `socket` (trusting `trusted` server uids):
/// refused as an untrusted server, or connected and registered with one memfd.
fn row_37_client(socket: &Path, trusted: Vec<u32>) -> Json {
    let mut config = ClientConfig::new(Endpoint::Unix(socket.to_path_buf()));
    config.trusted_server_uids = trusted;
    match Client::connect(config) {
        Err(ClientError::UntrustedServer {
            socket,
            uid,
            own_uid,
            ..
        }) => json!({ "untrusted": { "socket": socket, "uid": uid, "own_uid": own_uid } }),
        Err(other) => json!({ "error": other.to_string() }),
        Ok(client) => {
            let buffer = Arc::new(MemfdBuffer::new(4096).expect("a memfd"));
            let outcome = client.register(vec![buffer], "row37", 1);
            let outcome = outcome.unwrap_or_else(|e| e.to_string());
            json!({ "registered": outcome })
        }
    }
}

/// Row 37: another user creates the default socket directory first. A server of uid
/// 1003 (no `XDG_RUNTIME_DIR`) refuses `/tmp/kvwarden-1003` owned by uid 1004, or of
/// its own uid with mode 0777, or a symlink, naming it; the control: without it, the
/// server creates it (mode 0700, its own) and serves there. And a server of an
/// untrusted uid answers on the socket: a Rust client of uid 1002 (and root) refuses a
/// server of uid 1001 with `UntrustedServer` before sending a single request or fd (the
/// server counts no `hello` and holds nothing); the controls: trusting uid 1001, and
/// uid 1001's own client, connect and register.
#[test]
fn row_37_a_socket_dir_or_server_of_another_user_is_refused() {
    row_37_untrusted_server();
    row_37_default_socket_dir();
}

/// A server of uid 1001 answers on the socket: refused by a client of uid 1002 and by
/// root before any request or fd; the controls connect.
fn row_37_untrusted_server() {
    let dir = TempDir::new("row37-server");
    dir.chown(ALICE);
    let server = Server::start_as_uid(&dir, ALICE, &["--socket-mode", "666"]);
    let socket = server.socket.clone();
    let hellos = || metric(&server, "kvwarden_requests_total{op=\"hello\"}");
    assert_eq!(hellos(), Some(0.0));
    let bob = run_as_uid(BOB, "uid 1002's client", || row_37_client(&socket, vec![]));
    assert_eq!(
        bob["untrusted"],
        json!({ "socket": socket.display().to_string(), "uid": ALICE, "own_uid": BOB }),
        "{bob}"
    );
    let root = row_37_client(&socket, vec![]);
    assert_eq!(root["untrusted"]["uid"], ALICE, "{root}");
    let message = ClientError::UntrustedServer {
        socket: socket.display().to_string(),
        uid: ALICE,
        own_uid: BOB,
        trusted: vec![],
    }
    .to_string();
    assert!(message.contains("trusted_server_uids"), "{message}");
    // Nothing reached the server: no hello (so no pidfd), no registration, no memfd.
    let status = server.status();
    assert_eq!(hellos(), Some(0.0), "a refusing client sent nothing");
    assert_eq!(
        status["worker_liveness"]["tracked_instances"], 0,
        "{status:#}"
    );
    assert_eq!(status["watched_processes"], 0, "{status:#}");
    assert_eq!(status["trust"]["bound_instances"], 0, "{status:#}");
    // The controls: trusting uid 1001, and uid 1001's own client.
    let trusting = run_as_uid(BOB, "uid 1002 trusting uid 1001", || {
        row_37_client(&socket, vec![ALICE])
    });
    assert_eq!(trusting["registered"], "created", "{trusting}");
    let own = run_as_uid(ALICE, "uid 1001's own client", || {
        row_37_client(&socket, vec![])
    });
    assert_eq!(own["registered"], "created", "{own}");
    assert_eq!(hellos(), Some(2.0));
    let status = server.status();
    assert_eq!(built(&status), 2, "{status:#}");
    wait_for("the clients' exits freed", PATIENCE, || {
        (server.status()["worker_liveness"]["tracked_instances"] == 0).then_some(())
    });
}

/// The default socket directory of uid 1003 made by someone else first (this test alone
/// uses `/tmp/kvwarden-1003`): refused, each case, naming it; the control: created.
fn row_37_default_socket_dir() {
    use std::os::unix::fs::MetadataExt;
    const SERVER_UID: u32 = 1003;
    const OTHER_UID: u32 = 1004;
    let dir = fresh_private_dir(SERVER_UID);
    let (ready, log) = serve_default_socket_as(SERVER_UID);
    assert!(
        ready,
        "the control: without the directory the server starts: {log}"
    );
    let meta = std::fs::symlink_metadata(&dir).expect("the server created its directory");
    assert!(meta.is_dir());
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (SERVER_UID, 0o700));
    // Refused with the error that says why (the directory is not the server's own
    // 0700 one) and what to do; collected, so that every case is tried.
    let mut not_named_unsafe = Vec::new();
    for (what, owner, mode) in [
        ("owned by another uid", OTHER_UID, 0o755),
        ("writable by every user", SERVER_UID, 0o777),
        ("owned by another uid, mode 0700", OTHER_UID, 0o700),
    ] {
        let dir = fresh_private_dir(SERVER_UID);
        make_dir(&dir, owner, mode);
        let (ready, log) = serve_default_socket_as(SERVER_UID);
        assert!(
            !ready,
            "{what}: the server started in {}: {log}",
            dir.display()
        );
        assert!(
            log.contains(&dir.display().to_string()),
            "{what}: not named: {log}"
        );
        if !log.contains("refusing the socket directory") {
            not_named_unsafe.push(format!("{what}: {}", log.lines().last().unwrap_or("")));
        }
        assert!(
            !dir.join("kvwarden.sock").exists(),
            "{what}: a socket was made"
        );
    }
    // A symlink to a directory of the server's uid is not the directory.
    let target = TempDir::new("row37-link");
    target.chown(SERVER_UID);
    let link = fresh_private_dir(SERVER_UID);
    std::os::unix::fs::symlink(target.path(), &link).unwrap();
    let (ready, log) = serve_default_socket_as(SERVER_UID);
    assert!(!ready, "a symlink was followed: {log}");
    assert!(
        log.contains(&link.display().to_string()),
        "not named: {log}"
    );
    if !log.contains("refusing the socket directory") {
        not_named_unsafe.push(format!("a symlink: {}", log.lines().last().unwrap_or("")));
    }
    let _ = fresh_private_dir(SERVER_UID);
    assert!(
        not_named_unsafe.is_empty(),
        "refused without the unsafe-directory error (it must name the directory and say it \
         is not uid 1003's own 0700 one): {not_named_unsafe:#?}"
    );
}
