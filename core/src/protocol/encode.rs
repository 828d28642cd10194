//! Requests as they travel: the one typed request encoder, shared by the client, the
//! benches, the simulator and the fuzz targets.

use super::frame::encode_frame;
use super::request::{BufferSpec, Op, Request, RopeSpec};
use crate::InstanceId;
use rmpv::Value;

/// A framed request.
pub fn encode_request(id: u64, op: &str, args: Vec<Value>) -> Vec<u8> {
    framed(&Value::Array(vec![
        id.into(),
        op.into(),
        Value::Array(args),
    ]))
}

fn framed(value: &Value) -> Vec<u8> {
    let mut body = Vec::new();
    // Writing into a Vec cannot fail.
    if rmpv::encode::write_value(&mut body, value).is_err() {
        body.clear();
    }
    encode_frame(&body)
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
            BufferSpec::CudaVmm {
                fd_index,
                device,
                allocation_bytes,
                offset,
                nbytes,
            } => Value::Map(vec![
                ("kind".into(), "cuda_vmm".into()),
                ("fd_index".into(), Value::from(*fd_index)),
                ("device".into(), Value::from(*device)),
                ("allocation_bytes".into(), Value::from(*allocation_bytes)),
                ("offset".into(), Value::from(*offset)),
                ("nbytes".into(), Value::from(*nbytes)),
            ]),
        }
    }
}

/// A rope spec as `register_blend` sends it.
fn rope_value(rope: &RopeSpec) -> Value {
    Value::Map(vec![
        ("rotary_dim".into(), Value::from(rope.rotary_dim)),
        ("max_positions".into(), Value::from(rope.max_positions)),
        ("base".into(), Value::F64(rope.base)),
    ])
}

/// A `describe_keys` item: `[key, description]`.
fn pair(key: &[u8], meta: &[u8]) -> Value {
    Value::Array(vec![
        Value::Binary(key.to_vec()),
        Value::Binary(meta.to_vec()),
    ])
}

impl Op {
    /// The op's arguments as they travel (`args` of `[request_id, op, args]`), in the
    /// order of the op table in `docs/protocol.md`.
    pub fn args(&self) -> Vec<Value> {
        let uint = Value::from;
        let id = |instance: &InstanceId| Value::from(instance.get());
        let bin = |bytes: &[u8]| Value::Binary(bytes.to_vec());
        match self {
            Op::Hello { .. } => hello_args(self),
            Op::Auth { id, nonce } => vec![Value::Map(vec![
                ("id".into(), bin(id)),
                ("nonce".into(), bin(nonce)),
            ])],
            Op::Attach { instance, secret } => vec![id(instance), bin(secret)],
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
            }
            | Op::Retrieve {
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
            Op::StoreBatch { instance, items } => vec![
                id(instance),
                items_value(items.iter().map(|i| (&i.key, i.buffer, i.offset, i.nbytes))),
            ],
            Op::RetrieveBatch { instance, items } => vec![
                id(instance),
                items_value(items.iter().map(|i| (&i.key, i.buffer, i.offset, i.nbytes))),
            ],
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
            Op::RegisterBlend { instance, rope } => vec![id(instance), rope_value(rope)],
            Op::Status => vec![],
            Op::KvEvents { cursor, max } => vec![bin(cursor), uint(*max)],
            Op::DescribeKeys { items } => vec![Value::Array(
                items.iter().map(|(key, meta)| pair(key, meta)).collect(),
            )],
        }
    }
}

/// `hello`'s arguments: the options map only when an option differs from its default.
fn hello_args(op: &Op) -> Vec<Value> {
    let Op::Hello {
        protocol,
        client,
        pidfd_index,
        sends_fds,
        token,
        proof,
        wait_ms,
    } = op
    else {
        return Vec::new();
    };
    let mut args = vec![Value::from(*protocol), client.as_str().into()];
    let mut options = Vec::new();
    if let Some(index) = pidfd_index {
        options.push(("pidfd_index".into(), Value::from(*index)));
    }
    if !sends_fds {
        options.push(("sends_fds".into(), false.into()));
    }
    if let Some(token) = token {
        options.push(("token".into(), Value::Binary(token.clone())));
    }
    if let Some(proof) = proof {
        options.push(("proof".into(), Value::Binary(proof.clone())));
    }
    if let Some(wait) = wait_ms {
        options.push(("wait_ms".into(), Value::from(*wait)));
    }
    if !options.is_empty() {
        args.push(Value::Map(options));
    }
    args
}

/// A batch's items: `[[key: bin, buffer, offset, nbytes]]`.
fn items_value<'a>(items: impl Iterator<Item = (&'a Vec<u8>, u64, u64, u64)>) -> Value {
    Value::Array(
        items
            .map(|(key, buffer, offset, nbytes)| {
                Value::Array(vec![
                    Value::Binary(key.clone()),
                    buffer.into(),
                    offset.into(),
                    nbytes.into(),
                ])
            })
            .collect(),
    )
}
