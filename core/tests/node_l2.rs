//! The node's L2 decisions (`failure-modes.md` rows 27–29), one test per rule, with a
//! shell that answers L2 outputs by hand (or never, for a hung store).

mod support;

use kvwarden_core::InstanceId;
use kvwarden_core::l2::{L2HealthConfig, L2State, WriteOutcome};
use kvwarden_core::node::l2::{L2Fetched, L2NodeConfig, L2Presence, PROBE_KEY};
use kvwarden_core::node::{ConnId, Direction, Input, Note, ProcessKey};
use kvwarden_core::protocol::{
    ErrorCode, KvEvents, KvTier, Op, ProtocolError, ReplyValue, RetrieveItem,
};
use rmpv::Value;
use std::time::Duration;
use support::harness::{Harness, node_key, ping, store};
use support::id;

const TIMEOUT: Duration = Duration::from_millis(50);
const HEADER: u64 = kvwarden_core::l2::HEADER_BYTES as u64;

fn l2_config(write_queue_bytes: u64) -> L2NodeConfig {
    L2NodeConfig {
        timeout: TIMEOUT,
        write_queue_bytes,
        health: L2HealthConfig {
            failures_to_open: 3,
            probe_backoff: Duration::from_secs(1),
            probe_backoff_max: Duration::from_secs(8),
        },
    }
}

/// `retrieve` of `key` into offset 4096 of buffer 0, `nbytes` wanted.
fn retrieve(instance: InstanceId, key: &[u8], nbytes: u64) -> Op {
    Op::Retrieve {
        instance,
        key: key.to_vec(),
        buffer: 0,
        offset: 4096,
        nbytes,
    }
}

#[test]
fn without_l2_no_l2_output_is_ever_produced() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"a");
    assert_eq!(h.ask(retrieve(worker, b"missing", 300)), Value::Nil);
    assert_eq!(
        h.ask(Op::Lookup {
            keys: vec![b"a".to_vec(), b"b".to_vec()]
        }),
        Value::from(1u64)
    );
    h.run_for(Duration::from_secs(5));
    assert_eq!(h.l2_outputs(), 0);
    assert!(h.node.status().l2.is_none());
}

#[test]
fn row_29_a_completed_store_is_written_behind_with_its_slot_pinned_until_written() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(store(worker, b"k"));
    assert!(h.l2_writes().is_empty(), "nothing is written mid-copy");
    let [(copy, ..)] = h.copies()[..] else {
        panic!()
    };
    h.copy_done(copy, Ok(100));
    assert_eq!(h.answer(request), Value::from(true));
    let [(write, ref key, _, 100)] = h.l2_writes()[..] else {
        panic!("one write behind")
    };
    assert_eq!(key, b"k");
    assert_eq!(h.node.l1_occupancy().pinned, 1, "kept from eviction");
    assert_eq!(h.counters().queue_bytes, 100 + HEADER);
    h.input(Input::L2Written {
        write,
        outcome: WriteOutcome::Written,
    });
    assert_eq!(h.node.l1_occupancy().pinned, 0);
    assert_eq!(h.counters().writes, 1);
    assert_eq!(h.counters().queue_bytes, 0);
}

#[test]
fn row_29_a_store_cut_short_never_reaches_l2() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(store(worker, b"k"));
    let [(copy, ..)] = h.copies()[..] else {
        panic!()
    };
    h.copy_done(
        copy,
        Err(ProtocolError::new(ErrorCode::Internal, "cut short")),
    );
    assert!(h.reply(request).is_some());
    assert!(h.l2_writes().is_empty());
}

#[test]
fn row_29_an_engine_driven_reservation_never_committed_never_reaches_l2() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.engine_registered(worker);
    let grant = h.ask(Op::PrepareStore {
        instance: worker,
        key: b"unpublished".to_vec(),
    });
    assert!(matches!(grant, Value::Map(_)));
    // The worker dies with its reservation prepared.
    h.input(Input::ProcessExited {
        process: ProcessKey(1),
    });
    h.run_for(Duration::from_secs(1));
    assert!(h.l2_writes().is_empty(), "an unpublished reservation");
    // A committed one is published, and only then written.
    let worker = id(2);
    h.engine_registered(worker);
    let _ = h.ask(Op::PrepareStore {
        instance: worker,
        key: b"published".to_vec(),
    });
    assert!(h.l2_writes().is_empty());
    let committed = h.ask(Op::CommitStore {
        instance: worker,
        key: b"published".to_vec(),
        nbytes: 64,
    });
    assert_eq!(committed, Value::from(true));
    let [(_, ref key, _, 64)] = h.l2_writes()[..] else {
        panic!("one write behind")
    };
    assert_eq!(key, b"published");
}

