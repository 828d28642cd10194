//! Requests: `[request_id: uint, op: str, args: array]`, decoded into typed values.
//!
//! Every malformed input maps to an error code of the spec: a body that is not a
//! MessagePack request at all is `bad_frame`; a known op with the wrong arguments is
//! `bad_args`, naming the op, what it expects and what arrived; an op this server does
//! not know is `unknown_op`.

use super::error::{DecodeError, ErrorCode, ProtocolError};
use super::reply::encode_request;
use super::{MAX_DEPTH, PROTOCOL_VERSION};
use crate::InstanceId;
use rmpv::Value;

/// A decoded request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The id the reply must carry.
    pub id: u64,
    /// What is asked.
    pub op: Op,
}

/// A buffer a worker registers.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferSpec {
    /// Host memory shared as a memfd sent with the frame (`SCM_RIGHTS`).
    Memfd {
        /// Index of the fd among those that arrived with the frame.
        fd_index: u64,
        /// Bytes the worker claims the memfd holds.
        nbytes: u64,
    },
    /// A `cuIpcGetMemHandle` handle of an allocation's base.
    CudaIpc {
        /// The CUDA device ordinal.
        device: u64,
        /// The 64-byte IPC handle.
        handle: Vec<u8>,
        /// Where the buffer starts inside the allocation.
        offset: u64,
        /// The buffer's length.
        nbytes: u64,
    },
}

/// CacheBlend rope parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Rotary dimension.
    pub rotary_dim: u64,
    /// Positions to precompute.
    pub max_positions: u64,
    /// RoPE base.
    pub base: f64,
}

/// An op with its arguments.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // the fields are those of the op table in protocol.md
pub enum Op {
    Hello {
        protocol: u64,
        client: String,
    },
    Ping {
        instance: Option<InstanceId>,
    },
    RegisterKvCache {
        instance: InstanceId,
        buffers: Vec<BufferSpec>,
        model_name: String,
        world_size: u64,
    },
    UnregisterKvCache {
        instance: InstanceId,
    },
    Store {
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
        nbytes: u64,
    },
    Retrieve {
        instance: InstanceId,
        key: Vec<u8>,
        buffer: u64,
        offset: u64,
    },
    Lookup {
        keys: Vec<Vec<u8>>,
    },
    RegisterEngineDriven {
        instance: InstanceId,
        model_name: String,
        world_size: u64,
    },
    UnregisterEngineDriven {
        instance: InstanceId,
    },
    PrepareStore {
        instance: InstanceId,
        key: Vec<u8>,
    },
    CommitStore {
        instance: InstanceId,
        key: Vec<u8>,
        nbytes: u64,
    },
    PrepareRetrieve {
        instance: InstanceId,
        key: Vec<u8>,
    },
    CommitRetrieve {
        instance: InstanceId,
        key: Vec<u8>,
    },
    RegisterBlend {
        instance: InstanceId,
        rope: RopeSpec,
    },
    Status,
}

/// Every op name this server knows, for metrics labels and error messages.
pub const OP_NAMES: [&str; 15] = [
    "hello",
    "ping",
    "register_kv_cache",
    "unregister_kv_cache",
    "store",
    "retrieve",
    "lookup",
    "register_engine_driven",
    "unregister_engine_driven",
    "prepare_store",
    "commit_store",
    "prepare_retrieve",
    "commit_retrieve",
    "register_blend",
    "status",
];

