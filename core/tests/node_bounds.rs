//! What one peer may make the node hold or run, decided by the node (issue 25): each
//! limit shown next to its control, the same request within the limit, served.

mod support;

use kvwarden_core::node::admission::{Admission, ConnectionLimits, Holder, Refused};
use kvwarden_core::node::blend::{MAX_TABLE_BYTES, MAX_TENANT_BYTES, MAX_TOTAL_BYTES};
use kvwarden_core::node::{ConnId, Input, MAX_IN_FLIGHT_PER_CONNECTION, Output, Transport};
use kvwarden_core::node::{Job, PeerAction};
use kvwarden_core::protocol::{ErrorCode, Op, RopeSpec};
use support::harness::{Harness, OWNER, TCP_TOKEN, register};
use support::{at, id};

fn l2_config() -> kvwarden_core::node::l2::L2NodeConfig {
    kvwarden_core::node::l2::L2NodeConfig {
        timeout: std::time::Duration::from_secs(5),
        write_queue_bytes: 1 << 20,
        health: kvwarden_core::l2::L2HealthConfig::default(),
    }
}

/// Rope parameters whose tables take exactly [`MAX_TABLE_BYTES`] (256 MiB).
fn largest_rope() -> RopeSpec {
    RopeSpec {
        rotary_dim: 128,
        max_positions: MAX_TABLE_BYTES / 128 / 4,
        base: 10_000.0,
    }
}

/// Registers `instance` on `conn` (server-driven) and builds its context.
fn registered_on(h: &mut Harness, conn: ConnId, instance: kvwarden_core::InstanceId) {
    let request = h.send_on(conn, register(instance), 1);
    let [context] = h.builds()[..] else {
        panic!("one build")
    };
    h.build(context);
    let _ = h.answer(request);
}

/// `register_blend` of the largest tables for `instance` on `conn`; the computation
/// finishes at once. Returns the reply's error code, or None when it was served.
fn blend(h: &mut Harness, conn: ConnId, instance: kvwarden_core::InstanceId) -> Option<ErrorCode> {
    let request = h.send_on(
        conn,
        Op::RegisterBlend {
            instance,
            rope: largest_rope(),
        },
        0,
    );
    let started = h.take(|output| match output {
        Output::Job(Job::Blend { blend, .. }) => Some(*blend),
        _ => None,
    });
    if let [started] = started[..] {
        h.input(kvwarden_core::node::Input::BlendDone {
            blend: started,
            result: Ok(()),
        });
    }
    match h.reply(request) {
        Some(Ok(_)) => None,
        Some(Err(error)) => {
            assert!(
                error.message.contains("share") || error.message.contains("limit"),
                "{}",
                error.message
            );
            Some(error.code)
        }
        None => panic!("register_blend answered"),
    }
}

/// Row 47: one tenant's rope tables stay within its share (three quarters of the
/// server's budget): its fourth 256 MiB table set is `overloaded`, while another
/// tenant's first is served (the control) — and all of them stay within the server's
/// 1 GiB, fitted to the DaemonSet's memory.
#[test]
fn row_47_one_tenants_rope_tables_stay_within_its_share_and_another_tenant_is_served() {
    assert_eq!(MAX_TOTAL_BYTES, 1 << 30);
    assert_eq!(MAX_TENANT_BYTES, 768 << 20);
    let mut h = Harness::with_slots(64, None);
    let owner = ConnId(1);
    let other = ConnId(2);
    h.connect(other, Some(OWNER + 1), None);
    for n in 1..=4 {
        registered_on(&mut h, owner, id(n));
    }
    registered_on(&mut h, other, id(10));
    // Three of the owner's: 768 MiB, its share.
    for n in 1..=3 {
        assert_eq!(blend(&mut h, owner, id(n)), None, "instance {n}");
    }
    // The fourth would take it past its share.
    assert_eq!(blend(&mut h, owner, id(4)), Some(ErrorCode::Overloaded));
    // Another tenant's is served: the quarter kept for the others.
    assert_eq!(blend(&mut h, other, id(10)), None);
    assert_eq!(h.node.status().blend.0, 4 * MAX_TABLE_BYTES);
    // The same parameters again compute nothing and count once.
    assert_eq!(blend(&mut h, owner, id(1)), None);
}

