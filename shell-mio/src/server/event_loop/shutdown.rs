//! Clean shutdown on SIGTERM/SIGINT (row 19).

use super::*;

impl Server {
    // ---------------------------------------------------------------- shutdown

    pub(super) fn on_signal(&mut self) {
        let mut buf = [0u8; 64];
        while matches!(self.signals.read(&mut buf), Ok(n) if n > 0) {}
        if self.shutdown.is_some() {
            return;
        }
        tracing::info!(
            "shutdown requested: no new connections; answering requests in flight, then \
             freeing every context"
        );
        if let Some(mut listener) = self.unix_listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
        if let Some(mut listener) = self.tcp_listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
        if let Some(mut listener) = self.http_listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
        self.http_connections.clear();
        if let Err(error) = std::fs::remove_file(&self.config.socket_path) {
            tracing::warn!(%error, path = %self.config.socket_path.display(), "removing the socket file failed");
        }
        self.shutdown = Some(Shutdown::Draining {
            since: std::time::Instant::now(),
        });
    }

    /// Advances a shutdown; true once it is complete.
    pub(super) fn shutdown_step(&mut self) -> bool {
        match self.shutdown {
            None => false,
            Some(Shutdown::Draining { since }) => {
                if self.jobs_in_flight > 0 && since.elapsed() < SHUTDOWN_DRAIN {
                    return false;
                }
                let now = self.now();
                let keys: Vec<(InstanceId, Module)> = self.records.keys().copied().collect();
                for (instance, module) in keys {
                    self.liveness.unregister(now, instance, module);
                }
                self.drain_effects();
                self.flush_dirty();
                self.shutdown = Some(Shutdown::Freeing {
                    since: std::time::Instant::now(),
                });
                false
            }
            Some(Shutdown::Freeing { since }) => {
                self.take_completions();
                if !self.frees.is_empty() && since.elapsed() < self.config.free_watchdog {
                    return false;
                }
                self.flush_dirty();
                tracing::info!(
                    contexts_freed = self.freed_at_shutdown,
                    frees_unfinished = self.frees.len(),
                    "shutdown complete: freed {} contexts",
                    self.freed_at_shutdown
                );
                true
            }
        }
    }
}