impl Op {
    /// The op's wire name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Hello { .. } => "hello",
            Op::Ping { .. } => "ping",
            Op::RegisterKvCache { .. } => "register_kv_cache",
            Op::UnregisterKvCache { .. } => "unregister_kv_cache",
            Op::Store { .. } => "store",
            Op::Retrieve { .. } => "retrieve",
            Op::Lookup { .. } => "lookup",
            Op::RegisterEngineDriven { .. } => "register_engine_driven",
            Op::UnregisterEngineDriven { .. } => "unregister_engine_driven",
            Op::PrepareStore { .. } => "prepare_store",
            Op::CommitStore { .. } => "commit_store",
            Op::PrepareRetrieve { .. } => "prepare_retrieve",
            Op::CommitRetrieve { .. } => "commit_retrieve",
            Op::RegisterBlend { .. } => "register_blend",
            Op::Status => "status",
        }
    }

    /// The instance the op names, if any (ownership is checked against it).
    pub fn instance(&self) -> Option<InstanceId> {
        match self {
            Op::Hello { .. } | Op::Lookup { .. } | Op::Status => None,
            Op::Ping { instance } => *instance,
            Op::RegisterKvCache { instance, .. }
            | Op::UnregisterKvCache { instance }
            | Op::Store { instance, .. }
            | Op::Retrieve { instance, .. }
            | Op::RegisterEngineDriven { instance, .. }
            | Op::UnregisterEngineDriven { instance }
            | Op::PrepareStore { instance, .. }
            | Op::CommitStore { instance, .. }
            | Op::PrepareRetrieve { instance, .. }
            | Op::CommitRetrieve { instance, .. }
            | Op::RegisterBlend { instance, .. } => Some(*instance),
        }
    }
}

impl Request {
    /// The framed request, as a worker sends it: the one typed request encoder, shared
    /// by the client, the benches, the simulator and the fuzz targets.
    ///
    /// Decoding the frame's body gives this request back (`decode_request`).
    pub fn encode(&self) -> Vec<u8> {
        encode_request(self.id, self.op.name(), self.op.args())
    }
}

impl BufferSpec {
    /// The buffer map of `register_kv_cache`.
    pub fn to_value(&self) -> Value {
        match self {
            BufferSpec::Memfd { fd_index, nbytes } => Value::Map(vec![
                ("kind".into(), "memfd".into()),
                ("fd_index".into(), Value::from(*fd_index)),
                ("nbytes".into(), Value::from(*nbytes)),
            ]),
            BufferSpec::CudaIpc {
                device,
                handle,
                offset,
                nbytes,
            } => Value::Map(vec![
                ("kind".into(), "cuda_ipc".into()),
                ("device".into(), Value::from(*device)),
                ("handle".into(), Value::Binary(handle.clone())),
                ("offset".into(), Value::from(*offset)),
                ("nbytes".into(), Value::from(*nbytes)),
            ]),
        }
    }
}

impl Op {
    /// The op's arguments as they travel (`args` of `[request_id, op, args]`), in the
    /// order of the op table in `docs/protocol.md`.
    pub fn args(&self) -> Vec<Value> {
        let uint = Value::from;
        let id = |instance: &InstanceId| Value::from(instance.get());
        let bin = |bytes: &[u8]| Value::Binary(bytes.to_vec());
        match self {
            Op::Hello { protocol, client } => vec![uint(*protocol), client.as_str().into()],
            Op::Ping { instance } => vec![instance.as_ref().map_or(Value::Nil, id)],
            Op::RegisterKvCache {
                instance,
                buffers,
                model_name,
                world_size,
            } => vec![
                id(instance),
                Value::Array(buffers.iter().map(BufferSpec::to_value).collect()),
                model_name.as_str().into(),
                uint(*world_size),
            ],
            Op::UnregisterKvCache { instance } | Op::UnregisterEngineDriven { instance } => {
                vec![id(instance)]
            }
            Op::Store {
                instance,
                key,
                buffer,
                offset,
                nbytes,
            } => vec![
                id(instance),
                bin(key),
                uint(*buffer),
                uint(*offset),
                uint(*nbytes),
            ],
            Op::Retrieve {
                instance,
                key,
                buffer,
                offset,
            } => vec![id(instance), bin(key), uint(*buffer), uint(*offset)],
            Op::Lookup { keys } => vec![Value::Array(keys.iter().map(|k| bin(k)).collect())],
            Op::RegisterEngineDriven {
                instance,
                model_name,
                world_size,
            } => vec![id(instance), model_name.as_str().into(), uint(*world_size)],
            Op::PrepareStore { instance, key }
            | Op::PrepareRetrieve { instance, key }
            | Op::CommitRetrieve { instance, key } => vec![id(instance), bin(key)],
            Op::CommitStore {
                instance,
                key,
                nbytes,
            } => vec![id(instance), bin(key), uint(*nbytes)],
            Op::RegisterBlend { instance, rope } => vec![
                id(instance),
                Value::Map(vec![
                    ("rotary_dim".into(), uint(rope.rotary_dim)),
                    ("max_positions".into(), uint(rope.max_positions)),
                    ("base".into(), Value::F64(rope.base)),
                ]),
            ],
            Op::Status => vec![],
        }
    }
}

