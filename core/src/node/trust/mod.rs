//! Who is who: the identity behind each connection, the tenant it acts for, and the
//! capabilities (instance secrets) it has proven.
//!
//! Three rules live here and nowhere else:
//!
//! - **An instance is a capability, not a number.** The worker draws a secret with its
//!   instance id and proves it on every connection (`attach`); the node keeps only the
//!   secret's BLAKE3 digest, compared in constant time. A connection may name an
//!   instance only once it has attached it. The first `attach` of an unbound id binds
//!   it to that secret and to the caller's identity (uid, or TCP tenant); the binding
//!   lives while the instance has an entry or a connection that attached it. Nobody,
//!   the server's own uid included, acts on an instance it has not proven.
//! - **TCP is authenticated or refused.** A TCP connection presents a token in `hello`;
//!   until it has, every request on it is `forbidden`.
//! - **A tenant's keys are its own.** The tenant is derived from the peer (its uid, or
//!   its token), never from what it says; every key it names is prefixed with its
//!   tenant's name, so one tenant's chunk is never another's.

mod config;
mod keys;

use crate::id::InstanceId;
use crate::protocol::tcp_auth::{self, Nonce, TcpKey};
use crate::protocol::{Attached, Challenge, ErrorCode, ProtocolError};
use std::collections::HashMap;

/// Bytes of an instance secret, at least (128 bits of entropy).
pub const MIN_SECRET_BYTES: usize = 16;
/// Bytes of an instance secret, at most.
pub const MAX_SECRET_BYTES: usize = 64;
/// Instances one connection may attach.
pub const MAX_ATTACHED_PER_CONNECTION: usize = 1024;
/// Tenants the node tracks at once (the operator's and one per uid that holds something):
/// a tenant made for a uid that holds nothing is forgotten to make room (row 70).
pub const MAX_TENANTS: usize = 65_536;
/// Bytes of a tenant name.
pub const MAX_TENANT_NAME_BYTES: usize = 64;

/// A tenant, by its index in the node's table.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u32);

pub use config::{SubuidRange, TenantSpec, TrustConfig, TrustConfigError};

/// Who a peer is, as far as the node can tell.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Identity {
    /// A Unix-socket peer (`SO_PEERCRED`).
    Uid(u32),
    /// A TCP peer that proved it holds a token of this tenant.
    Token(TenantId),
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Uid(uid) => write!(f, "uid {uid}"),
            Identity::Token(tenant) => write!(f, "a TCP peer of tenant #{}", tenant.0),
        }
    }
}

/// A TCP peer's `auth`, until its `hello` proves it: which token, and both nonces.
#[derive(Debug)]
struct Challenged {
    /// Index in the node's token keys.
    key: usize,
    client: Nonce,
    server: Nonce,
}

/// What the node knows of one connection's peer.
#[derive(Debug, Default)]
pub struct Peer {
    /// None: a TCP peer that has not proven a token yet.
    identity: Option<Identity>,
    tenant: Option<TenantId>,
    /// The instances it has attached (one for a worker; a small list).
    attached: Vec<InstanceId>,
    /// Its `auth`, until a `hello` answers it (right or wrong).
    challenge: Option<Challenged>,
    /// Whether it made its one `auth`.
    challenged: bool,
}

impl Peer {
    /// The tenant it acts for; None before a TCP peer authenticated.
    pub fn tenant(&self) -> Option<TenantId> {
        self.tenant
    }

    /// Whether it is answering a challenge: its `auth` named a token of the server.
    pub fn has_challenge(&self) -> bool {
        self.challenge.is_some()
    }

    /// Whether it has attached `instance`.
    #[inline]
    pub fn has_attached(&self, instance: InstanceId) -> bool {
        self.attached.contains(&instance)
    }
}

