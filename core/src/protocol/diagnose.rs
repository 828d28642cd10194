//! Why a body is not a valid request: the messages of `bad_frame`, `bad_args` and
//! `unknown_op`, which name the op, what it expects and what arrived.
//!
//! This runs only when the typed decoder ([`super::wire_args`]) refused a body, so it
//! may build a MessagePack value tree (depth-limited, like the typed decoder). Each op's
//! arguments are checked in order against its row of the op table
//! ([`super::contract`]); the first mismatch is the answer.

use super::contract::{
    Arg, MAX_BATCH_ITEMS, MAX_DEPTH, MAX_KEY_BYTES, MAX_TEXT_BYTES, OP_NAMES, OpKind,
    PROTOCOL_VERSION,
};
use super::describe::{describe, describe_args, truncate};
use super::error::{DecodeError, ErrorCode, ProtocolError};
use super::tcp_auth::{KEY_ID_BYTES, NONCE_BYTES};
use crate::InstanceId;
use rmpv::Value;

/// The error for a body the typed decoder refused. `refusal` is what it said, used
/// only when no check here names a more precise cause.
pub(super) fn diagnose(body: &[u8], refusal: &str) -> DecodeError {
    match envelope(body) {
        Err(error) => error,
        Ok((id, op, items)) => DecodeError {
            request_id: Some(id),
            error: check_args(&op, &items).err().unwrap_or_else(|| {
                let row = OpKind::from_name(&op).map(OpKind::row);
                let args = Args {
                    op: row.map_or("?", |row| row.name),
                    expects: row.map_or("?", |row| row.expects),
                    items: &items,
                };
                args.mismatch(format!(
                    "the arguments do not decode: {}",
                    truncate(refusal)
                ))
            }),
        },
    }
}

/// The request id, op name and argument list of a body, or the `bad_frame` /
/// `bad_args` error of an envelope that is not `[request_id, op, args]`.
fn envelope(body: &[u8]) -> Result<(u64, String, Vec<Value>), DecodeError> {
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
    Ok((id, op_name.to_owned(), items))
}

