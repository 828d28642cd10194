//! Tenants a neighbour cannot mint (issue 51, attack 3): subordinate uids count as
//! their owner (row 69), and a tenant made for a uid that holds nothing is forgotten
//! (row 70). Real `kvwarden serve`, real processes under other uids (forked and
//! setuid: the tests run as root); counts and states only, never durations.

use kvwarden::memfd;
use kvwarden_tests::{RawClient, Server, TempDir, fork_as_uid, memfd_spec};
use rmpv::Value;
use rustix::fd::AsFd;
use serde_json::json;
use std::path::Path;

/// The victim, outside every subordinate range.
const BOB: u32 = 1002;
/// The owner of the subordinate range 200000..265535.
const ALICE: u32 = 1001;
/// The first of Alice's subordinate uids.
const FIRST_SUBUID: u32 = 200_000;
/// Bytes of a chunk (a slot: `--slot-bytes 64K`, 64 slots in `--l1-bytes 4M`).
const CHUNK: u64 = 64 << 10;

/// Registers `instance` with one memfd of `chunks` chunks over a new attached
/// connection, and stores `chunks` chunks under `key-<n>`; returns the connection (or
/// None when the server refused it) and how many were stored.
fn store_chunks(socket: &Path, instance: u64, chunks: u64) -> Option<(RawClient, u64)> {
    let mut raw = RawClient::connect(socket).ok()?;
    raw.attach_with(instance, &kvwarden_tests::instance_secret(instance))
        .ok()?
        .result
        .ok()?;
    let fd = memfd::create("tenants", chunks * CHUNK).expect("a memfd");
    let args = vec![
        instance.into(),
        Value::Array(vec![memfd_spec(0, chunks * CHUNK)]),
        "m".into(),
        1.into(),
    ];
    raw.request_with_fds("register_kv_cache", args, &[fd.as_fd()])
        .ok()?
        .result
        .ok()?;
    let mut stored = 0;
    for n in 0..chunks {
        let args = vec![
            instance.into(),
            Value::Binary(format!("key-{n}").into_bytes()),
            0.into(),
            (n * CHUNK).into(),
            CHUNK.into(),
        ];
        if raw.request("store", args).ok()?.result == Ok(Value::Boolean(true)) {
            stored += 1;
        }
    }
    Some((raw, stored))
}

/// How many of `key-0..key-<chunks>` `raw`'s tenant still finds in L1.
fn hits(raw: &mut RawClient, chunks: u64) -> u64 {
    (0..chunks)
        .filter(|n| {
            let keys = vec![Value::Array(vec![Value::Binary(
                format!("key-{n}").into_bytes(),
            )])];
            raw.request("lookup", keys)
                .ok()
                .and_then(|reply| reply.result.ok())
                == Some(Value::from(1u64))
        })
        .count() as u64
}

