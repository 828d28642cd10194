//! L2 end to end: real `kvwarden serve` processes with `--l2` on a real Redis Cluster on
//! loopback (3 masters, 1 replica each), `failure-modes.md` rows 27–29. Outcomes and
//! counts only, never durations: "answered", "a miss", "nothing reaped".
//!
//! Needs `redis-server` and `redis-cli` (`apt-get install -y redis-server`); without them
//! each test fails saying so. Every cluster is torn down when its test ends.

mod engine_support;

use engine_support::Helper;
use kvwarden::client::{Client, MemfdBuffer};
use kvwarden_core::l2::Namespace;
use kvwarden_core::protocol::Op;
use kvwarden_tests::l2_worker::{chunk, l2_counter, store, wait_written, worker};
use kvwarden_tests::{PATIENCE, RedisCluster, Server, TempDir, freed, wait_for};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `--slot-bytes` of the test servers: one chunk.
const CHUNK: u64 = 64 << 10;

/// The model name the workers here register.
const MODEL: &str = "l2";

/// The helper process of row 29 (a no-op when run as a test).
#[test]
fn helper_process_engine_worker() {
    engine_support::run_helper_if_asked();
}

/// A server on `cluster` under `namespace`; liveness timeouts long enough that a test's
/// idle moments never reap its workers (only the L2 behaviour is on trial here).
fn server(dir: &TempDir, cluster: &RedisCluster, namespace: &str) -> Server {
    server_with(dir, cluster, namespace, &[])
}

/// [`server`] with `extra` flags after the others.
fn server_with(dir: &TempDir, cluster: &RedisCluster, namespace: &str, extra: &[&str]) -> Server {
    server_with_seeds(dir, &cluster.seeds().join(","), namespace, extra)
}

/// [`server_with`] on `--l2 seeds`.
fn server_with_seeds(dir: &TempDir, seeds: &str, namespace: &str, extra: &[&str]) -> Server {
    let mut args = vec![
        "--worker-reap-timeout-seconds",
        "60",
        "--worker-registration-grace-seconds",
        "120",
        "--resolution-seconds",
        "1",
        "--l2",
        seeds,
        "--l2-namespace",
        namespace,
        "--l2-timeout-ms",
        "200",
        "--l2-write-queue-bytes",
        "16M",
    ];
    args.extend_from_slice(extra);
    Server::start(dir, &args)
}

fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Retrieves `key` (every chunk here is `CHUNK` bytes) into offset `CHUNK` of the
/// buffer: its bytes, or None on a miss.
fn retrieve(client: &Client, buffer: &MemfdBuffer, key: &[u8]) -> Option<Vec<u8>> {
    let nbytes = client.retrieve(key, 0, CHUNK, CHUNK).expect("retrieve")?;
    let mut out = vec![0; nbytes as usize];
    assert!(buffer.read(CHUNK, &mut out));
    Some(out)
}

fn ping(client: &Client) -> bool {
    let args = Op::Ping {
        instance: Some(client.instance_id()),
    }
    .args();
    client.call("ping", args).expect("ping answered") == rmpv::Value::Boolean(true)
}

