//! The node's decisions, one test per rule. The eleven places where the production
//! server and the simulator's old model behaved differently are decided here once;
//! each test is named for the decision (`docs/design.md`, "The node").

mod support;

use kvwarden_core::node::{BlendChange, Job, PeerAction};
use kvwarden_core::node::{Built, ConnId, Direction, Input, Note, Output, ProcessKey};
use kvwarden_core::protocol::{BufferSpec, ErrorCode, Op, ProtocolError, RopeSpec};
use kvwarden_core::{FreeCause, Module};
use rmpv::Value;
use support::harness::{Harness, OWNER, SLOT, TCP_TOKEN, node_key, outcome, ping, register, store};
use support::{at, id};

// 1. Held REGISTERs wait on the build they joined, not on the (instance, module).
#[test]
fn decision_1_a_held_register_gets_the_outcome_of_the_build_it_joined() {
    let mut h = Harness::new(None);
    let worker = id(1);
    let first = h.send(register(worker));
    let [build_1] = h.builds()[..] else { panic!() };
    assert_eq!(
        h.ask(Op::UnregisterKvCache { instance: worker }),
        Value::from(true)
    );
    let second = h.send(register(worker));
    let [build_2] = h.builds()[..] else { panic!() };
    let third = h.send(register(worker)); // joins build 2
    assert!(
        h.builds().is_empty(),
        "a REGISTER while building starts no build"
    );

    h.build(build_1); // the first build comes back after its entry went
    assert_eq!(h.error(first), ErrorCode::NotRegistered);
    assert!(
        h.reply(third).is_none(),
        "the third REGISTER waits for build 2, not build 1"
    );
    let frees = h.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!((frees[0].0, frees[0].1), (build_1, FreeCause::Cancelled));

    h.build(build_2);
    assert_eq!(outcome(&h.answer(second)), "created");
    assert_eq!(outcome(&h.answer(third)), "refreshed");
}

#[test]
fn decision_1_waiters_of_a_failed_build_are_told_not_registered() {
    let mut h = Harness::new(None);
    let worker = id(1);
    let first = h.send(register(worker));
    let [build] = h.builds()[..] else { panic!() };
    let second = h.send(register(worker));
    h.input(Input::BuildDone {
        context: build,
        result: Err(ProtocolError::new(ErrorCode::BadArgs, "not a memfd")),
    });
    assert_eq!(h.error(first), ErrorCode::BadArgs);
    assert_eq!(h.error(second), ErrorCode::NotRegistered);
    assert!(h.node.entry(worker, Module::ServerDriven).is_none());
}

// 2. Shutdown: answer what is in flight (at most the drain), then free everything.
#[test]
fn decision_2_shutdown_answers_builds_in_flight_then_frees_every_context() {
    let mut h = Harness::new(None);
    let built = h.registered(id(1));
    let pending = h.send(register(id(2)));
    let [building] = h.builds()[..] else { panic!() };
    h.input(Input::Shutdown);
    assert!(
        h.frees().is_empty(),
        "nothing is freed while a build is in flight"
    );
    assert_eq!(h.refuse(ping(id(1))), ErrorCode::Unavailable);

    h.build(building);
    assert_eq!(
        outcome(&h.answer(pending)),
        "created",
        "the build in flight is answered"
    );
    let mut frees = h.frees();
    frees.sort_by_key(|free| free.0);
    assert_eq!(
        frees.iter().map(|f| (f.0, f.2)).collect::<Vec<_>>(),
        vec![(built, "shutdown"), (building, "shutdown")]
    );
    assert!(!h.node.is_stopped(), "waits for the frees");
}

