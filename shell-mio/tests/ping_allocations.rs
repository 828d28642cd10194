//! The server's whole ping path allocates nothing: the real server (`Server::bind`,
//! `run` on a thread of this process) answers 100,000 pings of an attached instance
//! (protocol 2: the attach check is part of the path) on a warmed-up Unix
//! connection, from `recvmsg` (and 100,000 more after the connection's `hello` says
//! `sends_fds: false`, from plain `read`) through decoding, the node, the metrics and encoding the
//! reply into the connection's buffer to the `send`, and the allocation count over them
//! is 0. A count, not a timing: stable on any machine, however loaded.
//!
//! Counted: every allocation of the event loop's thread and of the client thread (which
//! allocates nothing while counting). Not counted: the context pool's threads, which a
//! ping never reaches, and on a host with a GPU the device-memory sampler, which wakes on
//! its own clock and would make the count depend on timing.

use kvwarden::protocol::{Op, ProtocolError, Request, encode_reply};
use kvwarden::server::{Server, ServerConfig};
use kvwarden_core::InstanceId;
use rmpv::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

struct Counting;

/// Allocations are counted while this is set, on threads that marked themselves.
static WINDOW: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COUNTED_THREAD: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if WINDOW.load(Ordering::Relaxed) && COUNTED_THREAD.with(Cell::get) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations of the counted threads while `work` runs.
fn counted<T>(work: impl FnOnce() -> T) -> (T, u64) {
    ALLOCATIONS.store(0, Ordering::SeqCst);
    WINDOW.store(true, Ordering::SeqCst);
    let result = work();
    WINDOW.store(false, Ordering::SeqCst);
    (result, ALLOCATIONS.load(Ordering::SeqCst))
}

fn config(socket_path: std::path::PathBuf) -> ServerConfig {
    ServerConfig {
        liveness: kvwarden_core::Config {
            reap_timeout: Duration::from_secs(120),
            ..kvwarden_core::Config::default()
        },
        allow_short_timeouts: false,
        socket_path,
        socket_mode: 0o600,
        tcp: None,
        http: None,
        l1_bytes: 1 << 20,
        l1_prefault: false,
        l1_file: None,
        l1_fdstore: false,
        l1_secret: None,
        slot_bytes: 64 << 10,
        max_frame_bytes: 1 << 20,
        max_connections: 16,
        max_connections_from_flag: true,
        max_connections_per_uid: None,
        frame_timeout: Duration::from_secs(10),
        allow_hugetlb_buffers: false,
        mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
        free_watchdog: Duration::from_secs(10),
        pool_threads: 1,
        l2: None,
        trust: Default::default(),
        kv_events: Vec::new(),
    }
}

/// Sends one frame and reads one whole reply frame into `reply`; its length.
fn round_trip(stream: &mut UnixStream, frame: &[u8], reply: &mut [u8]) -> usize {
    stream.write_all(frame).expect("sending a frame");
    stream.read_exact(&mut reply[..4]).expect("a reply header");
    let length = u32::from_be_bytes([reply[0], reply[1], reply[2], reply[3]]) as usize;
    assert!(4 + length <= reply.len(), "a reply of {length} bytes");
    stream
        .read_exact(&mut reply[4..4 + length])
        .expect("a reply body");
    4 + length
}

fn reply_of(id: u64, result: Result<Value, ProtocolError>) -> Vec<u8> {
    encode_reply(id, &result)
}