#[test]
fn row_27_a_full_write_queue_drops_and_counts_and_never_blocks() {
    let mut h = Harness::new(Some(l2_config(100 + HEADER)));
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"a");
    h.stored(worker, b"b");
    assert_eq!(h.l2_writes().len(), 1, "the second did not fit");
    assert_eq!(h.counters().write_drops, 1);
    assert_eq!(
        h.node.l1_occupancy().pinned,
        1,
        "a dropped write pins nothing"
    );
}

#[test]
fn row_27_a_backlog_of_writes_behind_never_leaves_a_store_without_a_slot() {
    // 8 slots, a queue that would hold every write: L2 never answers. Without the
    // share bound, small chunks would pin all 8 slots and the 9th store answer false.
    let mut h = Harness::with_slots(8, Some(l2_config(1 << 30)));
    let worker = id(1);
    h.registered(worker);
    let most = 8 / kvwarden_core::node::l2::WRITE_BEHIND_SLOTS_SHARE;
    for n in 0..20u32 {
        h.stored(worker, format!("chunk-{n}").as_bytes());
    }
    let writes = h.l2_writes();
    assert_eq!(
        writes.len(),
        most,
        "write-behind pins at most its share of L1"
    );
    assert_eq!(h.counters().write_drops, 20 - most as u64);
    assert_eq!(h.node.l1_occupancy().pinned, most);
    // A write that ends gives its place back: the next published chunk goes out again.
    let (write, ..) = writes[0];
    h.input(Input::L2Written {
        write,
        outcome: WriteOutcome::Written,
    });
    h.stored(worker, b"after");
    let [(_, key, ..)] = &h.l2_writes()[..] else {
        panic!("one more write behind")
    };
    assert_eq!(key, b"after");
    assert_eq!(h.counters().write_drops, 20 - most as u64);
}

#[test]
fn row_27_an_l1_miss_reads_through_and_a_hit_is_promoted_then_served() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(retrieve(worker, b"remote", 300));
    assert!(h.reply(request).is_none(), "waits for L2");
    let [(read, ref key, _slot)] = h.l2_gets()[..] else {
        panic!("one L2 read")
    };
    assert_eq!(key, b"remote");
    assert_eq!(
        h.node.l1_occupancy().reserved,
        1,
        "a slot waits for the hit"
    );
    h.l2_got(read, L2Fetched::Hit { nbytes: 300 });
    assert_eq!(h.node.l1_lookup(&[node_key(b"remote")]), 1, "promoted");
    let [(copy, Direction::FromL1, 300)] = h.copies()[..] else {
        panic!("served from L1 as usual")
    };
    h.copy_done(copy, Ok(300));
    assert_eq!(h.answer(request), Value::from(300u64));
    assert_eq!(h.counters().hits, 1);
    // Now in L1: no second read.
    let request = h.send(retrieve(worker, b"remote", 300));
    assert!(h.l2_gets().is_empty());
    let [(copy, ..)] = h.copies()[..] else {
        panic!()
    };
    h.copy_done(copy, Ok(300));
    assert_eq!(h.answer(request), Value::from(300u64));
}

#[test]
fn row_27_an_l2_miss_answers_as_today_and_gives_the_slot_back() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(retrieve(worker, b"nowhere", 300));
    let read = h.l2_get();
    h.l2_got(read, L2Fetched::Absent);
    assert_eq!(h.answer(request), Value::Nil);
    assert_eq!(h.node.l1_occupancy().reserved, 0);
    assert_eq!(h.counters().misses, 1);
}

#[test]
fn row_27_a_read_through_past_the_timeout_is_given_up_with_the_shell_then_a_miss() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(retrieve(worker, b"slow", 300));
    let read = h.l2_get();
    h.run_for(TIMEOUT);
    assert_eq!(h.l2_cancels(), vec![read], "given up at its deadline");
    assert!(
        h.reply(request).is_none(),
        "not answered before the shell says whether it delivered"
    );
    h.run_for(TIMEOUT);
    assert!(h.l2_cancels().is_empty(), "given up once");
    assert!(h.reply(request).is_none());
    h.l2_got(read, L2Fetched::TimedOut);
    assert_eq!(h.answer(request), Value::Nil, "a miss");
    assert_eq!((h.counters().timeouts, h.counters().hits), (1, 0));
    assert_eq!(h.node.l1_occupancy().reserved, 0, "the slot given back");
    assert_eq!(h.node.l1_lookup(&[node_key(b"slow")]), 0);
}