/// Decodes one frame body into a request. Never panics; see the module docs for the
/// error codes.
pub fn decode_request(body: &[u8]) -> Result<Request, DecodeError> {
    let bad_frame = |message: String| DecodeError {
        request_id: None,
        error: ProtocolError::new(ErrorCode::BadFrame, message),
    };
    let mut reader = body;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH).map_err(|e| {
        bad_frame(format!(
            "the frame body ({} bytes) is not a MessagePack value: {e}; expected \
             [request_id: uint, op: str, args: array]",
            body.len()
        ))
    })?;
    if !reader.is_empty() {
        return Err(bad_frame(format!(
            "{} trailing bytes after the request in the frame; a frame carries exactly one \
             MessagePack request [request_id, op, args]",
            reader.len()
        )));
    }
    let Value::Array(mut parts) = value else {
        return Err(bad_frame(format!(
            "a request is a MessagePack array [request_id: uint, op: str, args: array], got {}",
            describe(&value)
        )));
    };
    if parts.len() != 3 {
        return Err(bad_frame(format!(
            "a request is [request_id: uint, op: str, args: array], got an array of {} items",
            parts.len()
        )));
    }
    let args = parts.pop().unwrap_or(Value::Nil);
    let op = parts.pop().unwrap_or(Value::Nil);
    let id_value = parts.pop().unwrap_or(Value::Nil);
    let Some(id) = id_value.as_u64() else {
        return Err(bad_frame(format!(
            "request_id must be an unsigned integer, got {}",
            describe(&id_value)
        )));
    };
    let fail = |code: ErrorCode, message: String| DecodeError {
        request_id: Some(id),
        error: ProtocolError::new(code, message),
    };
    let Some(op_name) = op.as_str() else {
        return Err(fail(
            ErrorCode::BadArgs,
            format!("op must be a string, got {}", describe(&op)),
        ));
    };
    let Value::Array(items) = args else {
        return Err(fail(
            ErrorCode::BadArgs,
            format!(
                "args of `{}` must be an array, got {}",
                truncate(op_name),
                describe(&args)
            ),
        ));
    };
    let op = decode_op(op_name, &items).map_err(|error| DecodeError {
        request_id: Some(id),
        error,
    })?;
    Ok(Request { id, op })
}