#[test]
fn a_ping_through_the_running_server_allocates_nothing_on_a_warm_connection() {
    let dir = std::env::temp_dir().join(format!("kvwarden-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let socket_path = dir.join("kvwarden.sock");
    let server = Server::bind(config(socket_path.clone())).expect("the server binds");
    std::thread::Builder::new()
        .name("event-loop".into())
        .spawn(move || {
            COUNTED_THREAD.with(|c| c.set(true));
            // Serves until the test process exits.
            let _ = server.run();
        })
        .expect("the event loop's thread");
    COUNTED_THREAD.with(|c| c.set(true));

    let mut stream = UnixStream::connect(&socket_path).expect("connecting");
    let mut reply = vec![0u8; 1 << 16];
    let hello = Request {
        id: 1,
        op: Op::Hello {
            protocol: kvwarden::protocol::PROTOCOL_VERSION,
            client: "ping_allocations".into(),
            pidfd_index: None,
            sends_fds: true,
            token: None,
            proof: None,
            wait_ms: None,
        },
    }
    .encode();
    round_trip(&mut stream, &hello, &mut reply);
    let instance = InstanceId::new(42).expect("an instance id");
    // Protocol 2: the connection proves the instance before naming it.
    let attach = Request {
        id: 3,
        op: Op::Attach {
            instance,
            secret: vec![0x42; 32],
        },
    }
    .encode();
    let n = round_trip(&mut stream, &attach, &mut reply);
    let answer = kvwarden::protocol::decode_reply(&reply[4..n]).expect("a reply");
    assert!(answer.result.is_ok(), "attached: {answer:?}");
    let register = Request {
        id: 2,
        op: Op::RegisterEngineDriven {
            instance,
            model_name: "m".into(),
            world_size: 1,
        },
    }
    .encode();
    // Answered once the context is built on the pool, with the L1 pool's fd (which a
    // plain read discards).
    let n = round_trip(&mut stream, &register, &mut reply);
    let answer = kvwarden::protocol::decode_reply(&reply[4..n]).expect("a reply");
    assert!(answer.result.is_ok(), "registered: {answer:?}");

    let ping = Request {
        id: 7,
        op: Op::Ping {
            instance: Some(instance),
        },
    }
    .encode();
    let pong = reply_of(7, Ok(Value::Boolean(true)));
    let mut count_pings = |stream: &mut UnixStream, how: &str| {
        // Warm-up: buffers, queues and tables reach their working size.
        for _ in 0..1_000 {
            let n = round_trip(stream, &ping, &mut reply);
            assert_eq!(&reply[..n], &pong[..]);
        }
        let (answered, allocations) = counted(|| {
            let mut answered = 0u64;
            for _ in 0..100_000 {
                let n = round_trip(stream, &ping, &mut reply);
                answered += u64::from(reply[..n] == pong[..]);
            }
            answered
        });
        assert_eq!(answered, 100_000, "every ping answered true ({how})");
        assert_eq!(
            allocations, 0,
            "allocations over 100,000 pings through the server ({how})"
        );
    };
    count_pings(&mut stream, "read with recvmsg");

    // The same connection promises no more fds: read with plain `read` from here on.
    let no_fds = Request {
        id: 9,
        op: Op::Hello {
            protocol: kvwarden::protocol::PROTOCOL_VERSION,
            client: "ping_allocations".into(),
            pidfd_index: None,
            sends_fds: false,
            token: None,
            proof: None,
            wait_ms: None,
        },
    }
    .encode();
    let mut hello_reply = vec![0u8; 1 << 16];
    let n = round_trip(&mut stream, &no_fds, &mut hello_reply);
    let answer = kvwarden::protocol::decode_reply(&hello_reply[4..n]).expect("a reply");
    let says = answer.result.expect("hello answered");
    assert!(
        says.as_map().is_some_and(|map| map
            .iter()
            .any(|(k, v)| k.as_str() == Some("sends_fds") && v == &Value::Boolean(false))),
        "{says}"
    );
    count_pings(&mut stream, "read with plain read");

    // The counter is live, on both sides: the client's own allocation is seen, and so
    // is the event loop's when a request needs one (`status` builds a value tree).
    let (_, client) = counted(|| std::hint::black_box(Vec::<u8>::with_capacity(64)));
    assert!(client > 0, "the counter sees the client thread");
    let status = Request {
        id: 8,
        op: Op::Status,
    }
    .encode();
    let (_, server) = counted(|| round_trip(&mut stream, &status, &mut reply));
    assert!(server > 0, "the counter sees the event loop's thread");

    let _ = std::fs::remove_dir_all(&dir);
}
