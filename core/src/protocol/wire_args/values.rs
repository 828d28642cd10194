//! The values a request's arguments are made of, as they travel: an instance id, a key
//! or handle, a text, a bounded list, a buffer spec, `auth`'s arguments and a rope
//! spec, each strict where serde's defaults are lenient (see the parent's docs).

use super::super::contract::{MAX_KEY_BYTES, MAX_TEXT_BYTES};
use super::super::request::{BufferSpec, RopeSpec};
use super::super::tcp_auth::{KeyId, Nonce};
use crate::InstanceId;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// An instance id as it travels: a uint no larger than [`InstanceId::MAX`].
pub(super) struct Instance(pub(super) InstanceId);

impl<'de> Deserialize<'de> for Instance {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Instance, D::Error> {
        let raw = u64::deserialize(deserializer)?;
        InstanceId::new(raw)
            .map(Instance)
            .map_err(de::Error::custom)
    }
}

/// A key or handle: bin, or a str taken as its bytes (some MessagePack clients cannot
/// tell the two apart).
pub(super) struct Key(pub(super) Vec<u8>);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("bin")
            }
            fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Key, E> {
                if bytes.len() > MAX_KEY_BYTES {
                    return Err(E::custom("key too long"));
                }
                Ok(Key(bytes.to_vec()))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Key, E> {
                self.visit_bytes(text.as_bytes())
            }
        }
        deserializer.deserialize_bytes(KeyVisitor)
    }
}

/// A UTF-8 str (a bin is not a string here).
pub(super) struct Text(pub(super) String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Text, D::Error> {
        struct TextVisitor;
        impl Visitor<'_> for TextVisitor {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a UTF-8 string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Text, E> {
                if text.len() > MAX_TEXT_BYTES {
                    return Err(E::custom("string too long"));
                }
                Ok(Text(text.to_owned()))
            }
        }
        deserializer.deserialize_str(TextVisitor)
    }
}

/// An array whose declared length does not decide the allocation: a 5-byte header
/// claiming 4 billion items must not reserve memory for them.
pub(super) struct Bounded<T>(pub(super) Vec<T>);

/// Items reserved up front, whatever the header claims; more grow the vector.
const RESERVE_ITEMS: usize = 64;

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Bounded<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Bounded<T>, D::Error> {
        struct BoundedVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for BoundedVisitor<T> {
            type Value = Bounded<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bounded<T>, A::Error> {
                let hint = seq.size_hint().unwrap_or(0).min(RESERVE_ITEMS);
                let mut items = Vec::with_capacity(hint);
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Bounded(items))
            }
        }
        // Not `deserialize_seq`: rmp-serde would hand a bin over as an array of bytes.
        deserializer.deserialize_any(BoundedVisitor(std::marker::PhantomData))
    }
}

/// Any MessagePack value, kept only as far as a map of buffers or rope parameters needs
/// it. A field of the wrong type is not an error here: the kind decides which fields
/// count (a memfd buffer ignores `handle`), and a missing or mistyped one that counts
/// sends the body to the diagnosis.
pub(super) enum Loose {
    Uint(u64),
    /// A negative integer.
    Int(i64),
    Float(f64),
    Text(String),
    Bytes(Vec<u8>),
    Bool(bool),
    Nil,
    Other,
}

impl Loose {
    fn uint(self) -> Option<u64> {
        match self {
            Loose::Uint(value) => Some(value),
            _ => None,
        }
    }