fn decode_op(op: &str, items: &[Value]) -> Result<Op, ProtocolError> {
    let args = |expects: &'static str, name: &'static str| Args {
        op: name,
        expects,
        items,
    };
    Ok(match op {
        "hello" => {
            let a = args("[protocol: uint, client: str]", "hello");
            a.count(2)?;
            Op::Hello {
                protocol: a.uint(0, "protocol")?,
                client: a.string(1, "client")?,
            }
        }
        "ping" => {
            let a = args("[instance_id: uint | nil]", "ping");
            a.count(1)?;
            let instance = match &items[0] {
                Value::Nil => None,
                _ => Some(a.instance(0)?),
            };
            Op::Ping { instance }
        }
        "register_kv_cache" => {
            let a = args(
                "[instance_id: uint, buffers: [buffer], model_name: str, world_size: uint]",
                "register_kv_cache",
            );
            a.count(4)?;
            Op::RegisterKvCache {
                instance: a.instance(0)?,
                buffers: a.buffers(1)?,
                model_name: a.string(2, "model_name")?,
                world_size: a.uint(3, "world_size")?,
            }
        }
        "unregister_kv_cache" => {
            let a = args("[instance_id: uint]", "unregister_kv_cache");
            a.count(1)?;
            Op::UnregisterKvCache {
                instance: a.instance(0)?,
            }
        }
        "store" => {
            let a = args(
                "[instance_id: uint, key: bin, buffer: uint, offset: uint, nbytes: uint]",
                "store",
            );
            a.count(5)?;
            Op::Store {
                instance: a.instance(0)?,
                key: a.bin(1, "key")?,
                buffer: a.uint(2, "buffer")?,
                offset: a.uint(3, "offset")?,
                nbytes: a.uint(4, "nbytes")?,
            }
        }
        "retrieve" => {
            let a = args(
                "[instance_id: uint, key: bin, buffer: uint, offset: uint]",
                "retrieve",
            );
            a.count(4)?;
            Op::Retrieve {
                instance: a.instance(0)?,
                key: a.bin(1, "key")?,
                buffer: a.uint(2, "buffer")?,
                offset: a.uint(3, "offset")?,
            }
        }
        "lookup" => {
            let a = args("[keys: [bin]]", "lookup");
            a.count(1)?;
            let Value::Array(keys) = &items[0] else {
                return Err(a.wrong(0, "keys", "an array of bin"));
            };
            let mut out = Vec::with_capacity(keys.len());
            for key in keys {
                match key_bytes(key) {
                    Some(bytes) => out.push(bytes),
                    None => return Err(a.wrong(0, "keys", "an array of bin")),
                }
            }
            Op::Lookup { keys: out }
        }
        "register_engine_driven" => {
            let a = args(
                "[instance_id: uint, model_name: str, world_size: uint]",
                "register_engine_driven",
            );
            a.count(3)?;
            Op::RegisterEngineDriven {
                instance: a.instance(0)?,
                model_name: a.string(1, "model_name")?,
                world_size: a.uint(2, "world_size")?,
            }
        }
        "unregister_engine_driven" => {
            let a = args("[instance_id: uint]", "unregister_engine_driven");
            a.count(1)?;
            Op::UnregisterEngineDriven {
                instance: a.instance(0)?,
            }
        }
        "prepare_store" | "prepare_retrieve" | "commit_retrieve" => {
            let name = match op {
                "prepare_store" => "prepare_store",
                "prepare_retrieve" => "prepare_retrieve",
                _ => "commit_retrieve",
            };
            let a = args("[instance_id: uint, key: bin]", name);
            a.count(2)?;
            let instance = a.instance(0)?;
            let key = a.bin(1, "key")?;
            match name {
                "prepare_store" => Op::PrepareStore { instance, key },
                "prepare_retrieve" => Op::PrepareRetrieve { instance, key },
                _ => Op::CommitRetrieve { instance, key },
            }
        }
        "commit_store" => {
            let a = args(
                "[instance_id: uint, key: bin, nbytes: uint]",
                "commit_store",
            );
            a.count(3)?;
            Op::CommitStore {
                instance: a.instance(0)?,
                key: a.bin(1, "key")?,
                nbytes: a.uint(2, "nbytes")?,
            }
        }
        "register_blend" => {
            let a = args(
                "[instance_id: uint, rope: {rotary_dim: uint, max_positions: uint, base: float}]",
                "register_blend",
            );
            a.count(2)?;
            let instance = a.instance(0)?;
            let map = a.map(1, "rope")?;
            let rope = RopeSpec {
                rotary_dim: field_uint(&a, map, "rotary_dim")?,
                max_positions: field_uint(&a, map, "max_positions")?,
                base: match field(map, "base").and_then(Value::as_f64) {
                    Some(base) => base,
                    None => return Err(a.wrong(1, "rope.base", "a float")),
                },
            };
            Op::RegisterBlend { instance, rope }
        }
        "status" => {
            let a = args("[]", "status");
            a.count(0)?;
            Op::Status
        }
        other => {
            return Err(ProtocolError::new(
                ErrorCode::UnknownOp,
                format!(
                    "unknown op `{}`; this server (protocol {PROTOCOL_VERSION}) knows: {}; \
                     a newer client may need a newer server",
                    truncate(other),
                    OP_NAMES.join(", ")
                ),
            ));
        }
    })
}

/// The arguments of one op, with the words to complain about them.
struct Args<'a> {
    op: &'static str,
    expects: &'static str,
    items: &'a [Value],
}

