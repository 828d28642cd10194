//! Who is who (rows 30–33): the reference model of the node's trust rules, and the
//! invariant `non_owner_served`.
//!
//! Written from the protocol's rules (`docs/protocol.md`, wire protocol 3), not from the
//! node's code: a connection's peer is its uid (Unix socket) or nobody until a `hello`
//! whose proof answers the connection's one `auth` under the TCP token (the token itself
//! never travels; a `hello` carrying one is refused); an instance id is bound to the secret and the peer of the first
//! `attach` that claimed it, for as long as a connection that attached it is open or
//! the instance holds an entry; a connection may name an instance only once it attached
//! it; a tenant's keys are its own (`[len(name)] ++ name ++ key`, `uid-<uid>` by
//! default).
//!
//! Every request is judged before the node sees it ([`Checker::verdict`]), and its
//! answer against that verdict: a request the rules refuse must be answered `forbidden`
//! (or `unavailable` while the node shuts down) and change nothing of the instance it
//! names, neither its entries (registration, `last_seen`, `proven`) nor its blend
//! state; a read (`retrieve`, `retrieve_batch`, `lookup`) may answer with data only for
//! keys its own tenant published. Anything else is `non_owner_served` (safety).

use super::Checker;
use crate::violation::Class;
use kvwarden_core::InstanceId;
use kvwarden_core::protocol::tcp_auth::{Nonce, TcpKey};
use kvwarden_core::protocol::{Answer, Op};
use std::collections::BTreeSet;

/// A hash map with a fixed seed: lookups only, never iterated into anything judged.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Bytes of an instance secret the node accepts.
const SECRET_BYTES: std::ops::RangeInclusive<usize> = 16..=64;

/// Who a connection's peer is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Owner {
    /// A Unix-socket peer of this uid.
    Uid(u32),
    /// A TCP peer that presented the token.
    Tcp,
}

#[derive(Clone, Debug)]
struct Connection {
    /// None: a TCP peer that has not authenticated.
    owner: Option<Owner>,
    /// Its tenant's key prefix, once it has an owner.
    prefix: Option<Vec<u8>>,
    attached: Vec<InstanceId>,
    /// Whether it made its one `auth`.
    challenged: bool,
    /// Its answered `auth`'s nonces (the client's, the server's), until a `hello`.
    challenge: Option<(Nonce, Nonce)>,
}

#[derive(Clone, Debug)]
struct Binding {
    secret: Vec<u8>,
    owner: Owner,
    /// Connections that attached it.
    proofs: Vec<u64>,
}

/// What the attach rule says an `attach` gets.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttachExpect {
    /// Unbound: bound now to this secret and peer.
    Claimed,
    /// Bound to this secret and peer already.
    Proven,
    /// Bound to another secret or peer.
    Forbidden,
    /// A secret of the wrong length.
    BadArgs,
}

impl AttachExpect {
    fn label(self) -> &'static str {
        match self {
            AttachExpect::Claimed => "claimed",
            AttachExpect::Proven => "proven",
            AttachExpect::Forbidden => "forbidden",
            AttachExpect::BadArgs => "bad_args",
        }
    }
}

/// What the trust rules let one request do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It may name what it names (or names no instance).
    Allowed,
    /// It must be refused `forbidden` and change nothing; why, in words.
    Refused(&'static str),
    /// The owner's own request, refused `forbidden` for its tenant (row 35: an
    /// untrusted tenant registering engine-driven); still evidence of life.
    OwnerRefused,
    /// An `attach`: what it must get.
    Attach {
        /// The outcome.
        expect: AttachExpect,
        /// The id.
        instance: InstanceId,
        /// The secret.
        secret: Vec<u8>,
    },
    /// A TCP `hello`: whether its proof authenticates the connection.
    Hello {
        /// It does.
        authenticates: bool,
    },
    /// An `auth`: whether it must be answered with a challenge.
    Auth {
        /// It must (a TCP connection's first `auth`, with the server's token's key id).
        answered: bool,
        /// The client's nonce.
        client: Nonce,
    },
}

/// A read whose answer must not reveal another tenant's chunk.
#[derive(Clone, Debug)]
pub struct TenantRead {
    /// The reader's tenant prefix.
    pub prefix: Vec<u8>,
    /// The worker keys, in order.
    pub keys: Vec<Vec<u8>>,
    /// `lookup` (a count of leading keys) rather than a retrieve (per key).
    pub lookup: bool,
}

