//! What the node says, and when: the outputs waiting for `poll_output`, the ids it hands
//! out, and the `now` of the call being handled.

use super::Output;
use crate::time::Instant;
use std::collections::VecDeque;

/// Outputs, ids and the current call's time.
pub(super) struct NodeOutbox {
    pub(super) queue: VecDeque<Output>,
    next_id: u64,
    /// The `now` of the call being handled.
    pub(super) now: Instant,
}

impl NodeOutbox {
    /// Empty, at `now`.
    pub(super) fn new(now: Instant) -> NodeOutbox {
        NodeOutbox {
            queue: VecDeque::new(),
            next_id: 0,
            now,
        }
    }

    /// A fresh id (contexts, copies, frees, blends, L2 operations share one sequence).
    pub(super) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}