/// `redis-cli -c -p port args…`: its stdout (cluster redirections followed).
fn redis_cli(port: u16, args: &[&[u8]]) -> String {
    use std::os::unix::ffi::OsStrExt;
    let output = Command::new("redis-cli")
        .args(["-c", "-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args.iter().map(|arg| std::ffi::OsStr::from_bytes(arg)))
        .stdin(Stdio::null())
        .output()
        .expect("running redis-cli");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Every key under `namespace` in the cluster (a SCAN of each master).
fn scan(cluster: &RedisCluster, namespace: &str) -> Vec<String> {
    let pattern = format!("{namespace}:*");
    let mut keys = Vec::new();
    for port in cluster.masters() {
        let output = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(["--scan", "--pattern", &pattern])
            .stdin(Stdio::null())
            .output()
            .expect("running redis-cli --scan");
        keys.extend(
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter(|line| !line.is_empty())
                .map(str::to_string),
        );
    }
    keys
}

/// The Redis key of a worker's `key` stored by this test's workers (their tenant is
/// this process's uid's: keys are scoped per tenant, protocol 2).
fn redis_key(namespace: &str, key: &[u8]) -> Vec<u8> {
    let scoped = kvwarden_tests::tenant_scoped_key(&kvwarden_tests::own_tenant(), key);
    Namespace::new(namespace)
        .expect("a namespace")
        .redis_key(&scoped)
}

#[test]
fn row_27_a_chunk_stored_through_node_a_is_retrieved_through_node_b() {
    let cluster = RedisCluster::start(3, 1);
    let (dir_a, dir_b) = (TempDir::new("l2-node-a"), TempDir::new("l2-node-b"));
    let a = server(&dir_a, &cluster, "cross");
    let b = server(&dir_b, &cluster, "cross");
    let (writer, source) = worker(&a, MODEL);
    let bytes = chunk(1, CHUNK);
    store(&writer, &source, b"prefix-0", &bytes);
    wait_written(&a, 1);

    let (reader, target) = worker(&b, MODEL);
    assert_eq!(
        reader
            .lookup(&[b"prefix-0".to_vec(), b"prefix-1".to_vec()])
            .expect("lookup"),
        1,
        "B counts the chunk A published, through L2"
    );
    let read = retrieve(&reader, &target, b"prefix-0").expect("a hit through L2");
    assert_eq!(checksum(&read), checksum(&bytes), "byte-identical");
    let status = b.status();
    assert_eq!(l2_counter(&status, "hits"), 1);
    assert_eq!(l2_counter(&status, "corrupt"), 0);
    assert_eq!(status["l2"]["state"], "up");
    assert_eq!(status["l1"]["slots_used"], 1, "promoted into B's L1");
    // Served from B's L1 now: no second L2 read.
    let again = retrieve(&reader, &target, b"prefix-0").expect("an L1 hit");
    assert_eq!(checksum(&again), checksum(&bytes));
    assert_eq!(l2_counter(&b.status(), "hits"), 1);
    // A miss everywhere is a miss, as without L2.
    assert!(retrieve(&reader, &target, b"absent").is_none());
    let (code, body) = b.http_get("/metrics");
    assert_eq!(code, 200);
    assert!(body.contains("kvwarden_l2_hits_total 1"), "{body}");
    assert!(body.contains("kvwarden_l2_state{state=\"up\"} 1"), "{body}");
    let table = Command::new(kvwarden_tests::kvwarden_bin())
        .args(["status", "--socket"])
        .arg(&b.socket)
        .output()
        .expect("kvwarden status");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("L2: up"), "{table}");
    drop((writer, reader));
}

#[test]
fn row_58_a_miss_costs_nothing_beyond_itself_hits_after_misses_stay_hits() {
    // One L2 thread: every read of server B goes over the same connections, so a miss
    // whose reply was read short would break the read after it (issue 45).
    let cluster = RedisCluster::start(3, 1);
    let (dir_a, dir_b) = (TempDir::new("l2-miss-a"), TempDir::new("l2-miss-b"));
    let a = server(&dir_a, &cluster, "miss");
    let b = server_with(&dir_b, &cluster, "miss", &["--l2-threads", "1"]);
    let (writer, source) = worker(&a, MODEL);
    let held: Vec<Vec<u8>> = (0..13).map(|n| format!("held-{n}").into_bytes()).collect();
    for (n, key) in held.iter().enumerate() {
        store(&writer, &source, key, &chunk(n as u64, CHUNK));
    }
    wait_written(&a, held.len() as u64);

    let (reader, target) = worker(&b, MODEL);
    // Single reads: miss, hit, miss, hit, …
    for (n, key) in held.iter().enumerate().take(4) {
        let absent = format!("absent-{n}").into_bytes();
        assert!(retrieve(&reader, &target, &absent).is_none(), "a miss");
        let read = retrieve(&reader, &target, key).expect("a hit after a miss");
        assert_eq!(checksum(&read), checksum(&chunk(n as u64, CHUNK)));
    }
    // Batched: a miss first, one between, each hit still a hit.
    let mut items: Vec<(Vec<u8>, Option<u64>)> = vec![(b"absent-b0".to_vec(), None)];
    items.extend(held[4..8].iter().map(|key| (key.clone(), Some(n_of(key)))));
    items.push((b"absent-b1".to_vec(), None));
    items.extend(held[8..12].iter().map(|key| (key.clone(), Some(n_of(key)))));
    let requests: Vec<(&[u8], u64, u64, u64)> = items
        .iter()
        .enumerate()
        .map(|(at, (key, _))| (key.as_slice(), 0, at as u64 * CHUNK, CHUNK))
        .collect();
    let answers = reader.retrieve_batch(&requests).expect("retrieve_batch");
    for (at, ((key, seed), answer)) in items.iter().zip(&answers).enumerate() {
        let key = String::from_utf8_lossy(key);
        match seed {
            None => assert_eq!(*answer, None, "{key}: a miss"),
            Some(seed) => {
                assert_eq!(*answer, Some(CHUNK), "{key}: a hit in a batch after a miss");
                let mut read = vec![0; CHUNK as usize];
                assert!(target.read(at as u64 * CHUNK, &mut read));
                assert_eq!(checksum(&read), checksum(&chunk(*seed, CHUNK)), "{key}");
            }
        }
    }
    // One key twice in a batch, held only in L2: both items filled, as from L1.
    let twice: Vec<(&[u8], u64, u64, u64)> =
        vec![(&held[12], 0, 0, CHUNK), (&held[12], 0, CHUNK, CHUNK)];
    for from in ["L2", "L1"] {
        let answers = reader.retrieve_batch(&twice).expect("retrieve_batch");
        assert_eq!(answers, vec![Some(CHUNK); 2], "a key twice, from {from}");
    }
    let status = b.status();
    assert_eq!(l2_counter(&status, "hits"), held.len() as u64, "{status}");
    assert_eq!(l2_counter(&status, "misses"), 6, "{status}");
    assert_eq!(l2_counter(&status, "errors"), 0, "{status}");
    assert_eq!(l2_counter(&status, "timeouts"), 0, "{status}");
    assert_eq!(status["l2"]["state"], "up", "{status}");
    drop((writer, reader));
}

/// The seed of chunk `held-N`: N.
fn n_of(key: &[u8]) -> u64 {
    String::from_utf8_lossy(key)
        .trim_start_matches("held-")
        .parse()
        .expect("a held key")
}

#[test]
fn row_27_every_redis_process_stopped_pings_answered_l1_serves_l2_misses() {
    let cluster = RedisCluster::start(3, 1);
    let (dir_a, dir_b) = (TempDir::new("l2-stop-a"), TempDir::new("l2-stop-b"));
    let a = server(&dir_a, &cluster, "stop");
    let b = server(&dir_b, &cluster, "stop");
    let (local, local_buffer) = worker(&a, MODEL);
    let (remote, remote_buffer) = worker(&b, MODEL);
    let local_bytes = chunk(2, CHUNK);
    let remote_bytes = chunk(3, CHUNK);
    store(&local, &local_buffer, b"in-l1", &local_bytes);
    store(&remote, &remote_buffer, b"l2-only", &remote_bytes);
    wait_written(&a, 1);
    wait_written(&b, 1);

    cluster.stop_all();
    let stopped = Instant::now();
    let mut pings = 0;
    let mut misses = 0;
    while stopped.elapsed() < Duration::from_secs(10) {
        assert!(ping(&local), "a ping is answered true while L2 is stopped");
        pings += 1;
        if pings % 10 == 0 {
            assert!(
                retrieve(&local, &local_buffer, b"l2-only").is_none(),
                "an L2-only chunk is a miss"
            );
            misses += 1;
            let read = retrieve(&local, &local_buffer, b"in-l1").expect("L1 keeps serving");
            assert_eq!(checksum(&read), checksum(&local_bytes));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(misses > 0);
    let status = a.status();
    assert_ne!(status["l2"]["state"], "up", "{status}");
    assert_eq!(
        status["worker_liveness"]["reaped_total"], 0,
        "nothing reaped"
    );
    assert_eq!(status["worker_liveness"]["tracked_instances"], 1);
    assert_eq!(a.http_get("/healthz").0, 200, "L2 is optional");
    assert_eq!(local.pings_answered_false(), 0);

    cluster.cont_all();
    let read = wait_for("the L2-only chunk served again", PATIENCE, || {
        let read = retrieve(&local, &local_buffer, b"l2-only");
        if read.is_none() {
            std::thread::sleep(Duration::from_millis(200));
        }
        read
    });
    assert_eq!(checksum(&read), checksum(&remote_bytes));
    let status = a.wait_status("L2 up again", |status| status["l2"]["state"] == "up");
    assert_eq!(l2_counter(&status, "corrupt"), 0);
    let log = a.log();
    assert_eq!(log.matches("L2 is down").count(), 1, "logged once: {log}");
    assert_eq!(log.matches("L2 is back").count(), 1, "logged once: {log}");
}

#[test]
fn row_27_a_master_killed_its_replica_takes_over_and_l2_resumes() {
    let mut cluster = RedisCluster::start(3, 1);
    let (dir_a, dir_b) = (TempDir::new("l2-kill-a"), TempDir::new("l2-kill-b"));
    let a = server(&dir_a, &cluster, "failover");
    let b = server(&dir_b, &cluster, "failover");
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    let victim = cluster.masters()[0];
    cluster.kill(victim);
    // Keep publishing across the failover: writes to the dead master's slots fail
    // (counted) until its replica is promoted, then land again.
    let mut seed = 100;
    wait_for(
        "every key written again after the failover",
        PATIENCE,
        || {
            let status = a.status();
            let before = l2_counter(&status, "writes");
            let lost = |status: &serde_json::Value| {
                l2_counter(status, "write_drops") + l2_counter(status, "errors")
            };
            let lost_before = lost(&status);
            let batch: Vec<u64> = (seed..seed + 12).collect();
            seed += 12;
            for &n in &batch {
                store(
                    &writer,
                    &source,
                    format!("f-{n}").as_bytes(),
                    &chunk(n, CHUNK),
                );
            }
            std::thread::sleep(Duration::from_millis(300));
            // This batch is all in L2 when the queue is empty, nothing of it was lost,
            // and the writes grew by at least its length (a write of an earlier batch
            // may count here too, hence the empty queue).
            let status = a.status();
            (l2_counter(&status, "queue_bytes") == 0
                && lost(&status) == lost_before
                && l2_counter(&status, "writes") >= before + batch.len() as u64)
                .then_some(())
        },
    );
    let status = a.status();
    let failed = l2_counter(&status, "errors")
        + l2_counter(&status, "timeouts")
        + l2_counter(&status, "write_drops");
    assert!(
        failed > 0,
        "writes during the failover are counted as failed or dropped: {status}"
    );
    // The latest keys, spread over every slot range, are read through B.
    for n in seed - 12..seed {
        let read = retrieve(&reader, &target, format!("f-{n}").as_bytes())
            .unwrap_or_else(|| panic!("f-{n} through L2 after the failover"));
        assert_eq!(checksum(&read), checksum(&chunk(n, CHUNK)));
    }
    assert_eq!(
        l2_counter(&b.status(), "corrupt"),
        0,
        "no corrupt value served"
    );
    assert_eq!(l2_counter(&a.status(), "corrupt"), 0);
}

#[test]
fn row_28_a_value_overwritten_in_redis_is_a_miss_counted_and_deleted() {
    let cluster = RedisCluster::start(3, 1);
    let (dir_a, dir_b) = (TempDir::new("l2-corrupt-a"), TempDir::new("l2-corrupt-b"));
    let a = server(&dir_a, &cluster, "corrupt");
    let b = server(&dir_b, &cluster, "corrupt");
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    let port = cluster.live_ports()[0];
    for (n, damage) in [
        b"garbage, not a kvwarden value".to_vec(),
        b"KVL2".to_vec(), // a truncated header
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("damaged-{n}").into_bytes();
        store(&writer, &source, &key, &chunk(n as u64, CHUNK));
        wait_written(&a, n as u64 + 1);
        let name = redis_key("corrupt", &key);
        assert_eq!(redis_cli(port, &[b"SET", &name, &damage]), "OK");
        assert!(
            retrieve(&reader, &target, &key).is_none(),
            "a damaged value is a miss, never served"
        );
        assert_eq!(l2_counter(&b.status(), "corrupt"), n as u64 + 1);
        wait_for("the damaged key deleted", PATIENCE, || {
            (redis_cli(port, &[b"EXISTS", &name]) == "0").then_some(())
        });
    }
    assert_eq!(l2_counter(&b.status(), "hits"), 0);
}

#[test]
fn row_29_a_worker_killed_with_a_reservation_prepared_never_reaches_l2() {
    let cluster = RedisCluster::start(3, 1);
    let dir = TempDir::new("l2-row29");
    let server = server(&dir, &cluster, "row29");
    let helper = Helper::spawn(
        "helper_process_engine_worker",
        &server.socket,
        291,
        "engine,store:published-x,reserve:half-x",
    );
    wait_written(&server, 1);
    helper.kill();
    server.wait_status("the instance freed", |status| {
        freed(status, "process_exited") >= 1
    });
    // A later publication goes through the same queue: once it is in L2, anything
    // queued before it has been written too.
    let (writer, source) = worker(&server, MODEL);
    store(&writer, &source, b"after", &chunk(9, CHUNK));
    wait_written(&server, 2);
    let keys = scan(&cluster, "row29");
    let published = String::from_utf8(redis_key("row29", b"published-x")).unwrap();
    let half = String::from_utf8(redis_key("row29", b"half-x")).unwrap();
    assert!(keys.contains(&published), "{keys:?}");
    assert!(
        !keys.contains(&half),
        "an unpublished reservation reached L2: {keys:?}"
    );
}

#[test]
fn bad_l2_flags_exit_2_naming_the_flag_and_the_fix() {
    let dir = TempDir::new("l2-flags");
    let socket = dir.path().join("kvwarden.sock");
    let socket = socket.to_str().expect("a UTF-8 path");
    for (flags, named) in [
        (vec!["--l2", "http://127.0.0.1:7000"], "--l2"),
        (vec!["--l2", " , "], "--l2"),
        (
            vec!["--l2", "redis://127.0.0.1:7000", "--l2-timeout-ms", "0"],
            "--l2-timeout-ms",
        ),
        (
            vec!["--l2", "redis://127.0.0.1:7000", "--l2-threads", "0"],
            "--l2-threads",
        ),
        (
            vec!["--l2", "redis://127.0.0.1:7000", "--l2-namespace", "a{b}"],
            "--l2-namespace",
        ),
        (
            vec![
                "--l2",
                "redis://127.0.0.1:7000",
                "--l2-write-queue-bytes",
                "lots",
            ],
            "--l2-write-queue-bytes",
        ),
        (vec!["--l2-namespace", "alone"], "--l2"),
    ] {
        let output = Command::new(kvwarden_tests::kvwarden_bin())
            .args(["serve", "--socket", socket, "--http", "off"])
            .args(&flags)
            .stdin(Stdio::null())
            .output()
            .expect("running kvwarden serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(named), "{flags:?} names {named}: {stderr}");
    }
    // Without --l2 nothing of L2 shows.
    let plain = Server::start(&dir, &[]);
    assert!(plain.status()["l2"].is_null());
    let (_, metrics) = plain.http_get("/metrics");
    assert!(!metrics.contains("kvwarden_l2_"), "{metrics}");
    assert_eq!(plain.http_get("/healthz").0, 200);
    drop(plain);
    let help = Command::new(kvwarden_tests::kvwarden_bin())
        .args(["serve", "--help"])
        .output()
        .expect("kvwarden serve --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--l2 ",
        "--l2-namespace",
        "--l2-timeout-ms",
        "--l2-ttl-seconds",
        "--l2-write-queue-bytes",
        "--l2-threads",
    ] {
        assert!(help.contains(flag), "--help explains {flag}: {help}");
    }
}

/// Row 62: two servers whose only `--l2` seed is a master with a synced replica. The
/// seed is SIGKILLed; the cluster fails over. L2 comes back through the nodes the
/// cluster's map named (not only the seeds): every key written again after the
/// failover, and read through the other server, whose `l2.map_from` then names a node
/// that is not the seed. Before, both stayed `down` ("connection refused") until the
/// seed came back. The control: the same chunk read through L2 before the kill.
#[test]
fn row_62_l2_outlives_the_loss_of_its_only_seed() {
    let mut cluster = RedisCluster::start(3, 1);
    let victim = cluster.masters()[0];
    let seed = format!("redis://127.0.0.1:{victim}");
    let (dir_a, dir_b) = (TempDir::new("l2-seed-a"), TempDir::new("l2-seed-b"));
    let a = server_with_seeds(&dir_a, &seed, "seed", &[]);
    let b = server_with_seeds(&dir_b, &seed, "seed", &[]);
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    // The control: through the seed.
    store(&writer, &source, b"before", &chunk(1, CHUNK));
    wait_written(&a, 1);
    let read = retrieve(&reader, &target, b"before").expect("a hit through the seed");
    assert_eq!(checksum(&read), checksum(&chunk(1, CHUNK)));
    assert_eq!(b.status()["l2"]["map_from"], seed.as_str());

    cluster.kill(victim);
    let mut next = 100;
    wait_for(
        "every key written again after the seed died",
        PATIENCE,
        || {
            let status = a.status();
            let before = l2_counter(&status, "writes");
            let lost = |status: &serde_json::Value| {
                l2_counter(status, "write_drops") + l2_counter(status, "errors")
            };
            let lost_before = lost(&status);
            let batch: Vec<u64> = (next..next + 12).collect();
            next += 12;
            for &n in &batch {
                store(
                    &writer,
                    &source,
                    format!("s-{n}").as_bytes(),
                    &chunk(n, CHUNK),
                );
            }
            std::thread::sleep(Duration::from_millis(300));
            // This batch is all in L2 when the queue is empty, nothing of it was lost,
            // and the writes grew by at least its length (a write of an earlier batch
            // may count here too, hence the empty queue).
            let status = a.status();
            (l2_counter(&status, "queue_bytes") == 0
                && lost(&status) == lost_before
                && l2_counter(&status, "writes") >= before + batch.len() as u64)
                .then_some(())
        },
    );
    // Server b has not touched L2 since the kill: its first read of a key in the dead
    // seed's slots finds the seed gone (a miss, which is how it learns) and the reads
    // after it go through the map's other nodes. So the batch is read until every key
    // of it hits through b.
    let batch = next - 12..next;
    wait_for(
        "every key read through b after the seed died",
        PATIENCE,
        || {
            batch
                .clone()
                .all(|n| {
                    retrieve(&reader, &target, format!("s-{n}").as_bytes())
                        .is_some_and(|read| checksum(&read) == checksum(&chunk(n, CHUNK)))
                })
                .then_some(())
        },
    );
    let status = b.status();
    assert_eq!(status["l2"]["state"], "up", "{}", status["l2"]);
    let map_from = status["l2"]["map_from"].as_str().unwrap_or_default();
    assert!(
        !map_from.is_empty() && map_from != seed,
        "the map came from another node: {}",
        status["l2"]
    );
}
