//! Anonymous shared memory: memfds (never a name in `/dev/shm`) and their shared
//! mappings, used by the server's L1 pool, its view of workers' buffers, and the client.

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::ffi::c_void;
use std::io;
use std::ptr::NonNull;

/// A `MAP_SHARED` read-write mapping of a whole memfd (or of its first `len` bytes).
/// Unmapped on drop: when the last user of a context lets go, the pages go with it.
#[derive(Debug)]
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access goes
// through the bounds-checked copy functions below, which take raw pointers and never
// hand out references, so sharing the handle across threads is sound.
unsafe impl Send for SharedMapping {}
// SAFETY: as above; concurrent copies of disjoint or racing ranges are byte copies of
// shared memory, which the peer may modify at any time anyway.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `fd` from offset 0. `len == 0` maps nothing.
    pub fn map(fd: impl AsFd, len: usize) -> io::Result<SharedMapping> {
        if len == 0 {
            return Ok(SharedMapping {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        // SAFETY: a fresh mapping at an address the kernel chooses (null hint), so no
        // existing memory is replaced; the caller checked that the file holds `len`
        // bytes and sealed it against shrinking, so no access within `len` faults.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedMapping { ptr, len })
    }

    /// Allocates every page of the mapping now (`MADV_POPULATE_WRITE`, Linux 5.14), so
    /// that no later write pays a page fault; on an older kernel, by writing each page's
    /// first byte back to it (which changes nothing).
    pub fn populate(&self) -> io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the range is exactly this mapping; populating changes no contents.
        let advised = unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().cast::<c_void>(),
                self.len,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
        if advised.is_ok() {
            return Ok(());
        }
        // Every 4 KiB touches every page of any size Linux uses.
        for offset in (0..self.len).step_by(4096) {
            let mut byte = [0u8];
            self.read(offset as u64, &mut byte);
            self.write(offset as u64, &byte);
        }
        Ok(())
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `[offset, offset + nbytes)` lies inside the mapping.
    pub fn contains(&self, offset: u64, nbytes: u64) -> bool {
        offset
            .checked_add(nbytes)
            .is_some_and(|end| end <= self.len as u64)
    }

    /// The address of `[offset, offset + nbytes)`, for a copy by a device (DMA) that
    /// cannot go through the functions below; None when out of bounds. The pointer is
    /// valid while `self` lives.
    pub fn range_ptr(&self, offset: u64, nbytes: u64) -> Option<*mut u8> {
        if !self.contains(offset, nbytes) {
            return None;
        }
        // SAFETY: `offset <= len` (checked above), so the result stays inside the mapping
        // or one past its end.
        Some(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }

    /// Copies `nbytes` from `[src_offset..)` of `src` to `[dst_offset..)` of `dst`.
    /// Returns false (copying nothing) when either range is out of bounds.
    pub fn copy(
        src: &SharedMapping,
        src_offset: u64,
        dst: &SharedMapping,
        dst_offset: u64,
        nbytes: u64,
    ) -> bool {
        if !src.contains(src_offset, nbytes) || !dst.contains(dst_offset, nbytes) {
            return false;
        }
        if nbytes == 0 {
            return true;
        }
        // Both offsets are below `len`, which fits a usize (checked by `contains`).
        let (src_offset, dst_offset, n) =
            (src_offset as usize, dst_offset as usize, nbytes as usize);
        // SAFETY: both ranges were checked to lie inside live mappings borrowed for the
        // duration of the call; `ptr::copy` tolerates overlap; the memory is shared
        // with the peer, which may write it concurrently: the copy then carries
        // whatever bytes it saw, which is the protocol's contract.
        unsafe {
            std::ptr::copy(
                src.ptr.as_ptr().add(src_offset),
                dst.ptr.as_ptr().add(dst_offset),
                n,
            );
        }
        true
    }

    /// Writes `bytes` at `offset`; false when out of bounds.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> bool {
        if !self.contains(offset, bytes.len() as u64) {
            return false;
        }
        // SAFETY: bounds checked above; the source is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                bytes.len(),
            );
        }
        true
    }

    /// Reads `out.len()` bytes at `offset`; false when out of bounds.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> bool {
        if !self.contains(offset, out.len() as u64) {
            return false;
        }
        // SAFETY: bounds checked above; the destination is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        true
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: `ptr`/`len` describe a mapping this value created and still owns;
        // nothing else can reach it once the last owner drops it.
        let result = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
        if let Err(error) = result {
            tracing::error!(%error, len = self.len, "munmap failed; the mapping leaks");
        }
    }
}

