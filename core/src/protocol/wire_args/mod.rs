//! The typed decoder: a request body straight into an [`Op`] with serde and
//! `rmp-serde`, without building a MessagePack value tree.
//!
//! It accepts exactly the requests the protocol allows and nothing else; it says only
//! *whether* a body is a valid request. Why a body is not one (the `bad_frame`,
//! `bad_args` and `unknown_op` messages that name the op, what it expects and what
//! arrived) is [`super::diagnose`]'s job, which runs only on the rare invalid body.
//!
//! The wire types are strict where serde's defaults are lenient, and lenient where the
//! protocol always was, so that a body is valid here exactly when the diagnosis finds
//! nothing wrong: a string is a MessagePack str (not bin); a key or handle is bin or
//! str; a number is any integer encoding of its value; a map is a map (not an array
//! standing for a struct), only str keys name its fields, the first value under a key
//! counts, and a field the buffer's kind does not use is ignored whatever its type;
//! the rope base is any number.

use super::contract::{MAX_BATCH_ITEMS, MAX_DEPTH, OpKind};
use super::request::{BufferSpec, Op, Request, RetrieveItem, StoreItem};
use crate::InstanceId;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;
use values::{Bounded, Instance, Key, Loose, Text, WireAuth, WireBuffer, WireRope, fields, take};

mod values;

/// Decodes `body` as one request followed by nothing; otherwise serde's reason, which
/// the diagnosis uses only when it finds no more precise one.
pub(super) fn decode(body: &[u8]) -> Result<Request, String> {
    // Borrowing from `body` (not reading through `io::Read`, which copies every string
    // into a scratch buffer): a ping is decoded without one allocation.
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(body);
    deserializer.set_max_depth(MAX_DEPTH);
    let request = deserializer
        .deserialize_any(RequestVisitor)
        .map_err(|error| error.to_string())?;
    // Nothing may follow the request: reading one more value must hit the end.
    match IgnoredAny::deserialize(&mut deserializer) {
        Err(rmp_serde::decode::Error::InvalidMarkerRead(error))
            if error.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Ok(request)
        }
        _ => Err("trailing bytes after the request".to_string()),
    }
}

/// `[request_id: uint, op: str, args: array]`.
struct RequestVisitor;

impl<'de> Visitor<'de> for RequestVisitor {
    type Value = Request;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[request_id: uint, op: str, args: array]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Request, A::Error> {
        let missing = || de::Error::custom("a request has 3 items");
        let id: u64 = seq.next_element()?.ok_or_else(missing)?;
        let OpName(name) = seq.next_element()?.ok_or_else(missing)?;
        let op = seq.next_element_seed(ArgsSeed(name))?.ok_or_else(missing)?;
        // More than 3 items: rmp-serde refuses a sequence left unread.
        Ok(Request { id, op })
    }
}

/// An op name this server knows.
struct OpName(OpKind);

impl<'de> Deserialize<'de> for OpName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<OpName, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = OpName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an op name")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<OpName, E> {
                OpKind::from_name(name)
                    .map(OpName)
                    .ok_or_else(|| E::custom("unknown op"))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}

/// The args array of the op `.0`.
struct ArgsSeed(OpKind);

impl<'de> DeserializeSeed<'de> for ArgsSeed {
    type Value = Op;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Op, D::Error> {
        Ok(match self.0 {
            OpKind::Hello => hello(d)?,
            OpKind::Auth => {
                let (WireAuth { id, nonce },) = array(d)?;
                Op::Auth { id, nonce }
            }
            OpKind::Attach => {
                let (Instance(instance), Key(secret)) = array(d)?;
                Op::Attach { instance, secret }
            }
            OpKind::Ping => {
                let (instance,): (Option<Instance>,) = array(d)?;
                Op::Ping {
                    instance: instance.map(|Instance(id)| id),
                }
            }
            OpKind::RegisterKvCache => register_kv_cache(d)?,
            OpKind::UnregisterKvCache => Op::UnregisterKvCache {
                instance: instance_only(d)?,
            },
            OpKind::Store => transfer(d, OpKind::Store)?,
            OpKind::Retrieve => transfer(d, OpKind::Retrieve)?,
            OpKind::StoreBatch | OpKind::RetrieveBatch | OpKind::Lookup => batched(d, self.0)?,
            OpKind::RegisterEngineDriven => {
                let (Instance(instance), Text(model_name), world_size) = array(d)?;
                Op::RegisterEngineDriven {
                    instance,
                    model_name,
                    world_size,
                }
            }
            OpKind::UnregisterEngineDriven => Op::UnregisterEngineDriven {
                instance: instance_only(d)?,
            },
            OpKind::PrepareStore => keyed(d, |instance, key| Op::PrepareStore { instance, key })?,
            OpKind::PrepareRetrieve => {
                keyed(d, |instance, key| Op::PrepareRetrieve { instance, key })?
            }
            OpKind::CommitRetrieve => {
                keyed(d, |instance, key| Op::CommitRetrieve { instance, key })?
            }
            OpKind::CommitStore => {
                let (Instance(instance), Key(key), nbytes) = array(d)?;
                Op::CommitStore {
                    instance,
                    key,
                    nbytes,
                }
            }
            OpKind::RegisterBlend => {
                let (Instance(instance), WireRope(rope)) = array(d)?;
                Op::RegisterBlend { instance, rope }
            }
            OpKind::Status => {
                let []: [IgnoredAny; 0] = array(d)?;
                Op::Status
            }
            OpKind::KvEvents => {
                let (Key(cursor), max) = array(d)?;
                Op::KvEvents { cursor, max }
            }
            OpKind::DescribeKeys => batched(d, OpKind::DescribeKeys)?,
        })
    }
}

