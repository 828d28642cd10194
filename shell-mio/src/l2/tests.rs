//! The client without a Redis: a store that refuses connections, and one that accepts
//! and never answers (what a SIGSTOPped Redis looks like from here). The tests against a
//! real cluster live in the `tests` crate.

use super::*;
use std::net::TcpListener;
use std::time::Duration;

const WAKER: mio::Token = mio::Token(7);

fn config(seed: String, timeout_ms: u64, write_queue_bytes: u64) -> L2Config {
    L2Config {
        seeds: vec![seed],
        auth: L2Auth::default(),
        tls: None,
        format: kvwarden_core::l2::ValueFormat::new(None, 1 << 20),
        namespace: kvwarden_core::l2::Namespace::default(),
        timeout: Duration::from_millis(timeout_ms),
        ttl: None,
        write_queue_bytes,
        threads: 2,
    }
}

/// Waits on the waker, as the event loop does, until `count` completions arrived.
fn wait_for_completions(
    poll: &mut mio::Poll,
    client: &L2Client,
    count: usize,
) -> Vec<L2Completion> {
    let mut events = mio::Events::with_capacity(8);
    let mut got = Vec::new();
    for _ in 0..600 {
        got.extend(client.drain());
        if got.len() >= count {
            return got;
        }
        poll.poll(&mut events, Some(Duration::from_millis(100)))
            .expect("polling");
    }
    panic!(
        "only {} of {count} L2 completions arrived in 60 s: {got:?}",
        got.len()
    );
}

fn spawn(config: L2Config) -> (mio::Poll, L2Client) {
    let poll = mio::Poll::new().expect("a poll");
    let waker = mio::Waker::new(poll.registry(), WAKER).expect("a waker");
    let client = L2Client::spawn(config, waker).expect("the L2 client starts");
    (poll, client)
}

/// A loopback port with nothing listening.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
    listener.local_addr().expect("its address").port()
}

#[test]
fn unreachable_store_answers_every_read_as_a_miss_and_counts_it() {
    let (mut poll, client) = spawn(config(
        format!("redis://127.0.0.1:{}", closed_port()),
        200,
        0,
    ));
    client.get(1, b"chunk".to_vec());
    client.exists_prefix(2, vec![b"a".to_vec(), b"b".to_vec()]);
    let completions = wait_for_completions(&mut poll, &client, 2);
    for completion in &completions {
        match completion {
            L2Completion::Read {
                token: 1,
                key,
                outcome,
                payload: None,
                ..
            } => {
                assert_eq!(key, b"chunk");
                assert_ne!(*outcome, ReadOutcome::Hit);
            }
            L2Completion::Prefix { token: 2, outcome } => {
                assert!(!matches!(outcome, PrefixOutcome::Present(_)), "{outcome:?}")
            }
            other => panic!("unexpected completion {other:?}"),
        }
        assert_ne!(completion.op_result(), OpResult::Succeeded);
    }
    let counters = client.counters();
    assert_eq!((counters.hits, counters.misses), (0, 1));
    assert_eq!(counters.timeouts + counters.errors, 2);
}

#[test]
fn store_that_never_answers_is_a_timed_out_miss_and_the_caller_never_waits() {
    // Accepts connections (the kernel does it for a stopped process too) and never
    // answers a byte.
    let silent = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", silent.local_addr().expect("its address"));
    let (mut poll, client) = spawn(config(seed, 100, 1 << 20));
    for token in 0..10 {
        client.get(token, vec![token as u8]);
    }
    assert_eq!(
        client.submit_write(0, b"w".to_vec(), vec![1u8; 10]),
        Push::Queued
    );
    let completions = wait_for_completions(&mut poll, &client, 10);
    let mut tokens: Vec<u64> = completions
        .iter()
        .filter_map(|completion| match completion {
            L2Completion::Read {
                token,
                outcome: ReadOutcome::TimedOut,
                ..
            } => Some(*token),
            _ => None,
        })
        .collect();
    tokens.sort_unstable();
    assert_eq!(tokens, (0..10).collect::<Vec<_>>());
    assert_eq!(client.counters().timeouts, 10);
    drop(silent);
}

#[test]
fn full_write_queue_drops_and_counts_without_blocking() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", silent.local_addr().expect("its address"));
    let per_write = 100 + kvwarden_core::l2::HEADER_BYTES as u64;
    let (_poll, client) = spawn(config(seed, 60_000, 3 * per_write));
    let outcomes: Vec<Push> = (0..10u8)
        .map(|i| client.submit_write(0, vec![i], vec![i; 100]))
        .collect();
    assert_eq!(outcomes.iter().filter(|p| **p == Push::Queued).count(), 3);
    let counters = client.counters();
    assert_eq!(counters.write_drops, 7);
    assert_eq!(counters.queue_bytes, 3 * per_write);
    drop(silent);
}

#[test]
fn bad_configuration_is_refused_before_any_thread_starts() {
    let poll = mio::Poll::new().expect("a poll");
    let waker = mio::Waker::new(poll.registry(), WAKER).expect("a waker");
    let mut bad = config("redis://127.0.0.1:1".into(), 100, 0);
    bad.threads = 0;
    let error = L2Client::spawn(bad, waker).err().expect("refused");
    assert!(error.to_string().contains("--l2-threads"), "{error}");
}

#[test]
fn empty_prefix_check_is_zero_without_asking_redis() {
    let (mut poll, client) = spawn(config(
        format!("redis://127.0.0.1:{}", closed_port()),
        200,
        0,
    ));
    client.exists_prefix(3, Vec::new());
    let completions = wait_for_completions(&mut poll, &client, 1);
    assert!(matches!(
        completions[..],
        [L2Completion::Prefix {
            token: 3,
            outcome: PrefixOutcome::Present(0)
        }]
    ));
}

#[test]
fn reads_past_the_waiting_limit_are_answered_at_once_as_timed_out() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", silent.local_addr().expect("its address"));
    // A timeout no test outlasts: only the limit can answer these.
    let (mut poll, client) = spawn(config(seed, 600_000, 0));
    let over = 10;
    for token in 0..(READS_WAITING_MAX + 2 + over) as u64 {
        client.get(token, vec![1]);
    }
    let completions = wait_for_completions(&mut poll, &client, over);
    assert!(completions.iter().all(|completion| matches!(
        completion,
        L2Completion::Read {
            outcome: ReadOutcome::TimedOut,
            ..
        }
    )));
    drop(silent);
}

#[test]
fn a_read_given_up_is_answered_timed_out_at_once_once_and_never_placed() {
    // A store that never answers, and a timeout far longer than the test: only the
    // cancel can answer the read.
    let silent = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", silent.local_addr().expect("its address"));
    let (mut poll, client) = spawn(config(seed, 600_000, 1 << 20));
    let placed = Arc::new(AtomicBool::new(false));
    let placed_by_read = Arc::clone(&placed);
    let read = client.get_into(5, b"chunk".to_vec(), move |_| {
        placed_by_read.store(true, Ordering::SeqCst);
        true
    });
    assert!(read.cancel(), "the first cancel answers it");
    assert!(
        !read.cancel(),
        "answered once: a second cancel does nothing"
    );
    let completions = wait_for_completions(&mut poll, &client, 1);
    let [
        L2Completion::Read {
            token: 5,
            outcome: ReadOutcome::TimedOut,
            payload: None,
            placed: None,
            ..
        },
    ] = &completions[..]
    else {
        panic!("one TimedOut answer: {completions:?}")
    };
    assert!(!placed.load(Ordering::SeqCst), "never placed");
    assert_eq!(client.counters().timeouts, 1);
}
