//! Typed replies: what each op answers, as values the node builds and the clients read.
//!
//! The node answers with an [`Answer`]; a shell encodes it ([`Answer::to_value`], the
//! one encoder of every reply shape); a client reads the part it expects with
//! [`ReplyValue::from_value`] for the same type (`bool`, `Option<u64>`, [`HelloReply`],
//! …). Each op's shape is a column of the op table ([`ReplyShape`], checked by the node
//! on every reply it sends), so a reply's shape is written down once: here.

use super::tcp_auth::{Nonce, Proof};
use rmpv::Value;

/// The shape of an op's successful reply: the op table's reply column.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReplyShape {
    /// `bool`.
    Flag,
    /// `hello`'s map ([`HelloReply`]).
    Hello,
    /// `{"outcome": "claimed" | "proven"}` ([`Attached`]).
    Attached,
    /// `{"outcome"}`, engine-driven with the pool's geometry ([`Registered`]).
    Registered,
    /// `uint | nil`: bytes copied, or a miss.
    Length,
    /// `[bool]`.
    Stored,
    /// `[uint | nil]`.
    Lengths,
    /// `uint`.
    Count,
    /// `{"slot", "offset", "nbytes"} | nil` ([`ReservedSlot`]).
    Reserved,
    /// `{"offset", "nbytes"} | nil` ([`PinnedSlot`]).
    Pinned,
    /// The `status` map, which the shell completes with its own figures.
    Status,
    /// `auth`'s `{"nonce": bin, "proof": bin}` ([`Challenge`]).
    Challenge,
    /// `kv_events`' `{"cursor", "resync", "events", "more"}` ([`KvEvents`]).
    Events,
}

/// A successful reply, typed. See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// `ping`, `unregister_*`, `store`, `commit_store`, `commit_retrieve`,
    /// `register_blend`.
    Flag(bool),
    /// `hello`.
    Hello(HelloReply),
    /// `attach`.
    Attached(Attached),
    /// `register_kv_cache`, `register_engine_driven`.
    Registered(Registered),
    /// `retrieve`: bytes copied, None on a miss.
    Length(Option<u64>),
    /// `store_batch`: one `store` answer per item.
    Stored(Vec<bool>),
    /// `retrieve_batch`: one `retrieve` answer per item.
    Lengths(Vec<Option<u64>>),
    /// `lookup`: leading keys present.
    Count(u64),
    /// `prepare_store`: the slot reserved, None when the key is stored or being stored.
    Reserved(Option<ReservedSlot>),
    /// `prepare_retrieve`: the slot pinned, None on a miss.
    Pinned(Option<PinnedSlot>),
    /// `auth`.
    Challenge(Challenge),
    /// `kv_events`.
    Events(KvEvents),
}

impl Answer {
    /// Its shape, as the op table's reply column names it.
    pub fn shape(&self) -> ReplyShape {
        match self {
            Answer::Flag(_) => ReplyShape::Flag,
            Answer::Hello(_) => ReplyShape::Hello,
            Answer::Attached(_) => ReplyShape::Attached,
            Answer::Registered(_) => ReplyShape::Registered,
            Answer::Length(_) => ReplyShape::Length,
            Answer::Stored(_) => ReplyShape::Stored,
            Answer::Lengths(_) => ReplyShape::Lengths,
            Answer::Count(_) => ReplyShape::Count,
            Answer::Reserved(_) => ReplyShape::Reserved,
            Answer::Pinned(_) => ReplyShape::Pinned,
            Answer::Challenge(_) => ReplyShape::Challenge,
            Answer::Events(_) => ReplyShape::Events,
        }
    }

    /// The reply's value on the wire. Allocates nothing for a flag (a ping's reply).
    pub fn to_value(&self) -> Value {
        match self {
            Answer::Flag(flag) => flag.to_value(),
            Answer::Hello(hello) => hello.to_value(),
            Answer::Attached(attached) => attached.to_value(),
            Answer::Registered(registered) => registered.to_value(),
            Answer::Length(length) => length.to_value(),
            Answer::Stored(stored) => stored.to_value(),
            Answer::Lengths(lengths) => lengths.to_value(),
            Answer::Count(count) => count.to_value(),
            Answer::Reserved(reserved) => reserved.to_value(),
            Answer::Pinned(pinned) => pinned.to_value(),
            Answer::Challenge(challenge) => challenge.to_value(),
            Answer::Events(events) => events.to_value(),
        }
    }
}