struct Tenant {
    name: String,
    /// `len(name) | name`: what its keys are prefixed with.
    prefix: Vec<u8>,
    quota_percent: Option<u32>,
    engine_driven: bool,
    /// The uid it was made for on the fly (`uid-<uid>`; not the operator's, not the
    /// server's own): such a tenant is forgotten once it holds nothing, and this is
    /// None from then on.
    made_for: Option<u32>,
    /// Forgotten: its id is free for another.
    gone: bool,
}

struct Claim {
    digest: blake3::Hash,
    owner: Identity,
    /// Connections that attached it.
    proofs: u32,
}

/// One tenant's row for status pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantView {
    /// The tenant.
    pub tenant: TenantId,
    /// Its name.
    pub name: String,
    /// Its quota in percent of the pool (None: a fair share).
    pub quota_percent: Option<u32>,
    /// Whether it may register engine-driven.
    pub engine_driven: bool,
}

/// The trust component: tenants, tokens, and the instances' bindings.
pub struct Trust {
    tenants: Vec<Tenant>,
    by_uid: HashMap<u32, TenantId>,
    /// Ids of forgotten tenants, free for new ones.
    free: Vec<TenantId>,
    max_tenants: usize,
    subuids: Vec<SubuidRange>,
    tokens: Vec<(TcpKey, TenantId)>,
    nonce_secret: [u8; 32],
    /// Challenges made: the next server nonce's count.
    challenges: u64,
    claims: HashMap<InstanceId, Claim>,
    forbidden_total: u64,
}