#[test]
fn decision_2_shutdown_stops_once_the_frees_return_and_gives_up_after_the_drain() {
    let mut h = Harness::new(None);
    h.registered(id(1));
    h.send(register(id(2))); // a build that never returns
    assert_eq!(h.builds().len(), 1);
    h.input(Input::Shutdown);
    h.run_until(at(9.0));
    assert!(h.frees().is_empty());
    h.out.clear();
    h.run_until(at(10.5)); // the drain is over: free what is built
    let frees: Vec<_> = h
        .out
        .iter()
        .filter_map(|o| match o {
            Output::Job(Job::Free { free, label, .. }) => Some((*free, *label)),
            _ => None,
        })
        .collect();
    assert_eq!(frees.len(), 1);
    assert_eq!(frees[0].1, "shutdown");
    assert!(!h.node.is_stopped());
    h.input(Input::FreeDone { free: frees[0].0 });
    assert!(h.node.is_stopped());
    assert!(h.out.iter().any(|o| matches!(
        o,
        Output::Stopped {
            contexts_freed: 1,
            frees_unfinished: 0
        }
    )));
}

/// A copy still waiting for the pool when the drain ends never runs: it is answered
/// `unavailable`, and nothing starts after the shutdown (found by the fuzz target
/// node_events: a late report handed out a waiting copy after `Stopped`).
#[test]
fn decision_2_a_copy_still_waiting_for_the_pool_when_the_drain_ends_never_starts() {
    let mut h = Harness::with_pool_window(8, 1);
    let worker = id(1);
    h.registered(worker);
    let a = h.send(store(worker, b"a"));
    let b = h.send(store(worker, b"b"));
    let [(first, Direction::ToL1, 100)] = h.copies()[..] else {
        panic!("the window of one hands out the first copy only")
    };
    // Control: while the shutdown drains, a waiting copy still goes when the window
    // has room.
    let c = h.send(store(worker, b"c"));
    h.input(Input::Shutdown);
    h.copy_done(first, Ok(100));
    assert_eq!(h.answer(a), Value::from(true));
    let [(second, Direction::ToL1, 100)] = h.copies()[..] else {
        panic!("the second copy goes during the drain")
    };
    h.run_until(at(10.5)); // the drain is over, one copy running, one waiting
    let refused = h.reply(c).expect("answered").expect_err("never ran");
    assert_eq!(refused.code, ErrorCode::Unavailable);
    assert!(refused.message.contains("shut down"), "{}", refused.message);
    h.copy_done(second, Ok(100));
    assert_eq!(h.answer(b), Value::from(true));
    assert!(h.copies().is_empty(), "no copy starts after the drain");
    let frees: Vec<_> = h.take(|o| match o {
        Output::Job(Job::Free { free, .. }) => Some(*free),
        _ => None,
    });
    assert_eq!(frees.len(), 1, "the free waited for the running copy only");
    h.input(Input::FreeDone { free: frees[0] });
    assert!(h.node.is_stopped());
}

// 3. Transfers are answered after their copy.
#[test]
fn decision_3_a_store_is_answered_once_its_copy_is_done_and_only_then_published() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    let request = h.send(store(worker, b"k"));
    let [(copy, Direction::ToL1, 100)] = h.copies()[..] else {
        panic!()
    };
    assert!(h.reply(request).is_none());
    assert_eq!(
        h.node.l1_lookup(&[node_key(b"k")]),
        0,
        "not published mid-copy"
    );
    h.copy_done(copy, Ok(100));
    assert_eq!(h.answer(request), Value::from(true));
    assert_eq!(h.node.l1_lookup(&[node_key(b"k")]), 1);
    // A failed copy publishes nothing.
    let request = h.send(store(worker, b"j"));
    let [(copy, ..)] = h.copies()[..] else {
        panic!()
    };
    h.copy_done(
        copy,
        Err(ProtocolError::new(ErrorCode::Internal, "copy failed")),
    );
    assert_eq!(h.error(request), ErrorCode::Internal);
    assert_eq!(h.node.l1_lookup(&[node_key(b"j")]), 0);
}

