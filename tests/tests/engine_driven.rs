//! Engine-driven transfers: the worker maps the L1 pool's memfd it received with its
//! registration and writes and reads slots itself; the server keeps its reservations
//! and pins as the instance's context, and freeing that context (unregister, reap,
//! process exit) discards every unpublished reservation and releases every pin
//! (row 21).

mod engine_support;

use engine_support::{EngineWorker, Helper, l1};
use kvwarden_core::protocol::ErrorCode;
use kvwarden_tests::{Server, TempDir, find_instance, freed};
use rmpv::Value;

/// The helper process of the process-exit path (a no-op when run as a test).
#[test]
fn helper_process_engine_worker() {
    engine_support::run_helper_if_asked();
}

#[test]
fn engine_driven_store_retrieve_round_trip() {
    let dir = TempDir::new("engine-round-trip");
    let server = Server::start(&dir, &[]);
    let mut worker = EngineWorker::register(&server.socket, 101);
    assert_eq!(worker.outcome, "created");
    assert_eq!(worker.slot_bytes, 64 << 10, "--slot-bytes 64K");
    assert_eq!(worker.num_slots, 64, "--l1-bytes 4M");
    let entry = server.instance(101).expect("tracked");
    assert_eq!(entry["module"], "engine_driven");

    // Write through the mapping, publish, read back through the mapping.
    let grant = worker.prepare_store(b"ed-key").expect("a reservation");
    assert_eq!(grant.nbytes, worker.slot_bytes, "a whole slot to write");
    assert_eq!(grant.offset % worker.slot_bytes, 0);
    assert!(worker.pool.write(grant.offset, b"engine bytes"));
    assert_eq!(
        worker.lookup(b"ed-key"),
        0,
        "not visible before commit_store"
    );
    assert_eq!(worker.prepare_store(b"ed-key"), None, "being stored: nil");
    assert!(worker.commit_store(b"ed-key", 12));
    assert!(
        !worker.commit_store(b"ed-key", 12),
        "nothing reserved any more"
    );
    assert_eq!(worker.lookup(b"ed-key"), 1);
    assert_eq!(worker.prepare_store(b"ed-key"), None, "already stored: nil");

    let read = worker.prepare_retrieve(b"ed-key").expect("a hit");
    assert_eq!((read.offset, read.nbytes), (grant.offset, 12));
    assert_eq!(l1(&server.status(), "slots_pinned"), 1);
    let mut out = [0u8; 12];
    assert!(worker.pool.read(read.offset, &mut out));
    assert_eq!(&out, b"engine bytes");
    assert!(worker.commit_retrieve(b"ed-key"));
    assert!(!worker.commit_retrieve(b"ed-key"), "no pin left");
    assert_eq!(worker.prepare_retrieve(b"absent"), None, "a miss is nil");
    let status = server.status();
    assert_eq!(
        (l1(&status, "slots_pinned"), l1(&status, "slots_reserved")),
        (0, 0)
    );

    // A second engine (its own mapping of the same pool) sees the published bytes.
    let mut other = EngineWorker::register(&server.socket, 102);
    assert_eq!(other.load(b"ed-key").as_deref(), Some(&b"engine bytes"[..]));

    // Registering again refreshes (nothing built) and hands the pool over again.
    let built_before = kvwarden_tests::built(&server.status());
    let again = EngineWorker::register(&server.socket, 101);
    assert_eq!(again.outcome, "refreshed");
    assert_eq!(kvwarden_tests::built(&server.status()), built_before);
    let mut bytes = [0u8; 12];
    assert!(again.pool.read(grant.offset, &mut bytes));
    assert_eq!(&bytes, b"engine bytes");

    let reply = worker.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    let reply = worker.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(false), "row 14");
    assert!(server.instance(101).is_none());
    drop(other);
}

