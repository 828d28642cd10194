//! Who is who, decided by the node (rows 30–36): an instance is a capability proven
//! per connection, a TCP peer is nobody without its token, a tenant's keys are its
//! own, engine-driven is for trusted tenants, and a retrieve copies exactly the length
//! it asked for. Each refusal is shown next to a control: the same request by the
//! rightful peer, answered.

mod support;

use kvwarden_core::Module;
use kvwarden_core::node::{ConnId, Direction, Input, Transport};
use kvwarden_core::protocol::{ErrorCode, Op, RetrieveItem};
use rmpv::Value;
use support::harness::{
    Harness, OWNER, TCP_TOKEN, node_key, outcome, ping, register, secret_of, store,
};
use support::{at, id};

fn attach(instance: kvwarden_core::InstanceId, secret: Vec<u8>) -> Op {
    Op::Attach { instance, secret }
}

fn retrieve(instance: kvwarden_core::InstanceId, key: &[u8], nbytes: u64) -> Op {
    Op::Retrieve {
        instance,
        key: key.to_vec(),
        buffer: 0,
        offset: 4096,
        nbytes,
    }
}

fn hello(proof: Option<Vec<u8>>, token: Option<&[u8]>) -> Op {
    Op::Hello {
        protocol: kvwarden_core::protocol::PROTOCOL_VERSION,
        client: "test".into(),
        pidfd_index: None,
        sends_fds: true,
        token: token.map(<[u8]>::to_vec),
        proof,
        wait_ms: None,
    }
}

fn last_seen(h: &Harness, instance: kvwarden_core::InstanceId) -> kvwarden_core::Instant {
    h.node
        .entry(instance, Module::ServerDriven)
        .expect("the victim is registered")
        .last_seen
}

/// Row 30: a connection of the owner's own uid (here also the server's uid) that did
/// not attach the instance names it: every request is `forbidden`, nothing is
/// refreshed or changed. Control: the same connection's requests for the instance it
/// did attach are served.
#[test]
fn row_30_a_connection_that_did_not_attach_an_instance_is_forbidden_and_refreshes_nothing() {
    let mut h = Harness::new(None);
    let victim = id(1);
    h.registered(victim);
    h.stored(victim, b"victim-chunk");
    h.run_until(at(10.0));
    let before = last_seen(&h, victim);

    let impostor = ConnId(2);
    h.connect(impostor, Some(OWNER), None);
    h.auto_attach = false;
    // Control: its own instance, attached, registered and pinged.
    let own = id(2);
    let claimed = h.send_on(impostor, attach(own, secret_of(own)), 0);
    assert_eq!(outcome(&h.answer(claimed)), "claimed");
    let request = h.send_on(impostor, register(own), 1);
    let [context] = h.builds()[..] else {
        panic!("one build")
    };
    h.build(context);
    assert_eq!(outcome(&h.answer(request)), "created");
    let pong = h.send_on(impostor, ping(own), 0);
    assert_eq!(h.answer(pong), Value::from(true));

    // The attack: the victim's id, read from status.
    for op in [
        ping(victim),
        Op::UnregisterKvCache { instance: victim },
        store(victim, b"stolen"),
        retrieve(victim, b"victim-chunk", 100),
        Op::RetrieveBatch {
            instance: victim,
            items: vec![RetrieveItem {
                key: b"victim-chunk".to_vec(),
                buffer: 0,
                offset: 0,
                nbytes: 100,
            }],
        },
        register(victim),
    ] {
        let name = op.name();
        let request = h.send_on(impostor, op, 1);
        assert_eq!(h.error(request), ErrorCode::Forbidden, "{name}");
    }
    assert!(
        h.copies().is_empty(),
        "no byte of the victim's buffer moved"
    );
    assert!(h.builds().is_empty(), "nothing built for the victim's id");
    assert_eq!(last_seen(&h, victim), before, "nothing refreshed");
    assert_eq!(h.node.status().forbidden_total, 6);
    // The victim goes on.
    let pong = h.send(ping(victim));
    assert_eq!(h.answer(pong), Value::from(true));
}

