//! A pool that outlives the process (issue 48, failure modes 71-73), as the node decides
//! it: every committed value is sealed (and stays put until it is), and a restarted
//! node adopts what its shell found sealed, under the tenant the key names, while it
//! serves.

mod support;

use kvwarden_core::node::trust::scoped_key;
use kvwarden_core::node::{Direction, Input, Job, Note, Output, Scanned};
use kvwarden_core::protocol::Op;
use kvwarden_core::seal::Unsealed;
use support::harness::{Harness, node_key};
use support::id;

fn seals(h: &mut Harness) -> Vec<(usize, Vec<u8>, u64)> {
    h.take(|output| match output {
        Output::Job(Job::Seal { slot, key, len }) => Some((*slot, key.clone(), *len)),
        _ => None,
    })
}

fn scans(h: &mut Harness) -> Vec<(usize, usize)> {
    h.take(|output| match output {
        Output::Job(Job::Scan { first, count }) => Some((*first, *count)),
        _ => None,
    })
}

fn sealed(key: &[u8]) -> Scanned {
    Scanned::Sealed {
        key: node_key(key),
        len: 100,
    }
}

fn retrieve(h: &mut Harness, key: &[u8]) -> Option<u64> {
    let request = h.send(Op::Retrieve {
        instance: id(1),
        key: key.to_vec(),
        buffer: 0,
        offset: 0,
        nbytes: 100,
    });
    let copies = h.copies();
    for &(copy, direction, nbytes) in &copies {
        assert_eq!(direction, Direction::FromL1);
        h.copy_done(copy, Ok(nbytes));
    }
    let answer = h.answer(request);
    answer.as_u64()
}

#[test]
fn row_71_a_commit_is_sealed_and_stays_put_until_it_is() {
    // Control: an anonymous pool seals nothing.
    let mut plain = Harness::new(None);
    plain.registered(id(1));
    plain.stored(id(1), b"a");
    assert!(seals(&mut plain).is_empty());

    let mut h = Harness::new(None);
    h.node.persist_pool(h.now, true, false);
    h.drain();
    assert!(
        scans(&mut h).is_empty(),
        "nothing to adopt: nothing scanned"
    );
    h.registered(id(1));
    h.stored(id(1), b"a");
    let [(slot, key, 100)] = &seals(&mut h)[..] else {
        panic!("one seal")
    };
    assert_eq!(key, &node_key(b"a"));
    let status = h.node.status();
    assert_eq!(status.l1_sealing, 1);
    assert_eq!(status.l1_slots.3, 1, "pinned while it is sealed");
    h.input(Input::Sealed {
        slot: *slot,
        written: true,
    });
    let status = h.node.status();
    assert_eq!((status.l1_sealing, status.l1_slots.3), (0, 0));
    assert_eq!(status.l1_unsealed_total, 0);
    assert_eq!(retrieve(&mut h, b"a"), Some(100), "served, sealed or not");
}

#[test]
fn row_71_a_value_whose_seal_could_not_be_written_is_counted_and_still_served() {
    let mut h = Harness::new(None);
    h.node.persist_pool(h.now, true, false);
    h.registered(id(1));
    h.stored(id(1), b"a");
    h.stored(id(1), b"b");
    let [(a, ..), (b, ..)] = seals(&mut h)[..] else {
        panic!("two seals")
    };
    h.input(Input::Sealed {
        slot: a,
        written: true,
    });
    // The shell could not seal it (a key longer than a seal holds).
    h.input(Input::Sealed {
        slot: b,
        written: false,
    });
    let status = h.node.status();
    assert_eq!(status.l1_unsealed_total, 1, "only the one not written");
    assert_eq!(
        (status.l1_sealing, status.l1_slots.3),
        (0, 0),
        "both unpinned"
    );
    assert_eq!(retrieve(&mut h, b"b"), Some(100), "served all the same");
}

#[test]
fn row_71_a_shutdown_waits_for_the_seals_of_what_was_committed() {
    let mut h = Harness::new(None);
    h.node.persist_pool(h.now, true, false);
    h.registered(id(1));
    h.stored(id(1), b"a");
    let [(slot, ..)] = seals(&mut h)[..] else {
        panic!("one seal")
    };
    h.input(Input::Shutdown);
    h.run_for(support::secs(1.0));
    // Draining ends with the registrations' frees: none while a seal is unwritten.
    assert!(
        h.frees().is_empty(),
        "the drain ended with a seal unwritten"
    );
    h.input(Input::Sealed {
        slot,
        written: true,
    });
    h.run_for(support::secs(1.0));
    assert!(
        h.frees().iter().any(|&(_, _, label)| label == "shutdown"),
        "the drain ends once the seal is written"
    );
}

