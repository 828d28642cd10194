//! Replies `[request_id, ok, value]`: the server encodes them, a client decodes them.

use super::contract::MAX_DEPTH;
use super::describe::describe;
use super::error::{DecodeError, ErrorCode, ProtocolError};
use super::frame::LENGTH_PREFIX_BYTES;
use rmpv::Value;

/// A decoded reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The id of the request it answers.
    pub id: u64,
    /// The value, or the error.
    pub result: Result<Value, ProtocolError>,
}

/// A framed reply.
pub fn encode_reply(id: u64, result: &Result<Value, ProtocolError>) -> Vec<u8> {
    let mut out = Vec::new();
    encode_reply_into(&mut out, id, result);
    out
}

/// Appends a framed reply to `out`: the length prefix, then `[id, ok, value]` written
/// straight into the buffer. Allocates nothing when `out` has room for it (the reply
/// path of a ping).
pub fn encode_reply_into(out: &mut Vec<u8>, id: u64, result: &Result<Value, ProtocolError>) {
    let start = out.len();
    out.extend_from_slice(&[0; LENGTH_PREFIX_BYTES]);
    // Writing into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(out, 3);
    let _ = rmp::encode::write_uint(out, id);
    match result {
        Ok(value) => {
            let _ = rmp::encode::write_bool(out, true);
            let _ = rmpv::encode::write_value(out, value);
        }
        Err(error) => {
            let _ = rmp::encode::write_bool(out, false);
            let _ = rmp::encode::write_map_len(out, 2);
            let _ = rmp::encode::write_str(out, "code");
            let _ = rmp::encode::write_str(out, error.code.as_str());
            let _ = rmp::encode::write_str(out, "message");
            let _ = rmp::encode::write_str(out, &error.message);
        }
    }
    let length = u32::try_from(out.len() - start - LENGTH_PREFIX_BYTES).unwrap_or(u32::MAX);
    out[start..start + LENGTH_PREFIX_BYTES].copy_from_slice(&length.to_be_bytes());
}

/// Decodes a reply body (the client's side). Never panics.
pub fn decode_reply(body: &[u8]) -> Result<Reply, DecodeError> {
    let bad = |message: String| DecodeError {
        request_id: None,
        error: ProtocolError::new(ErrorCode::BadFrame, message),
    };
    let mut reader = body;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|e| bad(format!("reply is not MessagePack: {e}")))?;
    let Value::Array(mut parts) = value else {
        return Err(bad(format!(
            "a reply is [request_id, ok, value], got {}",
            describe(&value)
        )));
    };
    if parts.len() != 3 {
        return Err(bad(format!(
            "a reply is [request_id, ok, value], got {} items",
            parts.len()
        )));
    }
    let value = parts.pop().unwrap_or(Value::Nil);
    let ok = parts.pop().and_then(|v| v.as_bool());
    let id = parts.pop().and_then(|v| v.as_u64());
    let (Some(id), Some(ok)) = (id, ok) else {
        return Err(bad(
            "a reply's request_id must be a uint and ok a bool".into()
        ));
    };
    let result = if ok {
        Ok(value)
    } else {
        let text = |key: &str| match &value {
            Value::Map(map) => map
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .and_then(|(_, v)| v.as_str())
                .unwrap_or("")
                .to_string(),
            _ => String::new(),
        };
        Err(ProtocolError::new(
            ErrorCode::parse(&text("code")),
            text("message"),
        ))
    };
    Ok(Reply { id, result })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_round_trip() {
        let error = ProtocolError::new(ErrorCode::Forbidden, "not yours");
        for result in [Ok(Value::from(true)), Err(error)] {
            let frame = encode_reply(42, &result);
            let reply = decode_reply(&frame[4..]).unwrap();
            assert_eq!(reply, Reply { id: 42, result });
        }
        // Appended after what the buffer already holds, each with its own prefix.
        let mut out = b"xy".to_vec();
        encode_reply_into(&mut out, 1, &Ok(Value::from(true)));
        encode_reply_into(&mut out, 2, &Ok(Value::from(false)));
        let first = super::super::split_frame(&out[2..], 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(decode_reply(first.0).unwrap().result, Ok(Value::from(true)));
        let second = super::super::split_frame(&out[2 + first.1..], 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(decode_reply(second.0).unwrap().id, 2);
    }
}
