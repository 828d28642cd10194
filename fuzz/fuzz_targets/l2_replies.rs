//! Arbitrary sequences of RESP replies, well-formed and malformed, split at arbitrary
//! points, through the reader of the L2 data path (`failure-modes.md` row 58), as an L2
//! thread reads the replies to a pipeline of `GETRANGE`s and `SET`s.
//!
//! Oracles, from the replies as generated (not from the reader's code):
//! - every well-formed reply of a shape its command has (a value, nil or an empty
//!   string, an error; `+OK` to a `SET`) is read as itself, whatever came before it and
//!   however the bytes were split;
//! - a malformed reply, or one of a shape its command never has (an array, an integer, a
//!   value to a `SET`, a value longer than asked), is an error, and nothing after it is
//!   read: no later reply is attributed to a later command.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden::l2::{Asked, ReplyRead, read_replies};
use libfuzzer_sys::fuzz_target;

/// The most bytes a `GETRANGE` asks for, less one (`GETRANGE name 0 LIMIT`).
const LIMIT_BYTES: u64 = 64;

#[derive(Arbitrary, Debug)]
enum Reply {
    Nil,
    Empty,
    Value(Vec<u8>),
    Error(Vec<u8>),
    Ok,
    Integer(i64),
    Array(Vec<Vec<u8>>),
    /// Malformed: a line whose first byte is no RESP2 type Redis writes here.
    BadType(u8, Vec<u8>),
    /// Malformed: a length that is not a number.
    BadLength(Vec<u8>),
    /// Malformed: a value not followed by CRLF.
    NoCrlf(Vec<u8>, [u8; 2]),
    /// Malformed: a negative length other than nil's.
    Negative(u16),
    /// An empty line.
    EmptyLine,
}

#[derive(Arbitrary, Debug)]
struct Input {
    replies: Vec<(bool, Reply)>,
    /// Where the bytes are split into receives.
    cuts: Vec<u16>,
    /// Bytes of the last reply cut off (the node closed mid-reply).
    truncate: u8,
}

/// A line's text: no CR or LF in it.
fn text(bytes: &[u8]) -> Vec<u8> {
    bytes
        .iter()
        .copied()
        .filter(|&b| b != b'\r' && b != b'\n')
        .collect()
}

fn bulk(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", value.len()).as_bytes());
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `reply`'s bytes; what the reader must make of it when `asked`: Some(read),
/// or None: an error (and nothing after it read).
fn encode(out: &mut Vec<u8>, reply: &Reply, asked: Asked) -> Option<ReplyRead> {
    let get = asked == Asked::Get;
    match reply {
        Reply::Nil => {
            out.extend_from_slice(b"$-1\r\n");
            get.then_some(ReplyRead::Absent)
        }
        Reply::Empty => {
            out.extend_from_slice(b"$0\r\n\r\n");
            get.then_some(ReplyRead::Absent)
        }
        Reply::Value(value) => {
            let value: &[u8] = if value.is_empty() { b"v" } else { value };
            bulk(out, value);
            (get && value.len() as u64 <= LIMIT_BYTES + 1).then(|| ReplyRead::Value(value.to_vec()))
        }
        Reply::Error(message) => {
            let message = text(message);
            out.push(b'-');
            out.extend_from_slice(&message);
            out.extend_from_slice(b"\r\n");
            Some(ReplyRead::Error(
                String::from_utf8_lossy(&message).into_owned(),
            ))
        }
        Reply::Ok => {
            out.extend_from_slice(b"+OK\r\n");
            (!get).then_some(ReplyRead::Stored)
        }
        Reply::Integer(n) => {
            out.extend_from_slice(format!(":{n}\r\n").as_bytes());
            None
        }
        Reply::Array(items) => {
            out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
            for item in items {
                bulk(out, item);
            }
            None
        }
        Reply::BadType(kind, rest) => {
            let kind = if b"$+-:".contains(kind) { b'?' } else { *kind };
            out.push(kind);
            out.extend_from_slice(&text(rest));
            out.extend_from_slice(b"\r\n");
            None
        }
        Reply::BadLength(rest) => {
            out.extend_from_slice(b"$x");
            out.extend_from_slice(&text(rest));
            out.extend_from_slice(b"\r\n");
            None
        }
        Reply::NoCrlf(value, end) => {
            let end = if end == b"\r\n" { *b"\r." } else { *end };
            out.extend_from_slice(format!("${}\r\n", value.len() + 1).as_bytes());
            out.push(b'v');
            out.extend_from_slice(value);
            out.extend_from_slice(&end);
            None
        }
        Reply::Negative(n) => {
            out.extend_from_slice(format!("$-{}\r\n", u32::from(*n) + 2).as_bytes());
            None
        }
        Reply::EmptyLine => {
            out.extend_from_slice(b"\r\n");
            None
        }
    }
}

fuzz_target!(|input: Input| {
    let mut bytes = Vec::new();
    let mut asked = Vec::new();
    let mut expected = Vec::new();
    for (is_set, reply) in input.replies.iter().take(64) {
        let command = if *is_set { Asked::Set } else { Asked::Get };
        asked.push(command);
        expected.push((bytes.len(), encode(&mut bytes, reply, command)));
    }
    // The node closes early: the last reply (if any) loses up to `truncate` bytes, and
    // becomes an error; only replies wholly before the cut are owed.
    let sent = bytes
        .len()
        .saturating_sub(usize::from(input.truncate) % 8)
        .max(expected.last().map_or(0, |&(start, _)| start));
    let truncated = sent < bytes.len();
    bytes.truncate(sent);
    let mut cuts: Vec<usize> = input
        .cuts
        .iter()
        .take(256)
        .map(|&cut| usize::from(cut) % (sent + 1))
        .collect();
    cuts.push(0);
    cuts.push(sent);
    cuts.sort_unstable();
    cuts.dedup();
    let parts: Vec<Vec<u8>> = cuts
        .windows(2)
        .map(|pair| bytes[pair[0]..pair[1]].to_vec())
        .collect();

    let read = read_replies(parts, &asked, LIMIT_BYTES);
    for (at, got) in read.iter().enumerate() {
        let (_, owed) = &expected[at];
        let last = at + 1 == expected.len();
        match (owed, got) {
            (Some(owed), Ok(got)) => {
                assert!(
                    !(last && truncated),
                    "reply {at} read from a cut-off stream: {got:?}"
                );
                assert_eq!(got, owed, "reply {at} read as another");
            }
            (Some(_), Err(_)) => assert!(
                last && truncated,
                "the well-formed reply {at} was refused: {got:?}"
            ),
            (None, Ok(got)) => panic!("reply {at}, malformed or unexpected, read as {got:?}"),
            (None, Err(_)) => {}
        }
        if got.is_err() {
            assert_eq!(at + 1, read.len(), "read on after an error");
        }
    }
    // Everything owed was read, up to the first reply that is an error.
    let stop = expected
        .iter()
        .position(|(_, owed)| owed.is_none())
        .map_or(expected.len(), |at| at + 1);
    assert_eq!(read.len(), stop, "read {} of {stop} replies", read.len());
});