/// Row 46: a `lookup` whose keys go on to L2 runs as a job and counts in the
/// connection's cap: with 64 of them waiting on L2, the 65th is `overloaded` (the
/// control: the first 64 were taken); one answered makes room again.
#[test]
fn row_46_lookups_waiting_on_l2_count_in_the_connections_cap() {
    let mut h = Harness::new(Some(l2_config()));
    let keys = vec![b"not-in-l1".to_vec()];
    let mut requests = Vec::new();
    for _ in 0..MAX_IN_FLIGHT_PER_CONNECTION {
        requests.push(h.send(Op::Lookup { keys: keys.clone() }));
    }
    let reads = h.l2_exists();
    assert_eq!(
        reads.len(),
        MAX_IN_FLIGHT_PER_CONNECTION,
        "all 64 went to L2"
    );
    assert!(requests.iter().all(|&request| h.reply(request).is_none()));
    let refused = h.send(Op::Lookup { keys: keys.clone() });
    assert_eq!(h.error(refused), ErrorCode::Overloaded);
    assert!(h.l2_exists().is_empty(), "the 65th asked L2 nothing");
    // A lookup L1 answers alone needs no job: served at once.
    assert_eq!(h.ask(Op::Lookup { keys: vec![] }), rmpv::Value::from(0u64));
    let (read, _) = reads[0].clone();
    h.input(kvwarden_core::node::Input::L2Existed {
        read,
        presence: kvwarden_core::node::l2::L2Presence::Present(0),
    });
    assert!(h.reply(requests[0]).is_some());
    let again = h.send(Op::Lookup { keys });
    assert!(h.reply(again).is_none(), "taken: it waits on L2");
    assert_eq!(h.l2_exists().len(), 1);
}

/// Row 44, the rule itself: one uid stops at its share, others connect up to the bound.
#[test]
fn row_44_a_uid_stops_at_its_share_of_the_connections() {
    let mut admission = Admission::new(ConnectionLimits::new(8, None, None));
    for _ in 0..6 {
        assert_eq!(admission.admits(Some(1001)), Ok(()));
        admission.connected(Holder::Uid(1001));
    }
    assert!(matches!(
        admission.admits(Some(1001)),
        Err(Refused::UidShare { per_uid: 6, .. })
    ));
    assert_eq!(
        admission.admits(Some(0)),
        Ok(()),
        "the control: another uid"
    );
}

/// Row 67: TCP peers that have not authenticated hold an eighth of the bound together
/// (5 of 40): a sixth has the oldest closed, never itself, so a flood of them can keep
/// neither a worker about to prove its token nor any uid out; a peer that proves its
/// token leaves their share for its tenant's.
#[test]
fn row_67_tokenless_tcp_peers_hold_only_their_share() {
    let limits = ConnectionLimits::new(40, None, None);
    let mut h = Harness::with_limits(4, None, limits);
    let tcp = |h: &mut Harness, conn| {
        assert_eq!(h.node.admits(None), Ok(()));
        h.input(Input::Connected {
            conn,
            uid: None,
            transport: Transport::Tcp,
            process: None,
        });
    };
    for conn in 2..7 {
        tcp(&mut h, ConnId(conn));
    }
    assert!(disconnects(&mut h).is_empty(), "within their share");
    tcp(&mut h, ConnId(7));
    assert_eq!(
        disconnects(&mut h),
        vec![ConnId(2)],
        "the oldest makes room"
    );
    h.input(Input::Disconnected { conn: ConnId(2) });
    assert_eq!(h.node.admits(Some(1001)), Ok(()), "the control: a uid");
    // The newest proves the token: it stays, and leaves the strangers' share.
    let proof = h.tcp_proof(ConnId(7), TCP_TOKEN);
    let welcome = h.send_raw(ConnId(7), hello(proof), 0);
    assert!(h.reply(welcome).is_some_and(|reply| reply.is_ok()));
    tcp(&mut h, ConnId(8));
    assert!(
        disconnects(&mut h).is_empty(),
        "a stranger's place came free"
    );
    // One mid-handshake (its `auth` answered) goes after the others.
    h.tcp_proof(ConnId(3), TCP_TOKEN).expect("challenged");
    tcp(&mut h, ConnId(9));
    assert_eq!(
        disconnects(&mut h),
        vec![ConnId(4)],
        "not the one mid-handshake"
    );
}

fn hello(proof: Option<Vec<u8>>) -> Op {
    Op::Hello {
        protocol: kvwarden_core::protocol::PROTOCOL_VERSION,
        client: "test".into(),
        pidfd_index: None,
        sends_fds: false,
        token: None,
        proof,
        wait_ms: None,
    }
}

