//! The L2 value format: a fixed header that lets a reader prove a value is whole, of this
//! format and written by kvwarden before a single byte of it is served.
//!
//! ```text
//! offset  size  field
//!      0     4  magic            b"KVL2"
//!      4     4  format version   u32, little endian (FORMAT_VERSION)
//!      8     8  payload length   u64, little endian
//!     16     8  payload checksum u64, little endian: xxh3-64 of the payload
//!     24     …  payload
//! ```
//!
//! The checksum catches torn and truncated writes and values written by something else;
//! it is not a signature: whoever can write to the cluster is trusted.

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// The first four bytes of every L2 value.
pub const MAGIC: [u8; 4] = *b"KVL2";

/// The format version this build writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;

/// The size of the header in front of the payload.
pub const HEADER_BYTES: usize = 24;

/// Why a value read from L2 cannot be served. Every variant means: a miss, counted,
/// logged once per key, and the key deleted.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// Shorter than the header, or shorter than the header plus the declared payload.
    #[error(
        "truncated L2 value: {len_bytes} bytes, a whole one needs {need_bytes} \
         (a torn write or a value cut short); it is a miss and will be deleted"
    )]
    Truncated {
        /// The bytes that arrived.
        len_bytes: u64,
        /// The bytes a whole value of this kind would have.
        need_bytes: u64,
    },
    /// Does not start with [`MAGIC`]: not written by kvwarden.
    #[error(
        "L2 value does not start with the kvwarden magic {MAGIC:02x?}: found {found:02x?} \
         (written by something else under the kvwarden namespace?); it is a miss and will be deleted"
    )]
    BadMagic {
        /// The first four bytes seen.
        found: [u8; 4],
    },
    /// Written by another format version of kvwarden.
    #[error(
        "L2 value has format version {found}, this server reads only version \
         {FORMAT_VERSION} (a server of another version shares the namespace: give each \
         version its own --l2-namespace); it is a miss and will be deleted"
    )]
    OtherVersion {
        /// The version in the header.
        found: u32,
    },
    /// Longer than the header plus the declared payload.
    #[error(
        "L2 value declares a {declared_bytes}-byte payload but carries {actual_bytes} \
         bytes after the header (a value overwritten by something else); it is a miss and \
         will be deleted"
    )]
    LengthMismatch {
        /// The payload length in the header.
        declared_bytes: u64,
        /// The bytes after the header.
        actual_bytes: u64,
    },
    /// The payload does not hash to the checksum in the header.
    #[error(
        "L2 value payload checksum is {computed:#018x}, the header says {stored:#018x} \
         (a torn or corrupted value); it is a miss and will be deleted"
    )]
    ChecksumMismatch {
        /// The checksum in the header.
        stored: u64,
        /// The checksum of the payload that arrived.
        computed: u64,
    },
}

/// The header of a value holding `payload`.
#[must_use]
pub fn header(payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[0..4].copy_from_slice(&MAGIC);
    header[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    header[16..24].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    header
}

/// The L2 value holding `payload`: [`header`] then the payload.
#[must_use]
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(HEADER_BYTES + payload.len());
    value.extend_from_slice(&header(payload));
    value.extend_from_slice(payload);
    value
}

/// The payload of `value`, once every check of the header passed.
///
/// Checks in order: long enough for the magic, magic, long enough for the header,
/// version, payload length (short: [`DecodeError::Truncated`], long:
/// [`DecodeError::LengthMismatch`]), checksum. Never panics and never allocates.
pub fn decode(value: &[u8]) -> Result<&[u8], DecodeError> {
    let len_bytes = value.len() as u64;
    let Some(magic) = value.first_chunk::<4>() else {
        return Err(DecodeError::Truncated {
            len_bytes,
            need_bytes: HEADER_BYTES as u64,
        });
    };
    if *magic != MAGIC {
        return Err(DecodeError::BadMagic { found: *magic });
    }
    let Some((header, payload)) = value.split_first_chunk::<HEADER_BYTES>() else {
        return Err(DecodeError::Truncated {
            len_bytes,
            need_bytes: HEADER_BYTES as u64,
        });
    };
    let version = u32::from_le_bytes(le_field(header, 4));
    if version != FORMAT_VERSION {
        return Err(DecodeError::OtherVersion { found: version });
    }
    let declared_bytes = u64::from_le_bytes(le_field(header, 8));
    let actual_bytes = payload.len() as u64;
    if actual_bytes < declared_bytes {
        return Err(DecodeError::Truncated {
            len_bytes,
            need_bytes: declared_bytes.saturating_add(HEADER_BYTES as u64),
        });
    }
    if actual_bytes > declared_bytes {
        return Err(DecodeError::LengthMismatch {
            declared_bytes,
            actual_bytes,
        });
    }
    let stored = u64::from_le_bytes(le_field(header, 16));
    let computed = xxh3_64(payload);
    if stored != computed {
        return Err(DecodeError::ChecksumMismatch { stored, computed });
    }
    Ok(payload)
}

