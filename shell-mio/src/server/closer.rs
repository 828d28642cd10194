//! Where the files a peer handed over are closed: on threads of their own, never on the
//! event loop or a pool thread.
//!
//! `close(2)` of the last reference to a file runs that file's release, and a peer
//! chooses the file: a TCP socket with `SO_LINGER` set and unsent data blocks its
//! closer for the linger time (non-blocking or not), a FUSE file for as long as its
//! daemon keeps quiet, and a Unix socket for as long as any file still queued in it
//! takes (the kernel releases those when the socket goes). A worker connection's own
//! socket is such a Unix socket. So every fd that came from a peer ([`PeerFd`]) and
//! every Unix connection ([`close_stream`]) is closed here (row 56).
//!
//! One closer thread does the work while closes are quick. When a file arrives and
//! every closer has been in the middle of one close for longer than [`STUCK`], another
//! thread is started, up to [`MAX_CLOSERS`]; a peer that wants to hold them all must
//! keep that many closes stuck at once, and even then only closes wait: nobody is
//! served later.
//! Before a socket is closed its linger is set to zero where it is set, so a lingering
//! TCP socket goes at once (with a reset, which its sender asked for by handing it over).

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Instant;

/// The most closer threads at once.
pub const MAX_CLOSERS: usize = 4;
/// A close running longer than this counts as stuck: the next file starts a closer.
pub const STUCK: std::time::Duration = std::time::Duration::from_millis(50);

/// An fd a peer sent (`SCM_RIGHTS`). Dropping it hands it to a closer thread, so no
/// code path that lets one go can block the thread it runs on.
#[derive(Debug)]
pub struct PeerFd(Option<OwnedFd>);

impl PeerFd {
    /// Wraps an fd that came from a peer.
    pub fn new(fd: OwnedFd) -> PeerFd {
        PeerFd(Some(fd))
    }

    /// The fd itself, for a kind the caller has checked closes without blocking (a
    /// pidfd, a memfd): from then on it may be closed anywhere.
    pub fn into_checked(mut self) -> OwnedFd {
        self.0.take().expect("a PeerFd holds its fd until dropped")
    }
}

impl AsFd for PeerFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0
            .as_ref()
            .expect("a PeerFd holds its fd until dropped")
            .as_fd()
    }
}

impl Drop for PeerFd {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            close_off_thread(fd);
        }
    }
}

/// Closes a worker connection's Unix socket on a closer thread (the files queued in it
/// are released with it); a TCP stream is closed here (its linger is the server's own,
/// never set).
pub fn close_stream(stream: super::connection::PeerSocket) {
    match stream {
        super::connection::PeerSocket::Unix(stream) => close_off_thread(OwnedFd::from(stream)),
        super::connection::PeerSocket::Tcp(stream) => drop(stream),
    }
}

/// Hands `fd` to a closer thread; never blocks. Should no closer thread start (the
/// process is out of threads), the fd is kept open rather than closed here: a leaked fd
/// is logged, a frozen loop is not.
pub fn close_off_thread(fd: OwnedFd) {
    closers().push(fd);
}

/// Fds handed over and not closed yet (`/status` `closes_pending`).
pub fn pending() -> usize {
    closers().pending.load(Ordering::Relaxed)
}

struct Closers {
    queue: Mutex<VecDeque<OwnedFd>>,
    ready: Condvar,
    /// Threads started (and not failed to start).
    threads: AtomicUsize,
    /// Per thread: when its close in progress began (microseconds since `epoch`, plus
    /// one), or 0 while it waits for work.
    busy_since: [AtomicU64; MAX_CLOSERS],
    epoch: Instant,
    pending: AtomicUsize,
}

fn closers() -> &'static Closers {
    static CLOSERS: OnceLock<Closers> = OnceLock::new();
    CLOSERS.get_or_init(|| Closers {
        queue: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
        threads: AtomicUsize::new(0),
        busy_since: std::array::from_fn(|_| AtomicU64::new(0)),
        epoch: Instant::now(),
        pending: AtomicUsize::new(0),
    })
}

impl Closers {
    fn push(&'static self, fd: OwnedFd) {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.push_back(fd);
        drop(queue);
        if self.all_stuck() {
            self.start_one();
        }
        self.ready.notify_one();
    }