/// Row 31: `attach` with another secret is `forbidden` (counted); the right secret on
/// a second connection proves the instance (a worker's reconnect).
#[test]
fn row_31_an_attach_with_another_secret_is_forbidden_and_the_right_one_proves() {
    let mut h = Harness::new(None);
    let victim = id(1);
    h.registered(victim);
    h.connect(ConnId(2), Some(OWNER), None);
    h.auto_attach = false;
    let wrong = h.send_on(ConnId(2), attach(victim, vec![0xAA; 32]), 0);
    assert_eq!(h.error(wrong), ErrorCode::Forbidden);
    let pong = h.send_on(ConnId(2), ping(victim), 0);
    assert_eq!(h.error(pong), ErrorCode::Forbidden, "still not attached");
    // Control: the worker itself, reconnected.
    let right = h.send_on(ConnId(2), attach(victim, secret_of(victim)), 0);
    assert_eq!(outcome(&h.answer(right)), "proven");
    let pong = h.send_on(ConnId(2), ping(victim), 0);
    assert_eq!(h.answer(pong), Value::from(true));
    // Another uid with the right secret is still refused: the uid is a second layer.
    h.connect(ConnId(3), Some(OWNER + 1), None);
    let other = h.send_on(ConnId(3), attach(victim, secret_of(victim)), 0);
    assert_eq!(h.error(other), ErrorCode::Forbidden);
}

/// Row 31: an id nobody holds (no entry, no connection attached) is free again: a
/// squatter may claim it, and the victim's later attach is refused, so the victim
/// draws a fresh id (the clients do) and registers one context under it.
#[test]
fn row_31_a_squatted_id_costs_the_victim_a_fresh_id_and_nothing_else() {
    let mut h = Harness::new(None);
    let victim = id(1);
    h.registered(victim);
    let gone = h.send(Op::UnregisterKvCache { instance: victim });
    assert_eq!(h.answer(gone), Value::from(true));
    h.input(Input::Disconnected { conn: ConnId(1) });
    assert_eq!(h.node.status().bound_instances, 0, "nothing holds the id");

    h.connect(ConnId(2), Some(OWNER), None);
    h.auto_attach = false;
    let squat = h.send_on(ConnId(2), attach(victim, vec![0x55; 32]), 0);
    assert_eq!(outcome(&h.answer(squat)), "claimed");

    h.connect(ConnId(1), Some(OWNER), None);
    let refused = h.send_on(ConnId(1), attach(victim, secret_of(victim)), 0);
    assert_eq!(h.error(refused), ErrorCode::Forbidden);
    let fresh = id(77);
    let claimed = h.send_on(ConnId(1), attach(fresh, secret_of(fresh)), 0);
    assert_eq!(outcome(&h.answer(claimed)), "claimed");
    let request = h.send_on(ConnId(1), register(fresh), 1);
    let [context] = h.builds()[..] else {
        panic!("exactly one context for the fresh id")
    };
    h.build(context);
    assert_eq!(outcome(&h.answer(request)), "created");
}

/// Rows 6–11 with the capability in place: a reaped worker's connection still holds
/// its proof, its ping is answered `false` and its REGISTER builds exactly one context.
#[test]
fn a_reaped_worker_re_registers_with_one_context_and_its_proof_in_place() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    let pong = h.send(ping(worker));
    assert_eq!(h.answer(pong), Value::from(true));
    h.run_until(at(40.0)); // silent past T = 30 s: reaped
    assert!(h.node.entry(worker, Module::ServerDriven).is_none());
    let pong = h.send(ping(worker));
    assert_eq!(
        h.answer(pong),
        Value::from(false),
        "re-register, not forbidden"
    );
    let request = h.send(register(worker));
    let [context] = h.builds()[..] else {
        panic!("exactly one context")
    };
    assert!(h.reply(request).is_none(), "answered once built");
    h.build(context);
    assert_eq!(outcome(&h.answer(request)), "created");
    let pong = h.send(ping(worker));
    assert_eq!(h.answer(pong), Value::from(true));
}

