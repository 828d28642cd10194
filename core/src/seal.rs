//! The L1 pool's seals (failure modes 71–73): what lets a restarted server adopt the
//! chunks a pool file (`--l1-file`) still holds, and never a torn or foreign one.
//!
//! The pool's bytes stay where the workers' copies put them; beside the pool, an index
//! file holds a header for the pool and one seal per slot:
//!
//! ```text
//! index header (offset 0, 4096 bytes reserved)   a slot's seal (512 bytes, at
//! offset  size  field                            4096 + slot × 512)
//!      0     8  magic b"KVWL1IX1"                offset  size  field
//!      8     8  slot bytes (u64 LE)                   0     4  magic b"KVS1"
//!     16     8  slots (u64 LE)                        4     2  key length (u16 LE)
//!     24    32  the secret's id                       6     2  zero
//!                                                     8     8  value length (u64 LE)
//!                                                    16     …  key (node key: tenant, key)
//!                                                   480    32  keyed BLAKE3 tag
//! ```
//!
//! A seal is written once a value is committed, and its tag covers the pool's geometry,
//! the slot's index, the key (which names the tenant), the length and every byte of the
//! value, under a key derived from the server's secret (`--l1-secret-file`). A value torn
//! by a crash mid-write, overwritten after its seal, sealed under another secret or moved
//! to another slot does not verify: it is dropped and counted, never served. The
//! secret's id (a second derivation, which says nothing of the key) tells "another
//! secret" from "torn" for the operator.

use thiserror::Error;

/// The first eight bytes of an index file.
pub const INDEX_MAGIC: [u8; 8] = *b"KVWL1IX1";

/// Bytes reserved for the index header; the seals follow.
pub const INDEX_HEADER_BYTES: u64 = 4096;

/// Bytes of one slot's seal.
pub const SEAL_BYTES: usize = 512;

/// The first four bytes of a seal.
pub const SEAL_MAGIC: [u8; 4] = *b"KVS1";

const TAG_BYTES: usize = 32;
const KEY_AT: usize = 16;
const TAG_AT: usize = SEAL_BYTES - TAG_BYTES;

/// The longest node key a seal holds (the tenant's name and the worker's key); a value
/// under a longer key stays in the pool but is not sealed, so not adopted.
pub const MAX_SEALED_KEY_BYTES: usize = TAG_AT - KEY_AT;

/// The fewest bytes the secret file may hold.
pub const SECRET_MIN_BYTES: usize = 32;

const MAC_CONTEXT: &str = "kvwarden L1 seal MAC v1";
const ID_CONTEXT: &str = "kvwarden L1 seal key id v1";

/// The pool's shape: a pool of another shape is never adopted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the pool.
    pub num_slots: u64,
}

impl Geometry {
    /// The bytes of the index file for this geometry.
    pub fn index_bytes(&self) -> u64 {
        INDEX_HEADER_BYTES + self.num_slots * SEAL_BYTES as u64
    }

    /// Where `slot`'s seal lies in the index file.
    pub fn seal_offset(&self, slot: u64) -> u64 {
        INDEX_HEADER_BYTES + slot * SEAL_BYTES as u64
    }
}

/// The keys derived from the server's secret.
#[derive(Clone)]
pub struct SealKey {
    mac: [u8; 32],
    id: [u8; 32],
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(<redacted>)")
    }
}

/// A secret file too short to key seals with.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "{path}: {len_bytes} bytes; the L1 secret needs at least {SECRET_MIN_BYTES} (make one with \
     `head -c 32 /dev/urandom > {path} && chmod 600 {path}`, and keep it across restarts)"
)]
pub struct SecretTooShort {
    /// The file, as named.
    pub path: String,
    /// Its size.
    pub len_bytes: usize,
}

impl SealKey {
    /// The keys of the secret file `path` holding `bytes` (every byte counts).
    pub fn from_file_bytes(path: &str, bytes: &[u8]) -> Result<SealKey, SecretTooShort> {
        if bytes.len() < SECRET_MIN_BYTES {
            return Err(SecretTooShort {
                path: path.to_string(),
                len_bytes: bytes.len(),
            });
        }
        Ok(SealKey {
            mac: blake3::derive_key(MAC_CONTEXT, bytes),
            id: blake3::derive_key(ID_CONTEXT, bytes),
        })
    }
}

