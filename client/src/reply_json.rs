//! Replies as JSON: how the command lines and the benchmarks print a MessagePack reply
//! (a `status` map, a `call` result).

use rmpv::Value;
use serde_json::Value as Json;

/// Converts a MessagePack value (a `status` reply) back into JSON, for `kvwarden status`.
pub fn msgpack_to_json(value: &Value) -> Json {
    match value {
        Value::Nil => Json::Null,
        Value::Boolean(b) => Json::Bool(*b),
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Json::from(u),
            (None, Some(n)) => Json::from(n),
            _ => Json::Null,
        },
        Value::F32(f) => Json::from(f64::from(*f)),
        Value::F64(f) => Json::from(*f),
        Value::String(s) => Json::from(s.as_str().unwrap_or("")),
        Value::Binary(b) => Json::from(b.iter().map(|x| format!("{x:02x}")).collect::<String>()),
        Value::Array(items) => Json::Array(items.iter().map(msgpack_to_json).collect()),
        Value::Map(map) => Json::Object(
            map.iter()
                .map(|(k, v)| {
                    let key = k.as_str().map_or_else(|| k.to_string(), str::to_owned);
                    (key, msgpack_to_json(v))
                })
                .collect(),
        ),
        Value::Ext(_, _) => Json::Null,
    }
}
