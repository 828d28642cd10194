//! The worker's side of CUDA IPC, and the copy benchmark's baseline: device memory
//! allocated and exported (`kvwarden worker --cuda-bytes`), and page-locked host memory.

use super::{Context, CudaError, Gpu, IPC_HANDLE_BYTES};
use cudarc::driver::{result, sys};
use std::ffi::c_void;

/// A worker's device allocation exported for IPC (`kvwarden worker --cuda-bytes`).
#[derive(Debug)]
pub struct ExportedBuffer {
    context: Context,
    ptr: sys::CUdeviceptr,
    nbytes: usize,
    handle: [u8; IPC_HANDLE_BYTES],
}

impl ExportedBuffer {
    /// Allocates `nbytes` with `cuMemAlloc` (stream-ordered pool memory cannot be
    /// exported), fills it with `fill`, and exports its handle.
    pub fn allocate(
        gpu: &Gpu,
        device: u32,
        nbytes: usize,
        fill: u8,
    ) -> Result<ExportedBuffer, CudaError> {
        let context = gpu.context(device)?;
        context.make_current()?;
        let driver = |call| {
            move |error| CudaError::Driver {
                call,
                device,
                error,
            }
        };
        // SAFETY: plain device allocation; the memory is initialised right below.
        let ptr = unsafe { result::malloc_sync(nbytes) }.map_err(driver("cuMemAlloc"))?;
        let mut buffer = ExportedBuffer {
            context,
            ptr,
            nbytes,
            handle: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `ptr` points to `nbytes` bytes allocated above.
        unsafe { sys::cuMemsetD8_v2(ptr, fill, nbytes) }
            .result()
            .map_err(driver("cuMemsetD8"))?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `raw` is a valid out-pointer; `ptr` is the base of an allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut raw, ptr) }
            .result()
            .map_err(driver("cuIpcGetMemHandle"))?;
        for (dst, &src) in buffer.handle.iter_mut().zip(raw.reserved.iter()) {
            *dst = src as u8;
        }
        Ok(buffer)
    }

    /// The 64-byte IPC handle to send in `register_kv_cache`.
    pub fn handle(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.handle
    }

    /// The allocation's size.
    pub fn len(&self) -> usize {
        self.nbytes
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.nbytes == 0
    }

    /// Device → host copy from the worker's own allocation (to verify round trips).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.nbytes)
        {
            return Err(CudaError::OutOfRange {
                offset: offset as u64,
                nbytes: dst.len() as u64,
                size: self.nbytes as u64,
            });
        }
        self.context.make_current()?;
        // SAFETY: the range is inside the allocation (checked above).
        unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len())
        }
        .result()
        .map_err(|error| CudaError::Driver {
            call: "cuMemcpyDtoH",
            device: self.context.device,
            error,
        })
    }
}

impl ExportedBuffer {
    /// Host → device copy into the worker's own allocation (to set up round trips).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        self.context.make_current()?;
        // SAFETY: the range is inside the allocation (checked above).
        unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len()) }
            .result()
            .map_err(|error| CudaError::Driver {
                call: "cuMemcpyHtoD",
                device: self.context.device,
                error,
            })
    }

    /// Sets every byte of the allocation to `byte`.
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.context.make_current()?;
        // SAFETY: `ptr` points to `nbytes` bytes allocated by `allocate`.
        unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.nbytes) }
            .result()
            .map_err(|error| CudaError::Driver {
                call: "cuMemsetD8",
                device: self.context.device,
                error,
            })
    }
}

impl Drop for ExportedBuffer {
    fn drop(&mut self) {
        if self.context.make_current().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): the baseline of the copy benchmark (G2).
#[derive(Debug)]
pub struct PinnedHost {
    context: Context,
    ptr: *mut u8,
    nbytes: usize,
}

// SAFETY: the allocation is owned by this value and only reached through `&mut self`
// or `&self` copies bounded by `nbytes`.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    /// Allocates `nbytes` of page-locked host memory for `device`.
    pub fn allocate(gpu: &Gpu, device: u32, nbytes: usize) -> Result<PinnedHost, CudaError> {
        let context = gpu.context(device)?;
        context.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags 0 = plain page-locked memory.
        unsafe { sys::cuMemHostAlloc(&mut ptr, nbytes.max(1), 0) }
            .result()
            .map_err(|error| CudaError::Driver {
                call: "cuMemHostAlloc",
                device,
                error,
            })?;
        Ok(PinnedHost {
            context,
            ptr: ptr.cast(),
            nbytes,
        })
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.nbytes
    }

    /// Whether nothing is allocated.
    pub fn is_empty(&self) -> bool {
        self.nbytes == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.context.make_current().is_ok() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed only here.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

impl ExportedBuffer {
    /// Device → pinned host copy of `nbytes` at `offset` (the G2 baseline).
    pub fn copy_to_pinned(
        &self,
        offset: usize,
        host: &mut PinnedHost,
        nbytes: usize,
    ) -> Result<(), CudaError> {
        self.check(offset, nbytes)?;
        if nbytes > host.nbytes {
            return Err(CudaError::OutOfRange {
                offset: 0,
                nbytes: nbytes as u64,
                size: host.nbytes as u64,
            });
        }
        self.context.make_current()?;
        // SAFETY: both ranges were checked; `host` is exclusively borrowed.
        unsafe { sys::cuMemcpyDtoH_v2(host.ptr.cast(), self.ptr + offset as u64, nbytes) }
            .result()
            .map_err(|error| CudaError::Driver {
                call: "cuMemcpyDtoH",
                device: self.context.device,
                error,
            })
    }

    /// Pinned host → device copy of `nbytes` to `offset` (the G2 baseline).
    pub fn copy_from_pinned(
        &self,
        offset: usize,
        host: &PinnedHost,
        nbytes: usize,
    ) -> Result<(), CudaError> {
        self.check(offset, nbytes)?;
        if nbytes > host.nbytes {
            return Err(CudaError::OutOfRange {
                offset: 0,
                nbytes: nbytes as u64,
                size: host.nbytes as u64,
            });
        }
        self.context.make_current()?;
        // SAFETY: both ranges were checked; `host` stays allocated for the call.
        unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                host.ptr.cast_const().cast(),
                nbytes,
            )
        }
        .result()
        .map_err(|error| CudaError::Driver {
            call: "cuMemcpyHtoD",
            device: self.context.device,
            error,
        })
    }

    fn check(&self, offset: usize, nbytes: usize) -> Result<(), CudaError> {
        if offset
            .checked_add(nbytes)
            .is_none_or(|end| end > self.nbytes)
        {
            return Err(CudaError::OutOfRange {
                offset: offset as u64,
                nbytes: nbytes as u64,
                size: self.nbytes as u64,
            });
        }
        Ok(())
    }
}
