//! The L2 value format: a fixed header that lets a reader prove a value is whole, of this
//! format and written by kvwarden (with a cluster secret: by a server holding it, for this
//! very key) before a single byte of it is served.
//!
//! Two versions, one per kind of server; a server reads only its own:
//!
//! ```text
//! version 1 (no --l2-secret-file)          version 2 (--l2-secret-file)
//! offset  size  field                      offset  size  field
//!      0     4  magic b"KVL2"                   0     4  magic b"KVL2"
//!      4     4  version 1 (u32 LE)              4     4  version 2 (u32 LE)
//!      8     8  payload length (u64 LE)         8     8  payload length (u64 LE)
//!     16     8  xxh3-64 of the payload         16    32  keyed BLAKE3 tag
//!     24     …  payload                        48     …  payload
//! ```
//!
//! The checksum of version 1 catches torn and truncated writes and values written by
//! something else by mistake; it is not a signature: whoever can write to the cluster is
//! trusted. The tag of version 2 is `blake3::keyed_hash` with the key
//! `blake3::derive_key(MAC_CONTEXT, secret file)` over the header's first 16 bytes, the
//! namespace and the chunk key (the tenant-scoped key), each with its length as a u64 LE
//! in front, and the payload: a value written by anyone without the secret, or copied
//! from one key to another, does not verify.
//!
//! Every read is bounded ([`ValueFormat::read_limit_bytes`]): a value longer than a slot
//! plus the header is a miss before it is looked at.

use super::key::Namespace;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// The first four bytes of every L2 value.
pub const MAGIC: [u8; 4] = *b"KVL2";

/// The format version of a value with a checksum: what a server without a cluster secret
/// writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;

/// The format version of a value with a MAC: what a server with `--l2-secret-file`
/// writes and the only one it reads.
pub const MAC_FORMAT_VERSION: u32 = 2;

/// The size of the header of a version-1 value; the write-behind queue counts every
/// value's header at this size.
pub const HEADER_BYTES: usize = 24;

/// The size of a MAC tag.
pub const MAC_TAG_BYTES: usize = 32;

/// The size of the header of a version-2 value (with a MAC).
pub const MAC_HEADER_BYTES: usize = 16 + MAC_TAG_BYTES;

/// The fewest bytes a cluster secret file may hold.
pub const SECRET_MIN_BYTES: usize = 32;

/// The context string of the MAC key's derivation (`blake3::derive_key`).
pub const MAC_CONTEXT: &str = "kvwarden L2 value MAC v1";

/// Why a value read from L2 cannot be served. Every variant means: a miss, counted,
/// logged once per key, and the key deleted.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ValueError {
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
         {FORMAT_VERSION} (or {MAC_FORMAT_VERSION} with --l2-secret-file) (a server of another version shares the namespace: give each \
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
    /// A value with a MAC read by a server without a cluster secret.
    #[error(
        "L2 value has format version {MAC_FORMAT_VERSION} (authenticated: written by a \
         server with --l2-secret-file), this server has no secret and reads only version \
         {FORMAT_VERSION}; give it the cluster's --l2-secret-file (or give servers without \
         a secret their own --l2-namespace); it is a miss and will be deleted"
    )]
    Authenticated,
    /// A value without a MAC read by a server with a cluster secret.
    #[error(
        "L2 value has format version {FORMAT_VERSION} (no MAC: written by a server without \
         --l2-secret-file, or by anyone who can reach Redis), this server has \
         --l2-secret-file and serves only authenticated values (version \
         {MAC_FORMAT_VERSION}); give every server of the namespace the same \
         --l2-secret-file; it is a miss and will be deleted"
    )]
    Unauthenticated,
    /// The tag does not verify: written without this cluster's secret, or moved here
    /// from another key.
    #[error(
        "L2 value's MAC does not verify for this key (written by someone without this \
         cluster's secret, with another --l2-secret-file, or copied from another key); \
         every server of the namespace needs the same --l2-secret-file; it is a miss and \
         will be deleted"
    )]
    MacMismatch,
    /// Longer than a slot plus the header: the read stopped at the bound.
    #[error(
        "L2 value is longer than {limit_bytes} bytes, the most a value of one \
         {max_payload_bytes}-byte slot and its header may hold (read stopped there; written \
         by a server with larger --slot-bytes, or planted); it is a miss and will be deleted"
    )]
    Oversized {
        /// The longest value accepted (header included).
        limit_bytes: u64,
        /// The largest payload accepted (the slot size).
        max_payload_bytes: u64,
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

/// The payload of a version-1 `value`, once every check of the header passed, with no
/// bound on its length: [`ValueFormat::decode`] without a secret and without a bound.
///
/// Checks in order: long enough for the magic, magic, long enough for the header,
/// version, payload length (short: [`ValueError::Truncated`], long:
/// [`ValueError::LengthMismatch`]), checksum. Never panics and never allocates.
pub fn decode(value: &[u8]) -> Result<&[u8], ValueError> {
    ValueFormat::new(None, u64::MAX).decode(&Namespace::default(), b"", value)
}

/// A cluster secret's MAC key, derived from the secret file's bytes; never printed.
#[derive(Clone)]
pub struct ClusterSecret {
    key: [u8; 32],
}

/// A secret file that was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SecretError {
    /// Fewer bytes than [`SECRET_MIN_BYTES`].
    #[error(
        "--l2-secret-file {path}: it holds {len_bytes} bytes, a cluster secret needs at \
         least {SECRET_MIN_BYTES} (make one with `head -c 32 /dev/urandom > {path}; chmod \
         600 {path}` and give every server of the namespace the same file)"
    )]
    TooShort {
        /// The file, as named.
        path: String,
        /// Its size.
        len_bytes: usize,
    },
}

