//! Test-only faults of `kvwarden serve`: slow context builds and frees that never
//! return (row 20 of the failure modes; benchmark S3). They exist so that tests and
//! benchmarks can show that the event loop keeps serving while builds and frees are
//! stuck. `kvwarden serve` refuses them unless `--allow-short-timeouts` is given too,
//! and logs them loudly.

use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Duration;

/// The faults asked for on the command line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Every context build sleeps this long before it starts (`--fault-build-delay-ms`).
    pub build_delay: Duration,
    /// The frees of the first this-many contexts never return
    /// (`--fault-free-hang-instances`).
    pub free_hang_instances: u64,
}

impl Faults {
    /// Whether any fault is switched on.
    pub fn any(&self) -> bool {
        !self.build_delay.is_zero() || self.free_hang_instances > 0
    }
}

/// The faults in force in a running server.
#[derive(Debug, Default)]
pub struct FaultState {
    faults: Faults,
    hangs_started: u64,
    /// Kept (never sent on) so that each hung free blocks until the server exits.
    hung_frees: Vec<Sender<()>>,
}

impl FaultState {
    /// The faults `faults` in force from now on.
    pub fn new(faults: Faults) -> FaultState {
        FaultState {
            faults,
            ..FaultState::default()
        }
    }

    /// How long a build sleeps first (zero unless the fault is on).
    pub fn build_delay(&self) -> Duration {
        self.faults.build_delay
    }

    /// For the next free: a channel it blocks on for good when it is one of the first
    /// `free_hang_instances` frees, else None.
    pub fn next_free_hang(&mut self) -> Option<FreeHang> {
        if self.hangs_started >= self.faults.free_hang_instances {
            return None;
        }
        self.hangs_started += 1;
        let (sender, receiver) = mpsc::channel();
        self.hung_frees.push(sender);
        Some(FreeHang(receiver))
    }
}

/// A free that is made to hang: [`FreeHang::block`] returns only when the server exits.
#[derive(Debug)]
pub struct FreeHang(Receiver<()>);

impl FreeHang {
    /// Blocks, as a CUDA call that never returns would.
    pub fn block(self) {
        let _ = self.0.recv();
    }
}

/// Sleeps `delay` (a no-op for zero): the build-delay fault, run on the pool thread.
pub fn delay_build(delay: Duration) {
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_n_frees_hang() {
        let mut state = FaultState::new(Faults {
            build_delay: Duration::ZERO,
            free_hang_instances: 2,
        });
        let first = state.next_free_hang().expect("first hangs");
        assert!(state.next_free_hang().is_some());
        assert!(state.next_free_hang().is_none());
        assert!(FaultState::default().next_free_hang().is_none());
        let blocked = std::thread::spawn(move || first.block());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!blocked.is_finished(), "a hung free stays hung");
        drop(state);
        blocked.join().unwrap();
    }
}
