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
        known_nodes: Default::default(),
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

/// A landing that records whether it was touched at all.
struct Recorder {
    touched: Arc<AtomicBool>,
    room: Vec<u8>,
}

impl Recorder {
    fn new(touched: Arc<AtomicBool>) -> Recorder {
        Recorder {
            touched,
            room: Vec::new(),
        }
    }
}

impl Landing for Recorder {
    fn room(&mut self, nbytes: usize) -> Option<&mut [u8]> {
        self.touched.store(true, Ordering::SeqCst);
        self.room = vec![0; nbytes];
        Some(&mut self.room)
    }

    fn landed(&mut self, _nbytes: usize) {
        self.touched.store(true, Ordering::SeqCst);
    }
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

/// The write-behind bound is the node's (`row_27_a_full_write_queue_drops_and_counts_
/// and_never_blocks` in core/tests/node_l2.rs): the client queues every write the node
/// admitted, never dropping one the node counts as queued, and never blocks.
#[test]
fn the_client_queues_every_write_it_is_given_the_bound_is_the_nodes() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", silent.local_addr().expect("its address"));
    let per_write = 100 + kvwarden_core::l2::HEADER_BYTES as u64;
    let (_poll, client) = spawn(config(seed, 60_000, 3 * per_write));
    let outcomes: Vec<Push> = (0..10u8)
        .map(|i| client.submit_write(0, vec![i], vec![i; 100]))
        .collect();
    assert_eq!(outcomes, vec![Push::Queued; 10]);
    let counters = client.counters();
    assert_eq!(counters.write_drops, 0);
    assert_eq!(counters.queue_bytes, 10 * per_write);
    // Once the client shuts down it takes nothing more, and says so.
    let finished = client.finish_writes(std::time::Duration::ZERO);
    assert_eq!(finished.dropped, 10);
    assert_eq!(
        client.submit_write(0, vec![11], vec![0; 100]),
        Push::Dropped
    );
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
    // Each of the 2 threads holds at most one batch (stuck connecting); the rest wait.
    let held = 2 * worker::READ_BATCH_MAX;
    for token in 0..(READS_WAITING_MAX + held + over) as u64 {
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
    let read = client.get_into(5, b"chunk".to_vec(), Recorder::new(placed_by_read));
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

/// How the fake store answers a `GETRANGE` of a key.
#[derive(Clone)]
enum Answer {
    /// The whole value.
    Value(Vec<u8>),
    /// The reply line and the first `n` bytes of the value, then nothing (a store
    /// stopped mid-reply).
    Stall(Vec<u8>, usize),
    /// A reply line claiming this many bytes, then the value's header, then nothing
    /// (no Redis answers a bounded `GETRANGE` so).
    Claim(u64, Vec<u8>),
}

/// A plain Redis stand-in on loopback: answers `CLUSTER` as a Redis without cluster
/// support does, `GETRANGE` from `answers` (an empty string for other keys), and `+OK`
/// to everything else. Each connection on a thread of its own.
fn fake_store(answers: std::collections::HashMap<Vec<u8>, Answer>) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
    let seed = format!("redis://{}", listener.local_addr().expect("its address"));
    let answers = Arc::new(answers);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let answers = Arc::clone(&answers);
            std::thread::spawn(move || {
                let mut writer = stream.try_clone().expect("a second handle");
                let mut reader = BufReader::new(stream);
                let mut line = String::new();
                loop {
                    line.clear();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let count: usize = line.trim_start_matches('*').trim().parse().unwrap_or(0);
                    let mut args = Vec::new();
                    for _ in 0..count {
                        line.clear();
                        reader.read_line(&mut line).expect("a length");
                        let len: usize = line
                            .trim_start_matches('$')
                            .trim()
                            .parse()
                            .expect("a number");
                        let mut arg = vec![0; len + 2];
                        reader.read_exact(&mut arg).expect("an argument");
                        arg.truncate(len);
                        args.push(arg);
                    }
                    let reply = match args.first().map(Vec::as_slice) {
                        Some(b"CLUSTER") => {
                            b"-ERR This instance has cluster support disabled\r\n".to_vec()
                        }
                        Some(b"GETRANGE") => match answers.get(&args[1]) {
                            Some(Answer::Value(value)) => {
                                let mut reply = format!("${}\r\n", value.len()).into_bytes();
                                reply.extend_from_slice(value);
                                reply.extend_from_slice(b"\r\n");
                                reply
                            }
                            Some(Answer::Stall(value, n)) => {
                                let mut reply = format!("${}\r\n", value.len()).into_bytes();
                                reply.extend_from_slice(&value[..*n]);
                                let _ = writer.write_all(&reply);
                                std::thread::sleep(Duration::from_secs(3600));
                                return;
                            }
                            Some(Answer::Claim(len, head)) => {
                                let mut reply = format!("${len}\r\n").into_bytes();
                                reply.extend_from_slice(head);
                                let _ = writer.write_all(&reply);
                                std::thread::sleep(Duration::from_secs(3600));
                                return;
                            }
                            None => b"$0\r\n\r\n".to_vec(),
                        },
                        _ => b"+OK\r\n".to_vec(),
                    };
                    if writer.write_all(&reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    seed
}

/// A landing that keeps what landed.
struct Keeper {
    room: Vec<u8>,
    landed: Landed,
    touched: Arc<AtomicBool>,
}

impl Landing for Keeper {
    fn room(&mut self, nbytes: usize) -> Option<&mut [u8]> {
        self.touched.store(true, Ordering::SeqCst);
        self.room = vec![0; nbytes];
        Some(&mut self.room)
    }

    fn landed(&mut self, nbytes: usize) {
        *self.landed.lock().expect("the lock") = Some(self.room[..nbytes].to_vec());
    }
}

/// What a [`Keeper`] landed.
type Landed = Arc<Mutex<Option<Vec<u8>>>>;

fn keeper() -> (Keeper, Landed, Arc<AtomicBool>) {
    let landed = Arc::new(Mutex::new(None));
    let touched = Arc::new(AtomicBool::new(false));
    let keeper = Keeper {
        room: Vec::new(),
        landed: Arc::clone(&landed),
        touched: Arc::clone(&touched),
    };
    (keeper, landed, touched)
}

#[test]
fn row_54_only_a_whole_checked_value_lands_a_torn_or_stalled_one_never_does() {
    let namespace = kvwarden_core::l2::Namespace::default();
    let format = kvwarden_core::l2::ValueFormat::new(None, 1 << 20);
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    let good = format.encode(&namespace, b"good", &payload);
    let mut torn = format.encode(&namespace, b"torn", &payload);
    let last = torn.len() - 1;
    torn[last] ^= 1; // the checksum no longer matches
    let stalled = format.encode(&namespace, b"stalled", &payload);
    let answers = [
        (namespace.redis_key(b"good"), Answer::Value(good)),
        (namespace.redis_key(b"torn"), Answer::Value(torn)),
        (
            namespace.redis_key(b"stalled"),
            Answer::Stall(stalled.clone(), 100_000),
        ),
        (
            namespace.redis_key(b"huge"),
            Answer::Claim(1 << 40, stalled[..format.header_bytes()].to_vec()),
        ),
    ]
    .into_iter()
    .collect();
    let seed = fake_store(answers);
    let (mut poll, client) = spawn(config(seed, 300, 1 << 20));

    // The control: a whole value with its checksum lands, byte for byte.
    let (landing, landed, _) = keeper();
    let _read = client.get_into(1, b"good".to_vec(), landing);
    let got = wait_for_completions(&mut poll, &client, 1);
    assert!(
        matches!(&got[..], [L2Completion::Read { token: 1, outcome: ReadOutcome::Hit, placed: Some(n), .. }] if *n == payload.len() as u64),
        "{got:?}"
    );
    assert_eq!(
        landed.lock().expect("the lock").as_deref(),
        Some(&payload[..])
    );

    // A flipped payload byte: received, checked, refused: a corrupt miss, never landed.
    let (landing, landed, touched) = keeper();
    let _read = client.get_into(2, b"torn".to_vec(), landing);
    let got = wait_for_completions(&mut poll, &client, 1);
    assert!(
        matches!(
            &got[..],
            [L2Completion::Read {
                token: 2,
                outcome: ReadOutcome::Corrupt,
                placed: None,
                ..
            }]
        ),
        "{got:?}"
    );
    assert!(
        touched.load(Ordering::SeqCst),
        "it was received into the room"
    );
    assert_eq!(*landed.lock().expect("the lock"), None, "but never landed");

    // A store that stops a third of the way into the payload: timed out, never landed.
    let (landing, landed, _) = keeper();
    let _read = client.get_into(3, b"stalled".to_vec(), landing);
    let got = wait_for_completions(&mut poll, &client, 1);
    assert!(
        matches!(
            &got[..],
            [L2Completion::Read {
                token: 3,
                outcome: ReadOutcome::TimedOut,
                placed: None,
                ..
            }]
        ),
        "{got:?}"
    );
    assert_eq!(*landed.lock().expect("the lock"), None, "never landed");

    // A reply claiming a terabyte: answered corrupt as soon as its header is judged (not
    // a timeout after trying to read it), nothing received into the room, and the next
    // read, on a fresh connection, lands.
    let (landing, _, touched) = keeper();
    let _read = client.get_into(4, b"huge".to_vec(), landing);
    let got = wait_for_completions(&mut poll, &client, 1);
    assert!(
        matches!(
            &got[..],
            [L2Completion::Read {
                token: 4,
                outcome: ReadOutcome::Corrupt,
                placed: None,
                ..
            }]
        ),
        "{got:?}"
    );
    assert!(!touched.load(Ordering::SeqCst), "no room was asked for");
    let (landing, landed, _) = keeper();
    let _read = client.get_into(5, b"good".to_vec(), landing);
    let got = wait_for_completions(&mut poll, &client, 1);
    assert!(
        matches!(
            &got[..],
            [L2Completion::Read {
                token: 5,
                outcome: ReadOutcome::Hit,
                ..
            }]
        ),
        "{got:?}"
    );
    assert_eq!(
        landed.lock().expect("the lock").as_deref(),
        Some(&payload[..])
    );
    let counters = client.counters();
    assert_eq!(
        (counters.hits, counters.corrupt, counters.timeouts),
        (2, 2, 1)
    );
}