fn tenant_names(server: &Server) -> Vec<String> {
    server.status()["tenants"]
        .as_array()
        .map(|tenants| {
            tenants
                .iter()
                .filter_map(|tenant| tenant["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Row 69: 40 subordinate uids of uid 1001 (`--subuid-file`), each storing 4 chunks
/// and holding its connection, are one tenant, `uid-1001`: uid 1002's 10 chunks still
/// hit 10 of 10 (before, 41 tenants split the 64 slots and its hits fell to 0 of 10),
/// and the subordinate uids together hold uid 1001's share of `--max-connections 40`,
/// not 40 places. Control: uid 1002's 10 of 10 before them.
#[test]
fn row_69_subordinate_uids_count_as_their_owner() {
    let dir = TempDir::new("row69-subuids");
    let subuids = dir.path().join("subuid");
    std::fs::write(&subuids, format!("{ALICE}:{FIRST_SUBUID}:65536\n")).unwrap();
    let server = Server::start(
        &dir,
        &[
            "--socket-mode",
            "666",
            "--max-connections",
            "40",
            "--subuid-file",
            subuids.to_str().unwrap(),
        ],
    );
    let socket = server.socket.clone();
    // The victim stores 10 chunks and keeps its connection; control: all 10 hit.
    let victim_socket = socket.clone();
    let mut victim = fork_as_uid(BOB, move |parent| {
        let (mut raw, stored) = store_chunks(&victim_socket, 6901, 10).expect("served");
        parent.send(json!([stored, hits(&mut raw, 10)]));
        assert_eq!(parent.recv(), json!("again"));
        parent.send(json!(hits(&mut raw, 10)));
        json!(null)
    });
    assert_eq!(victim.recv("the victim's control"), json!([10, 10]));
    // (The status connection is root's from here on: it holds one of the 40 places.)
    assert!(tenant_names(&server).contains(&format!("uid-{BOB}")));

    // 40 subordinate uids, each its own process, 4 chunks each, connections held.
    let mut neighbours: Vec<_> = (0..40u32)
        .map(|n| {
            let socket = socket.clone();
            fork_as_uid(FIRST_SUBUID + n, move |parent| {
                let held = store_chunks(&socket, 7000 + u64::from(n), 4);
                parent.send(json!(
                    held.as_ref().map_or(-1, |(_, stored)| *stored as i64)
                ));
                let _ = parent.recv(); // holds its connection until the parent is done
                json!(null)
            })
        })
        .collect();
    let outcomes: Vec<i64> = neighbours
        .iter_mut()
        .map(|n| n.recv("a subordinate uid's stores").as_i64().unwrap())
        .collect();
    let served = outcomes.iter().filter(|&&o| o >= 0).count();
    let names = tenant_names(&server);
    let subuid_tenants = names
        .iter()
        .filter(|name| name.starts_with("uid-2"))
        .count();

    victim.send(json!("again"));
    let after = victim.recv("the victim's hits after");
    victim.finish("the victim");
    for mut neighbour in neighbours {
        neighbour.send(json!("done"));
        neighbour.finish("a subordinate uid");
    }
    assert_eq!(
        subuid_tenants, 0,
        "no tenant of a subordinate uid: {names:?}"
    );
    assert!(names.contains(&format!("uid-{ALICE}")), "{names:?}");
    assert_eq!(
        after,
        json!(10),
        "the victim's chunks all hit under 40 subuids"
    );
    // Root's status connection and the victim's hold 2 of 40: uid 1001's share is
    // three quarters of the 38 left.
    assert_eq!(
        served, 28,
        "the subuids hold their owner's share: {outcomes:?}"
    );
}

/// Row 70: uids that come and go leave no tenant behind. 20 uids (3000..3019) each
/// connect, are served a `lookup` and leave; afterwards none of their tenants is
/// tracked, while uid 1002, which holds a chunk (its connection closed), keeps its
/// tenant and its chunk hits when it comes back. Before, every uid that ever connected
/// stayed a tenant until a restart, and 65,536 of them left every new uid `forbidden`.
#[test]
fn row_70_uids_that_come_and_go_leave_no_tenant_behind() {
    let dir = TempDir::new("row70-expiry");
    let server = Server::start(&dir, &["--socket-mode", "666"]);
    let socket = server.socket.clone();
    // Control: uid 1002 stores a chunk and leaves; it holds the chunk.
    let keeper = socket.clone();
    let stored = kvwarden_tests::run_as_uid(BOB, "uid 1002 stores", move || {
        let (_, stored) = store_chunks(&keeper, 7001, 1).expect("served");
        json!(stored)
    });
    assert_eq!(stored, json!(1));
    for uid in 3000..3020u32 {
        let socket = socket.clone();
        let served = kvwarden_tests::run_as_uid(uid, "a passing uid", move || {
            let mut raw = RawClient::connect(&socket).expect("connecting");
            let reply = raw
                .request("lookup", vec![Value::Array(vec![])])
                .expect("a reply");
            json!(reply.result == Ok(Value::from(0u64)))
        });
        assert_eq!(served, json!(true), "uid {uid} is served");
    }
    let names = kvwarden_tests::wait_for(
        "the passing uids' tenants forgotten",
        kvwarden_tests::PATIENCE,
        || {
            let names = tenant_names(&server);
            (!names.iter().any(|name| name.starts_with("uid-30"))).then_some(names)
        },
    );
    assert!(
        names.contains(&format!("uid-{BOB}")),
        "a tenant holding a chunk is kept: {names:?}"
    );
    // Its L1 gauges go with a forgotten tenant: uid 3100's are scraped while it is
    // connected, and gone once it left.
    let metrics = |server: &Server| server.http_get("/metrics").1;
    let passing = socket.clone();
    let mut lingering = kvwarden_tests::fork_as_uid(3100, move |parent| {
        let mut raw = RawClient::connect(&passing).expect("connecting");
        let reply = raw
            .request("lookup", vec![Value::Array(vec![])])
            .expect("a reply");
        parent.send(json!(reply.result.is_ok()));
        let _ = parent.recv(); // holds its connection until the parent has scraped
        json!(null)
    });
    assert_eq!(lingering.recv("uid 3100 served"), json!(true));
    assert!(
        metrics(&server).contains("tenant=\"uid-3100\""),
        "its gauges while it is here"
    );
    lingering.send(json!("go"));
    lingering.finish("uid 3100");
    kvwarden_tests::wait_for("uid 3100's gauges gone", kvwarden_tests::PATIENCE, || {
        (!metrics(&server).contains("tenant=\"uid-3100\"")).then_some(())
    });
    assert!(metrics(&server).contains(&format!("tenant=\"uid-{BOB}\"")));
    let keeper = socket.clone();
    let hit = kvwarden_tests::run_as_uid(BOB, "uid 1002 comes back", move || {
        let mut raw = RawClient::connect_attached(&keeper, 7001);
        json!(hits(&mut raw, 1))
    });
    assert_eq!(hit, json!(1), "its chunk still hits");
}
