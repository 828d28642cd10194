//! Who may come in, act, and hold what: who is who ([`Trust`]), connection admission,
//! and the bytes of peers' memfds mapped under their caps.

use super::admission::{self, Admission};
use super::mapped::Mapped;
use super::trust::Trust;

/// The node's doors.
pub(super) struct Doors {
    pub(super) trust: Trust,
    pub(super) admission: Admission,
    /// Bytes of peers' memfds mapped, under their caps.
    pub(super) mapped: Mapped,
}

impl Doors {
    /// Whether a peer of `uid` (None: TCP) may open one more connection now; a
    /// subordinate uid counts as its owner (row 69).
    pub(super) fn admits(&self, uid: Option<u32>) -> Result<(), admission::Refused> {
        self.admission
            .admits(uid.map(|uid| self.trust.counted_uid(uid)))
    }
}
