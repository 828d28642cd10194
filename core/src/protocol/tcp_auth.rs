//! TCP authenticates both ways, and the token never travels: a challenge and response
//! keyed by the token (HMAC-SHA256), with a nonce from each side.
//!
//! 1. The client sends `auth {"id": key id, "nonce": its nonce}`. The key id names the
//!    token without revealing it ([`TcpKey::id`]).
//! 2. The server answers `{"nonce": its nonce, "proof": server proof}` for the token of
//!    that id ([`TcpKey::server_proof`]). The client checks the proof and sends nothing
//!    more to a server that cannot make it.
//! 3. The client says `hello` with `{"proof": client proof}` ([`TcpKey::client_proof`]);
//!    the server checks it against the nonces of this connection.
//!
//! Both proofs cover the key id and both nonces, under different labels, so neither
//! can stand in for the other, and a proof seen on one connection proves nothing on
//! another (the server's nonce is new for each). It authenticates; it does not encrypt:
//! on a path where another can read and inject, the traffic after `hello` is theirs too
//! (`docs/security.md`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce (each side's).
pub const NONCE_BYTES: usize = 32;
/// Bytes of a proof.
pub const PROOF_BYTES: usize = 32;
/// Bytes of a key id.
pub const KEY_ID_BYTES: usize = 16;

/// A nonce.
pub type Nonce = [u8; NONCE_BYTES];
/// A proof.
pub type Proof = [u8; PROOF_BYTES];
/// A key id.
pub type KeyId = [u8; KEY_ID_BYTES];

const KEY_LABEL: &[u8] = b"kvwarden tcp auth key v3";
const ID_LABEL: &[u8] = b"kvwarden tcp key id";
const SERVER_LABEL: &[u8] = b"kvwarden tcp server proof";
const CLIENT_LABEL: &[u8] = b"kvwarden tcp client proof";

/// The key a token gives: what the server keeps of it, and what both sides prove with.
#[derive(Clone)]
pub struct TcpKey {
    key: [u8; 32],
    id: KeyId,
}

impl std::fmt::Debug for TcpKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is as good as the token: never in a log.
        f.debug_struct("TcpKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// HMAC-SHA256 under `key` over the concatenation of `parts`, not yet finalized.
fn hmac(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key");
    for part in parts {
        mac.update(part);
    }
    mac
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    hmac(key, parts).finalize().into_bytes().into()
}

/// Whether `proof` is the MAC of `parts` under `key`, compared in constant time.
fn verify(key: &[u8], parts: &[&[u8]], proof: &[u8]) -> bool {
    hmac(key, parts).verify_slice(proof).is_ok()
}

impl TcpKey {
    /// The key of `token` (the token file's contents, surrounding whitespace stripped).
    pub fn from_token(token: &[u8]) -> TcpKey {
        let key = mac(token, &[KEY_LABEL]);
        let mut id = [0; KEY_ID_BYTES];
        id.copy_from_slice(&mac(&key, &[ID_LABEL])[..KEY_ID_BYTES]);
        TcpKey { key, id }
    }

    /// Names the token without revealing it.
    pub fn id(&self) -> KeyId {
        self.id
    }

    /// What the server answers `auth` with.
    pub fn server_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        mac(&self.key, &[SERVER_LABEL, &self.id, client, server])
    }

    /// What the client says `hello` with.
    pub fn client_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        mac(&self.key, &[CLIENT_LABEL, &self.id, client, server])
    }

    /// Whether `proof` is the server's for these nonces (in constant time).
    pub fn check_server(&self, client: &Nonce, server: &Nonce, proof: &[u8]) -> bool {
        verify(&self.key, &[SERVER_LABEL, &self.id, client, server], proof)
    }

    /// Whether `proof` is the client's for these nonces (in constant time).
    pub fn check_client(&self, client: &Nonce, server: &Nonce, proof: &[u8]) -> bool {
        verify(&self.key, &[CLIENT_LABEL, &self.id, client, server], proof)
    }
}

/// The server's nonce for its `count`-th challenge: a MAC of the count under a secret
/// the shell draws at each start, so that nonces never repeat within a run and cannot be
/// foreseen by a peer (the core holds no entropy source of its own).
pub fn server_nonce(secret: &[u8; 32], count: u64) -> Nonce {
    mac(
        secret,
        &[b"kvwarden tcp server nonce", &count.to_le_bytes()],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The same vector is in the Python client's tests (`python/tests/`): both sides
    /// compute the same key id and proofs.
    #[test]
    fn the_shared_test_vector() {
        let key = TcpKey::from_token(b"0123456789abcdef-token");
        let client: Nonce = std::array::from_fn(|i| i as u8);
        let server: Nonce = std::array::from_fn(|i| 32 + i as u8);
        assert_eq!(
            hex(&key.key),
            "dac3034d75cf72240db32dd12705c5bdf4a812f859694d4177771ba4cc819f0d"
        );
        assert_eq!(hex(&key.id()), "0ab3ce57b13c3c1828e03b38245e6e01");
        let server_proof = key.server_proof(&client, &server);
        let client_proof = key.client_proof(&client, &server);
        assert_eq!(
            hex(&server_proof),
            "37f1bf291e8dee8e7ce01336bf75bc67ba930bc74f8be6eadc6cd5a5de3a8f97"
        );
        assert_eq!(
            hex(&client_proof),
            "10ef67157ba29d8daebb01a3f1bbe027bf6d7baefa701b41528db116a84d5fa0"
        );
        assert!(key.check_server(&client, &server, &server_proof));
        assert!(key.check_client(&client, &server, &client_proof));
        // One proof never stands for the other, nor for other nonces or another token.
        assert!(!key.check_client(&client, &server, &server_proof));
        assert!(!key.check_server(&client, &server, &client_proof));
        assert!(!key.check_client(&server, &client, &client_proof));
        let other = TcpKey::from_token(b"0123456789abcdef-other");
        assert!(!other.check_client(&client, &server, &client_proof));
        assert_ne!(other.id(), key.id());
        assert!(!key.check_client(&client, &server, &client_proof[..31]));
    }

    #[test]
    fn server_nonces_differ_by_count_and_secret() {
        let a = server_nonce(&[1; 32], 0);
        assert_ne!(a, server_nonce(&[1; 32], 1));
        assert_ne!(a, server_nonce(&[2; 32], 0));
        assert_eq!(a, server_nonce(&[1; 32], 0));
    }
}
