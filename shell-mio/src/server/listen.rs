//! Listening sockets: the Unix socket (default path, mode, stale-file handling), TCP
//! and HTTP.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why the server could not start listening.
#[derive(Debug, Error)]
pub enum ListenError {
    /// Another server answers on the socket.
    #[error(
        "another kvwarden server is already listening on {path}; stop it first, or \
         start this one with --socket PATH"
    )]
    AlreadyRunning {
        /// The socket path.
        path: PathBuf,
    },
    /// Something that is not a socket sits at the path.
    #[error(
        "{path} exists and is not a socket; refusing to replace it: remove it or pick another --socket"
    )]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A system call failed.
    #[error("{what} {target}: {source}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// On what.
        target: String,
        /// The error.
        source: io::Error,
    },
}

/// `$XDG_RUNTIME_DIR/kvwarden.sock`, else `/tmp/kvwarden-<uid>.sock`.
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("kvwarden.sock"),
        _ => PathBuf::from(format!(
            "/tmp/kvwarden-{}.sock",
            rustix::process::getuid().as_raw()
        )),
    }
}

/// Binds the Unix socket at `path` with permission bits `mode`. A stale socket file
/// (nobody answers) is replaced; a live server's is refused.
pub fn bind_unix(path: &Path, mode: u32) -> Result<mio::net::UnixListener, ListenError> {
    let io_error = |what, source| ListenError::Io {
        what,
        target: path.display().to_string(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => {
                    return Err(ListenError::AlreadyRunning {
                        path: path.to_path_buf(),
                    });
                }
                Err(_) => {
                    tracing::warn!(path = %path.display(), "replacing a stale socket file left by a server that is gone");
                    std::fs::remove_file(path).map_err(|e| io_error("removing stale socket", e))?;
                }
            }
        }
        Ok(_) => {
            return Err(ListenError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("inspecting", e)),
    }
    let listener = mio::net::UnixListener::bind(path).map_err(|e| io_error("binding", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_error("setting the mode of", e))?;
    Ok(listener)
}

/// Binds a TCP listener.
pub fn bind_tcp(addr: std::net::SocketAddr) -> Result<mio::net::TcpListener, ListenError> {
    mio::net::TcpListener::bind(addr).map_err(|source| ListenError::Io {
        what: "binding",
        target: addr.to_string(),
        source,
    })
}