impl ClusterSecret {
    /// The secret of the file `path` holding `bytes` (every byte counts; at least
    /// [`SECRET_MIN_BYTES`]).
    pub fn from_file_bytes(path: &str, bytes: &[u8]) -> Result<ClusterSecret, SecretError> {
        if bytes.len() < SECRET_MIN_BYTES {
            return Err(SecretError::TooShort {
                path: path.to_string(),
                len_bytes: bytes.len(),
            });
        }
        Ok(ClusterSecret {
            key: blake3::derive_key(MAC_CONTEXT, bytes),
        })
    }
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// The header of one value, as written in front of its payload.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    bytes: [u8; MAC_HEADER_BYTES],
    len: usize,
}

impl AsRef<[u8]> for Header {
    fn as_ref(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }
}

/// How this server writes and reads L2 values: with a MAC (a cluster secret) or a
/// checksum, and the largest payload it accepts (its slot size).
#[derive(Clone, Debug)]
pub struct ValueFormat {
    secret: Option<ClusterSecret>,
    max_payload_bytes: u64,
}

impl ValueFormat {
    /// Values with a MAC under `secret` (version 2), or with a checksum without one
    /// (version 1), of at most `max_payload_bytes` of payload.
    #[must_use]
    pub fn new(secret: Option<ClusterSecret>, max_payload_bytes: u64) -> ValueFormat {
        ValueFormat {
            secret,
            max_payload_bytes,
        }
    }

    /// Whether values carry a MAC.
    #[must_use]
    pub fn authenticated(&self) -> bool {
        self.secret.is_some()
    }

    /// The size of the header this server writes and reads.
    #[must_use]
    pub fn header_bytes(&self) -> usize {
        if self.secret.is_some() {
            MAC_HEADER_BYTES
        } else {
            HEADER_BYTES
        }
    }

    /// The most a read fetches, less one: the largest payload plus the larger header
    /// (so that a value of the other kind of server is seen whole, and refused for what
    /// it is). A read asks for one byte more than this (`GETRANGE key 0 LIMIT`), so that
    /// a longer value is seen to be longer without ever being fetched whole.
    #[must_use]
    pub fn read_limit_bytes(&self) -> u64 {
        self.max_payload_bytes
            .saturating_add(MAC_HEADER_BYTES as u64)
    }