fn disconnects(h: &mut Harness) -> Vec<ConnId> {
    h.take(|output| match output {
        Output::Peer(PeerAction::Disconnect { conn, .. }) => Some(*conn),
        _ => None,
    })
}

/// Row 44, TCP: a peer that connects and never presents the token (or sends a
/// refused request and goes quiet) is cut at the deadline, so it cannot hold one of
/// the TCP share's places for good; the control, a peer that presents it late but
/// before the deadline, is never cut.
#[test]
fn row_44_a_tcp_peer_that_never_presents_the_token_is_cut_at_its_deadline() {
    let limits = ConnectionLimits::new(100, None, Some(std::time::Duration::from_secs(10)));
    let mut h = Harness::with_limits(4, None, limits);
    let (quiet, refused, late) = (ConnId(2), ConnId(3), ConnId(4));
    for conn in [quiet, refused, late] {
        h.input(Input::Connected {
            conn,
            uid: None,
            transport: Transport::Tcp,
            process: None,
        });
    }
    let refusal = h.send_raw(refused, hello(None), 0);
    assert_eq!(h.error(refusal), ErrorCode::Forbidden);
    h.run_until(at(9.0));
    let proof = h.tcp_proof(late, TCP_TOKEN);
    let welcome = h.send_raw(late, hello(proof), 0);
    assert!(h.reply(welcome).is_some_and(|reply| reply.is_ok()));
    assert!(disconnects(&mut h).is_empty(), "nobody before the deadline");
    h.run_until(at(10.0));
    let mut cut = disconnects(&mut h);
    cut.sort();
    assert_eq!(
        cut,
        vec![quiet, refused],
        "the two that never authenticated"
    );
    h.run_until(at(60.0));
    assert!(
        disconnects(&mut h).is_empty(),
        "each once; the authenticated one never"
    );
}

// ------------------------------------------------------------------ row 57

/// REGISTER `instance` server-driven with one memfd buffer of `nbytes`.
fn register_bytes(instance: kvwarden_core::InstanceId, nbytes: u64) -> Op {
    Op::RegisterKvCache {
        instance,
        buffers: vec![kvwarden_core::protocol::BufferSpec::Memfd {
            fd_index: 0,
            nbytes,
        }],
        model_name: "m".into(),
        world_size: 1,
    }
}

/// Row 57: the bytes of peers' memfds the server maps are capped per registration,
/// per tenant and in all, each cap shown next to its control (the same registration
/// within it, built); a refused registration leaves no entry and starts no build, and
/// a freed context gives its bytes back.
#[test]
fn row_57_mapped_bytes_are_capped_per_instance_per_tenant_and_in_all() {
    use kvwarden_core::node::mapped::MappedLimits;
    const MIB: u64 = 1 << 20;
    let mut h = Harness::with_mapped(MappedLimits::new(4 * MIB, Some(3 * MIB), Some(2 * MIB)));
    let neighbour = ConnId(2);
    h.connect(neighbour, Some(OWNER + 1), None);
    let created = |h: &mut Harness, conn: ConnId, instance: u64, nbytes: u64| {
        let request = h.send_on(conn, register_bytes(id(instance), nbytes), 1);
        let [context] = h.builds()[..] else {
            panic!("instance {instance}: one build")
        };
        h.build(context);
        let _ = h.answer(request);
        context
    };
    let refused = |h: &mut Harness, conn: ConnId, instance: u64, nbytes: u64| {
        let request = h.send_on(conn, register_bytes(id(instance), nbytes), 1);
        assert!(h.builds().is_empty(), "instance {instance}: nothing built");
        let code = h.error(request);
        assert!(
            h.node
                .status()
                .instances
                .iter()
                .all(|v| v.instance != id(instance)),
            "instance {instance}: no entry left behind"
        );
        code
    };
    // Per registration: 2 MiB is built (the control), 2 MiB and a byte never is.
    let first = created(&mut h, ConnId(1), 1, 2 * MIB);
    assert_eq!(
        refused(&mut h, ConnId(1), 2, 2 * MIB + 1),
        ErrorCode::BadArgs
    );
    // Per tenant: 1 MiB more fits the owner's 3 MiB, a byte more does not ...
    created(&mut h, ConnId(1), 3, MIB);
    assert_eq!(refused(&mut h, ConnId(1), 4, 1), ErrorCode::Overloaded);
    // ... while the neighbour's tenant still registers, up to the total of 4 MiB.
    created(&mut h, neighbour, 5, MIB);
    assert_eq!(refused(&mut h, neighbour, 6, 1), ErrorCode::Overloaded);
    let status = h.node.status();
    assert_eq!(status.mapped_bytes, 4 * MIB);
    assert_eq!(status.mapped_refused_total, 3);
    let owner_tenant = status
        .tenants
        .iter()
        .find(|t| t.view.name == format!("uid-{OWNER}"))
        .expect("the owner's tenant");
    assert_eq!(owner_tenant.mapped_bytes, 3 * MIB);
    // Unregistering gives the bytes back: the neighbour's second registration fits now.
    let request = h.send(Op::UnregisterKvCache { instance: id(1) });
    assert_eq!(h.answer(request), rmpv::Value::from(true));
    assert!(h.frees().iter().any(|(context, _, _)| *context == first));
    assert_eq!(h.node.status().mapped_bytes, 2 * MIB);
    created(&mut h, neighbour, 6, MIB);
    assert_eq!(h.node.status().mapped_bytes, 3 * MIB);
}

