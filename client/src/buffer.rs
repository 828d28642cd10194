//! The buffers a worker registers: host memfds mapped here, or windows of CUDA
//! allocations (IPC handles, or VMM exports).

use crate::memfd::{self, SharedMapping};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::ClientError;

/// A host buffer the worker shares with the server: an anonymous memfd, mapped here.
#[derive(Debug)]
pub struct MemfdBuffer {
    pub(crate) fd: OwnedFd,
    pub(crate) mapping: SharedMapping,
}

impl MemfdBuffer {
    /// A zero-filled buffer of `nbytes`.
    pub fn new(nbytes: usize) -> Result<MemfdBuffer, ClientError> {
        let local = |e: std::io::Error| {
            ClientError::Local(format!("creating a memfd buffer of {nbytes} bytes: {e}"))
        };
        let fd = memfd::create("kvwarden-worker-buffer", nbytes as u64).map_err(local)?;
        let mapping = SharedMapping::map(&fd, nbytes).map_err(local)?;
        Ok(MemfdBuffer { fd, mapping })
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }

    /// Writes `bytes` at `offset`; false when out of bounds.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> bool {
        self.mapping.write(offset, bytes)
    }

    /// Reads into `out` from `offset`; false when out of bounds.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> bool {
        self.mapping.read(offset, out)
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A buffer a worker registers for server-driven transfers.
#[derive(Clone, Debug)]
pub enum ClientBuffer {
    /// Host memory shared as a memfd (Unix socket only).
    Memfd(Arc<MemfdBuffer>),
    /// A window of a device allocation, named by its `cuIpcGetMemHandle` handle.
    CudaIpc {
        /// The device ordinal.
        device: u32,
        /// The IPC handle of the allocation's base.
        handle: [u8; 64],
        /// Where the window starts in the allocation.
        offset: u64,
        /// The window's length.
        nbytes: u64,
    },
    /// A window of a CUDA virtual-memory allocation (`cuMemCreate`), sent as the POSIX
    /// fd `cuMemExportToShareableHandle` gave (Unix socket only).
    CudaVmm {
        /// The exported fd; it must stay open while the buffer may be re-registered.
        fd: Arc<OwnedFd>,
        /// The device ordinal.
        device: u32,
        /// The allocation's size, as `cuMemCreate` made it.
        allocation_bytes: u64,
        /// Where the window starts in the allocation.
        offset: u64,
        /// The window's length.
        nbytes: u64,
    },
}