// 4. Commits: not registered, not ready, too large.
#[test]
fn decision_4_engine_driven_commits_answer_every_state() {
    let mut h = Harness::new(None);
    let worker = id(1);
    let commit = |nbytes| Op::CommitStore {
        instance: worker,
        key: b"k".to_vec(),
        nbytes,
    };
    assert_eq!(h.refuse(commit(1)), ErrorCode::NotRegistered);
    let request = h.send(Op::RegisterEngineDriven {
        instance: worker,
        model_name: "m".into(),
        world_size: 1,
    });
    let [context] = h.builds()[..] else { panic!() };
    assert_eq!(h.refuse(commit(1)), ErrorCode::NotReady);
    h.input(Input::BuildDone {
        context,
        result: Ok(Built::EngineDriven),
    });
    assert!(matches!(
        h.out
            .iter()
            .find(|o| matches!(o, Output::Reply { request_id, .. } if *request_id == request)),
        Some(Output::Reply { pool_fd: true, .. })
    ));
    let grant = h.ask(Op::PrepareStore {
        instance: worker,
        key: b"k".to_vec(),
    });
    assert!(matches!(grant, Value::Map(_)), "{grant:?}");
    assert_eq!(h.refuse(commit(SLOT + 1)), ErrorCode::BadArgs);
    assert_eq!(
        h.ask(commit(SLOT)),
        Value::from(true),
        "the reservation was kept"
    );
    assert_eq!(
        h.ask(commit(SLOT)),
        Value::from(false),
        "nothing reserved now"
    );
}

// 5. The L1 pool is the node's: a full pool, eviction, and the per-instance cap.
#[test]
fn decision_5_a_pool_full_of_reservations_refuses_and_a_freed_instance_gives_them_back() {
    let mut h = Harness::with_slots(1, None);
    let (a, b) = (id(1), id(2));
    for worker in [a, b] {
        let request = h.send(Op::RegisterEngineDriven {
            instance: worker,
            model_name: "m".into(),
            world_size: 1,
        });
        let [context] = h.builds()[..] else { panic!() };
        h.input(Input::BuildDone {
            context,
            result: Ok(Built::EngineDriven),
        });
        h.answer(request);
    }
    let prepare = |instance, key: &[u8]| Op::PrepareStore {
        instance,
        key: key.to_vec(),
    };
    assert!(matches!(h.ask(prepare(a, b"x")), Value::Map(_)));
    assert_eq!(h.refuse(prepare(b, b"y")), ErrorCode::Overloaded);
    h.ask(Op::UnregisterEngineDriven { instance: a });
    assert_eq!(
        h.node.l1_occupancy().reserved,
        0,
        "a's reservation discarded"
    );
    assert!(matches!(h.ask(prepare(b, b"y")), Value::Map(_)));
    assert_eq!(h.node.l1_lookup(&[node_key(b"x")]), 0, "never published");
}

// 6. Blend limits and a free while computing.
#[test]
fn decision_6_rope_tables_of_an_instance_freed_while_computing_are_discarded() {
    let mut h = Harness::new(None);
    let worker = id(1);
    let rope = RopeSpec {
        rotary_dim: 4,
        max_positions: 8,
        base: 10_000.0,
    };
    let blend = |rope: &RopeSpec| Op::RegisterBlend {
        instance: worker,
        rope: rope.clone(),
    };
    assert_eq!(h.refuse(blend(&rope)), ErrorCode::NotRegistered);
    h.registered(worker);
    let too_big = RopeSpec {
        rotary_dim: 128,
        max_positions: 1 << 20,
        base: 10.0,
    };
    assert_eq!(h.refuse(blend(&too_big)), ErrorCode::BadArgs);
    let request = h.send(blend(&rope));
    let started = h.out.iter().find_map(|o| match o {
        Output::Job(Job::Blend { blend, .. }) => Some(*blend),
        _ => None,
    });
    let started = started.expect("a computation starts");
    h.ask(Op::UnregisterKvCache { instance: worker });
    h.input(Input::BlendDone {
        blend: started,
        result: Ok(()),
    });
    assert_eq!(h.error(request), ErrorCode::NotRegistered);
    assert!(
        h.out
            .contains(&Output::Blend(BlendChange::Discard { blend: started }))
    );
    assert!(
        !h.out
            .iter()
            .any(|o| matches!(o, Output::Blend(BlendChange::Keep { .. })))
    );
}

