//! Process-exit proof: pidfds of registering peers in the poll set.
//!
//! A pidfd names one process for good (PID reuse cannot fool it) and turns readable
//! when that process exits. A closed connection proves nothing; an exited process does.

use kvwarden_core::node;
use rustix::fd::{AsFd, AsRawFd, OwnedFd};
use std::collections::HashMap;

/// The peer credentials of a Unix-socket connection and a pidfd of its process.
pub fn peer_of(stream: &mio::net::UnixStream) -> super::connection::Credentials {
    let Some((pid, uid)) = peer_credentials(stream) else {
        return super::connection::Credentials::default();
    };
    // pid 0 means the peer lives in a PID namespace we cannot see: no proof by pid (the
    // worker may still hand over a pidfd of itself in `hello`).
    let pidfd = rustix::process::Pid::from_raw(pid).and_then(|pid| {
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK).ok()
    });
    let pid = (pid > 0).then_some(pid);
    let process = pidfd.as_ref().and_then(|pidfd| {
        pid.map(|pid| Process {
            key: pidfs_key(pidfd).unwrap_or(ProcessIdentity::Pid(pid)),
            pid: Some(pid),
        })
    });
    super::connection::Credentials {
        uid: Some(uid),
        pid,
        pidfd,
        pidfd_from_peer: false,
        process,
        key: None,
    }
}

pub use kvwarden_core::node::DeathNotice;

/// What names a watched process, so that one process gets one watch however its pidfd
/// was obtained. A pidfd of a process this server cannot see has no usable pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProcessIdentity {
    /// The pidfs inode of the process (Linux 6.9+): unique per process, in every
    /// namespace, never reused.
    Pidfs(u64),
    /// The pid, in the server's PID namespace (older kernels).
    Pid(i32),
    /// Neither: the process as seen through one connection (its token).
    Connection(usize),
}

/// A process a connection's registrations are tied to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    /// Its watch key.
    pub key: ProcessIdentity,
    /// Its pid in the server's PID namespace, when visible there.
    pub pid: Option<i32>,
}

/// `statfs.f_type` of pidfs (`PID_FS_MAGIC`).
const PIDFS_MAGIC: i64 = 0x5049_4446;

/// The pidfs inode of `pidfd`, on kernels whose pidfds live on pidfs.
fn pidfs_key(pidfd: impl AsFd) -> Option<ProcessIdentity> {
    let pidfd = pidfd.as_fd();
    let fs = rustix::fs::fstatfs(pidfd).ok()?;
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)] // f_type's width varies
    if i64::from(fs.f_type as i64) != PIDFS_MAGIC {
        return None;
    }
    let stat = rustix::fs::fstat(pidfd).ok()?;
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    Some(ProcessIdentity::Pidfs(stat.st_ino as u64))
}

/// The `Pid:` line of `/proc/self/fdinfo/<fd>`: the process a pidfd names, in the PID
/// namespace of this `/proc` (0: not visible there; -1: it has exited). None when the
/// fd is not a pidfd; Err when `/proc` cannot be read.
fn pidfd_pid(fd: impl AsFd) -> std::io::Result<Option<i32>> {
    let path = format!("/proc/self/fdinfo/{}", fd.as_fd().as_raw_fd());
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .find_map(|line| line.strip_prefix("Pid:"))
        .and_then(|pid| pid.trim().parse().ok()))
}

/// Checks a pidfd the peer sent of itself (`hello`'s `pidfd_index`) and returns the
/// process it names, or the reason to refuse it (a `bad_args` message).
///
/// It must be a pidfd. Where `SO_PEERCRED` shows the peer's pid, the pidfd must name
/// that process: a worker cannot tie its instances to someone else's life. Where the
/// peer is not visible (pid 0), it is taken on trust: a worker that lies can only
/// shorten or lengthen the life of its own instances, which ownership already confines
/// to its uid.
pub fn check_peer_pidfd(
    peer: &super::connection::Credentials,
    pidfd: &impl AsFd,
    index: u64,
    connection: mio::Token,
) -> Result<Process, String> {
    let named = match pidfd_pid(pidfd) {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            return Err(format!(
                "`hello`: the fd at pidfd_index {index} is not a pidfd (its \
                 /proc/self/fdinfo has no `Pid:` line); send a pidfd of the worker itself, \
                 from pidfd_open(getpid(), 0) (Linux 5.3+), or leave pidfd_index out"
            ));
        }
        Err(error) => {
            return Err(format!(
                "`hello`: cannot check the pidfd at pidfd_index {index}: reading \
                 /proc/self/fdinfo failed ({error}); the server needs /proc mounted to accept \
                 pidfds; leave pidfd_index out meanwhile"
            ));
        }
    };
    if let Some(peer_pid) = peer.pid {
        // Both `Pid:` lines come from the same /proc, so they compare even where that
        // /proc belongs to another PID namespace than the server's.
        let expected = peer
            .pidfd
            .as_ref()
            .filter(|_| !peer.pidfd_from_peer)
            .and_then(|own| pidfd_pid(own).ok().flatten())
            .filter(|&pid| pid > 0)
            .unwrap_or(peer_pid);
        if named != expected {
            let which = if named == -1 {
                "a process that has exited".to_string()
            } else if named == 0 {
                "a process this server cannot see".to_string()
            } else {
                format!("pid {named}")
            };
            return Err(format!(
                "`hello`: the pidfd at pidfd_index {index} names {which}, but this \
                 connection's peer is pid {peer_pid} (SO_PEERCRED); a worker may send only \
                 a pidfd of itself: pidfd_open(getpid(), 0) in the process that connected"
            ));
        }
    }
    // A `Pid:` of an invisible peer is not used as a key: it may come from a /proc of
    // another PID namespace than SO_PEERCRED's, where the same number is someone else.
    let key = pidfs_key(pidfd)
        .or(peer.pid.map(ProcessIdentity::Pid))
        .unwrap_or(ProcessIdentity::Connection(connection.0));
    Ok(Process { key, pid: peer.pid })
}

