//! Framing: a 4-byte big-endian length `N`, then `N` bytes of MessagePack.

use thiserror::Error;

/// Bytes of the length prefix.
pub const LENGTH_PREFIX_BYTES: usize = 4;

/// A frame header that breaks the stream.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Error)]
pub enum FrameError {
    /// `N = 0`: no message can be empty.
    #[error("bad frame: length 0; every frame carries a MessagePack request of at least 1 byte")]
    Empty,
    /// `N` above the limit.
    #[error(
        "frame of {length} bytes is larger than this server's limit of {max_frame_bytes} \
         bytes (--max-frame-bytes); split the request or raise the limit"
    )]
    TooLarge {
        /// The length announced.
        length: u64,
        /// The limit in force.
        max_frame_bytes: usize,
    },
}

/// Reads the header at the start of `buffer`: `Ok(None)` while fewer than 4 bytes are
/// there, `Ok(Some(body_len))` once the length is known and acceptable.
pub fn parse_header(buffer: &[u8], max_frame_bytes: usize) -> Result<Option<usize>, FrameError> {
    let Some(prefix) = buffer.first_chunk::<LENGTH_PREFIX_BYTES>() else {
        return Ok(None);
    };
    let length = u32::from_be_bytes(*prefix);
    if length == 0 {
        return Err(FrameError::Empty);
    }
    match usize::try_from(length) {
        Ok(length) if length <= max_frame_bytes => Ok(Some(length)),
        _ => Err(FrameError::TooLarge {
            length: u64::from(length),
            max_frame_bytes,
        }),
    }
}

/// Splits one complete frame off the front of `buffer`: `Ok(Some((body, consumed)))`,
/// or `Ok(None)` when more bytes are needed.
pub fn split_frame(
    buffer: &[u8],
    max_frame_bytes: usize,
) -> Result<Option<(&[u8], usize)>, FrameError> {
    let Some(body_len) = parse_header(buffer, max_frame_bytes)? else {
        return Ok(None);
    };
    let total = LENGTH_PREFIX_BYTES + body_len;
    match buffer.get(LENGTH_PREFIX_BYTES..total) {
        Some(body) => Ok(Some((body, total))),
        None => Ok(None),
    }
}

/// Prefixes `body` with its length. Bodies above 4 GiB cannot be framed and are
/// reported as an error message instead of being truncated.
pub fn encode_frame(body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(LENGTH_PREFIX_BYTES + body.len());
    let length = u32::try_from(body.len()).unwrap_or(u32::MAX);
    frame.extend_from_slice(&length.to_be_bytes());
    frame.extend_from_slice(body);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_needs_four_bytes_and_rejects_zero_and_huge() {
        assert_eq!(parse_header(&[0, 0, 1], 10), Ok(None));
        assert_eq!(parse_header(&[0, 0, 0, 0], 10), Err(FrameError::Empty));
        assert_eq!(parse_header(&[0, 0, 0, 10], 10), Ok(Some(10)));
        assert!(matches!(
            parse_header(&[255, 255, 255, 255], 10),
            Err(FrameError::TooLarge {
                length: 4_294_967_295,
                ..
            })
        ));
    }

    #[test]
    fn split_waits_for_the_whole_body() {
        let frame = encode_frame(b"abc");
        assert_eq!(split_frame(&frame[..5], 100), Ok(None));
        assert_eq!(split_frame(&frame, 100), Ok(Some((&b"abc"[..], 7))));
    }
}