// 7. Owners, per-connection caps, and which refusals count as evidence of life.
#[test]
fn decision_7_a_forbidden_request_never_refreshes_an_overloaded_one_does() {
    let mut h = Harness::with_slots(128, None);
    let worker = id(1);
    h.registered(worker);
    h.connect(ConnId(2), Some(OWNER + 1), None);
    h.run_until(at(20.0));
    let before = h
        .node
        .entry(worker, Module::ServerDriven)
        .unwrap()
        .last_seen;
    let forbidden = h.send_on(ConnId(2), store(worker, b"k"), 0);
    assert_eq!(h.error(forbidden), ErrorCode::Forbidden);
    assert_eq!(
        h.node
            .entry(worker, Module::ServerDriven)
            .unwrap()
            .last_seen,
        before
    );

    // 64 stores in flight on one connection; the 65th is refused but is evidence.
    for n in 0..64u32 {
        h.send(store(worker, format!("k{n}").as_bytes()));
    }
    h.run_until(at(25.0));
    let refused = h.send(store(worker, b"one too many"));
    assert_eq!(h.error(refused), ErrorCode::Overloaded);
    assert_eq!(
        h.node
            .entry(worker, Module::ServerDriven)
            .unwrap()
            .last_seen,
        at(25.0)
    );
    // Another connection of the same owner is not limited by the first one's load.
    h.connect(ConnId(3), Some(OWNER), None);
    let other = h.send_on(ConnId(3), Op::Lookup { keys: vec![] }, 0);
    assert_eq!(h.answer(other), Value::from(0u64));
}

#[test]
fn decision_7_buffers_are_validated_against_what_the_frame_carried() {
    let mut h = Harness::new(None);
    let request = h.send_on(ConnId(1), register(id(1)), 0);
    assert_eq!(h.error(request), ErrorCode::BadArgs);
    let cuda = Op::RegisterKvCache {
        instance: id(1),
        buffers: vec![BufferSpec::CudaIpc {
            device: 0,
            handle: vec![0; 64],
            offset: 0,
            nbytes: 1,
        }],
        model_name: "m".into(),
        world_size: 1,
    };
    assert_eq!(h.refuse(cuda), ErrorCode::Unavailable);
    assert!(h.builds().is_empty());
    let worker = id(2);
    h.registered(worker);
    let past_end = Op::Store {
        instance: worker,
        key: b"k".to_vec(),
        buffer: 0,
        offset: (1 << 20) - 10,
        nbytes: 100,
    };
    assert_eq!(h.refuse(past_end), ErrorCode::BadArgs);
    assert!(h.copies().is_empty());
}

// 8. Input before deadlines: what was handed in before handle_timeout(now) counts.
#[test]
fn decision_8_a_ping_handed_in_before_the_timeout_call_keeps_its_worker() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    assert_eq!(h.ask(ping(worker)), Value::from(true));
    h.run_until(at(29.0));
    // The loop woke at 31 s (past the 30 s deadline) with a ping already arrived: it
    // hands the ping in first, then judges time.
    h.now = at(31.0);
    let ping = h.send(ping(worker));
    h.node.handle_timeout(h.now);
    h.drain();
    assert_eq!(h.answer(ping), Value::from(true));
    assert!(h.frees().is_empty());
    // Both directions: with no ping, the same wake reaps it.
    h.run_until(at(62.5));
    assert_eq!(h.frees().len(), 1);
}

// 9. A free waits for the copies using its context.
#[test]
fn decision_9_a_context_is_freed_only_after_its_copies_are_done() {
    let mut h = Harness::new(None);
    let worker = id(1);
    let context = h.registered(worker);
    let request = h.send(store(worker, b"k"));
    let [(copy, ..)] = h.copies()[..] else {
        panic!()
    };
    h.ask(Op::UnregisterKvCache { instance: worker });
    assert!(h.frees().is_empty(), "the copy still uses the mapping");
    h.copy_done(copy, Ok(100));
    assert_eq!(h.answer(request), Value::from(true));
    let frees = h.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!((frees[0].0, frees[0].2), (context, "unregistered"));
}

