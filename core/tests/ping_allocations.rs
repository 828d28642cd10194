//! The core's half of a ping allocates nothing: decoding the frame body, the node's
//! decision, draining its output and encoding the reply into a reused buffer. A count,
//! not a timing: stable on any machine.

use kvwarden_core::node::Job;
use kvwarden_core::node::{Built, ConnId, Input, Node, NodeConfig, Output, Transport};
use kvwarden_core::protocol::{Answer, BufferSpec, Op, decode_request, encode_reply_into};
use kvwarden_core::{Config, InstanceId, Instant};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

/// Counts the allocations of the thread that switched counting on.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn counted<T>(work: impl FnOnce() -> T) -> (T, u64) {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    let result = work();
    COUNTING.with(|c| c.set(false));
    (result, ALLOCATIONS.with(Cell::get))
}

fn config() -> NodeConfig {
    NodeConfig {
        liveness: Config {
            reap_timeout: Duration::from_secs(120),
            ..Config::default()
        },
        reap_timeout_floor: Duration::ZERO,
        num_slots: 4,
        slot_bytes: 4096,
        server_uid: 0,
        trust: Default::default(),
        boot_id: 1,
        server_name: "test".into(),
        free_watchdog: Duration::from_secs(10),
        shutdown_drain: Duration::from_secs(10),
        cuda_devices: Err("none".into()),
        connections: kvwarden_core::node::admission::ConnectionLimits::unbounded(),
        mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
        pool_window: kvwarden_core::node::jobs::UNBOUNDED,
        kv_publish: Vec::new(),
        l2: None,
    }
}

/// One ping through the core: bytes in, reply bytes appended to `out`. Returns whether
/// the ping was answered `true`.
fn ping(node: &mut Node, now: Instant, body: &[u8], out: &mut Vec<u8>) -> bool {
    let request = decode_request(body).expect("a valid ping");
    node.handle_input(
        now,
        Input::Request {
            conn: ConnId(1),
            request_id: request.id,
            op: request.op,
            fds: 0,
        },
    );
    let mut tracked = false;
    while let Some(output) = node.poll_output() {
        if let Output::Reply {
            request_id, result, ..
        } = output
        {
            tracked = result.as_ref() == Ok(&Answer::Flag(true));
            // What the shell does: the answer's value, encoded.
            encode_reply_into(out, request_id, &result.map(|answer| answer.to_value()));
        }
    }
    tracked
}

#[test]
fn a_ping_through_the_core_allocates_nothing_on_a_warm_connection() {
    let mut node = Node::new(config(), Instant::ZERO).unwrap();
    let instance = InstanceId::new(42).unwrap();
    node.handle_input(
        Instant::ZERO,
        Input::Connected {
            conn: ConnId(1),
            uid: Some(1000),
            transport: Transport::Unix,
            process: None,
        },
    );
    node.handle_input(
        Instant::ZERO,
        Input::Request {
            conn: ConnId(1),
            request_id: 0,
            op: Op::Attach {
                instance,
                secret: vec![3; 32],
            },
            fds: 0,
        },
    );
    node.handle_input(
        Instant::ZERO,
        Input::Request {
            conn: ConnId(1),
            request_id: 1,
            op: Op::RegisterKvCache {
                instance,
                buffers: vec![BufferSpec::Memfd {
                    fd_index: 0,
                    nbytes: 4096,
                }],
                model_name: "m".into(),
                world_size: 1,
            },
            fds: 1,
        },
    );
    let mut context = None;
    while let Some(output) = node.poll_output() {
        if let Output::Job(Job::Build { context: c, .. }) = output {
            context = Some(c);
        }
    }
    node.handle_input(
        Instant::ZERO,
        Input::BuildDone {
            context: context.expect("a build"),
            result: Ok(Built::ServerDriven {
                buffer_lens: vec![4096],
            }),
        },
    );
    while node.poll_output().is_some() {}

    let frame = kvwarden_core::protocol::Request {
        id: 7,
        op: Op::Ping {
            instance: Some(instance),
        },
    }
    .encode();
    let body = &frame[4..];
    let mut out = Vec::with_capacity(1 << 16);
    // Warm-up: the output queue and the registry reach their working size.
    for n in 0..1_000u64 {
        out.clear();
        assert!(ping(
            &mut node,
            Instant::from_nanos(n * 1_000),
            body,
            &mut out
        ));
    }
    let (answered, allocations) = counted(|| {
        let mut answered = 0u64;
        for n in 0..100_000u64 {
            out.clear();
            let now = Instant::from_nanos(1_000_000 + n * 1_000);
            answered += u64::from(ping(&mut node, now, body, &mut out));
        }
        answered
    });
    assert_eq!(answered, 100_000, "every ping answered true");
    assert_eq!(allocations, 0, "allocations over 100,000 pings");

    // The counter is live: a ping of an unknown instance with a fresh buffer allocates.
    let (_, fresh) = counted(|| {
        let mut fresh = Vec::new();
        ping(&mut node, Instant::from_nanos(1 << 40), body, &mut fresh)
    });
    assert!(fresh > 0, "the counter sees allocations");
}
