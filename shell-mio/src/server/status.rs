//! The status map: `status` op (MessagePack) and `GET /status` (JSON) show the same.

use rmpv::Value;
use serde_json::Value as Json;

/// Converts the JSON status into MessagePack for the `status` op.
pub fn json_to_msgpack(json: &Json) -> Value {
    match json {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Boolean(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::F64(n.as_f64().unwrap_or(0.0))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::Array(items.iter().map(json_to_msgpack).collect()),
        Json::Object(map) => Value::Map(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_msgpack(v)))
                .collect(),
        ),
    }
}

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