/// The reference model's trust state.
#[derive(Clone, Debug, Default)]
pub struct TrustModel {
    server_uid: u32,
    tcp_token: Option<Vec<u8>>,
    connections: HashMap<u64, Connection>,
    bindings: HashMap<InstanceId, Binding>,
    /// Every tenant prefix seen (a handful).
    prefixes: BTreeSet<Vec<u8>>,
}

/// `[len(name)] ++ name`.
pub fn prefix_of(name: &str) -> Vec<u8> {
    let mut prefix = Vec::with_capacity(name.len() + 1);
    prefix.push(name.len() as u8);
    prefix.extend_from_slice(name.as_bytes());
    prefix
}

/// The tenant of a Unix peer of `uid` (the simulator declares no uid tenants).
pub fn uid_tenant(uid: u32) -> String {
    format!("uid-{uid}")
}

impl TrustModel {
    fn tenant(owner: &Owner) -> String {
        match owner {
            Owner::Uid(uid) => uid_tenant(*uid),
            Owner::Tcp => crate::config::TCP_TENANT.to_string(),
        }
    }

    fn engine_driven_allowed(&self, owner: &Owner) -> bool {
        *owner == Owner::Uid(self.server_uid)
    }

    /// Whether `instance` is bound now: a binding lives while a connection that attached
    /// it is open or the instance holds an entry (`holds_entry`, asked only then).
    fn bound(
        &mut self,
        instance: InstanceId,
        holds_entry: impl FnOnce() -> bool,
    ) -> Option<&Binding> {
        let live = self
            .bindings
            .get(&instance)
            .map(|binding| !binding.proofs.is_empty() || holds_entry());
        if live == Some(false) {
            self.bindings.remove(&instance);
            return None;
        }
        self.bindings.get(&instance)
    }
}

impl Checker {
    /// The server's uid and TCP token, as the node was configured.
    pub fn set_trust(&mut self, server_uid: u32, tcp_token: Option<Vec<u8>>) {
        self.trust.server_uid = server_uid;
        self.trust.tcp_token = tcp_token;
    }

    /// A connection opened: a Unix peer of `uid`, or (None) a TCP peer.
    pub fn connected(&mut self, conn: u64, uid: Option<u32>) {
        let owner = uid.map(Owner::Uid);
        let prefix = owner.as_ref().map(|o| prefix_of(&TrustModel::tenant(o)));
        if let Some(prefix) = &prefix {
            self.trust.prefixes.insert(prefix.clone());
        }
        self.trust.connections.insert(
            conn,
            Connection {
                owner,
                prefix,
                attached: Vec::new(),
                challenged: false,
                challenge: None,
            },
        );
    }

    /// A connection closed: its proofs go with it.
    pub fn disconnected(&mut self, conn: u64) {
        let Some(connection) = self.trust.connections.remove(&conn) else {
            return;
        };
        for instance in connection.attached {
            if let Some(binding) = self.trust.bindings.get_mut(&instance) {
                binding.proofs.retain(|&c| c != conn);
            }
        }
    }

    /// The server process died: no connection, no binding.
    pub(super) fn trust_restarted(&mut self) {
        self.trust.connections.clear();
        self.trust.bindings.clear();
    }

    /// Whether a connection of a Unix peer of `uid` attaching `instance` with `secret`
    /// would be let through, as things stand: a message of the process naming its own
    /// instance is evidence of life only then (an id squatted by another secret is not
    /// the process's any more; its requests are refused).
    pub fn would_attach(&mut self, instance: InstanceId, secret: &[u8], uid: u32) -> bool {
        let shadow = &self.shadow;
        match self.trust.bound(instance, || shadow.holds(instance)) {
            None => true,
            Some(binding) => binding.secret == secret && binding.owner == Owner::Uid(uid),
        }
    }

    /// The key prefix of `conn`'s tenant; None before a TCP peer authenticated.
    pub fn tenant_prefix(&self, conn: u64) -> Option<&[u8]> {
        self.trust.connections.get(&conn)?.prefix.as_deref()
    }