#[test]
fn engine_driven_ops_answer_as_the_protocol_says() {
    let dir = TempDir::new("engine-errors");
    let server = Server::start(&dir, &[]);
    let mut stranger = EngineWorker::register(&server.socket, 111);
    stranger.instance = 112; // never registered
    stranger.raw.attach(112); // but attached: the refusal below is about registration
    for (op, args) in [
        ("prepare_store", vec![Value::Binary(b"k".to_vec())]),
        ("commit_store", vec![Value::Binary(b"k".to_vec()), 1.into()]),
        ("prepare_retrieve", vec![Value::Binary(b"k".to_vec())]),
        ("commit_retrieve", vec![Value::Binary(b"k".to_vec())]),
    ] {
        let error = stranger.call(op, args).result.unwrap_err();
        assert_eq!(error.code, ErrorCode::NotRegistered, "{op}: {error}");
        assert!(
            error.message.contains("register_engine_driven"),
            "{op}: {}",
            error.message
        );
    }
    assert!(
        server.instance(112).is_none(),
        "transfers never create state"
    );

    // A server-driven registration is not an engine-driven one.
    let reply = stranger
        .raw
        .request(
            "register_kv_cache",
            vec![112.into(), Value::Array(vec![]), "m".into(), 1.into()],
        )
        .unwrap();
    reply.result.expect("registered server-driven");
    let error = stranger
        .call("prepare_store", vec![Value::Binary(b"k".to_vec())])
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::NotRegistered);

    // A commit larger than a slot is bad_args, and the reservation survives it.
    let mut worker = EngineWorker::register(&server.socket, 113);
    worker.prepare_store(b"big").expect("a reservation");
    let error = worker
        .call(
            "commit_store",
            vec![
                Value::Binary(b"big".to_vec()),
                (worker.slot_bytes + 1).into(),
            ],
        )
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::BadArgs);
    assert!(error.message.contains(&(worker.slot_bytes + 1).to_string()));
    assert!(worker.commit_store(b"big", worker.slot_bytes));
    assert_eq!(worker.lookup(b"big"), 1);
}

/// What every path of row 21 must leave behind: the instance gone, no slot reserved
/// or pinned, the committed key still published with its bytes, the half-written key
/// never published and free to be stored again.
fn assert_released(server: &Server, instance: u64, published: &[u8], half: &[u8], cause: &str) {
    let status = server.wait_status(&format!("{instance} freed ({cause})"), |s| {
        find_instance(s, instance).is_none()
            && l1(s, "slots_reserved") == 0
            && l1(s, "slots_pinned") == 0
    });
    assert!(freed(&status, cause) >= 1, "{cause}: {status}");
    let mut reader = EngineWorker::register(&server.socket, instance + 1000);
    assert_eq!(reader.lookup(published), 1, "{cause}: published data stays");
    let bytes = reader.load(published).expect("a hit");
    assert_eq!(&bytes[..6], b"helper", "{cause}: published bytes intact");
    assert_eq!(
        reader.lookup(half),
        0,
        "{cause}: a reservation is never published"
    );
    assert_eq!(
        reader.prepare_retrieve(half),
        None,
        "{cause}: half-written data cannot be read"
    );
    let grant = reader
        .prepare_store(half)
        .expect("the discarded key can be stored again");
    assert!(reader.pool.write(grant.offset, b"whole"));
    assert!(reader.commit_store(half, 5));
    let reply = reader.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
}

/// Registers `instance`, publishes `published`, reserves `half` (writing half of it)
/// and pins `published`; checks the server sees one reservation and one pin.
fn hold_a_reservation_and_a_pin(
    server: &Server,
    instance: u64,
    published: &[u8],
    half: &[u8],
) -> EngineWorker {
    let mut worker = EngineWorker::register(&server.socket, instance);
    worker.store(published, b"helper");
    let grant = worker.prepare_store(half).expect("a reservation");
    assert!(worker.pool.write(grant.offset, b"ha"));
    worker.prepare_retrieve(published).expect("a hit");
    let status = server.status();
    assert_eq!(l1(&status, "slots_reserved"), 1, "{status}");
    assert_eq!(l1(&status, "slots_pinned"), 1, "{status}");
    worker
}