/// A new anonymous memfd of `len` bytes that allows sealing (the server seals the
/// memfds it maps against shrinking).
pub fn create(name: &str, len: u64) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    Ok(fd)
}

/// Why a peer's fd cannot serve as a memfd buffer.
#[derive(Debug, thiserror::Error)]
pub enum MemfdCheckError {
    /// Not a memfd (or not sealable).
    #[error(
        "fd is not a memfd that allows sealing ({0}); create buffers with \
         memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)"
    )]
    NotMemfd(io::Error),
    /// Smaller than the registration claims.
    #[error("memfd holds {actual} bytes but the registration claims {claimed} bytes")]
    TooSmall {
        /// fstat size.
        actual: u64,
        /// Claimed size.
        claimed: u64,
    },
    /// Could not be sealed against shrinking.
    #[error(
        "memfd cannot be sealed against shrinking ({0}); the server must be sure the \
         memory stays mapped while it copies; create it with MFD_ALLOW_SEALING and do \
         not add F_SEAL_SEAL"
    )]
    Unsealable(io::Error),
    /// fstat failed.
    #[error("fstat of the memfd failed: {0}")]
    Stat(io::Error),
}

/// Checks that `fd` is a memfd, seals it against shrinking, and only then checks that
/// it holds at least `claimed` bytes: from the seal on its size can only grow, so a
/// mapping of `claimed` bytes can never fault. (Checked the other way round, a peer
/// that shrinks its file between the size check and the seal leaves the server a
/// mapping past the file's end, and the first copy there is a SIGBUS: row 55.)
/// A file that was too small stays sealed; it is its sender's, who is told why.
pub fn check_and_seal(fd: impl AsFd, claimed: u64) -> Result<(), MemfdCheckError> {
    let fd = fd.as_fd();
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| MemfdCheckError::NotMemfd(e.into()))?;
    if !seals.contains(SealFlags::SHRINK) {
        rustix::fs::fcntl_add_seals(fd, SealFlags::SHRINK)
            .map_err(|e| MemfdCheckError::Unsealable(e.into()))?;
    }
    let stat = rustix::fs::fstat(fd).map_err(|e| MemfdCheckError::Stat(e.into()))?;
    let actual = u64::try_from(stat.st_size).unwrap_or(0);
    if actual < claimed {
        return Err(MemfdCheckError::TooSmall { actual, claimed });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked_and_too_small_memfds_are_refused() {
        let a = SharedMapping::map(create("a", 64).unwrap(), 64).unwrap();
        let b = SharedMapping::map(create("b", 64).unwrap(), 64).unwrap();
        assert!(a.write(0, b"hello"));
        assert!(SharedMapping::copy(&a, 0, &b, 10, 5));
        let mut out = [0u8; 5];
        assert!(b.read(10, &mut out));
        assert_eq!(&out, b"hello");
        assert!(!SharedMapping::copy(&a, 60, &b, 0, 5));
        assert!(!SharedMapping::copy(&a, u64::MAX, &b, 0, 2));
        let small = create("small", 10).unwrap();
        assert!(matches!(
            check_and_seal(&small, 11),
            Err(MemfdCheckError::TooSmall {
                actual: 10,
                claimed: 11
            })
        ));
        check_and_seal(&small, 10).unwrap();
        assert!(
            rustix::fs::ftruncate(&small, 1).is_err(),
            "sealed against shrinking"
        );
    }
}