    /// What the rules let `op` from `conn` do.
    pub fn verdict(&mut self, conn: u64, op: &Op) -> Verdict {
        let Some(connection) = self.trust.connections.get(&conn) else {
            return Verdict::Allowed; // a connection the node was never told of
        };
        let tcp = !matches!(connection.owner, Some(Owner::Uid(_)));
        let key = self.trust.tcp_token.as_deref().map(TcpKey::from_token);
        if let Op::Auth { id, nonce } = op {
            let answered = tcp && !connection.challenged && key.is_some_and(|k| k.id() == *id);
            return Verdict::Auth {
                answered,
                client: *nonce,
            };
        }
        if let Op::Hello { token, proof, .. } = op {
            if !tcp {
                return Verdict::Allowed;
            }
            let (owned, challenge) = (connection.owner.is_some(), connection.challenge);
            let proven = match (proof, challenge, &key) {
                // A later `hello` of a connection that proved its token already.
                (None, _, _) => owned,
                (Some(proof), Some((client, server)), Some(key)) => {
                    key.check_client(&client, &server, proof)
                }
                _ => false,
            };
            // Whatever it says, a `hello` ends the connection's challenge.
            if let Some(connection) = self.trust.connections.get_mut(&conn) {
                connection.challenge = None;
            }
            return Verdict::Hello {
                authenticates: token.is_none() && proven,
            };
        }
        let Some(owner) = connection.owner.clone() else {
            return Verdict::Refused("a TCP peer that has not authenticated");
        };
        if let Op::Attach { instance, secret } = op {
            if !SECRET_BYTES.contains(&secret.len()) {
                return Verdict::Attach {
                    expect: AttachExpect::BadArgs,
                    instance: *instance,
                    secret: secret.clone(),
                };
            }
            let shadow = &self.shadow;
            let expect = match self.trust.bound(*instance, || shadow.holds(*instance)) {
                None => AttachExpect::Claimed,
                Some(binding) if binding.secret == *secret && binding.owner == owner => {
                    AttachExpect::Proven
                }
                Some(_) => AttachExpect::Forbidden,
            };
            return Verdict::Attach {
                expect,
                instance: *instance,
                secret: secret.clone(),
            };
        }
        match op.instance() {
            None => Verdict::Allowed,
            Some(instance) if !connection.attached.contains(&instance) => {
                Verdict::Refused("its connection never attached that instance with its secret")
            }
            Some(_) => {
                if matches!(op, Op::RegisterEngineDriven { .. })
                    && !self.trust.engine_driven_allowed(&owner)
                {
                    Verdict::OwnerRefused
                } else {
                    Verdict::Allowed
                }
            }
        }
    }

    /// The node answered a request judged `verdict`; `code`: its error code, if any
    /// (`answered`: whether it was answered in the call it was handed in). Returns true
    /// when the request was one the rules let through (its answer is then read as the
    /// registry's), false when it is judged here in full.
    pub fn judge_trust(
        &mut self,
        conn: u64,
        name: &str,
        named: Option<InstanceId>,
        verdict: &Verdict,
        reply: Option<&Result<Answer, kvwarden_core::protocol::ProtocolError>>,
    ) -> bool {
        use kvwarden_core::protocol::ErrorCode;
        let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
        let refused = matches!(code, Some(ErrorCode::Forbidden | ErrorCode::Unavailable));
        // Worded only for a failure (this runs for every request).
        let what = || match named {
            Some(instance) => format!("a `{name}` naming instance {instance}"),
            None => format!("a `{name}`"),
        };
        match verdict {
            Verdict::Allowed => {
                if code == Some(ErrorCode::Forbidden) {
                    self.diverged(format!(
                        "{} was refused `forbidden`, but its connection attached that \
                         instance with its secret: the owner is refused",
                        what()
                    ));
                    return false;
                }
                true
            }
            Verdict::Refused(why) => {
                if !refused {
                    let answer = match reply {
                        None => "not at once (the node went on with it)".to_string(),
                        Some(result) => format!("{result:?}"),
                    };
                    self.fail(
                        Class::Safety,
                        "non_owner_served",
                        format!(
                            "{} from a peer that may not name it ({why}) was answered \
                             {answer}, not `forbidden`",
                            what()
                        ),
                    );
                }
                false
            }
            Verdict::OwnerRefused => {
                if code != Some(ErrorCode::Forbidden) && code != Some(ErrorCode::Unavailable) {
                    self.fail(
                        Class::Safety,
                        "non_owner_served",
                        format!(
                            "{} from a tenant the operator did not trust with engine-driven \
                             transfers (they map every tenant's L1 slots) was answered \
                             {reply:?}, not `forbidden` (row 35)",
                            what()
                        ),
                    );
                }
                false
            }
            Verdict::Attach {
                expect,
                instance,
                secret,
            } => self.judge_attach(conn, &what, reply, *expect, *instance, secret),
            Verdict::Auth { answered, client } => self.judge_auth(conn, reply, *answered, client),
            Verdict::Hello { authenticates } => self.judge_hello(conn, reply, *authenticates),
        }
    }

