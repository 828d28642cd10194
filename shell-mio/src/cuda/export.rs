//! The worker's side of CUDA IPC, and the copy benchmark's baseline: device memory
//! allocated and exported (`kvwarden worker --cuda-bytes`), and page-locked host memory.

use super::{
    Context, CudaError, Gpu, IPC_HANDLE_BYTES, failed, map_vmm, vmm_granularity, vmm_properties,
};
use crate::client::ClientBuffer;
use cudarc::driver::{result, sys};
use rustix::fd::{FromRawFd, OwnedFd};
use std::ffi::c_void;

/// How a worker's device memory is allocated and shared (`--cuda-allocator`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CudaAllocator {
    /// cuMemAlloc, shared by its CUDA IPC handle (`cuda_ipc`).
    Malloc,
    /// cuMemCreate, as PyTorch's expandable segments and vLLM's sleep mode allocate,
    /// shared by a POSIX fd (`cuda_vmm`).
    Vmm,
}

impl CudaAllocator {
    /// The flag's value.
    pub fn label(self) -> &'static str {
        match self {
            CudaAllocator::Malloc => "malloc",
            CudaAllocator::Vmm => "vmm",
        }
    }
}

/// A worker's device allocation exported for IPC (`kvwarden worker --cuda-bytes`).
#[derive(Debug)]
pub struct ExportedBuffer {
    context: Context,
    ptr: sys::CUdeviceptr,
    nbytes: usize,
    export: Export,
}

/// How an [`ExportedBuffer`] was allocated and is shared.
#[derive(Debug)]
enum Export {
    /// `cuMemAlloc`, shared by its `cuIpcGetMemHandle` handle.
    Ipc([u8; IPC_HANDLE_BYTES]),
    /// `cuMemCreate` mapped at `ptr`, shared by the POSIX fd of
    /// `cuMemExportToShareableHandle`.
    Vmm {
        handle: sys::CUmemGenericAllocationHandle,
        allocation_bytes: usize,
        fd: std::sync::Arc<OwnedFd>,
    },
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
        // SAFETY: plain device allocation; the memory is initialised right below.
        let ptr = unsafe { result::malloc_sync(nbytes) }.map_err(failed(device, "cuMemAlloc"))?;
        let mut handle = [0; IPC_HANDLE_BYTES];
        // SAFETY: `ptr` points to `nbytes` bytes allocated above.
        unsafe { sys::cuMemsetD8_v2(ptr, fill, nbytes) }
            .result()
            .map_err(failed(device, "cuMemsetD8"))?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `raw` is a valid out-pointer; `ptr` is the base of an allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut raw, ptr) }
            .result()
            .map_err(failed(device, "cuIpcGetMemHandle"))?;
        for (dst, &src) in handle.iter_mut().zip(raw.reserved.iter()) {
            *dst = src as u8;
        }
        Ok(ExportedBuffer {
            context,
            ptr,
            nbytes,
            export: Export::Ipc(handle),
        })
    }

    /// Allocates `nbytes` with `allocator`'s call, fills it with `fill`, and exports it.
    pub fn allocate_with(
        allocator: CudaAllocator,
        gpu: &Gpu,
        device: u32,
        nbytes: usize,
        fill: u8,
    ) -> Result<ExportedBuffer, CudaError> {
        match allocator {
            CudaAllocator::Malloc => ExportedBuffer::allocate(gpu, device, nbytes, fill),
            CudaAllocator::Vmm => ExportedBuffer::allocate_vmm(gpu, device, nbytes, fill),
        }
    }

    /// Allocates `nbytes` (rounded up to the device's granularity) with `cuMemCreate`,
    /// as PyTorch's expandable segments and vLLM's sleep-mode pool do, maps it, fills it
    /// with `fill`, and exports it as a POSIX fd (`cuMemExportToShareableHandle`).
    pub fn allocate_vmm(
        gpu: &Gpu,
        device: u32,
        nbytes: usize,
        fill: u8,
    ) -> Result<ExportedBuffer, CudaError> {
        let context = gpu.context(device)?;
        context.make_current()?;
        let granularity = vmm_granularity(device)?;
        let allocation_bytes = nbytes.max(1).div_ceil(granularity) * granularity;
        let prop = vmm_properties(device);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid pointers; a size that is a multiple of the granularity.
        unsafe { sys::cuMemCreate(&mut handle, allocation_bytes, &prop, 0) }
            .result()
            .map_err(failed(device, "cuMemCreate"))?;
        let release = |error: CudaError| {
            // SAFETY: `handle` came from cuMemCreate and is released once, here.
            let _ = unsafe { sys::cuMemRelease(handle) };
            error
        };
        let mut raw_fd: std::ffi::c_int = -1;
        // SAFETY: for the POSIX fd type the driver writes an int to the pointer.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut raw_fd as *mut std::ffi::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(|error| release(failed(device, "cuMemExportToShareableHandle")(error)))?;
        // SAFETY: the driver just created this fd for the caller, who owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
        let ptr = map_vmm(context, handle, allocation_bytes).map_err(release)?;
        let buffer = ExportedBuffer {
            context,
            ptr,
            nbytes,
            export: Export::Vmm {
                handle,
                allocation_bytes,
                fd: std::sync::Arc::new(fd),
            },
        };
        buffer.fill(fill)?;
        Ok(buffer)
    }

    /// The whole buffer as `register_kv_cache` takes it: a `cuda_ipc` handle of a
    /// `cuMemAlloc` allocation, or a `cuda_vmm` fd of a `cuMemCreate` one.
    pub fn client_buffer(&self) -> ClientBuffer {
        let device = self.context.device;
        let nbytes = self.nbytes as u64;
        match &self.export {
            Export::Ipc(handle) => ClientBuffer::CudaIpc {
                device,
                handle: *handle,
                offset: 0,
                nbytes,
            },
            Export::Vmm {
                fd,
                allocation_bytes,
                ..
            } => ClientBuffer::CudaVmm {
                fd: fd.clone(),
                device,
                allocation_bytes: *allocation_bytes as u64,
                offset: 0,
                nbytes,
            },
        }
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
        .map_err(failed(self.context.device, "cuMemcpyDtoH"))
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
            .map_err(failed(self.context.device, "cuMemcpyHtoD"))
    }

    /// Sets every byte of the buffer to `byte`.
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.context.make_current()?;
        // SAFETY: `ptr` points to at least `nbytes` bytes allocated by `allocate` or
        // mapped by `allocate_vmm`.
        unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.nbytes) }
            .result()
            .map_err(failed(self.context.device, "cuMemsetD8"))
    }
}

impl Drop for ExportedBuffer {
    fn drop(&mut self) {
        if self.context.make_current().is_err() {
            return;
        }
        match &self.export {
            // SAFETY: `ptr` came from cuMemAlloc and is freed only here.
            Export::Ipc(_) => drop(unsafe { result::free_sync(self.ptr) }),
            Export::Vmm {
                handle,
                allocation_bytes,
                ..
            } => {
                // SAFETY: `ptr..ptr + allocation_bytes` was reserved and mapped by
                // allocate_vmm and `handle` created there; each is undone once, here.
                unsafe {
                    let _ = sys::cuMemUnmap(self.ptr, *allocation_bytes);
                    let _ = sys::cuMemAddressFree(self.ptr, *allocation_bytes);
                    let _ = sys::cuMemRelease(*handle);
                }
            }
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
            .map_err(failed(device, "cuMemHostAlloc"))?;
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
            .map_err(failed(self.context.device, "cuMemcpyDtoH"))
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
        .map_err(failed(self.context.device, "cuMemcpyHtoD"))
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
