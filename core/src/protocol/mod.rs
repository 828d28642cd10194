//! The wire protocol (version 1): framing, typed requests and replies, and the error
//! codes of `docs/protocol.md`.
//!
//! Everything here is pure: bytes in, values out. Decoding never panics on any input
//! and never allocates more than a constant multiple of the frame it is given, which is
//! itself bounded by `--max-frame-bytes`. The fuzzer drives [`decode_request`] and
//! [`frame::parse_header`] directly.

pub mod answer;
pub mod contract;
mod describe;
mod diagnose;
mod encode;
pub mod error;
pub mod frame;
pub mod reply;
pub mod request;
pub mod status;
pub mod tcp_auth;
#[cfg(test)]
mod tests;
mod wire_args;

pub use answer::{
    Answer, Attached, Challenge, HelloReply, KvEvent, KvEvents, KvTier, Outcome, PinnedSlot,
    PoolGeometry, Registered, ReplyShape, ReplyValue, ReservedSlot,
};
pub use contract::{
    MAX_BATCH_ITEMS, MAX_DEPTH, MAX_KEY_BYTES, MAX_KV_EVENTS, MAX_META_BYTES, MAX_TEXT_BYTES,
    OP_COUNT, OP_NAMES, OpKind, PROTOCOL_VERSION,
};

pub use encode::encode_request;
pub use error::{DecodeError, ErrorCode, ProtocolError};
pub use frame::{FrameError, LENGTH_PREFIX_BYTES, encode_frame, parse_header, split_frame};
pub use reply::{Reply, decode_reply, encode_reply, encode_reply_into};
pub use request::{BufferSpec, Op, Request, RetrieveItem, RopeSpec, StoreItem};
pub use status::StatusReport;

/// Decodes one frame body into a request. Never panics.
///
/// Every malformed input maps to an error code of the spec: a body that is not a
/// MessagePack request at all is `bad_frame`; a known op with the wrong arguments is
/// `bad_args`, naming the op, what it expects and what arrived; an op this server does
/// not know is `unknown_op`. A valid body goes through the typed serde decoder
/// (`wire_args`) alone; only a refused one is decoded again, into a value tree, to say
/// what is wrong with it (`diagnose`).
pub fn decode_request(body: &[u8]) -> Result<Request, DecodeError> {
    wire_args::decode(body).map_err(|refusal| diagnose::diagnose(body, &refusal))
}