/// `SO_PEERCRED` as raw numbers. (rustix's `UCred` holds the pid as a non-zero type,
/// but the kernel reports 0 for a peer outside our PID namespace.)
fn peer_credentials(stream: &mio::net::UnixStream) -> Option<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given, and the fd is
    // a live socket borrowed from `stream` for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    (rc == 0).then_some((cred.pid, cred.uid))
}

/// One process the shell knows: a peer's, named for the node by an opaque key.
struct Known {
    pid: Option<i32>,
    /// Connections whose peer it is.
    connections: usize,
    /// The pidfd in the poll set, while the node watches it.
    watch: Option<(OwnedFd, mio::Token)>,
}

/// The processes of connected peers, under the node's opaque [`node::ProcessKey`]s
/// (one per process however its pidfd came: by pid at accept, or sent in `hello`),
/// and the pidfds in the poll set for those the node watches. A process is forgotten
/// once no connection is its and it is not watched.
#[derive(Default)]
pub struct Processes {
    keys: HashMap<ProcessIdentity, node::ProcessKey>,
    known: HashMap<node::ProcessKey, (ProcessIdentity, Known)>,
    by_token: HashMap<mio::Token, node::ProcessKey>,
    next: u64,
}

impl Processes {
    /// A connection's peer is `process`: its key for the node.
    pub fn hold(&mut self, process: Process) -> node::ProcessKey {
        let key = match self.keys.get(&process.key) {
            Some(&key) => key,
            None => {
                self.next += 1;
                let key = node::ProcessKey(self.next);
                self.keys.insert(process.key, key);
                key
            }
        };
        let (_, known) = self.known.entry(key).or_insert((
            process.key,
            Known {
                pid: process.pid,
                connections: 0,
                watch: None,
            },
        ));
        known.connections += 1;
        if known.pid.is_none() {
            known.pid = process.pid;
        }
        key
    }

    /// A connection whose peer `key` was closed (or named another process).
    pub fn release(&mut self, key: node::ProcessKey) {
        if let Some((_, known)) = self.known.get_mut(&key) {
            known.connections = known.connections.saturating_sub(1);
        }
        self.forget_if_unused(key);
    }

    /// Puts a clone of `pidfd` (the process `key`'s) in the poll set.
    pub fn watch(
        &mut self,
        registry: &mio::Registry,
        key: node::ProcessKey,
        pidfd: &OwnedFd,
        token: impl FnOnce() -> mio::Token,
    ) -> Result<(), std::io::Error> {
        let Some((_, known)) = self.known.get_mut(&key) else {
            return Err(std::io::Error::other("a process no connection named"));
        };
        if known.watch.is_some() {
            return Ok(());
        }
        let pidfd = pidfd.try_clone()?;
        let token = token();
        let raw = pidfd.as_raw_fd();
        registry.register(
            &mut mio::unix::SourceFd(&raw),
            token,
            mio::Interest::READABLE,
        )?;
        known.watch = Some((pidfd, token));
        self.by_token.insert(token, key);
        Ok(())
    }

    /// Takes the process's pidfd out of the poll set.
    pub fn unwatch(&mut self, registry: &mio::Registry, key: node::ProcessKey) {
        if let Some((_, known)) = self.known.get_mut(&key)
            && let Some((pidfd, token)) = known.watch.take()
        {
            let raw = pidfd.as_raw_fd();
            let _ = registry.deregister(&mut mio::unix::SourceFd(&raw));
            self.by_token.remove(&token);
        }
        self.forget_if_unused(key);
    }

    /// The watched process whose pidfd is `token`, if any.
    pub fn watched_by(&self, token: mio::Token) -> Option<node::ProcessKey> {
        self.by_token.get(&token).copied()
    }

    /// The process's pid, when visible in this PID namespace.
    pub fn pid_of(&self, key: node::ProcessKey) -> Option<i32> {
        self.known.get(&key).and_then(|(_, known)| known.pid)
    }

    /// Processes whose pidfd is in the poll set.
    pub fn watched(&self) -> usize {
        self.by_token.len()
    }

