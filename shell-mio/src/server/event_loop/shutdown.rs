//! Clean shutdown on SIGTERM/SIGINT (row 19): the shell stops listening; the node
//! drains, frees and stops.

use super::Server;
use kvwarden_core::node::Input;
use std::io::Read;

impl Server {
    // ---------------------------------------------------------------- shutdown

    pub(super) fn on_signal(&mut self) {
        let mut buf = [0u8; 64];
        while matches!(self.signals.read(&mut buf), Ok(n) if n > 0) {}
        if self.node.is_shutting_down() {
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
        if self.socket_owned
            && let Err(error) = std::fs::remove_file(&self.config.socket_path)
        {
            tracing::warn!(%error, path = %self.config.socket_path.display(), "removing the socket file failed");
        }
        // The node answers what runs, then frees every entry, then says `Stopped`.
        self.input(Input::Shutdown);
    }
}