#[test]
fn row_27_a_cancel_that_lost_to_a_delivery_serves_the_delivered_hit() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(retrieve(worker, b"late", 10));
    let read = h.l2_get();
    h.run_for(TIMEOUT);
    assert_eq!(h.l2_cancels(), vec![read]);
    // The hit was being placed when the cancel came: the buffer holds it.
    h.l2_got(read, L2Fetched::Delivered { nbytes: 10 });
    assert_eq!(h.answer(request), Value::from(10u64));
    assert!(h.copies().is_empty(), "delivered: nothing left to copy");
    assert_eq!((h.counters().timeouts, h.counters().hits), (0, 1));
    assert_eq!(h.node.l1_lookup(&[node_key(b"late")]), 1, "promoted");
    assert_eq!(h.node.l1_occupancy().pinned, 0);
}

#[test]
fn row_27_a_prepare_retrieve_past_the_timeout_is_a_miss_and_a_late_hit_is_still_promoted() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.engine_registered(worker);
    let request = h.send(Op::PrepareRetrieve {
        instance: worker,
        key: b"slow".to_vec(),
    });
    let [(read, None)] = h.l2_gets_delivering()[..] else {
        panic!("one L2 read, for the slot only: the engine copies by itself")
    };
    h.run_for(TIMEOUT);
    assert_eq!(
        h.l2_cancels(),
        vec![read],
        "given up with the shell too: a read no one waits for takes no L2 thread's time"
    );
    assert_eq!(
        h.answer(request),
        Value::Nil,
        "a miss once the timeout passed"
    );
    assert_eq!(h.counters().timeouts, 1);
    assert_eq!(
        h.node.l1_occupancy().reserved,
        1,
        "the slot waits for the late answer: no one else's bytes may land in it"
    );
    h.l2_got(read, L2Fetched::Hit { nbytes: 10 });
    assert_eq!(h.node.l1_lookup(&[node_key(b"slow")]), 1);
    assert!(h.reply(request).is_none(), "answered once");
    assert_eq!(h.counters().hits, 0, "counted once, as the timeout");
}

#[test]
fn a_read_through_delivers_into_the_retrieve_buffer_with_no_copy_of_its_own() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    let context = h.registered(worker);
    let request = h.send(Op::Retrieve {
        instance: worker,
        key: b"remote".to_vec(),
        buffer: 0,
        offset: 4096,
        nbytes: 300,
    });
    let [(read, Some(deliver))] = h.l2_gets_delivering()[..] else {
        panic!("one L2 read that delivers")
    };
    assert_eq!(
        (deliver.context, deliver.buffer, deliver.offset),
        (context, 0, 4096)
    );
    h.l2_got(read, L2Fetched::Delivered { nbytes: 300 });
    assert!(h.copies().is_empty(), "no copy from L1 afterwards");
    assert_eq!(h.answer(request), Value::from(300u64));
    assert_eq!(h.node.l1_lookup(&[node_key(b"remote")]), 1, "promoted");
    assert_eq!(h.node.l1_occupancy().pinned, 0, "nothing left pinned");
    assert_eq!(h.counters().hits, 1);
}

// Decision 9, both ways: a free waits for a read that may still deliver into the
// context's buffer, and starts as soon as its answer comes, delivered or not.
#[test]
fn decision_9_a_free_waits_for_a_read_through_that_may_deliver() {
    for fetched in [
        L2Fetched::Delivered { nbytes: 300 },
        L2Fetched::Absent,
        L2Fetched::TimedOut,
    ] {
        let mut h = Harness::new(Some(l2_config(1 << 20)));
        let worker = id(1);
        let context = h.registered(worker);
        let request = h.send(retrieve(worker, b"remote", 300));
        let read = h.l2_get();
        h.ask(Op::UnregisterKvCache { instance: worker });
        assert!(
            h.frees().is_empty(),
            "{fetched:?}: the read may still write into the mapping"
        );
        h.l2_got(read, fetched);
        assert!(h.reply(request).is_some(), "{fetched:?}: answered");
        let frees = h.frees();
        assert_eq!(frees.len(), 1, "{fetched:?}");
        assert_eq!(frees[0].0, context);
    }
}