/// A part of a reply, both ways: the node's shell writes it, a client reads it.
pub trait ReplyValue: Sized {
    /// Its wire value.
    fn to_value(&self) -> Value;
    /// Read back from a reply value; None when the value has another shape (a client
    /// then says which op answered what).
    fn from_value(value: &Value) -> Option<Self>;
}

impl ReplyValue for bool {
    fn to_value(&self) -> Value {
        Value::Boolean(*self)
    }
    fn from_value(value: &Value) -> Option<bool> {
        value.as_bool()
    }
}

impl ReplyValue for u64 {
    fn to_value(&self) -> Value {
        Value::from(*self)
    }
    fn from_value(value: &Value) -> Option<u64> {
        value.as_u64()
    }
}

/// `nil` is None: a miss, or nothing reserved.
impl<T: ReplyValue> ReplyValue for Option<T> {
    fn to_value(&self) -> Value {
        self.as_ref().map_or(Value::Nil, T::to_value)
    }
    fn from_value(value: &Value) -> Option<Option<T>> {
        match value {
            Value::Nil => Some(None),
            other => T::from_value(other).map(Some),
        }
    }
}

impl<T: ReplyValue> ReplyValue for Vec<T> {
    fn to_value(&self) -> Value {
        Value::Array(self.iter().map(T::to_value).collect())
    }
    fn from_value(value: &Value) -> Option<Vec<T>> {
        match value {
            Value::Array(items) => items.iter().map(T::from_value).collect(),
            _ => None,
        }
    }
}

/// What `hello` tells the worker of this server.
#[derive(Clone, Debug, PartialEq)]
pub struct HelloReply {
    /// The protocol version the server speaks.
    pub protocol: u64,
    /// The server's name (`--name`).
    pub server: String,
    /// Random per server start: a changed one means the server restarted.
    pub boot_id: u64,
    /// The reap timeout, in seconds.
    pub reap_timeout_seconds: f64,
    /// The registration grace, in seconds.
    pub registration_grace_seconds: f64,
    /// How the server notices the death of what this connection registers
    /// (`pidfd_from_peer`, `pidfd_by_pid`, `timeout_only`).
    pub exit_proof: String,
    /// Whether the server still reads fds on this connection.
    pub sends_fds: bool,
    /// The tenant the server derived from the peer (None: the shared default).
    pub tenant: Option<String>,
}

impl ReplyValue for HelloReply {
    fn to_value(&self) -> Value {
        Value::Map(vec![
            ("protocol".into(), self.protocol.into()),
            ("server".into(), self.server.as_str().into()),
            ("boot_id".into(), self.boot_id.into()),
            (
                "reap_timeout_seconds".into(),
                Value::F64(self.reap_timeout_seconds),
            ),
            (
                "registration_grace_seconds".into(),
                Value::F64(self.registration_grace_seconds),
            ),
            ("exit_proof".into(), self.exit_proof.as_str().into()),
            ("sends_fds".into(), self.sends_fds.into()),
            (
                "tenant".into(),
                self.tenant.as_deref().map_or(Value::Nil, Value::from),
            ),
        ])
    }
    fn from_value(value: &Value) -> Option<HelloReply> {
        let map = Fields::of(value)?;
        Some(HelloReply {
            protocol: map.get("protocol")?.as_u64()?,
            server: map.get("server")?.as_str()?.to_owned(),
            boot_id: map.get("boot_id")?.as_u64()?,
            reap_timeout_seconds: map.get("reap_timeout_seconds")?.as_f64()?,
            registration_grace_seconds: map.get("registration_grace_seconds")?.as_f64()?,
            exit_proof: map.get("exit_proof")?.as_str()?.to_owned(),
            sends_fds: map.get("sends_fds")?.as_bool()?,
            tenant: match map.get("tenant")? {
                Value::Nil => None,
                other => Some(other.as_str()?.to_owned()),
            },
        })
    }
}

/// What the server answers `auth` with: its nonce, and its proof that it holds the
/// token of the key id the client sent ([`tcp_auth`](super::tcp_auth)).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The server's nonce.
    pub nonce: Nonce,
    /// The server's proof.
    pub proof: Proof,
}

impl ReplyValue for Challenge {
    fn to_value(&self) -> Value {
        Value::Map(vec![
            ("nonce".into(), Value::Binary(self.nonce.to_vec())),
            ("proof".into(), Value::Binary(self.proof.to_vec())),
        ])
    }
    fn from_value(value: &Value) -> Option<Challenge> {
        let map = Fields::of(value)?;
        let bytes = |key| match map.get(key)? {
            Value::Binary(bytes) => Some(bytes.as_slice()),
            _ => None,
        };
        Some(Challenge {
            nonce: bytes("nonce")?.try_into().ok()?,
            proof: bytes("proof")?.try_into().ok()?,
        })
    }
}

