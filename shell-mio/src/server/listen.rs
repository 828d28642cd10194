//! Listening sockets: the Unix socket (default path, mode, stale-file handling), TCP
//! and HTTP.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why the server could not start listening.
#[derive(Debug, Error)]
pub enum ListenError {
    /// A kvwarden server already answers where this one would listen: on its Unix
    /// socket, at its HTTP address, or both (each place found is named).
    #[error("{}", already_running(socket, http))]
    AlreadyRunning {
        /// The socket path, when a server answers on it.
        socket: Option<PathBuf>,
        /// The HTTP address, when a kvwarden server's `/status` answers there.
        http: Option<std::net::SocketAddr>,
    },
    /// Something that is not a socket sits at the path.
    #[error(
        "{path} exists and is not a socket; refusing to replace it: remove it or pick another --socket"
    )]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// The directory that should hold the Unix socket does not exist.
    #[error(
        "cannot create the socket {path}: its directory {dir} does not exist; create it \
         (systemd: RuntimeDirectory=), or pick another path with --socket PATH"
    )]
    SocketDirMissing {
        /// The socket path.
        path: PathBuf,
        /// Its missing directory.
        dir: PathBuf,
    },
    /// The default socket's directory is not this uid's own.
    #[error(
        "refusing the socket directory {dir}: it must be a directory of uid {uid} with mode \
         0700, and it is owned by uid {owner} with mode {mode:04o} (or is not a directory); \
         another user may have created it to catch this server's workers. Remove it, or pick \
         --socket PATH in a directory only you can write (e.g. under $XDG_RUNTIME_DIR)"
    )]
    UnsafeSocketDir {
        /// The directory.
        dir: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode bits.
        mode: u32,
        /// This server's uid.
        uid: u32,
    },
    /// The socket path does not fit a Unix socket address.
    #[error(
        "the socket path {path} is {len} bytes; a Unix socket path holds at most \
         {MAX_SOCKET_PATH_BYTES}: pick a shorter --socket PATH (e.g. under /run or \
         $XDG_RUNTIME_DIR)"
    )]
    SocketPathTooLong {
        /// The socket path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The Unix socket could not be bound.
    #[error(
        "binding the socket {path}: {source}; check its directory's permissions, or pick \
         another path with --socket PATH"
    )]
    UnixBind {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A TCP listener could not be bound.
    #[error("binding {addr} for {}: {source}; {}", role.flag(), role.fix())]
    TcpBind {
        /// What the listener is for.
        role: TcpRole,
        /// The address.
        addr: std::net::SocketAddr,
        /// The error.
        source: io::Error,
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

fn already_running(socket: &Option<PathBuf>, http: &Option<std::net::SocketAddr>) -> String {
    let (place, fix) = match (socket, http) {
        (Some(path), Some(addr)) => (
            format!("on the socket {} and HTTP {addr}", path.display()),
            "another --socket PATH and --http ADDR (or --http off)",
        ),
        (Some(path), None) => (
            format!("on the socket {}", path.display()),
            "another --socket PATH",
        ),
        (None, Some(addr)) => (
            format!("with HTTP on {addr}"),
            "another --http ADDR (e.g. --http 127.0.0.1:8081, or --http off) and --socket \
             PATH",
        ),
        (None, None) => ("here".to_string(), "another --socket PATH"),
    };
    format!(
        "a kvwarden server is already running {place} (`kvwarden status` shows it); stop \
         it first, or start this one with {fix}"
    )
}

/// Refuses to start where a kvwarden server already runs, naming every place it answers
/// (its socket, its HTTP address) in one message, before anything is bound: a second
/// `serve` would otherwise report one conflict at a time. A port held by something
/// else is left to the bind, which names it.
pub fn refuse_a_running_server(
    socket: &Path,
    http: Option<std::net::SocketAddr>,
) -> Result<(), ListenError> {
    let socket_answers = std::fs::symlink_metadata(socket)
        .is_ok_and(|meta| meta.file_type().is_socket())
        && std::os::unix::net::UnixStream::connect(socket).is_ok();
    let http = http.filter(|addr| addr.port() != 0 && http_is_kvwarden(*addr));
    if socket_answers || http.is_some() {
        return Err(ListenError::AlreadyRunning {
            socket: socket_answers.then(|| socket.to_path_buf()),
            http,
        });
    }
    Ok(())
}

/// Whether `GET /status` at `addr` answers as a kvwarden server (within half a second).
fn http_is_kvwarden(addr: std::net::SocketAddr) -> bool {
    use std::io::{Read, Write};
    const PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, PATIENCE) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(PATIENCE));
    let _ = stream.set_write_timeout(Some(PATIENCE));
    if stream
        .write_all(b"GET /status HTTP/1.1\r\nHost: kvwarden\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    // The server's name comes in the first lines of the body: 4 KiB is plenty.
    let mut head = Vec::with_capacity(4096);
    let _ = stream.take(4096).read_to_end(&mut head);
    String::from_utf8_lossy(&head).contains("\"server\": \"kvwarden")
}

/// What a TCP listener is for; it decides which flag an error names.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TcpRole {
    /// `--tcp`: workers over TCP.
    Workers,
    /// `--http`: /status, /metrics and /healthz.
    Http,
}