#[test]
fn row_27_pings_never_wait_for_l2_and_nothing_is_reaped_while_it_is_down() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    // L2 never answers: three timeouts open the breaker.
    for key in [b"x1", b"x2", b"x3"] {
        let request = h.send(retrieve(worker, key, 300));
        assert_eq!(h.l2_gets().len(), 1);
        let ping = h.send(ping(worker));
        assert_eq!(h.answer(ping), Value::from(true), "answered at once");
        h.run_for(TIMEOUT);
        h.l2_cancels_won();
        assert_eq!(h.answer(request), Value::Nil);
    }
    assert_eq!(h.state(), L2State::Down);
    assert!(h.notes().iter().any(|note| matches!(
        note,
        Note::L2StateChanged {
            to: L2State::Down,
            ..
        }
    )));
    // Down: a miss at once, writes dropped.
    let request = h.send(retrieve(worker, b"x4", 300));
    assert_eq!(h.answer(request), Value::Nil);
    assert!(h.l2_gets().is_empty());
    h.stored(worker, b"w");
    assert!(h.l2_writes().is_empty());
    assert_eq!(h.counters().write_drops, 1);
    // Twenty seconds of a dead L2 with a pinging worker: nothing reaped.
    for _ in 0..20 {
        let ping = h.send(ping(worker));
        assert_eq!(h.answer(ping), Value::from(true));
        h.run_for(Duration::from_secs(1));
    }
    assert_eq!(h.node.status().liveness.reaped_total, 0);
    assert_eq!(h.node.tracked(), 1);
    // The breaker probed meanwhile (unanswered, so it backs off); the next probe
    // answered in time brings it back.
    let probes = h.l2_exists();
    assert!(!probes.is_empty(), "probes went out");
    assert!(probes.iter().all(|(_, keys)| keys == &[PROBE_KEY.to_vec()]));
    let mut next_probe = None;
    for _ in 0..200 {
        h.run_for(Duration::from_millis(100));
        next_probe = h.l2_exists().pop();
        if next_probe.is_some() {
            break;
        }
    }
    let (read, _) = next_probe.expect("a probe within the back-off cap");
    h.input(Input::L2Existed {
        read,
        presence: L2Presence::Present(0),
    });
    assert_eq!(h.state(), L2State::Up);
    assert!(h.notes().iter().any(|note| matches!(
        note,
        Note::L2StateChanged {
            from: L2State::Down,
            to: L2State::Up
        }
    )));
}

#[test]
fn row_28_a_corrupt_value_is_a_miss_counted_never_served() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let request = h.send(retrieve(worker, b"torn", 300));
    let read = h.l2_get();
    h.l2_got(read, L2Fetched::Corrupt);
    assert_eq!(h.answer(request), Value::Nil);
    assert!(h.copies().is_empty(), "nothing served");
    assert_eq!(h.node.l1_lookup(&[node_key(b"torn")]), 0);
    assert_eq!(h.node.l1_occupancy().reserved, 0);
    let counters = h.counters();
    assert_eq!((counters.corrupt, counters.misses), (1, 1));
    assert_eq!(h.state(), L2State::Up, "Redis answered: not a failure");
}

#[test]
fn lookup_counts_the_l1_prefix_then_asks_l2_for_the_rest() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"a");
    let keys = vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()];
    let request = h.send(Op::Lookup { keys: keys.clone() });
    let [(read, ref rest)] = h.l2_exists()[..] else {
        panic!("one existence check")
    };
    assert_eq!(rest, &keys[1..]);
    h.input(Input::L2Existed {
        read,
        presence: L2Presence::Present(1),
    });
    assert_eq!(h.answer(request), Value::from(2u64));
    assert!(h.l2_cancels().is_empty(), "answered: nothing given up");
    // No answer within the timeout: the L1 prefix, and the check is given up with the
    // shell too (row 64), so that no L2 thread spends time on it.
    let request = h.send(Op::Lookup { keys });
    let [(read, _)] = h.l2_exists()[..] else {
        panic!("one existence check")
    };
    h.run_for(TIMEOUT);
    assert_eq!(h.answer(request), Value::from(1u64));
    assert_eq!(h.l2_cancels(), vec![read], "given up in the shell");
    // Its late answer (the cancel's TimedOut) finds nothing and changes nothing.
    h.input(Input::L2Existed {
        read,
        presence: L2Presence::TimedOut,
    });
    assert_eq!(h.reply(request), None, "answered once");
}

#[test]
fn prepare_retrieve_reads_through_and_pins_the_promoted_slot() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.engine_registered(worker);
    let request = h.send(Op::PrepareRetrieve {
        instance: worker,
        key: b"remote".to_vec(),
    });
    let read = h.l2_get();
    h.l2_got(read, L2Fetched::Hit { nbytes: 77 });
    let Value::Map(grant) = h.answer(request) else {
        panic!("a grant")
    };
    assert!(
        grant
            .iter()
            .any(|(k, v)| k.as_str() == Some("nbytes") && *v == Value::from(77u64))
    );
    assert_eq!(h.node.l1_occupancy().pinned, 1);
}

