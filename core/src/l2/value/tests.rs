//! The value format both ways: what is written reads back, and every damage is named.

use super::*;
use proptest::prelude::*;

fn put_u32(value: &mut [u8], at: usize, field: u32) {
    value[at..at + 4].copy_from_slice(&field.to_le_bytes());
}

fn put_u64(value: &mut [u8], at: usize, field: u64) {
    value[at..at + 8].copy_from_slice(&field.to_le_bytes());
}

proptest! {
    /// A payload checked in parts, split anywhere (as a reader receives it), is
    /// judged as when checked whole, with and without a MAC; one flipped bit fails.
    #[test]
    fn row_54_a_payload_checked_in_parts_is_judged_as_checked_whole(
        payload in proptest::collection::vec(any::<u8>(), 0..5000),
        cuts in proptest::collection::vec(any::<usize>(), 0..4),
        flip in any::<usize>(),
    ) {
        let namespace = Namespace::default();
        let secret = ClusterSecret::from_file_bytes("t", &[9; 32]).ok();
        for format in [ValueFormat::new(None, 1 << 20), ValueFormat::new(secret, 1 << 20)] {
            let mut value = format.encode(&namespace, b"key", &payload);
            for corrupt in [false, true] {
                if corrupt {
                    if payload.is_empty() { continue; }
                    let at = format.header_bytes() + flip % payload.len();
                    value[at] ^= 1;
                }
                let (head, body) = value.split_at(format.header_bytes());
                let mut check = format.payload_check(&namespace, b"key", head).unwrap();
                let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut % (body.len() + 1)).collect();
                cuts.push(0);
                cuts.push(body.len());
                cuts.sort_unstable();
                for pair in cuts.windows(2) {
                    check.update(&body[pair[0]..pair[1]]);
                }
                let whole = format.check_payload(&namespace, b"key", head, body);
                prop_assert_eq!(check.finish(), whole.clone());
                prop_assert_eq!(whole.is_ok(), !corrupt);
            }
        }
    }
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
        Err(ValueError::Truncated {
            len_bytes: 2,
            need_bytes: HEADER_BYTES as u64
        })
    );
    assert!(matches!(decode(b""), Err(ValueError::Truncated { .. })));
}

