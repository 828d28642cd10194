//! Arbitrary sequences of every input of the server's state machine (`node`): requests
//! (typed, and raw bytes through the real decoder), connections, completions in any
//! order (L2's too, when the run has L2), process exits, shutdown, time steps. Typed
//! requests attach with one of three secrets (protocol 2) so that the rest reaches the
//! registry; `node_trust` fuzzes who is who itself.
//!
//! Oracles: no panic; a context is freed at most once and only one that was built; no
//! context is freed while a copy using it runs; every request is answered at most
//! once; a copy, build or blend is reported back only for what the node started;
//! after `Stopped` nothing starts (requests are refused); without L2 no L2 output ever
//! comes; each L2 write and read is asked once.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::kv_publish::{BlockEvent, BlockHash};
use kvwarden_core::l2::{L2HealthConfig, WriteOutcome};
use kvwarden_core::node::l2::{L2Fetched, L2NodeConfig, L2Presence, L2ReadId, L2WriteId};
use kvwarden_core::node::{BlendChange, Job, L2Request, PeerAction};
use kvwarden_core::node::{
    Built, ConnId, ContextId, CopyId, DeathNotice, FreeId, Input, Node, NodeConfig, Output,
    ProcessKey, Scanned, Transport,
};
use kvwarden_core::protocol::{
    Answer, BufferSpec, ErrorCode, Op, ProtocolError, RopeSpec, decode_request,
};
use kvwarden_core::{Config, InstanceId, Instant};
use libfuzzer_sys::fuzz_target;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

#[derive(Arbitrary, Debug)]
enum Step {
    Connect {
        conn: u8,
        uid: u8,
        unix: bool,
        process: Option<u8>,
    },
    Disconnect(u8),
    Raw {
        conn: u8,
        bytes: Vec<u8>,
        fds: u8,
    },
    Typed {
        conn: u8,
        op: TypedOp,
        instance: u8,
        key: u8,
        n: u16,
    },
    BuildDone {
        which: u8,
        ok: bool,
        lens: Vec<u16>,
    },
    CopyDone {
        which: u8,
        ok: bool,
    },
    BlendDone {
        which: u8,
        ok: bool,
    },
    FreeDone(u8),
    Exit(u8),
    L2Written {
        which: u8,
        outcome: u8,
    },
    L2Got {
        which: u8,
        fetched: u8,
        nbytes: u16,
    },
    L2Existed {
        which: u8,
        presence: u8,
        count: u8,
    },
    /// A pool file's seal written (or not).
    SealDone(u8),
    /// A pool file's scan: one finding per slot, from these bytes.
    ScanDone {
        which: u8,
        findings: Vec<u8>,
    },
    Shutdown,
    Step(u16),
    Tick,
}

#[derive(Arbitrary, Debug)]
enum TypedOp {
    Ping,
    Register,
    RegisterEngine,
    Unregister,
    UnregisterEngine,
    Store,
    Retrieve,
    Prepare,
    Commit,
    PrepareRetrieve,
    CommitRetrieve,
    Blend,
    Lookup,
    Attach,
    KvEvents,
    /// `describe_keys` of a version 3 description (`kvwarden_core::kv_publish`): few
    /// hashes, so that blocks share them, and parents among them.
    Describe,
}

