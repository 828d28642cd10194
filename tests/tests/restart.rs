//! A restart keeps the node's cache warm (issue 48, failure modes 71-73): a server on a
//! pool file (`--l1-file`, `--l1-secret-file`) that is SIGKILLed and started again
//! serves every chunk it had sealed, byte for byte, and never one that is torn, sealed
//! under another secret or for another geometry; a pool file that is not the server's
//! own is refused at start.

use kvwarden::client::{Client, MemfdBuffer};
use kvwarden_tests::l2_worker::{chunk, store, worker};
use kvwarden_tests::{Server, TempDir, kvwarden_bin};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const CHUNK: u64 = 64 << 10;

struct Pool {
    file: PathBuf,
    secret: PathBuf,
}

impl Pool {
    fn new(dir: &TempDir) -> Pool {
        let secret = dir.path().join("l1.secret");
        std::fs::write(&secret, [7u8; 32]).unwrap();
        Pool {
            file: dir.path().join("l1.pool"),
            secret,
        }
    }

    fn flags(&self) -> Vec<String> {
        vec![
            "--l1-file".into(),
            self.file.display().to_string(),
            "--l1-secret-file".into(),
            self.secret.display().to_string(),
        ]
    }
}

fn start(dir: &TempDir, flags: &[String]) -> Server {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Server::start(dir, &flags)
}

fn key(n: u64) -> Vec<u8> {
    format!("chunk-{n}").into_bytes()
}

/// Stores chunks `range` and waits until every one is sealed.
fn store_sealed(
    server: &Server,
    client: &Client,
    buffer: &MemfdBuffer,
    range: std::ops::Range<u64>,
) {
    for n in range {
        store(client, buffer, &key(n), &chunk(n, CHUNK));
    }
    server.wait_status("every stored chunk sealed", |status| {
        status["l1"]["sealing"].as_u64() == Some(0)
    });
}

/// Starts a server with `flags`, stores chunks `range` (each sealed) and SIGKILLs it.
fn fill_and_kill(dir: &TempDir, flags: &[String], range: std::ops::Range<u64>) {
    let server = start(dir, flags);
    {
        let (client, buffer) = worker(&server, "m");
        store_sealed(&server, &client, &buffer, range);
    }
    kill(server);
}

/// Which of chunks `range` the server serves, each checked byte for byte.
fn served(client: &Client, buffer: &MemfdBuffer, range: std::ops::Range<u64>) -> Vec<u64> {
    let mut hits = Vec::new();
    for n in range {
        if client.retrieve(&key(n), 0, 0, CHUNK).expect("retrieve") == Some(CHUNK) {
            let mut got = vec![0u8; CHUNK as usize];
            assert!(buffer.read(0, &mut got));
            assert!(
                got == chunk(n, CHUNK),
                "chunk {n} was served with other bytes than were stored"
            );
            hits.push(n);
        }
    }
    hits
}

fn kill(server: Server) {
    let mut server = server;
    server.child.kill().expect("SIGKILL");
    server.child.wait().expect("reaped");
}

fn adoption(status: &Json) -> &Json {
    &status["l1"]["adoption"]
}

fn adopted(server: &Server) -> Json {
    server.wait_status("the pool adopted", |status| {
        adoption(status)["state"] == "done"
    })
}

#[test]
fn row_71_a_sigkilled_server_restarted_on_its_pool_file_serves_every_sealed_chunk() {
    let dir = TempDir::new("restart-71");
    let pool = Pool::new(&dir);
    let server = start(&dir, &pool.flags());
    {
        let (client, buffer) = worker(&server, "m");
        store_sealed(&server, &client, &buffer, 0..20);
        assert_eq!(served(&client, &buffer, 0..20).len(), 20);
    }
    kill(server);

    // Control: the same restart on an anonymous pool serves none of them.
    let anonymous_dir = TempDir::new("restart-71-anonymous");
    {
        let server = start(&anonymous_dir, &[]);
        let (client, buffer) = worker(&server, "m");
        assert_eq!(served(&client, &buffer, 0..20), Vec::<u64>::new());
    }

    let server = start(&dir, &pool.flags());
    let status = adopted(&server);
    assert_eq!(status["l1"]["pool"], "adopted", "{status}");
    assert_eq!(adoption(&status)["adopted"], 20, "{status}");
    assert_eq!(adoption(&status)["adopted_bytes"], 20 * CHUNK, "{status}");
    assert_eq!(adoption(&status)["dropped"]["torn"], 0, "{status}");
    let (client, buffer) = worker(&server, "m");
    assert_eq!(served(&client, &buffer, 0..20), (0..20).collect::<Vec<_>>());
    assert_eq!(
        served(&client, &buffer, 20..22),
        Vec::<u64>::new(),
        "never stored"
    );
    assert!(
        server
            .log()
            .contains("L1 pool adopted: 20 values served again, 0 dropped")
    );
}

