//! L2 on a network and a Redis that are not trusted: real `kvwarden serve` processes on
//! a real Redis on loopback, `failure-modes.md` rows 38–41 (TLS with the certificate
//! verified, values authenticated by the cluster secret, reads bounded by the slot, no
//! credential in the open) and row 19's write-behind drain on SIGTERM. Each attack runs
//! after a control that shows the same operation succeeding. Outcomes and counts only,
//! never durations.
//!
//! Needs `redis-server` and `redis-cli` (`apt-get install -y redis-server`, built with
//! TLS as Debian's is) and `openssl` (`apt-get install -y openssl`); without them each
//! test fails saying so.

use kvwarden::client::{Client, MemfdBuffer};
use kvwarden_bench::redis_cluster::{self as harness, Security};
use kvwarden_core::l2::{self, Namespace};
use kvwarden_tests::l2_worker::{chunk, l2_counter, store, wait_written, worker};
use kvwarden_tests::{PATIENCE, Server, TempDir, wait_for};
use serde_json::Value as Json;
use std::process::{Command, Stdio};

/// `--slot-bytes` of the test servers: one chunk.
const CHUNK: u64 = 64 << 10;

/// The model name the workers here register.
const MODEL: &str = "l2-trust";

/// A Redis Cluster of 3 masters (no replicas) or one plain Redis, secured so.
fn redis(cluster: bool, security: Security) -> harness::RedisCluster {
    if let Err(error) = harness::require(&harness::REDIS_PROGRAMS) {
        panic!("{error}. The L2 tests need a real Redis; `.ci/run` installs it by itself");
    }
    let started = if cluster {
        harness::RedisCluster::start_secured(3, 0, harness::CLUSTER_NODE_TIMEOUT_MS, security)
    } else {
        harness::RedisCluster::single_secured(security)
    };
    started.unwrap_or_else(|error| panic!("starting Redis: {error}"))
}

/// A server on `seeds` under `namespace`, with `extra` flags and `env`.
fn server(
    dir: &TempDir,
    seeds: &str,
    namespace: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Server {
    let mut flags = vec![
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
        "--l2-write-queue-bytes",
        "1M",
    ];
    if !extra.contains(&"--l2-timeout-ms") {
        flags.extend(["--l2-timeout-ms", "500"]);
    }
    flags.extend_from_slice(extra);
    Server::start_with_env(dir, &flags, env)
}

/// The sentinel a retrieve's destination holds before it: a miss leaves it there.
const UNTOUCHED: u8 = 0xA5;

/// Retrieves `key` into offset `CHUNK` of the buffer (filled with [`UNTOUCHED`] first):
/// its bytes, or None on a miss, after checking that a miss wrote nothing there.
fn retrieve(client: &Client, buffer: &MemfdBuffer, key: &[u8]) -> Option<Vec<u8>> {
    assert!(buffer.write(CHUNK, &vec![UNTOUCHED; CHUNK as usize]));
    let got = client.retrieve(key, 0, CHUNK, CHUNK).expect("retrieve");
    let mut out = vec![0; CHUNK as usize];
    assert!(buffer.read(CHUNK, &mut out));
    match got {
        Some(nbytes) => {
            out.truncate(nbytes as usize);
            Some(out)
        }
        None => {
            assert!(
                out.iter().all(|byte| *byte == UNTOUCHED),
                "a miss wrote into the worker's buffer"
            );
            None
        }
    }
}

/// The Redis key of this test process's worker's `key` (tenant-scoped).
fn redis_key(namespace: &str, key: &[u8]) -> Vec<u8> {
    let scoped = kvwarden_tests::tenant_scoped_key(&kvwarden_tests::own_tenant(), key);
    Namespace::new(namespace)
        .expect("a namespace")
        .redis_key(&scoped)
}

/// A plain-TCP connection to `redis` for planting and reading raw values by hand.
fn by_hand(redis: &harness::RedisCluster, cluster: bool) -> Box<dyn redis::ConnectionLike> {
    if cluster {
        Box::new(
            redis::cluster::ClusterClient::new(redis.seeds())
                .and_then(|client| client.get_connection())
                .expect("a cluster connection by hand"),
        )
    } else {
        Box::new(
            redis::Client::open(redis.seeds()[0].as_str())
                .and_then(|client| client.get_connection())
                .expect("a connection by hand"),
        )
    }
}

fn write_file(dir: &TempDir, name: &str, bytes: &[u8]) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("writing a test file");
    path.to_str().expect("a UTF-8 path").to_string()
}

