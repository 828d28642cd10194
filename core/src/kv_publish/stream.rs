//! A stream in vLLM's KV-event wire format (`vllm/distributed/kv_events.py`), as
//! llm-d's indexer and Dynamo's router read an engine's: on the PUB socket each batch
//! is three frames (topic, sequence number as 8 big-endian bytes, the msgpack of a
//! `KVEventBatch`); the replay ROUTER answers a subscriber's `start_seq` (8 big-endian
//! bytes) with every batch still held from it on, then an end marker of sequence -1.
//!
//! The stream's first batch clears what any earlier incarnation of it announced
//! (`AllBlocksCleared`): a router that kept a stopped server's blocks drops them. Its
//! last, when the server stops, ends with the same: nothing can be loaded from a
//! server that is gone (a SIGKILLed one says nothing; its restart's first batch clears).

use super::announce::BlockEvent;
use super::meta::BlockMeta;
use rmpv::Value;
use std::collections::VecDeque;

/// The `medium` of kvwarden's blocks: host memory, as vLLM's own CPU offload says.
pub const MEDIUM: &str = "CPU";
/// The `ownership` of kvwarden's blocks (the connector's own stream says the same).
pub const OWNERSHIP: &str = "kvwarden";
/// Batches held for replay at most (vLLM's `buffer_steps` default).
pub const REPLAY_BATCHES: usize = 10_000;
/// Bytes of batches held for replay at most.
pub const REPLAY_BYTES: usize = 64 << 20;
/// The sequence number of the replay's end marker.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// One stream's sequence and the batches held for replay.
pub struct Stream {
    next: u64,
    held: VecDeque<(u64, Vec<u8>)>,
    held_bytes: usize,
}

impl Default for Stream {
    fn default() -> Self {
        Stream::new()
    }
}

impl Stream {
    /// A stream that has sent nothing.
    pub fn new() -> Stream {
        Stream {
            next: 0,
            held: VecDeque::new(),
            held_bytes: 0,
        }
    }

    /// The first batch of a stream, stamped `ts` (seconds since the epoch).
    pub fn opening(ts: f64) -> Vec<u8> {
        encode_batch(ts, &[BlockEvent::AllCleared])
    }

    /// The last batch of a stream: `events`, then `AllBlocksCleared`.
    pub fn closing(ts: f64, mut events: Vec<BlockEvent>) -> Vec<u8> {
        events.push(BlockEvent::AllCleared);
        encode_batch(ts, &events)
    }

    /// Holds `payload` for replay and gives its sequence number, as 8 big-endian bytes.
    pub fn push(&mut self, payload: Vec<u8>) -> [u8; 8] {
        let seq = self.next;
        self.next += 1;
        self.held_bytes += payload.len();
        self.held.push_back((seq, payload));
        while self.held.len() > REPLAY_BATCHES || self.held_bytes > REPLAY_BYTES {
            if let Some((_, gone)) = self.held.pop_front() {
                self.held_bytes -= gone.len();
            }
        }
        seq.to_be_bytes()
    }

    /// The batches a subscriber asking from `start_seq` (its request's frame) gets:
    /// every one held from it on, as (sequence bytes, payload). A frame that is not a
    /// number gets none (then the end marker, as for any request).
    pub fn replay(&self, start_seq: &[u8]) -> impl Iterator<Item = ([u8; 8], &[u8])> {
        let start = (1..=8).contains(&start_seq.len()).then(|| {
            let mut word = [0u8; 8];
            word[8 - start_seq.len()..].copy_from_slice(start_seq);
            u64::from_be_bytes(word)
        });
        self.held
            .iter()
            .filter(move |(seq, _)| start.is_some_and(|s| *seq >= s))
            .map(|(seq, payload)| (seq.to_be_bytes(), payload.as_slice()))
    }
}

/// The msgpack of a `KVEventBatch` of `events` stamped `ts`: `[ts, [event, …]]`, each
/// event a map tagged `type` with its fields (as msgspec encodes vLLM's classes).
pub fn encode_batch(ts: f64, events: &[BlockEvent]) -> Vec<u8> {
    let events = events.iter().map(event_value).collect();
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events)]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).expect("writing to a Vec cannot fail");
    bytes
}

fn event_value(event: &BlockEvent) -> Value {
    let field = |name: &str, value: Value| (Value::from(name), value);
    let text = |s: &str| Value::from(s);
    match event {
        BlockEvent::Stored(meta) => Value::Map(stored_fields(meta)),
        BlockEvent::Removed(hash) => Value::Map(vec![
            field("type", text("BlockRemoved")),
            field("block_hashes", Value::Array(vec![hash.to_value()])),
            field("medium", text(MEDIUM)),
            field("ownership", text(OWNERSHIP)),
        ]),
        BlockEvent::AllCleared => Value::Map(vec![field("type", text("AllBlocksCleared"))]),
    }
}

