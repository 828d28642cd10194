//! Who is who (protocol 3; failure-mode rows 30–32 and 65): arbitrary interleavings of
//! connections (Unix peers of three uids, TCP peers), `auth` with arbitrary tokens'
//! key ids, `hello` with proofs made from arbitrary tokens (or the token itself),
//! `attach` with arbitrary ids and secrets (right, wrong, of any length), requests
//! naming instances (typed, and raw bytes through the real decoder), builds and copies
//! completing, disconnects, process exits, shutdown and time.
//!
//! Oracles, from a reference model of the trust rules (not from the node's code):
//! - a request naming an instance from a connection that never attached it (an
//!   `attach` the node answered `claimed` or `proven`) is answered `forbidden` in the
//!   call it was handed in (`unavailable` once shutting down), and (when `forbidden`)
//!   leaves the named instance's entries as they were (not refreshed, not changed);
//! - a TCP connection that never proved the token gets `forbidden` for everything but
//!   `auth` and `hello`; an `auth` is answered (with a proof that checks under the
//!   server's token) exactly when it is the connection's first and names the server's
//!   token; a `hello` is accepted exactly when it carries no token and its proof answers
//!   the connection's challenge under the server's token (or, with no proof, when the
//!   connection proved it already);
//! - an `attach` gets what the binding rule says: `bad_args` for a secret outside
//!   16..=64 bytes, `forbidden` for an id bound to another secret or another peer,
//!   `proven` for the same secret and peer, `claimed` for an unbound id (a binding lives
//!   while a connection that attached it is open or the instance holds an entry).
//!
//! Built with `--features planted-bugs` and run with
//! `KVWARDEN_FUZZ_PLANT=trust_any_connection`, it finds the planted bug in seconds.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::node::Job;
use kvwarden_core::node::trust::{TenantSpec, TrustConfig};
use kvwarden_core::node::{
    Built, ConnId, ContextId, CopyId, DeathNotice, Input, Node, NodeConfig, Output, ProcessKey,
    Transport,
};
use kvwarden_core::protocol::tcp_auth::{Nonce, TcpKey};
use kvwarden_core::protocol::{
    BufferSpec, Challenge, ErrorCode, Op, PROTOCOL_VERSION, ProtocolError, ReplyValue,
    RetrieveItem, RopeSpec, StoreItem, decode_request,
};
use kvwarden_core::{Config, EntryView, InstanceId, Instant, Module};
use libfuzzer_sys::fuzz_target;
use rmpv::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const TOKEN: &[u8] = b"fuzz-tcp-token-0123456789";
const CONNS: u8 = 6;

#[derive(Arbitrary, Debug)]
enum Step {
    Connect {
        conn: u8,
        uid: u8,
        tcp: bool,
        process: u8,
    },
    Disconnect(u8),
    Auth {
        conn: u8,
        token: TokenPick,
    },
    Hello {
        conn: u8,
        token: TokenPick,
        /// Protocol 2's way: the token itself in `hello`.
        old: bool,
    },
    Attach {
        conn: u8,
        instance: u8,
        secret: SecretPick,
    },
    Request {
        conn: u8,
        op: Named,
        instance: u8,
        n: u8,
    },
    Raw {
        conn: u8,
        bytes: Vec<u8>,
    },
    BuildDone {
        which: u8,
        ok: bool,
    },
    CopyDone(u8),
    Exit(u8),
    Shutdown,
    Wait(u16),
    Tick,
}