    /// An `attach` answered as the reference model expects: claimed, proven or refused.
    fn judge_attach(
        &mut self,
        conn: u64,
        what: &dyn Fn() -> String,
        reply: Option<&Result<Answer, kvwarden_core::protocol::ProtocolError>>,
        expect: AttachExpect,
        instance: InstanceId,
        secret: &[u8],
    ) -> bool {
        use kvwarden_core::protocol::ErrorCode;
        let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
        let got = match (reply, code) {
            (_, Some(ErrorCode::Unavailable)) => return false,
            (Some(Ok(Answer::Attached(attached))), None) => Some(attached.label().to_owned()),
            (_, Some(ErrorCode::Forbidden)) => Some("forbidden".to_string()),
            (_, Some(ErrorCode::BadArgs)) => Some("bad_args".to_string()),
            _ => None,
        };
        if got.as_deref() != Some(expect.label()) {
            let detail = format!(
                "{} was answered {reply:?}; the reference model expects {}",
                what(),
                expect.label()
            );
            if expect == AttachExpect::Forbidden {
                self.fail(Class::Safety, "non_owner_served", detail);
            } else {
                self.diverged(detail);
            }
            return false;
        }
        if expect == AttachExpect::Claimed {
            // A new capability under an old number: whatever that number did
            // before (a clean shutdown, say) was another owner's.
            self.cleanly_gone.remove(&instance);
        }
        if matches!(expect, AttachExpect::Claimed | AttachExpect::Proven) {
            self.attached(conn, instance, secret);
        }
        false
    }

    /// An `auth` answered with a challenge exactly on a TCP connection's first, its
    /// proof the server's token's.
    fn judge_auth(
        &mut self,
        conn: u64,
        reply: Option<&Result<Answer, kvwarden_core::protocol::ProtocolError>>,
        answered: bool,
        client: &Nonce,
    ) -> bool {
        let tcp = self
            .trust
            .connections
            .get(&conn)
            .is_some_and(|c| !matches!(c.owner, Some(Owner::Uid(_))));
        if let Some(connection) = self.trust.connections.get_mut(&conn)
            && tcp
        {
            connection.challenged = true;
        }
        let challenge = match reply {
            Some(Ok(Answer::Challenge(challenge))) => Some(*challenge),
            _ => None,
        };
        if challenge.is_some() != answered {
            self.diverged(format!(
                "an `auth` was answered {reply:?}; the reference model expects {}",
                if answered {
                    "a challenge (a TCP connection's first, with the token's key id)"
                } else {
                    "a refusal"
                }
            ));
            return false;
        }
        if let (Some(challenge), Some(token)) = (challenge, &self.trust.tcp_token) {
            let key = TcpKey::from_token(token);
            if !key.check_server(client, &challenge.nonce, &challenge.proof) {
                self.diverged(
                    "the server's proof in an `auth` answer does not check with its \
                     own token"
                        .to_string(),
                );
            }
            if let Some(connection) = self.trust.connections.get_mut(&conn) {
                connection.challenge = Some((*client, challenge.nonce));
            }
        }
        false
    }

    /// A TCP `hello` accepted exactly when it proves the server's token.
    fn judge_hello(
        &mut self,
        conn: u64,
        reply: Option<&Result<Answer, kvwarden_core::protocol::ProtocolError>>,
        authenticates: bool,
    ) -> bool {
        use kvwarden_core::protocol::ErrorCode;
        let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
        if code == Some(ErrorCode::Unavailable) {
            return false;
        }
        let accepted = reply.is_some_and(|r| r.is_ok());
        if accepted != authenticates {
            let detail = format!(
                "a TCP `hello` was answered {reply:?}; the reference model expects it \
                 {}",
                if authenticates {
                    "accepted (the server's token)"
                } else {
                    "refused `forbidden` (no token, or not the server's)"
                }
            );
            if authenticates {
                self.diverged(detail);
            } else {
                self.fail(Class::Safety, "non_owner_served", detail);
            }
            return false;
        }
        if accepted && let Some(connection) = self.trust.connections.get_mut(&conn) {
            let prefix = prefix_of(crate::config::TCP_TENANT);
            self.trust.prefixes.insert(prefix.clone());
            connection.owner = Some(Owner::Tcp);
            connection.prefix = Some(prefix);
        }
        false
    }

