//! CacheBlend rope state: `register_blend` computes an instance's RoPE tables on the
//! server; they are held while the instance has any entry and dropped with its last
//! one (unregister, reap, process exit), never while it lives.

mod engine_support;

use engine_support::{EngineWorker, Helper, rope};
use kvwarden_core::protocol::ErrorCode;
use kvwarden_tests::{RawClient, Server, TempDir, find_instance};
use rmpv::Value;
use serde_json::Value as Json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Bytes of `rope(64, 1024, ..)`: 1024 positions × 32 pairs × (cos + sin) × 4 bytes.
const HELPER_TABLE_BYTES: u64 = 1024 * 64 * 4;

/// The helper process of the process-exit path (a no-op when run as a test).
#[test]
fn helper_process_blend_worker() {
    engine_support::run_helper_if_asked();
}

fn blend_bytes(status: &Json, instance: u64) -> Option<u64> {
    find_instance(status, instance).and_then(|entry| entry["blend_bytes"].as_u64())
}

fn total_blend_bytes(status: &Json) -> u64 {
    status["blend"]["bytes_total"]
        .as_u64()
        .expect("blend.bytes_total")
}

fn register_kv(raw: &mut RawClient, instance: u64) {
    let reply = raw
        .request(
            "register_kv_cache",
            vec![instance.into(), Value::Array(vec![]), "m".into(), 1.into()],
        )
        .unwrap();
    reply.result.expect("register_kv_cache");
}

fn register_blend(
    raw: &mut RawClient,
    instance: u64,
    rope: Value,
) -> Result<Value, kvwarden_core::protocol::ProtocolError> {
    raw.request("register_blend", vec![instance.into(), rope])
        .unwrap()
        .result
}

