//! Nothing is written into a worker's memory after it stopped waiting (issue 52, row
//! 60), with a starved pool: a real `kvwarden serve` with one pool thread, which a
//! slow build (`--fault-build-delay-ms`) holds while a worker's `retrieve` waits for it.
//! The worker gives up at its request timeout (its `hello` said `wait_ms`), reuses the
//! destination for bytes of its own, and the test checks they are still there after
//! the pool came free. The control: the same retrieve with a timeout longer than the
//! build, served, the chunk in place.

use kvwarden::client::{Client, ClientConfig, Endpoint, MemfdBuffer};
use kvwarden_tests::{RawClient, Server, TempDir, memfd_spec};
use rmpv::Value;
use rustix::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

const CHUNK: u64 = 64 << 10;
/// How long every build holds the one pool thread.
const BUILD_DELAY_MS: &str = "2000";

fn client(server: &Server, request_timeout: Duration) -> (Client, Arc<MemfdBuffer>) {
    let mut config = ClientConfig::new(Endpoint::Unix(server.socket.clone()));
    config.request_timeout = request_timeout;
    let client = Client::connect(config).expect("connecting");
    let buffer = Arc::new(MemfdBuffer::new(1 << 20).expect("a memfd"));
    client
        .register(vec![Arc::clone(&buffer)], "deadlines", 1)
        .expect("registering");
    (client, buffer)
}

/// A server with one pool thread, which every build holds for [`BUILD_DELAY_MS`].
fn starved_pool_server(dir: &TempDir) -> Server {
    Server::start(
        dir,
        &[
            "--worker-reap-timeout-seconds",
            "60",
            "--worker-registration-grace-seconds",
            "120",
            "--pool-threads",
            "1",
            "--fault-build-delay-ms",
            BUILD_DELAY_MS,
        ],
    )
}

/// Registers a fresh worker on another thread: its build holds the pool thread for
/// [`BUILD_DELAY_MS`].
fn occupy_the_pool(server: &Server) -> std::thread::JoinHandle<Client> {
    let socket = server.socket.clone();
    let handle = std::thread::spawn(move || {
        let mut config = ClientConfig::new(Endpoint::Unix(socket));
        config.request_timeout = Duration::from_secs(30);
        let client = Client::connect(config).expect("connecting");
        let buffer = Arc::new(MemfdBuffer::new(4096).expect("a memfd"));
        client
            .register(vec![buffer], "occupier", 1)
            .expect("registering the occupier");
        client
    });
    // Its build is on the pool once the server counts it as building.
    std::thread::sleep(Duration::from_millis(300));
    handle
}

/// Row 60: a `retrieve` whose copy waits behind a slow job on the pool past the
/// worker's deadline is never started: the worker's own bytes, written into the
/// destination after it gave up, are still there once the pool came free, and the
/// server counts the copy it did not start. The control, with a timeout longer than
/// the build, gets the chunk.
#[test]
fn row_60_a_copy_that_would_start_after_the_worker_gave_up_never_does() {
    let dir = TempDir::new("row60-pool");
    let server = starved_pool_server(&dir);
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i % 251) as u8).collect();
    let own: Vec<u8> = vec![0x5A; CHUNK as usize];

    // The control: a worker that waits long enough gets the chunk after the build.
    let (patient, patient_buffer) = client(&server, Duration::from_secs(30));
    assert!(patient_buffer.write(0, &chunk));
    assert!(patient.store(b"k", 0, 0, CHUNK).expect("store"));
    let occupier = occupy_the_pool(&server);
    assert!(patient_buffer.write(CHUNK, &own));
    assert_eq!(
        patient.retrieve(b"k", 0, CHUNK, CHUNK).expect("retrieve"),
        Some(CHUNK),
        "control: served once the pool came free"
    );
    let mut out = vec![0; CHUNK as usize];
    assert!(patient_buffer.read(CHUNK, &mut out));
    assert!(out == chunk, "control: the chunk in place");
    drop(occupier.join().expect("the occupier"));

    // A worker that waits 500 ms (its hello's wait_ms), speaking the protocol itself so
    // that its registration may take the build's 2 s.
    let mut hasty = RawClient::connect(&server.socket).expect("connecting");
    let options = Value::Map(vec![("wait_ms".into(), 500u64.into())]);
    hasty
        .request("hello", vec![2u64.into(), "hasty".into(), options])
        .expect("hello")
        .result
        .expect("hello answered");
    let instance = 60_000;
    hasty.attach(instance);
    let memfd = kvwarden::memfd::create("hasty", 1 << 20).expect("a memfd");
    let hasty_buffer = kvwarden::memfd::SharedMapping::map(&memfd, 1 << 20).unwrap();
    let args = vec![
        instance.into(),
        Value::Array(vec![memfd_spec(0, 1 << 20)]),
        "deadlines".into(),
        1u64.into(),
    ];
    hasty
        .request_with_fds("register_kv_cache", args, &[memfd.as_fd()])
        .expect("register")
        .result
        .expect("registered");
    let occupier = occupy_the_pool(&server);
    let (_, frame) = hasty.frame(
        "retrieve",
        vec![
            instance.into(),
            Value::Binary(b"k".to_vec()),
            0u64.into(),
            CHUNK.into(),
            CHUNK.into(),
        ],
    );
    hasty.send_bytes(&frame).expect("the retrieve");
    hasty
        .stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(
        hasty.read_reply().is_err(),
        "the worker gave up after 500 ms"
    );
    // It reuses the destination at once, for bytes of its own.
    assert!(hasty_buffer.write(CHUNK, &own));
    drop(occupier.join().expect("the occupier"));
    // The queued copy's turn on the pool comes right after the build.
    std::thread::sleep(Duration::from_secs(1));
    assert!(hasty_buffer.read(CHUNK, &mut out));
    assert!(
        out == own,
        "the chunk was written into the destination after the worker gave up"
    );
    server.wait_status("the copy past the deadline counted", |status| {
        status["transfers"]["copies_past_deadline_total"].as_u64() >= Some(1)
    });
}