#[test]
fn row_71_a_server_killed_under_store_traffic_serves_no_torn_chunk() {
    let dir = TempDir::new("restart-71-traffic");
    let pool = Pool::new(&dir);
    let server = start(&dir, &pool.flags());
    let (client, buffer) = worker(&server, "m");
    store_sealed(&server, &client, &buffer, 0..8);
    // Stores keep coming (the pool holds 64 slots: they evict and rewrite slots) while
    // the server is SIGKILLed.
    let storing = std::thread::spawn(move || {
        let mut n = 100;
        loop {
            assert!(buffer.write(0, &chunk(n, CHUNK)));
            if client.store(&key(n), 0, 0, CHUNK).is_err() {
                return n;
            }
            n += 1;
        }
    });
    server.wait_status("the pool full: stores evict and rewrite slots", |status| {
        status["l1"]["slots_used"].as_u64() == Some(64)
    });
    kill(server);
    let last = storing.join().expect("the storing thread");

    let server = start(&dir, &pool.flags());
    let status = adopted(&server);
    eprintln!("stored up to chunk {last}; adoption: {}", adoption(&status));
    let (client, buffer) = worker(&server, "m");
    // Every chunk served is byte-identical (checked in `served`); whatever was torn
    // mid-write was dropped, not served.
    let hits = served(&client, &buffer, 0..8).len() + served(&client, &buffer, 100..last + 1).len();
    assert_eq!(
        hits as u64,
        adoption(&status)["adopted"].as_u64().unwrap(),
        "every adopted chunk is served, and only those: {status}"
    );
    assert!(hits > 0, "{status}");
}

#[test]
fn row_72_a_restart_with_another_geometry_or_secret_starts_cold_and_says_why() {
    let dir = TempDir::new("restart-72");
    let pool = Pool::new(&dir);
    fill_and_kill(&dir, &pool.flags(), 0..4);

    // Another secret.
    let other_secret = dir.path().join("other.secret");
    std::fs::write(&other_secret, [8u8; 32]).unwrap();
    let mut flags = pool.flags();
    flags[3] = other_secret.display().to_string();
    let server = start(&dir, &flags);
    let status = server.status();
    assert_eq!(status["l1"]["pool"], "cold", "{status}");
    assert!(
        status["l1"]["cold_reason"]
            .as_str()
            .unwrap()
            .contains("another --l1-secret-file"),
        "{status}"
    );
    {
        let (client, buffer) = worker(&server, "m");
        assert_eq!(served(&client, &buffer, 0..4), Vec::<u64>::new());
        store_sealed(&server, &client, &buffer, 0..4);
    }
    kill(server);

    // Control: the same secret again adopts what it sealed.
    let server = start(&dir, &flags);
    assert_eq!(adoption(&adopted(&server))["adopted"], 4);
    kill(server);

    // Another slot size.
    let mut flags_128k = flags.clone();
    flags_128k.extend(["--slot-bytes".to_string(), "128K".to_string()]);
    let server = start(&dir, &flags_128k);
    let status = server.status();
    assert_eq!(status["l1"]["pool"], "cold", "{status}");
    let reason = status["l1"]["cold_reason"].as_str().unwrap();
    assert!(
        reason.contains("--slot-bytes 65536 and 64 slots")
            && reason.contains("--slot-bytes 131072"),
        "{reason}"
    );
    let (client, buffer) = worker(&server, "m");
    assert_eq!(served(&client, &buffer, 0..4), Vec::<u64>::new());
}

