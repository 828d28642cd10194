//! How a chunk's key is named in L2: `<namespace>:<hex of the key bytes>`.
//!
//! No Redis Cluster hash tag is used, on purpose. A hash tag (`{…}`) pins every key that
//! shares it to one slot, hence one master: that is only worth it for multi-key
//! commands on one node, and L2 has none (each chunk is one GET or SET; existence checks
//! are pipelined per key, which redis-rs splits by node). Without a tag, chunks spread
//! over every master by CRC16 of the whole name, which is what spreads both memory and
//! load. The key bytes are written in lowercase hex so that no key, whatever its bytes,
//! can contain a `{…}` and form a tag by accident (an adversarial or unlucky key set
//! would otherwise land on a single master), and so that an operator can list the keys
//! with `redis-cli --scan --pattern 'kvwarden:*'`. The namespace is checked to hold no
//! braces, spaces or glob characters for the same reasons.

use thiserror::Error;

/// The namespace used when the operator names none.
pub const DEFAULT_NAMESPACE: &str = "kvwarden";

/// The longest namespace accepted.
pub const NAMESPACE_MAX_BYTES: usize = 64;

/// A checked key prefix: 1 to [`NAMESPACE_MAX_BYTES`] bytes of ASCII letters, digits,
/// `.`, `_`, `-` and `:`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Namespace(String);

/// A namespace that was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum NamespaceError {
    /// Empty or too long.
    #[error(
        "invalid --l2-namespace {namespace:?}: it has {len_bytes} bytes, use 1 to \
         {NAMESPACE_MAX_BYTES} (default {DEFAULT_NAMESPACE:?})"
    )]
    Length {
        /// The namespace given.
        namespace: String,
        /// Its length.
        len_bytes: usize,
    },
    /// Holds a character that could form a hash tag, break a scan pattern or confuse a
    /// reader of `redis-cli` output.
    #[error(
        "invalid --l2-namespace {namespace:?}: character {found:?} is not allowed; use \
         ASCII letters, digits, '.', '_', '-' and ':' (for example \"kvwarden\" or \
         \"kvwarden:prod\")"
    )]
    Character {
        /// The namespace given.
        namespace: String,
        /// The first character refused.
        found: char,
    },
}

impl Namespace {
    /// Checks `namespace`.
    pub fn new(namespace: &str) -> Result<Namespace, NamespaceError> {
        if namespace.is_empty() || namespace.len() > NAMESPACE_MAX_BYTES {
            return Err(NamespaceError::Length {
                namespace: namespace.to_string(),
                len_bytes: namespace.len(),
            });
        }
        if let Some(found) = namespace
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')))
        {
            return Err(NamespaceError::Character {
                namespace: namespace.to_string(),
                found,
            });
        }
        Ok(Namespace(namespace.to_string()))
    }

    /// The namespace as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The Redis key of the chunk `key`: `<namespace>:<lowercase hex of key>`.
    #[must_use]
    pub fn redis_key(&self, key: &[u8]) -> Vec<u8> {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut name = Vec::with_capacity(self.0.len() + 1 + 2 * key.len());
        name.extend_from_slice(self.0.as_bytes());
        name.push(b':');
        for byte in key {
            name.push(HEX[usize::from(byte >> 4)]);
            name.push(HEX[usize::from(byte & 0x0f)]);
        }
        name
    }
}

impl Default for Namespace {
    fn default() -> Namespace {
        Namespace(DEFAULT_NAMESPACE.to_string())
    }
}

impl std::fmt::Display for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn redis_key_is_namespace_colon_hex() {
        let namespace = Namespace::new("kvwarden").unwrap();
        assert_eq!(namespace.redis_key(&[0x00, 0xab, 0x7f]), b"kvwarden:00ab7f");
        assert_eq!(namespace.redis_key(b""), b"kvwarden:");
        assert_eq!(Namespace::default(), namespace);
    }

    #[test]
    fn key_bytes_with_braces_never_form_a_hash_tag() {
        let name = Namespace::default().redis_key(b"{tag}");
        assert!(!name.contains(&b'{') && !name.contains(&b'}'));
    }

    #[test]
    fn namespace_with_brace_space_or_glob_is_refused_and_plain_ones_accepted() {
        for bad in ["kv{w}", "kv warden", "kv*", "kv?", "é"] {
            assert!(
                matches!(Namespace::new(bad), Err(NamespaceError::Character { .. })),
                "{bad}"
            );
        }
        for good in ["kvwarden", "kvwarden:prod", "a", "team-1.cache_v2"] {
            assert_eq!(Namespace::new(good).unwrap().as_str(), good);
        }
    }

    #[test]
    fn namespace_empty_or_too_long_is_refused_naming_the_bounds() {
        let error = Namespace::new("").unwrap_err();
        assert!(error.to_string().contains("1 to 64"), "{error}");
        assert!(Namespace::new(&"a".repeat(NAMESPACE_MAX_BYTES)).is_ok());
        assert!(matches!(
            Namespace::new(&"a".repeat(NAMESPACE_MAX_BYTES + 1)),
            Err(NamespaceError::Length { len_bytes: 65, .. })
        ));
    }

    proptest! {
        #[test]
        fn distinct_keys_get_distinct_names(a in proptest::collection::vec(any::<u8>(), 0..32),
                                            b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let namespace = Namespace::default();
            prop_assert_eq!(a == b, namespace.redis_key(&a) == namespace.redis_key(&b));
        }
    }
}
