//! Short descriptions of MessagePack values for error messages: a value's type and
//! size, never its whole content.

use rmpv::Value;

/// Caps names echoed back into messages.
pub(super) fn truncate(text: &str) -> &str {
    match text.char_indices().nth(64) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

pub(super) fn describe_args(items: &[Value]) -> String {
    let shown: Vec<String> = items.iter().take(8).map(describe).collect();
    let more = if items.len() > 8 { ", …" } else { "" };
    format!("[{}{more}] ({} arguments)", shown.join(", "), items.len())
}

/// A short type description of a value, never its whole content.
pub(super) fn describe(value: &Value) -> String {
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