    /// The header of `payload` stored under chunk key `key` of `namespace`.
    #[must_use]
    pub fn header(&self, namespace: &Namespace, key: &[u8], payload: &[u8]) -> Header {
        let mut bytes = [0u8; MAC_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&MAGIC);
        bytes[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        match &self.secret {
            None => {
                bytes[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
                bytes[16..24].copy_from_slice(&xxh3_64(payload).to_le_bytes());
                Header {
                    bytes,
                    len: HEADER_BYTES,
                }
            }
            Some(secret) => {
                bytes[4..8].copy_from_slice(&MAC_FORMAT_VERSION.to_le_bytes());
                let fixed: [u8; 16] = le_field(&bytes, 0);
                let tag = mac(secret, &fixed, namespace, key, payload);
                bytes[16..MAC_HEADER_BYTES].copy_from_slice(tag.as_bytes());
                Header {
                    bytes,
                    len: MAC_HEADER_BYTES,
                }
            }
        }
    }

    /// The value holding `payload` under `key` of `namespace`: [`ValueFormat::header`]
    /// then the payload.
    #[must_use]
    pub fn encode(&self, namespace: &Namespace, key: &[u8], payload: &[u8]) -> Vec<u8> {
        let header = self.header(namespace, key, payload);
        let mut value = Vec::with_capacity(header.len + payload.len());
        value.extend_from_slice(header.as_ref());
        value.extend_from_slice(payload);
        value
    }

    /// The payload of `value` read under chunk key `key` of `namespace` (at most
    /// [`ValueFormat::read_limit_bytes`] + 1 bytes of it), once every check passed:
    /// [`ValueFormat::check_head`] then [`ValueFormat::check_payload`]. Never panics and
    /// never allocates.
    pub fn decode<'v>(
        &self,
        namespace: &Namespace,
        key: &[u8],
        value: &'v [u8],
    ) -> Result<&'v [u8], ValueError> {
        let (head, payload) = value.split_at(value.len().min(self.header_bytes()));
        self.check_head(head, value.len() as u64)?;
        self.check_payload(namespace, key, head, payload)?;
        Ok(payload)
    }

    /// The checks that need only a value's first [`ValueFormat::header_bytes`] bytes
    /// (`head`, fewer when the value is shorter) and its length `len_bytes`: what a
    /// reader asks before it receives the payload, so that it knows where the payload
    /// may go. Returns the payload's length, at most the largest payload.
    ///
    /// Checks in order: the read bound ([`ValueError::Oversized`]), long enough for
    /// the magic, magic, version (another kind of server: [`ValueError::Authenticated`]
    /// or [`ValueError::Unauthenticated`]), long enough for the header, a payload of at
    /// most a slot ([`ValueError::Oversized`]), then the payload length.
    pub fn check_head(&self, head: &[u8], len_bytes: u64) -> Result<u64, ValueError> {
        let limit_bytes = self.read_limit_bytes();
        if len_bytes > limit_bytes {
            return Err(ValueError::Oversized {
                limit_bytes,
                max_payload_bytes: self.max_payload_bytes,
            });
        }
        let header_bytes = self.header_bytes();
        let truncated = ValueError::Truncated {
            len_bytes,
            need_bytes: header_bytes as u64,
        };
        let Some(magic) = head.first_chunk::<4>() else {
            return Err(truncated);
        };
        if *magic != MAGIC {
            return Err(ValueError::BadMagic { found: *magic });
        }
        let Some(fixed) = head.first_chunk::<16>() else {
            return Err(truncated);
        };
        let version = u32::from_le_bytes(le_field(fixed, 4));
        match (version, &self.secret) {
            (FORMAT_VERSION, None) | (MAC_FORMAT_VERSION, Some(_)) => {}
            (MAC_FORMAT_VERSION, None) => return Err(ValueError::Authenticated),
            (FORMAT_VERSION, Some(_)) => return Err(ValueError::Unauthenticated),
            (found, _) => return Err(ValueError::OtherVersion { found }),
        }
        if head.len() < header_bytes || len_bytes < header_bytes as u64 {
            return Err(truncated);
        }
        let declared_bytes = u64::from_le_bytes(le_field(fixed, 8));
        let actual_bytes = len_bytes - header_bytes as u64;
        if actual_bytes > self.max_payload_bytes {
            return Err(ValueError::Oversized {
                limit_bytes: self.max_payload_bytes.saturating_add(header_bytes as u64),
                max_payload_bytes: self.max_payload_bytes,
            });
        }
        if actual_bytes < declared_bytes {
            return Err(ValueError::Truncated {
                len_bytes,
                need_bytes: declared_bytes.saturating_add(header_bytes as u64),
            });
        }
        if actual_bytes > declared_bytes {
            return Err(ValueError::LengthMismatch {
                declared_bytes,
                actual_bytes,
            });
        }
        Ok(actual_bytes)
    }