/// Row 32 (and 65): a TCP peer is nobody until its `hello` proves the token: before
/// it, with no proof, with another token, with a guessed proof, or with the token itself
/// in `hello` (protocol 2's way, refused naming the change), everything is `forbidden`.
#[test]
fn row_32_a_tcp_peer_without_the_token_is_answered_forbidden_to_everything() {
    let mut h = Harness::new(None);
    let tcp = |h: &mut Harness, conn| {
        h.input(Input::Connected {
            conn,
            uid: None,
            transport: Transport::Tcp,
            process: None,
        });
        conn
    };
    let (bare, wrong, guess, old, good) = (
        tcp(&mut h, ConnId(5)),
        tcp(&mut h, ConnId(6)),
        tcp(&mut h, ConnId(7)),
        tcp(&mut h, ConnId(8)),
        tcp(&mut h, ConnId(9)),
    );
    h.auto_attach = false;
    let instance = id(9);
    let refused_everything = |h: &mut Harness, conn| {
        let status = h.send_on(conn, Op::Status, 0);
        assert_eq!(h.error(status), ErrorCode::Forbidden);
        let claim = h.send_on(conn, attach(instance, secret_of(instance)), 0);
        assert_eq!(h.error(claim), ErrorCode::Forbidden);
        let lookup = h.send_on(conn, Op::Lookup { keys: vec![] }, 0);
        assert_eq!(h.error(lookup), ErrorCode::Forbidden);
    };
    refused_everything(&mut h, bare);
    let request = h.send_on(bare, hello(None, None), 0);
    assert_eq!(h.error(request), ErrorCode::Forbidden);
    refused_everything(&mut h, bare);
    // Another token: its key id is none of the server's.
    assert_eq!(h.tcp_proof(wrong, b"0123456789abcdef-not-it"), None);
    let request = h.send_on(wrong, hello(Some(vec![0; 32]), None), 0);
    assert_eq!(h.error(request), ErrorCode::Forbidden);
    refused_everything(&mut h, wrong);
    // The right key id, a proof made without the token.
    let proof = h.tcp_proof(guess, TCP_TOKEN).expect("challenged");
    let mut guessed = proof.clone();
    guessed[0] ^= 1;
    let request = h.send_on(guess, hello(Some(guessed), None), 0);
    assert_eq!(h.error(request), ErrorCode::Forbidden);
    refused_everything(&mut h, guess);
    // The token itself in `hello`, even beside a good proof.
    let proof_old = h.tcp_proof(old, TCP_TOKEN).expect("challenged");
    let request = h.send_on(old, hello(Some(proof_old), Some(TCP_TOKEN)), 0);
    let Some(Err(error)) = h.reply(request) else {
        panic!("refused")
    };
    assert_eq!(error.code, ErrorCode::Forbidden);
    assert!(
        error.message.contains("takes no token"),
        "{}",
        error.message
    );
    refused_everything(&mut h, old);
    // A proof seen on another connection proves nothing here.
    h.tcp_proof(good, TCP_TOKEN).expect("challenged");
    let request = h.send_on(good, hello(Some(proof), None), 0);
    assert_eq!(h.error(request), ErrorCode::Forbidden);
    // Control: a fresh connection's proof, then the same requests are served.
    let tcp = tcp(&mut h, ConnId(10));
    let proof = h.tcp_proof(tcp, TCP_TOKEN).expect("challenged");
    let good = h.send_on(tcp, hello(Some(proof), None), 0);
    let reply = h.answer(good);
    let tenant = reply
        .as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("tenant")))
        .map(|(_, v)| v.clone());
    assert_eq!(tenant, Some(Value::from("tcp")));
    let claim = h.send_on(tcp, attach(instance, secret_of(instance)), 0);
    assert_eq!(outcome(&h.answer(claim)), "claimed");
    let lookup = h.send_on(tcp, Op::Lookup { keys: vec![] }, 0);
    assert_eq!(h.answer(lookup), Value::from(0u64));
}