#[test]
fn row_72_a_chunk_torn_in_the_pool_file_is_dropped_and_the_rest_adopted() {
    let dir = TempDir::new("restart-72-torn");
    let pool = Pool::new(&dir);
    fill_and_kill(&dir, &pool.flags(), 0..6);
    // One byte of chunk 3 changed where it lies in the pool file (as a crash mid-write
    // or a stray write would).
    let mut bytes = std::fs::read(&pool.file).unwrap();
    let wanted = chunk(3, CHUNK);
    let at = bytes
        .windows(64)
        .position(|window| window == &wanted[..64])
        .expect("chunk 3 in the pool file");
    bytes[at + 1000] ^= 0xff;
    std::fs::write(&pool.file, &bytes).unwrap();

    let server = start(&dir, &pool.flags());
    let status = adopted(&server);
    assert_eq!(adoption(&status)["adopted"], 5, "{status}");
    assert_eq!(adoption(&status)["dropped"]["torn"], 1, "{status}");
    assert_eq!(
        server.counter("kvwarden_l1_adoption_total", &[("outcome", "torn")]),
        1
    );
    let (client, buffer) = worker(&server, "m");
    assert_eq!(served(&client, &buffer, 0..6), vec![0, 1, 2, 4, 5]);
}

/// Starts `kvwarden serve` on `pool` expecting it to refuse: its stderr.
fn refused(dir: &TempDir, pool: &Pool) -> String {
    let output = Command::new(kvwarden_bin())
        .arg("serve")
        .arg("--socket")
        .arg(dir.path().join("refused.sock"))
        .args(["--http", "off", "--l1-bytes", "4M", "--slot-bytes", "64K"])
        .args(pool.flags())
        .stdin(Stdio::null())
        .output()
        .expect("kvwarden serve");
    assert!(
        !output.status.success(),
        "the server started on {:?}",
        pool.file
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn chown(path: &Path, uid: u32) {
    rustix::fs::chown(path, Some(rustix::fs::Uid::from_raw(uid)), None).expect("chown");
}

#[test]
fn row_73_a_pool_file_of_another_uid_or_readable_by_others_is_refused_at_start() {
    let dir = TempDir::new("restart-73");
    let pool = Pool::new(&dir);
    fill_and_kill(&dir, &pool.flags(), 0..2);
    let mode = |path: &Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };

    mode(&pool.file, 0o644);
    let stderr = refused(&dir, &pool);
    assert!(
        stderr.contains("with mode 0644") && stderr.contains("chmod 600"),
        "{stderr}"
    );
    mode(&pool.file, 0o600);

    if rustix::process::geteuid().is_root() {
        chown(&pool.file, 1001);
        let stderr = refused(&dir, &pool);
        assert!(stderr.contains("owned by uid 1001"), "{stderr}");
        chown(&pool.file, 0);
    } else {
        eprintln!("not root: the pool file cannot be given to another uid here; the mode case ran");
    }

    // Control: the server's own file, mode 0600, is adopted.
    let server = start(&dir, &pool.flags());
    assert_eq!(adoption(&adopted(&server))["adopted"], 2);
}

/// systemd's notification socket, played by the test: what the server sends it.
struct Systemd {
    socket: std::os::unix::net::UnixDatagram,
    path: PathBuf,
}

impl Systemd {
    fn new(dir: &TempDir) -> Systemd {
        let path = dir.path().join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("the notify socket");
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        Systemd { socket, path }
    }

    fn env(&self) -> (&'static str, String) {
        ("NOTIFY_SOCKET", self.path.display().to_string())
    }

    /// Receives notifications until `READY=1`: the file-descriptor store's contents by
    /// name (the last `FDSTORE=1` of each name; `FDSTOREREMOVE=1` empties a name).
    fn until_ready(&self, store: &mut std::collections::BTreeMap<String, rustix::fd::OwnedFd>) {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        use std::io::IoSliceMut;
        use std::mem::MaybeUninit;
        loop {
            let mut bytes = [0u8; 4096];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut bytes)];
            let received = rustix::net::recvmsg(
                &self.socket,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .expect("a notification before the timeout");
            let mut fds = Vec::new();
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    fds.extend(received);
                }
            }
            let text = String::from_utf8_lossy(&bytes[..received.bytes]).into_owned();
            let lines: Vec<&str> = text.lines().collect();
            let name = lines
                .iter()
                .find_map(|line| line.strip_prefix("FDNAME="))
                .map(str::to_owned);
            if lines.contains(&"FDSTOREREMOVE=1") {
                store.remove(name.as_deref().expect("FDSTOREREMOVE names the fds"));
            }
            if lines.contains(&"FDSTORE=1") {
                let [fd] = <[_; 1]>::try_from(fds).expect("one fd with FDSTORE=1");
                store.insert(name.expect("FDSTORE names its fd"), fd);
            }
            if lines.contains(&"READY=1") {
                return;
            }
        }
    }
}