    fn attached(&mut self, conn: u64, instance: InstanceId, secret: &[u8]) {
        let Some(connection) = self.trust.connections.get_mut(&conn) else {
            return;
        };
        let Some(owner) = connection.owner.clone() else {
            return;
        };
        if !connection.attached.contains(&instance) {
            connection.attached.push(instance);
        }
        let binding = self.trust.bindings.entry(instance).or_insert(Binding {
            secret: secret.to_vec(),
            owner,
            proofs: Vec::new(),
        });
        if !binding.proofs.contains(&conn) {
            binding.proofs.push(conn);
        }
    }

    /// A refused request's instance was `before` and is `after` (entries and blend
    /// state): it must not have changed, nor been refreshed.
    pub fn refused_left_alone<T: PartialEq + std::fmt::Debug>(
        &mut self,
        name: &str,
        instance: InstanceId,
        before: &T,
        after: &T,
    ) {
        if before != after {
            self.fail(
                Class::Safety,
                "non_owner_served",
                format!(
                    "a `{name}` naming instance {instance} from a peer that may not name it was \
                     refused, yet the instance changed (entries, blend state): {before:?} → \
                     {after:?}"
                ),
            );
        }
    }

    /// A read was answered `result`: data only for keys its tenant published. Returns
    /// how many of its misses were keys another tenant published (a poacher kept out).
    pub fn read_answered(
        &mut self,
        name: &str,
        read: &TenantRead,
        result: &Result<Answer, kvwarden_core::protocol::ProtocolError>,
    ) -> u64 {
        let Ok(answer) = result else {
            return 0;
        };
        // Which keys the answer says are there.
        let (served, first_miss) = served_and_missed(read, answer);
        let scoped = |prefix: &[u8], key: &[u8]| {
            let mut scoped = prefix.to_vec();
            scoped.extend_from_slice(key);
            scoped
        };
        for index in served {
            let key = &read.keys[index];
            if !self.published.contains(&scoped(&read.prefix, key)) {
                let tenant = String::from_utf8_lossy(&read.prefix[1..]).into_owned();
                let answer = if read.lookup {
                    "counted"
                } else {
                    "answered with"
                };
                self.fail(
                    Class::Safety,
                    "non_owner_served",
                    format!(
                        "a `{name}` of tenant {tenant} {answer} the chunk under key {} (item \
                         {index}), which its tenant never stored: another tenant's chunk (row \
                         33: a tenant's keys are its own)",
                        super::hex(key)
                    ),
                );
                return 0;
            }
        }
        if self.trust.prefixes.len() < 2 {
            return 0;
        }
        let mut foreign = 0;
        for index in first_miss {
            let key = &read.keys[index];
            if self.published.contains(&scoped(&read.prefix, key)) {
                continue;
            }
            if self
                .trust
                .prefixes
                .iter()
                .any(|p| *p != read.prefix && self.published.contains(&scoped(p, key)))
            {
                foreign += 1;
            }
        }
        foreign
    }
}

/// The items of `read` that `answer` serves, and those it misses (a `lookup`: the first
/// missed only).
fn served_and_missed(read: &TenantRead, answer: &Answer) -> (Vec<usize>, Vec<usize>) {
    if read.lookup {
        let count = match answer {
            Answer::Count(count) => *count as usize,
            _ => 0,
        };
        (
            (0..count.min(read.keys.len())).collect(),
            (count..read.keys.len().min(count + 1)).collect(),
        )
    } else {
        // Per key read, whether the answer carries data.
        let answers: Vec<bool> = match answer {
            Answer::Lengths(lengths) => lengths.iter().map(Option::is_some).collect(),
            Answer::Length(length) => vec![length.is_some()],
            Answer::Pinned(pinned) => vec![pinned.is_some()],
            other => vec![other.to_value() != rmpv::Value::Nil],
        };
        let mut served = Vec::new();
        let mut missed = Vec::new();
        for (index, data) in answers.iter().enumerate().take(read.keys.len()) {
            if *data {
                served.push(index);
            } else {
                missed.push(index);
            }
        }
        (served, missed)
    }
}
