//! The L2 client (`kvwarden::l2`) against a real Redis Cluster on loopback: 3 masters,
//! 1 replica each. Outcomes and counts only, never durations: a bound such as "the
//! answer arrived" is the most a test here says about time.
//!
//! Needs `redis-server` and `redis-cli` (`apt-get install -y redis-server`); without them
//! each test fails saying so.

use kvwarden::l2::{L2Client, L2Completion, L2Config, Mode, PrefixOutcome};
use kvwarden_core::l2::{self, Namespace, Push, ReadOutcome, WriteOutcome};
use kvwarden_tests::{PATIENCE, RedisCluster, wait_for};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WAKER: mio::Token = mio::Token(0);

/// A client as the event loop holds one: a poll, its waker, and the completions seen.
struct Harness {
    poll: mio::Poll,
    client: L2Client,
    next_token: u64,
}

impl Harness {
    fn new(seeds: Vec<String>, timeout_ms: u64) -> Harness {
        let poll = mio::Poll::new().expect("a poll");
        let waker = mio::Waker::new(poll.registry(), WAKER).expect("a waker");
        let config = L2Config {
            seeds,
            auth: Default::default(),
            tls: None,
            format: l2::ValueFormat::new(None, 1 << 20),
            namespace: Namespace::new("kvwarden-test").expect("a namespace"),
            timeout: Duration::from_millis(timeout_ms),
            ttl: Some(Duration::from_secs(600)),
            write_queue_bytes: 64 << 20,
            threads: 4,
            known_nodes: Default::default(),
        };
        let client = L2Client::spawn(config, waker).expect("the L2 client starts");
        Harness {
            poll,
            client,
            next_token: 0,
        }
    }

    /// Waits on the waker until `done` says the completions seen so far are enough.
    fn wait(
        &mut self,
        what: &str,
        mut done: impl FnMut(&[L2Completion]) -> bool,
    ) -> Vec<L2Completion> {
        let mut events = mio::Events::with_capacity(8);
        let mut seen = Vec::new();
        let start = Instant::now();
        loop {
            seen.extend(self.client.drain());
            if done(&seen) {
                return seen;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "timed out waiting for {what}: {seen:?}"
            );
            self.poll
                .poll(&mut events, Some(Duration::from_millis(50)))
                .expect("polling");
        }
    }

    /// Writes every `(key, payload)` and waits for each write's outcome.
    fn write_all(&mut self, chunks: &[(Vec<u8>, Vec<u8>)]) -> HashMap<Vec<u8>, WriteOutcome> {
        for (key, payload) in chunks {
            assert_eq!(
                self.client.submit_write(0, key.clone(), payload.clone()),
                Push::Queued
            );
        }
        let completions = self.wait("every write's outcome", |seen| {
            seen.iter()
                .filter(|c| matches!(c, L2Completion::Written { .. }))
                .count()
                >= chunks.len()
        });
        completions
            .into_iter()
            .filter_map(|completion| match completion {
                L2Completion::Written { key, outcome, .. } => Some((key, outcome)),
                _ => None,
            })
            .collect()
    }

    /// Writes every `(key, payload)` and writes again those not written, until all are
    /// (bounded by [`PATIENCE`]): what a test needs in L2 before its fault, on a machine
    /// busy enough that a first write can time out.
    fn write_until_written(&mut self, chunks: &[(Vec<u8>, Vec<u8>)]) {
        let start = Instant::now();
        let mut left = chunks.to_vec();
        while !left.is_empty() {
            let outcomes = self.write_all(&left);
            left.retain(|(key, _)| outcomes.get(key) != Some(&WriteOutcome::Written));
            assert!(
                left.is_empty() || start.elapsed() < PATIENCE,
                "{} chunks still not written: {outcomes:?}",
                left.len()
            );
        }
    }