/// What an index file's header says of the pool beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexHeader {
    /// This geometry, this secret: the seals may be checked.
    Matches,
    /// No index header (a new or zeroed file): nothing to adopt.
    Blank,
    /// Written for another geometry: nothing is adopted.
    OtherGeometry(Geometry),
    /// Written under another secret: nothing is adopted.
    OtherSecret,
}

/// The header of an index file for `geometry` under `key`.
pub fn index_header(geometry: Geometry, key: &SealKey) -> [u8; 56] {
    let mut out = [0u8; 56];
    out[..8].copy_from_slice(&INDEX_MAGIC);
    out[8..16].copy_from_slice(&geometry.slot_bytes.to_le_bytes());
    out[16..24].copy_from_slice(&geometry.num_slots.to_le_bytes());
    out[24..56].copy_from_slice(&key.id);
    out
}

/// Reads an index file's header (`bytes`: its first bytes, at least 56).
pub fn check_index_header(bytes: &[u8], geometry: Geometry, key: &SealKey) -> IndexHeader {
    let Some(head) = bytes.get(..56) else {
        return IndexHeader::Blank;
    };
    if head[..8] != INDEX_MAGIC {
        return IndexHeader::Blank;
    }
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]));
    let found = Geometry {
        slot_bytes: word(8),
        num_slots: word(16),
    };
    if found != geometry {
        return IndexHeader::OtherGeometry(found);
    }
    if head[24..56] != key.id {
        return IndexHeader::OtherSecret;
    }
    IndexHeader::Matches
}

/// Why a slot's seal was not adopted.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Error)]
pub enum Unsealed {
    /// The tag does not verify: torn by a crash mid-write, overwritten after it was
    /// sealed, or not written by this server.
    #[error("its tag does not verify (torn, overwritten, or not sealed by this server)")]
    Torn,
    /// A length or key length no seal has.
    #[error("its seal is malformed")]
    Malformed,
}

fn tag(key: &SealKey, geometry: Geometry, slot: u64, head: &[u8], payload: &[u8]) -> blake3::Hash {
    let mut hasher = blake3::Hasher::new_keyed(&key.mac);
    hasher.update(&geometry.slot_bytes.to_le_bytes());
    hasher.update(&geometry.num_slots.to_le_bytes());
    hasher.update(&slot.to_le_bytes());
    hasher.update(head);
    hasher.update(payload);
    hasher.finalize()
}