/// What `attach` found.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Attached {
    /// The id was unbound: now bound to this secret and this peer.
    Claimed,
    /// The id was bound to this secret already.
    Proven,
}

impl Attached {
    /// The reply's `outcome`.
    pub fn label(self) -> &'static str {
        match self {
            Attached::Claimed => "claimed",
            Attached::Proven => "proven",
        }
    }
}

impl ReplyValue for Attached {
    fn to_value(&self) -> Value {
        Value::Map(vec![("outcome".into(), self.label().into())])
    }
    fn from_value(value: &Value) -> Option<Attached> {
        match Fields::of(value)?.get("outcome")?.as_str()? {
            "claimed" => Some(Attached::Claimed),
            "proven" => Some(Attached::Proven),
            _ => None,
        }
    }
}

/// How a REGISTER that holds ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A context was built for it.
    Created,
    /// The entry was present (nothing built).
    Refreshed,
}

impl Outcome {
    /// The reply's `outcome`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Refreshed => "refreshed",
        }
    }
}

/// The reply to a REGISTER that holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// Built, or found present.
    pub outcome: Outcome,
    /// Engine-driven only: the L1 pool's geometry (its memfd rides on the reply, at
    /// `pool_fd_index` 0).
    pub pool: Option<PoolGeometry>,
}

/// The L1 pool as an engine-driven worker maps it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the pool.
    pub num_slots: u64,
}

impl ReplyValue for Registered {
    fn to_value(&self) -> Value {
        let outcome = ("outcome".into(), self.outcome.label().into());
        match self.pool {
            None => Value::Map(vec![outcome]),
            Some(pool) => Value::Map(vec![
                outcome,
                ("slot_bytes".into(), pool.slot_bytes.into()),
                ("num_slots".into(), pool.num_slots.into()),
                ("pool_fd_index".into(), 0u64.into()),
            ]),
        }
    }
    fn from_value(value: &Value) -> Option<Registered> {
        let map = Fields::of(value)?;
        let outcome = match map.get("outcome")?.as_str()? {
            "created" => Outcome::Created,
            "refreshed" => Outcome::Refreshed,
            _ => return None,
        };
        let pool = match (map.get("slot_bytes"), map.get("num_slots")) {
            (Some(slot_bytes), Some(num_slots)) => Some(PoolGeometry {
                slot_bytes: slot_bytes.as_u64()?,
                num_slots: num_slots.as_u64()?,
            }),
            _ => None,
        };
        Some(Registered { outcome, pool })
    }
}

/// A slot `prepare_store` reserved: the worker writes at most `nbytes` at `offset`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ReservedSlot {
    /// The slot's index.
    pub slot: u64,
    /// Its byte offset in the pool.
    pub offset: u64,
    /// Bytes it may write (a whole slot).
    pub nbytes: u64,
}

impl ReplyValue for ReservedSlot {
    fn to_value(&self) -> Value {
        Value::Map(vec![
            ("slot".into(), self.slot.into()),
            ("offset".into(), self.offset.into()),
            ("nbytes".into(), self.nbytes.into()),
        ])
    }
    fn from_value(value: &Value) -> Option<ReservedSlot> {
        let map = Fields::of(value)?;
        Some(ReservedSlot {
            slot: map.get("slot")?.as_u64()?,
            offset: map.get("offset")?.as_u64()?,
            nbytes: map.get("nbytes")?.as_u64()?,
        })
    }
}

/// A slot `prepare_retrieve` pinned: the worker reads `nbytes` at `offset`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PinnedSlot {
    /// Its byte offset in the pool.
    pub offset: u64,
    /// The committed length.
    pub nbytes: u64,
}

impl ReplyValue for PinnedSlot {
    fn to_value(&self) -> Value {
        Value::Map(vec![
            ("offset".into(), self.offset.into()),
            ("nbytes".into(), self.nbytes.into()),
        ])
    }
    fn from_value(value: &Value) -> Option<PinnedSlot> {
        let map = Fields::of(value)?;
        Some(PinnedSlot {
            offset: map.get("offset")?.as_u64()?,
            nbytes: map.get("nbytes")?.as_u64()?,
        })
    }
}