    fn forget_if_unused(&mut self, key: node::ProcessKey) {
        if let Some((process, known)) = self.known.get(&key)
            && known.connections == 0
            && known.watch.is_none()
        {
            self.keys.remove(process);
            self.known.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::connection::Credentials;
    use rustix::process::{Pid, PidfdFlags, getpid, pidfd_open};

    fn own_pidfd() -> OwnedFd {
        pidfd_open(getpid(), PidfdFlags::empty()).unwrap()
    }

    struct Sleeper(std::process::Child);

    impl Sleeper {
        fn start() -> Sleeper {
            Sleeper(
                std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .unwrap(),
            )
        }

        fn pid(&self) -> i32 {
            self.0.id() as i32
        }

        fn pidfd(&self) -> OwnedFd {
            pidfd_open(Pid::from_raw(self.pid()).unwrap(), PidfdFlags::empty()).unwrap()
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn visible_peer() -> Credentials {
        Credentials {
            uid: Some(0),
            pid: Some(getpid().as_raw_nonzero().get()),
            pidfd: Some(own_pidfd()),
            pidfd_from_peer: false,
            process: None,
            key: None,
        }
    }

    #[test]
    fn row_01_a_visible_peer_may_send_only_its_own_pidfd() {
        let peer = visible_peer();
        let own_pid = getpid().as_raw_nonzero().get();
        let process = check_peer_pidfd(&peer, &own_pidfd(), 0, mio::Token(7)).unwrap();
        assert_eq!(process.pid, Some(own_pid));
        assert_ne!(
            process.key,
            ProcessIdentity::Connection(7),
            "a visible process has a key"
        );
        let other = Sleeper::start();
        let error = check_peer_pidfd(&peer, &other.pidfd(), 0, mio::Token(7)).unwrap_err();
        assert!(error.contains(&format!("pid {}", other.pid())), "{error}");
        assert!(error.contains(&format!("pid {own_pid}")), "{error}");
        let memfd = crate::memfd::create("not-a-pidfd", 16).unwrap();
        let error = check_peer_pidfd(&peer, &memfd, 2, mio::Token(7)).unwrap_err();
        assert!(error.contains("pidfd_index 2 is not a pidfd"), "{error}");
    }

    #[test]
    fn row_02_an_invisible_peer_is_taken_at_its_word() {
        let peer = Credentials {
            uid: Some(0),
            ..Credentials::default()
        };
        let other = Sleeper::start();
        let process = check_peer_pidfd(&peer, &other.pidfd(), 0, mio::Token(9)).unwrap();
        assert_eq!(
            process.pid, None,
            "its pid is not shown: it is not the peer's view"
        );
        let expected = pidfs_key(other.pidfd()).unwrap_or(ProcessIdentity::Connection(9));
        assert_eq!(process.key, expected);
        // Still only pidfds.
        let memfd = crate::memfd::create("not-a-pidfd", 16).unwrap();
        assert!(check_peer_pidfd(&peer, &memfd, 0, mio::Token(9)).is_err());
    }

    #[test]
    fn row_01_one_watch_per_process_however_its_pidfd_came() {
        let poll = mio::Poll::new().unwrap();
        let mut processes = Processes::default();
        let peer = visible_peer();
        let by_pid = Process {
            key: pidfs_key(own_pidfd()).unwrap_or(ProcessIdentity::Pid(peer.pid.unwrap())),
            pid: peer.pid,
        };
        let from_peer = check_peer_pidfd(&peer, &own_pidfd(), 0, mio::Token(3)).unwrap();
        assert_eq!(by_pid.key, from_peer.key);
        let mut next = 100;
        let mut token = || {
            next += 1;
            mio::Token(next)
        };
        let registry = poll.registry();
        let a = processes.hold(by_pid);
        let b = processes.hold(from_peer);
        assert_eq!(a, b, "one key per process");
        processes
            .watch(registry, a, &own_pidfd(), &mut token)
            .unwrap();
        processes
            .watch(registry, b, &own_pidfd(), &mut token)
            .unwrap();
        assert_eq!(processes.watched(), 1);
        assert_eq!(processes.watched_by(mio::Token(101)), Some(a));
        assert_eq!(processes.pid_of(a), peer.pid);
        // Another process is another key; once unwatched and without connections it
        // is forgotten.
        let other = Sleeper::start();
        let invisible = Process {
            key: ProcessIdentity::Connection(55),
            pid: None,
        };
        let c = processes.hold(invisible);
        assert_ne!(c, a);
        processes
            .watch(registry, c, &other.pidfd(), &mut token)
            .unwrap();
        assert_eq!(processes.watched(), 2);
        assert_eq!(processes.pid_of(c), None);
        processes.release(c);
        assert_eq!(processes.watched(), 2, "watched: still known");
        processes.unwatch(registry, c);
        assert_eq!(processes.watched(), 1);
        assert!(!processes.known.contains_key(&c));
        assert!(
            processes
                .watch(registry, c, &other.pidfd(), &mut token)
                .is_err()
        );
    }
}
