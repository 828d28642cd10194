//! The operator's tenants (`--tenant`), subordinate uid ranges and the limits of who is
//! who, as the shell hands them to the node, and why they may be refused.

use super::{MAX_TENANT_NAME_BYTES, MIN_SECRET_BYTES};

/// A range of subordinate uids (`/etc/subuid`: `owner:start:count`): a peer of a uid in
/// it counts as `owner` for its tenant and its share of the connections (row 69).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubuidRange {
    /// The uid that owns the range.
    pub owner: u32,
    /// Its first uid.
    pub start: u32,
    /// How many uids.
    pub count: u32,
}

impl SubuidRange {
    pub(super) fn holds(&self, uid: u32) -> bool {
        uid >= self.start && u64::from(uid) < u64::from(self.start) + u64::from(self.count)
    }
}

/// One tenant the operator declared (`--tenant`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantSpec {
    /// Its name: the prefix of its keys in L1 and L2 (so the same on every node).
    pub name: String,
    /// Unix peers of these uids act for it.
    pub uids: Vec<u32>,
    /// TCP peers proving they hold one of these tokens act for it (the node keeps
    /// the keys derived from them, [`TcpKey`](crate::protocol::tcp_auth::TcpKey)).
    pub tokens: Vec<Vec<u8>>,
    /// Its share of the L1 pool in percent; None: a fair share of the tenants holding
    /// slots.
    pub quota_percent: Option<u32>,
    /// Whether its workers may register engine-driven (they map the whole L1 pool).
    pub engine_driven: bool,
}

/// Who may do what: the operator's tenants. Uids no tenant names are each a tenant of
/// their own (`uid-<uid>`); the server's own uid's tenant may register engine-driven.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustConfig {
    /// The declared tenants.
    pub tenants: Vec<TenantSpec>,
    /// The secret the node's TCP challenge nonces are drawn from
    /// ([`tcp_auth::server_nonce`](crate::protocol::tcp_auth::server_nonce)): random at each start (the shell's `getrandom`).
    pub nonce_secret: [u8; 32],
    /// Subordinate uid ranges (`--subuid-file`): each uid in one counts as its owner.
    pub subuids: Vec<SubuidRange>,
    /// Tenants tracked at once (None: [`MAX_TENANTS`](super::MAX_TENANTS)).
    pub max_tenants: Option<usize>,
}

/// Why a [`TrustConfig`] cannot be used.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum TrustConfigError {
    /// A tenant name that cannot be a key prefix.
    #[error(
        "tenant name {0:?}: use 1 to {MAX_TENANT_NAME_BYTES} bytes of ASCII letters, digits, `.`, `_`, `-`, not starting with `uid-` (the default tenants' names)"
    )]
    BadName(String),
    /// Two tenants of one name.
    #[error("tenant {0:?} is declared twice; declare each tenant once, with all its members")]
    DuplicateName(String),
    /// A uid in two tenants.
    #[error(
        "uid {uid} is a member of both tenant {first:?} and tenant {second:?}; a uid acts for one tenant"
    )]
    DuplicateUid {
        /// The uid.
        uid: u32,
        /// The first tenant naming it.
        first: String,
        /// The second.
        second: String,
    },
    /// A token in two tenants.
    #[error(
        "one token is a member of both tenant {first:?} and tenant {second:?}; give each tenant its own token"
    )]
    DuplicateToken {
        /// The first tenant naming it.
        first: String,
        /// The second.
        second: String,
    },
    /// A token too short to be a secret.
    #[error(
        "a token of tenant {0:?} has fewer than {MIN_SECRET_BYTES} bytes; use at least 16 random bytes (e.g. `openssl rand -hex 32`)"
    )]
    ShortToken(String),
    /// A quota outside 1..=100 %.
    #[error("tenant {name:?}: quota {percent}% is not 1 to 100")]
    BadQuota {
        /// The tenant.
        name: String,
        /// The quota given.
        percent: u32,
    },
}