fn forbidden(message: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::Forbidden, message)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TENANT_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Trust {
    /// Whether `name` is a tenant of this node, now or once its uid connects: an
    /// operator's (`--tenant`), or `uid-<uid>`.
    pub fn names_tenant(&self, name: &str) -> bool {
        self.tenants.iter().any(|t| t.name == name)
            || name
                .strip_prefix("uid-")
                .and_then(|uid| uid.parse::<u32>().ok())
                .is_some_and(|uid| format!("uid-{uid}") == name)
    }

    /// The tenants of `config`; `server_uid`'s own tenant may register engine-driven.
    pub fn new(config: &TrustConfig, server_uid: u32) -> Result<Trust, TrustConfigError> {
        let mut trust = Trust {
            tenants: Vec::new(),
            by_uid: HashMap::new(),
            free: Vec::new(),
            max_tenants: config.max_tenants.unwrap_or(MAX_TENANTS).max(1),
            subuids: config.subuids.clone(),
            tokens: Vec::new(),
            nonce_secret: config.nonce_secret,
            challenges: 0,
            claims: HashMap::new(),
            forbidden_total: 0,
        };
        for spec in &config.tenants {
            if !valid_name(&spec.name) || spec.name.starts_with("uid-") {
                return Err(TrustConfigError::BadName(spec.name.clone()));
            }
            if trust.tenants.iter().any(|t| t.name == spec.name) {
                return Err(TrustConfigError::DuplicateName(spec.name.clone()));
            }
            if let Some(percent) = spec.quota_percent
                && !(1..=100).contains(&percent)
            {
                return Err(TrustConfigError::BadQuota {
                    name: spec.name.clone(),
                    percent,
                });
            }
            let id = trust.add_tenant(spec.name.clone(), spec.quota_percent, spec.engine_driven);
            for &uid in &spec.uids {
                if let Some(&first) = trust.by_uid.get(&uid) {
                    return Err(TrustConfigError::DuplicateUid {
                        uid,
                        first: trust.name(first).to_owned(),
                        second: spec.name.clone(),
                    });
                }
                trust.by_uid.insert(uid, id);
            }
            for token in &spec.tokens {
                if token.len() < MIN_SECRET_BYTES {
                    return Err(TrustConfigError::ShortToken(spec.name.clone()));
                }
                let key = TcpKey::from_token(token);
                if let Some(&(_, first)) = trust.tokens.iter().find(|(k, _)| k.id() == key.id()) {
                    return Err(TrustConfigError::DuplicateToken {
                        first: trust.name(first).to_owned(),
                        second: spec.name.clone(),
                    });
                }
                trust.tokens.push((key, id));
            }
        }
        if !trust.by_uid.contains_key(&server_uid) {
            let own = trust.add_tenant(format!("uid-{server_uid}"), None, true);
            trust.by_uid.insert(server_uid, own);
        }
        Ok(trust)
    }

    fn add_tenant(&mut self, name: String, quota_percent: Option<u32>, engine: bool) -> TenantId {
        let tenant = Tenant {
            prefix: scoped_key(&name, b""),
            name,
            quota_percent,
            engine_driven: engine,
            made_for: None,
            gone: false,
        };
        if let Some(id) = self.free.pop() {
            self.tenants[id.0 as usize] = tenant;
            return id;
        }
        self.tenants.push(tenant);
        TenantId(self.tenants.len() as u32 - 1)
    }

    /// The uid a peer of `uid` counts as, for its tenant and its share of the
    /// connections: the owner of a subordinate range it is in (row 69), unless an
    /// operator's tenant names `uid` itself; else `uid`.
    pub fn counted_uid(&self, uid: u32) -> u32 {
        let named = self
            .by_uid
            .get(&uid)
            .is_some_and(|&tenant| self.tenants[tenant.0 as usize].made_for.is_none());
        if named {
            return uid;
        }
        self.subuids
            .iter()
            .find(|range| range.holds(uid))
            .map_or(uid, |range| range.owner)
    }

    /// Whether a peer of `uid` would find no tenant: it has none yet and the node
    /// tracks as many as it may (the node then forgets those that hold nothing).
    pub fn needs_room(&self, uid: u32) -> bool {
        !self.by_uid.contains_key(&self.counted_uid(uid)) && self.live_tenants() >= self.max_tenants
    }

    /// Tenants tracked now.
    pub fn live_tenants(&self) -> usize {
        self.tenants.len() - self.free.len()
    }

    /// Tenants made on the fly for a uid: those the node may forget ([`Trust::forget`]).
    pub fn made_on_the_fly(&self) -> impl Iterator<Item = TenantId> + '_ {
        self.tenants
            .iter()
            .enumerate()
            .filter(|(_, tenant)| tenant.made_for.is_some())
            .map(|(index, _)| TenantId(index as u32))
    }

    /// Whether `tenant` was made on the fly for a uid (and is not forgotten).
    pub fn made_for_a_uid(&self, tenant: TenantId) -> bool {
        self.tenants
            .get(tenant.0 as usize)
            .is_some_and(|t| t.made_for.is_some())
    }

    /// Forgets `tenant`, made on the fly for a uid, which holds nothing (the node
    /// checked: no connection, entry, L1 slot, mapped byte or queued copy): its uid
    /// gets a tenant anew when it comes back, under the same name, so the same keys.
    pub fn forget(&mut self, tenant: TenantId) {
        let Some(entry) = self.tenants.get_mut(tenant.0 as usize) else {
            return;
        };
        let Some(uid) = entry.made_for.take() else {
            return; // the operator's, or the server's own: kept
        };
        entry.gone = true;
        self.by_uid.remove(&uid);
        self.free.push(tenant);
    }

    /// The tenant whose keyspace a node key names (`len | name | key`, [`scoped_key`]),
    /// for a chunk a restarted server adopts (row 71): the operator's tenant of that
    /// name, else uid N's own for `uid-N` (made now, as when N connects). None when no
    /// tenant of that name may exist now: the operator dropped it, N now counts as
    /// another uid's (`--subuid-file`), or the bound on tenants is reached.
    pub fn tenant_of_key(&mut self, node_key: &[u8]) -> Option<TenantId> {
        let (&len, rest) = node_key.split_first()?;
        let name = std::str::from_utf8(rest.get(..usize::from(len))?).ok()?;
        if let Some(index) = self
            .tenants
            .iter()
            .position(|tenant| !tenant.gone && tenant.name == name)
        {
            return Some(TenantId(index as u32));
        }
        let uid: u32 = name.strip_prefix("uid-")?.parse().ok()?;
        if format!("uid-{uid}") != name || self.counted_uid(uid) != uid {
            return None;
        }
        self.tenant_of_uid(uid)
    }

    /// The tenant of a Unix-socket peer of `uid`: the operator's, else its own (its
    /// subordinate range's owner's).
    fn tenant_of_uid(&mut self, uid: u32) -> Option<TenantId> {
        let uid = self.counted_uid(uid);
        if let Some(&tenant) = self.by_uid.get(&uid) {
            return Some(tenant);
        }
        if self.live_tenants() >= self.max_tenants {
            return None;
        }
        let tenant = self.add_tenant(format!("uid-{uid}"), None, false);
        self.tenants[tenant.0 as usize].made_for = Some(uid);
        self.by_uid.insert(uid, tenant);
        Some(tenant)
    }

    /// A new connection's peer: a Unix peer is its uid (and its tenant) at once; a TCP
    /// peer is nobody until it proves it holds a token.
    pub fn connect(&mut self, uid: Option<u32>) -> Peer {
        match uid {
            Some(uid) => Peer {
                identity: Some(Identity::Uid(uid)),
                tenant: self.tenant_of_uid(uid),
                attached: Vec::new(),
                ..Peer::default()
            },
            None => Peer::default(),
        }
    }

    /// `auth` over TCP: the challenge for the token of key id `id`, once per
    /// connection. The answer proves the server holds that token.
    pub fn challenge(
        &mut self,
        peer: &mut Peer,
        id: &[u8],
        client: &Nonce,
    ) -> Result<Challenge, ProtocolError> {
        if peer.challenged {
            self.forbidden_total += 1;
            return Err(forbidden(
                "`auth`: this connection made its challenge already (one a connection); \
                 open a new connection to authenticate again"
                    .into(),
            ));
        }
        peer.challenged = true;
        let Some(key) = self.tokens.iter().position(|(key, _)| key.id() == id) else {
            self.forbidden_total += 1;
            return Err(forbidden(
                "`auth`: no token of this server has this key id: the client's token is not \
                 one the server accepts; use the contents of the file its --tcp-token-file \
                 (or a --tenant's token-file) names"
                    .into(),
            ));
        };
        let server = tcp_auth::server_nonce(&self.nonce_secret, self.challenges);
        self.challenges += 1;
        let proof = self.tokens[key].0.server_proof(client, &server);
        peer.challenge = Some(Challenged {
            key,
            client: *client,
            server,
        });
        Ok(Challenge {
            nonce: server,
            proof,
        })
    }

    /// `hello` over TCP: its `proof` must answer this connection's `auth`. A
    /// connection that proved its token already may say `hello` again without one. A
    /// `token` (what protocol 2 sent) is refused, naming the change.
    pub fn authenticate(
        &mut self,
        peer: &mut Peer,
        proof: Option<&[u8]>,
        token: Option<&[u8]>,
    ) -> Result<(), ProtocolError> {
        if token.is_some() {
            self.forbidden_total += 1;
            return Err(forbidden(format!(
                "`hello`: this server (protocol {}) takes no token in `hello`: a TCP client \
                 proves it holds the token without sending it (`auth`, then `hello` with \
                 options {{\"proof\": ...}}; docs/protocol.md). Upgrade this client to one \
                 of protocol {} (kvwarden's Rust and Python clients), and treat a token an \
                 older client has sent across a network others can read as exposed",
                crate::protocol::PROTOCOL_VERSION,
                crate::protocol::PROTOCOL_VERSION,
            )));
        }
        let Some(proof) = proof else {
            if matches!(peer.identity, Some(Identity::Token(_))) {
                return Ok(());
            }
            self.forbidden_total += 1;
            return Err(forbidden(
                "`hello` over TCP must answer an `auth`: send `auth` with your token's key id \
                 and a nonce, check the server's proof, then `hello` with options \
                 {\"proof\": <your proof>} (docs/protocol.md); nothing else is answered on \
                 this connection until it does"
                    .into(),
            ));
        };
        let Some(challenge) = peer.challenge.take() else {
            self.forbidden_total += 1;
            return Err(forbidden(
                "`hello`: a proof with no `auth` to answer on this connection; send `auth` \
                 first (one a connection)"
                    .into(),
            ));
        };
        let (key, tenant) = &self.tokens[challenge.key];
        if !key.check_client(&challenge.client, &challenge.server, proof) {
            self.forbidden_total += 1;
            return Err(forbidden(
                "`hello`: the proof does not answer this connection's `auth`: the client \
                 does not hold the token of the key id it sent; open a new connection with \
                 the contents of the server's --tcp-token-file"
                    .into(),
            ));
        }
        let tenant = *tenant;
        if let Some(Identity::Token(already)) = peer.identity
            && already != tenant
        {
            self.forbidden_total += 1;
            return Err(forbidden(
                "`hello`: this connection authenticated as another tenant already; \
                 open a new connection for that token"
                    .into(),
            ));
        }
        peer.identity = Some(Identity::Token(tenant));
        peer.tenant = Some(tenant);
        Ok(())
    }

    /// Takes back what an `authenticate` just gave (its connection had no place in its
    /// tenant's share): the peer is nobody again, and its challenge is spent.
    pub fn forget_identity(&mut self, peer: &mut Peer) {
        peer.identity = None;
        peer.tenant = None;
    }

    /// Refuses every request but `hello` from a peer that has not authenticated.
    #[inline]
    pub fn require_identity(&mut self, peer: &Peer, op: &str) -> Result<(), ProtocolError> {
        if peer.identity.is_some() && peer.tenant.is_some() {
            return Ok(());
        }
        self.forbidden_total += 1;
        Err(forbidden(if peer.identity.is_none() {
            format!(
                "`{op}`: this TCP connection has not authenticated; send `auth`, then \
                 `hello` with its proof, keyed by the contents of the server's \
                 --tcp-token-file (docs/protocol.md), first"
            )
        } else {
            format!(
                "`{op}`: the server tracks {} tenants already, each holding something, and \
                 gave this uid none; ask the operator to join uids into tenants (--tenant) or \
                 to list subordinate uids (--subuid-file)",
                self.max_tenants
            )
        }))
    }

    /// `attach`: proves `instance` with `secret` on this connection, binding the id if
    /// it is unbound.
    pub fn attach(
        &mut self,
        peer: &mut Peer,
        instance: InstanceId,
        secret: &[u8],
    ) -> Result<Attached, ProtocolError> {
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&secret.len()) {
            return Err(ProtocolError::new(
                ErrorCode::BadArgs,
                format!(
                    "`attach`: the secret has {} bytes; draw {MIN_SECRET_BYTES} to \
                     {MAX_SECRET_BYTES} bytes from the OS (32 is usual) with the instance id \
                     and keep it for the worker's life",
                    secret.len()
                ),
            ));
        }
        let Some(identity) = peer.identity else {
            return Err(forbidden("`attach`: authenticate first".into()));
        };
        let digest = blake3::hash(secret);
        let outcome = match self.claims.get(&instance) {
            Some(claim) if claim.digest == digest && claim.owner == identity => {
                if peer.has_attached(instance) {
                    return Ok(Attached::Proven);
                }
                Attached::Proven
            }
            Some(claim) => {
                self.forbidden_total += 1;
                let whose = if claim.owner == identity {
                    "another secret".to_string()
                } else {
                    format!("another peer ({})", claim.owner)
                };
                return Err(forbidden(format!(
                    "`attach`: instance {instance} is bound to {whose}; a worker that finds \
                     its id taken draws a fresh instance id and secret and attaches those"
                )));
            }
            None => Attached::Claimed,
        };
        if peer.attached.len() >= MAX_ATTACHED_PER_CONNECTION {
            return Err(ProtocolError::new(
                ErrorCode::Overloaded,
                format!(
                    "`attach`: this connection attached {MAX_ATTACHED_PER_CONNECTION} \
                     instances already; use one connection per few instances"
                ),
            ));
        }
        let claim = self.claims.entry(instance).or_insert(Claim {
            digest,
            owner: identity,
            proofs: 0,
        });
        claim.proofs += 1;
        peer.attached.push(instance);
        Ok(outcome)
    }

    /// Refuses a request naming `instance` from a connection that has not attached it.
    /// Counted; the caller refreshes nothing.
    #[inline]
    pub fn check(
        &mut self,
        peer: &Peer,
        instance: InstanceId,
        op: &str,
    ) -> Result<(), ProtocolError> {
        if peer.has_attached(instance) {
            return Ok(());
        }
        self.forbidden_total += 1;
        Err(forbidden(format!(
            "`{op}`: this connection has not attached instance {instance}; send `attach \
             [instance_id, secret]` with the secret drawn with the id (every connection, \
             after hello), then retry. Only the worker holding the secret may name an \
             instance"
        )))
    }

    /// A connection went: its proofs go with it. Returns the instances nobody has
    /// attached any more; the node drops their bindings unless they hold entries
    /// ([`Trust::release`]).
    pub fn disconnect(&mut self, peer: Peer) -> Vec<InstanceId> {
        let mut orphaned = Vec::new();
        for instance in peer.attached {
            if let Some(claim) = self.claims.get_mut(&instance) {
                claim.proofs = claim.proofs.saturating_sub(1);
                if claim.proofs == 0 {
                    orphaned.push(instance);
                }
            }
        }
        orphaned
    }

    /// Drops `instance`'s binding when no connection has attached it; the node calls
    /// this once the instance holds no entry. The id is free again.
    pub fn release(&mut self, instance: InstanceId) {
        if self
            .claims
            .get(&instance)
            .is_some_and(|claim| claim.proofs == 0)
        {
            self.claims.remove(&instance);
        }
    }

    /// The prefix of `tenant`'s keys.
    #[inline]
    pub fn key_prefix(&self, tenant: TenantId) -> &[u8] {
        &self.tenants[tenant.0 as usize].prefix
    }

    /// `tenant`'s name.
    pub fn name(&self, tenant: TenantId) -> &str {
        &self.tenants[tenant.0 as usize].name
    }

    /// Whether `tenant` may register engine-driven.
    pub fn engine_driven_allowed(&self, tenant: TenantId) -> bool {
        self.tenants[tenant.0 as usize].engine_driven
    }

    /// Every tenant, in the order they became known.
    pub fn tenants(&self) -> Vec<TenantView> {
        self.tenants
            .iter()
            .enumerate()
            .filter(|(_, tenant)| !tenant.gone)
            .map(|(index, tenant)| TenantView {
                tenant: TenantId(index as u32),
                name: tenant.name.clone(),
                quota_percent: tenant.quota_percent,
                engine_driven: tenant.engine_driven,
            })
            .collect()
    }

    /// Requests refused `forbidden` so far.
    pub fn forbidden_total(&self) -> u64 {
        self.forbidden_total
    }

    /// Instance ids bound now.
    pub fn bindings(&self) -> usize {
        self.claims.len()
    }
}