    /// Reads `key`: the outcome and the payload.
    fn get(&mut self, key: &[u8]) -> (ReadOutcome, Option<Vec<u8>>) {
        self.next_token += 1;
        let token = self.next_token;
        self.client.get(token, key.to_vec());
        let completions = self.wait("a read's answer", |seen| {
            seen.iter()
                .any(|c| matches!(c, L2Completion::Read { token: t, .. } if *t == token))
        });
        completions
            .into_iter()
            .find_map(|completion| match completion {
                L2Completion::Read {
                    token: t,
                    outcome,
                    payload,
                    ..
                } if t == token => Some((outcome, payload)),
                _ => None,
            })
            .expect("the read's answer")
    }

    fn exists_prefix(&mut self, keys: &[Vec<u8>]) -> PrefixOutcome {
        self.next_token += 1;
        let token = self.next_token;
        self.client.exists_prefix(token, keys.to_vec());
        let completions = self.wait("an existence check's answer", |seen| {
            seen.iter()
                .any(|c| matches!(c, L2Completion::Prefix { token: t, .. } if *t == token))
        });
        completions
            .into_iter()
            .find_map(|completion| match completion {
                L2Completion::Prefix { token: t, outcome } if t == token => Some(outcome),
                _ => None,
            })
            .expect("the check's answer")
    }
}

/// `count` chunks named `tag-i`, of varied sizes up to 256 KiB, each with its own bytes.
fn chunks(tag: &str, count: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let key = format!("{tag}-{i}").into_bytes();
            let len = [0, 1, 4096, 256 << 10][i % 4] + i;
            let payload = (0..len).map(|j| (j * 31 + i * 7) as u8).collect();
            (key, payload)
        })
        .collect()
}

/// A plain connection to the cluster, for what a test does by hand.
fn by_hand(cluster: &RedisCluster) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::new(cluster.seeds())
        .and_then(|client| client.get_connection())
        .expect("a cluster connection")
}

fn redis_key(key: &[u8]) -> Vec<u8> {
    Namespace::new("kvwarden-test")
        .expect("a namespace")
        .redis_key(key)
}

#[test]
fn written_chunks_read_back_byte_identical_and_count_as_present() {
    let cluster = RedisCluster::start(3, 1);
    let mut l2 = Harness::new(cluster.seeds(), 1000);
    let chunks = chunks("round-trip", 24);
    let outcomes = l2.write_all(&chunks);
    assert!(
        outcomes.values().all(|o| *o == WriteOutcome::Written),
        "{outcomes:?}"
    );
    assert_eq!(l2.client.mode(), Some(Mode::Cluster));
    for (key, payload) in &chunks {
        let (outcome, read) = l2.get(key);
        assert_eq!(
            outcome,
            ReadOutcome::Hit,
            "{}",
            String::from_utf8_lossy(key)
        );
        assert!(
            read.as_deref() == Some(&payload[..]),
            "bytes differ for {key:?}"
        );
    }
    let keys: Vec<Vec<u8>> = chunks.iter().map(|(key, _)| key.clone()).collect();
    assert_eq!(l2.exists_prefix(&keys), PrefixOutcome::Present(24));
    let gap = vec![keys[0].clone(), b"never-written".to_vec(), keys[1].clone()];
    assert_eq!(l2.exists_prefix(&gap), PrefixOutcome::Present(1));
    assert_eq!(l2.get(b"never-written").0, ReadOutcome::Absent);
    let counters = l2.client.counters();
    assert_eq!(
        (counters.writes, counters.hits, counters.misses),
        (24, 24, 1)
    );
    assert_eq!(
        (counters.corrupt, counters.errors, counters.queue_bytes),
        (0, 0, 0)
    );
}

#[test]
fn single_plain_redis_works_too() {
    let redis = RedisCluster::single();
    let mut l2 = Harness::new(redis.seeds(), 1000);
    let chunks = chunks("single", 4);
    assert!(
        l2.write_all(&chunks)
            .values()
            .all(|o| *o == WriteOutcome::Written)
    );
    assert_eq!(l2.client.mode(), Some(Mode::Single));
    for (key, payload) in &chunks {
        assert_eq!(l2.get(key), (ReadOutcome::Hit, Some(payload.clone())));
    }
    let keys: Vec<Vec<u8>> = chunks.iter().map(|(key, _)| key.clone()).collect();
    assert_eq!(l2.exists_prefix(&keys), PrefixOutcome::Present(4));
}

