//! Node-scoped KV events (issue 42, `kvwarden serve --kv-events TENANT=ENDPOINT`): the
//! server announces one tenant's blocks itself, in vLLM's own format, for KV-aware
//! routers with no engine in the loop. Pure: the node feeds each tenant's
//! [`Announcer`] the changes it logs and the descriptions it is given
//! ([`BlockMeta`]); the shell's publisher sends what [`Stream`] and [`encode_batch`]
//! make of the events.

mod announce;
mod meta;
mod recency;
mod stream;

pub use announce::{Announcer, BlockEvent, MAX_BLOCKS, MAX_SHARDS};
pub use meta::{BlockHash, BlockMeta, MAX_SHARDS_PER_BLOCK, META_VERSION};
pub use stream::{END_SEQ, MEDIUM, OWNERSHIP, REPLAY_BATCHES, REPLAY_BYTES, Stream, encode_batch};