/// Checks each argument of `op` in order against its row of the op table; the first
/// mismatch is the error.
fn check_args(op: &str, items: &[Value]) -> Result<(), ProtocolError> {
    let Some(row) = OpKind::from_name(op).map(OpKind::row) else {
        return Err(ProtocolError::new(
            ErrorCode::UnknownOp,
            format!(
                "unknown op `{}`; this server (protocol {PROTOCOL_VERSION}) knows: {}; \
                 a newer client may need a newer server",
                truncate(op),
                OP_NAMES.join(", ")
            ),
        ));
    };
    let a = Args {
        op: row.name,
        expects: row.expects,
        items,
    };
    let shape = row.args;
    let optional = shape
        .iter()
        .filter(|arg| matches!(arg, Arg::HelloOptions))
        .count();
    if optional == 0 {
        a.count(shape.len())?;
    } else if !(shape.len() - optional..=shape.len()).contains(&items.len()) {
        return Err(a.mismatch(format!(
            "{} arguments instead of {} or {}",
            items.len(),
            shape.len() - optional,
            shape.len()
        )));
    }
    for (index, arg) in shape.iter().enumerate().take(items.len()) {
        match *arg {
            Arg::Uint(name) => drop(a.uint(index, name)?),
            Arg::Instance => drop(a.instance(index)?),
            Arg::InstanceOrNil => {
                if items[index] != Value::Nil {
                    a.instance(index)?;
                }
            }
            Arg::Text(name) => a.string(index, name)?,
            Arg::Bin(name) => a.bin(index, name)?,
            Arg::Keys => a.keys(index)?,
            Arg::Buffers => a.buffers(index)?,
            Arg::Items => a.batch_items(index, &["key", "buffer", "offset", "nbytes"])?,
            Arg::Descriptions => a.batch_items(index, &["key", "meta"])?,
            Arg::HelloOptions => a.hello_options(index)?,
            Arg::AuthChallenge => a.auth_challenge(index)?,
            Arg::Rope => a.rope(index)?,
        }
    }
    Ok(())
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
                "bad arguments for `{}`: expects {}, got {}: {detail}; send the arguments \
                 in that form (a client and a server of different protocol versions \
                 disagree on it too: this server speaks protocol {PROTOCOL_VERSION}; then \
                 upgrade the older side)",
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

    fn string(&self, index: usize, name: &str) -> Result<(), ProtocolError> {
        match self.items.get(index).and_then(Value::as_str) {
            Some(text) if text.len() > MAX_TEXT_BYTES => Err(self.mismatch(format!(
                "{name} is {} bytes; at most {MAX_TEXT_BYTES}",
                text.len()
            ))),
            Some(_) => Ok(()),
            None => Err(self.wrong(index, name, "a UTF-8 string")),
        }
    }

    fn bin(&self, index: usize, name: &str) -> Result<(), ProtocolError> {
        match self.items.get(index) {
            Some(value) if is_key(value) => self.key_length(value, name),
            _ => Err(self.wrong(index, name, "bin")),
        }
    }

    /// A key (or bin) past [`MAX_KEY_BYTES`] is refused naming its size.
    fn key_length(&self, value: &Value, name: &str) -> Result<(), ProtocolError> {
        let len = match value {
            Value::Binary(bytes) => bytes.len(),
            Value::String(text) => text.as_bytes().len(),
            _ => 0,
        };
        if len > MAX_KEY_BYTES {
            return Err(self.mismatch(format!(
                "{name} is {len} bytes; a key holds at most {MAX_KEY_BYTES} (hash long keys)"
            )));
        }
        Ok(())
    }

    fn map(&self, index: usize, name: &str) -> Result<&[(Value, Value)], ProtocolError> {
        match self.items.get(index) {
            Some(Value::Map(map)) => Ok(map),
            _ => Err(self.wrong(index, name, "a map")),
        }
    }

    /// A batch's items: at most [`MAX_BATCH_ITEMS`] arrays of `fields`, the first a key
    /// and the others unsigned integers.
    fn batch_items(&self, index: usize, fields: &[&str]) -> Result<(), ProtocolError> {
        let Some(Value::Array(items)) = self.items.get(index) else {
            return Err(self.wrong(index, "items", "an array of item arrays"));
        };
        if items.len() > MAX_BATCH_ITEMS {
            return Err(self.mismatch(format!(
                "{} items; a batch holds at most {MAX_BATCH_ITEMS}; split it",
                items.len()
            )));
        }
        for (position, item) in items.iter().enumerate() {
            let Value::Array(parts) = item else {
                return Err(self.mismatch(format!(
                    "items[{position}] must be an array of {} values, got {}",
                    fields.len(),
                    describe(item)
                )));
            };
            if parts.len() != fields.len() {
                return Err(self.mismatch(format!(
                    "items[{position}] has {} values instead of {} ({})",
                    parts.len(),
                    fields.len(),
                    fields.join(", ")
                )));
            }
            for (part, name) in parts.iter().zip(fields) {
                if *name == "key" && is_key(part) {
                    self.key_length(part, &format!("items[{position}].key"))?;
                }
                let bin = *name == "key" || *name == "meta";
                let fits = if bin {
                    is_key(part)
                } else {
                    part.as_u64().is_some()
                };
                if !fits {
                    let wanted = if bin { "bin" } else { "an unsigned integer" };
                    return Err(self.mismatch(format!(
                        "items[{position}].{name} must be {wanted}, got {}",
                        describe(part)
                    )));
                }
            }
        }
        Ok(())
    }

    fn keys(&self, index: usize) -> Result<(), ProtocolError> {
        let Some(Value::Array(keys)) = self.items.get(index) else {
            return Err(self.wrong(index, "keys", "an array of bin"));
        };
        if !keys.iter().all(is_key) {
            return Err(self.wrong(index, "keys", "an array of bin"));
        }
        if keys.len() > MAX_BATCH_ITEMS {
            return Err(self.mismatch(format!(
                "{} keys; a lookup holds at most {MAX_BATCH_ITEMS}; split it",
                keys.len()
            )));
        }
        for (position, key) in keys.iter().enumerate() {
            self.key_length(key, &format!("keys[{position}]"))?;
        }
        Ok(())
    }

    fn hello_options(&self, index: usize) -> Result<(), ProtocolError> {
        let map = self.map(index, "options")?;
        match field(map, "pidfd_index") {
            None | Some(Value::Nil) => {}
            Some(value) if value.as_u64().is_some() => {}
            Some(value) => {
                return Err(self.mismatch(format!(
                    "options.pidfd_index must be an unsigned integer, got {}",
                    describe(value)
                )));
            }
        }
        match field(map, "sends_fds") {
            None | Some(Value::Nil | Value::Boolean(_)) => {}
            Some(value) => {
                return Err(self.mismatch(format!(
                    "options.sends_fds must be a boolean, got {}",
                    describe(value)
                )));
            }
        }
        match field(map, "token") {
            None | Some(Value::Nil | Value::String(_) | Value::Binary(_)) => {}
            Some(value) => {
                return Err(self.mismatch(format!(
                    "options.token must be a str or bin (the contents of the server's \
                     --tcp-token-file), got {}",
                    describe(value)
                )));
            }
        }
        match field(map, "proof") {
            None | Some(Value::Nil | Value::Binary(_)) => {}
            Some(value) => {
                return Err(self.mismatch(format!(
                    "options.proof must be a bin (the client's proof for this connection's \
                     `auth`), got {}",
                    describe(value)
                )));
            }
        }
        match field(map, "wait_ms") {
            None | Some(Value::Nil) => Ok(()),
            Some(value) if value.as_u64().is_some() => Ok(()),
            Some(value) => Err(self.mismatch(format!(
                "options.wait_ms must be an unsigned integer (how long the client waits for a \
                 reply, in milliseconds), got {}",
                describe(value)
            ))),
        }
    }

    fn auth_challenge(&self, index: usize) -> Result<(), ProtocolError> {
        let map = self.map(index, "challenge")?;
        for (key, bytes) in [("id", KEY_ID_BYTES), ("nonce", NONCE_BYTES)] {
            match field(map, key) {
                Some(Value::Binary(value)) if value.len() == bytes => {}
                other => {
                    return Err(self.mismatch(format!(
                        "{key} must be a bin of {bytes} bytes, got {}",
                        other.map_or_else(|| "nothing".to_owned(), describe)
                    )));
                }
            }
        }
        Ok(())
    }

    fn rope(&self, index: usize) -> Result<(), ProtocolError> {
        let map = self.map(index, "rope")?;
        field_uint(self, map, "rotary_dim")?;
        field_uint(self, map, "max_positions")?;
        if field(map, "base").and_then(Value::as_f64).is_none() {
            return Err(self.wrong(index, "rope.base", "a float"));
        }
        Ok(())
    }

    fn buffers(&self, index: usize) -> Result<(), ProtocolError> {
        let Some(Value::Array(items)) = self.items.get(index) else {
            return Err(self.wrong(index, "buffers", "an array of buffer maps"));
        };
        for (position, item) in items.iter().enumerate() {
            let Value::Map(map) = item else {
                return Err(self.mismatch(format!(
                    "buffers[{position}] must be a map with a \"kind\", got {}",
                    describe(item)
                )));
            };
            let uint = |key: &str| match field(map, key).and_then(Value::as_u64) {
                Some(_) => Ok(()),
                None => Err(self.mismatch(format!(
                    "buffers[{position}].{key} must be an unsigned integer"
                ))),
            };
            match field(map, "kind").and_then(Value::as_str) {
                Some("memfd") => {
                    uint("fd_index")?;
                    uint("nbytes")?;
                }
                Some("cuda_ipc") => {
                    uint("device")?;
                    if !field(map, "handle").is_some_and(is_key) {
                        return Err(
                            self.mismatch(format!("buffers[{position}].handle must be bin(64)"))
                        );
                    }
                    uint("offset")?;
                    uint("nbytes")?;
                }
                Some("cuda_vmm") => {
                    uint("fd_index")?;
                    uint("device")?;
                    uint("allocation_bytes")?;
                    uint("offset")?;
                    uint("nbytes")?;
                }
                other => {
                    return Err(self.mismatch(format!(
                        "buffers[{position}].kind must be \"memfd\", \"cuda_ipc\" or \"cuda_vmm\", got {}",
                        other.map_or("nothing".to_string(), |k| format!("{:?}", truncate(k)))
                    )));
                }
            }
        }
        Ok(())
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
fn is_key(value: &Value) -> bool {
    matches!(value, Value::Binary(_) | Value::String(_))
}