/// Where a `kv_events` change happened.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KvTier {
    /// The node's L1 pool: `"l1"`.
    L1,
    /// The L2 tier (Redis): `"l2"`.
    L2,
}

impl KvTier {
    /// Its wire name.
    pub fn name(self) -> &'static str {
        match self {
            KvTier::L1 => "l1",
            KvTier::L2 => "l2",
        }
    }
}

/// One change to what a tier holds for a tenant: `stored` (entered, served from now on)
/// or removed (evicted from L1; found corrupt and deleted in L2), with the key as the
/// tenant wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Entered the tier (true) or left it (false).
    pub stored: bool,
    /// The key.
    pub key: Vec<u8>,
    /// Which tier.
    pub tier: KvTier,
    /// What the value is, as its writer described it (`describe_keys`): on an L1
    /// `stored` change while L1 holds the value described; None otherwise.
    pub meta: Option<Vec<u8>>,
}

/// `kv_events`: the changes since the cursor asked with, in order. With `resync`, the
/// reader's view is void (a new server process, or changes it missed): it withdraws
/// everything it announced, and the events that follow (this reply's first) begin with
/// every key held now, as `stored`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvents {
    /// The cursor for the next call (opaque).
    pub cursor: Vec<u8>,
    /// Whether the reader starts over: withdraw everything, then apply `events`.
    pub resync: bool,
    /// The changes, oldest first.
    pub events: Vec<KvEvent>,
    /// Whether more are waiting already (call again at once).
    pub more: bool,
}