#[test]
fn retrieve_batch_serves_l1_items_and_reads_the_rest_through() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"local");
    let item = |key: &[u8], offset, nbytes| RetrieveItem {
        key: key.to_vec(),
        buffer: 0,
        offset,
        nbytes,
    };
    let request = h.send(Op::RetrieveBatch {
        instance: worker,
        items: vec![
            item(b"local", 0, 100),
            item(b"hit", 8192, 50),
            item(b"miss", 16384, 50),
        ],
    });
    let gets = h.l2_gets();
    assert_eq!(gets.len(), 2);
    for (read, key, _) in gets {
        let fetched = if key == b"hit" {
            L2Fetched::Hit { nbytes: 50 }
        } else {
            L2Fetched::Absent
        };
        h.l2_got(read, fetched);
    }
    for (copy, direction, nbytes) in h.copies() {
        assert_eq!(direction, Direction::FromL1);
        h.copy_done(copy, Ok(nbytes));
    }
    assert_eq!(
        h.answer(request),
        Value::Array(vec![Value::from(100u64), Value::from(50u64), Value::Nil])
    );
}

/// Row 60: a read-through that ends after the worker stopped waiting (its `hello`'s
/// `wait_ms`) starts no copy into its buffer: the chunk stays in L1, the retrieve is
/// answered as a miss and the copy not started is counted. The control: the same read
/// ending within the wait is copied, and its delivery carries the worker's deadline.
#[test]
fn row_60_a_read_through_that_ends_after_the_worker_stopped_waiting_copies_nothing() {
    let wait = Duration::from_millis(20);
    assert!(wait < TIMEOUT, "the worker gives up before L2 does");
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let hello = h.send_raw(
        kvwarden_core::node::ConnId(1),
        Op::Hello {
            protocol: 2,
            client: "deadlines".into(),
            pidfd_index: None,
            sends_fds: true,
            token: None,
            proof: None,
            wait_ms: Some(wait.as_millis() as u64),
        },
        0,
    );
    let _ = h.answer(hello);

    // The control: on time.
    let asked_at = h.now;
    let request = h.send(retrieve(worker, b"on-time", 300));
    let [(read, Some(delivery))] = h.l2_gets_delivering()[..] else {
        panic!("one delivering L2 read")
    };
    assert_eq!(delivery.not_after, Some(asked_at + wait));
    h.run_for(wait / 2);
    h.l2_got(read, L2Fetched::Hit { nbytes: 300 });
    let [(copy, Direction::FromL1, 300)] = h.copies()[..] else {
        panic!("copied into the worker's buffer")
    };
    h.copy_done(copy, Ok(300));
    assert_eq!(h.answer(request), Value::from(300u64));

    // Past the worker's wait (L2 still within its own timeout).
    let request = h.send(retrieve(worker, b"late", 300));
    let [(read, _)] = h.l2_gets_delivering()[..] else {
        panic!("one L2 read")
    };
    h.run_for(wait + Duration::from_millis(10));
    h.l2_got(read, L2Fetched::Hit { nbytes: 300 });
    assert!(
        h.copies().is_empty(),
        "no copy into the buffer past the deadline"
    );
    assert_eq!(h.answer(request), Value::Nil, "a miss");
    assert_eq!(
        h.node.l1_lookup(&[node_key(b"late")]),
        1,
        "the chunk is in L1"
    );
    assert_eq!(h.node.status().copies_past_deadline_total, 1);
}

/// A `retrieve_batch` naming one key twice, held only in L2 (first read through, then
/// with its hit delivered straight into the first item's buffer), answers both items,
/// as the same batch answers both from L1; L2 is asked once.
#[test]
fn row_58_a_key_twice_in_a_batch_is_served_twice_from_l2_as_from_l1() {
    for delivered in [false, true] {
        let mut h = Harness::new(Some(l2_config(1 << 20)));
        let worker = id(1);
        h.registered(worker);
        h.stored(worker, b"local");
        let item = |key: &[u8], offset| RetrieveItem {
            key: key.to_vec(),
            buffer: 0,
            offset,
            nbytes: 100,
        };
        let from_l1 = h.send(Op::RetrieveBatch {
            instance: worker,
            items: vec![item(b"local", 0), item(b"local", 8192)],
        });
        for (copy, _, nbytes) in h.copies() {
            h.copy_done(copy, Ok(nbytes));
        }
        let both = Value::Array(vec![Value::from(100u64), Value::from(100u64)]);
        assert_eq!(h.answer(from_l1), both, "from L1");

        let from_l2 = h.send(Op::RetrieveBatch {
            instance: worker,
            items: vec![item(b"remote", 0), item(b"remote", 8192)],
        });
        let gets = h.l2_gets_delivering();
        assert_eq!(gets.len(), 1, "one L2 read for the key");
        assert!(
            gets[0].1.is_some(),
            "the read may deliver into the first item"
        );
        let fetched = if delivered {
            L2Fetched::Delivered { nbytes: 100 }
        } else {
            L2Fetched::Hit { nbytes: 100 }
        };
        h.l2_got(gets[0].0, fetched);
        // Each copy from L1 (the first item's, unless delivered; then the second's).
        for _ in 0..2 {
            for (copy, direction, nbytes) in h.copies() {
                assert_eq!(direction, Direction::FromL1);
                h.copy_done(copy, Ok(nbytes));
            }
        }
        assert_eq!(h.answer(from_l2), both, "from L2, delivered: {delivered}");
    }
}