#[test]
fn row_21_freed_engine_instance_discards_reservation_and_releases_pins() {
    let dir = TempDir::new("row21");
    let server = Server::start(&dir, &[]);
    server.expect_pings_answered_false("the instance is reaped, then pinged");

    // Unregister.
    let mut worker = hold_a_reservation_and_a_pin(&server, 211, b"pub-u", b"half-u");
    let reply = worker.call("unregister_engine_driven", vec![]);
    assert_eq!(reply.result.unwrap(), Value::Boolean(true));
    assert_released(&server, 211, b"pub-u", b"half-u", "unregistered");
    // A commit after the free neither publishes nor resurrects anything.
    let error = worker
        .call(
            "commit_store",
            vec![Value::Binary(b"half-u".to_vec()), 2.into()],
        )
        .result
        .unwrap_err();
    assert_eq!(error.code, ErrorCode::NotRegistered);
    assert!(server.instance(211).is_none());

    // Reap: it pinged once (proven), then fell silent past the 2 s reap timeout.
    let mut worker = hold_a_reservation_and_a_pin(&server, 212, b"pub-r", b"half-r");
    assert!(worker.ping());
    assert_released(&server, 212, b"pub-r", b"half-r", "reaped");
    assert!(server.log().contains("reaped"), "{}", server.log());
    assert!(
        !worker.ping(),
        "a reaped instance is not resurrected by a ping"
    );

    // Process exit: the worker process is SIGKILLed holding both.
    let helper = Helper::spawn(
        "helper_process_engine_worker",
        &server.socket,
        213,
        "engine,store:pub-x,reserve:half-x,pin:pub-x",
    );
    let status = server.status();
    assert!(find_instance(&status, 213).is_some());
    assert_eq!(
        (l1(&status, "slots_reserved"), l1(&status, "slots_pinned")),
        (1, 1)
    );
    let exits_before = freed(&status, "process_exited");
    helper.kill();
    assert_released(&server, 213, b"pub-x", b"half-x", "process_exited");
    let status = server.status();
    assert_eq!(freed(&status, "process_exited"), exits_before + 1);
    // All slots of the three freed instances came back: nothing reserved or pinned
    // is left, and the pool can be filled to the brim again.
    let mut filler = EngineWorker::register(&server.socket, 219);
    let slots = filler.num_slots;
    for n in 0..slots {
        let key = format!("fill-{n}").into_bytes();
        assert!(filler.prepare_store(&key).is_some(), "slot {n} of {slots}");
        assert!(filler.commit_store(&key, 1));
    }
    assert_eq!(l1(&server.status(), "slots_used"), slots);
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| entries.count())
        .unwrap_or(0)
}

#[test]
fn a_peer_that_floods_registrations_without_reading_is_cut_off_and_leaks_no_fds() {
    let dir = TempDir::new("engine-flood");
    let server = Server::start(&dir, &[]);
    let pid = server.child.id();
    let worker = EngineWorker::register(&server.socket, 121);
    server.status(); // its connection is part of the baseline
    let baseline = open_fds(pid);
    let mut flooder = kvwarden_tests::RawClient::connect_attached(&server.socket, 122);
    flooder
        .stream
        .set_write_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut frames = Vec::new();
    for _ in 0..20_000 {
        let (_, frame) = flooder.frame(
            "register_engine_driven",
            vec![122.into(), "m".into(), 1.into()],
        );
        frames.extend_from_slice(&frame);
    }
    // Write until the server stops reading (it cut us off) or everything is sent.
    let _ = std::io::Write::write_all(&mut flooder.stream, &frames);
    // Reading with read() (not recvmsg) lets the kernel close every fd that arrives.
    // Reading with read() (not recvmsg) lets the kernel close every fd that arrives;
    // the server cut us off once two pool-fd replies were queued unread.
    let started = std::time::Instant::now();
    let mut replies_read = 0usize;
    loop {
        let mut sink = [0u8; 65536];
        match std::io::Read::read(&mut flooder.stream, &mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => replies_read += 1,
        }
        assert!(
            started.elapsed() < kvwarden_tests::PATIENCE,
            "the flooder was never cut off ({replies_read} reads)"
        );
    }
    assert!(replies_read < 20_000, "cut off before every reply was sent");
    kvwarden_tests::wait_for("fds back at the baseline", kvwarden_tests::PATIENCE, || {
        (open_fds(pid) <= baseline).then_some(())
    });
    // Everyone else is still served, and the pool can still be handed out.
    let mut again = EngineWorker::register(&server.socket, 123);
    again.store(b"after-flood", b"helper");
    assert_eq!(again.lookup(b"after-flood"), 1);
    drop(worker);
}

