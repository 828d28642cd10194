//! No neighbour can crash or freeze the server (issue 50): failure-mode rows 55–57 end
//! to end, each attack run by a real process of another uid (1001, forked and setuid:
//! the tests run as root) against a real `kvwarden serve` whose socket every uid may
//! reach, while a victim of a third uid (1002) is served.
//!
//! Each test first runs its control: the victim's round (register a memfd, store a
//! chunk, retrieve it back, compare, unregister) and the attacker's own operation done
//! as a well-behaved peer would, both served. Then the attack, then the victim's round
//! again and the server's health. The one bound on time (row 56) is ten times away from
//! what the attack would hold without the fix.

use kvwarden_tests::{RawClient, Server, TempDir, fork_as_uid, memfd_spec, wait_for};
use rmpv::Value;
use rustix::fd::{AsFd, OwnedFd};
use serde_json::{Value as Json, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The attacker's uid.
const ALICE: u32 = 1001;
/// The victim's uid.
const BOB: u32 = 1002;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A server every uid may reach (`--socket-mode 666`), as on a node whose workers run
/// under many uids.
fn shared_server(dir: &TempDir, extra: &[&str]) -> Server {
    let mut flags = vec!["--socket-mode", "666"];
    flags.extend_from_slice(extra);
    Server::start(dir, &flags)
}

fn register_args(instance: u64, nbytes: u64) -> Vec<Value> {
    vec![
        instance.into(),
        Value::Array(vec![memfd_spec(0, nbytes)]),
        "m".into(),
        1.into(),
    ]
}

/// `register_kv_cache` of one memfd buffer claimed at `nbytes`: the reply's outcome
/// (`created`), or the error's code.
fn register(raw: &mut RawClient, instance: u64, nbytes: u64, fd: impl AsFd) -> String {
    let reply = raw
        .request_with_fds(
            "register_kv_cache",
            register_args(instance, nbytes),
            &[fd.as_fd()],
        )
        .expect("a reply to register_kv_cache");
    match reply.result {
        Ok(value) => kvwarden::server::status::msgpack_to_json(&value)["outcome"]
            .as_str()
            .unwrap_or("?")
            .to_owned(),
        Err(error) => error.code.as_str().to_owned(),
    }
}

fn transfer(raw: &mut RawClient, op: &str, instance: u64, key: &[u8], offset: u64) -> Value {
    raw.request(
        op,
        vec![
            instance.into(),
            Value::Binary(key.to_vec()),
            0u64.into(),
            offset.into(),
            (64 * KIB).into(),
        ],
    )
    .expect("a reply")
    .result
    .unwrap_or_else(|error| panic!("{op} refused: {error}"))
}

/// The victim's round, in a process of uid [`BOB`]: registers a 256 KiB memfd as a
/// fresh instance, stores 64 KiB of a pattern, retrieves it into another window of the
/// buffer, compares, unregisters. True when every step was served as it should be.
fn victim_round(socket: &Path, instance: u64) -> bool {
    let Ok(mut raw) = RawClient::connect(socket) else {
        return false;
    };
    raw.attach(instance);
    let fd = kvwarden::memfd::create("victim", 256 * KIB).expect("a memfd");
    let mapping = kvwarden::memfd::SharedMapping::map(&fd, (256 * KIB) as usize).unwrap();
    let pattern: Vec<u8> = (0..64 * KIB)
        .map(|i| (i % 251) as u8 ^ instance as u8)
        .collect();
    assert!(mapping.write(0, &pattern));
    if register(&mut raw, instance, 256 * KIB, &fd) != "created" {
        return false;
    }
    let key = format!("victim-{instance}").into_bytes();
    let stored = transfer(&mut raw, "store", instance, &key, 0) == Value::Boolean(true);
    let retrieved = transfer(&mut raw, "retrieve", instance, &key, 128 * KIB);
    let mut back = vec![0u8; pattern.len()];
    assert!(mapping.read(128 * KIB, &mut back));
    let unregistered = raw
        .request("unregister_kv_cache", vec![instance.into()])
        .is_ok_and(|reply| reply.result == Ok(Value::Boolean(true)));
    stored && retrieved == Value::from(64 * KIB) && back == pattern && unregistered
}

/// A victim of uid [`BOB`] that runs [`victim_round`] each time the parent asks, with
/// a fresh instance each round.
struct Victim(kvwarden_tests::Forked);

impl Victim {
    fn start(socket: PathBuf, first_instance: u64) -> Victim {
        let forked = fork_as_uid(BOB, move |parent| {
            let mut instance = first_instance;
            while parent.recv() == json!("round") {
                parent.send(json!(victim_round(&socket, instance)));
                instance += 1;
            }
            json!(null)
        });
        Victim(forked)
    }

    fn served(&mut self, when: &str) -> bool {
        self.0.send(json!("round"));
        self.0.recv(when) == json!(true)
    }

    fn finish(self) {
        self.0.finish("the victim");
    }
}

fn alive(server: &mut Server) -> bool {
    matches!(server.child.try_wait(), Ok(None)) && server.http_get("/healthz").0 == 200
}

// ------------------------------------------------------------------ row 55

/// Registrations the attacker tries while it shrinks and grows each memfd.
const SEAL_RACE_ATTEMPTS: u64 = 1500;

/// Row 55: a worker that shrinks its memfd while the server checks and seals it (a
/// second thread toggles `ftruncate` between 4 KiB and 4 MiB) never gets a buffer
/// registered over a file smaller than it claims, so the `store` from offset 2 MiB that
/// follows every `created` never faults the server. Checked before the fix, the size
/// was read, then the file shrunk, then sealed: `created` over a 4 KiB file, and the
/// store killed the server with SIGBUS.
#[test]
fn row_55_a_memfd_shrunk_while_it_is_sealed_never_crashes_the_server() {
    let dir = TempDir::new("row55-seal-race");
    let mut server = shared_server(&dir, &["--worker-registration-grace-seconds", "60"]);
    let mut victim = Victim::start(server.socket.clone(), 55_000);
    assert!(
        victim.served("the control round"),
        "control: the victim is served"
    );

    let socket = server.socket.clone();
    let attacker = fork_as_uid(ALICE, move |_| {
        let mut raw = RawClient::connect(&socket).expect("connecting");
        // The attacker's control: a memfd left alone registers and serves the store.
        raw.attach(55_100);
        let quiet = kvwarden::memfd::create("quiet", 4 * MIB).unwrap();
        let control = register(&mut raw, 55_100, 4 * MIB, &quiet);
        let control_store = transfer(&mut raw, "store", 55_100, b"quiet", 2 * MIB);
        let (mut created, mut refused, mut smaller_than_claimed) = (0u64, 0u64, 0u64);
        for attempt in 0..SEAL_RACE_ATTEMPTS {
            let instance = 55_200 + attempt;
            // A connection attaches at most 1024 instances: a fresh one every few.
            if attempt % 256 == 0 {
                raw = RawClient::connect(&socket).expect("connecting");
            }
            raw.attach(instance);
            let fd = std::sync::Arc::new(kvwarden::memfd::create("racy", 4 * MIB).unwrap());
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let toggles = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let toggler = {
                let (fd, stop, toggles) = (fd.clone(), stop.clone(), toggles.clone());
                std::thread::spawn(move || {
                    // Shrinks and grows it until the server seals it, and then leaves
                    // it as it was sealed (growing it back would undo the attack).
                    let sealed = || {
                        rustix::fs::fcntl_get_seals(&*fd)
                            .is_ok_and(|seals| seals.contains(rustix::fs::SealFlags::SHRINK))
                    };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = rustix::fs::ftruncate(&*fd, 4 * KIB);
                        if sealed() {
                            break;
                        }
                        let _ = rustix::fs::ftruncate(&*fd, 4 * MIB);
                        if sealed() {
                            break;
                        }
                        toggles.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            };
            // Racing from the first byte of the request on.
            while toggles.load(std::sync::atomic::Ordering::Relaxed) < 16 {
                std::hint::spin_loop();
            }
            let outcome = register(&mut raw, instance, 4 * MIB, &*fd);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            toggler.join().unwrap();
            if outcome != "created" {
                refused += 1;
                continue;
            }
            created += 1;
            let size = rustix::fs::fstat(&*fd).map_or(0, |stat| stat.st_size as u64);
            smaller_than_claimed += u64::from(size < 4 * MIB);
            // Before the fix, this is the store that killed the server.
            let _ = raw.request(
                "store",
                vec![
                    instance.into(),
                    Value::Binary(b"racy".to_vec()),
                    0u64.into(),
                    (2 * MIB).into(),
                    (64 * KIB).into(),
                ],
            );
            let _ = raw.request("unregister_kv_cache", vec![instance.into()]);
        }
        json!({
            "control": control,
            "control_store": control_store == Value::Boolean(true),
            "created": created,
            "refused": refused,
            "smaller_than_claimed": smaller_than_claimed,
        })
    });
    let report = attacker.finish("the attacker");
    eprintln!("the seal race: {report}");
    assert_eq!(report["control"], "created", "{report}");
    assert_eq!(report["control_store"], true, "{report}");
    assert_eq!(
        report["created"].as_u64().unwrap() + report["refused"].as_u64().unwrap(),
        SEAL_RACE_ATTEMPTS,
        "every attempt was answered: {report}"
    );
    assert_eq!(
        report["smaller_than_claimed"], 0,
        "no registration holds a file smaller than it claims: {report}"
    );
    assert!(alive(&mut server), "the server survived the race: {report}");
    assert!(
        victim.served("after the race"),
        "the victim is still served"
    );
    victim.finish();
}

// ------------------------------------------------------------------ row 56

/// How long each handed-over socket lingers on a plain close.
const LINGER: Duration = Duration::from_secs(30);

/// A connected TCP socket whose close lingers for [`LINGER`]: its send and receive
/// buffers are full, and the peer (returned, to be kept open) never reads.
fn lingering_socket() -> (OwnedFd, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (receiver, _) = listener.accept().unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&receiver, 4096).unwrap();
    rustix::net::sockopt::set_socket_linger(&sender, Some(LINGER)).unwrap();
    sender.set_nonblocking(true).unwrap();
    let chunk = vec![7u8; 64 << 10];
    while std::io::Write::write(&mut &sender, &chunk).is_ok() {}
    (OwnedFd::from(sender), receiver)
}

/// Row 56: fds whose close lingers for 30 s, handed over by a neighbour where the
/// server closes them (one with a `ping [nil]`, which uses none; four with a
/// `register_kv_cache` that is refused on a pool thread, one for each of the pool's
/// threads; one with half a frame on a connection that then goes), freeze neither the
/// event loop nor the pool: `/healthz` answers within 3 s (a tenth of the linger), the
/// victim registers and is served meanwhile, every fd is closed (a reset for the
/// lingering sockets), and the server never saw itself stalled.
#[test]
fn row_56_an_fd_whose_close_lingers_freezes_neither_the_loop_nor_the_pool() {
    let dir = TempDir::new("row56-linger");
    let mut server = shared_server(&dir, &["--pool-threads", "4"]);
    let mut victim = Victim::start(server.socket.clone(), 56_000);
    assert!(
        victim.served("the control round"),
        "control: the victim is served"
    );
    let started = Instant::now();
    assert_eq!(
        server.http_get("/healthz").0,
        200,
        "control: /healthz answers"
    );
    let control_healthz = started.elapsed();

    let socket = server.socket.clone();
    let mut attacker = fork_as_uid(ALICE, move |parent| {
        let mut receivers = Vec::new();
        let mut raw = RawClient::connect(&socket).expect("connecting");
        // The control: a ping [nil] with no fd is answered.
        let control = raw
            .request("ping", vec![Value::Nil])
            .expect("a reply")
            .result;
        // One lingering fd with a ping, which uses none: a stray, closed by the server.
        let (fd, receiver) = lingering_socket();
        receivers.push(receiver);
        let (id, frame) = raw.frame("ping", vec![Value::Nil]);
        raw.send_with_fds(&frame, &[fd.as_fd()]).unwrap();
        drop(fd);
        let ping = raw.read_reply().expect("the ping's reply");
        assert_eq!(ping.id, id);
        // Four with a registration refused on the pool (not memfds).
        raw.attach(56_100);
        let fds: Vec<OwnedFd> = (0..4)
            .map(|_| {
                let (fd, receiver) = lingering_socket();
                receivers.push(receiver);
                fd
            })
            .collect();
        let specs = (0..4).map(|i| memfd_spec(i, 4096)).collect();
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        let register = raw
            .request_with_fds(
                "register_kv_cache",
                vec![56_100u64.into(), Value::Array(specs), "m".into(), 1.into()],
                &borrowed,
            )
            .expect("the registration's reply");
        drop(fds);
        // One with half a frame, on a connection that then goes.
        let mut half = RawClient::connect(&socket).expect("connecting");
        let (fd, receiver) = lingering_socket();
        receivers.push(receiver);
        let (_, frame) = half.frame("ping", vec![Value::Nil]);
        half.send_with_fds(&frame[..frame.len() / 2], &[fd.as_fd()])
            .unwrap();
        drop(fd);
        drop(half);
        parent.send(json!({
            "control": control == Ok(Value::Boolean(true)),
            "ping": ping.result == Ok(Value::Boolean(true)),
            "register": register.result.err().map(|e| e.code.as_str().to_owned()),
        }));
        // The receivers stay open (unread) until the parent is done.
        parent.recv();
        json!(receivers.len())
    });
    let sent = attacker.recv("the attacker's fds");
    assert_eq!(sent["control"], true, "{sent}");
    assert_eq!(
        sent["ping"], true,
        "the ping that carried a stray fd is answered: {sent}"
    );
    assert_eq!(sent["register"], "bad_args", "{sent}");

    let started = Instant::now();
    let (code, _) = server.http_get("/healthz");
    let healthz = started.elapsed();
    assert_eq!(code, 200);
    assert!(
        healthz < LINGER / 10,
        "/healthz answered in {healthz:?} while {LINGER:?} lingers were pending (control: \
         {control_healthz:?})"
    );
    assert!(
        victim.served("while the lingers would run"),
        "the victim registers (a pool build) and is served"
    );
    wait_for(
        "every handed-over fd closed",
        Duration::from_secs(20),
        || {
            let status = server.status();
            (status["limits"]["closes_pending"] == 0).then_some(())
        },
    );
    attacker.send(json!("done"));
    assert_eq!(attacker.finish("the attacker"), json!(6));
    assert!(alive(&mut server));
    assert!(
        !server.log().contains("the server itself was stalled"),
        "the event loop never stalled"
    );
    victim.finish();
}

// ------------------------------------------------------------------ row 57

/// Row 57: sparse memfds (free for their sender) cannot take the server's address
/// space or memory: with the default caps, a 4 TiB registration is `bad_args` naming
/// `--max-mapped-bytes-per-instance`, and 16 GiB ones stop at the tenant's 48 GiB
/// (three quarters of 64 GiB) with `overloaded`, while the victim's tenant still
/// registers and is served. Before the fix, 37 registrations of 4 TiB took the
/// server's 128 TiB of address space and the victim's 16 MiB failed `internal`.
#[test]
fn row_57_sparse_memfds_stop_at_the_caps_and_the_victim_still_registers() {
    let dir = TempDir::new("row57-sparse");
    let mut server = shared_server(&dir, &["--worker-registration-grace-seconds", "60"]);
    let mut victim = Victim::start(server.socket.clone(), 57_000);
    assert!(
        victim.served("the control round"),
        "control: the victim is served"
    );

    let socket = server.socket.clone();
    let mut attacker = fork_as_uid(ALICE, move |parent| {
        let mut raw = RawClient::connect(&socket).expect("connecting");
        // The control: a plain 16 MiB registration of the attacker's own is created.
        raw.attach(57_100);
        let small = kvwarden::memfd::create("small", 16 * MIB).unwrap();
        let control = register(&mut raw, 57_100, 16 * MIB, &small);
        let _ = raw.request("unregister_kv_cache", vec![57_100u64.into()]);
        raw.attach(57_101);
        let huge = kvwarden::memfd::create("huge", 4 << 40).unwrap();
        let huge_outcome = register(&mut raw, 57_101, 4 << 40, &huge);
        let mut outcomes = Vec::new();
        let mut held = Vec::new();
        for n in 0..5u64 {
            let instance = 57_110 + n;
            raw.attach(instance);
            let fd = kvwarden::memfd::create("sparse", 16 * GIB).unwrap();
            outcomes.push(register(&mut raw, instance, 16 * GIB, &fd));
            held.push(fd);
        }
        parent.send(json!({"control": control, "huge": huge_outcome, "sparse": outcomes}));
        // Its registrations live while it does (its exit frees them).
        parent.recv();
        json!(held.len())
    });
    let report = attacker.recv("the attacker's registrations");
    assert_eq!(report["control"], "created", "{report}");
    assert_eq!(report["huge"], "bad_args", "{report}");
    assert_eq!(
        report["sparse"],
        json!(["created", "created", "created", "overloaded", "overloaded"]),
        "three of 16 GiB fill the tenant's 48 GiB: {report}"
    );
    let status = server.status();
    assert_eq!(status["mapped"]["bytes"], 48 * GIB, "{}", status["mapped"]);
    assert_eq!(status["mapped"]["max_bytes"], 64 * GIB);
    assert_eq!(status["mapped"]["max_bytes_per_tenant"], 48 * GIB);
    assert_eq!(status["mapped"]["refused_total"], 3);
    let alice = status["tenants"]
        .as_array()
        .and_then(|tenants| {
            tenants
                .iter()
                .find(|t| t["name"] == format!("uid-{ALICE}"))
                .cloned()
        })
        .unwrap_or(Json::Null);
    assert_eq!(alice["mapped_bytes"], 48 * GIB, "{alice}");
    assert!(
        server.log().contains("--max-mapped-bytes-per-tenant"),
        "the refusal is logged naming the flag"
    );
    assert!(
        victim.served("with the attacker at its cap"),
        "the victim's tenant still registers and is served"
    );
    attacker.send(json!("done"));
    attacker.finish("the attacker");
    assert!(alive(&mut server));
    victim.finish();
}

// ------------------------------------------------------------------ secrets

/// The server makes itself non-dumpable (`PR_SET_DUMPABLE` 0) before it reads any
/// secret: no core dump carries its tokens or the L2 secret, and no other process of its
/// uid may ptrace it or read its memory. The kernel shows it: the files under
/// `/proc/<pid>` of a non-dumpable process are root's. Control: a plain process of the
/// same uid owns its `/proc/<pid>/status`.
#[test]
fn the_server_is_not_dumpable_so_no_core_dump_carries_its_secrets() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("dumpable");
    dir.chown(ALICE);
    let server = Server::start_as_uid(&dir, ALICE, &[]);
    let mut plain = std::process::Command::new("sleep")
        .arg("60")
        .uid(ALICE)
        .gid(ALICE)
        .spawn()
        .expect("sleep as uid 1001");
    let owner = |pid: u32| {
        std::fs::metadata(format!("/proc/{pid}/status"))
            .expect("its /proc entry")
            .uid()
    };
    assert_eq!(
        owner(plain.id()),
        ALICE,
        "control: a dumpable process owns its /proc"
    );
    assert_eq!(owner(server.child.id()), 0, "the server is not dumpable");
    let _ = plain.kill();
    let _ = plain.wait();
}