#[test]
fn row_71_a_restarted_node_serves_what_verified_under_the_tenant_its_key_names() {
    let mut h = Harness::new(None);
    h.node.persist_pool(h.now, true, true);
    h.drain();
    assert_eq!(scans(&mut h), vec![(0, 4)]);
    h.registered(id(1));
    // Not scanned yet: a miss, never a guess.
    assert_eq!(h.node.l1_lookup(&[node_key(b"a")]), 0);
    h.input(Input::Scanned {
        first: 0,
        found: vec![
            sealed(b"a"),
            Scanned::Blank,
            Scanned::Unsealed(Unsealed::Torn),
            Scanned::Sealed {
                // A tenant the operator no longer configures.
                key: scoped_key("gone-team", b"b"),
                len: 100,
            },
        ],
    });
    let view = h.node.adoption().expect("adopting").clone();
    assert_eq!(
        (view.scanned, view.adopted, view.adopted_bytes),
        (4, 1, 100)
    );
    assert_eq!((view.dropped_torn, view.dropped_tenant), (1, 1));
    assert!(view.finished.is_some());
    assert!(
        h.notes()
            .iter()
            .any(|note| matches!(note, Note::PoolAdopted(adopted) if adopted.adopted == 1))
    );
    assert_eq!(retrieve(&mut h, b"a"), Some(100));
    // Another uid's tenant does not see it: its key is in another keyspace.
    assert_eq!(
        h.node.l1_lookup(&[scoped_key("uid-1001", b"a")]),
        0,
        "only the tenant the key names"
    );
    // The adopted value is charged to its tenant and evictable like any other.
    for key in [b"c", b"d", b"e", b"f"] {
        h.stored(id(1), key);
    }
    assert_eq!(
        h.node.l1_lookup(&[node_key(b"a")]),
        0,
        "evicted as the oldest"
    );
}

#[test]
fn row_71_a_uid_tenant_is_made_again_for_its_adopted_chunks() {
    let mut h = Harness::new(None);
    h.node.persist_pool(h.now, true, true);
    h.input(Input::Scanned {
        first: 0,
        found: vec![
            Scanned::Sealed {
                key: scoped_key("uid-1001", b"x"),
                len: 100,
            },
            Scanned::Sealed {
                key: scoped_key("uid-01001", b"y"),
                len: 100,
            },
            // The same key sealed in two slots (a stale seal the scan found twice).
            Scanned::Sealed {
                key: scoped_key("uid-1001", b"x"),
                len: 100,
            },
            Scanned::Blank,
        ],
    });
    let view = h.node.adoption().unwrap().clone();
    assert_eq!(view.adopted, 1);
    assert_eq!(view.dropped_tenant, 1, "uid-01001 names no uid's tenant");
    assert_eq!(view.dropped_duplicate, 1);
    let status = h.node.status();
    let tenant = status
        .tenants
        .iter()
        .find(|tenant| tenant.view.name == "uid-1001")
        .expect("uid 1001's tenant, made for its chunk");
    assert_eq!(tenant.slots_used, 1);
    assert_eq!(h.node.l1_lookup(&[scoped_key("uid-1001", b"x")]), 1);
}

#[test]
fn row_71_a_store_during_the_scan_takes_an_unscanned_slot_only_when_nothing_else_is_left() {
    let mut h = Harness::with_slots(2, None);
    h.node.persist_pool(h.now, true, true);
    h.drain();
    assert_eq!(scans(&mut h), vec![(0, 2)]);
    h.registered(id(1));
    // Slot 0 scanned first: free; the store takes it, not an unscanned one.
    h.input(Input::Scanned {
        first: 0,
        found: vec![Scanned::Blank],
    });
    h.stored(id(1), b"s0");
    let [(first, ..)] = seals(&mut h)[..] else {
        panic!("one seal")
    };
    assert_eq!(first, 0);
    h.input(Input::Sealed {
        slot: first,
        written: true,
    });
    // Slot 0 is evictable now; the next store evicts it rather than take slot 1.
    h.stored(id(1), b"s1");
    let [(second, ..)] = seals(&mut h)[..] else {
        panic!("one seal")
    };
    assert_eq!(second, 0, "the evictable slot, not the unscanned one");
    // Slot 0 pinned for its seal: nothing is evictable, so a store takes slot 1 unscanned.
    h.stored(id(1), b"s2");
    let [(third, ..)] = seals(&mut h)[..] else {
        panic!("one seal")
    };
    assert_eq!(third, 1);
    // Its scan reports what was there before: lost, counted, and the store's value stays.
    h.input(Input::Scanned {
        first: 1,
        found: vec![sealed(b"old")],
    });
    let view = h.node.adoption().unwrap().clone();
    assert_eq!((view.adopted, view.dropped_taken), (0, 1));
    assert_eq!(h.node.l1_lookup(&[node_key(b"s2")]), 1);
    assert_eq!(h.node.l1_lookup(&[node_key(b"old")]), 0);
}