/// Row 61: a worker whose own `retrieve` is held by the server (its copy waits 2 s
/// behind a slow build on the one pool thread) goes on pinging: its heartbeat pings on
/// a connection of its own, answered at once, instead of waiting behind the retrieve
/// on the worker's connection. Every 200 ms over 2 s is about ten pings; the server
/// must count at least five during the hold (one, after it, before the fix), and the
/// worker stays healthy throughout. The control: the held retrieve is served.
#[test]
fn row_61_a_worker_whose_retrieve_is_held_goes_on_pinging_and_stays_healthy() {
    let dir = TempDir::new("row61-ping");
    let server = starved_pool_server(&dir);
    let mut config = ClientConfig::new(Endpoint::Unix(server.socket.clone()));
    config.request_timeout = Duration::from_secs(30);
    config.heartbeat_interval = Duration::from_millis(200);
    let worker = Arc::new(Client::connect(config).expect("connecting"));
    let buffer = Arc::new(MemfdBuffer::new(1 << 20).expect("a memfd"));
    worker
        .register(vec![Arc::clone(&buffer)], "pings", 1)
        .expect("registering");
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i % 241) as u8).collect();
    assert!(buffer.write(0, &chunk));
    assert!(worker.store(b"k", 0, 0, CHUNK).expect("store"));
    // Healthy once a ping has been answered since the registration.
    kvwarden_tests::wait_for("healthy", Duration::from_secs(10), || {
        worker.is_healthy().then_some(())
    });

    let pings = || {
        server.status()["worker_liveness"]["pings_total"]
            .as_u64()
            .expect("pings_total")
    };
    let occupier = occupy_the_pool(&server);
    let pings_before = pings();
    let retrieving = {
        let worker = Arc::clone(&worker);
        std::thread::spawn(move || worker.retrieve(b"k", 0, CHUNK, CHUNK))
    };
    let mut samples = Vec::new();
    while !retrieving.is_finished() {
        samples.push(worker.is_healthy());
        std::thread::sleep(Duration::from_millis(50));
    }
    let pinged = pings() - pings_before;
    let served = retrieving.join().expect("the retrieve");
    assert_eq!(
        served.expect("retrieve"),
        Some(CHUNK),
        "the held retrieve is served"
    );
    assert!(
        pinged >= 5,
        "{pinged} pings answered while the worker's retrieve was held"
    );
    assert!(
        samples.iter().all(|healthy| *healthy),
        "unhealthy in {} of {} samples while its own retrieve was held",
        samples.iter().filter(|healthy| !**healthy).count(),
        samples.len()
    );
    drop(occupier.join().expect("the occupier"));
}
