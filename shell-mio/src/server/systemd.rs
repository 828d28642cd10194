//! systemd's side of a restart that keeps the cache warm (`--l1-fdstore`, row 71):
//! the pool's memfds go to the service manager's file-descriptor store (`sd_notify`
//! `FDSTORE=1`, `FDNAME=`), and come back on the next start, after a crash too, among
//! the fds it passes (`LISTEN_FDS`, `LISTEN_FDNAMES`). `READY=1` when serving (a
//! `Type=notify` unit). Outside systemd (no `NOTIFY_SOCKET`) nothing is sent.

use rustix::fd::{BorrowedFd, FromRawFd, OwnedFd};
use sd_notify::NotifyState;

/// The name of the pool's memfd in the store.
pub const POOL_FD_NAME: &str = "kvwarden-l1-pool";
/// The name of the index's memfd in the store.
pub const INDEX_FD_NAME: &str = "kvwarden-l1-index";

/// Whether a service manager listens (`NOTIFY_SOCKET` is set).
pub fn supervised() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some_and(|socket| !socket.is_empty())
}

/// The fds the service manager passed to this process, with their names; the
/// environment is left as it is (nothing here starts a child that could mistake it).
pub fn passed_fds() -> Result<Vec<(OwnedFd, String)>, String> {
    let fds = sd_notify::listen_fds_with_names(false)
        .map_err(|e| format!("reading the fds systemd passed (LISTEN_FDS, LISTEN_FDNAMES): {e}"))?;
    Ok(fds
        .map(|(fd, name)| {
            // SAFETY: by the protocol (LISTEN_PID is this process), fds 3 to
            // 3 + LISTEN_FDS - 1 are open and this process's to own; each is taken once.
            (unsafe { OwnedFd::from_raw_fd(fd) }, name)
        })
        .collect())
}

/// Puts `fd` in the store under `name`, replacing whatever the store held under it.
pub fn store(name: &str, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    sd_notify::notify_with_fds(
        false,
        &[NotifyState::FdStoreRemove, NotifyState::FdName(name)],
        &[],
    )?;
    sd_notify::notify_with_fds(
        false,
        &[NotifyState::FdStore, NotifyState::FdName(name)],
        &[fd],
    )
}

/// Tells the service manager the server is serving.
pub fn ready() {
    if let Err(error) = sd_notify::notify(false, &[NotifyState::Ready]) {
        tracing::warn!(%error, "telling systemd READY=1 failed");
    }
}

/// Takes the listening Unix stream socket among `passed` (socket activation: the unit's
/// `.socket` made and bound it, and keeps it across restarts, so workers that connect
/// meanwhile wait in its backlog), if there is one.
pub fn take_unix_listener(passed: &mut Vec<(OwnedFd, String)>) -> Option<OwnedFd> {
    use rustix::net::{AddressFamily, SocketType, sockopt};
    let at = passed.iter().position(|(fd, _)| {
        sockopt::socket_domain(fd).is_ok_and(|domain| domain == AddressFamily::UNIX)
            && sockopt::socket_type(fd).is_ok_and(|kind| kind == SocketType::STREAM)
            && sockopt::socket_acceptconn(fd).unwrap_or(false)
    })?;
    Some(passed.remove(at).0)
}