/// Row 33: tenants' keys are their own. Another uid's retrieve and lookup of the
/// victim's key miss, and its store of the same key is its own chunk; the victim reads
/// its own bytes. Control: the victim's own lookup and retrieve hit.
#[test]
fn row_33_another_tenant_neither_reads_nor_poisons_a_tenants_key() {
    let mut h = Harness::new(None);
    let victim = id(1);
    h.registered(victim);
    h.stored(victim, b"prefix");
    let lookup = h.send(Op::Lookup {
        keys: vec![b"prefix".to_vec()],
    });
    assert_eq!(
        h.answer(lookup),
        Value::from(1u64),
        "control: the victim's own"
    );

    let neighbour = ConnId(2);
    h.connect(neighbour, Some(OWNER + 1), None);
    let other = id(2);
    let request = h.send_on(neighbour, register(other), 1);
    let [context] = h.builds()[..] else {
        panic!("one build")
    };
    h.build(context);
    assert_eq!(outcome(&h.answer(request)), "created");
    let lookup = h.send_on(
        neighbour,
        Op::Lookup {
            keys: vec![b"prefix".to_vec()],
        },
        0,
    );
    assert_eq!(
        h.answer(lookup),
        Value::from(0u64),
        "not seen by another tenant"
    );
    let miss = h.send_on(neighbour, retrieve(other, b"prefix", 100), 0);
    assert_eq!(h.answer(miss), Value::Nil);
    assert!(h.copies().is_empty(), "nothing copied to the neighbour");
    // Its store of the same key is a chunk of its own, copied into its own slot.
    let poison = h.send_on(neighbour, store(other, b"prefix"), 0);
    let [(copy, Direction::ToL1, 100)] = h.copies()[..] else {
        panic!("the neighbour's own copy")
    };
    h.copy_done(copy, Ok(100));
    assert_eq!(h.answer(poison), Value::from(true));
    assert_eq!(h.node.l1_lookup(&[node_key(b"prefix")]), 1);
    let tenants = h.node.status().tenants;
    let used = |name: &str| {
        tenants
            .iter()
            .find(|t| t.view.name == name)
            .map(|t| t.slots_used)
    };
    assert_eq!(used("uid-1000"), Some(1));
    assert_eq!(used("uid-1001"), Some(1), "two chunks, one per tenant");
}

/// Row 35: engine-driven maps the whole pool, so only trusted tenants may register it.
#[test]
fn row_35_an_untrusted_tenant_may_not_register_engine_driven() {
    let mut h = Harness::new(None);
    h.connect(ConnId(2), Some(OWNER + 1), None);
    let request = h.send_on(
        ConnId(2),
        Op::RegisterEngineDriven {
            instance: id(2),
            model_name: "m".into(),
            world_size: 1,
        },
        0,
    );
    let Some(Err(error)) = h.reply(request) else {
        panic!("refused")
    };
    assert_eq!(error.code, ErrorCode::Forbidden);
    assert!(error.message.contains("uid-1001"), "{}", error.message);
    assert!(error.message.contains("engine-driven"), "{}", error.message);
    assert!(h.builds().is_empty());
    // Control: the server's own uid's tenant (the owner here) may.
    h.engine_registered(id(1));
    assert!(h.node.entry(id(1), Module::EngineDriven).is_some());
}

/// Row 36: a stored value of another length than the retrieve's destination is a
/// miss, counted, and no copy starts, for a single retrieve and a batch item alike.
/// Control: the right length is copied.
#[test]
fn row_36_a_value_of_another_length_is_a_miss_and_nothing_is_copied() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"block"); // 100 bytes
    for wanted in [50, 4096] {
        let request = h.send(retrieve(worker, b"block", wanted));
        assert_eq!(h.answer(request), Value::Nil, "wanted {wanted}");
    }
    let batch = h.send(Op::RetrieveBatch {
        instance: worker,
        items: vec![RetrieveItem {
            key: b"block".to_vec(),
            buffer: 0,
            offset: 0,
            nbytes: 64,
        }],
    });
    assert_eq!(h.answer(batch), Value::Array(vec![Value::Nil]));
    assert!(h.copies().is_empty(), "not one byte written");
    assert_eq!(h.node.status().retrieve_length_mismatches, 3);
    let request = h.send(retrieve(worker, b"block", 100));
    let [(copy, Direction::FromL1, 100)] = h.copies()[..] else {
        panic!("the right length is copied")
    };
    h.copy_done(copy, Ok(100));
    assert_eq!(h.answer(request), Value::from(100u64));
    // A destination past the buffer's end is refused before anything is pinned.
    let past = h.send(Op::Retrieve {
        instance: worker,
        key: b"block".to_vec(),
        buffer: 0,
        offset: (1 << 20) - 50,
        nbytes: 100,
    });
    assert_eq!(h.error(past), ErrorCode::BadArgs);
}
