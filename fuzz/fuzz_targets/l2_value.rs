//! Arbitrary bytes, and damaged real values, through the L2 value decoder, as an L2
//! thread reads whatever a Redis key holds.
//!
//! Oracles: no panic; a value the decoder accepts is exactly the encoding of the payload
//! it returns (nothing else is ever served); every error's numbers are consistent
//! (a truncated value is shorter than it needs, a length mismatch is longer than
//! declared, a checksum mismatch has two different sums); any one-byte change, cut or
//! extension of a real value is refused. The same for values with a MAC
//! (`--l2-secret-file`): a damaged one, or one read under another key, is refused.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::l2::{ClusterSecret, Namespace, ValueError, ValueFormat, decode, encode};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Raw(Vec<u8>),
    Damaged {
        payload: Vec<u8>,
        damage: Damage,
    },
    Mac {
        payload: Vec<u8>,
        key: Vec<u8>,
        other_key: Vec<u8>,
        damage: Damage,
    },
}

#[derive(Arbitrary, Debug)]
enum Damage {
    Flip { at: u16, mask: u8 },
    Cut { keep: u16 },
    Extend { extra: Vec<u8> },
}

fn check(value: &[u8]) -> bool {
    match decode(value) {
        Ok(payload) => {
            assert_eq!(encode(payload), value, "an accepted value is not canonical");
            true
        }
        Err(ValueError::Truncated {
            len_bytes,
            need_bytes,
        }) => {
            assert!(len_bytes < need_bytes);
            assert_eq!(len_bytes, value.len() as u64);
            false
        }
        Err(ValueError::LengthMismatch {
            declared_bytes,
            actual_bytes,
        }) => {
            assert!(actual_bytes > declared_bytes);
            false
        }
        Err(ValueError::ChecksumMismatch { stored, computed }) => {
            assert_ne!(stored, computed);
            false
        }
        Err(
            ValueError::BadMagic { .. }
            | ValueError::OtherVersion { .. }
            | ValueError::Authenticated
            | ValueError::Unauthenticated
            | ValueError::MacMismatch
            | ValueError::Oversized { .. },
        ) => false,
    }
}

/// `damage` done to `value`; false when it leaves the value as it was.
fn damage(value: &mut Vec<u8>, damage: Damage) -> bool {
    match damage {
        Damage::Flip { at, mask } => {
            if mask == 0 {
                return false;
            }
            let at = usize::from(at) % value.len();
            value[at] ^= mask;
        }
        Damage::Cut { keep } => {
            let keep = usize::from(keep) % value.len();
            value.truncate(keep);
        }
        Damage::Extend { extra } => {
            if extra.is_empty() {
                return false;
            }
            value.extend_from_slice(&extra);
        }
    }
    true
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw(bytes) => {
            check(&bytes);
        }
        Input::Damaged {
            payload,
            damage: how,
        } => {
            let mut value = encode(&payload);
            assert!(check(&value), "a fresh encoding is refused");
            if damage(&mut value, how) {
                assert!(!check(&value), "a damaged value was accepted");
            }
        }
        Input::Mac {
            payload,
            key,
            other_key,
            damage: how,
        } => {
            let secret = ClusterSecret::from_file_bytes("fuzz", &[0x42; 32]).expect("a secret");
            let format = ValueFormat::new(Some(secret), u64::MAX);
            let namespace = Namespace::default();
            let mut value = format.encode(&namespace, &key, &payload);
            assert_eq!(
                format.decode(&namespace, &key, &value),
                Ok(&payload[..]),
                "a fresh MAC value is refused"
            );
            if other_key != key {
                assert!(
                    format.decode(&namespace, &other_key, &value).is_err(),
                    "a MAC value was accepted under another key"
                );
            }
            assert!(
                decode(&value).is_err(),
                "a MAC value passed the checksum decoder"
            );
            if damage(&mut value, how) {
                assert!(
                    format.decode(&namespace, &key, &value).is_err(),
                    "a damaged MAC value was accepted"
                );
            }
        }
    }
});