    /// The check of the payload against the header `head` that
    /// [`ValueFormat::check_head`] accepted: the checksum, or the MAC over the key
    /// (compared in constant time).
    pub fn check_payload(
        &self,
        namespace: &Namespace,
        key: &[u8],
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), ValueError> {
        let mut check = self.payload_check(namespace, key, head)?;
        check.update(payload);
        check.finish()
    }

    /// [`ValueFormat::check_payload`] a part at a time, for a reader that checks each
    /// part of the payload as it arrives (while it is still in the cache).
    pub fn payload_check(
        &self,
        namespace: &Namespace,
        key: &[u8],
        head: &[u8],
    ) -> Result<PayloadCheck, ValueError> {
        let header_bytes = self.header_bytes();
        let (Some(fixed), Some(header)) = (head.first_chunk::<16>(), head.get(..header_bytes))
        else {
            return Err(ValueError::Truncated {
                len_bytes: head.len() as u64,
                need_bytes: header_bytes as u64,
            });
        };
        Ok(match &self.secret {
            None => PayloadCheck::Checksum {
                hasher: Box::default(),
                stored: u64::from_le_bytes(le_field(header, 16)),
            },
            Some(secret) => PayloadCheck::Mac {
                hasher: Box::new(mac_hasher(secret, fixed, namespace, key)),
                stored: le_field(header, 16),
            },
        })
    }
}

/// A payload's check under way ([`ValueFormat::payload_check`]): fed the payload in
/// order, then finished.
pub enum PayloadCheck {
    /// The xxh3 checksum of a value without a MAC.
    Checksum {
        /// The payload so far.
        hasher: Box<xxhash_rust::xxh3::Xxh3Default>,
        /// The checksum in the header.
        stored: u64,
    },
    /// The MAC of a value of a cluster with a secret.
    Mac {
        /// The MAC's input so far.
        hasher: Box<blake3::Hasher>,
        /// The tag in the header.
        stored: [u8; MAC_TAG_BYTES],
    },
}

impl PayloadCheck {
    /// The next bytes of the payload.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            PayloadCheck::Checksum { hasher, .. } => hasher.update(bytes),
            PayloadCheck::Mac { hasher, .. } => {
                hasher.update(bytes);
            }
        }
    }

    /// Whether the whole payload, fed in order, matches the header.
    pub fn finish(self) -> Result<(), ValueError> {
        match self {
            PayloadCheck::Checksum { hasher, stored } => {
                let computed = hasher.digest();
                if stored != computed {
                    return Err(ValueError::ChecksumMismatch { stored, computed });
                }
            }
            PayloadCheck::Mac { hasher, stored } => {
                // `blake3::Hash` compares in constant time.
                if blake3::Hash::from_bytes(stored) != hasher.finalize() {
                    return Err(ValueError::MacMismatch);
                }
            }
        }
        Ok(())
    }
}

/// The tag of a version-2 value: keyed BLAKE3 over the header's first 16 bytes, the
/// length-prefixed namespace and chunk key, and the payload.
fn mac(
    secret: &ClusterSecret,
    fixed: &[u8; 16],
    namespace: &Namespace,
    key: &[u8],
    payload: &[u8],
) -> blake3::Hash {
    let mut hasher = mac_hasher(secret, fixed, namespace, key);
    hasher.update(payload);
    hasher.finalize()
}

/// The MAC's input up to the payload: the header's fixed part, then the namespace and
/// the key, each after its length.
fn mac_hasher(
    secret: &ClusterSecret,
    fixed: &[u8; 16],
    namespace: &Namespace,
    key: &[u8],
) -> blake3::Hasher {
    let mut hasher = blake3::Hasher::new_keyed(&secret.key);
    hasher.update(fixed);
    for part in [namespace.as_str().as_bytes(), key] {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hasher
}

/// The `N` bytes of `header` at `at`; the callers' offsets are constants inside a header
/// they checked the length of, so the fallback (zeros) is never taken.
fn le_field<const N: usize>(header: &[u8], at: usize) -> [u8; N] {
    header
        .get(at..at + N)
        .and_then(|bytes| <[u8; N]>::try_from(bytes).ok())
        .unwrap_or([0; N])
}

#[cfg(test)]
mod tests;