/// Row 64: the reads of a large `retrieve_batch` queue behind each other in the shell;
/// L2 answers them one after another, each within the timeout of the one before, the
/// last long after the timeout from the ask (2 MiB values at 50 ms: 15 % of held keys
/// missed with one client, 32 % with four). Each is waited for while L2 keeps
/// answering; once it stops answering, what is left is given up the timeout after its
/// last answer. The control: with no answer at all, a read is given up at the timeout
/// from its ask (row 27).
#[test]
fn row_64_reads_queued_behind_answers_are_waited_for_and_given_up_once_l2_stops() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    let keys: [&[u8]; 4] = [b"k0", b"k1", b"k2", b"k3"];
    let request = h.send(Op::RetrieveBatch {
        instance: worker,
        items: (0..4u64)
            .map(|n| RetrieveItem {
                key: keys[n as usize].to_vec(),
                buffer: 0,
                offset: n * 8192,
                nbytes: 50,
            })
            .collect(),
    });
    let gets = h.l2_gets();
    assert_eq!(gets.len(), 4);
    let step = TIMEOUT * 3 / 4;
    // Three answers, each within the timeout of the one before; the third comes at
    // 2.25 timeouts after the ask.
    for (read, _, _) in &gets[..3] {
        h.run_for(step);
        assert!(
            h.l2_cancels().is_empty(),
            "L2 is answering: nothing given up"
        );
        h.l2_got(*read, L2Fetched::Hit { nbytes: 50 });
    }
    // L2 stops answering: the last read waits the timeout after the last answer.
    h.run_for(step);
    assert!(
        h.l2_cancels().is_empty(),
        "within the timeout of the last answer"
    );
    h.run_for(TIMEOUT - step);
    assert_eq!(
        h.l2_cancels(),
        vec![gets[3].0],
        "given up a timeout after it"
    );
    h.l2_got(gets[3].0, L2Fetched::TimedOut);
    for (copy, direction, nbytes) in h.copies() {
        assert_eq!(direction, Direction::FromL1);
        h.copy_done(copy, Ok(nbytes));
    }
    assert_eq!(
        h.answer(request),
        Value::Array(vec![
            Value::from(50u64),
            Value::from(50u64),
            Value::from(50u64),
            Value::Nil
        ])
    );
    assert_eq!((h.counters().hits, h.counters().timeouts), (3, 1));

    // The control: a read with no answer at all is given up the timeout after its ask.
    let request = h.send(retrieve(worker, b"unanswered", 50));
    let [(read, _, _)] = h.l2_gets()[..] else {
        panic!("one read through")
    };
    h.run_for(TIMEOUT - Duration::from_millis(1));
    assert!(h.l2_cancels().is_empty(), "not before its deadline");
    h.run_for(Duration::from_millis(1));
    assert_eq!(h.l2_cancels(), vec![read]);
    h.l2_got(read, L2Fetched::TimedOut);
    assert_eq!(h.answer(request), Value::Nil);
}

/// `kv_events` from a new cursor until caught up: (stored, key, tier) in order.
fn kv_events(h: &mut Harness, cursor: &mut Vec<u8>) -> Vec<(bool, Vec<u8>, KvTier)> {
    let mut changes = Vec::new();
    loop {
        let request = h.send(Op::KvEvents {
            cursor: cursor.clone(),
            max: 8,
        });
        let page = KvEvents::from_value(&h.answer(request)).expect("a kv_events reply");
        changes.extend(page.events.into_iter().map(|e| (e.stored, e.key, e.tier)));
        *cursor = page.cursor;
        if !page.more {
            return changes;
        }
    }
}