    /// bin, or a str taken as its bytes (as keys are).
    fn bytes(self) -> Option<Vec<u8>> {
        match self {
            Loose::Bytes(bytes) => Some(bytes),
            Loose::Text(text) => Some(text.into_bytes()),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Loose {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Loose, D::Error> {
        struct LooseVisitor;
        impl<'de> Visitor<'de> for LooseVisitor {
            type Value = Loose;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Loose, E> {
                Ok(Loose::Text(text.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Loose, E> {
                Ok(Loose::Bytes(bytes.to_vec()))
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Loose, E> {
                Ok(Loose::Uint(value))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Loose, E> {
                Ok(u64::try_from(value).map_or(Loose::Int(value), Loose::Uint))
            }
            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Loose, E> {
                Ok(Loose::Float(value))
            }
            fn visit_bool<E: de::Error>(self, value: bool) -> Result<Loose, E> {
                Ok(Loose::Bool(value))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Loose, E> {
                Ok(Loose::Nil)
            }
            fn visit_none<E: de::Error>(self) -> Result<Loose, E> {
                Ok(Loose::Nil)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Loose, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Loose, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Loose, D::Error> {
                IgnoredAny::deserialize(d)?;
                Ok(Loose::Other)
            }
        }
        deserializer.deserialize_any(LooseVisitor)
    }
}

/// Reads a map field by field: the first value under each str key of `known` counts
/// (as the protocol has always read them); every other entry is skipped. What is kept
/// is bounded by `known`, whatever the map's size.
pub(super) fn fields<'de, A: MapAccess<'de>>(
    mut map: A,
    known: &[&str],
) -> Result<Vec<(String, Loose)>, A::Error> {
    let mut out: Vec<(String, Loose)> = Vec::new();
    while let Some(key) = map.next_key::<Loose>()? {
        let value: Loose = map.next_value()?;
        if let Loose::Text(key) = key
            && known.contains(&key.as_str())
            && !out.iter().any(|(seen, _)| *seen == key)
        {
            out.push((key, value));
        }
    }
    Ok(out)
}

/// Takes the value under `key` out of `fields`.
pub(super) fn take(fields: &mut [(String, Loose)], key: &str) -> Option<Loose> {
    fields
        .iter_mut()
        .find(|(name, _)| name == key)
        .map(|(_, value)| std::mem::replace(value, Loose::Other))
}
/// One buffer map of `register_kv_cache`, before its kind is checked.
pub(super) struct WireBuffer(Vec<(String, Loose)>);

impl WireBuffer {
    /// The buffer its kind describes, or None when the kind is unknown or a field it
    /// needs is missing or mistyped.
    pub(super) fn into_spec(mut self) -> Option<BufferSpec> {
        let fields = &mut self.0;
        let kind = match take(fields, "kind")? {
            Loose::Text(kind) => kind,
            _ => return None,
        };
        let uint = |fields: &mut [(String, Loose)], key| take(fields, key).and_then(Loose::uint);
        match kind.as_str() {
            "memfd" => Some(BufferSpec::Memfd {
                fd_index: uint(fields, "fd_index")?,
                nbytes: uint(fields, "nbytes")?,
            }),
            "cuda_ipc" => Some(BufferSpec::CudaIpc {
                device: uint(fields, "device")?,
                handle: take(fields, "handle").and_then(Loose::bytes)?,
                offset: uint(fields, "offset")?,
                nbytes: uint(fields, "nbytes")?,
            }),
            "cuda_vmm" => Some(BufferSpec::CudaVmm {
                fd_index: uint(fields, "fd_index")?,
                device: uint(fields, "device")?,
                allocation_bytes: uint(fields, "allocation_bytes")?,
                offset: uint(fields, "offset")?,
                nbytes: uint(fields, "nbytes")?,
            }),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for WireBuffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<WireBuffer, D::Error> {
        struct BufferVisitor;
        impl<'de> Visitor<'de> for BufferVisitor {
            type Value = WireBuffer;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a buffer map")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<WireBuffer, A::Error> {
                fields(
                    map,
                    &[
                        "kind",
                        "fd_index",
                        "device",
                        "handle",
                        "allocation_bytes",
                        "offset",
                        "nbytes",
                    ],
                )
                .map(WireBuffer)
            }
        }
        deserializer.deserialize_map(BufferVisitor)
    }
}

/// `auth`'s map: a 16-byte key id and a 32-byte nonce.
pub(super) struct WireAuth {
    pub(super) id: KeyId,
    pub(super) nonce: Nonce,
}

impl<'de> Deserialize<'de> for WireAuth {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<WireAuth, D::Error> {
        struct AuthVisitor;
        impl<'de> Visitor<'de> for AuthVisitor {
            type Value = WireAuth;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an auth map")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<WireAuth, A::Error> {
                let mut fields = fields(map, &["id", "nonce"])?;
                let mut bytes = |key| match take(&mut fields, key) {
                    Some(Loose::Bytes(bytes)) => Some(bytes),
                    _ => None,
                };
                let id = bytes("id").and_then(|id| id.try_into().ok());
                let nonce = bytes("nonce").and_then(|nonce| nonce.try_into().ok());
                match (id, nonce) {
                    (Some(id), Some(nonce)) => Ok(WireAuth { id, nonce }),
                    _ => Err(de::Error::custom(
                        "auth's id or nonce is missing or mistyped",
                    )),
                }
            }
        }
        deserializer.deserialize_map(AuthVisitor)
    }
}

/// The rope map of `register_blend`.
pub(super) struct WireRope(pub(super) RopeSpec);

impl<'de> Deserialize<'de> for WireRope {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<WireRope, D::Error> {
        struct RopeVisitor;
        impl<'de> Visitor<'de> for RopeVisitor {
            type Value = WireRope;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a rope map")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<WireRope, A::Error> {
                let mut fields = fields(map, &["rotary_dim", "max_positions", "base"])?;
                let uint =
                    |fields: &mut [(String, Loose)], key| take(fields, key).and_then(Loose::uint);
                let rope = (|| {
                    Some(RopeSpec {
                        rotary_dim: uint(&mut fields, "rotary_dim")?,
                        max_positions: uint(&mut fields, "max_positions")?,
                        // Any number, as the protocol has always read the base.
                        base: match take(&mut fields, "base")? {
                            Loose::Float(base) => base,
                            Loose::Uint(base) => base as f64,
                            Loose::Int(base) => base as f64,
                            _ => return None,
                        },
                    })
                })();
                rope.map(WireRope)
                    .ok_or_else(|| de::Error::custom("a rope field is missing or mistyped"))
            }
        }
        deserializer.deserialize_map(RopeVisitor)
    }
}