/// The ops whose arguments hold a list of at most [`MAX_BATCH_ITEMS`]: `store_batch`,
/// `retrieve_batch`, `lookup` and `describe_keys`.
fn batched<'de, D: Deserializer<'de>>(d: D, kind: OpKind) -> Result<Op, D::Error> {
    Ok(match kind {
        OpKind::StoreBatch => {
            let (Instance(instance), Bounded(items)): (_, Bounded<WireStoreItem>) = array(d)?;
            Op::StoreBatch {
                instance,
                items: batch(items)?.into_iter().map(|item| item.0).collect(),
            }
        }
        OpKind::RetrieveBatch => {
            let (Instance(instance), Bounded(items)): (_, Bounded<WireRetrieveItem>) = array(d)?;
            Op::RetrieveBatch {
                instance,
                items: batch(items)?.into_iter().map(|item| item.0).collect(),
            }
        }
        OpKind::Lookup => {
            let (Bounded(keys),): (Bounded<Key>,) = array(d)?;
            Op::Lookup {
                keys: batch(keys)?.into_iter().map(|Key(key)| key).collect(),
            }
        }
        _ => {
            let (Bounded(items),): (Bounded<WireDescription>,) = array(d)?;
            Op::DescribeKeys {
                items: batch(items)?.into_iter().map(|item| item.0).collect(),
            }
        }
    })
}

fn hello<'de, D: Deserializer<'de>>(d: D) -> Result<Op, D::Error> {
    let HelloArgs {
        protocol,
        client,
        options:
            HelloOptions {
                pidfd_index,
                sends_fds,
                token,
                proof,
                wait_ms,
            },
    } = d.deserialize_any(HelloVisitor)?;
    Ok(Op::Hello {
        protocol,
        client,
        pidfd_index,
        sends_fds,
        token,
        proof,
        wait_ms,
    })
}

fn register_kv_cache<'de, D: Deserializer<'de>>(d: D) -> Result<Op, D::Error> {
    let (Instance(instance), Bounded(buffers), Text(model_name), world_size): (
        _,
        Bounded<WireBuffer>,
        _,
        _,
    ) = array(d)?;
    let buffers = buffers
        .into_iter()
        .map(WireBuffer::into_spec)
        .collect::<Option<Vec<BufferSpec>>>()
        .ok_or_else(|| de::Error::custom("a buffer lacks a field its kind needs"))?;
    Ok(Op::RegisterKvCache {
        instance,
        buffers,
        model_name,
        world_size,
    })
}

/// `[instance_id]`.
fn instance_only<'de, D: Deserializer<'de>>(d: D) -> Result<InstanceId, D::Error> {
    let (Instance(instance),) = array(d)?;
    Ok(instance)
}

/// `store` or `retrieve`: `[instance_id, key, buffer, offset, nbytes]`.
fn transfer<'de, D: Deserializer<'de>>(d: D, kind: OpKind) -> Result<Op, D::Error> {
    let (Instance(instance), Key(key), buffer, offset, nbytes) = array(d)?;
    Ok(if kind == OpKind::Store {
        Op::Store {
            instance,
            key,
            buffer,
            offset,
            nbytes,
        }
    } else {
        Op::Retrieve {
            instance,
            key,
            buffer,
            offset,
            nbytes,
        }
    })
}

/// `prepare_store`, `prepare_retrieve` or `commit_retrieve`: `[instance_id, key]`.
fn keyed<'de, D: Deserializer<'de>>(
    d: D,
    op: impl FnOnce(InstanceId, Vec<u8>) -> Op,
) -> Result<Op, D::Error> {
    let (Instance(instance), Key(key)) = array(d)?;
    Ok(op(instance, key))
}

/// A tuple or array read from a MessagePack array only. Serde reads tuples with
/// `deserialize_tuple`, for which rmp-serde also takes a bin as an array of bytes.
fn array<'de, D: Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<T, D::Error> {
    struct ArrayVisitor<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for ArrayVisitor<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
            T::deserialize(de::value::SeqAccessDeserializer::new(seq))
        }
    }
    deserializer.deserialize_any(ArrayVisitor(std::marker::PhantomData))
}

/// The items of a batch, refused past [`MAX_BATCH_ITEMS`].
fn batch<T, E: de::Error>(items: Vec<T>) -> Result<Vec<T>, E> {
    if items.len() > MAX_BATCH_ITEMS {
        return Err(E::custom("too many batch items"));
    }
    Ok(items)
}