#[test]
fn row_74_an_l2_write_and_a_corrupt_value_deleted_are_told_as_l2_changes() {
    let mut h = Harness::new(Some(l2_config(1 << 20)));
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"a");
    let mut cursor = Vec::new();
    assert_eq!(
        kv_events(&mut h, &mut cursor),
        vec![(true, b"a".to_vec(), KvTier::L1)],
        "the snapshot: L1's keys"
    );
    let [(write, ..)] = h.l2_writes()[..] else {
        panic!("one L2 write")
    };
    h.input(Input::L2Written {
        write,
        outcome: WriteOutcome::Written,
    });
    assert_eq!(
        kv_events(&mut h, &mut cursor),
        vec![(true, b"a".to_vec(), KvTier::L2)],
        "L2 holds it too"
    );
    // Control: a write that failed is not told.
    h.stored(worker, b"b");
    let [(write, ..)] = h.l2_writes()[..] else {
        panic!("one L2 write")
    };
    h.input(Input::L2Written {
        write,
        outcome: WriteOutcome::Failed,
    });
    assert_eq!(
        kv_events(&mut h, &mut cursor),
        vec![(true, b"b".to_vec(), KvTier::L1)]
    );
    // A read through L2 that finds the value corrupt: the shell deleted it.
    let request = h.send(retrieve(worker, b"c", 50));
    let read = h.l2_get();
    h.l2_got(read, L2Fetched::Corrupt);
    assert_eq!(h.answer(request), Value::Nil);
    assert_eq!(
        kv_events(&mut h, &mut cursor),
        vec![(false, b"c".to_vec(), KvTier::L2)]
    );
}

/// `kv_events` on `conn` from `cursor` until caught up: (stored, key, meta) in order.
fn described(
    h: &mut Harness,
    conn: ConnId,
    cursor: &mut Vec<u8>,
) -> Vec<(bool, Vec<u8>, Option<Vec<u8>>)> {
    let mut changes = Vec::new();
    loop {
        let request = h.send_on(
            conn,
            Op::KvEvents {
                cursor: cursor.clone(),
                max: 8,
            },
            0,
        );
        let page = KvEvents::from_value(&h.answer(request)).expect("a kv_events reply");
        changes.extend(page.events.into_iter().map(|e| (e.stored, e.key, e.meta)));
        *cursor = page.cursor;
        if !page.more {
            return changes;
        }
    }
}

#[test]
fn row_74_a_described_key_carries_its_description_to_its_tenants_readers_only() {
    let mut h = Harness::new(None);
    let worker = id(1);
    h.registered(worker);
    h.stored(worker, b"a");
    let describe = |h: &mut Harness, conn, items: Vec<(&[u8], &[u8])>| {
        let request = h.send_on(
            conn,
            Op::DescribeKeys {
                items: items
                    .into_iter()
                    .map(|(k, m)| (k.to_vec(), m.to_vec()))
                    .collect(),
            },
            0,
        );
        h.answer(request)
    };
    let mut cursor = Vec::new();
    assert_eq!(
        described(&mut h, ConnId(1), &mut cursor),
        vec![(true, b"a".to_vec(), None)],
        "not described yet"
    );
    // Held: described; never stored: refused.
    assert_eq!(
        describe(
            &mut h,
            ConnId(1),
            vec![(b"a", b"block 0"), (b"b", b"block 1")]
        ),
        Value::Array(vec![true.into(), false.into()])
    );
    assert_eq!(
        described(&mut h, ConnId(1), &mut cursor),
        vec![(true, b"a".to_vec(), Some(b"block 0".to_vec()))],
        "told again, with its description"
    );
    assert_eq!(
        described(&mut h, ConnId(1), &mut Vec::new()),
        vec![(true, b"a".to_vec(), Some(b"block 0".to_vec()))],
        "a new reader's snapshot has it too"
    );
    // Another tenant (uid 1001) describes a key of the same name: its own keyspace, where
    // nothing is held; and its reader sees none of the owner's.
    h.connect(ConnId(9), Some(1001), None);
    assert_eq!(
        describe(&mut h, ConnId(9), vec![(b"a", b"forged")]),
        Value::Array(vec![false.into()])
    );
    assert_eq!(described(&mut h, ConnId(9), &mut Vec::new()), vec![]);
    assert_eq!(
        described(&mut h, ConnId(1), &mut cursor),
        vec![],
        "the owner's description is untouched"
    );
    // Too long a description: bad_args naming the item.
    let long = vec![0u8; kvwarden_core::protocol::MAX_META_BYTES + 1];
    let request = h.send_on(
        ConnId(1),
        Op::DescribeKeys {
            items: vec![(b"a".to_vec(), long)],
        },
        0,
    );
    let error = h.reply(request).expect("answered").expect_err("refused");
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains("items[0].meta"), "{}", error.message);
}