/// Row 57: a build that fails gives its bytes back.
#[test]
fn row_57_a_failed_build_gives_its_mapped_bytes_back() {
    use kvwarden_core::node::mapped::MappedLimits;
    let mut h = Harness::with_mapped(MappedLimits::new(1 << 20, Some(1 << 20), None));
    let request = h.send(register_bytes(id(1), 1 << 20));
    let [context] = h.builds()[..] else {
        panic!("one build")
    };
    assert_eq!(
        h.node.status().mapped_bytes,
        1 << 20,
        "counted from the build on"
    );
    h.input(Input::BuildDone {
        context,
        result: Err(kvwarden_core::protocol::ProtocolError::new(
            ErrorCode::BadArgs,
            "not a memfd".to_string(),
        )),
    });
    assert_eq!(h.error(request), ErrorCode::BadArgs);
    assert_eq!(h.node.status().mapped_bytes, 0);
    h.registered(id(2));
}

/// A `retrieve_batch` of `count` items, each the 100 bytes under `key`.
fn retrieve_batch(instance: kvwarden_core::InstanceId, key: &[u8], count: usize) -> Op {
    let item = kvwarden_core::protocol::RetrieveItem {
        key: key.to_vec(),
        buffer: 0,
        offset: 0,
        nbytes: 100,
    };
    Op::RetrieveBatch {
        instance,
        items: vec![item; count],
    }
}

/// The victim's bytes: 64, so that its copies stand out among the flood's 100.
const VICTIMS: u64 = 64;

/// A `store` or `retrieve` of [`VICTIMS`] bytes under `key`.
fn victims(instance: kvwarden_core::InstanceId, key: &[u8], store: bool) -> Op {
    let key = key.to_vec();
    let (buffer, offset, nbytes) = (0, 0, VICTIMS);
    if store {
        Op::Store {
            instance,
            key,
            buffer,
            offset,
            nbytes,
        }
    } else {
        Op::Retrieve {
            instance,
            key,
            buffer,
            offset,
            nbytes,
        }
    }
}

/// Completes the oldest of `running` and returns the copies handed out since.
fn complete_oldest(
    h: &mut Harness,
    running: &mut Vec<kvwarden_core::node::CopyId>,
) -> Vec<(kvwarden_core::node::CopyId, u64)> {
    let copy = running.remove(0);
    h.copy_done(copy, Ok(100));
    let handed: Vec<_> = h
        .copies()
        .into_iter()
        .map(|(copy, _, n)| (copy, n))
        .collect();
    running.extend(handed.iter().map(|&(copy, _)| copy));
    handed
}