impl TcpRole {
    /// The flag that sets the address.
    pub fn flag(self) -> &'static str {
        match self {
            TcpRole::Workers => "--tcp",
            TcpRole::Http => "--http",
        }
    }

    /// What the operator can do about a bind error.
    pub fn fix(self) -> &'static str {
        match self {
            TcpRole::Workers => {
                "pick a free address with --tcp ADDR, or leave --tcp out to serve the Unix \
                 socket only"
            }
            TcpRole::Http => {
                "pick a free address with --http ADDR (e.g. --http 127.0.0.1:8081), or \
                 --http off to run without /status, /metrics and /healthz"
            }
        }
    }
}

/// The longest path a Unix socket address holds (`sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// `$XDG_RUNTIME_DIR/kvwarden.sock`, else `/tmp/kvwarden-<uid>/kvwarden.sock` (in a
/// `0700` directory the server creates and checks: nobody else can create the socket
/// there first).
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("kvwarden.sock"),
        _ => private_dir().join("kvwarden.sock"),
    }
}

/// `/tmp/kvwarden-<uid>`: the default socket's directory without `XDG_RUNTIME_DIR`.
fn private_dir() -> PathBuf {
    PathBuf::from(format!(
        "/tmp/kvwarden-{}",
        rustix::process::getuid().as_raw()
    ))
}

/// Creates `dir` with mode `0700`, or checks that the one there is a directory (not a
/// link) of this uid that nobody else may write to: in a world-writable `/tmp`
/// another user could otherwise create it first and own the socket inside.
fn ensure_private_dir(dir: &Path) -> Result<(), ListenError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let uid = rustix::process::getuid().as_raw();
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(ListenError::Io {
                what: "creating the socket directory",
                target: dir.display().to_string(),
                source,
            });
        }
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|source| ListenError::Io {
        what: "inspecting the socket directory",
        target: dir.display().to_string(),
        source,
    })?;
    let mode = meta.mode() & 0o7777;
    if !meta.file_type().is_dir() || meta.uid() != uid || mode & 0o022 != 0 {
        return Err(ListenError::UnsafeSocketDir {
            dir: dir.to_path_buf(),
            owner: meta.uid(),
            mode,
            uid,
        });
    }
    Ok(())
}

/// Whatever is at `path` before the Unix socket is bound there: nothing, or a socket
/// no server answers (removed, said); a socket a server answers is `AlreadyRunning`,
/// anything else `NotASocket`.
fn clear_stale_socket(path: &Path) -> Result<(), ListenError> {
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
                        socket: Some(path.to_path_buf()),
                        http: None,
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
    Ok(())
}

/// Binds the Unix socket at `path` with permission bits `mode`. A stale socket file
/// (nobody answers) is replaced; a live server's is refused.
pub fn bind_unix(path: &Path, mode: u32) -> Result<mio::net::UnixListener, ListenError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH_BYTES {
        return Err(ListenError::SocketPathTooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    // The default directory is checked before anything in it is looked at (or a stale
    // socket there removed): one another user made is refused whatever it holds.
    if path.parent() == Some(private_dir().as_path()) {
        ensure_private_dir(&private_dir())?;
    }
    let io_error = |what, source| ListenError::Io {
        what,
        target: path.display().to_string(),
        source,
    };
    clear_stale_socket(path)?;
    let dir_missing = || {
        let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty())?;
        (!dir.is_dir()).then(|| ListenError::SocketDirMissing {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
        })
    };
    if let Some(error) = dir_missing() {
        return Err(error);
    }
    // bind, chmod, then listen: until `listen` every connect is refused, so no peer
    // reaches the socket before it has its final mode.
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let bind_error = |source: io::Error| {
        dir_missing().unwrap_or_else(|| ListenError::UnixBind {
            path: path.to_path_buf(),
            source,
        })
    };
    let socket = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| bind_error(e.into()))?;
    let address = SocketAddrUnix::new(path).map_err(|e| bind_error(e.into()))?;
    rustix::net::bind(&socket, &address).map_err(|e| bind_error(e.into()))?;
    if let Err(error) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)) {
        // A failed start leaves no socket file behind.
        let _ = std::fs::remove_file(path);
        return Err(io_error("setting the mode of", error));
    }
    if let Err(error) = rustix::net::listen(&socket, 1024) {
        let _ = std::fs::remove_file(path);
        return Err(io_error("listening on", error.into()));
    }
    let std_listener = std::os::unix::net::UnixListener::from(socket);
    Ok(mio::net::UnixListener::from_std(std_listener))
}