pub use keys::{scope_keys, scoped_key};

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> InstanceId {
        InstanceId::new(n).unwrap()
    }

    #[test]
    fn an_attached_secret_is_proven_and_another_is_forbidden() {
        let mut trust = Trust::new(&TrustConfig::default(), 0).unwrap();
        let mut owner = trust.connect(Some(1000));
        let mut impostor = trust.connect(Some(1000));
        let secret = [7u8; 32];
        assert_eq!(
            trust.attach(&mut owner, id(5), &secret),
            Ok(Attached::Claimed)
        );
        assert!(trust.check(&owner, id(5), "ping").is_ok());
        // Same uid, no secret: forbidden.
        let refused = trust.check(&impostor, id(5), "ping").unwrap_err();
        assert_eq!(refused.code, ErrorCode::Forbidden);
        let wrong = trust.attach(&mut impostor, id(5), &[8u8; 32]).unwrap_err();
        assert_eq!(wrong.code, ErrorCode::Forbidden);
        assert!(trust.check(&impostor, id(5), "ping").is_err());
        // The owner's second connection proves the same secret.
        let mut again = trust.connect(Some(1000));
        assert_eq!(
            trust.attach(&mut again, id(5), &secret),
            Ok(Attached::Proven)
        );
        assert_eq!(trust.forbidden_total(), 3);
    }

    #[test]
    fn the_right_secret_from_another_uid_is_forbidden() {
        let mut trust = Trust::new(&TrustConfig::default(), 0).unwrap();
        let mut owner = trust.connect(Some(1000));
        let mut other = trust.connect(Some(1001));
        let secret = [1u8; 16];
        trust.attach(&mut owner, id(9), &secret).unwrap();
        let refused = trust.attach(&mut other, id(9), &secret).unwrap_err();
        assert_eq!(refused.code, ErrorCode::Forbidden);
        assert!(refused.message.contains("uid 1000"), "{}", refused.message);
    }

    #[test]
    fn a_binding_goes_when_no_connection_and_no_entry_hold_it() {
        let mut trust = Trust::new(&TrustConfig::default(), 0).unwrap();
        let mut owner = trust.connect(Some(1000));
        trust.attach(&mut owner, id(3), &[2u8; 32]).unwrap();
        assert_eq!(trust.disconnect(owner), vec![id(3)]);
        assert_eq!(
            trust.bindings(),
            1,
            "released only by the node, entries gone"
        );
        trust.release(id(3));
        assert_eq!(trust.bindings(), 0);
        let mut squatter = trust.connect(Some(1001));
        assert_eq!(
            trust.attach(&mut squatter, id(3), &[4u8; 32]),
            Ok(Attached::Claimed),
            "a free id may be claimed by anyone"
        );
    }

    #[test]
    fn secrets_shorter_than_128_bits_are_refused() {
        let mut trust = Trust::new(&TrustConfig::default(), 0).unwrap();
        let mut peer = trust.connect(Some(1000));
        let error = trust.attach(&mut peer, id(1), &[0u8; 15]).unwrap_err();
        assert_eq!(error.code, ErrorCode::BadArgs);
        assert!(trust.attach(&mut peer, id(1), &[0u8; 16]).is_ok());
    }

    const TOKEN: &[u8] = b"0123456789abcdef-token";

    fn tcp_trust() -> Trust {
        let config = TrustConfig {
            tenants: vec![TenantSpec {
                name: "team-a".into(),
                uids: vec![1000, 1001],
                tokens: vec![TOKEN.to_vec()],
                quota_percent: Some(50),
                engine_driven: false,
            }],
            nonce_secret: [7; 32],
            ..TrustConfig::default()
        };
        Trust::new(&config, 0).unwrap()
    }

    /// A client's side of the handshake with `token`: `auth`, the server's proof
    /// checked, the client's proof for `hello`.
    fn handshake(
        trust: &mut Trust,
        peer: &mut Peer,
        token: &[u8],
        client: Nonce,
    ) -> Result<Vec<u8>, ProtocolError> {
        let key = TcpKey::from_token(token);
        let challenge = trust.challenge(peer, &key.id(), &client)?;
        assert!(
            key.check_server(&client, &challenge.nonce, &challenge.proof),
            "the server proves it holds the token"
        );
        Ok(key.client_proof(&client, &challenge.nonce).to_vec())
    }

    #[test]
    fn tcp_peers_prove_their_token_and_act_for_its_tenant() {
        let mut trust = tcp_trust();
        let mut tcp = trust.connect(None);
        assert!(trust.require_identity(&tcp, "ping").is_err());
        // The control: the token's proof authenticates.
        let proof = handshake(&mut trust, &mut tcp, TOKEN, [1; 32]).unwrap();
        trust.authenticate(&mut tcp, Some(&proof), None).unwrap();
        assert!(trust.require_identity(&tcp, "ping").is_ok());
        // A later `hello` on the same connection needs no proof.
        trust.authenticate(&mut tcp, None, None).unwrap();
        let unix = trust.connect(Some(1001));
        assert_eq!(tcp.tenant(), unix.tenant(), "joined into one tenant");
        let alone = trust.connect(Some(1002));
        assert_ne!(alone.tenant(), unix.tenant());
        assert_eq!(trust.name(alone.tenant().unwrap()), "uid-1002");
        let own = trust.connect(Some(0)).tenant().unwrap();
        assert!(trust.engine_driven_allowed(own));
        assert!(!trust.engine_driven_allowed(unix.tenant().unwrap()));
    }

    #[test]
    fn no_token_travels_and_no_proof_serves_twice() {
        let mut trust = tcp_trust();
        // Protocol 2's token in `hello`, even the right one: refused, naming the change.
        let mut old = trust.connect(None);
        let error = trust.authenticate(&mut old, None, Some(TOKEN)).unwrap_err();
        assert_eq!(error.code, ErrorCode::Forbidden);
        assert!(
            error.message.contains("takes no token"),
            "{}",
            error.message
        );
        assert!(trust.require_identity(&old, "ping").is_err());
        // No `auth` before `hello`.
        let mut bare = trust.connect(None);
        let error = trust.authenticate(&mut bare, None, None).unwrap_err();
        assert!(
            error.message.contains("must answer an `auth`"),
            "{}",
            error.message
        );
        let error = trust
            .authenticate(&mut bare, Some(&[0; 32]), None)
            .unwrap_err();
        assert!(
            error.message.contains("no `auth` to answer"),
            "{}",
            error.message
        );
        // Another token's key id: nothing to answer with.
        let mut wrong = trust.connect(None);
        let error =
            handshake(&mut trust, &mut wrong, b"0123456789abcdef-wrong", [2; 32]).unwrap_err();
        assert!(
            error.message.contains("no token of this server"),
            "{}",
            error.message
        );
        // The right key id, a proof made without the token: refused, and the connection
        // has had its one `auth`.
        let mut guess = trust.connect(None);
        handshake(&mut trust, &mut guess, TOKEN, [3; 32]).unwrap();
        let error = trust
            .authenticate(&mut guess, Some(&[0; 32]), None)
            .unwrap_err();
        assert!(
            error.message.contains("does not answer"),
            "{}",
            error.message
        );
        let again = handshake(&mut trust, &mut guess, TOKEN, [3; 32]).unwrap_err();
        assert!(
            again.message.contains("made its challenge already"),
            "{}",
            again.message
        );
        assert!(trust.require_identity(&guess, "ping").is_err());
        // A proof seen on one connection proves nothing on another (a fresh server nonce).
        let mut first = trust.connect(None);
        let proof = handshake(&mut trust, &mut first, TOKEN, [4; 32]).unwrap();
        trust.authenticate(&mut first, Some(&proof), None).unwrap();
        let mut replay = trust.connect(None);
        handshake(&mut trust, &mut replay, TOKEN, [4; 32]).unwrap();
        assert!(trust.authenticate(&mut replay, Some(&proof), None).is_err());
        assert!(trust.require_identity(&replay, "ping").is_err());
    }

    #[test]
    fn a_config_that_joins_a_uid_twice_is_refused() {
        let spec = |name: &str| TenantSpec {
            name: name.into(),
            uids: vec![7],
            tokens: vec![],
            quota_percent: None,
            engine_driven: false,
        };
        let config = TrustConfig {
            tenants: vec![spec("a"), spec("b")],
            ..TrustConfig::default()
        };
        assert!(matches!(
            Trust::new(&config, 0),
            Err(TrustConfigError::DuplicateUid { uid: 7, .. })
        ));
    }
}
