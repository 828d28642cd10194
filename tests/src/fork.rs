//! Another uid's process, forked and setuid, talking to the test over a pipe.

use crate::PATIENCE;
use serde_json::Value as Json;
use std::io::{Read, Write};
use std::time::Instant;

/// A child process forked from this test process that runs as another uid (setgid,
/// setuid, no supplementary groups: the tests that use it run as root) and talks to
/// its parent over two pipes, one JSON value a line. Its body is a closure of the
/// test, run right after the fork and the privilege drop; the child then exits with
/// `_exit` (no destructor of the parent's state runs twice).
///
/// Right after the fork the child closes every fd but stdin/stdout/stderr and its two
/// pipe ends: it holds no copy of another test's sockets (which would keep the server
/// from seeing them close). Its body must touch no lock another thread of the test
/// process could have held at the fork: it builds its own connections, memfds and
/// clients, and uses nothing of the parent's but plain values it captured.
pub struct Forked {
    pid: libc::pid_t,
    uid: u32,
    from_child: std::fs::File,
    to_child: Option<std::fs::File>,
    pending: Vec<u8>,
    exited: bool,
}

/// The child's end of a [`Forked`]: what it sends and receives.
pub struct ToParent {
    to_parent: std::fs::File,
    from_parent: std::io::BufReader<std::fs::File>,
}

impl ToParent {
    /// Sends `value` to the parent (one line).
    pub fn send(&mut self, value: Json) {
        let line = serde_json::json!({ "message": value }).to_string();
        let _ = writeln!(self.to_parent, "{line}");
    }

    /// Waits for the parent's next value ([`Forked::send`]); `Null` once the parent
    /// closed its end.
    pub fn recv(&mut self) -> Json {
        use std::io::BufRead;
        let mut line = String::new();
        match self.from_parent.read_line(&mut line) {
            Ok(n) if n > 0 => serde_json::from_str(&line).unwrap_or(Json::Null),
            _ => Json::Null,
        }
    }
}

/// Forks a child that drops to `uid` and runs `body`; its return value is what
/// [`Forked::finish`] returns. A panic in the body is reported to the parent, which
/// panics with it.
pub fn fork_as_uid(uid: u32, body: impl FnOnce(&mut ToParent) -> Json) -> Forked {
    use rustix::fd::{AsRawFd, FromRawFd, IntoRawFd};
    use rustix::pipe::{PipeFlags, pipe_with};
    assert!(
        rustix::process::geteuid().is_root(),
        "acting as uid {uid} needs root: run the who-is-who tests as root"
    );
    let (up_read, up_write) = pipe_with(PipeFlags::CLOEXEC).expect("a pipe to the parent");
    let (down_read, down_write) = pipe_with(PipeFlags::CLOEXEC).expect("a pipe to the child");
    // SAFETY: the child only runs `child_main`, which closes fds, drops privileges, runs
    // the test's body (see the type's docs for what it may touch) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let keep = [up_write.as_raw_fd(), down_read.as_raw_fd()];
        // SAFETY: the fds were just created and are owned here.
        let to_parent = unsafe { std::fs::File::from_raw_fd(up_write.into_raw_fd()) };
        let from_parent = unsafe { std::fs::File::from_raw_fd(down_read.into_raw_fd()) };
        let code = child_main(uid, &keep, to_parent, from_parent, body);
        // SAFETY: ends the child without running the parent's destructors or atexit.
        unsafe { libc::_exit(code) };
    }
    drop(up_write);
    drop(down_read);
    Forked {
        pid,
        uid,
        from_child: std::fs::File::from(up_read),
        to_child: Some(std::fs::File::from(down_write)),
        pending: Vec::new(),
        exited: false,
    }
}

