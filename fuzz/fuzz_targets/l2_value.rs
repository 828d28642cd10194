//! Arbitrary bytes, and damaged real values, through the L2 value decoder, as an L2
//! thread reads whatever a Redis key holds.
//!
//! Oracles: no panic; a value the decoder accepts is exactly the encoding of the payload
//! it returns (nothing else is ever served); every error's numbers are consistent
//! (a truncated value is shorter than it needs, a length mismatch is longer than
//! declared, a checksum mismatch has two different sums); any one-byte change, cut or
//! extension of a real value is refused.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::l2::{DecodeError, decode, encode};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Raw(Vec<u8>),
    Damaged { payload: Vec<u8>, damage: Damage },
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
        Err(DecodeError::Truncated {
            len_bytes,
            need_bytes,
        }) => {
            assert!(len_bytes < need_bytes);
            assert_eq!(len_bytes, value.len() as u64);
            false
        }
        Err(DecodeError::LengthMismatch {
            declared_bytes,
            actual_bytes,
        }) => {
            assert!(actual_bytes > declared_bytes);
            false
        }
        Err(DecodeError::ChecksumMismatch { stored, computed }) => {
            assert_ne!(stored, computed);
            false
        }
        Err(DecodeError::BadMagic { .. } | DecodeError::OtherVersion { .. }) => false,
    }
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw(bytes) => {
            check(&bytes);
        }
        Input::Damaged { payload, damage } => {
            let mut value = encode(&payload);
            assert!(check(&value), "a fresh encoding is refused");
            match damage {
                Damage::Flip { at, mask } => {
                    if mask == 0 {
                        return;
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
                        return;
                    }
                    value.extend_from_slice(&extra);
                }
            }
            assert!(!check(&value), "a damaged value was accepted");
        }
    }
});