/// Pings `instances` every 200 ms from a thread until dropped: live workers whose
/// state must never be taken (T is 2 s in tests).
struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(server: &Server, instances: Vec<u64>) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let mut raw = RawClient::connect(&server.socket).unwrap();
        for &instance in &instances {
            raw.attach(instance);
        }
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                for &instance in &instances {
                    let _ = raw.request("ping", vec![instance.into()]);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Heartbeat {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn blend_state_dropped_after_unregister_reap_and_process_exit() {
    let dir = TempDir::new("blend-drop");
    let server = Server::start(&dir, &[]);
    let mut raw = RawClient::connect(&server.socket).unwrap();
    // This connection acts on every instance below but 403 and 404 (each connection
    // attaches what it names: protocol 2).
    for instance in [401, 402, 405] {
        raw.attach(instance);
    }

    // A live instance whose state must survive everything below, and one registered
    // in both modules.
    register_kv(&mut raw, 401);
    register_kv(&mut raw, 405);
    let mut both = EngineWorker::register(&server.socket, 405);
    let _heartbeat = Heartbeat::start(&server, vec![401, 405]);
    for instance in [401, 405] {
        assert_eq!(
            register_blend(&mut raw, instance, rope(64, 1024, 10_000.0)),
            Ok(true.into())
        );
    }

    // Unregister.
    let mut unregistering = EngineWorker::register(&server.socket, 402);
    assert_eq!(
        register_blend(&mut raw, 402, rope(64, 1024, 10_000.0)),
        Ok(true.into())
    );
    let status = server.status();
    assert_eq!(blend_bytes(&status, 402), Some(HELPER_TABLE_BYTES));
    assert_eq!(total_blend_bytes(&status), 3 * HELPER_TABLE_BYTES);
    assert_eq!(status["blend"]["instances"], 3);
    let reply = unregistering.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    server.wait_status("402's rope tables dropped", |s| {
        find_instance(s, 402).is_none() && total_blend_bytes(s) == 2 * HELPER_TABLE_BYTES
    });

    // Reap: registered, pinged once, then silent past the reap timeout.
    let mut silent = RawClient::connect_attached(&server.socket, 403);
    register_kv(&mut silent, 403);
    assert_eq!(
        silent.request("ping", vec![403.into()]).unwrap().result,
        Ok(true.into())
    );
    assert_eq!(
        register_blend(&mut silent, 403, rope(64, 1024, 10_000.0)),
        Ok(true.into())
    );
    assert_eq!(blend_bytes(&server.status(), 403), Some(HELPER_TABLE_BYTES));
    server.wait_status("403 reaped with its rope tables", |s| {
        find_instance(s, 403).is_none() && total_blend_bytes(s) == 2 * HELPER_TABLE_BYTES
    });
    assert!(server.log().contains("reaped"));

    // Process exit: the worker process is SIGKILLed.
    let helper = Helper::spawn(
        "helper_process_blend_worker",
        &server.socket,
        404,
        "kv,blend",
    );
    server.wait_status("404 holds its rope tables", |s| {
        blend_bytes(s, 404) == Some(HELPER_TABLE_BYTES)
            && total_blend_bytes(s) == 3 * HELPER_TABLE_BYTES
    });
    helper.kill();
    server.wait_status("404 freed by its process exit, rope tables dropped", |s| {
        find_instance(s, 404).is_none() && total_blend_bytes(s) == 2 * HELPER_TABLE_BYTES
    });

    // The other direction: a live instance keeps its state, and an instance keeps it
    // while any of its entries lives.
    let reply = both.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let status = server.status();
    assert_eq!(
        blend_bytes(&status, 405),
        Some(HELPER_TABLE_BYTES),
        "{status}"
    );
    assert_eq!(
        blend_bytes(&status, 401),
        Some(HELPER_TABLE_BYTES),
        "{status}"
    );
    let reply = raw
        .request("unregister_kv_cache", vec![405.into()])
        .unwrap();
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let status = server.wait_status("405's last entry gone with its tables", |s| {
        find_instance(s, 405).is_none() && total_blend_bytes(s) == HELPER_TABLE_BYTES
    });
    assert_eq!(blend_bytes(&status, 401), Some(HELPER_TABLE_BYTES));
    assert_eq!(status["blend"]["instances"], 1);
}

#[test]
fn register_blend_checks_its_parameters_and_needs_a_registration() {
    let dir = TempDir::new("blend-args");
    let server = Server::start(&dir, &[]);
    let mut raw = RawClient::connect(&server.socket).unwrap();
    let error = register_blend(&mut raw, 410, rope(64, 1024, 10_000.0)).unwrap_err();
    assert_eq!(error.code, ErrorCode::Forbidden, "not attached: {error}");
    assert!(error.message.contains("attach"), "{}", error.message);
    raw.attach(410);
    let error = register_blend(&mut raw, 410, rope(64, 1024, 10_000.0)).unwrap_err();
    assert_eq!(error.code, ErrorCode::NotRegistered, "{error}");
    assert!(error.message.contains("410"), "{}", error.message);
    assert!(
        server.instance(410).is_none(),
        "register_blend creates no entry"
    );

    register_kv(&mut raw, 410);
    for (bad, words) in [
        (rope(7, 1024, 10_000.0), "rotary_dim 7"),
        (rope(0, 1024, 10_000.0), "rotary_dim 0"),
        (rope(64, 0, 10_000.0), "max_positions 0"),
        (rope(64, 1024, 1.0), "base 1"),
        (rope(64, 1024, f64::NAN), "base NaN"),
        (rope(128, 1 << 20, 10_000.0), "268435456 bytes"),
    ] {
        let error = register_blend(&mut raw, 410, bad).unwrap_err();
        assert_eq!(error.code, ErrorCode::BadArgs, "{words}: {error}");
        assert!(error.message.contains(words), "{words}: {}", error.message);
    }
    assert_eq!(
        total_blend_bytes(&server.status()),
        0,
        "nothing held after refusals"
    );

    // Registered: held, reported in status and in /metrics; the same parameters again
    // compute nothing new, other ones replace the tables.
    assert_eq!(
        register_blend(&mut raw, 410, rope(128, 4096, 10_000.0)),
        Ok(true.into())
    );
    assert_eq!(
        register_blend(&mut raw, 410, rope(128, 4096, 10_000.0)),
        Ok(true.into())
    );
    let status = server.status();
    assert_eq!(blend_bytes(&status, 410), Some(2 << 20));
    assert_eq!(total_blend_bytes(&status), 2 << 20);
    let metrics = server.http_get("/metrics").1;
    assert!(
        metrics.contains("kvwarden_blend_bytes 2097152"),
        "{metrics}"
    );
    assert!(metrics.contains("kvwarden_blend_instances 1"), "{metrics}");
    assert_eq!(
        register_blend(&mut raw, 410, rope(64, 1024, 500_000.0)),
        Ok(true.into())
    );
    assert_eq!(total_blend_bytes(&server.status()), HELPER_TABLE_BYTES);
}