/// The `N` bytes of `header` at `at`; the callers' offsets are constants inside the
/// header, so the fallback (zeros) is never taken.
fn le_field<const N: usize>(header: &[u8; HEADER_BYTES], at: usize) -> [u8; N] {
    header
        .get(at..at + N)
        .and_then(|bytes| <[u8; N]>::try_from(bytes).ok())
        .unwrap_or([0; N])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put_u32(value: &mut [u8], at: usize, field: u32) {
        value[at..at + 4].copy_from_slice(&field.to_le_bytes());
    }

    fn put_u64(value: &mut [u8], at: usize, field: u64) {
        value[at..at + 8].copy_from_slice(&field.to_le_bytes());
    }

    #[test]
    fn encoded_value_decodes_to_the_same_payload() {
        for payload in [&b""[..], b"x", &[7u8; 4096]] {
            let value = encode(payload);
            assert_eq!(value.len(), HEADER_BYTES + payload.len());
            assert_eq!(decode(&value), Ok(payload));
        }
    }

    #[test]
    fn value_shorter_than_the_magic_is_truncated() {
        assert_eq!(
            decode(b"KV"),
            Err(DecodeError::Truncated {
                len_bytes: 2,
                need_bytes: HEADER_BYTES as u64
            })
        );
        assert!(matches!(decode(b""), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn value_with_magic_but_shorter_than_the_header_is_truncated() {
        let value = encode(b"payload");
        assert_eq!(
            decode(&value[..10]),
            Err(DecodeError::Truncated {
                len_bytes: 10,
                need_bytes: HEADER_BYTES as u64
            })
        );
        // The full header alone (payload cut off) is truncated too, naming the need.
        assert_eq!(
            decode(&value[..HEADER_BYTES + 3]),
            Err(DecodeError::Truncated {
                len_bytes: HEADER_BYTES as u64 + 3,
                need_bytes: HEADER_BYTES as u64 + 7
            })
        );
    }

    #[test]
    fn value_with_another_magic_is_rejected_and_the_right_one_accepted() {
        let mut value = encode(b"payload");
        assert!(decode(&value).is_ok());
        value[0] = b'X';
        assert_eq!(
            decode(&value),
            Err(DecodeError::BadMagic { found: *b"XVL2" })
        );
        // Plain text someone SET by hand.
        assert!(matches!(
            decode(b"hello world, this is not a kvwarden value"),
            Err(DecodeError::BadMagic { .. })
        ));
    }

    #[test]
    fn value_of_another_format_version_is_rejected_and_this_one_accepted() {
        let mut value = encode(b"payload");
        put_u32(&mut value, 4, FORMAT_VERSION);
        assert!(decode(&value).is_ok());
        put_u32(&mut value, 4, FORMAT_VERSION + 1);
        assert_eq!(
            decode(&value),
            Err(DecodeError::OtherVersion {
                found: FORMAT_VERSION + 1
            })
        );
    }

    #[test]
    fn value_longer_than_declared_is_a_length_mismatch() {
        let mut value = encode(b"payload");
        value.push(0);
        assert_eq!(
            decode(&value),
            Err(DecodeError::LengthMismatch {
                declared_bytes: 7,
                actual_bytes: 8
            })
        );
        value.pop();
        assert!(decode(&value).is_ok());
    }

    #[test]
    fn declared_length_beyond_the_value_is_truncated_without_overflow() {
        let mut value = encode(b"payload");
        put_u64(&mut value, 8, u64::MAX);
        assert_eq!(
            decode(&value),
            Err(DecodeError::Truncated {
                len_bytes: value.len() as u64,
                need_bytes: u64::MAX
            })
        );
    }

    #[test]
    fn flipped_payload_byte_is_a_checksum_mismatch() {
        let mut value = encode(b"payload");
        assert!(decode(&value).is_ok());
        value[HEADER_BYTES] ^= 1;
        assert!(matches!(
            decode(&value),
            Err(DecodeError::ChecksumMismatch { stored, computed }) if stored != computed
        ));
    }

    #[test]
    fn flipped_checksum_byte_is_a_checksum_mismatch() {
        let mut value = encode(b"payload");
        value[20] ^= 0x80;
        assert!(matches!(
            decode(&value),
            Err(DecodeError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn errors_name_the_value_seen_and_the_fix() {
        let message = DecodeError::OtherVersion { found: 9 }.to_string();
        assert!(
            message.contains('9') && message.contains("--l2-namespace"),
            "{message}"
        );
        let message = DecodeError::Truncated {
            len_bytes: 3,
            need_bytes: 24,
        }
        .to_string();
        assert!(
            message.contains("3 bytes") && message.contains("24"),
            "{message}"
        );
    }

    proptest! {
        #[test]
        fn no_byte_string_panics_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn no_header_with_a_valid_magic_panics_the_decoder(
            version in any::<u32>(),
            declared in any::<u64>(),
            checksum in any::<u64>(),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut value = Vec::new();
            value.extend_from_slice(&MAGIC);
            value.extend_from_slice(&version.to_le_bytes());
            value.extend_from_slice(&declared.to_le_bytes());
            value.extend_from_slice(&checksum.to_le_bytes());
            value.extend_from_slice(&payload);
            let _ = decode(&value);
        }

        #[test]
        fn every_prefix_and_extension_of_a_value_is_rejected(
            payload in proptest::collection::vec(any::<u8>(), 0..64),
            extra in 1usize..8,
        ) {
            let value = encode(&payload);
            for cut in 0..value.len() {
                prop_assert!(decode(&value[..cut]).is_err());
            }
            let mut longer = value.clone();
            longer.extend(std::iter::repeat_n(0u8, extra));
            prop_assert!(decode(&longer).is_err());
            prop_assert_eq!(decode(&value), Ok(&payload[..]));
        }
    }
}