#[test]
fn value_with_magic_but_shorter_than_the_header_is_truncated() {
    let value = encode(b"payload");
    assert_eq!(
        decode(&value[..10]),
        Err(ValueError::Truncated {
            len_bytes: 10,
            need_bytes: HEADER_BYTES as u64
        })
    );
    // The full header alone (payload cut off) is truncated too, naming the need.
    assert_eq!(
        decode(&value[..HEADER_BYTES + 3]),
        Err(ValueError::Truncated {
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
        Err(ValueError::BadMagic { found: *b"XVL2" })
    );
    // Plain text someone SET by hand.
    assert!(matches!(
        decode(b"hello world, this is not a kvwarden value"),
        Err(ValueError::BadMagic { .. })
    ));
}

#[test]
fn value_of_another_format_version_is_rejected_and_this_one_accepted() {
    let mut value = encode(b"payload");
    put_u32(&mut value, 4, FORMAT_VERSION);
    assert!(decode(&value).is_ok());
    put_u32(&mut value, 4, MAC_FORMAT_VERSION + 1);
    assert_eq!(
        decode(&value),
        Err(ValueError::OtherVersion {
            found: MAC_FORMAT_VERSION + 1
        })
    );
}

#[test]
fn value_longer_than_declared_is_a_length_mismatch() {
    let mut value = encode(b"payload");
    value.push(0);
    assert_eq!(
        decode(&value),
        Err(ValueError::LengthMismatch {
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
        Err(ValueError::Truncated {
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
        Err(ValueError::ChecksumMismatch { stored, computed }) if stored != computed
    ));
}

#[test]
fn flipped_checksum_byte_is_a_checksum_mismatch() {
    let mut value = encode(b"payload");
    value[20] ^= 0x80;
    assert!(matches!(
        decode(&value),
        Err(ValueError::ChecksumMismatch { .. })
    ));
}

#[test]
fn errors_name_the_value_seen_and_the_fix() {
    let message = ValueError::OtherVersion { found: 9 }.to_string();
    assert!(
        message.contains('9') && message.contains("--l2-namespace"),
        "{message}"
    );
    let message = ValueError::Truncated {
        len_bytes: 3,
        need_bytes: 24,
    }
    .to_string();
    assert!(
        message.contains("3 bytes") && message.contains("24"),
        "{message}"
    );
}

fn secret(byte: u8) -> ClusterSecret {
    ClusterSecret::from_file_bytes("secret", &[byte; 32]).unwrap()
}

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

#[test]
fn a_value_with_a_mac_decodes_under_the_same_secret_and_key_only() {
    let format = ValueFormat::new(Some(secret(1)), 4096);
    let value = format.encode(&ns("kv"), b"key", b"payload");
    assert_eq!(value.len(), MAC_HEADER_BYTES + 7);
    assert_eq!(
        format.decode(&ns("kv"), b"key", &value),
        Ok(&b"payload"[..])
    );
    // Another key, another namespace, another secret: the same bytes do not verify.
    assert_eq!(
        format.decode(&ns("kv"), b"kez", &value),
        Err(ValueError::MacMismatch)
    );
    assert_eq!(
        format.decode(&ns("kw"), b"key", &value),
        Err(ValueError::MacMismatch)
    );
    let other = ValueFormat::new(Some(secret(2)), 4096);
    assert_eq!(
        other.decode(&ns("kv"), b"key", &value),
        Err(ValueError::MacMismatch)
    );
    // The length prefixes keep namespace and key apart.
    let value = format.encode(&ns("kv"), b"", b"payload");
    assert_eq!(format.decode(&ns("kv"), b"", &value), Ok(&b"payload"[..]));
}

#[test]
fn a_flipped_bit_anywhere_in_a_mac_value_fails_it() {
    let format = ValueFormat::new(Some(secret(1)), 4096);
    let value = format.encode(&ns("kv"), b"key", b"payload");
    for at in 0..value.len() {
        let mut bad = value.clone();
        bad[at] ^= 1;
        assert!(format.decode(&ns("kv"), b"key", &bad).is_err(), "{at}");
    }
}

#[test]
fn a_server_with_a_secret_refuses_values_without_one_and_vice_versa() {
    let plain = ValueFormat::new(None, 4096);
    let keyed = ValueFormat::new(Some(secret(1)), 4096);
    let plain_value = plain.encode(&ns("kv"), b"k", b"payload");
    let keyed_value = keyed.encode(&ns("kv"), b"k", b"payload");
    assert!(plain.decode(&ns("kv"), b"k", &plain_value).is_ok());
    assert!(keyed.decode(&ns("kv"), b"k", &keyed_value).is_ok());
    let error = keyed.decode(&ns("kv"), b"k", &plain_value).unwrap_err();
    assert_eq!(error, ValueError::Unauthenticated);
    assert!(error.to_string().contains("--l2-secret-file"), "{error}");
    let error = plain.decode(&ns("kv"), b"k", &keyed_value).unwrap_err();
    assert_eq!(error, ValueError::Authenticated);
    assert!(error.to_string().contains("--l2-secret-file"), "{error}");
}

#[test]
fn a_value_longer_than_a_slot_and_its_header_is_oversized_and_one_that_fits_is_not() {
    for format in [
        ValueFormat::new(None, 8),
        ValueFormat::new(Some(secret(1)), 8),
    ] {
        let fits = format.encode(&ns("kv"), b"k", &[7; 8]);
        assert!(fits.len() as u64 <= format.read_limit_bytes());
        assert!(format.decode(&ns("kv"), b"k", &fits).is_ok());
        let mut longer = fits.clone();
        longer.push(0);
        let error = format.decode(&ns("kv"), b"k", &longer).unwrap_err();
        assert!(matches!(error, ValueError::Oversized { .. }), "{error}");
        assert!(error.to_string().contains("--slot-bytes"), "{error}");
    }
}

#[test]
fn a_secret_file_shorter_than_32_bytes_is_refused_naming_it_and_its_size() {
    assert!(ClusterSecret::from_file_bytes("f", &[0; SECRET_MIN_BYTES]).is_ok());
    let error = ClusterSecret::from_file_bytes("/etc/kv.secret", &[0; 31]).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("/etc/kv.secret") && message.contains("31 bytes"),
        "{message}"
    );
    assert_eq!(format!("{:?}", secret(1)), "ClusterSecret(<redacted>)");
}

proptest! {
    #[test]
    fn no_byte_string_panics_the_mac_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let format = ValueFormat::new(Some(secret(3)), 64);
        let _ = format.decode(&Namespace::default(), b"k", &bytes);
    }

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