fn stored_fields(meta: &BlockMeta) -> Vec<(Value, Value)> {
    let field = |name: &str, value: Value| (Value::from(name), value);
    let (lora_name, lora_id) = match &meta.lora {
        Some((name, id)) => (
            Value::from(name.as_str()),
            id.map_or(Value::Nil, Value::from),
        ),
        None => (Value::Nil, Value::Nil),
    };
    let mut fields = vec![
        field("type", Value::from("BlockStored")),
        field(
            "block_hashes",
            Value::Array(vec![meta.block_hash.to_value()]),
        ),
        field(
            "parent_block_hash",
            meta.parent_hash
                .as_ref()
                .map_or(Value::Nil, |h| h.to_value()),
        ),
        field(
            "token_ids",
            Value::Array(meta.token_ids.iter().map(|&t| Value::from(t)).collect()),
        ),
        field("block_size", Value::from(meta.token_ids.len() as u64)),
        field("lora_id", lora_id),
        field("medium", Value::from(MEDIUM)),
        field("lora_name", lora_name),
    ];
    if !meta.extra_keys.is_nil() {
        fields.push(field("extra_keys", meta.extra_keys.clone()));
    }
    fields.push(field("ownership", Value::from(OWNERSHIP)));
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_publish::meta::BlockHash;
    use std::sync::Arc;

    #[test]
    fn a_batch_is_ts_then_events_tagged_by_type_with_vllms_field_names() {
        let meta = BlockMeta {
            chain_key: b"c".to_vec(),
            block_hash: BlockHash::Int(5),
            parent_hash: None,
            token_ids: vec![1, 2, 3],
            extra_keys: Value::Nil,
            lora: None,
            shard_keys: vec![b"c0".to_vec()],
        };
        let bytes = encode_batch(
            1.5,
            &[
                BlockEvent::AllCleared,
                BlockEvent::Stored(Arc::new(meta)),
                BlockEvent::Removed(BlockHash::Bytes(b"h".to_vec())),
            ],
        );
        let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let Value::Array(batch) = value else { panic!() };
        assert_eq!(batch[0], Value::F64(1.5));
        let events = batch[1].as_array().unwrap();
        let get = |event: &Value, name: &str| {
            event
                .as_map()
                .unwrap()
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(
            get(&events[0], "type"),
            Some(Value::from("AllBlocksCleared"))
        );
        assert_eq!(get(&events[1], "type"), Some(Value::from("BlockStored")));
        assert_eq!(get(&events[1], "block_size"), Some(Value::from(3)));
        assert_eq!(get(&events[1], "parent_block_hash"), Some(Value::Nil));
        assert_eq!(get(&events[1], "extra_keys"), None, "a default is omitted");
        assert_eq!(
            get(&events[2], "block_hashes"),
            Some(Value::Array(vec![Value::Binary(b"h".to_vec())]))
        );
    }

    #[test]
    fn a_replay_gives_what_is_held_from_the_asked_sequence_on() {
        let mut stream = Stream::new();
        for n in 0..5u8 {
            assert_eq!(stream.push(vec![n]), u64::from(n).to_be_bytes());
        }
        fn replayed(stream: &Stream, start: &[u8]) -> Vec<u8> {
            stream.replay(start).map(|(_, p)| p[0]).collect()
        }
        let from = |start: &[u8]| replayed(&stream, start);
        assert_eq!(from(&3u64.to_be_bytes()), [3, 4]);
        assert_eq!(from(&0u64.to_be_bytes()), [0, 1, 2, 3, 4]);
        assert_eq!(
            from(&[2]),
            [2, 3, 4],
            "a shorter number is still big-endian"
        );
        assert_eq!(from(&9u64.to_be_bytes()), Vec::<u8>::new());
        assert_eq!(from(b""), Vec::<u8>::new(), "not a number");
        assert_eq!(from(&[0; 9]), Vec::<u8>::new(), "not a number");
        // Bounded: the oldest batches go first.
        for _ in 0..REPLAY_BATCHES {
            stream.push(vec![9]);
        }
        assert_eq!(stream.held.len(), REPLAY_BATCHES);
        let held = replayed(&stream, &0u64.to_be_bytes());
        assert!(held.iter().all(|&b| b == 9));
    }
}