fn path(path: &std::path::Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

// ------------------------------------------------------------------ row 38: TLS

#[test]
fn row_38_a_chunk_stored_over_tls_is_retrieved_through_another_server() {
    let redis = redis(
        true,
        Security {
            password: None,
            tls: Some(false),
        },
    );
    let files = redis.tls_files().expect("TLS files").clone();
    let seeds = redis.seeds().join(",");
    assert!(seeds.starts_with("rediss://"), "{seeds}");
    let (dir_a, dir_b) = (TempDir::new("tls-a"), TempDir::new("tls-b"));
    let ca = ["--l2-tls-ca-file", path(&files.ca)];
    let a = server(&dir_a, &seeds, "tls", &ca, &[]);
    let b = server(&dir_b, &seeds, "tls", &ca, &[]);
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    let bytes = chunk(38, CHUNK);
    store(&writer, &source, b"over-tls", &bytes);
    wait_written(&a, 1);
    assert_eq!(retrieve(&reader, &target, b"over-tls"), Some(bytes));
    let status = b.status();
    assert_eq!(status["l2"]["tls"], Json::Bool(true), "{status}");
    assert_eq!(status["l2"]["state"], "up", "{status}");
    assert_eq!(l2_counter(&status, "hits"), 1);
}

#[test]
fn row_38_a_server_trusting_another_ca_or_speaking_plaintext_gets_no_l2() {
    let redis = redis(
        true,
        Security {
            password: None,
            tls: Some(false),
        },
    );
    let files = redis.tls_files().expect("TLS files").clone();
    let seeds = redis.seeds().join(",");
    let dirs = [
        TempDir::new("tls-w"),
        TempDir::new("tls-r"),
        TempDir::new("tls-x"),
        TempDir::new("tls-p"),
    ];
    let writer_server = server(
        &dirs[0],
        &seeds,
        "tls2",
        &["--l2-tls-ca-file", path(&files.ca)],
        &[],
    );
    let (writer, source) = worker(&writer_server, MODEL);
    let bytes = chunk(1, CHUNK);
    store(&writer, &source, b"secret-chunk", &bytes);
    wait_written(&writer_server, 1);

    // Control: a server that trusts the CA that signed Redis's certificate reads it.
    let trusting = server(
        &dirs[1],
        &seeds,
        "tls2",
        &["--l2-tls-ca-file", path(&files.ca)],
        &[],
    );
    let (reader, target) = worker(&trusting, MODEL);
    assert_eq!(retrieve(&reader, &target, b"secret-chunk"), Some(bytes));

    // A server that trusts another CA refuses the servers: no value served, and the
    // status says why.
    let other = server(
        &dirs[2],
        &seeds,
        "tls2",
        &["--l2-tls-ca-file", path(&files.other_ca)],
        &[],
    );
    let (reader, target) = worker(&other, MODEL);
    assert_eq!(retrieve(&reader, &target, b"secret-chunk"), None);
    let status = other.wait_status("the certificate refusal in l2.reason", |status| {
        status["l2"]["reason"].as_str().is_some()
    });
    let reason = status["l2"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(reason.contains("certificate"), "{status}");
    assert_ne!(status["l2"]["state"], "up", "{status}");
    assert_eq!(l2_counter(&status, "hits"), 0);

    // The TLS port does not speak plaintext: a redis:// server aimed at it gets nothing.
    let plain_seeds = seeds.replace("rediss://", "redis://");
    let plain = server(&dirs[3], &plain_seeds, "tls2", &[], &[]);
    let (reader, target) = worker(&plain, MODEL);
    assert_eq!(retrieve(&reader, &target, b"secret-chunk"), None);
    let status = plain.wait_status("a reason in l2.reason", |status| {
        status["l2"]["reason"].as_str().is_some()
    });
    assert_eq!(status["l2"]["tls"], Json::Bool(false), "{status}");
    assert_eq!(l2_counter(&status, "hits"), 0, "{status}");
}

#[test]
fn row_38_mutual_tls_admits_the_client_certificate_and_refuses_a_server_without_one() {
    let redis = redis(
        true,
        Security {
            password: None,
            tls: Some(true),
        },
    );
    let files = redis.tls_files().expect("TLS files").clone();
    let seeds = redis.seeds().join(",");
    let (dir_a, dir_b, dir_c) = (
        TempDir::new("mtls-a"),
        TempDir::new("mtls-b"),
        TempDir::new("mtls-c"),
    );
    let with_cert = [
        "--l2-tls-ca-file",
        path(&files.ca),
        "--l2-tls-cert-file",
        path(&files.client_cert),
        "--l2-tls-key-file",
        path(&files.client_key),
    ];
    let a = server(&dir_a, &seeds, "mtls", &with_cert, &[]);
    let b = server(&dir_b, &seeds, "mtls", &with_cert, &[]);
    let (writer, source) = worker(&a, MODEL);
    let bytes = chunk(2, CHUNK);
    store(&writer, &source, b"mutual", &bytes);
    wait_written(&a, 1);
    let (reader, target) = worker(&b, MODEL);
    assert_eq!(retrieve(&reader, &target, b"mutual"), Some(bytes));

    let without = server(
        &dir_c,
        &seeds,
        "mtls",
        &["--l2-tls-ca-file", path(&files.ca)],
        &[],
    );
    let (reader, target) = worker(&without, MODEL);
    assert_eq!(retrieve(&reader, &target, b"mutual"), None);
    let status = without.wait_status("a reason in l2.reason", |status| {
        status["l2"]["reason"].as_str().is_some()
    });
    assert_eq!(l2_counter(&status, "hits"), 0, "{status}");
}

#[test]
fn row_38_bad_tls_flags_exit_2_naming_the_flag_and_the_path() {
    let dir = TempDir::new("tls-flags");
    let socket = dir.path().join("kvwarden.sock");
    let not_pem = write_file(&dir, "not.pem", b"not a certificate");
    let missing = dir.path().join("missing.pem");
    let missing = path(&missing);
    for (flags, named) in [
        (
            vec![
                "--l2",
                "rediss://127.0.0.1:7000",
                "--l2-tls-ca-file",
                missing,
            ],
            vec!["--l2-tls-ca-file", missing],
        ),
        (
            vec![
                "--l2",
                "rediss://127.0.0.1:7000",
                "--l2-tls-ca-file",
                &not_pem,
            ],
            vec!["--l2-tls-ca-file", &not_pem],
        ),
        (
            vec![
                "--l2",
                "rediss://127.0.0.1:7000",
                "--l2-tls-cert-file",
                &not_pem,
                "--l2-tls-key-file",
                &not_pem,
            ],
            vec!["--l2-tls-cert-file", &not_pem],
        ),
        (
            vec!["--l2", "redis://127.0.0.1:7000,rediss://127.0.0.1:7001"],
            vec!["same scheme"],
        ),
        (
            vec![
                "--l2",
                "redis://127.0.0.1:7000",
                "--l2-tls-ca-file",
                &not_pem,
            ],
            vec!["rediss://"],
        ),
    ] {
        let output = Command::new(kvwarden_tests::kvwarden_bin())
            .args(["serve", "--http", "off", "--socket", path(&socket)])
            .args(&flags)
            .stdin(Stdio::null())
            .output()
            .expect("running kvwarden serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flags:?}: {stderr}");
        for word in named {
            assert!(stderr.contains(word), "{flags:?} names {word}: {stderr}");
        }
    }
}

// ------------------------------------------------------------------ row 39: MAC

#[test]
fn row_39_a_value_not_written_with_the_cluster_secret_is_a_miss_never_served() {
    let redis = redis(true, Security::default());
    let seeds = redis.seeds().join(",");
    let secrets = TempDir::new("mac-secrets");
    let secret = write_file(&secrets, "secret", &[7u8; 32]);
    let other_secret = write_file(&secrets, "other", &[8u8; 32]);
    let with_secret = ["--l2-secret-file", secret.as_str()];
    let dirs = [
        TempDir::new("mac-a"),
        TempDir::new("mac-b"),
        TempDir::new("mac-c"),
        TempDir::new("mac-d"),
    ];
    let a = server(&dirs[0], &seeds, "mac", &with_secret, &[]);
    let b = server(&dirs[1], &seeds, "mac", &with_secret, &[]);
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);

    // Control: what one server with the secret writes, another with it serves.
    let bytes = chunk(39, CHUNK);
    store(&writer, &source, b"shared", &bytes);
    wait_written(&a, 1);
    assert_eq!(retrieve(&reader, &target, b"shared"), Some(bytes.clone()));
    assert_eq!(b.status()["l2"]["authenticated_values"], Json::Bool(true));

    // A server with another secret, and one without any, miss it (and delete it).
    let other = server(
        &dirs[2],
        &seeds,
        "mac",
        &["--l2-secret-file", other_secret.as_str()],
        &[],
    );
    let (other_reader, other_target) = worker(&other, MODEL);
    store(&writer, &source, b"for-other", &bytes);
    wait_written(&a, 2);
    assert_eq!(retrieve(&other_reader, &other_target, b"for-other"), None);
    assert_eq!(l2_counter(&other.status(), "corrupt"), 1);
    let plain = server(&dirs[3], &seeds, "mac", &[], &[]);
    let (plain_reader, plain_target) = worker(&plain, MODEL);
    store(&writer, &source, b"for-plain", &bytes);
    wait_written(&a, 3);
    assert_eq!(retrieve(&plain_reader, &plain_target, b"for-plain"), None);
    assert_eq!(l2_counter(&plain.status(), "corrupt"), 1);
    assert!(plain.log().contains("--l2-secret-file"), "{}", plain.log());

    // An attacker who can reach Redis but has no secret plants values under real keys:
    // a checksummed one (what a server without a secret writes), and one of the MAC
    // format with a made-up tag. Each is a miss, counted, deleted, never served.
    let mut hand = by_hand(&redis, true);
    let forged_mac = {
        let mut value = l2::ValueFormat::new(
            Some(l2::ClusterSecret::from_file_bytes("attacker", &[9u8; 32]).expect("a secret")),
            CHUNK,
        )
        .encode(
            &Namespace::new("mac").expect("ns"),
            b"whatever",
            &chunk(666, CHUNK),
        );
        value[20] ^= 1;
        value
    };
    for (n, planted) in [l2::encode(&chunk(666, CHUNK)), forged_mac]
        .into_iter()
        .enumerate()
    {
        let key = format!("planted-{n}").into_bytes();
        let name = redis_key("mac", &key);
        redis::cmd("SET")
            .arg(&name)
            .arg(&planted)
            .exec(hand.as_mut())
            .expect("SET by hand");
        assert_eq!(
            retrieve(&reader, &target, &key),
            None,
            "a planted value was served"
        );
        assert_eq!(l2_counter(&b.status(), "corrupt"), n as u64 + 1);
        wait_for("the planted key deleted", PATIENCE, || {
            let exists: bool = redis::cmd("EXISTS").arg(&name).query(hand.as_mut()).ok()?;
            (!exists).then_some(())
        });
    }
    assert_eq!(l2_counter(&b.status(), "hits"), 1);
}

#[test]
fn row_39_a_value_moved_to_another_key_is_a_miss() {
    let redis = redis(false, Security::default());
    let seeds = redis.seeds().join(",");
    let secrets = TempDir::new("move-secret");
    let secret = write_file(
        &secrets,
        "secret",
        b"0123456789abcdef0123456789abcdef-and-more",
    );
    let with_secret = ["--l2-secret-file", secret.as_str()];
    let (dir_a, dir_b) = (TempDir::new("move-a"), TempDir::new("move-b"));
    let a = server(&dir_a, &seeds, "move", &with_secret, &[]);
    let b = server(&dir_b, &seeds, "move", &with_secret, &[]);
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    store(&writer, &source, b"original", &chunk(3, CHUNK));
    store(&writer, &source, b"kept", &chunk(4, CHUNK));
    wait_written(&a, 2);
    let mut hand = by_hand(&redis, false);
    let value: Vec<u8> = redis::cmd("GET")
        .arg(redis_key("move", b"original"))
        .query(hand.as_mut())
        .expect("GET by hand");
    redis::cmd("SET")
        .arg(redis_key("move", b"copy"))
        .arg(&value)
        .exec(hand.as_mut())
        .expect("SET by hand");
    // Control: the value under its own key is served.
    assert_eq!(
        retrieve(&reader, &target, b"original"),
        Some(chunk(3, CHUNK))
    );
    assert_eq!(retrieve(&reader, &target, b"copy"), None);
    assert_eq!(l2_counter(&b.status(), "corrupt"), 1);
    // Another server's value copied over a key it does not belong to: a miss too.
    let kept: Vec<u8> = redis::cmd("GET")
        .arg(redis_key("move", b"kept"))
        .query(hand.as_mut())
        .expect("GET by hand");
    redis::cmd("SET")
        .arg(redis_key("move", b"original"))
        .arg(&kept)
        .exec(hand.as_mut())
        .expect("SET by hand");
    let c_dir = TempDir::new("move-c");
    let c = server(&c_dir, &seeds, "move", &with_secret, &[]);
    let (reader_c, target_c) = worker(&c, MODEL);
    assert_eq!(retrieve(&reader_c, &target_c, b"original"), None);
    assert_eq!(l2_counter(&c.status(), "corrupt"), 1);
}

#[test]
fn row_39_a_secret_file_shorter_than_32_bytes_is_refused_naming_it_and_its_size() {
    let dir = TempDir::new("short-secret");
    let short = write_file(&dir, "short", &[1u8; 31]);
    let socket = dir.path().join("kvwarden.sock");
    let output = Command::new(kvwarden_tests::kvwarden_bin())
        .args(["serve", "--http", "off", "--socket", path(&socket)])
        .args(["--l2", "redis://127.0.0.1:7000", "--l2-secret-file", &short])
        .stdin(Stdio::null())
        .output()
        .expect("running kvwarden serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&short) && stderr.contains("31 bytes"),
        "{stderr}"
    );
}

// ------------------------------------------------------------------ row 40: bounded reads

#[test]
fn row_40_a_64_mib_value_planted_under_a_key_is_a_miss_counted_and_deleted() {
    let redis = redis(false, Security::default());
    let seeds = redis.seeds().join(",");
    let (dir_a, dir_b) = (TempDir::new("big-a"), TempDir::new("big-b"));
    let a = server(&dir_a, &seeds, "big", &[], &[]);
    let b = server(&dir_b, &seeds, "big", &[], &[]);
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    // Control: a chunk of one slot is served.
    store(&writer, &source, b"fits", &chunk(5, CHUNK));
    wait_written(&a, 1);
    assert_eq!(retrieve(&reader, &target, b"fits"), Some(chunk(5, CHUNK)));

    // A value of 64 MiB whose header is a valid one: only its length gives it away.
    let payload = vec![0x5a; 64 << 20];
    let planted = l2::encode(&payload);
    let name = redis_key("big", b"huge");
    let mut hand = by_hand(&redis, false);
    redis::cmd("SET")
        .arg(&name)
        .arg(&planted)
        .exec(hand.as_mut())
        .expect("SET by hand");
    drop(planted);
    assert_eq!(retrieve(&reader, &target, b"huge"), None);
    let status = b.status();
    assert_eq!(l2_counter(&status, "corrupt"), 1, "{status}");
    assert_eq!(l2_counter(&status, "hits"), 1, "{status}");
    wait_for("the oversized key deleted", PATIENCE, || {
        let exists: bool = redis::cmd("EXISTS").arg(&name).query(hand.as_mut()).ok()?;
        (!exists).then_some(())
    });
    assert!(b.log().contains("longer than"), "{}", b.log());
}

// ------------------------------------------------------------------ row 41: credentials

const PASSWORD: &str = "pw-7c1f9e0b2d4a86359e1b";

#[test]
fn row_41_the_l2_password_works_from_a_file_or_the_environment_and_is_never_shown() {
    let redis = redis(
        true,
        Security {
            password: Some(PASSWORD.into()),
            tls: None,
        },
    );
    let seeds = redis.seeds().join(",");
    let files = TempDir::new("pw-files");
    let password_file = write_file(&files, "password", format!("{PASSWORD}\n").as_bytes());
    let wrong_file = write_file(&files, "wrong", b"not-the-password");
    let (dir_a, dir_b, dir_c) = (
        TempDir::new("pw-a"),
        TempDir::new("pw-b"),
        TempDir::new("pw-c"),
    );
    // Control: the password from a file (server a) and from the environment (server b).
    let a = server(
        &dir_a,
        &seeds,
        "pw",
        &["--l2-password-file", &password_file],
        &[],
    );
    let b = server(
        &dir_b,
        &seeds,
        "pw",
        &[],
        &[("KVWARDEN_L2_PASSWORD", PASSWORD)],
    );
    let (writer, source) = worker(&a, MODEL);
    let (reader, target) = worker(&b, MODEL);
    store(&writer, &source, b"authed", &chunk(6, CHUNK));
    wait_written(&a, 1);
    assert_eq!(retrieve(&reader, &target, b"authed"), Some(chunk(6, CHUNK)));

    // A wrong password is refused, with a reason that says so.
    let c = server(
        &dir_c,
        &seeds,
        "pw",
        &["--l2-password-file", &wrong_file],
        &[],
    );
    let (reader_c, target_c) = worker(&c, MODEL);
    assert_eq!(retrieve(&reader_c, &target_c, b"authed"), None);
    let status = c.wait_status("the refusal in l2.reason", |status| {
        status["l2"]["reason"].as_str().is_some()
    });
    let reason = status["l2"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("--l2-password-file"), "{status}");
    assert_eq!(l2_counter(&status, "hits"), 0);

    // Nowhere it prints: the log, /status, the status op.
    for server in [&a, &b, &c] {
        let (_, http_status) = server.http_get("/status");
        let op_status = server.status().to_string();
        for (what, text) in [
            ("the log", server.log()),
            ("/status", http_status),
            ("the status op", op_status),
        ] {
            assert!(
                !text.contains(PASSWORD),
                "{what} shows the password: {text}"
            );
            assert!(text.contains("127.0.0.1"), "{what} names the seeds: {text}");
        }
    }
}

#[test]
fn row_41_a_password_in_the_l2_url_is_refused_without_printing_it() {
    let dir = TempDir::new("pw-url");
    let socket = dir.path().join("kvwarden.sock");
    // Control: the same seed without the credential starts (and is merely unreachable).
    let control = Server::start(&dir, &["--l2", "redis://127.0.0.1:1"]);
    drop(control);
    for url in [
        format!("redis://:{PASSWORD}@127.0.0.1:7000"),
        format!("rediss://user:{PASSWORD}@127.0.0.1:7000"),
        format!("redis://127.0.0.1:7001,user:{PASSWORD}@127.0.0.1:7000"),
    ] {
        let output = Command::new(kvwarden_tests::kvwarden_bin())
            .args([
                "serve",
                "--http",
                "off",
                "--socket",
                path(&socket),
                "--l2",
                &url,
            ])
            .stdin(Stdio::null())
            .output()
            .expect("running kvwarden serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("--l2-password-file") && stderr.contains("KVWARDEN_L2_PASSWORD"),
            "{stderr}"
        );
        assert!(
            !stderr.contains(PASSWORD),
            "the error repeats the password: {stderr}"
        );
    }
}

// ------------------------------------------------------------------ row 19: SIGTERM drains L2

/// Every key under `namespace` in a plain Redis.
fn keys(redis: &harness::RedisCluster, namespace: &str) -> usize {
    let port = redis.live_ports()[0];
    redis
        .cli(port, &["--scan", "--pattern", &format!("{namespace}:*")])
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.is_empty())
        .count()
}

