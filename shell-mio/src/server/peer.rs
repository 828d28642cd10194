//! Process-exit proof: pidfds of registering peers in the poll set.
//!
//! A pidfd names one process for good (PID reuse cannot fool it) and turns readable
//! when that process exits. A closed connection proves nothing; an exited process does.

use kvwarden_core::InstanceId;
use rustix::fd::{AsRawFd, OwnedFd};
use std::collections::{BTreeSet, HashMap};

/// The peer credentials of a Unix-socket connection and a pidfd of its process.
pub fn peer_of(stream: &mio::net::UnixStream) -> super::connection::Peer {
    let Some((pid, uid)) = peer_credentials(stream) else {
        return super::connection::Peer::default();
    };
    // pid 0 means the peer lives in a PID namespace we cannot see: no proof possible.
    let pidfd = rustix::process::Pid::from_raw(pid).and_then(|pid| {
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK).ok()
    });
    super::connection::Peer {
        uid: Some(uid),
        pid: (pid > 0).then_some(pid),
        pidfd,
    }
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

struct Watch {
    pidfd: OwnedFd,
    token: mio::Token,
    instances: BTreeSet<InstanceId>,
}

/// The processes watched, each with the instances it registered.
#[derive(Default)]
pub struct Watches {
    by_pid: HashMap<i32, Watch>,
    by_token: HashMap<mio::Token, i32>,
    by_instance: HashMap<InstanceId, i32>,
}

impl Watches {
    /// Watches `pid` (with a pidfd cloned from the connection's) for `instance`.
    /// `token` is used only when the pid is not yet watched.
    pub fn watch(
        &mut self,
        registry: &mio::Registry,
        pid: i32,
        pidfd: &OwnedFd,
        instance: InstanceId,
        token: impl FnOnce() -> mio::Token,
    ) {
        if let Some(previous) = self.by_instance.get(&instance).copied() {
            if previous == pid {
                return;
            }
            // Re-registered from another process: the newest registrant is the proof.
            self.forget(registry, instance);
        }
        if !self.by_pid.contains_key(&pid) {
            let Ok(pidfd) = pidfd.try_clone() else {
                tracing::warn!(pid, %instance, "cloning a pidfd failed; this instance is left to the heartbeat rules");
                return;
            };
            let token = token();
            let raw = pidfd.as_raw_fd();
            let registered = registry.register(
                &mut mio::unix::SourceFd(&raw),
                token,
                mio::Interest::READABLE,
            );
            if let Err(error) = registered {
                tracing::warn!(pid, %error, "watching a pidfd failed; this instance is left to the heartbeat rules");
                return;
            }
            self.by_token.insert(token, pid);
            self.by_pid.insert(
                pid,
                Watch {
                    pidfd,
                    token,
                    instances: BTreeSet::new(),
                },
            );
        }
        if let Some(watch) = self.by_pid.get_mut(&pid) {
            watch.instances.insert(instance);
            self.by_instance.insert(instance, pid);
        }
    }

    /// The instance holds nothing any more: stop watching for it.
    pub fn forget(&mut self, registry: &mio::Registry, instance: InstanceId) {
        let Some(pid) = self.by_instance.remove(&instance) else {
            return;
        };
        let empty = match self.by_pid.get_mut(&pid) {
            Some(watch) => {
                watch.instances.remove(&instance);
                watch.instances.is_empty()
            }
            None => false,
        };
        if empty {
            self.remove_pid(registry, pid);
        }
    }

    /// The pidfd behind `token` fired: the process exited. Returns its instances.
    pub fn exited(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
    ) -> Option<(i32, Vec<InstanceId>)> {
        let pid = *self.by_token.get(&token)?;
        let instances = self.remove_pid(registry, pid);
        Some((pid, instances))
    }

    /// Whether `token` is a pidfd watch.
    pub fn is_watch(&self, token: mio::Token) -> bool {
        self.by_token.contains_key(&token)
    }

    /// Processes watched.
    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    /// Whether nothing is watched.
    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }

    /// The watched pid of an instance.
    pub fn pid_of(&self, instance: InstanceId) -> Option<i32> {
        self.by_instance.get(&instance).copied()
    }

    fn remove_pid(&mut self, registry: &mio::Registry, pid: i32) -> Vec<InstanceId> {
        let Some(watch) = self.by_pid.remove(&pid) else {
            return Vec::new();
        };
        self.by_token.remove(&watch.token);
        let raw = watch.pidfd.as_raw_fd();
        let _ = registry.deregister(&mut mio::unix::SourceFd(&raw));
        for instance in &watch.instances {
            self.by_instance.remove(instance);
        }
        watch.instances.into_iter().collect()
    }
}
