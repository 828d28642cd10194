//! The work that runs on the shell's pool and what waits for it: built contexts with
//! the copies against them, open batches, and the builds, copies and blends waiting for
//! their tenant's turn.

use super::batches::Batches;
use super::contexts::Contexts;
use super::jobs::JobQueue;

/// Contexts, batches and the pool's queue.
pub(super) struct PoolWork {
    /// Built contexts, their strategies and the copies running against them.
    pub(super) contexts: Contexts,
    /// Batches open until their last item ends.
    pub(super) batches: Batches,
    /// Builds, copies and blends waiting for their tenant's turn at the pool.
    pub(super) jobs: JobQueue,
}

impl PoolWork {
    /// No work yet; at most `pool_window` jobs handed to the pool at once.
    pub(super) fn new(pool_window: usize) -> PoolWork {
        PoolWork {
            contexts: Contexts::default(),
            batches: Batches::default(),
            jobs: JobQueue::new(pool_window),
        }
    }
}
