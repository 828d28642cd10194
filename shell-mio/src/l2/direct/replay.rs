//! A node's bytes replayed in parts, and what the reader makes of them: for the
//! reader's tests and the `l2_replies` fuzz target, which feed it every split of every
//! reply.

use super::{GetReply, NodeConn, SetReply, Socket, protocol_error};
use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// Bytes a node sent, arriving in parts (one per receive; none left: the node closed):
/// what the reader's tests and the `l2_replies` fuzz target feed it.
struct Parts(std::collections::VecDeque<Vec<u8>>);

impl Read for Parts {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(mut part) = self.0.pop_front() else {
            return Ok(0);
        };
        let taken = part.len().min(buf.len());
        buf[..taken].copy_from_slice(&part[..taken]);
        if taken < part.len() {
            self.0.push_front(part.split_off(taken));
        }
        Ok(taken)
    }
}

impl Write for Parts {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Socket for Parts {
    fn set_read_timeout(&self, _timeout: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// A command whose reply the reader is asked to read ([`read_replies`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    Get,
    Set,
}

/// What the reader made of one reply ([`read_replies`]).
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyRead {
    Absent,
    Value(Vec<u8>),
    Stored,
    Error(String),
}

/// For the `l2_replies` fuzz target and the reader's tests only: the replies to `asked`
/// (each `GETRANGE` of at most `limit_bytes + 1` bytes), received in `parts`, read as an
/// L2 thread reads them (a value: its first bytes, then the rest against a deadline,
/// then CRLF), up to and including the first error, after which the thread drops the
/// connection and reads nothing more from it.
#[doc(hidden)]
pub fn read_replies(
    parts: Vec<Vec<u8>>,
    asked: &[Asked],
    limit_bytes: u64,
) -> Vec<Result<ReplyRead, String>> {
    /// The most bytes of a value read before the rest (an L2 value's header).
    const FIRST_BYTES: usize = 24;
    let mut conn = NodeConn::over(Parts(parts.into()), Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(3600);
    let mut read = Vec::new();
    for asked in asked {
        let reply = match asked {
            Asked::Get => conn.get_reply(limit_bytes).and_then(|reply| match reply {
                GetReply::Absent => Ok(ReplyRead::Absent),
                GetReply::Error(message) => Ok(ReplyRead::Error(message)),
                GetReply::TooLong(len) => Err(protocol_error(&format!(
                    "a value of {len} bytes to a GETRANGE of at most {} bytes",
                    limit_bytes.saturating_add(1)
                ))),
                GetReply::Value(len) => {
                    let mut value = vec![0; len];
                    let (first, rest) = value.split_at_mut(len.min(FIRST_BYTES));
                    conn.read_exact_into(first, None, |_| {})?;
                    conn.read_exact_into(rest, Some(deadline), |_| {})?;
                    conn.crlf()?;
                    Ok(ReplyRead::Value(value))
                }
            }),
            Asked::Set => conn.set_reply().map(|reply| match reply {
                SetReply::Stored => ReplyRead::Stored,
                SetReply::Error(message) => ReplyRead::Error(message),
            }),
        };
        let failed = reply.is_err();
        read.push(reply.map_err(|error| error.to_string()));
        if failed {
            break;
        }
    }
    read
}