// 10. Frees take time; the watchdog reports one that never returns, once.
#[test]
fn decision_10_a_free_that_never_returns_is_reported_once_and_pings_go_on() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    h.registered(id(2));
    h.ask(Op::UnregisterKvCache { instance: worker });
    assert_eq!(h.frees().len(), 1);
    h.run_until(at(4.9));
    assert!(!h.notes().iter().any(|n| matches!(n, Note::FreeHung { .. })));
    h.run_until(at(5.1));
    let hung = h
        .notes()
        .iter()
        .filter(|n| matches!(n, Note::FreeHung { .. }))
        .count();
    assert_eq!(hung, 1);
    h.run_until(at(20.0));
    assert!(
        !h.notes().iter().any(|n| matches!(n, Note::FreeHung { .. })),
        "once"
    );
    assert_eq!(h.ask(ping(id(2))), Value::from(true));
    assert_eq!(h.node.status().frees_hung_total, 1);
    assert_eq!(h.node.status().frees_in_flight, 1);
}

// 11. Process exits: the newest registrant's process is the proof; watches go with
// the last entry.
#[test]
fn decision_11_the_newest_registrants_process_is_the_proof_of_exit() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    assert!(h.out.contains(&Output::Peer(PeerAction::Watch {
        process: ProcessKey(1),
        conn: ConnId(1)
    })));
    h.connect(ConnId(2), Some(OWNER), Some(ProcessKey(2)));
    let again = h.send_on(ConnId(2), register(worker), 1);
    assert_eq!(outcome(&h.answer(again)), "refreshed");
    assert!(h.out.contains(&Output::Peer(PeerAction::Unwatch {
        process: ProcessKey(1)
    })));
    assert!(h.out.contains(&Output::Peer(PeerAction::Watch {
        process: ProcessKey(2),
        conn: ConnId(2)
    })));
    h.input(Input::ProcessExited {
        process: ProcessKey(1),
    });
    assert!(
        h.frees().is_empty(),
        "the old process's exit proves nothing now"
    );
    h.input(Input::ProcessExited {
        process: ProcessKey(2),
    });
    let frees = h.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!(frees[0].1, FreeCause::ProcessExited);
}

#[test]
fn decision_11_an_instance_holding_nothing_is_no_longer_watched() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    h.out.clear();
    h.ask(Op::UnregisterKvCache { instance: worker });
    assert!(h.out.contains(&Output::Peer(PeerAction::Unwatch {
        process: ProcessKey(1)
    })));
    assert_eq!(h.node.status().watched_processes, 0);
}

#[test]
fn reaped_when_due_not_before_through_the_node() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    assert_eq!(h.ask(ping(worker)), Value::from(true));
    h.run_until(at(30.0));
    assert!(h.frees().is_empty(), "silence exactly T: not yet");
    h.run_until(at(31.5));
    let frees = h.frees();
    assert_eq!(frees.len(), 1);
    assert!(matches!(frees[0].1, FreeCause::Reaped { proven: true, .. }));
    assert_eq!(h.ask(ping(worker)), Value::from(false));
    assert_eq!(h.node.status().pings_answered_false_total, 1);
}

/// The value of `key` in a reply map.
fn field<'a>(map: &'a Value, key: &str) -> &'a Value {
    map.as_map()
        .and_then(|entries| entries.iter().find(|(k, _)| k.as_str() == Some(key)))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no `{key}` in {map}"))
}

fn hello(sends_fds: bool) -> Op {
    Op::Hello {
        protocol: 2,
        client: "c".into(),
        pidfd_index: None,
        sends_fds,
        token: None,
        proof: None,
        wait_ms: None,
    }
}