/// `[key: bin, buffer: uint, offset: uint, nbytes: uint]`, an item of `store_batch`.
struct WireStoreItem(StoreItem);

impl<'de> Deserialize<'de> for WireStoreItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<WireStoreItem, D::Error> {
        let (Key(key), buffer, offset, nbytes) = array(d)?;
        Ok(WireStoreItem(StoreItem {
            key,
            buffer,
            offset,
            nbytes,
        }))
    }
}

/// `[key: bin, meta: bin]`, an item of `describe_keys`.
struct WireDescription((Vec<u8>, Vec<u8>));

impl<'de> Deserialize<'de> for WireDescription {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<WireDescription, D::Error> {
        let (Key(key), Key(meta)) = array(d)?;
        Ok(WireDescription((key, meta)))
    }
}

/// `[key: bin, buffer: uint, offset: uint, nbytes: uint]`, an item of `retrieve_batch`.
struct WireRetrieveItem(RetrieveItem);

impl<'de> Deserialize<'de> for WireRetrieveItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<WireRetrieveItem, D::Error> {
        let (Key(key), buffer, offset, nbytes) = array(d)?;
        Ok(WireRetrieveItem(RetrieveItem {
            key,
            buffer,
            offset,
            nbytes,
        }))
    }
}

/// `hello`'s `[protocol: uint, client: str]`, or the same with a third argument, an
/// options map whose `pidfd_index` (uint or nil) and `sends_fds` (bool or nil) count
/// and whose other keys are ignored (room to grow).
struct HelloArgs {
    protocol: u64,
    client: String,
    options: HelloOptions,
}

struct HelloVisitor;

impl<'de> Visitor<'de> for HelloVisitor {
    type Value = HelloArgs;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[protocol: uint, client: str, options?: map]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HelloArgs, A::Error> {
        let missing = || de::Error::custom("hello has 2 or 3 arguments");
        let protocol: u64 = seq.next_element()?.ok_or_else(missing)?;
        let Text(client) = seq.next_element()?.ok_or_else(missing)?;
        let options = seq
            .next_element::<HelloOptions>()?
            .unwrap_or(HelloOptions::DEFAULT);
        // A fourth argument: rmp-serde refuses a sequence left unread.
        Ok(HelloArgs {
            protocol,
            client,
            options,
        })
    }
}

/// `hello`'s options map: `pidfd_index` when present and not nil; `sends_fds` true
/// unless present and false.
struct HelloOptions {
    pidfd_index: Option<u64>,
    sends_fds: bool,
    token: Option<Vec<u8>>,
    proof: Option<Vec<u8>>,
    wait_ms: Option<u64>,
}

impl HelloOptions {
    /// No options map, or an empty one.
    const DEFAULT: HelloOptions = HelloOptions {
        pidfd_index: None,
        sends_fds: true,
        token: None,
        proof: None,
        wait_ms: None,
    };
}

impl<'de> Deserialize<'de> for HelloOptions {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<HelloOptions, D::Error> {
        struct OptionsVisitor;
        impl<'de> Visitor<'de> for OptionsVisitor {
            type Value = HelloOptions;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an options map")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<HelloOptions, A::Error> {
                let mut fields = fields(
                    map,
                    &["pidfd_index", "sends_fds", "token", "proof", "wait_ms"],
                )?;
                let pidfd_index = match take(&mut fields, "pidfd_index") {
                    None | Some(Loose::Nil) => None,
                    Some(Loose::Uint(index)) => Some(index),
                    _ => return Err(de::Error::custom("options.pidfd_index is not a uint")),
                };
                let sends_fds = match take(&mut fields, "sends_fds") {
                    None | Some(Loose::Nil) => true,
                    Some(Loose::Bool(sends)) => sends,
                    _ => return Err(de::Error::custom("options.sends_fds is not a bool")),
                };
                let token = match take(&mut fields, "token") {
                    None | Some(Loose::Nil) => None,
                    Some(Loose::Bytes(token)) => Some(token),
                    Some(Loose::Text(token)) => Some(token.into_bytes()),
                    _ => return Err(de::Error::custom("options.token is not a str or bin")),
                };
                let proof = match take(&mut fields, "proof") {
                    None | Some(Loose::Nil) => None,
                    Some(Loose::Bytes(proof)) => Some(proof),
                    _ => return Err(de::Error::custom("options.proof is not a bin")),
                };
                let wait_ms = match take(&mut fields, "wait_ms") {
                    None | Some(Loose::Nil) => None,
                    Some(Loose::Uint(wait)) => Some(wait),
                    _ => return Err(de::Error::custom("options.wait_ms is not a uint")),
                };
                Ok(HelloOptions {
                    pidfd_index,
                    sends_fds,
                    token,
                    proof,
                    wait_ms,
                })
            }
        }
        deserializer.deserialize_map(OptionsVisitor)
    }
}