impl ReplyValue for KvEvents {
    fn to_value(&self) -> Value {
        let events = self
            .events
            .iter()
            .map(|event| {
                Value::Array(vec![
                    Value::Boolean(event.stored),
                    Value::Binary(event.key.clone()),
                    event.tier.name().into(),
                    event.meta.clone().map_or(Value::Nil, Value::Binary),
                ])
            })
            .collect();
        Value::Map(vec![
            ("cursor".into(), Value::Binary(self.cursor.clone())),
            ("resync".into(), Value::Boolean(self.resync)),
            ("events".into(), Value::Array(events)),
            ("more".into(), Value::Boolean(self.more)),
        ])
    }
    fn from_value(value: &Value) -> Option<KvEvents> {
        let map = Fields::of(value)?;
        let events = map
            .get("events")?
            .as_array()?
            .iter()
            .map(|event| match event.as_array()?.as_slice() {
                [Value::Boolean(stored), Value::Binary(key), tier, meta] => Some(KvEvent {
                    stored: *stored,
                    key: key.clone(),
                    tier: match tier.as_str()? {
                        "l1" => KvTier::L1,
                        "l2" => KvTier::L2,
                        _ => return None,
                    },
                    meta: match meta {
                        Value::Nil => None,
                        Value::Binary(meta) => Some(meta.clone()),
                        _ => return None,
                    },
                }),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        Some(KvEvents {
            cursor: match map.get("cursor")? {
                Value::Binary(cursor) => cursor.clone(),
                _ => return None,
            },
            resync: map.get("resync")?.as_bool()?,
            events,
            more: map.get("more")?.as_bool()?,
        })
    }
}

/// A reply map's fields by name (other keys are ignored: a newer server may add some).
struct Fields<'a>(&'a [(Value, Value)]);

impl<'a> Fields<'a> {
    fn of(value: &'a Value) -> Option<Fields<'a>> {
        match value {
            Value::Map(map) => Some(Fields(map)),
            _ => None,
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0
            .iter()
            .find(|(key, _)| key.as_str() == Some(name))
            .map(|(_, value)| value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_shape() -> Vec<Answer> {
        vec![
            Answer::Flag(true),
            Answer::Flag(false),
            Answer::Hello(HelloReply {
                protocol: 2,
                server: "node-a".into(),
                boot_id: 7,
                reap_timeout_seconds: 30.0,
                registration_grace_seconds: 2.5,
                exit_proof: "pidfd_by_pid".into(),
                sends_fds: false,
                tenant: Some("team-a".into()),
            }),
            Answer::Attached(Attached::Claimed),
            Answer::Attached(Attached::Proven),
            Answer::Registered(Registered {
                outcome: Outcome::Created,
                pool: None,
            }),
            Answer::Registered(Registered {
                outcome: Outcome::Refreshed,
                pool: Some(PoolGeometry {
                    slot_bytes: 4096,
                    num_slots: 8,
                }),
            }),
            Answer::Length(Some(4096)),
            Answer::Length(None),
            Answer::Stored(vec![true, false]),
            Answer::Lengths(vec![Some(1), None]),
            Answer::Count(3),
            Answer::Reserved(Some(ReservedSlot {
                slot: 1,
                offset: 4096,
                nbytes: 4096,
            })),
            Answer::Reserved(None),
            Answer::Pinned(Some(PinnedSlot {
                offset: 0,
                nbytes: 10,
            })),
            Answer::Pinned(None),
            Answer::Challenge(Challenge {
                nonce: [1; 32],
                proof: [2; 32],
            }),
            Answer::Events(KvEvents {
                cursor: vec![7; 32],
                resync: true,
                events: vec![
                    KvEvent {
                        stored: true,
                        key: b"a".to_vec(),
                        tier: KvTier::L1,
                        meta: Some(b"m".to_vec()),
                    },
                    KvEvent {
                        stored: false,
                        key: vec![],
                        tier: KvTier::L2,
                        meta: None,
                    },
                ],
                more: false,
            }),
        ]
    }

    /// What a client reads back as the type it expects for the shape.
    fn read_back(shape: ReplyShape, value: &Value) -> Option<Answer> {
        Some(match shape {
            ReplyShape::Flag => Answer::Flag(bool::from_value(value)?),
            ReplyShape::Hello => Answer::Hello(HelloReply::from_value(value)?),
            ReplyShape::Attached => Answer::Attached(Attached::from_value(value)?),
            ReplyShape::Registered => Answer::Registered(Registered::from_value(value)?),
            ReplyShape::Length => Answer::Length(ReplyValue::from_value(value)?),
            ReplyShape::Stored => Answer::Stored(ReplyValue::from_value(value)?),
            ReplyShape::Lengths => Answer::Lengths(ReplyValue::from_value(value)?),
            ReplyShape::Count => Answer::Count(u64::from_value(value)?),
            ReplyShape::Reserved => Answer::Reserved(ReplyValue::from_value(value)?),
            ReplyShape::Pinned => Answer::Pinned(ReplyValue::from_value(value)?),
            ReplyShape::Challenge => Answer::Challenge(Challenge::from_value(value)?),
            ReplyShape::Events => Answer::Events(KvEvents::from_value(value)?),
            ReplyShape::Status => return None,
        })
    }

    #[test]
    fn every_answer_reads_back_as_itself() {
        for answer in every_shape() {
            let value = answer.to_value();
            assert_eq!(
                read_back(answer.shape(), &value),
                Some(answer.clone()),
                "{value}"
            );
        }
    }

    #[test]
    fn a_value_of_another_shape_is_not_read() {
        assert_eq!(bool::from_value(&Value::Nil), None);
        assert_eq!(u64::from_value(&Value::from(true)), None);
        assert_eq!(<Vec<bool>>::from_value(&Value::from(true)), None);
        // One bad item refuses the whole batch reply.
        let mixed = Value::Array(vec![Value::from(true), Value::from(1u64)]);
        assert_eq!(<Vec<bool>>::from_value(&mixed), None);
        assert_eq!(
            <Vec<Option<u64>>>::from_value(&mixed),
            None,
            "true is not a length"
        );
        let unknown = Value::Map(vec![("outcome".into(), "stolen".into())]);
        assert_eq!(Attached::from_value(&unknown), None);
        assert_eq!(Registered::from_value(&unknown), None);
        // A hello without a field the protocol promises is not a hello reply.
        let Value::Map(mut hello) = every_shape()[2].to_value() else {
            unreachable!()
        };
        hello.retain(|(key, _)| key.as_str() != Some("sends_fds"));
        assert_eq!(HelloReply::from_value(&Value::Map(hello)), None);
    }

    #[test]
    fn the_wire_shapes_are_those_of_the_protocol_doc() {
        // The engine-driven reply carries `pool_fd_index: 0`, the server-driven one
        // only its outcome.
        let engine = Answer::Registered(Registered {
            outcome: Outcome::Created,
            pool: Some(PoolGeometry {
                slot_bytes: 1,
                num_slots: 2,
            }),
        });
        assert_eq!(
            engine.to_value().to_string(),
            r#"{"outcome": "created", "slot_bytes": 1, "num_slots": 2, "pool_fd_index": 0}"#
        );
        assert_eq!(
            Answer::Lengths(vec![Some(5), None]).to_value().to_string(),
            "[5, nil]"
        );
        assert_eq!(Answer::Reserved(None).to_value(), Value::Nil);
    }
}