// A `hello` that says `sends_fds: false` has the shell read the connection without
// SCM_RIGHTS from then on (once, for good); one that does not changes nothing, and a
// memfd registration on a connection that promised no fds is refused, naming why.
#[test]
fn a_hello_without_fds_has_the_connection_read_plainly_for_good() {
    let reads_without_fds = |h: &mut Harness| {
        h.take(|output| match output {
            Output::Peer(PeerAction::ReadWithoutFds { conn }) => Some(*conn),
            _ => None,
        })
    };
    let mut h = Harness::new(None);
    let reply = h.ask(hello(true));
    assert_eq!(field(&reply, "sends_fds"), &Value::from(true));
    assert!(
        reads_without_fds(&mut h).is_empty(),
        "the default reads fds"
    );
    h.send(register(id(1)));
    assert_eq!(h.builds().len(), 1, "the memfd it carried is taken");

    let reply = h.ask(hello(false));
    assert_eq!(field(&reply, "sends_fds"), &Value::from(false));
    assert_eq!(reads_without_fds(&mut h), vec![ConnId(1)]);
    let reply = h.ask(hello(true));
    assert_eq!(
        field(&reply, "sends_fds"),
        &Value::from(false),
        "a later hello cannot take it back"
    );
    assert!(reads_without_fds(&mut h).is_empty(), "said once");
    let request = h.send_on(ConnId(1), register(id(2)), 0);
    let Some(Err(error)) = h.reply(request) else {
        panic!("a memfd registration without its fd is refused")
    };
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(
        error.message.contains("`sends_fds: false`"),
        "{}",
        error.message
    );
    assert_eq!(h.ask(ping(id(1))), Value::from(true), "pings go on");
}

#[test]
fn a_tcp_hello_without_fds_asks_the_shell_for_nothing() {
    let mut h = Harness::new(None);
    h.input(Input::Connected {
        conn: ConnId(2),
        uid: None,
        transport: kvwarden_core::node::Transport::Tcp,
        process: None,
    });
    let mut with_proof = hello(false);
    let answer = h.tcp_proof(ConnId(2), TCP_TOKEN);
    if let Op::Hello { proof, .. } = &mut with_proof {
        *proof = answer;
    }
    let request = h.send_on(ConnId(2), with_proof, 0);
    let Some(Ok(reply)) = h.reply(request) else {
        panic!("answered")
    };
    assert_eq!(
        field(&reply, "sends_fds"),
        &Value::from(false),
        "TCP carries none"
    );
    assert!(
        !h.out
            .iter()
            .any(|output| matches!(output, Output::Peer(PeerAction::ReadWithoutFds { .. }))),
        "TCP is read plainly anyway"
    );
}

// The rules of a peer's pidfd that need no kernel are the node's (`Node::hello_pidfd`):
// over the Unix socket only, once per connection, among the fds its frame carried. The
// control: the same index on a Unix connection whose frame carries the fd is adopted.
#[test]
fn a_hello_pidfd_is_taken_once_over_unix_from_the_fds_its_frame_carried() {
    let mut h = Harness::new(None);
    let unix = ConnId(1);
    assert_eq!(h.node.hello_pidfd(unix, 1, 2), Ok(Some(1)), "the control");
    let error = h.node.hello_pidfd(unix, 2, 2).unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains("it carried 2"), "{}", error.message);
    h.input(Input::PeerProcess {
        conn: unix,
        process: ProcessKey(7),
        notice: kvwarden_core::node::DeathNotice::PidfdFromPeer,
    });
    let again = h.node.hello_pidfd(unix, 0, 1).unwrap_err();
    assert!(
        again.message.contains("once per connection"),
        "{}",
        again.message
    );
    // A pidfd found by pid is no pidfd the peer sent: it may still send its own.
    let other = ConnId(3);
    h.input(Input::Connected {
        conn: other,
        uid: Some(OWNER),
        transport: kvwarden_core::node::Transport::Unix,
        process: Some((ProcessKey(8), kvwarden_core::node::DeathNotice::PidfdByPid)),
    });
    assert_eq!(h.node.hello_pidfd(other, 0, 1), Ok(Some(0)));
    let tcp = ConnId(2);
    h.input(Input::Connected {
        conn: tcp,
        uid: None,
        transport: kvwarden_core::node::Transport::Tcp,
        process: None,
    });
    let error = h.node.hello_pidfd(tcp, 0, 1).unwrap_err();
    assert!(
        error.message.contains("this connection is TCP"),
        "{}",
        error.message
    );
    // Shutting down: nothing is adopted (the hello itself is refused `unavailable`).
    h.input(Input::Shutdown);
    assert_eq!(h.node.hello_pidfd(ConnId(3), 0, 1), Ok(None));
}