/// Row 68: one tenant's thousands of copies wait their turn at the pool. With a pool
/// window of 2, another tenant's `retrieve` is handed out after at most the two copies
/// running when it came (the flood's turn comes first, then the victim's), while more
/// than 2,000 of the flood's copies still wait; before, the node handed every copy to
/// the pool's one FIFO at once, and the victim's came after all of them. A connection's
/// in-flight limit counts items: a third batch past two full ones is refused.
#[test]
fn row_68_one_tenants_copies_wait_their_turn_and_another_tenant_is_served() {
    const VICTIM: u32 = 2000;
    let mut h = Harness::with_pool_window(8, 2);
    let (flooder, victim) = (id(1), id(2));
    h.registered(flooder);
    h.stored(flooder, b"f");
    h.connect(ConnId(2), Some(VICTIM), None);
    registered_on(&mut h, ConnId(2), victim);
    let store = h.send_on(ConnId(2), victims(victim, b"v", true), 0);
    let [(copy, _, VICTIMS)] = h.copies()[..] else {
        panic!("the victim's store copies at once")
    };
    h.copy_done(copy, Ok(VICTIMS));
    assert_eq!(h.answer(store), rmpv::Value::from(true));

    // Control: with nothing else running, the victim's retrieve is handed out at once.
    let control = h.send_on(ConnId(2), victims(victim, b"v", false), 0);
    let [(copy, _, VICTIMS)] = h.copies()[..] else {
        panic!("the control's copy is handed out at once")
    };
    h.copy_done(copy, Ok(VICTIMS));
    assert_eq!(h.answer(control), rmpv::Value::from(VICTIMS));

    // The flood: two full batches, the connection's whole item allowance (2,048).
    let floods = [
        h.send_on(ConnId(1), retrieve_batch(flooder, b"f", 1024), 0),
        h.send_on(ConnId(1), retrieve_batch(flooder, b"f", 1024), 0),
    ];
    let mut running: Vec<_> = h.copies().into_iter().map(|(copy, ..)| copy).collect();
    assert_eq!(running.len(), 2, "the window holds the rest back");
    assert_eq!(h.node.status().pool_waiting, 2048 - 2);
    // Past the items allowance: refused, naming it (by requests it would have room).
    let third = h.send_on(ConnId(1), retrieve_batch(flooder, b"f", 1), 0);
    let refused = h.reply(third).expect("answered").expect_err("refused");
    assert_eq!(refused.code, ErrorCode::Overloaded);
    assert!(
        refused.message.contains("2048 items"),
        "{}",
        refused.message
    );

    // The victim asks while 2,046 copies wait: handed out after two of them end.
    let asked = h.send_on(ConnId(2), victims(victim, b"v", false), 0);
    assert!(h.copies().is_empty(), "the window is full");
    let mut ended_before = 0;
    let victim_copy = loop {
        assert!(ended_before < 3, "the victim's copy waits at most its turn");
        let handed = complete_oldest(&mut h, &mut running);
        ended_before += 1;
        if let Some(&(copy, _)) = handed.iter().find(|&&(_, n)| n == VICTIMS) {
            break copy;
        }
    };
    assert_eq!(ended_before, 2, "the flood's turn, then the victim's");
    h.copy_done(victim_copy, Ok(VICTIMS));
    assert_eq!(h.reply(asked), Some(Ok(rmpv::Value::from(VICTIMS))));
    assert!(h.node.status().pool_waiting > 2000, "the flood still waits");
    assert!(floods.iter().all(|&flood| h.reply(flood).is_none()));
}

/// The names of the tenants the node tracks.
fn tenant_names(h: &Harness) -> Vec<String> {
    h.node
        .status()
        .tenants
        .into_iter()
        .map(|tenant| tenant.view.name)
        .collect()
}