    fn now_micros(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Whether no closer could take a file soon: none started, or every one has been
    /// in one close for longer than [`STUCK`].
    fn all_stuck(&self) -> bool {
        let threads = self.threads.load(Ordering::Acquire).min(MAX_CLOSERS);
        let now = self.now_micros();
        let stuck_micros = STUCK.as_micros() as u64;
        self.busy_since[..threads].iter().all(|since| {
            let since = since.load(Ordering::Acquire);
            since != 0 && now.saturating_sub(since) > stuck_micros
        })
    }

    fn start_one(&'static self) {
        let started = self
            .threads
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_CLOSERS).then_some(n + 1)
            });
        let Ok(n) = started else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name(format!("kvwarden-closer-{n}"))
            .stack_size(64 << 10)
            .spawn(move || self.run(n));
        if let Err(error) = spawned {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(%error, "starting a closer thread failed; fds wait for another");
        }
    }

    fn run(&'static self, n: usize) {
        loop {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            let fd = loop {
                if let Some(fd) = queue.pop_front() {
                    break fd;
                }
                queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
            };
            self.busy_since[n].store(self.now_micros(), Ordering::Release);
            drop(queue);
            // A socket's linger is set to zero first (ENOTSOCK for any other file).
            let _ = rustix::net::sockopt::set_socket_linger(&fd, Some(std::time::Duration::ZERO));
            drop(fd);
            self.busy_since[n].store(0, Ordering::Release);
            self.pending.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A TCP socket whose close lingers for `linger` (its buffers full, the peer, which
    /// is returned and must be kept open, never reads).
    fn lingering(linger: Duration) -> (std::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (receiver, _) = listener.accept().unwrap();
        rustix::net::sockopt::set_socket_recv_buffer_size(&receiver, 4096).unwrap();
        rustix::net::sockopt::set_socket_linger(&sender, Some(linger)).unwrap();
        sender.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while std::io::Write::write(&mut &sender, &chunk).is_ok() {}
        (sender, receiver)
    }

    /// A close that is stuck (a Unix socket whose queue holds a lingering TCP socket: the
    /// linger of the queued one cannot be zeroed) holds one closer; a file handed over
    /// once it has been stuck past [`STUCK`] starts another, which closes it: one end of
    /// a socket pair, whose other end then reads the end of the stream, well before the
    /// 30 s linger ends.
    #[test]
    fn a_stuck_close_holds_one_closer_and_the_next_file_gets_another() {
        let (queued, _receiver) = lingering(Duration::from_secs(30));
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let fds = [rustix::fd::AsFd::as_fd(&queued)];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
        rustix::net::sendmsg(
            &ours,
            &[std::io::IoSlice::new(b"x")],
            &mut control,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
        drop(queued);
        drop(ours);
        close_off_thread(OwnedFd::from(theirs));
        std::thread::sleep(STUCK * 4);
        let (mut near, far) = std::os::unix::net::UnixStream::pair().unwrap();
        close_off_thread(OwnedFd::from(far));
        near.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut byte = [0u8; 1];
        let read = std::io::Read::read(&mut near, &mut byte);
        assert!(
            matches!(read, Ok(0)),
            "the handed-over end was closed within 3 s: {read:?}"
        );
    }

    /// A TCP socket whose linger (5 s) holds unsent data blocks a plain close for the
    /// linger time (the control); handed to the closer, the caller goes on at once and
    /// the socket is gone (its peer sees the reset) long before the linger ran out.
    #[test]
    fn a_lingering_socket_blocks_a_plain_close_and_not_a_handed_over_one() {
        let lingering = || lingering(Duration::from_secs(5));
        let (sender, _receiver) = lingering();
        let started = Instant::now();
        drop(sender);
        let plain = started.elapsed();
        assert!(
            plain >= Duration::from_secs(4),
            "the control: a plain close lingers ({plain:?})"
        );

        let (sender, mut receiver) = lingering();
        let started = Instant::now();
        close_off_thread(OwnedFd::from(sender));
        let handed = started.elapsed();
        assert!(
            handed < plain / 4,
            "handing it over returns at once ({handed:?}; a plain close took {plain:?})"
        );
        // The receiver sees the reset once the closer closed it, well within the linger.
        receiver
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut sink = vec![0u8; 1 << 20];
        let ended = loop {
            match std::io::Read::read(&mut receiver, &mut sink) {
                Ok(0) => break "eof",
                Ok(_) => continue,
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                    break "reset";
                }
                Err(error) => panic!("reading the receiver: {error}"),
            }
        };
        assert_eq!(ended, "reset", "linger zero: the closer reset the socket");
    }
}