/// `status` is one typed reply for every shell: the node's figures with the shell's own,
/// read back whole as a client reads it. Pings count as received, a refused one too.
#[test]
fn status_is_the_nodes_figures_with_the_shells_and_reads_back_whole() {
    use kvwarden_core::node::ShellFigures;
    use kvwarden_core::protocol::status::{GpuStatus, LimitsStatus};
    use kvwarden_core::protocol::{ReplyValue, StatusReport};
    let shell = || ShellFigures {
        server: "kvwarden test".into(),
        uptime_seconds: 2.5,
        gpu: GpuStatus::Unavailable {
            available: false,
            reason: "no CUDA driver".into(),
        },
        limits: LimitsStatus {
            open_files_soft: 1024,
            open_files_hard: 4096,
            connection_capacity: 400,
            max_connections: 7,
            closes_pending: 0,
        },
        pool: "anonymous",
        cold_reason: None,
        l2_link: None,
    };
    let pid_of = |key: ProcessKey| (key == ProcessKey(1)).then_some(4321);
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    assert_eq!(h.ask(ping(worker)), Value::from(true));
    let before = h.node.status_report(h.now, shell(), &pid_of);
    assert_eq!(before.worker_liveness.tracked_instances, 1);
    let [listed] = &before.instances[..] else {
        panic!("one instance listed: {:?}", before.instances)
    };
    assert_eq!(listed.instance_id, worker.get());
    assert_eq!(listed.tenant, format!("uid-{OWNER}"));
    assert_eq!(
        listed.watched_pid,
        Some(4321),
        "the shell's pid of its process"
    );
    assert_eq!(listed.death_noticed_by, "pidfd_by_pid");
    assert_eq!(before.instances_by_death_notice.pidfd_by_pid, 1);
    assert_eq!(
        (before.server.as_str(), before.boot_id),
        ("kvwarden test", 7)
    );
    assert_eq!(before.limits.max_connections, 7);
    assert_eq!(before.connections, 1);

    // A TCP peer without the token: its ping is refused, and counted as received.
    h.input(Input::Connected {
        conn: ConnId(5),
        uid: None,
        transport: kvwarden_core::node::Transport::Tcp,
        process: None,
    });
    h.auto_attach = false;
    let refused = h.send_on(ConnId(5), ping(worker), 0);
    assert_eq!(h.error(refused), ErrorCode::Forbidden);
    let after = h.node.status_report(h.now, shell(), &pid_of);
    let pings = |report: &StatusReport| {
        let live = &report.worker_liveness;
        (live.pings_total, live.pings_answered_false_total)
    };
    assert_eq!(pings(&after).0, pings(&before).0 + 1);
    assert_eq!(
        pings(&after).1,
        pings(&before).1,
        "refused, not answered false"
    );
    assert_eq!(after.connections, 2);

    // What a client reads back is the report; another shape is none.
    assert_eq!(StatusReport::from_value(&after.to_value()), Some(after));
    let old = Value::Map(vec![("tracked".into(), 1.into())]);
    assert_eq!(StatusReport::from_value(&old), None);
    assert_eq!(StatusReport::from_value(&Value::from(true)), None);
}