#[test]
fn row_71_under_systemd_the_pool_is_kept_in_its_file_descriptor_store() {
    use rustix::fd::AsFd;
    let dir = TempDir::new("restart-71-systemd");
    let pool = Pool::new(&dir);
    let systemd = Systemd::new(&dir);
    let (name, value) = systemd.env();
    let flags = [
        "--l1-fdstore",
        "--l1-secret-file",
        pool.secret.to_str().unwrap(),
    ];
    let mut store = std::collections::BTreeMap::new();
    let server = Server::start_with_env(&dir, &flags, &[(name, &value)]);
    systemd.until_ready(&mut store);
    assert_eq!(
        store.keys().collect::<Vec<_>>(),
        ["kvwarden-l1-index", "kvwarden-l1-pool"],
        "the pool and its index handed to the store"
    );
    assert!(
        server.status()["l1"]["cold_reason"]
            .as_str()
            .unwrap()
            .contains("nothing in systemd's file-descriptor store yet")
    );
    {
        let (client, buffer) = worker(&server, "m");
        store_sealed(&server, &client, &buffer, 0..10);
    }
    kill(server);

    // Control: a restart that is not handed the store's fds starts cold.
    let mut empty = std::collections::BTreeMap::new();
    let server = Server::start_with_env(&dir, &flags, &[(name, &value)]);
    systemd.until_ready(&mut empty);
    {
        let (client, buffer) = worker(&server, "m");
        assert_eq!(served(&client, &buffer, 0..10), Vec::<u64>::new());
    }
    kill(server);

    // systemd's restart: the stored fds come back as LISTEN_FDS (the first run's: the
    // test's store was not given the control run's), with the unit's socket (socket
    // activation). A worker that connects before the server is up waits in its backlog.
    let socket_path = dir.path().join("kvwarden.sock");
    let _ = std::fs::remove_file(&socket_path);
    let listener = std::os::unix::net::UnixListener::bind(&socket_path).expect("systemd's socket");
    let mut early =
        kvwarden_tests::RawClient::connect(&socket_path).expect("queued in the backlog");
    let (id, frame) = early.frame("ping", vec![rmpv::Value::Nil]);
    early.send_bytes(&frame).unwrap();
    let mut passed: Vec<(rustix::fd::BorrowedFd<'_>, &str)> =
        vec![(listener.as_fd(), "kvwarden.socket")];
    passed.extend(store.iter().map(|(name, fd)| (fd.as_fd(), name.as_str())));
    let server = Server::start_with_listen_fds(&dir, &flags, &[(name, &value)], &passed);
    let mut again = std::collections::BTreeMap::new();
    systemd.until_ready(&mut again);
    assert!(
        again.is_empty(),
        "adopted fds stay in the store: nothing stored anew"
    );
    let reply = early.read_reply().expect("the early worker is answered");
    assert_eq!(reply.id, id);
    assert!(reply.result.is_ok(), "{reply:?}");
    let status = adopted(&server);
    assert_eq!(status["l1"]["pool"], "adopted", "{status}");
    assert_eq!(adoption(&status)["adopted"], 10, "{status}");
    {
        let (client, buffer) = worker(&server, "m");
        assert_eq!(served(&client, &buffer, 0..10), (0..10).collect::<Vec<_>>());
    }
    let (exit, log) = server.terminate();
    assert!(exit.success(), "{log}");
    assert!(
        log.contains("listening on the Unix socket systemd passed (socket activation)"),
        "{log}"
    );
    assert!(
        socket_path.exists(),
        "systemd's socket file is left where systemd made it"
    );
}

#[test]
fn row_71_a_worker_loading_through_the_restart_is_answered_and_warm_again() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let dir = TempDir::new("restart-71-loads");
    let pool = Pool::new(&dir);
    let server = start(&dir, &pool.flags());
    let (client, buffer) = worker(&server, "m");
    store_sealed(&server, &client, &buffer, 0..8);
    // The worker keeps loading chunk after chunk, through the server's SIGKILL and
    // restart: every call returns (a hit, a miss or an error), none hangs, and a hit is
    // always the stored bytes.
    let stop = Arc::new(AtomicBool::new(false));
    let boot = Arc::new(AtomicU64::new(0));
    let hits_after = Arc::new(AtomicU64::new(0));
    let loading = {
        let (stop, boot, hits_after) = (stop.clone(), boot.clone(), hits_after.clone());
        std::thread::spawn(move || {
            let (mut calls, mut errors) = (0u64, 0u64);
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let restarted = boot.load(Ordering::SeqCst) == 1;
                match client.retrieve(&key(n % 8), 0, 0, CHUNK) {
                    Ok(Some(len)) => {
                        assert_eq!(len, CHUNK);
                        let mut got = vec![0u8; CHUNK as usize];
                        assert!(buffer.read(0, &mut got));
                        assert!(
                            got == chunk(n % 8, CHUNK),
                            "chunk {} with other bytes",
                            n % 8
                        );
                        if restarted {
                            hits_after.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Ok(None) => {}
                    Err(_) => errors += 1,
                }
                calls += 1;
                n += 1;
            }
            (calls, errors)
        })
    };
    kill(server);
    let server = start(&dir, &pool.flags());
    boot.store(1, Ordering::SeqCst);
    adopted(&server);
    kvwarden_tests::wait_for(
        "the same worker's loads hitting again after the restart",
        std::time::Duration::from_secs(60),
        || (hits_after.load(Ordering::SeqCst) > 0).then_some(()),
    );
    stop.store(true, Ordering::SeqCst);
    let (calls, errors) = loading.join().expect("the loading thread");
    eprintln!("{calls} loads through the restart, {errors} failed");
    assert!(server.status()["l1"]["adoption"]["adopted"] == 8);
}

#[test]
fn row_71_a_chunk_whose_key_is_too_long_to_seal_is_counted_served_and_not_adopted() {
    // A node key (the tenant's name, then the worker's key) longer than a seal holds
    // cannot be sealed: the chunk is served, counted, and after a restart a miss.
    let dir = TempDir::new("restart-71-long-key");
    let pool = Pool::new(&dir);
    let long = vec![b'k'; kvwarden_core::seal::MAX_SEALED_KEY_BYTES];
    let server = start(&dir, &pool.flags());
    {
        let (client, buffer) = worker(&server, "m");
        store(&client, &buffer, &key(0), &chunk(0, CHUNK));
        store(&client, &buffer, &long, &chunk(1, CHUNK));
        let status = server.wait_status("both seals ended", |status| {
            status["l1"]["sealing"].as_u64() == Some(0)
        });
        assert_eq!(status["l1"]["unsealed_total"], 1, "{status}");
        assert_eq!(client.retrieve(&long, 0, 0, CHUNK).unwrap(), Some(CHUNK));
        let (_, metrics) = server.http_get("/metrics");
        assert!(
            metrics.lines().any(|l| l == "kvwarden_l1_unsealed_total 1"),
            "{metrics}"
        );
    }
    kill(server);

    let server = start(&dir, &pool.flags());
    let status = adopted(&server);
    assert_eq!(adoption(&status)["adopted"], 1, "{status}");
    let (client, buffer) = worker(&server, "m");
    // Control: the chunk with a short key is back.
    assert_eq!(served(&client, &buffer, 0..1), vec![0]);
    assert_eq!(client.retrieve(&long, 0, 0, CHUNK).unwrap(), None);
}
