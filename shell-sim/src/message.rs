//! What travels between a worker and the server: the protocol's real requests
//! ([`kvwarden_core::protocol::Op`]) or raw bytes for the real decoder, and the real
//! replies (`Result<Value, ProtocolError>`).

use kvwarden_core::InstanceId;
use kvwarden_core::protocol::{DecodeError, Op, ProtocolError, Request};
use rmpv::Value;

/// Which of a worker's connections a message travels on.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Channel {
    /// The client library's connection.
    Main,
    /// A second connection of the same process that sends raw bytes (row 24); the
    /// server closes it on a `bad_frame` and the next bytes open a new one.
    Raw,
}

/// What a request carries.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// A typed request, as the client's encoder would frame it.
    Op {
        /// The request id, echoed in the reply.
        id: u64,
        /// The op.
        op: Op,
        /// How many fds travel with it (`SCM_RIGHTS`).
        fds: usize,
    },
    /// A frame body the server decodes with the real decoder.
    Bytes(Vec<u8>),
    /// A body already through the decoder (set when it reaches the server's socket).
    Decoded(Result<Request, DecodeError>),
}

/// A request from a worker process, as the server's socket receives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The worker slot it came from.
    pub slot: usize,
    /// Which process in that slot (a restart is a new incarnation).
    pub incarnation: u32,
    /// The id the process chose at start-up.
    pub instance: InstanceId,
    /// The server boot the connection was opened to: a restart breaks it.
    pub boot: u64,
    /// When the worker sent it.
    pub sent_at: u64,
    /// The worker is shutting down cleanly (its UNREGISTER is the last word).
    pub exiting: bool,
    /// The connection.
    pub channel: Channel,
    /// The process's uid (`SO_PEERCRED`).
    pub uid: u32,
    /// Whether the server can open a pidfd of the process (same host and pid namespace).
    pub same_host: bool,
    /// The secret the process drew with `instance`. The client attaches on every
    /// connection before anything else: the first message of a connection to reach the
    /// server opens it, and the shell hands the node that connection's `attach
    /// [instance, secret]` before the message (request id [`HANDSHAKE_ID`] + `epoch`).
    /// None: a peer that attaches nothing (a TCP probe).
    pub secret: Option<[u8; 32]>,
    /// Which connection of the process this travels on: bumped when the client
    /// reconnects (told to attach first) or draws a fresh identity. A message of an
    /// older connection than the server saw last is lost with it.
    pub epoch: u32,
    /// Over TCP: no uid, no fds; the peer is nobody until a `hello` with the token.
    pub tcp: bool,
    /// What it asks.
    pub payload: Payload,
}

/// Request ids from here up are the connection's own `attach` (plus its epoch); the
/// client reads only a refusal of it.
pub const HANDSHAKE_ID: u64 = 0xffff_ffff_0000_0000;

impl Envelope {
    /// The decoded op, if it decoded.
    pub fn op(&self) -> Option<&Op> {
        match &self.payload {
            Payload::Op { op, .. } => Some(op),
            Payload::Decoded(Ok(request)) => Some(&request.op),
            _ => None,
        }
    }

    /// A small stable code for the trace hash.
    pub fn code(&self) -> u64 {
        match &self.payload {
            Payload::Op { op, id, .. } => op_code(op) ^ id << 8,
            Payload::Bytes(bytes) => 100 ^ (bytes.len() as u64) << 8,
            Payload::Decoded(Ok(request)) => op_code(&request.op) ^ request.id << 8,
            Payload::Decoded(Err(error)) => 101 ^ error.request_id.unwrap_or(0) << 8,
        }
    }
}

fn op_code(op: &Op) -> u64 {
    kvwarden_core::protocol::OP_NAMES
        .iter()
        .position(|name| *name == op.name())
        .unwrap_or(99) as u64
}

/// A reply on its way to a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplyEnvelope {
    /// The worker slot it goes to.
    pub slot: usize,
    /// The process it answers.
    pub incarnation: u32,
    /// The server boot that answered.
    pub boot: u64,
    /// The request it answers.
    pub request_id: u64,
    /// The answer.
    pub result: Result<Value, ProtocolError>,
}

/// A request body as the client encodes it (`[request_id, op, args]`, unframed).
pub fn body(id: u64, op: &str, args: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    let value = Value::Array(vec![id.into(), op.into(), Value::Array(args)]);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &value);
    out
}