/// A version 3 description of the block whose first shard is `key`.
fn description(key: &[u8], n: u64) -> Vec<u8> {
    use rmpv::Value;
    let next = vec![key[0].wrapping_add(1) % 8];
    let value = Value::Array(vec![
        Value::from(3),
        Value::Binary(key.to_vec()),
        Value::from(n % 4),
        if n % 2 == 1 {
            Value::from((n / 2) % 4)
        } else {
            Value::Nil
        },
        Value::Array(vec![Value::from(1)]),
        Value::Nil,
        Value::Nil,
        Value::Array(vec![Value::Binary(key.to_vec()), Value::Binary(next)]),
        Value::Nil,
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &value).unwrap();
    bytes
}

fn instance(raw: u8) -> InstanceId {
    InstanceId::new(u64::from(raw % 6) + 1).unwrap()
}

fn typed(op: &TypedOp, instance: InstanceId, key: u8, n: u16) -> Op {
    let key = vec![key % 8];
    let n = u64::from(n);
    match op {
        TypedOp::Ping => Op::Ping {
            instance: Some(instance),
        },
        TypedOp::Register => Op::RegisterKvCache {
            instance,
            buffers: vec![BufferSpec::Memfd {
                fd_index: n % 2,
                nbytes: 4096,
            }],
            model_name: "m".into(),
            world_size: 1,
        },
        TypedOp::RegisterEngine => Op::RegisterEngineDriven {
            instance,
            model_name: "m".into(),
            world_size: 1,
        },
        TypedOp::Unregister => Op::UnregisterKvCache { instance },
        TypedOp::UnregisterEngine => Op::UnregisterEngineDriven { instance },
        TypedOp::Store => Op::Store {
            instance,
            key,
            buffer: n % 2,
            offset: n % 64,
            nbytes: n % 5000,
        },
        TypedOp::Retrieve => Op::Retrieve {
            instance,
            key,
            buffer: n % 2,
            offset: n % 64,
            nbytes: n % 5000,
        },
        TypedOp::Prepare => Op::PrepareStore { instance, key },
        TypedOp::Commit => Op::CommitStore {
            instance,
            key,
            nbytes: n,
        },
        TypedOp::PrepareRetrieve => Op::PrepareRetrieve { instance, key },
        TypedOp::CommitRetrieve => Op::CommitRetrieve { instance, key },
        TypedOp::Blend => Op::RegisterBlend {
            instance,
            rope: RopeSpec {
                rotary_dim: n % 9,
                max_positions: n,
                base: 10.0,
            },
        },
        TypedOp::Lookup => Op::Lookup { keys: vec![key] },
        TypedOp::Attach => Op::Attach {
            instance,
            secret: vec![b'k' ^ (n % 3) as u8; 32],
        },
        // A new reader, or a cursor of bytes the node never gave (a resync either way).
        TypedOp::KvEvents => Op::KvEvents {
            cursor: vec![(n % 7) as u8; usize::from(n % 3 == 0) * 32],
            max: n % 5,
        },
        TypedOp::Describe => Op::DescribeKeys {
            items: vec![(key.clone(), description(&key, n))],
        },
    }
}

#[derive(Default)]
struct Ledger {
    /// Each node-scoped stream's hashes announced now.
    announced: [std::collections::HashSet<BlockHash>; 2],
    builds: Vec<ContextId>,
    built: BTreeSet<ContextId>,
    freed: BTreeSet<ContextId>,
    copies: BTreeMap<CopyId, ContextId>,
    blends: Vec<kvwarden_core::node::blend::BlendId>,
    frees: Vec<FreeId>,
    answered: BTreeSet<(ConnId, u64)>,
    stopped: bool,
    l2: bool,
    l2_writes: Vec<L2WriteId>,
    l2_gets: Vec<L2ReadId>,
    /// Delivering L2 reads not answered yet → the context whose buffer they may write.
    deliveries: BTreeMap<L2ReadId, ContextId>,
    /// Reads given up (`L2Request::Cancel`).
    cancelled: std::collections::BTreeSet<L2ReadId>,
    l2_exists: Vec<L2ReadId>,
    l2_named: BTreeSet<u64>,
    /// Slots being sealed: each at most once at a time (pinned until sealed).
    seals: Vec<usize>,
    /// Scans out: (first, count).
    scans: Vec<(usize, usize)>,
    persist: u8,
}

impl Ledger {
    fn take(&mut self, node: &mut Node) {
        while let Some(output) = node.poll_output() {
            if self.stopped {
                // Late completions may still be answered and free what they bring back;
                // nothing new starts.
                let starts = matches!(
                    output,
                    Output::Job(Job::Build { .. })
                        | Output::Job(Job::Copy { .. })
                        | Output::Job(Job::Blend { .. })
                );
                assert!(!starts, "{output:?} after Stopped");
            }
            match output {
                Output::Reply {
                    conn,
                    request_id,
                    result,
                    ..
                } => {
                    if let Ok(Answer::Events(page)) = &result {
                        // Only keys as a tenant wrote them (one byte: stored, 0..8, or
                        // adopted, 'a'..='d'), never with a tenant's prefix.
                        assert!(
                            page.events.iter().all(|e| e.key.len() == 1
                                && (e.key[0] < 8 || (b'a'..=b'd').contains(&e.key[0]))),
                            "kv_events told a key that was never stored: {page:?}"
                        );
                    }
                    assert!(
                        self.answered.insert((conn, request_id)),
                        "request {request_id} answered twice"
                    );
                }
                Output::ReplyStatus { conn, request_id } => {
                    assert!(
                        self.answered.insert((conn, request_id)),
                        "request {request_id} answered twice"
                    );
                }
                Output::Job(Job::Build { context, .. }) => self.builds.push(context),
                Output::Job(Job::Copy { copy, context, .. }) => {
                    assert!(self.built.contains(&context) && !self.freed.contains(&context));
                    self.copies.insert(copy, context);
                }
                Output::Job(Job::Blend { blend, .. }) => self.blends.push(blend),
                Output::Job(Job::Free { free, context, .. }) => {
                    assert!(
                        self.built.contains(&context),
                        "free of a context never built"
                    );
                    assert!(
                        self.freed.insert(context),
                        "context {context:?} freed twice"
                    );
                    assert!(
                        !self.copies.values().any(|&c| c == context),
                        "freed while a copy runs"
                    );
                    assert!(
                        !self.deliveries.values().any(|&c| c == context),
                        "freed while an L2 read may deliver into it"
                    );
                    self.frees.push(free);
                }
                Output::Stopped { .. } => self.stopped = true,
                Output::Publish { stream, events } => {
                    let announced = &mut self.announced[stream];
                    for event in events {
                        match event {
                            BlockEvent::Stored(meta) => assert!(
                                announced.insert(meta.block_hash.clone()),
                                "{:?} announced twice on stream {stream}",
                                meta.block_hash
                            ),
                            BlockEvent::Removed(hash) => assert!(
                                announced.remove(&hash),
                                "{hash:?} withdrawn on stream {stream}, never announced"
                            ),
                            BlockEvent::AllCleared => panic!("the node cleared a stream"),
                        }
                    }
                }
                Output::Job(Job::Seal { slot, .. }) => {
                    assert!(self.persist > 0, "a seal of an anonymous pool");
                    assert!(
                        !self.seals.contains(&slot),
                        "slot {slot} sealed twice at once: committed again while pinned"
                    );
                    self.seals.push(slot);
                }
                Output::Job(Job::Scan { first, count }) => {
                    assert!(self.persist > 1, "a scan of a pool not adopted");
                    self.scans.push((first, count));
                }
                Output::L2(L2Request::Write { write, .. }) => {
                    assert!(self.l2, "an L2 write from a node without L2");
                    assert!(
                        self.l2_named.insert(write.0),
                        "L2 write {write:?} asked twice"
                    );
                    self.l2_writes.push(write);
                }
                Output::L2(L2Request::Get { read, deliver, .. }) => {
                    assert!(self.l2, "an L2 read from a node without L2");
                    assert!(self.l2_named.insert(read.0), "L2 read {read:?} asked twice");
                    if let Some(deliver) = deliver {
                        assert!(
                            self.built.contains(&deliver.context)
                                && !self.freed.contains(&deliver.context),
                            "a delivery into a context not live"
                        );
                        self.deliveries.insert(read, deliver.context);
                    }
                    self.l2_gets.push(read);
                }
                Output::L2(L2Request::Cancel { read }) => {
                    // Any read out may be given up (row 64): a delivering one, or one
                    // for the slot only, so that no L2 thread spends time on it.
                    assert!(
                        self.l2_gets.contains(&read) || self.l2_exists.contains(&read),
                        "gave up {read:?}, not an L2 read or check out"
                    );
                    assert!(self.cancelled.insert(read), "gave up {read:?} twice");
                }
                Output::L2(L2Request::Exists { read, .. }) => {
                    assert!(self.l2, "an L2 lookup from a node without L2");
                    assert!(
                        self.l2_named.insert(read.0),
                        "L2 lookup {read:?} asked twice"
                    );
                    self.l2_exists.push(read);
                }
                Output::Blend(BlendChange::Keep { .. })
                | Output::Blend(BlendChange::Discard { .. })
                | Output::Blend(BlendChange::Drop { .. })
                | Output::Peer(PeerAction::Watch { .. })
                | Output::Peer(PeerAction::Unwatch { .. })
                | Output::Peer(PeerAction::ReadWithoutFds { .. })
                | Output::Peer(PeerAction::Disconnect { .. })
                | Output::Note(_) => {}
            }
        }
    }
}

fn pick<T: Copy>(list: &mut Vec<T>, which: u8) -> Option<T> {
    if list.is_empty() {
        return None;
    }
    let index = usize::from(which) % list.len();
    Some(list.swap_remove(index))
}

fuzz_target!(|input: (bool, u8, Vec<Step>)| {
    let (with_l2, persist, steps) = input;
    // 0: an anonymous pool; 1: a pool file whose commits are sealed; 2: one adopted.
    let persist = persist % 3;
    let config = NodeConfig {
        liveness: Config {
            reap_timeout: Duration::from_millis(300),
            registration_grace: Duration::from_millis(900),
            resolution: Duration::from_millis(20),
            stall_threshold: Duration::from_millis(200),
        },
        reap_timeout_floor: Duration::ZERO,
        num_slots: 4,
        slot_bytes: 4096,
        server_uid: 0,
        trust: kvwarden_core::node::trust::TrustConfig::default(),
        boot_id: 1,
        server_name: "fuzz".into(),
        free_watchdog: Duration::from_millis(500),
        shutdown_drain: Duration::from_millis(500),
        cuda_devices: Err("none".into()),
        connections: kvwarden_core::node::admission::ConnectionLimits::unbounded(),
        mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
        // A small window: copies wait their tenant's turn in the node (row 68).
        pool_window: 2,
        // Two tenants' blocks announced by the node (the third uid's are not).
        kv_publish: vec!["uid-0".into(), "uid-1".into()],
        l2: with_l2.then(|| L2NodeConfig {
            timeout: Duration::from_millis(50),
            write_queue_bytes: 3 * 4096,
            health: L2HealthConfig {
                failures_to_open: 2,
                probe_backoff: Duration::from_millis(100),
                probe_backoff_max: Duration::from_millis(400),
            },
        }),
    };
    let mut node = Node::new(config, Instant::ZERO).unwrap();
    let mut ledger = Ledger {
        l2: with_l2,
        persist,
        ..Ledger::default()
    };
    node.persist_pool(Instant::ZERO, persist > 0, persist > 1);
    ledger.take(&mut node);
    let mut now = Instant::ZERO;
    let mut request_id = 0u64;
    for step in steps.into_iter().take(512) {
        let input = match step {
            Step::Connect {
                conn,
                uid,
                unix,
                process,
            } => Some(Input::Connected {
                conn: ConnId(u64::from(conn % 4)),
                uid: unix.then_some(u32::from(uid % 3)),
                transport: if unix {
                    Transport::Unix
                } else {
                    Transport::Tcp
                },
                process: process.map(|p| (ProcessKey(u64::from(p % 4)), DeathNotice::PidfdByPid)),
            }),
            Step::Disconnect(conn) => Some(Input::Disconnected {
                conn: ConnId(u64::from(conn % 4)),
            }),
            Step::Raw { conn, bytes, fds } => match decode_request(&bytes) {
                Ok(request) => {
                    // The wire's id may repeat; the ledger's "answered once" needs its own.
                    request_id += 1;
                    Some(Input::Request {
                        conn: ConnId(u64::from(conn % 4)),
                        request_id: request_id << 32,
                        op: request.op,
                        fds: usize::from(fds % 3),
                    })
                }
                Err(_) => None,
            },
            Step::Typed {
                conn,
                op,
                instance: raw,
                key,
                n,
            } => {
                request_id += 1;
                Some(Input::Request {
                    conn: ConnId(u64::from(conn % 4)),
                    request_id: request_id << 32,
                    op: typed(&op, instance(raw), key, n),
                    fds: 1,
                })
            }
            Step::BuildDone { which, ok, lens } => pick(&mut ledger.builds, which).map(|context| {
                let result = if ok {
                    ledger.built.insert(context);
                    Ok(if lens.is_empty() {
                        Built::EngineDriven
                    } else {
                        Built::ServerDriven {
                            buffer_lens: lens.iter().map(|&l| u64::from(l)).collect(),
                        }
                    })
                } else {
                    Err(ProtocolError::new(ErrorCode::BadArgs, "no"))
                };
                Input::BuildDone { context, result }
            }),
            Step::CopyDone { which, ok } => {
                let copies: Vec<CopyId> = ledger.copies.keys().copied().collect();
                (!copies.is_empty()).then(|| {
                    let copy = copies[usize::from(which) % copies.len()];
                    ledger.copies.remove(&copy);
                    Input::CopyDone {
                        copy,
                        result: if ok {
                            Ok(1)
                        } else {
                            Err(ProtocolError::new(ErrorCode::Internal, "no"))
                        },
                    }
                })
            }
            Step::BlendDone { which, ok } => {
                pick(&mut ledger.blends, which).map(|blend| Input::BlendDone {
                    blend,
                    result: if ok { Ok(()) } else { Err("no".into()) },
                })
            }
            Step::FreeDone(which) => {
                pick(&mut ledger.frees, which).map(|free| Input::FreeDone { free })
            }
            Step::L2Written { which, outcome } => pick(&mut ledger.l2_writes, which).map(|write| {
                let outcome = match outcome % 3 {
                    0 => WriteOutcome::Written,
                    1 => WriteOutcome::TimedOut,
                    _ => WriteOutcome::Failed,
                };
                Input::L2Written { write, outcome }
            }),
            Step::L2Got {
                which,
                fetched,
                nbytes,
            } => pick(&mut ledger.l2_gets, which).map(|read| {
                ledger.deliveries.remove(&read);
                let fetched = match fetched % 6 {
                    0 => L2Fetched::Hit {
                        nbytes: u64::from(nbytes) % 4097,
                    },
                    5 => L2Fetched::Delivered {
                        nbytes: u64::from(nbytes) % 4097,
                    },
                    1 => L2Fetched::Absent,
                    2 => L2Fetched::Corrupt,
                    3 => L2Fetched::TimedOut,
                    _ => L2Fetched::Failed,
                };
                Input::L2Got { read, fetched }
            }),
            Step::L2Existed {
                which,
                presence,
                count,
            } => pick(&mut ledger.l2_exists, which).map(|read| {
                let presence = match presence % 3 {
                    0 => L2Presence::Present(u64::from(count)),
                    1 => L2Presence::TimedOut,
                    _ => L2Presence::Failed,
                };
                Input::L2Existed { read, presence }
            }),
            Step::Exit(process) => Some(Input::ProcessExited {
                process: ProcessKey(u64::from(process % 4)),
            }),
            Step::SealDone(which) => pick(&mut ledger.seals, which).map(|slot| Input::Sealed {
                slot,
                written: which % 2 == 0,
            }),
            Step::ScanDone { which, findings } => {
                pick(&mut ledger.scans, which).map(|(first, count)| Input::Scanned {
                    first,
                    found: (0..count)
                        .map(|i| match findings.get(i).copied().unwrap_or(0) % 5 {
                            0 => Scanned::Blank,
                            1 | 2 => Scanned::Sealed {
                                key: kvwarden_core::node::trust::scoped_key(
                                    ["uid-0", "uid-1", "uid-2", "uid-x"][usize::from(
                                        findings.get(i).copied().unwrap_or(0) / 5 % 4,
                                    )],
                                    &[b'a' + findings.get(i).copied().unwrap_or(0) % 4],
                                ),
                                len: u64::from(findings.get(i).copied().unwrap_or(0)) * 16,
                            },
                            3 => Scanned::Unsealed(kvwarden_core::seal::Unsealed::Torn),
                            _ => Scanned::Unsealed(kvwarden_core::seal::Unsealed::Malformed),
                        })
                        .collect(),
                })
            }
            Step::Shutdown => Some(Input::Shutdown),
            Step::Step(ms) => {
                now = now + Duration::from_millis(u64::from(ms % 1000));
                None
            }
            Step::Tick => {
                if let Some(at) = node.poll_timeout() {
                    now = now.max(at);
                }
                node.handle_timeout(now);
                None
            }
        };
        if let Some(input) = input {
            node.handle_input(now, input);
        }
        ledger.take(&mut node);
        let _ = node.status();
    }
});