/// A version 3 description of block `name` (`kvwarden.kv_announce.encode_meta`): its
/// hash is `h-<name>`, its shards `shards`, its parent's hash `h-<parent>`.
fn description(name: &str, parent: Option<&str>, shards: &[&[u8]]) -> Vec<u8> {
    let hash = |name: &str| Value::Binary(format!("h-{name}").into_bytes());
    let value = Value::Array(vec![
        Value::from(3),
        Value::Binary(name.as_bytes().to_vec()),
        hash(name),
        parent.map_or(Value::Nil, hash),
        Value::Array(vec![Value::from(1), Value::from(2)]),
        Value::Nil,
        Value::Nil,
        Value::Array(shards.iter().map(|s| Value::Binary(s.to_vec())).collect()),
        Value::Nil,
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &value).unwrap();
    bytes
}

/// The node-scoped streams' events since the last call: (stream, `+name` / `-name`).
fn published(h: &mut Harness) -> Vec<(usize, String)> {
    use kvwarden_core::kv_publish::{BlockEvent, BlockHash};
    h.drain();
    h.take(|output| match output {
        kvwarden_core::node::Output::Publish { stream, events } => Some(
            events
                .iter()
                .map(|event| match event {
                    BlockEvent::Stored(meta) => {
                        format!("+{}", String::from_utf8_lossy(&meta.chain_key))
                    }
                    BlockEvent::Removed(BlockHash::Bytes(hash)) => {
                        format!("-{}", String::from_utf8_lossy(&hash[2..]))
                    }
                    other => format!("{other:?}"),
                })
                .map(|told| (*stream, told))
                .collect::<Vec<_>>(),
        ),
        _ => None,
    })
    .concat()
}

/// A block: its name, its parent's, its shards' keys.
type Block<'a> = (&'a str, Option<&'a str>, &'a [&'a [u8]]);

/// Stores every shard of `blocks` and describes them, as the owner's worker.
fn store_and_describe(h: &mut Harness, worker: InstanceId, blocks: &[Block]) {
    for (_, _, shards) in blocks {
        for shard in *shards {
            h.stored(worker, shard);
        }
    }
    let items = blocks
        .iter()
        .map(|(name, parent, shards)| (shards[0].to_vec(), description(name, *parent, shards)))
        .collect();
    let answer = h.ask(Op::DescribeKeys { items });
    assert!(
        answer
            .as_array()
            .unwrap()
            .iter()
            .all(|held| held.as_bool() == Some(true)),
        "every first shard is held: {answer}"
    );
}

#[test]
fn row_74_the_servers_own_stream_announces_its_tenants_whole_blocks_and_withdraws_them() {
    let worker = id(1);
    // Control: a stream for another tenant says nothing of the owner's blocks.
    let mut other = Harness::adjusted(8, |config| config.kv_publish = vec!["uid-1001".into()]);
    other.registered(worker);
    store_and_describe(&mut other, worker, &[("a", None, &[b"a/0", b"a/1"])]);
    assert_eq!(published(&mut other), vec![]);

    // The owner's stream (stream 1; stream 0 is another tenant's).
    let streams = vec![
        "uid-1001".to_string(),
        format!("uid-{}", support::harness::OWNER),
    ];
    let mut h = Harness::adjusted(4, |config| config.kv_publish = streams);
    h.registered(worker);
    store_and_describe(&mut h, worker, &[("a", None, &[b"a/0", b"a/1"])]);
    assert_eq!(
        published(&mut h),
        vec![(1, "+a".into())],
        "both shards held"
    );
    // A child whose second shard is not held yet waits for it; then it is announced.
    h.stored(worker, b"b/0");
    let answer = h.ask(Op::DescribeKeys {
        items: vec![(
            b"b/0".to_vec(),
            description("b", Some("a"), &[b"b/0", b"b/1"]),
        )],
    });
    assert_eq!(answer, Value::Array(vec![true.into()]));
    assert_eq!(published(&mut h), vec![], "b/1 is not held");
    h.stored(worker, b"b/1");
    assert_eq!(published(&mut h), vec![(1, "+b".into())]);
    // The pool of 4 is full: one more store evicts the oldest, a/0. Block a is
    // withdrawn, and b after it (its parent is gone), parent first.
    h.stored(worker, b"c");
    assert_eq!(published(&mut h), vec![(1, "-a".into()), (1, "-b".into())]);
}