#[derive(Arbitrary, Debug)]
enum TokenPick {
    Missing,
    Right,
    /// The right token with its last byte changed.
    Near,
    Other(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum SecretPick {
    /// One of four fixed 32-byte secrets.
    Known(u8),
    /// Anything, of any length.
    Any(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Named {
    Ping,
    Register,
    RegisterEngine,
    Unregister,
    UnregisterEngine,
    Store,
    Retrieve,
    StoreBatch,
    RetrieveBatch,
    Prepare,
    Commit,
    PrepareRetrieve,
    CommitRetrieve,
    Blend,
    Lookup,
    Status,
}

/// The token a pick names (None: none).
fn picked(pick: TokenPick) -> Option<Vec<u8>> {
    match pick {
        TokenPick::Missing => None,
        TokenPick::Right => Some(TOKEN.to_vec()),
        TokenPick::Near => {
            let mut near = TOKEN.to_vec();
            near[TOKEN.len() - 1] ^= 1;
            Some(near)
        }
        TokenPick::Other(bytes) => Some(bytes),
    }
}

fn instance(raw: u8) -> InstanceId {
    InstanceId::new(u64::from(raw % 5) + 1).unwrap()
}

fn secret(pick: SecretPick) -> Vec<u8> {
    match pick {
        SecretPick::Known(which) => vec![b's' ^ (which % 4); 32],
        SecretPick::Any(bytes) => bytes.into_iter().take(80).collect(),
    }
}

fn named(op: &Named, instance: InstanceId, n: u8) -> Op {
    let key = vec![n % 4];
    let n = u64::from(n);
    match op {
        Named::Ping => Op::Ping {
            instance: Some(instance),
        },
        Named::Register => Op::RegisterKvCache {
            instance,
            buffers: vec![BufferSpec::Memfd {
                fd_index: 0,
                nbytes: 8192,
            }],
            model_name: "m".into(),
            world_size: 1,
        },
        Named::RegisterEngine => Op::RegisterEngineDriven {
            instance,
            model_name: "m".into(),
            world_size: 1,
        },
        Named::Unregister => Op::UnregisterKvCache { instance },
        Named::UnregisterEngine => Op::UnregisterEngineDriven { instance },
        Named::Store => Op::Store {
            instance,
            key,
            buffer: 0,
            offset: n % 64,
            nbytes: 4096,
        },
        Named::Retrieve => Op::Retrieve {
            instance,
            key,
            buffer: 0,
            offset: n % 64,
            nbytes: 4096,
        },
        Named::StoreBatch => Op::StoreBatch {
            instance,
            items: vec![StoreItem {
                key,
                buffer: 0,
                offset: 0,
                nbytes: 4096,
            }],
        },
        Named::RetrieveBatch => Op::RetrieveBatch {
            instance,
            items: vec![RetrieveItem {
                key,
                buffer: 0,
                offset: 0,
                nbytes: 4096,
            }],
        },
        Named::Prepare => Op::PrepareStore { instance, key },
        Named::Commit => Op::CommitStore {
            instance,
            key,
            nbytes: 4096,
        },
        Named::PrepareRetrieve => Op::PrepareRetrieve { instance, key },
        Named::CommitRetrieve => Op::CommitRetrieve { instance, key },
        Named::Blend => Op::RegisterBlend {
            instance,
            rope: RopeSpec {
                rotary_dim: 8,
                max_positions: 16,
                base: 10.0,
            },
        },
        Named::Lookup => Op::Lookup { keys: vec![key] },
        Named::Status => Op::Status,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Owner {
    Uid(u32),
    Token,
}

struct Conn {
    owner: Option<Owner>,
    attached: BTreeSet<InstanceId>,
    challenged: bool,
    /// The answered `auth`'s nonces (client, server), until a `hello`.
    challenge: Option<(Nonce, Nonce)>,
}

struct Binding {
    secret: Vec<u8>,
    owner: Owner,
    proofs: BTreeSet<u64>,
}

#[derive(Default)]
struct Model {
    conns: BTreeMap<u64, Conn>,
    bindings: BTreeMap<InstanceId, Binding>,
    shutting_down: bool,
    builds: Vec<ContextId>,
    copies: Vec<CopyId>,
}

/// What the rules say a request gets.
enum Expect {
    /// Anything the registry decides.
    Free,
    /// `forbidden` (or `unavailable`), and the instance untouched.
    Refused(Option<InstanceId>),
    Attach(InstanceId, Vec<u8>, &'static str),
    Auth(bool, Nonce),
    Hello(bool),
}

fn entries(node: &Node, instance: InstanceId) -> [Option<EntryView>; 2] {
    Module::ALL.map(|module| node.entry(instance, module))
}

impl Model {
    fn holds_entry(node: &Node, instance: InstanceId) -> bool {
        entries(node, instance).iter().any(Option::is_some)
    }

    fn expect(&mut self, node: &Node, conn: u64, op: &Op) -> Expect {
        let Some(state) = self.conns.get(&conn) else {
            return Expect::Free;
        };
        let tcp = !matches!(state.owner, Some(Owner::Uid(_)));
        let key = TcpKey::from_token(TOKEN);
        if let Op::Auth { id, nonce } = op {
            return Expect::Auth(tcp && !state.challenged && *id == key.id(), *nonce);
        }
        if let Op::Hello { token, proof, .. } = op {
            if !tcp {
                return Expect::Free;
            }
            let proven = match (proof, state.challenge) {
                (None, _) => state.owner.is_some(),
                (Some(proof), Some((client, server))) => key.check_client(&client, &server, proof),
                (Some(_), None) => false,
            };
            return Expect::Hello(token.is_none() && proven);
        }
        let Some(owner) = state.owner.clone() else {
            return Expect::Refused(op.instance());
        };
        if let Op::Attach { instance, secret } = op {
            if !(16..=64).contains(&secret.len()) {
                return Expect::Attach(*instance, secret.clone(), "bad_args");
            }
            let live = self.bindings.get(instance).is_some_and(|binding| {
                !binding.proofs.is_empty() || Self::holds_entry(node, *instance)
            });
            if !live {
                self.bindings.remove(instance);
            }
            let outcome = match self.bindings.get(instance) {
                None => "claimed",
                Some(binding) if binding.secret == *secret && binding.owner == owner => "proven",
                Some(_) => "forbidden",
            };
            return Expect::Attach(*instance, secret.clone(), outcome);
        }
        match op.instance() {
            Some(named) if !state.attached.contains(&named) => Expect::Refused(Some(named)),
            _ => Expect::Free,
        }
    }

    fn attached(&mut self, conn: u64, instance: InstanceId, secret: Vec<u8>) {
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(owner) = state.owner.clone() else {
            return;
        };
        state.attached.insert(instance);
        self.bindings
            .entry(instance)
            .or_insert(Binding {
                secret,
                owner,
                proofs: BTreeSet::new(),
            })
            .proofs
            .insert(conn);
    }

    fn disconnected(&mut self, conn: u64) {
        if let Some(state) = self.conns.remove(&conn) {
            for instance in state.attached {
                if let Some(binding) = self.bindings.get_mut(&instance) {
                    binding.proofs.remove(&conn);
                }
            }
        }
    }
}

fn code(result: &Result<Value, ProtocolError>) -> Option<ErrorCode> {
    result.as_ref().err().map(|error| error.code)
}

fuzz_target!(|steps: Vec<Step>| {
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
        trust: TrustConfig {
            tenants: vec![
                TenantSpec {
                    name: "tcp".into(),
                    uids: Vec::new(),
                    tokens: vec![TOKEN.to_vec()],
                    quota_percent: None,
                    engine_driven: false,
                },
                TenantSpec {
                    name: "team".into(),
                    uids: vec![2],
                    tokens: Vec::new(),
                    quota_percent: Some(50),
                    engine_driven: true,
                },
            ],
            nonce_secret: [3; 32],
            subuids: vec![kvwarden_core::node::trust::SubuidRange {
                owner: 1,
                start: 100,
                count: 10,
            }],
            max_tenants: Some(6),
        },
        boot_id: 1,
        server_name: "fuzz".into(),
        free_watchdog: Duration::from_millis(500),
        shutdown_drain: Duration::from_millis(500),
        cuda_devices: Err("none".into()),
        connections: kvwarden_core::node::admission::ConnectionLimits::unbounded(),
        mapped: kvwarden_core::node::mapped::MappedLimits::unbounded(),
        // A small window: copies wait their tenant's turn in the node (row 68).
        pool_window: 2,
        kv_publish: Vec::new(),
        l2: None,
    };
    #[allow(unused_mut)]
    let mut node = Node::new(config, Instant::ZERO).unwrap();
    #[cfg(feature = "planted-bugs")]
    match std::env::var("KVWARDEN_FUZZ_PLANT").as_deref() {
        Ok("trust_any_connection") => {
            node.plant(kvwarden_core::node::PlantedBug::TrustAnyConnection)
        }
        Ok("shared_keyspace") => node.plant(kvwarden_core::node::PlantedBug::SharedKeyspace),
        _ => {}
    }
    let mut model = Model::default();
    let mut now = Instant::ZERO;
    let mut request_id = 0u64;
    for step in steps.into_iter().take(400) {
        let mut request: Option<(u64, Op)> = None;
        let input = match step {
            Step::Connect {
                conn,
                uid,
                tcp,
                process,
            } => {
                let conn = u64::from(conn % CONNS);
                let uid = (!tcp).then_some(u32::from(uid % 3));
                match model.conns.entry(conn) {
                    // A shell never reuses a connection id while it is open.
                    std::collections::btree_map::Entry::Occupied(_) => None,
                    std::collections::btree_map::Entry::Vacant(slot) => {
                        slot.insert(Conn {
                            owner: uid.map(Owner::Uid),
                            attached: BTreeSet::new(),
                            challenged: false,
                            challenge: None,
                        });
                        Some(Input::Connected {
                            conn: ConnId(conn),
                            uid,
                            transport: if tcp { Transport::Tcp } else { Transport::Unix },
                            process: (!tcp).then_some((
                                ProcessKey(u64::from(process % 3)),
                                DeathNotice::PidfdByPid,
                            )),
                        })
                    }
                }
            }
            Step::Disconnect(conn) => {
                let conn = u64::from(conn % CONNS);
                model.conns.contains_key(&conn).then(|| {
                    model.disconnected(conn);
                    Input::Disconnected { conn: ConnId(conn) }
                })
            }
            Step::Auth { conn, token } => {
                let token = picked(token).unwrap_or_default();
                let op = Op::Auth {
                    id: TcpKey::from_token(&token).id(),
                    nonce: [conn; 32],
                };
                request = Some((u64::from(conn % CONNS), op));
                None
            }
            Step::Hello { conn, token, old } => {
                let conn = u64::from(conn % CONNS);
                let token = picked(token);
                // The proof the picked token makes for this connection's challenge (a
                // guess where it had none answered).
                let (client, server) = model
                    .conns
                    .get(&conn)
                    .and_then(|state| state.challenge)
                    .unwrap_or(([0; 32], [0; 32]));
                let proof = token.as_deref().map(|token| {
                    TcpKey::from_token(token)
                        .client_proof(&client, &server)
                        .to_vec()
                });
                let op = Op::Hello {
                    protocol: PROTOCOL_VERSION,
                    client: "fuzz".into(),
                    pidfd_index: None,
                    sends_fds: true,
                    token: if old { token } else { None },
                    proof,
                    wait_ms: None,
                };
                request = Some((conn, op));
                None
            }
            Step::Attach {
                conn,
                instance: raw,
                secret: pick,
            } => {
                let op = Op::Attach {
                    instance: instance(raw),
                    secret: secret(pick),
                };
                request = Some((u64::from(conn % CONNS), op));
                None
            }
            Step::Request {
                conn,
                op,
                instance: raw,
                n,
            } => {
                request = Some((u64::from(conn % CONNS), named(&op, instance(raw), n)));
                None
            }
            Step::Raw { conn, bytes } => {
                if let Ok(decoded) = decode_request(&bytes) {
                    request = Some((u64::from(conn % CONNS), decoded.op));
                }
                None
            }
            Step::BuildDone { which, ok } => (!model.builds.is_empty()).then(|| {
                let context = model
                    .builds
                    .swap_remove(usize::from(which) % model.builds.len());
                let result = if ok {
                    Ok(Built::ServerDriven {
                        buffer_lens: vec![8192],
                    })
                } else {
                    Err(ProtocolError::new(ErrorCode::Internal, "no"))
                };
                Input::BuildDone { context, result }
            }),
            Step::CopyDone(which) => (!model.copies.is_empty()).then(|| {
                let copy = model
                    .copies
                    .swap_remove(usize::from(which) % model.copies.len());
                Input::CopyDone {
                    copy,
                    result: Ok(4096),
                }
            }),
            Step::Exit(process) => Some(Input::ProcessExited {
                process: ProcessKey(u64::from(process % 3)),
            }),
            Step::Shutdown => {
                model.shutting_down = true;
                Some(Input::Shutdown)
            }
            Step::Wait(ms) => {
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
        let mut judged = None;
        if let Some((conn, op)) = request {
            if model.conns.contains_key(&conn) {
                request_id += 1;
                let expect = model.expect(&node, conn, &op);
                let before = op.instance().map(|named| (named, entries(&node, named)));
                // Builds start only for the conversations the fuzzer drives to them.
                let fds = usize::from(matches!(op, Op::RegisterKvCache { .. }));
                node.handle_input(
                    now,
                    Input::Request {
                        conn: ConnId(conn),
                        request_id,
                        op,
                        fds,
                    },
                );
                judged = Some((conn, request_id, expect, before));
            }
        } else if let Some(input) = input {
            node.handle_input(now, input);
        }
        let mut reply = None;
        while let Some(output) = node.poll_output() {
            match output {
                Output::Reply {
                    conn,
                    request_id: id,
                    result,
                    ..
                } if judged
                    .as_ref()
                    .is_some_and(|(c, r, _, _)| ConnId(*c) == conn && *r == id) =>
                {
                    reply = Some(result.map(|answer| answer.to_value()));
                }
                Output::Job(Job::Build { context, .. }) => model.builds.push(context),
                Output::Job(Job::Copy { copy, .. }) => model.copies.push(copy),
                _ => {}
            }
        }
        let Some((conn, _, expect, before)) = judged else {
            continue;
        };
        match expect {
            Expect::Free => {}
            Expect::Refused(named) => {
                let answer = reply.as_ref().map(code);
                assert!(
                    matches!(
                        answer,
                        Some(Some(ErrorCode::Forbidden | ErrorCode::Unavailable))
                    ),
                    "a request naming {named:?} from connection {conn}, which never attached it \
                     (or never authenticated), was answered {reply:?}, not `forbidden`"
                );
                // A shutdown frees everything, whoever asks: only a request refused
                // `forbidden` is judged on the instance it names.
                let forbidden = matches!(answer, Some(Some(ErrorCode::Forbidden)));
                if let Some((named, before)) = before.filter(|_| forbidden) {
                    assert_eq!(
                        before,
                        entries(&node, named),
                        "a refused request changed or refreshed instance {named} (answered \
                         {reply:?}, shutting down: {})",
                        model.shutting_down
                    );
                }
            }
            Expect::Attach(instance, secret, outcome) => {
                let Some(result) = reply else {
                    panic!("attach of {instance} not answered at once");
                };
                if code(&result) == Some(ErrorCode::Unavailable) && model.shutting_down {
                    continue;
                }
                let got = match &result {
                    Ok(Value::Map(fields)) => fields
                        .iter()
                        .find(|(k, _)| k.as_str() == Some("outcome"))
                        .and_then(|(_, v)| v.as_str())
                        .unwrap_or("?")
                        .to_string(),
                    Err(error) if error.code == ErrorCode::Forbidden => "forbidden".into(),
                    Err(error) if error.code == ErrorCode::BadArgs => "bad_args".into(),
                    other => format!("{other:?}"),
                };
                assert_eq!(
                    got, outcome,
                    "attach of {instance} on connection {conn}: {result:?}"
                );
                if outcome == "claimed" || outcome == "proven" {
                    model.attached(conn, instance, secret);
                }
            }
            Expect::Auth(answered, client) => {
                let Some(result) = reply else {
                    panic!("auth not answered at once");
                };
                if code(&result) == Some(ErrorCode::Unavailable) && model.shutting_down {
                    continue;
                }
                let Some(state) = model.conns.get_mut(&conn) else {
                    continue;
                };
                let tcp = !matches!(state.owner, Some(Owner::Uid(_)));
                state.challenged |= tcp;
                let challenge = result.as_ref().ok().map(|value| {
                    Challenge::from_value(value).expect("an answered `auth` is a challenge")
                });
                assert_eq!(
                    challenge.is_some(),
                    answered,
                    "an auth on connection {conn}: {result:?}"
                );
                if let Some(challenge) = challenge {
                    assert!(
                        TcpKey::from_token(TOKEN).check_server(
                            &client,
                            &challenge.nonce,
                            &challenge.proof
                        ),
                        "the server's proof does not check under its token"
                    );
                    state.challenge = Some((client, challenge.nonce));
                }
            }
            Expect::Hello(authenticates) => {
                let Some(result) = reply else {
                    panic!("hello not answered at once");
                };
                if code(&result) == Some(ErrorCode::Unavailable) && model.shutting_down {
                    continue;
                }
                if let Some(state) = model.conns.get_mut(&conn) {
                    state.challenge = None; // a `hello` ends the challenge, whatever it says
                }
                assert_eq!(
                    result.is_ok(),
                    authenticates,
                    "a TCP hello on connection {conn}: {result:?}"
                );
                if authenticates && let Some(state) = model.conns.get_mut(&conn) {
                    state.owner = Some(Owner::Token);
                }
            }
        }
    }
    let _ = node.status();
});