/// Row 69: subordinate uids count as their owner. Uid 1001 owns 200000..265535: 40 of
/// them connect as one tenant, `uid-1001` (before, 40 tenants, each diluting the
/// others' fair share of L1), and hold its share of the connections together (15 of
/// 20); uid 1002, outside the range, still connects (the control), and an operator's
/// tenant naming a subordinate uid itself keeps it.
#[test]
fn row_69_subordinate_uids_count_as_their_owner() {
    use kvwarden_core::node::trust::{SubuidRange, TenantSpec};
    let mut h = Harness::adjusted(8, |config| {
        config.trust.subuids = vec![SubuidRange {
            owner: 1001,
            start: 200_000,
            count: 65_536,
        }];
        config.trust.tenants.push(TenantSpec {
            name: "named".into(),
            uids: vec![200_007],
            tokens: vec![],
            quota_percent: None,
            engine_driven: false,
        });
        config.connections = ConnectionLimits::new(20, None, None);
    });
    let before = tenant_names(&h).len();
    // Control: uid 1002 is a tenant of its own.
    assert_eq!(h.node.admits(Some(1002)), Ok(()));
    h.connect(ConnId(2), Some(1002), None);
    assert!(tenant_names(&h).contains(&"uid-1002".to_string()));
    // 40 subordinate uids of 1001 (200007 aside: the operator named it).
    let mut admitted = 0;
    for (n, uid) in (200_000..200_041).filter(|&uid| uid != 200_007).enumerate() {
        if h.node.admits(Some(uid)).is_ok() {
            h.connect(ConnId(100 + n as u64), Some(uid), None);
            admitted += 1;
        } else {
            let refused = h.node.admits(Some(uid)).unwrap_err();
            assert!(
                matches!(refused, Refused::UidShare { uid: 1001, .. }),
                "counted as their owner: {refused}"
            );
        }
    }
    let names = tenant_names(&h);
    assert_eq!(
        names.len(),
        before + 2,
        "uid-1002 and uid-1001 only: {names:?}"
    );
    assert!(names.contains(&"uid-1001".to_string()));
    // Root's connection 1 and uid 1002's hold 2: 1001 takes three quarters of the 18
    // places they leave, 13, not 40.
    assert_eq!(admitted, 13);
    // The operator's tenant keeps the subordinate uid it names.
    assert_eq!(h.node.admits(Some(200_007)), Ok(()));
    h.connect(ConnId(99), Some(200_007), None);
    assert_eq!(
        tenant_names(&h).len(),
        before + 2,
        "named is the operator's, known"
    );
}

/// Row 70: a tenant made for a uid that holds nothing is forgotten, so uids that came
/// and went never use up the tenants (before, 65,536 one-time uids left every new uid
/// `forbidden` until a restart). With a bound of 4 tenants (the server's own and the
/// TCP tenant among them): uids connect and leave one after another, and a new uid is
/// still served; one holding a connection, or an L1 chunk, is kept, and its chunk
/// stays readable.
#[test]
fn row_70_tenants_that_hold_nothing_are_forgotten() {
    let mut h = Harness::adjusted(8, |config| config.trust.max_tenants = Some(4));
    let lookup = |h: &mut Harness, conn: u64| {
        let request = h.send_on(ConnId(conn), Op::Lookup { keys: vec![] }, 0);
        h.reply(request)
    };
    // Control: OWNER's worker stores a chunk (its tenant holds a slot).
    let owner = id(1);
    h.registered(owner);
    h.stored(owner, b"kept");
    // Uids 3000.. come and go, one at a time: each is served, then leaves.
    for uid in 3000..3020u32 {
        let conn = 10 + u64::from(uid);
        h.connect(ConnId(conn), Some(uid), None);
        assert_eq!(
            lookup(&mut h, conn),
            Some(Ok(rmpv::Value::from(0u64))),
            "uid {uid} is served"
        );
        h.input(Input::Disconnected { conn: ConnId(conn) });
    }
    assert!(
        !tenant_names(&h)
            .iter()
            .any(|name| name.starts_with("uid-30")),
        "those that left hold nothing: forgotten"
    );
    // One stays connected: kept; the bound (4: OWNER's, the TCP tenant, this one and
    // one more) then still has room for one new uid at a time.
    h.connect(ConnId(5000), Some(4000), None);
    h.connect(ConnId(5001), Some(4001), None);
    assert_eq!(lookup(&mut h, 5001), Some(Ok(rmpv::Value::from(0u64))));
    // Full: a fifth uid finds no tenant while every one holds something ...
    h.connect(ConnId(5002), Some(4002), None);
    let refused = lookup(&mut h, 5002)
        .expect("answered")
        .expect_err("no tenant");
    assert_eq!(refused.code, ErrorCode::Forbidden);
    assert!(
        refused.message.contains("tracks 4 tenants"),
        "{}",
        refused.message
    );
    h.input(Input::Disconnected { conn: ConnId(5002) });
    // ... until one lets go; the one still connected is kept, and OWNER's chunk too.
    h.input(Input::Disconnected { conn: ConnId(5001) });
    h.connect(ConnId(5003), Some(4003), None);
    assert_eq!(lookup(&mut h, 5003), Some(Ok(rmpv::Value::from(0u64))));
    let names = tenant_names(&h);
    assert!(names.contains(&"uid-4000".to_string()), "{names:?}");
    assert!(names.contains(&format!("uid-{OWNER}")), "{names:?}");
    let request = h.send(Op::Lookup {
        keys: vec![b"kept".to_vec()],
    });
    assert_eq!(h.reply(request), Some(Ok(rmpv::Value::from(1u64))));
}
