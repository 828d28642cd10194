//! The request decoder and encoder against the op table, both directions.

use super::*;
use crate::InstanceId;
use crate::protocol::{ErrorCode, PROTOCOL_VERSION};
use rmpv::Value;

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
    // The arguments are blamed first; a version mismatch is only the less likely cause.
    assert!(
        message.contains("send the arguments in that form"),
        "{message}"
    );
    assert!(message.contains("protocol versions"), "{message}");
}

#[test]
fn any_integer_encoding_is_accepted_and_ids_above_max_are_bad_args() {
    for encoded in [
        vec![0x93, 0x01, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0x05],
        vec![
            0x93, 0xcc, 0x01, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0xd0, 0x05,
        ],
        vec![
            0x93, 0xd3, 0, 0, 0, 0, 0, 0, 0, 1, 0xa4, b'p', b'i', b'n', b'g', 0x91, 0xcf, 0, 0, 0,
            0, 0, 0, 0, 5,
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
            pidfd_index: None,
            sends_fds: true,
            token: None,
            proof: None,
            wait_ms: None,
        },
        Op::Hello {
            protocol: PROTOCOL_VERSION,
            client: "w".into(),
            pidfd_index: Some(0),
            sends_fds: true,
            token: None,
            proof: None,
            wait_ms: None,
        },
        Op::Hello {
            protocol: PROTOCOL_VERSION,
            client: "w".into(),
            pidfd_index: None,
            sends_fds: false,
            token: None,
            proof: None,
            wait_ms: None,
        },
        Op::Hello {
            protocol: PROTOCOL_VERSION,
            client: "w".into(),
            pidfd_index: Some(1),
            sends_fds: false,
            token: None,
            proof: None,
            wait_ms: None,
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
                BufferSpec::CudaVmm {
                    fd_index: 1,
                    device: 0,
                    allocation_bytes: 2 << 20,
                    offset: 4096,
                    nbytes: 8192,
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
            nbytes: 2,
        },
        Op::Attach {
            instance,
            secret: vec![9; 32],
        },
        Op::Auth {
            id: [1; 16],
            nonce: [2; 32],
        },
        Op::Hello {
            protocol: PROTOCOL_VERSION,
            client: "w".into(),
            pidfd_index: None,
            sends_fds: true,
            token: Some(b"t0ken".to_vec()),
            proof: Some(vec![5; 32]),
            wait_ms: None,
        },
        Op::StoreBatch {
            instance,
            items: vec![
                StoreItem {
                    key: key.clone(),
                    buffer: 0,
                    offset: 1,
                    nbytes: 2,
                },
                StoreItem {
                    key: vec![],
                    buffer: 3,
                    offset: 4,
                    nbytes: 5,
                },
            ],
        },
        Op::RetrieveBatch {
            instance,
            items: vec![RetrieveItem {
                key: key.clone(),
                buffer: 1,
                offset: 2,
                nbytes: 3,
            }],
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
        Op::KvEvents {
            cursor: vec![1; 32],
            max: 64,
        },
        Op::DescribeKeys {
            items: vec![(b"k".to_vec(), b"what it is".to_vec())],
        },
    ];
    assert_eq!(
        ops.len(),
        OP_NAMES.len() + 5,
        "one op per name; hello five times (its options), ping twice"
    );
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

/// The typed decoder and the diagnosis agree: a body the typed decoder refuses gets
/// a precise cause from the diagnosis, never the fallback that quotes serde (except
/// for the never-used marker 0xc1, which the value tree reads as nil).
#[test]
fn every_refused_body_is_diagnosed_precisely() {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    fn value(next: &mut dyn FnMut() -> u64, depth: u32) -> Value {
        const WORDS: [&str; 14] = [
            "memfd",
            "cuda_ipc",
            "cuda_vmm",
            "allocation_bytes",
            "kind",
            "fd_index",
            "nbytes",
            "device",
            "handle",
            "offset",
            "rotary_dim",
            "max_positions",
            "base",
            "x",
        ];
        match next() % if depth > 3 { 9 } else { 12 } {
            0 => Value::Nil,
            1 => Value::from(next() % 5),
            2 => Value::from(-((next() % 5) as i64) - 1),
            3 => Value::from(next()),
            4 => Value::F64(1.5),
            5 => Value::from(WORDS[(next() % 12) as usize]),
            6 => Value::Binary(vec![1; (next() % 3) as usize]),
            7 => Value::Boolean(true),
            8 => Value::F32(2.0),
            9 | 10 => Value::Array((0..next() % 4).map(|_| value(next, depth + 1)).collect()),
            _ => Value::Map(
                (0..next() % 6)
                    .map(|_| (value(next, depth + 1), value(next, depth + 1)))
                    .collect(),
            ),
        }
    }
    let mut ops: Vec<&str> = OP_NAMES.to_vec();
    ops.push("fly");
    for round in 0..100_000u32 {
        let op = ops[(next() % ops.len() as u64) as usize];
        let mut args: Vec<Value> = (0..next() % 6).map(|_| value(&mut next, 1)).collect();
        if round % 3 == 0 && !args.is_empty() {
            args[0] = Value::from(next() % 3);
        }
        if round % 2 == 0 && args.len() > 1 {
            let keys: &[&str] = if op == "register_blend" {
                &["rotary_dim", "max_positions", "base"]
            } else {
                &[
                    "kind",
                    "fd_index",
                    "nbytes",
                    "device",
                    "handle",
                    "allocation_bytes",
                    "offset",
                ]
            };
            let mut map: Vec<(Value, Value)> = Vec::new();
            for key in keys {
                if next() % 5 != 0 {
                    let v = match (*key, next() % 6) {
                        (_, 0) => value(&mut next, 3),
                        ("kind", _) => {
                            ["memfd", "cuda_ipc", "cuda_vmm"][(next() % 3) as usize].into()
                        }
                        ("handle", _) => Value::Binary(vec![0; 64]),
                        _ => Value::from(next() % 9),
                    };
                    map.push(((*key).into(), v));
                }
            }
            args[1] = if op == "register_blend" {
                Value::Map(map)
            } else {
                Value::Array(vec![Value::Map(map)])
            };
        }
        let mut bytes = body(Value::Array(vec![
            Value::from(next() % 100),
            op.into(),
            Value::Array(args),
        ]));
        if next() % 10 == 0 {
            let at = (next() as usize) % bytes.len();
            bytes[at] = next() as u8;
        }
        if let Err(error) = decode_request(&bytes) {
            assert!(
                !error.error.message.contains("do not decode") || bytes.contains(&0xc1),
                "{bytes:02x?}: {error}"
            );
        }
    }
}

/// `hello [protocol, client]` (every client before the pidfd) stays valid; the
/// optional options map carries `pidfd_index` and `sends_fds`; anything else is
/// `bad_args` naming it.
#[test]
fn row_24_hello_takes_an_optional_pidfd_index_and_refuses_a_bad_one() {
    let decode = |args: Vec<Value>| decode_request(&request(3.into(), "hello", args));
    let hello_with = |pidfd_index, sends_fds| Op::Hello {
        protocol: 1,
        client: "c".into(),
        pidfd_index,
        sends_fds,
        token: None,
        proof: None,
        wait_ms: None,
    };
    let hello = |pidfd_index| hello_with(pidfd_index, true);
    assert_eq!(decode(vec![1.into(), "c".into()]).unwrap().op, hello(None));
    let options = |entries: Vec<(Value, Value)>| Value::Map(entries);
    let with = |value: Value| options(vec![("pidfd_index".into(), value)]);
    assert_eq!(
        decode(vec![1.into(), "c".into(), with(0.into())])
            .unwrap()
            .op,
        hello(Some(0))
    );
    assert_eq!(
        decode(vec![1.into(), "c".into(), with(Value::Nil)])
            .unwrap()
            .op,
        hello(None)
    );
    // `sends_fds`: false promises no more fds on the connection; nil or true is
    // the default.
    let sends = |value: Value| options(vec![("sends_fds".into(), value)]);
    for (value, expected) in [
        (false.into(), false),
        (true.into(), true),
        (Value::Nil, true),
    ] {
        assert_eq!(
            decode(vec![1.into(), "c".into(), sends(value)]).unwrap().op,
            hello_with(None, expected)
        );
    }
    assert_eq!(
        decode(vec![
            1.into(),
            "c".into(),
            options(vec![
                ("sends_fds".into(), false.into()),
                ("pidfd_index".into(), 0.into())
            ])
        ])
        .unwrap()
        .op,
        hello_with(Some(0), false)
    );
    // Unknown options are ignored (room to grow); an empty map means no pidfd.
    let other = options(vec![("later".into(), true.into())]);
    assert_eq!(
        decode(vec![1.into(), "c".into(), other]).unwrap().op,
        hello(None)
    );
    assert_eq!(
        decode(vec![1.into(), "c".into(), options(vec![])])
            .unwrap()
            .op,
        hello(None)
    );
    for (args, says) in [
        (
            vec![1.into(), "c".into(), with((-1).into())],
            "negative int -1",
        ),
        (vec![1.into(), "c".into(), with("0".into())], "pidfd_index"),
        (
            vec![1.into(), "c".into(), sends(0.into())],
            "options.sends_fds must be a boolean, got uint 0",
        ),
        (
            vec![1.into(), "c".into(), sends("no".into())],
            "options.sends_fds must be a boolean",
        ),
        (
            vec![1.into(), "c".into(), 0.into()],
            "`options` must be a map",
        ),
        (
            vec![1.into(), "c".into(), Value::Nil, Value::Nil],
            "4 arguments instead of 2 or 3",
        ),
        (vec![1.into()], "1 arguments instead of 2 or 3"),
    ] {
        let error = decode(args).unwrap_err().error;
        assert_eq!(error.code, ErrorCode::BadArgs);
        assert!(error.message.contains(says), "{}", error.message);
    }
}

/// A batch is `[instance_id, items]`; a bad item is `bad_args` naming its index and
/// field, and more than `MAX_BATCH_ITEMS` items is `bad_args` naming the limit.
#[test]
fn batch_ops_decode_and_refuse_a_bad_item_by_its_index() {
    let item = |key: &[u8], rest: &[u64]| {
        let mut parts = vec![Value::Binary(key.to_vec())];
        parts.extend(rest.iter().map(|&n| Value::from(n)));
        Value::Array(parts)
    };
    let decode = |op: &str, items: Vec<Value>| {
        decode_request(&request(4.into(), op, vec![7.into(), Value::Array(items)]))
    };
    let instance = InstanceId::new(7).unwrap();
    assert_eq!(
        decode("retrieve_batch", vec![item(b"k", &[0, 8, 16])])
            .unwrap()
            .op,
        Op::RetrieveBatch {
            instance,
            items: vec![RetrieveItem {
                key: b"k".to_vec(),
                buffer: 0,
                offset: 8,
                nbytes: 16,
            }]
        }
    );
    // A protocol-1 item without its length is refused, naming the shape.
    let old = decode("retrieve_batch", vec![item(b"k", &[0, 8])]).unwrap_err();
    assert_eq!(old.error.code, ErrorCode::BadArgs);
    assert!(
        old.error.message.contains("nbytes"),
        "{}",
        old.error.message
    );
    assert_eq!(
        decode("store_batch", vec![]).unwrap().op,
        Op::StoreBatch {
            instance,
            items: vec![]
        }
    );
    let good = item(b"k", &[0, 0, 8]);
    for (op, items, says) in [
        (
            "store_batch",
            vec![good.clone(), item(b"k", &[0, 0])],
            "items[1] has 3 values instead of 4",
        ),
        (
            "store_batch",
            vec![good.clone(), good.clone(), Value::from(3)],
            "items[2] must be an array of 4 values, got uint 3",
        ),
        (
            "store_batch",
            vec![Value::Array(vec![
                Value::Binary(vec![1]),
                0.into(),
                (-1).into(),
                8.into(),
            ])],
            "items[0].offset must be an unsigned integer, got negative int -1",
        ),
        (
            "retrieve_batch",
            vec![Value::Array(vec![1.into(), 0.into(), 0.into(), 0.into()])],
            "items[0].key must be bin, got uint 1",
        ),
        (
            "retrieve_batch",
            vec![item(b"k", &[0, 0, 0]); MAX_BATCH_ITEMS + 1],
            "1025 items; a batch holds at most 1024",
        ),
    ] {
        let error = decode(op, items).unwrap_err();
        assert_eq!(error.request_id, Some(4));
        assert_eq!(error.error.code, ErrorCode::BadArgs);
        assert!(
            error.error.message.contains(says),
            "{}",
            error.error.message
        );
        assert!(error.error.message.contains(op), "{}", error.error.message);
    }
    let error = decode_request(&request(4.into(), "store_batch", vec![7.into()])).unwrap_err();
    assert!(error.error.message.contains("1 arguments instead of 2"));
    assert_eq!(
        decode(
            "retrieve_batch",
            vec![item(b"k", &[0, 0, 0]); MAX_BATCH_ITEMS]
        )
        .unwrap()
        .op
        .name(),
        "retrieve_batch"
    );
}