/// Chunks stored right before SIGTERM (within the quarter of L1's 64 slots the queue
/// may pin).
const BEFORE_SIGTERM: u64 = 12;

#[test]
fn row_19_chunks_stored_just_before_sigterm_are_in_redis_after_the_server_exits() {
    let redis = redis(false, Security::default());
    let seeds = redis.seeds().join(",");
    let dir = TempDir::new("drain");
    let server = server(&dir, &seeds, "drain", &[], &[]);
    let (writer, source) = worker(&server, MODEL);
    for n in 0..BEFORE_SIGTERM {
        store(
            &writer,
            &source,
            format!("last-{n}").as_bytes(),
            &chunk(n, CHUNK),
        );
    }
    drop(writer);
    let (exit, log) = server.terminate();
    assert!(exit.success(), "{log}");
    assert_eq!(keys(&redis, "drain"), BEFORE_SIGTERM as usize, "{log}");
    assert!(
        log.contains("L2 write-behind queue written out at shutdown"),
        "{log}"
    );
}

#[test]
fn row_19_sigterm_with_redis_stopped_counts_what_is_lost_and_exits() {
    let redis = redis(false, Security::default());
    let seeds = redis.seeds().join(",");
    let dir = TempDir::new("drain-stopped");
    let server = server(&dir, &seeds, "drop", &["--l2-timeout-ms", "1000"], &[]);
    let (writer, source) = worker(&server, MODEL);
    // Control: with Redis answering, a chunk reaches it.
    store(&writer, &source, b"before-stop", &chunk(99, CHUNK));
    wait_written(&server, 1);
    redis.stop_all();
    for n in 0..BEFORE_SIGTERM {
        store(
            &writer,
            &source,
            format!("lost-{n}").as_bytes(),
            &chunk(n, CHUNK),
        );
    }
    drop(writer);
    let (exit, log) = server.terminate();
    redis.cont_all();
    assert!(exit.success(), "{log}");
    let line = log
        .lines()
        .find(|line| line.contains("not written out at shutdown"))
        .unwrap_or_else(|| panic!("no line about the lost writes: {log}"));
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(&format!("{name}=")))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("{name}= in {line}"))
    };
    assert_eq!(field("written"), 0, "{line}");
    assert_eq!(field("failed") + field("dropped"), BEFORE_SIGTERM, "{line}");
    // The control's chunk is there; a write that timed out while Redis was stopped may
    // still land once it resumes (Redis had it in its socket buffer), so no more is said.
    assert!(keys(&redis, "drop") >= 1, "{log}");
}

#[test]
fn the_l2_trust_flags_are_explained_in_help() {
    let help = Command::new(kvwarden_tests::kvwarden_bin())
        .args(["serve", "--help"])
        .output()
        .expect("kvwarden serve --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--l2-tls-ca-file",
        "--l2-tls-cert-file",
        "--l2-tls-key-file",
        "--l2-username",
        "--l2-password-file",
        "KVWARDEN_L2_PASSWORD",
        "--l2-secret-file",
        "rediss://",
    ] {
        assert!(help.contains(flag), "--help explains {flag}: {help}");
    }
}