/// The seal of `slot` holding `payload` under `node_key`, or None when the key is longer
/// than a seal holds ([`MAX_SEALED_KEY_BYTES`]) or the payload than a slot.
pub fn seal(
    key: &SealKey,
    geometry: Geometry,
    slot: u64,
    node_key: &[u8],
    payload: &[u8],
) -> Option<[u8; SEAL_BYTES]> {
    if node_key.len() > MAX_SEALED_KEY_BYTES || payload.len() as u64 > geometry.slot_bytes {
        return None;
    }
    let mut out = [0u8; SEAL_BYTES];
    out[..4].copy_from_slice(&SEAL_MAGIC);
    out[4..6].copy_from_slice(&(node_key.len() as u16).to_le_bytes());
    out[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[KEY_AT..KEY_AT + node_key.len()].copy_from_slice(node_key);
    let tag = tag(key, geometry, slot, &out[..TAG_AT], payload);
    out[TAG_AT..].copy_from_slice(tag.as_bytes());
    Some(out)
}

/// The value length a seal claims, to know how much of the slot to read: None when the
/// seal is blank (never written), `Some(Err)` when it cannot be one.
pub fn claimed_len(seal: &[u8], geometry: Geometry) -> Option<Result<u64, Unsealed>> {
    let seal = seal.get(..SEAL_BYTES)?;
    if seal[..4] != SEAL_MAGIC {
        return None;
    }
    let key_len = usize::from(u16::from_le_bytes([seal[4], seal[5]]));
    let len = u64::from_le_bytes(seal[8..16].try_into().unwrap_or([0xff; 8]));
    if key_len == 0 || key_len > MAX_SEALED_KEY_BYTES || len > geometry.slot_bytes {
        return Some(Err(Unsealed::Malformed));
    }
    Some(Ok(len))
}

/// Opens `slot`'s seal over `payload` (the slot's first `claimed_len` bytes): the node
/// key and the value's length when the tag verifies.
pub fn open(
    key: &SealKey,
    geometry: Geometry,
    slot: u64,
    seal: &[u8],
    payload: &[u8],
) -> Result<(Vec<u8>, u64), Unsealed> {
    let len = match claimed_len(seal, geometry) {
        Some(Ok(len)) => len,
        Some(Err(unsealed)) => return Err(unsealed),
        None => return Err(Unsealed::Malformed),
    };
    if payload.len() as u64 != len {
        return Err(Unsealed::Malformed);
    }
    let key_len = usize::from(u16::from_le_bytes([seal[4], seal[5]]));
    let found: [u8; TAG_BYTES] = seal[TAG_AT..SEAL_BYTES]
        .try_into()
        .unwrap_or([0; TAG_BYTES]);
    // blake3::Hash compares in constant time.
    if tag(key, geometry, slot, &seal[..TAG_AT], payload) != blake3::Hash::from_bytes(found) {
        return Err(Unsealed::Torn);
    }
    Ok((seal[KEY_AT..KEY_AT + key_len].to_vec(), len))
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Geometry = Geometry {
        slot_bytes: 64,
        num_slots: 4,
    };

    fn key(byte: u8) -> SealKey {
        SealKey::from_file_bytes("s", &[byte; 32]).unwrap()
    }

    #[test]
    fn a_sealed_value_opens_as_itself_and_nothing_else_does() {
        let k = key(1);
        let payload = b"the value".to_vec();
        let sealed = seal(&k, G, 2, b"\x03t-akey", &payload).unwrap();
        assert_eq!(claimed_len(&sealed, G), Some(Ok(9)));
        assert_eq!(
            open(&k, G, 2, &sealed, &payload),
            Ok((b"\x03t-akey".to_vec(), 9))
        );
        // A byte of the value changed (torn, or overwritten after the seal).
        let mut torn = payload.clone();
        torn[3] ^= 1;
        assert_eq!(open(&k, G, 2, &sealed, &torn), Err(Unsealed::Torn));
        // Another secret, another slot, another geometry.
        assert_eq!(open(&key(2), G, 2, &sealed, &payload), Err(Unsealed::Torn));
        assert_eq!(open(&k, G, 1, &sealed, &payload), Err(Unsealed::Torn));
        let wider = Geometry { num_slots: 5, ..G };
        assert_eq!(open(&k, wider, 2, &sealed, &payload), Err(Unsealed::Torn));
        // A seal edited to claim another key.
        let mut edited = sealed;
        edited[KEY_AT] ^= 1;
        assert_eq!(open(&k, G, 2, &edited, &payload), Err(Unsealed::Torn));
    }

    #[test]
    fn blank_and_malformed_seals_are_told_apart() {
        let k = key(1);
        assert_eq!(claimed_len(&[0u8; SEAL_BYTES], G), None);
        let mut long = seal(&k, G, 0, b"k", b"v").unwrap();
        long[8..16].copy_from_slice(&65u64.to_le_bytes());
        assert_eq!(claimed_len(&long, G), Some(Err(Unsealed::Malformed)));
        let mut keyless = seal(&k, G, 0, b"k", b"v").unwrap();
        keyless[4..6].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(claimed_len(&keyless, G), Some(Err(Unsealed::Malformed)));
        assert!(seal(&k, G, 0, &[7; MAX_SEALED_KEY_BYTES + 1], b"v").is_none());
        assert!(seal(&k, G, 0, b"k", &[0; 65]).is_none());
    }

    #[test]
    fn the_index_header_names_geometry_and_secret() {
        let k = key(1);
        let head = index_header(G, &k);
        assert_eq!(check_index_header(&head, G, &k), IndexHeader::Matches);
        assert_eq!(
            check_index_header(&head, G, &key(2)),
            IndexHeader::OtherSecret
        );
        let other = Geometry {
            slot_bytes: 128,
            num_slots: 2,
        };
        assert_eq!(
            check_index_header(&head, other, &k),
            IndexHeader::OtherGeometry(G)
        );
        assert_eq!(check_index_header(&[0u8; 64], G, &k), IndexHeader::Blank);
        assert!(
            SealKey::from_file_bytes("/etc/kvwarden/l1.secret", &[1; 31])
                .unwrap_err()
                .to_string()
                .contains("head -c 32 /dev/urandom > /etc/kvwarden/l1.secret")
        );
    }
}
