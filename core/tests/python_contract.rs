//! The Python client speaks the contract the Rust one does: its error-code table is
//! exactly [`ErrorCode::ALL`], every op it sends is a row of the op table, and its
//! protocol version and limits (batch items, instance ids, secret length) are the
//! server's, the block descriptions it writes are of the version the server reads, and
//! every key it reads out of a reply map, and every outcome, is one the server sends.
//!
//! Read from the Python sources (`python/src/kvwarden/`), so that a code or an op
//! added on one side only fails here, in `cargo test --workspace`.

use kvwarden_core::protocol::{ErrorCode, OP_NAMES};
use std::collections::BTreeSet;
use std::path::PathBuf;

fn python_source(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../python/src/kvwarden")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of the first `"..."` after `start` in `text`.
fn quoted_after(text: &str, start: usize) -> Option<&str> {
    let open = start + text[start..].find('"')? + 1;
    let close = open + text[open..].find('"')?;
    Some(&text[open..close])
}

/// `(class name, code)` of each direct subclass of `ServerError` in `errors.py`.
fn python_server_error_classes(errors: &str) -> Vec<(String, String)> {
    let mut classes = Vec::new();
    let mut rest = 0;
    while let Some(found) = errors[rest..].find("(ServerError):") {
        let at = rest + found;
        let line_start = errors[..at].rfind("class ").expect("a class statement");
        let name = errors[line_start + "class ".len()..at].to_string();
        let code_at = at
            + errors[at..]
                .find("code = ")
                .expect("the class sets its code");
        let code = quoted_after(errors, code_at).expect("a quoted code");
        classes.push((name, code.to_string()));
        rest = at + 1;
    }
    classes
}

#[test]
fn python_error_codes_are_exactly_the_rust_ones() {
    let errors = python_source("errors.py");
    let classes = python_server_error_classes(&errors);
    let python: BTreeSet<&str> = classes.iter().map(|(_, code)| code.as_str()).collect();
    let rust: BTreeSet<&str> = ErrorCode::ALL.iter().map(|code| code.as_str()).collect();
    assert_eq!(
        python, rust,
        "python/src/kvwarden/errors.py's ServerError subclasses and ErrorCode::ALL differ"
    );
    assert_eq!(classes.len(), rust.len(), "two Python classes share a code");
    // Each class is in the table that turns a reply's code into the class.
    let table_at = errors.find("_BY_CODE").expect("errors.py's _BY_CODE table");
    let table = &errors[table_at..table_at + errors[table_at..].find("\n}").unwrap()];
    for (name, code) in &classes {
        assert!(
            table.contains(&format!("        {name},")),
            "{name} (code {code}) is missing from _BY_CODE"
        );
    }
}

/// The op names the Python sources send: the first argument of each
/// `_request("op"`, `_transfer("op"`, `call("op"` and `encode_frame(…, "op"`.
fn python_ops(source: &str) -> BTreeSet<String> {
    let mut ops = BTreeSet::new();
    for call in [
        "_request(",
        "_transfer(",
        " call(",
        "encode_frame(request_id, ",
    ] {
        let mut rest = 0;
        while let Some(found) = source[rest..].find(call) {
            let at = rest + found + call.len();
            let text = source[at..].trim_start();
            if let Some(literal) = text.strip_prefix('"')
                && let Some(end) = literal.find('"')
            {
                ops.insert(literal[..end].to_string());
            }
            rest = at;
        }
    }
    ops
}

#[test]
fn every_op_the_python_client_sends_is_in_the_op_table() {
    let mut sent = BTreeSet::new();
    for file in ["worker.py", "wire.py", "vllm.py"] {
        sent.extend(python_ops(&python_source(file)));
    }
    // The scan finds the client's ops: the ones every worker sends at least.
    for op in [
        "hello",
        "attach",
        "ping",
        "register_kv_cache",
        "store",
        "lookup",
    ] {
        assert!(sent.contains(op), "the scan missed `{op}`; found {sent:?}");
    }
    let unknown: Vec<&String> = sent
        .iter()
        .filter(|op| !OP_NAMES.contains(&op.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "the Python client sends ops the server does not know: {unknown:?}"
    );
}

#[test]
fn the_scans_see_a_code_or_an_op_out_of_contract() {
    // The control: the same scans on a doctored source find what is wrong.
    let errors = python_source("errors.py").replace("code = \"forbidden\"", "code = \"gone\"");
    let codes: BTreeSet<String> = python_server_error_classes(&errors)
        .into_iter()
        .map(|(_, code)| code)
        .collect();
    assert!(codes.contains("gone") && !codes.contains("forbidden"));
    let ops = python_ops("x = self._request(\"teleport\", [1])\n");
    assert_eq!(ops, BTreeSet::from(["teleport".to_string()]));
    assert!(!OP_NAMES.contains(&"teleport"));
}

/// The integer a top-level `NAME = <expression>` of `source` sets, for the expressions
/// the client uses: a literal (`1024`, `64 * 1024`) or `(1 << 63) - 1`.
fn python_constant(source: &str, name: &str) -> Option<u64> {
    let line = source
        .lines()
        .find(|line| line.starts_with(&format!("{name} = ")))?;
    let expression = line[name.len() + 3..].split('#').next()?.trim();
    if expression == "(1 << 63) - 1" {
        return Some((1 << 63) - 1);
    }
    expression
        .split('*')
        .map(|factor| factor.trim().parse::<u64>().ok())
        .product()
}

#[test]
fn the_python_clients_limits_are_the_servers() {
    use kvwarden_core::InstanceId;
    use kvwarden_core::node::trust::{MAX_SECRET_BYTES, MIN_SECRET_BYTES};
    use kvwarden_core::protocol::{MAX_BATCH_ITEMS, PROTOCOL_VERSION};
    let wire = python_source("wire.py");
    let worker = python_source("worker.py");
    assert_eq!(
        python_constant(&wire, "PROTOCOL_VERSION"),
        Some(PROTOCOL_VERSION),
        "python/src/kvwarden/wire.py's PROTOCOL_VERSION is not the server's"
    );
    assert_eq!(
        python_constant(&worker, "MAX_BATCH_ITEMS"),
        Some(MAX_BATCH_ITEMS as u64),
        "python/src/kvwarden/worker.py's MAX_BATCH_ITEMS is not the server's"
    );
    assert_eq!(
        python_constant(&worker, "INSTANCE_ID_MAX"),
        Some(InstanceId::MAX),
        "python/src/kvwarden/worker.py's INSTANCE_ID_MAX is not the server's"
    );
    let secret = python_constant(&worker, "SECRET_BYTES").expect("worker.py's SECRET_BYTES");
    assert!(
        (MIN_SECRET_BYTES as u64..=MAX_SECRET_BYTES as u64).contains(&secret),
        "python/src/kvwarden/worker.py's SECRET_BYTES {secret} is outside the server's \
         {MIN_SECRET_BYTES}..={MAX_SECRET_BYTES}"
    );
    assert_eq!(
        python_constant(&python_source("kv_announce.py"), "META_VERSION"),
        Some(kvwarden_core::kv_publish::META_VERSION),
        "python/src/kvwarden/kv_announce.py writes descriptions of another version than \
         the server reads (kvwarden_core::kv_publish::META_VERSION)"
    );
    // The control: the same reading of a doctored source sees the difference.
    let doctored = wire.replace("PROTOCOL_VERSION = 3", "PROTOCOL_VERSION = 4");
    assert_eq!(python_constant(&doctored, "PROTOCOL_VERSION"), Some(4));
    assert_eq!(python_constant("X = 64 * 1024 * 1024", "X"), Some(64 << 20));
    assert_eq!(python_constant("X = size()", "X"), None);
}

/// The keys the Python client reads out of a reply map (`value.get("k"` and
/// `value["k"]`).
fn python_reply_keys(source: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for pattern in ["value.get(", "value["] {
        let mut rest = 0;
        while let Some(at) = source[rest..].find(pattern) {
            let start = rest + at + pattern.len();
            if source[start..].starts_with('"')
                && let Some(key) = quoted_after(source, start)
            {
                keys.insert(key.to_string());
            }
            rest = start;
        }
    }
    keys
}

/// Every string key of every map in `value`, however deep.
fn map_keys(value: &rmpv::Value, keys: &mut BTreeSet<String>) {
    match value {
        rmpv::Value::Map(entries) => {
            for (key, value) in entries {
                if let Some(key) = key.as_str() {
                    keys.insert(key.to_string());
                }
                map_keys(value, keys);
            }
        }
        rmpv::Value::Array(items) => items.iter().for_each(|item| map_keys(item, keys)),
        _ => {}
    }
}

/// The keys of every reply shape the server sends (one answer of each map shape, and
/// an error's map), and the outcomes it names.
fn server_reply_keys() -> (BTreeSet<String>, BTreeSet<&'static str>) {
    use kvwarden_core::protocol::answer::{
        Attached, Challenge, HelloReply, KvEvent, KvEvents, KvTier, Outcome, PinnedSlot,
        PoolGeometry, Registered, ReservedSlot,
    };
    use kvwarden_core::protocol::{Answer, ProtocolError, split_frame};
    let answers = [
        Answer::Hello(HelloReply {
            protocol: 3,
            server: "node-a".into(),
            boot_id: 7,
            reap_timeout_seconds: 30.0,
            registration_grace_seconds: 2.5,
            exit_proof: "pidfd_by_pid".into(),
            sends_fds: false,
            tenant: Some("team-a".into()),
        }),
        Answer::Attached(Attached::Claimed),
        Answer::Registered(Registered {
            outcome: Outcome::Created,
            pool: Some(PoolGeometry {
                slot_bytes: 4096,
                num_slots: 8,
            }),
        }),
        Answer::Reserved(Some(ReservedSlot {
            slot: 1,
            offset: 4096,
            nbytes: 4096,
        })),
        Answer::Pinned(Some(PinnedSlot {
            offset: 0,
            nbytes: 10,
        })),
        Answer::Challenge(Challenge {
            nonce: [1; 32],
            proof: [2; 32],
        }),
        Answer::Events(KvEvents {
            cursor: vec![7; 32],
            resync: true,
            events: vec![KvEvent {
                stored: true,
                key: b"a".to_vec(),
                tier: KvTier::L1,
                meta: None,
            }],
            more: false,
        }),
    ];
    let mut keys = BTreeSet::new();
    for answer in &answers {
        map_keys(&answer.to_value(), &mut keys);
    }
    let error = Err(ProtocolError::new(ErrorCode::Forbidden, "no"));
    let frame = kvwarden_core::protocol::encode_reply(1, &error);
    let (mut body, _) = split_frame(&frame, 1 << 20)
        .ok()
        .flatten()
        .expect("a frame");
    map_keys(
        &rmpv::decode::read_value(&mut body).expect("a reply"),
        &mut keys,
    );
    let outcomes = [Attached::Claimed, Attached::Proven]
        .map(Attached::label)
        .into_iter()
        .chain([Outcome::Created, Outcome::Refreshed].map(Outcome::label))
        .collect();
    (keys, outcomes)
}

#[test]
fn every_reply_key_and_outcome_the_python_client_reads_is_one_the_server_sends() {
    let (server_keys, outcomes) = server_reply_keys();
    let source = python_source("wire.py") + &python_source("worker.py");
    let read = python_reply_keys(&source);
    assert!(
        read.len() >= 15,
        "the scan finds the client's reads: {read:?}"
    );
    let unknown: Vec<&String> = read.difference(&server_keys).collect();
    assert!(
        unknown.is_empty(),
        "the Python client reads reply keys no reply of the server has: {unknown:?} (the \
         server's: {server_keys:?})"
    );
    for outcome in outcomes {
        assert!(
            source.contains(&format!("\"{outcome}\"")),
            "the server answers outcome {outcome:?}, which the Python client never names"
        );
    }
    // The control: a key the server never sends is seen.
    let doctored = source.replace("value[\"nbytes\"]", "value[\"n_bytes\"]");
    assert!(!python_reply_keys(&doctored).is_subset(&server_keys));
}