impl Args<'_> {
    fn mismatch(&self, detail: String) -> ProtocolError {
        ProtocolError::new(
            ErrorCode::BadArgs,
            format!(
                "bad arguments for `{}`: expects {}, got {}: {detail}; this usually means \
                 the client and the server speak different versions of the protocol \
                 (server: protocol {PROTOCOL_VERSION}); upgrade the older side",
                self.op,
                self.expects,
                describe_args(self.items),
            ),
        )
    }

    fn count(&self, n: usize) -> Result<(), ProtocolError> {
        if self.items.len() == n {
            return Ok(());
        }
        Err(self.mismatch(format!("{} arguments instead of {n}", self.items.len())))
    }

    fn wrong(&self, index: usize, name: &str, wanted: &str) -> ProtocolError {
        let got = self
            .items
            .get(index)
            .map_or("nothing".to_string(), describe);
        self.mismatch(format!("`{name}` must be {wanted}, got {got}"))
    }

    fn uint(&self, index: usize, name: &str) -> Result<u64, ProtocolError> {
        self.items
            .get(index)
            .and_then(Value::as_u64)
            .ok_or_else(|| self.wrong(index, name, "an unsigned integer"))
    }

    fn instance(&self, index: usize) -> Result<InstanceId, ProtocolError> {
        let raw = self.uint(index, "instance_id")?;
        InstanceId::new(raw).map_err(|e| self.mismatch(e.to_string()))
    }

    fn string(&self, index: usize, name: &str) -> Result<String, ProtocolError> {
        self.items
            .get(index)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| self.wrong(index, name, "a UTF-8 string"))
    }

    fn bin(&self, index: usize, name: &str) -> Result<Vec<u8>, ProtocolError> {
        self.items
            .get(index)
            .and_then(key_bytes)
            .ok_or_else(|| self.wrong(index, name, "bin"))
    }

    fn map(&self, index: usize, name: &str) -> Result<&[(Value, Value)], ProtocolError> {
        match self.items.get(index) {
            Some(Value::Map(map)) => Ok(map),
            _ => Err(self.wrong(index, name, "a map")),
        }
    }

    fn buffers(&self, index: usize) -> Result<Vec<BufferSpec>, ProtocolError> {
        let Some(Value::Array(items)) = self.items.get(index) else {
            return Err(self.wrong(index, "buffers", "an array of buffer maps"));
        };
        let mut buffers = Vec::with_capacity(items.len());
        for (position, item) in items.iter().enumerate() {
            let Value::Map(map) = item else {
                return Err(self.mismatch(format!(
                    "buffers[{position}] must be a map with a \"kind\", got {}",
                    describe(item)
                )));
            };
            let uint = |key: &str| {
                field(map, key).and_then(Value::as_u64).ok_or_else(|| {
                    self.mismatch(format!(
                        "buffers[{position}].{key} must be an unsigned integer"
                    ))
                })
            };
            let kind = field(map, "kind").and_then(Value::as_str);
            buffers.push(match kind {
                Some("memfd") => BufferSpec::Memfd {
                    fd_index: uint("fd_index")?,
                    nbytes: uint("nbytes")?,
                },
                Some("cuda_ipc") => BufferSpec::CudaIpc {
                    device: uint("device")?,
                    handle: field(map, "handle").and_then(key_bytes).ok_or_else(|| {
                        self.mismatch(format!("buffers[{position}].handle must be bin(64)"))
                    })?,
                    offset: uint("offset")?,
                    nbytes: uint("nbytes")?,
                },
                other => {
                    return Err(self.mismatch(format!(
                        "buffers[{position}].kind must be \"memfd\" or \"cuda_ipc\", got {}",
                        other.map_or("nothing".to_string(), |k| format!("{:?}", truncate(k)))
                    )));
                }
            });
        }
        Ok(buffers)
    }
}

fn field<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    map.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn field_uint(args: &Args<'_>, map: &[(Value, Value)], key: &str) -> Result<u64, ProtocolError> {
    field(map, key)
        .and_then(Value::as_u64)
        .ok_or_else(|| args.mismatch(format!("rope.{key} must be an unsigned integer")))
}

/// Keys travel as bin; a str is accepted too (some MessagePack clients cannot tell).
fn key_bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::Binary(bytes) => Some(bytes.clone()),
        Value::String(text) => Some(text.as_bytes().to_vec()),
        _ => None,
    }
}

