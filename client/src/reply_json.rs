//! Replies as JSON: how the command lines and the benchmarks print a MessagePack reply
//! (a `status` map, a `call` result).

use rmpv::Value;
use serde_json::Value as Json;

/// Turns every id in `json` into a string: the integer value of a key named `id` or
/// ending in `_id`, and the integers of a list under a key ending in `_ids`, at any depth.
///
/// Ids are 63-bit: a JSON number above 2^53 is rounded by jq, JavaScript and Grafana, and
/// a rounded id names another instance and matches no log line. Every JSON a person
/// reads (`GET /status`, `kvwarden status --json`, `kvwarden call`) goes through this
/// one rule, so all of them show the same map.
pub fn ids_as_strings(json: &mut Json) {
    match json {
        Json::Object(map) => {
            for (key, value) in map.iter_mut() {
                if key == "id" || key.ends_with("_id") {
                    stringify_integer(value);
                } else if key.ends_with("_ids")
                    && let Json::Array(items) = value
                {
                    items.iter_mut().for_each(stringify_integer);
                } else {
                    ids_as_strings(value);
                }
            }
        }
        Json::Array(items) => items.iter_mut().for_each(ids_as_strings),
        _ => {}
    }
}

fn stringify_integer(value: &mut Json) {
    if let Json::Number(n) = value
        && (n.is_u64() || n.is_i64())
    {
        *value = Json::String(n.to_string());
    }
}

/// Converts a MessagePack value (a `status` reply) back into JSON, for `kvwarden status`.
/// Ids stay numbers here (tests compare them as such); what is printed for people goes
/// through [`ids_as_strings`] as well.
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ids_above_2_pow_53_become_exact_strings_at_any_depth() {
        let mut shown = json!({
            "boot_id": 138_417_436_216_666_983_u64,
            "instances": [{"instance_id": 1_350_828_252_971_355_580_u64, "pid": 7}],
            "seen_ids": [1, 2],
            "request_id": "already",
            "uptime_seconds": 1.5,
        });
        ids_as_strings(&mut shown);
        assert_eq!(
            shown,
            json!({
                "boot_id": "138417436216666983",
                "instances": [{"instance_id": "1350828252971355580", "pid": 7}],
                "seen_ids": ["1", "2"],
                "request_id": "already",
                "uptime_seconds": 1.5,
            })
        );
    }
}
