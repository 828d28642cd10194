//! What the core asks of its shell: effects, drained with `Liveness::poll_effect`.
//!
//! Each effect is an edge, never a level: it is emitted once for the change it reports.

use crate::id::InstanceId;
use crate::module::Module;
use std::time::Duration;

/// Something the shell must carry out.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect<C> {
    /// Release this context exactly as a clean UNREGISTER would. Edge: once per entry.
    FreeContext {
        /// The instance whose entry went.
        instance: InstanceId,
        /// The module the entry was in.
        module: Module,
        /// The context the shell handed over in `context_built`.
        context: C,
        /// Why it goes.
        cause: FreeCause,
    },
    /// The instance has no entry left in any module: drop every per-instance mirror
    /// (CacheBlend rope state and the like). Edge: once each time the instance's last
    /// entry goes, after that entry's FreeContext.
    DropBlendState {
        /// The instance that is gone from every module.
        instance: InstanceId,
    },
    /// The core saw no input for `gap` (> stall_threshold): the server itself was paused.
    /// The gap does not count as anyone's silence.
    StallDetected {
        /// How long the core saw nothing.
        gap: Duration,
    },
}

/// Why a context is freed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FreeCause {
    /// The worker said goodbye (UNREGISTER).
    Unregistered,
    /// `silence` is how long the entry had been silent; `proven` whether it had pinged.
    Reaped {
        /// Silence on the stall-corrected clock when the entry was reaped.
        silence: Duration,
        /// Whether the entry had ever pinged (its window was the reap timeout).
        proven: bool,
    },
    /// The operating system proved that the worker's process exited.
    ProcessExited,
    /// The entry was removed while its context was still being built.
    Cancelled,
}

impl FreeCause {
    /// A short stable label for logs and metrics: `unregistered`, `reaped`,
    /// `process_exited`, `cancelled`.
    pub fn label(&self) -> &'static str {
        match self {
            FreeCause::Unregistered => "unregistered",
            FreeCause::Reaped { .. } => "reaped",
            FreeCause::ProcessExited => "process_exited",
            FreeCause::Cancelled => "cancelled",
        }
    }
}