/// Caps names echoed back into messages.
fn truncate(text: &str) -> &str {
    match text.char_indices().nth(64) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

fn describe_args(items: &[Value]) -> String {
    let shown: Vec<String> = items.iter().take(8).map(describe).collect();
    let more = if items.len() > 8 { ", …" } else { "" };
    format!("[{}{more}] ({} arguments)", shown.join(", "), items.len())
}

/// A short type description of a value, never its whole content.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Nil => "nil".into(),
        Value::Boolean(b) => format!("bool {b}"),
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => format!("uint {u}"),
            (None, Some(n)) => format!("negative int {n}"),
            _ => "int".into(),
        },
        Value::F32(_) | Value::F64(_) => "float".into(),
        Value::String(s) => format!("str({} bytes)", s.as_bytes().len()),
        Value::Binary(b) => format!("bin({} bytes)", b.len()),
        Value::Array(a) => format!("array({} items)", a.len()),
        Value::Map(m) => format!("map({} entries)", m.len()),
        Value::Ext(t, _) => format!("ext type {t}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(value: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &value).unwrap();
        out
    }

    fn request(id: Value, op: &str, args: Vec<Value>) -> Vec<u8> {
        body(Value::Array(vec![id, op.into(), Value::Array(args)]))
    }

    #[test]
    fn ping_with_empty_args_is_bad_args_naming_the_mismatch() {
        let error = decode_request(&request(7.into(), "ping", vec![])).unwrap_err();
        assert_eq!(error.request_id, Some(7));
        assert_eq!(error.error.code, ErrorCode::BadArgs);
        let message = error.error.message;
        assert!(message.contains("`ping`"), "{message}");
        assert!(message.contains("[instance_id: uint | nil]"), "{message}");
        assert!(message.contains("0 arguments"), "{message}");
        assert!(message.contains("versions"), "{message}");
    }

    #[test]
    fn any_integer_encoding_is_accepted_and_ids_above_max_are_bad_args() {
        for encoded in [
            vec![0x93, 0x01, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0x05],
            vec![
                0x93, 0xcc, 0x01, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0xd0, 0x05,
            ],
            vec![
                0x93, 0xd3, 0, 0, 0, 0, 0, 0, 0, 1, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0xcf, 0, 0,
                0, 0, 0, 0, 0, 5,
            ],
        ] {
            let request = decode_request(&encoded).unwrap();
            assert_eq!(request.id, 1);
            assert_eq!(
                request.op,
                Op::Ping {
                    instance: Some(InstanceId::new(5).unwrap())
                }
            );
        }
        let too_big = request(1.into(), "ping", vec![Value::from(1u64 << 63)]);
        let error = decode_request(&too_big).unwrap_err();
        assert_eq!(error.error.code, ErrorCode::BadArgs);
        assert!(error.error.message.contains("9223372036854775808"));
        let negative = request(1.into(), "ping", vec![Value::from(-1)]);
        assert_eq!(
            decode_request(&negative).unwrap_err().error.code,
            ErrorCode::BadArgs
        );
    }

    #[test]
    fn garbage_is_bad_frame_and_unknown_ops_are_unknown_op() {
        for garbage in [&b""[..], b"\xc1", b"\x93\x01", b"\x01", b"\x92\x01\x02"] {
            let error = decode_request(garbage).unwrap_err();
            assert_eq!(error.error.code, ErrorCode::BadFrame, "{garbage:?}");
        }
        let error = decode_request(&request(3.into(), "fly", vec![])).unwrap_err();
        assert_eq!(error.error.code, ErrorCode::UnknownOp);
        assert_eq!(error.request_id, Some(3));
    }

    #[test]
    fn deep_nesting_is_rejected_without_recursion_blowup() {
        let mut nested = vec![0x91; 100_000];
        nested.push(0xc0);
        assert_eq!(
            decode_request(&nested).unwrap_err().error.code,
            ErrorCode::BadFrame
        );
    }

    /// A cheap stand-in for the fuzzer until `fuzz/` has a `frame_decode` target:
    /// random bytes and random mutations of valid requests never panic.
    #[test]
    fn random_and_mutated_inputs_never_panic() {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = [
            request(1.into(), "ping", vec![Value::Nil]),
            request(
                2.into(),
                "store",
                vec![
                    1.into(),
                    Value::Binary(vec![1]),
                    0.into(),
                    0.into(),
                    8.into(),
                ],
            ),
            request(
                3.into(),
                "register_kv_cache",
                vec![
                    1.into(),
                    Value::Array(vec![Value::Map(vec![
                        ("kind".into(), "memfd".into()),
                        ("fd_index".into(), 0.into()),
                        ("nbytes".into(), 8.into()),
                    ])]),
                    "m".into(),
                    1.into(),
                ],
            ),
        ];
        for round in 0..50_000 {
            let mut bytes = if round % 2 == 0 {
                let len = (next() % 64) as usize;
                (0..len).map(|_| next() as u8).collect::<Vec<u8>>()
            } else {
                valid[(next() % 3) as usize].clone()
            };
            for _ in 0..(next() % 4) {
                if bytes.is_empty() {
                    break;
                }
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
            }
            let _ = decode_request(&bytes);
            let _ = crate::protocol::decode_reply(&bytes);
        }
    }

    #[test]
    fn register_decodes_memfd_and_cuda_buffers() {
        let memfd = Value::Map(vec![
            ("kind".into(), "memfd".into()),
            ("fd_index".into(), 0.into()),
            ("nbytes".into(), 4096.into()),
        ]);
        let request = decode_request(&request(
            9.into(),
            "register_kv_cache",
            vec![5.into(), Value::Array(vec![memfd]), "m".into(), 1.into()],
        ))
        .unwrap();
        let Op::RegisterKvCache { buffers, .. } = request.op else {
            panic!("wrong op");
        };
        assert_eq!(
            buffers,
            vec![BufferSpec::Memfd {
                fd_index: 0,
                nbytes: 4096
            }]
        );
    }

    #[test]
    fn every_op_encodes_to_a_frame_that_decodes_back_to_it() {
        let instance = InstanceId::new(42).unwrap();
        let key = vec![1, 2, 3];
        let ops = [
            Op::Hello {
                protocol: PROTOCOL_VERSION,
                client: "w".into(),
            },
            Op::Ping { instance: None },
            Op::Ping {
                instance: Some(instance),
            },
            Op::RegisterKvCache {
                instance,
                buffers: vec![
                    BufferSpec::Memfd {
                        fd_index: 0,
                        nbytes: 4096,
                    },
                    BufferSpec::CudaIpc {
                        device: 1,
                        handle: vec![7; 64],
                        offset: 8,
                        nbytes: 16,
                    },
                ],
                model_name: "m".into(),
                world_size: 2,
            },
            Op::UnregisterKvCache { instance },
            Op::Store {
                instance,
                key: key.clone(),
                buffer: 0,
                offset: 1,
                nbytes: 2,
            },
            Op::Retrieve {
                instance,
                key: key.clone(),
                buffer: 0,
                offset: 1,
            },
            Op::Lookup {
                keys: vec![key.clone(), vec![]],
            },
            Op::RegisterEngineDriven {
                instance,
                model_name: "m".into(),
                world_size: 1,
            },
            Op::UnregisterEngineDriven { instance },
            Op::PrepareStore {
                instance,
                key: key.clone(),
            },
            Op::CommitStore {
                instance,
                key: key.clone(),
                nbytes: 9,
            },
            Op::PrepareRetrieve {
                instance,
                key: key.clone(),
            },
            Op::CommitRetrieve {
                instance,
                key: key.clone(),
            },
            Op::RegisterBlend {
                instance,
                rope: RopeSpec {
                    rotary_dim: 64,
                    max_positions: 128,
                    base: 10000.0,
                },
            },
            Op::Status,
        ];
        assert_eq!(ops.len(), OP_NAMES.len() + 1, "one op per name, ping twice");
        for (id, op) in ops.into_iter().enumerate() {
            let request = Request { id: id as u64, op };
            let frame = request.encode();
            let (body, consumed) = crate::protocol::split_frame(&frame, 1 << 20)
                .unwrap()
                .unwrap();
            assert_eq!(consumed, frame.len());
            assert_eq!(decode_request(body).unwrap(), request);
        }
    }
}