/// Binds a TCP listener for `role`.
pub fn bind_tcp(
    addr: std::net::SocketAddr,
    role: TcpRole,
) -> Result<mio::net::TcpListener, ListenError> {
    mio::net::TcpListener::bind(addr).map_err(|source| ListenError::TcpBind { role, addr, source })
}

/// fds kept aside from worker connections: listeners, epoll, waker, signal pipe, the L1
/// memfd, 64 HTTP connections, fds in transit (up to 32 per read) and memfds being
/// mapped on the context pool.
pub const RESERVED_FDS: u64 = 256;
/// fds one worker connection holds: its socket and the pidfd taken at accept. (A
/// process that registers adds one more watch pidfd, shared by all its connections.)
pub const FDS_PER_CONNECTION: u64 = 2;

/// The open-file limit the server runs under, and the worker connections it allows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit found at start.
    pub soft_at_start: u64,
    /// The soft limit in force (raised to the hard limit when allowed).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

impl FdLimit {
    /// Worker connections that fit: `(soft - RESERVED_FDS - transit) /
    /// FDS_PER_CONNECTION`, where `transit` is [`FdLimit::transit_budget`].
    pub fn connection_capacity(&self) -> usize {
        let capacity = self
            .soft
            .saturating_sub(RESERVED_FDS)
            .saturating_sub(self.soft / 4)
            / FDS_PER_CONNECTION;
        usize::try_from(capacity).unwrap_or(usize::MAX).max(1)
    }

    /// fds all connections together may hold for frames not yet complete (memfds of
    /// a registration on their way): a quarter of the soft limit, kept out of the
    /// connection capacity, so that peers hoarding fds cannot fill the table (row 43).
    pub fn transit_budget(&self) -> usize {
        usize::try_from(self.soft / 4).unwrap_or(usize::MAX).max(64)
    }
}

/// Raises this process's open-file soft limit (`RLIMIT_NOFILE`) to its hard limit, so
/// that the connection capacity is what the operator allowed, not the shell's 1024
/// default. A refusal (or an unlimited hard limit the kernel will not grant) leaves the
/// soft limit as it was; the result says what is in force.
pub fn raise_fd_limit() -> FdLimit {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    const UNLIMITED: u64 = u64::MAX;
    let limit = getrlimit(Resource::Nofile);
    let soft_at_start = limit.current.unwrap_or(UNLIMITED);
    let hard = limit.maximum.unwrap_or(UNLIMITED);
    let mut soft = soft_at_start;
    if soft < hard {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => soft = hard,
            Err(error) => tracing::warn!(
                soft = soft_at_start,
                hard,
                %error,
                "could not raise the open-file soft limit to the hard limit"
            ),
        }
    }
    FdLimit {
        soft_at_start,
        soft,
        hard,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_capacity_keeps_a_reserve_a_transit_budget_and_two_fds_per_connection() {
        let limit = |soft| FdLimit {
            soft_at_start: 1024,
            soft,
            hard: soft,
        };
        assert_eq!(limit(1024).connection_capacity(), 256);
        assert_eq!(limit(1024).transit_budget(), 256);
        assert_eq!(limit(1_048_576).connection_capacity(), 393_088);
        assert_eq!(limit(1_048_576).transit_budget(), 262_144);
        assert_eq!(limit(100).connection_capacity(), 1, "never zero");
        assert_eq!(limit(100).transit_budget(), 64, "never below 64");
        assert_eq!(
            limit(u64::MAX).connection_capacity(),
            usize::try_from((u64::MAX - RESERVED_FDS - u64::MAX / 4) / 2).unwrap_or(usize::MAX)
        );
    }

    #[test]
    fn raising_reaches_the_hard_limit_when_allowed() {
        let limit = raise_fd_limit();
        assert!(limit.soft >= limit.soft_at_start);
        assert!(limit.soft <= limit.hard);
        let again = raise_fd_limit();
        assert_eq!(again.soft, limit.soft, "raising twice changes nothing");
    }
}