#[test]
fn value_overwritten_by_hand_is_a_counted_miss_and_the_key_is_deleted() {
    let cluster = RedisCluster::start(3, 1);
    let mut l2 = Harness::new(cluster.seeds(), 1000);
    let mut hand = by_hand(&cluster);
    let good = l2::encode(b"the real payload");
    let mut other_version = good.clone();
    other_version[4..8].copy_from_slice(&(l2::FORMAT_VERSION + 1).to_le_bytes());
    let mut torn = good.clone();
    torn[l2::HEADER_BYTES] ^= 0xff;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"written by something else".to_vec()),
        ("truncated", good[..good.len() - 3].to_vec()),
        ("header only", good[..l2::HEADER_BYTES].to_vec()),
        ("other version", other_version),
        ("torn", torn),
    ];
    for (name, value) in &cases {
        let _: () = redis::cmd("SET")
            .arg(redis_key(name.as_bytes()))
            .arg(value)
            .query(&mut hand)
            .expect("SET by hand");
    }
    // A key holding a list, not a string: written by something else too.
    let _: () = redis::cmd("RPUSH")
        .arg(redis_key(b"a list"))
        .arg("x")
        .query(&mut hand)
        .expect("RPUSH by hand");

    let names: Vec<&str> = cases
        .iter()
        .map(|(name, _)| *name)
        .chain(["a list"])
        .collect();
    for name in &names {
        assert_eq!(
            l2.get(name.as_bytes()),
            (ReadOutcome::Corrupt, None),
            "{name}"
        );
    }
    let counters = l2.client.counters();
    assert_eq!(
        (counters.corrupt, counters.misses, counters.hits),
        (6, 6, 0)
    );
    for name in &names {
        // The delete follows the answer; wait for it.
        wait_for(&format!("{name:?} deleted"), PATIENCE, || {
            let exists: i64 = redis::cmd("EXISTS")
                .arg(redis_key(name.as_bytes()))
                .query(&mut hand)
                .expect("EXISTS by hand");
            (exists == 0).then_some(())
        });
    }
    // A good value under the same key afterwards is served again.
    let _: () = redis::cmd("SET")
        .arg(redis_key(b"garbage"))
        .arg(&good)
        .query(&mut hand)
        .expect("SET by hand");
    assert_eq!(
        l2.get(b"garbage"),
        (ReadOutcome::Hit, Some(b"the real payload".to_vec()))
    );
}

#[test]
fn every_node_stopped_reads_miss_within_the_timeout_and_resume_after_sigcont() {
    let cluster = RedisCluster::start(3, 1);
    let mut l2 = Harness::new(cluster.seeds(), 300);
    let chunks = chunks("stopped", 6);
    l2.write_until_written(&chunks);

    cluster.stop_all();
    // Every call returns at once; every read is answered, as a miss.
    for (key, payload) in &chunks {
        l2.client.get(0, key.clone());
        let push = l2.client.submit_write(0, key.clone(), payload.clone());
        assert!(matches!(push, Push::Queued | Push::Dropped));
    }
    let keys: Vec<Vec<u8>> = chunks.iter().map(|(key, _)| key.clone()).collect();
    l2.client.exists_prefix(1, keys.clone());
    let asked = chunks.len() + 1; // the reads and the existence check
    let answers = l2.wait("every read answered while Redis is stopped", |seen| {
        seen.iter()
            .filter(|c| matches!(c, L2Completion::Read { .. } | L2Completion::Prefix { .. }))
            .count()
            >= asked
    });
    for answer in &answers {
        match answer {
            L2Completion::Read {
                outcome, payload, ..
            } => {
                assert_eq!((*outcome, payload), (ReadOutcome::TimedOut, &None));
            }
            L2Completion::Prefix { outcome, .. } => {
                assert_eq!(*outcome, PrefixOutcome::TimedOut)
            }
            L2Completion::Written { .. } => {}
        }
    }
    let counters = l2.client.counters();
    assert_eq!(counters.hits, 0);
    assert!(counters.timeouts >= asked as u64, "{counters:?}");

    cluster.cont_all();
    let (key, payload) = &chunks[0];
    wait_for("a hit again after SIGCONT", PATIENCE, || {
        (l2.get(key) == (ReadOutcome::Hit, Some(payload.clone()))).then_some(())
    });
    assert_eq!(
        l2.exists_prefix(&keys),
        PrefixOutcome::Present(chunks.len())
    );
    assert_eq!(l2.client.counters().corrupt, 0);
}

