//! A block's description as a connector attaches it to the block's first shard
//! (`describe_keys`, written by `kvwarden.kv_announce.encode_meta`): what a router's
//! `BlockStored` needs besides the fact that the block is held.
//!
//! Version 3, a msgpack array: `[3, chain_key, block_hash, parent_hash, token_ids,
//! hash_extra_keys, lora, shard_keys, event_extra_keys]`. `lora` is nil or
//! `[name, id]`; `shard_keys` are the server keys of every shard of the block (one per
//! tensor-parallel rank and part), the first the key it is attached to;
//! `event_extra_keys` is `BlockStored.extra_keys` as the engine publishes it, passed
//! through. Versions 1 and 2 name no shards: the server cannot tell when such a block
//! is whole, so it never announces one (the engine's own stream still does).

use crate::protocol::MAX_DEPTH;
use rmpv::Value;

/// The version this server reads.
pub const META_VERSION: u64 = 3;
/// The most shards a description may name.
pub const MAX_SHARDS_PER_BLOCK: usize = 256;

/// vLLM's `ExternalBlockHash`: bytes or an integer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// A hash as bytes (vLLM's default, `sha256_cbor` and friends).
    Bytes(Vec<u8>),
    /// A hash as an integer.
    Int(i64),
    /// A hash as an integer past `i64::MAX`.
    Uint(u64),
}

impl BlockHash {
    fn from_value(value: &Value) -> Option<BlockHash> {
        match value {
            Value::Binary(bytes) => Some(BlockHash::Bytes(bytes.clone())),
            Value::Integer(n) => n
                .as_i64()
                .map(BlockHash::Int)
                .or_else(|| n.as_u64().map(BlockHash::Uint)),
            _ => None,
        }
    }

    /// As msgpack, the way the engine publishes it.
    pub fn to_value(&self) -> Value {
        match self {
            BlockHash::Bytes(bytes) => Value::Binary(bytes.clone()),
            BlockHash::Int(n) => Value::from(*n),
            BlockHash::Uint(n) => Value::from(*n),
        }
    }
}

/// What a block's `BlockStored` says, and which shards make it whole.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockMeta {
    /// The connector's key for the block (its shards' keys add rank and part).
    pub chain_key: Vec<u8>,
    /// vLLM's hash of the block.
    pub block_hash: BlockHash,
    /// Its parent's hash; None for a prefix's first block.
    pub parent_hash: Option<BlockHash>,
    /// The block's tokens.
    pub token_ids: Vec<u64>,
    /// `BlockStored.extra_keys` as the engine publishes it (nil: none).
    pub extra_keys: Value,
    /// The LoRA adapter's name and id.
    pub lora: Option<(String, Option<i64>)>,
    /// The server keys (the tenant's, without its prefix) of every shard, the first
    /// shard first.
    pub shard_keys: Vec<Vec<u8>>,
}

impl BlockMeta {
    /// The block a version 3 description names; None for anything else.
    pub fn decode(bytes: &[u8]) -> Option<BlockMeta> {
        let value = rmpv::decode::read_value_with_max_depth(&mut &bytes[..], MAX_DEPTH).ok()?;
        let Value::Array(fields) = value else {
            return None;
        };
        let [
            version,
            chain,
            hash,
            parent,
            tokens,
            _hash_extra,
            lora,
            shards,
            extra,
        ] = <[Value; 9]>::try_from(fields).ok()?;
        if version.as_u64() != Some(META_VERSION) {
            return None;
        }
        let parent_hash = match parent {
            Value::Nil => None,
            other => Some(BlockHash::from_value(&other)?),
        };
        let token_ids = match tokens {
            Value::Array(tokens) => tokens.iter().map(Value::as_u64).collect::<Option<_>>()?,
            _ => return None,
        };
        let lora = match lora {
            Value::Nil => None,
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(name), id] => Some((
                    name.as_str()?.to_owned(),
                    if id.is_nil() {
                        None
                    } else {
                        Some(id.as_i64()?)
                    },
                )),
                _ => return None,
            },
            _ => return None,
        };
        let shard_keys: Vec<Vec<u8>> = match shards {
            Value::Array(keys) => keys
                .into_iter()
                .map(|k| match k {
                    Value::Binary(key) => Some(key),
                    _ => None,
                })
                .collect::<Option<_>>()?,
            _ => return None,
        };
        if shard_keys.is_empty() || shard_keys.len() > MAX_SHARDS_PER_BLOCK {
            return None;
        }
        Some(BlockMeta {
            chain_key: match chain {
                Value::Binary(key) => key,
                _ => return None,
            },
            block_hash: BlockHash::from_value(&hash)?,
            parent_hash,
            token_ids,
            extra_keys: extra,
            lora,
            shard_keys,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A version 3 description, as `kv_announce.encode_meta` writes it.
    pub(crate) fn description(version: u64, shards: Vec<Value>) -> Vec<u8> {
        let value = Value::Array(vec![
            Value::from(version),
            Value::Binary(b"chain".to_vec()),
            Value::Binary(b"hash".to_vec()),
            Value::from(7),
            Value::Array(vec![Value::from(1), Value::from(2)]),
            Value::Nil,
            Value::Array(vec![Value::from("adapter"), Value::from(3)]),
            Value::Array(shards),
            Value::Array(vec![Value::Array(vec![Value::from("salt")])]),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        bytes
    }

    #[test]
    fn the_description_pythons_connector_writes_is_read() {
        // python/tests/test_kv_announce.py checks that `encode_meta` writes these bytes.
        let meta = BlockMeta::decode(include_bytes!("description-v3.msgpack")).expect("read");
        assert_eq!(
            meta,
            BlockMeta {
                chain_key: b"chain".to_vec(),
                block_hash: BlockHash::Bytes(b"hash".to_vec()),
                parent_hash: Some(BlockHash::Int(7)),
                token_ids: vec![1, 2],
                extra_keys: Value::Array(vec![Value::Array(vec![
                    Value::from("adapter"),
                    Value::from("salt")
                ])]),
                lora: Some(("adapter".to_owned(), Some(3))),
                shard_keys: vec![b"k0".to_vec(), b"k1".to_vec()],
            }
        );
    }

    #[test]
    fn a_version_3_description_is_read_and_anything_else_is_not() {
        let shards = vec![Value::Binary(b"k0".to_vec()), Value::Binary(b"k1".to_vec())];
        let meta = BlockMeta::decode(&description(3, shards.clone())).expect("version 3");
        assert_eq!(meta.chain_key, b"chain");
        assert_eq!(meta.block_hash, BlockHash::Bytes(b"hash".to_vec()));
        assert_eq!(meta.parent_hash, Some(BlockHash::Int(7)));
        assert_eq!(meta.token_ids, [1, 2]);
        assert_eq!(meta.lora, Some(("adapter".to_owned(), Some(3))));
        assert_eq!(meta.shard_keys, [b"k0".to_vec(), b"k1".to_vec()]);
        assert_eq!(
            BlockMeta::decode(&description(2, shards)),
            None,
            "no shards named"
        );
        assert_eq!(BlockMeta::decode(&description(3, vec![])), None, "no shard");
        let many = vec![Value::Binary(b"k".to_vec()); MAX_SHARDS_PER_BLOCK + 1];
        assert_eq!(BlockMeta::decode(&description(3, many)), None, "too many");
        assert_eq!(BlockMeta::decode(b"\xc1 not msgpack"), None);
        assert_eq!(BlockMeta::decode(&[]), None);
    }
}