pub(crate) fn child_main(
    uid: u32,
    keep: &[i32],
    to_parent: std::fs::File,
    from_parent: std::fs::File,
    body: impl FnOnce(&mut ToParent) -> Json,
) -> i32 {
    close_fds_but(keep);
    let mut channel = ToParent {
        to_parent,
        from_parent: std::io::BufReader::new(from_parent),
    };
    // SAFETY: plain syscalls on this (single-threaded) child.
    let dropped = unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(uid) == 0
            && libc::setuid(uid) == 0
            && libc::getuid() == uid
            && libc::geteuid() == uid
    };
    if !dropped {
        let error = std::io::Error::last_os_error();
        let line = serde_json::json!({ "panic": format!("dropping to uid {uid}: {error}") });
        let _ = writeln!(channel.to_parent, "{line}");
        return 1;
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut channel)));
    let line = match outcome {
        Ok(value) => serde_json::json!({ "result": value }),
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "a panic".to_string());
            serde_json::json!({ "panic": text })
        }
    };
    let _ = writeln!(channel.to_parent, "{line}");
    0
}

/// Closes every fd above 2 but `keep` (read from `/proc/self/fd` first, then closed).
pub(crate) fn close_fds_but(keep: &[i32]) {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing an fd of this child; nothing here uses it again (the
            // parent's objects owning it are never dropped in the child).
            unsafe { libc::close(fd) };
        }
    }
}

impl Forked {
    /// The uid it runs as.
    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// Sends `value` to the child ([`ToParent::recv`]).
    pub fn send(&mut self, value: Json) {
        let to_child = self
            .to_child
            .as_mut()
            .expect("the pipe to the child is open");
        writeln!(to_child, "{value}").expect("writing to the child");
    }

    /// The next line from the child, waiting up to [`PATIENCE`].
    fn line(&mut self, what: &str) -> Json {
        use rustix::fd::AsRawFd;
        let start = Instant::now();
        loop {
            if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=at).collect();
                return serde_json::from_slice(&line).unwrap_or_else(|error| {
                    panic!(
                        "uid {}'s child sent a line that is not JSON ({error}): {}",
                        self.uid,
                        String::from_utf8_lossy(&line)
                    )
                });
            }
            let left = PATIENCE.saturating_sub(start.elapsed());
            assert!(
                !left.is_zero(),
                "uid {}'s child said nothing within {PATIENCE:?} ({what})",
                self.uid
            );
            let mut poll = libc::pollfd {
                fd: self.from_child.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut poll, 1, millis) };
            if ready <= 0 {
                continue;
            }
            let mut chunk = [0u8; 4096];
            match self.from_child.read(&mut chunk) {
                Ok(0) => panic!(
                    "uid {}'s child exited without a word ({what}); partial output: {}",
                    self.uid,
                    String::from_utf8_lossy(&self.pending)
                ),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => panic!("reading from uid {}'s child: {error}", self.uid),
            }
        }
    }

    /// The child's next [`ToParent::send`]; panics if it panicked or finished instead.
    pub fn recv(&mut self, what: &str) -> Json {
        let line = self.line(what);
        if let Some(message) = line.get("message") {
            return message.clone();
        }
        self.fail(&line, what)
    }

    /// Closes the pipe to the child, waits for its body's result and its exit.
    pub fn finish(mut self, what: &str) -> Json {
        self.to_child = None;
        let line = loop {
            let line = self.line(what);
            if line.get("message").is_none() {
                break line;
            }
        };
        let Some(result) = line.get("result").cloned() else {
            self.fail(&line, what)
        };
        self.reap();
        result
    }

    fn fail(&mut self, line: &Json, what: &str) -> ! {
        match line.get("panic") {
            Some(panic) => panic!("uid {}'s child failed ({what}): {panic}", self.uid),
            None => panic!("uid {}'s child: unexpected line {line} ({what})", self.uid),
        }
    }

    fn reap(&mut self) {
        if self.exited {
            return;
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
        self.exited = true;
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        if !self.exited {
            // SAFETY: our own child.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            self.reap();
        }
    }
}

/// Runs `body` in a child forked as `uid` (see [`Forked`]) and returns its result.
pub fn run_as_uid(uid: u32, what: &str, body: impl FnOnce() -> Json) -> Json {
    fork_as_uid(uid, |_| body()).finish(what)
}
