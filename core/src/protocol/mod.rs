//! The wire protocol (version 1): framing, typed requests and replies, and the error
//! codes of `docs/protocol.md`.
//!
//! Everything here is pure: bytes in, values out. Decoding never panics on any input
//! and never allocates more than a constant multiple of the frame it is given, which is
//! itself bounded by `--max-frame-bytes`. The fuzzer drives [`decode_request`] and
//! [`frame::parse_header`] directly.

mod diagnose;
pub mod error;
pub mod frame;
pub mod reply;
pub mod request;
mod wire_args;

pub use error::{DecodeError, ErrorCode, ProtocolError};
pub use frame::{FrameError, LENGTH_PREFIX_BYTES, encode_frame, parse_header, split_frame};
pub use reply::{Reply, decode_reply, encode_reply, encode_reply_into, encode_request};
pub use request::{
    BufferSpec, MAX_BATCH_ITEMS, Op, Request, RetrieveItem, RopeSpec, StoreItem, decode_request,
};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u64 = 2;

/// The deepest MessagePack nesting a valid request needs is 5 (request, args, buffers,
/// buffer map, value); anything much deeper is garbage and must not cost stack.
pub const MAX_DEPTH: usize = 16;