#[test]
fn master_killed_its_replica_takes_over_and_traffic_resumes() {
    let mut cluster = RedisCluster::start(3, 1);
    let mut l2 = Harness::new(cluster.seeds(), 1000);
    let before = chunks("before", 30);
    l2.write_until_written(&before);
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3, "masters: {masters:?}");

    cluster.kill(masters[0]);
    // Rounds of fresh writes and reads until one round goes through whole: 30 keys
    // cover every master's slots, the dead one's included. Redis promotes the replica
    // within a few node timeouts; the bound is patience, not a figure.
    let killed = Instant::now();
    let mut round = 0;
    loop {
        round += 1;
        assert!(
            killed.elapsed() < 2 * PATIENCE,
            "L2 traffic did not resume after the failover ({round} rounds); counters: {:?}; \
             {}",
            l2.client.counters(),
            cluster.describe()
        );
        let chunks = chunks(&format!("after-{round}"), 30);
        let outcomes = l2.write_all(&chunks);
        let mut whole = outcomes.values().all(|o| *o == WriteOutcome::Written);
        for (key, payload) in &chunks {
            match l2.get(key) {
                (ReadOutcome::Hit, Some(read)) => assert!(read == *payload, "bytes differ"),
                (ReadOutcome::Corrupt, _) => panic!("a corrupt value after the failover"),
                _ => whole = false,
            }
        }
        if whole {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let masters_now = cluster.masters();
    assert_eq!(
        masters_now.len(),
        3,
        "a replica was promoted: {masters_now:?}"
    );
    assert!(!masters_now.contains(&masters[0]));
    let counters = l2.client.counters();
    assert_eq!(counters.corrupt, 0);
    assert!(
        counters.errors + counters.timeouts > 0,
        "writes to the dead master were counted as failed: {counters:?}"
    );
    // What was written before the kill is still served (the replica had it) or a miss,
    // never different bytes.
    for (key, payload) in &before {
        match l2.get(key) {
            (ReadOutcome::Hit, Some(read)) => assert!(read == *payload, "bytes differ"),
            (ReadOutcome::Absent, None) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// At start the server reaches L2 once before `ready` and says what it found, or
/// exactly why not; `/status` shows `down` with the reason until it is reached, and the
/// server serves all the same. Control: a reachable Redis is named and `up`.
#[test]
fn l2_at_start_is_named_when_reached_and_down_with_the_reason_when_not() {
    use kvwarden_tests::{Server, TempDir};
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port");
    // The listener is dropped: nothing answers on the port.
    let dir = TempDir::new("l2-start-down");
    let server = Server::start(&dir, &["--l2", &format!("redis://{closed}")]);
    let status = server.status();
    assert_eq!(status["l2"]["state"], "down", "{}", status["l2"]);
    let reason = status["l2"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(reason.contains("refused"), "{reason}");
    assert!(
        server.log().contains("L2 is unreachable at start"),
        "{}",
        server.log()
    );
    let pong = kvwarden_tests::RawClient::connect(&server.socket)
        .expect("connecting")
        .request("ping", vec![rmpv::Value::Nil])
        .expect("a reply");
    assert_eq!(pong.result.expect("ok"), rmpv::Value::Boolean(true));

    let redis = RedisCluster::single();
    let dir = TempDir::new("l2-start-up");
    let server = Server::start(&dir, &["--l2", &redis.seeds()[0]]);
    assert!(
        server
            .log()
            .contains("L2: connected to a single Redis node"),
        "{}",
        server.log()
    );
    let status = server.status();
    assert_eq!(status["l2"]["state"], "up", "{}", status["l2"]);
    assert_eq!(status["l2"]["reason"], serde_json::Value::Null);
}