#[test]
fn pipelined_registrations_each_carry_their_own_pool_fd() {
    let dir = TempDir::new("engine-pipelined");
    let server = Server::start(&dir, &[]);
    let mut raw = kvwarden_tests::RawClient::connect(&server.socket).unwrap();
    for instance in 131..134 {
        raw.attach(instance);
    }
    let mut frames = Vec::new();
    let mut expected = std::collections::HashMap::new();
    for n in 0..12u64 {
        let (id, frame) = if n % 2 == 0 {
            raw.frame(
                "register_engine_driven",
                vec![(131 + n % 3).into(), "m".into(), 1.into()],
            )
        } else {
            raw.frame("ping", vec![Value::Nil])
        };
        expected.insert(id, usize::from(n % 2 == 0));
        frames.extend_from_slice(&frame);
    }
    raw.send_bytes(&frames).unwrap();

    // The fds of a read belong to the frame that holds the read's last byte: the
    // server sends each fd-carrying reply by a sendmsg of its own.
    let mut buffer: Vec<u8> = Vec::new();
    let mut fds_at_end: Vec<(usize, usize)> = Vec::new(); // (buffer end, fd count)
    let mut seen = std::collections::HashMap::new();
    while seen.len() < expected.len() {
        let mut chunk = [0u8; 4096];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let mut iov = [std::io::IoSliceMut::new(&mut chunk)];
        let received = rustix::net::recvmsg(
            &raw.stream,
            &mut iov,
            &mut control,
            rustix::net::RecvFlags::CMSG_CLOEXEC,
        )
        .unwrap();
        assert!(received.bytes > 0, "the server closed the connection");
        let mut count = 0;
        for message in control.drain() {
            if let rustix::net::RecvAncillaryMessage::ScmRights(fds) = message {
                count += fds.count();
            }
        }
        buffer.extend_from_slice(&chunk[..received.bytes]);
        if count > 0 {
            fds_at_end.push((buffer.len(), count));
        }
        // Take every complete frame, with the fds whose read ended inside it.
        let mut start = 0;
        while buffer.len() >= start + 4 {
            let len = u32::from_be_bytes(buffer[start..start + 4].try_into().unwrap()) as usize;
            let end = start + 4 + len;
            if buffer.len() < end {
                break;
            }
            let reply = kvwarden_core::protocol::decode_reply(&buffer[start + 4..end]).unwrap();
            reply.result.expect("every request succeeds");
            let fds: usize = fds_at_end
                .iter()
                .filter(|(at, _)| *at > start && *at <= end)
                .map(|(_, count)| count)
                .sum();
            seen.insert(reply.id, fds);
            start = end;
        }
        buffer.drain(..start);
        fds_at_end = fds_at_end
            .into_iter()
            .filter(|(at, _)| *at > start)
            .map(|(at, count)| (at - start, count))
            .collect();
    }
    assert_eq!(seen, expected, "request id → fds received with its reply");
    assert!(
        raw.request("ping", vec![Value::Nil]).is_ok(),
        "still connected"
    );
}
