//! Registrations with adversarial fds, through the mio shell's own fd handling: the fds
//! travel over a real Unix socket pair as `SCM_RIGHTS`, are read by
//! `server::connection::Connection` (which wraps each in a `PeerFd`), handed to the
//! frame, and built by `server::context::build`, as the event loop and the pool do.
//!
//! Each buffer's fd is one of: a memfd (sealable or not, already sealed in various ways,
//! sparse or written, shrunk or grown before it is sent), or an fd of the wrong kind (a
//! pipe, a socket, `/dev/null`, an eventfd, a directory). Its claimed size is arbitrary
//! (bounded so that a case stays fast).
//!
//! Oracles: no panic and no fault; a build that succeeds holds only memfds sealed against
//! shrinking and at least as large as each buffer claims, which its sender can no longer
//! shrink; a copy of each buffer's last byte into L1 succeeds (a mapping past the end of
//! a file would fault here); an fd of the wrong kind never builds.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden::memfd::SharedMapping;
use kvwarden::protocol::BufferSpec;
use kvwarden::server::connection::{Connection, Credentials, PeerSocket, SocketRead};
use kvwarden::server::context::{BuildRequest, RegisteredBuffer, build};
use libfuzzer_sys::fuzz_target;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{MemfdFlags, SealFlags};

/// The largest size a case creates or claims: mappings are lazy, so this costs address
/// space, not memory.
const MAX_BYTES: u64 = 1 << 30;

#[derive(Arbitrary, Debug)]
enum Kind {
    /// A memfd; `sealable`: created with `MFD_ALLOW_SEALING`; `seals`: bits of
    /// SHRINK, GROW, WRITE, SEAL added before it is sent.
    Memfd {
        sealable: bool,
        seals: u8,
    },
    Pipe,
    Socket,
    DevNull,
    EventFd,
    Directory,
}

#[derive(Arbitrary, Debug)]
struct Buffer {
    kind: Kind,
    /// Its size at creation.
    created: u32,
    /// Bytes written at its start (the rest is sparse).
    written: u16,
    /// A size it is truncated to just before it is sent.
    resized: Option<u32>,
    /// What the registration claims.
    claimed: u32,
    /// Scales `created`, `resized` and `claimed` up to [`MAX_BYTES`].
    scale: u8,
}

#[derive(Arbitrary, Debug)]
struct Case {
    buffers: Vec<Buffer>,
    allow_hugetlb: bool,
}

fn scaled(value: u32, scale: u8) -> u64 {
    (u64::from(value) << (scale % 12)).min(MAX_BYTES)
}

fn make(buffer: &Buffer) -> Option<OwnedFd> {
    let fd = match buffer.kind {
        Kind::Memfd { sealable, seals } => {
            let flags = if sealable {
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
            } else {
                MemfdFlags::CLOEXEC
            };
            let fd = rustix::fs::memfd_create("fuzz", flags).ok()?;
            rustix::fs::ftruncate(&fd, scaled(buffer.created, buffer.scale)).ok()?;
            if buffer.written > 0 {
                let bytes = vec![0xa5u8; usize::from(buffer.written)];
                let _ = rustix::io::pwrite(&fd, &bytes, 0);
            }
            if let Some(size) = buffer.resized {
                let _ = rustix::fs::ftruncate(&fd, scaled(size, buffer.scale));
            }
            let mut add = SealFlags::empty();
            for (bit, seal) in [
                SealFlags::SHRINK,
                SealFlags::GROW,
                SealFlags::WRITE,
                SealFlags::SEAL,
            ]
            .into_iter()
            .enumerate()
            {
                if seals & (1 << bit) != 0 {
                    add |= seal;
                }
            }
            if !add.is_empty() {
                let _ = rustix::fs::fcntl_add_seals(&fd, add);
            }
            fd
        }
        Kind::Pipe => rustix::pipe::pipe().ok()?.0,
        Kind::Socket => {
            rustix::net::socketpair(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::STREAM,
                rustix::net::SocketFlags::CLOEXEC,
                None,
            )
            .ok()?
            .0
        }
        Kind::DevNull => std::fs::File::open("/dev/null").ok()?.into(),
        Kind::EventFd => rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).ok()?,
        Kind::Directory => std::fs::File::open("/").ok()?.into(),
    };
    Some(fd)
}

fuzz_target!(|case: Case| {
    let buffers: Vec<&Buffer> = case.buffers.iter().take(8).collect();
    let Some(ours) = buffers
        .iter()
        .map(|b| make(b))
        .collect::<Option<Vec<OwnedFd>>>()
    else {
        return;
    };
    // Through a real socket pair and the shell's connection, as a worker sends them.
    let (server_end, worker_end) = std::os::unix::net::UnixStream::pair().unwrap();
    server_end.set_nonblocking(true).unwrap();
    let stream = PeerSocket::Unix(mio::net::UnixStream::from_std(server_end));
    let mut connection = Connection::new(stream, Credentials::default(), 1 << 10, 1 << 20);
    let frame = kvwarden::protocol::encode_frame(b"register");
    let borrowed: Vec<_> = ours.iter().map(AsFd::as_fd).collect();
    let mut space =
        vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(borrowed.len()))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    if !borrowed.is_empty() {
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&borrowed)));
    }
    rustix::net::sendmsg(
        &worker_end,
        &[std::io::IoSlice::new(&frame)],
        &mut control,
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    while matches!(
        connection.read().unwrap(),
        SocketRead::Data | SocketRead::Drained
    ) {}
    let got = connection
        .next_frame(1 << 10, |_| ())
        .unwrap()
        .expect("the frame");
    assert_eq!(got.fds.len(), ours.len(), "every fd arrives with its frame");
    let claims: Vec<u64> = buffers.iter().map(|b| scaled(b.claimed, b.scale)).collect();
    let request = BuildRequest {
        buffers: got
            .fds
            .into_iter()
            .zip(&claims)
            .enumerate()
            .map(|(index, (fd, &nbytes))| {
                (
                    BufferSpec::Memfd {
                        fd_index: index as u64,
                        nbytes,
                    },
                    Some(fd),
                )
            })
            .collect(),
        model_name: "fuzz".into(),
        gpu: None,
        allow_hugetlb: case.allow_hugetlb,
    };
    let Ok(context) = build(request) else {
        return;
    };
    let pool = SharedMapping::map(kvwarden::memfd::create("pool", 4096).unwrap(), 4096).unwrap();
    for ((buffer, fd), (spec, &claimed)) in context
        .buffers
        .iter()
        .zip(&ours)
        .zip(buffers.iter().zip(&claims))
    {
        assert!(
            matches!(spec.kind, Kind::Memfd { .. }),
            "an fd of the wrong kind built: {spec:?}"
        );
        let seals = rustix::fs::fcntl_get_seals(fd).expect("a memfd");
        assert!(
            seals.contains(SealFlags::SHRINK),
            "built unsealed: {spec:?}"
        );
        let size = rustix::fs::fstat(fd).unwrap().st_size as u64;
        assert!(
            size >= claimed,
            "built over {size} bytes claiming {claimed}: {spec:?}"
        );
        assert!(
            rustix::fs::ftruncate(fd, 0).is_err() || size == 0,
            "its sender can still shrink it: {spec:?}"
        );
        assert_eq!(buffer.len(), claimed);
        if claimed > 0 {
            let RegisteredBuffer::Memfd(_) = buffer else {
                panic!("a memfd buffer")
            };
            assert!(buffer.copy_to_l1(claimed - 1, &pool, 0, 1), "{spec:?}");
        }
    }
});
