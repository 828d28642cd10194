//! CUDA IPC through the driver API (cudarc, loaded at run time).
//!
//! On a GPU node the state that leaks is a CUDA IPC mapping of a worker's KV cache: the
//! mapping alone keeps a dead exporter's device memory allocated. This module opens and
//! closes such mappings and copies between them and host memory; the server owns one
//! [`Gpu`] created at start (the first use of a primary context costs ~150 ms, which must
//! never land on a worker's REGISTER).
//!
//! Without libcuda, or without a device, nothing here panics: [`Gpu::probe`] says why it
//! is unavailable, and the caller answers `unavailable`.

use cudarc::driver::{result, sys};
use rustix::fd::{AsRawFd, BorrowedFd};
use std::ffi::c_void;
use thiserror::Error;

/// Bytes in a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Why CUDA work could not be done.
#[derive(Debug, Error)]
pub enum CudaError {
    /// No usable driver or device on this host.
    #[error("CUDA is unavailable on this host: {0}")]
    Unavailable(String),
    /// The request names a device this host does not have.
    #[error("no CUDA device {device}: this host has {count} device(s) (0..{count})")]
    NoSuchDevice {
        /// The device asked for.
        device: u32,
        /// How many there are.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed on device {device}: {error}")]
    Driver {
        /// The driver entry point.
        call: &'static str,
        /// The device it ran against.
        device: u32,
        /// The driver's error.
        error: result::DriverError,
    },
    /// A VMM allocation's size the device cannot have made.
    #[error(
        "allocation_bytes {allocation_bytes} is not a multiple of the device's allocation \
         granularity ({granularity} bytes); send the size cuMemCreate was given"
    )]
    Granularity {
        /// The size sent.
        allocation_bytes: u64,
        /// The device's minimum granularity.
        granularity: u64,
    },
    /// A copy outside the mapping.
    #[error("copy of {nbytes} bytes at offset {offset} is outside the {size}-byte CUDA buffer")]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        nbytes: u64,
        /// The buffer's size.
        size: u64,
    },
}

/// The error of driver call `call` on `device`, for `map_err`.
fn failed(device: u32, call: &'static str) -> impl FnOnce(result::DriverError) -> CudaError {
    move |error| CudaError::Driver {
        call,
        device,
        error,
    }
}

/// A primary context, usable from any thread once made current there.
#[derive(Copy, Clone, Debug)]
struct Context {
    raw: sys::CUcontext,
    device: u32,
}

// SAFETY: a CUDA context handle is an opaque token that the driver allows any host thread
// to make current; kvwarden never dereferences it.
unsafe impl Send for Context {}
// SAFETY: as above; the driver serialises work on a context internally.
unsafe impl Sync for Context {}

/// The calling thread's copy stream on each device it copied on: non-blocking streams,
/// so that the copies of different pool threads overlap on the device's copy engines
/// instead of queueing behind each other on the legacy default stream (where one
/// thread's 32 KiB copies each waited for every other thread's). Destroyed with the
/// thread.
struct ThreadStreams(Vec<(u32, sys::CUstream)>);

impl Drop for ThreadStreams {
    fn drop(&mut self) {
        for (_, stream) in self.0.drain(..) {
            // SAFETY: created by cuStreamCreate on this thread and destroyed once, here.
            let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
        }
    }
}

thread_local! {
    static STREAMS: std::cell::RefCell<ThreadStreams> =
        const { std::cell::RefCell::new(ThreadStreams(Vec::new())) };
}

impl Context {
    /// This thread's copy stream on the context's device, made on first use (the
    /// context must be current).
    fn stream(self) -> Result<sys::CUstream, CudaError> {
        STREAMS.with(|streams| {
            let mut streams = streams.borrow_mut();
            if let Some(&(_, stream)) = streams.0.iter().find(|(device, _)| *device == self.device)
            {
                return Ok(stream);
            }
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; the flag is the documented non-blocking one.
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            }
            .result()
            .map_err(failed(self.device, "cuStreamCreate"))?;
            streams.0.push((self.device, stream));
            Ok(stream)
        })
    }

    /// Waits for everything queued on `stream`.
    fn synchronize(self, stream: sys::CUstream) -> Result<(), CudaError> {
        // SAFETY: `stream` came from Context::stream on this thread.
        unsafe { sys::cuStreamSynchronize(stream) }
            .result()
            .map_err(failed(self.device, "cuStreamSynchronize"))
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    fn make_current(self) -> Result<(), CudaError> {
        // SAFETY: `raw` came from cuDevicePrimaryCtxRetain and is never released while
        // the process runs.
        unsafe { result::ctx::set_current(self.raw) }
            .map_err(failed(self.device, "cuCtxSetCurrent"))
    }
}

/// The GPUs of this host, each with its primary context retained for the process's life.
#[derive(Debug)]
pub struct Gpu {
    /// One per device ordinal; None for a device this process did not open.
    contexts: Vec<Option<Context>>,
}

/// Free and total memory of one device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device ordinal.
    pub device: u32,
    /// Free bytes (`cuMemGetInfo`).
    pub free_bytes: u64,
    /// Total bytes.
    pub total_bytes: u64,
}

impl Gpu {
    /// Loads libcuda, initialises the driver and retains every device's primary context.
    /// Err tells why there is no GPU here; it is never a panic.
    pub fn probe() -> Result<Gpu, CudaError> {
        Self::probe_devices(None)
    }

    /// As [`Gpu::probe`], retaining only `device`'s context: a worker touches one GPU,
    /// and every retained context costs device memory.
    pub fn probe_device(device: u32) -> Result<Gpu, CudaError> {
        Self::probe_devices(Some(device))
    }

    fn probe_devices(only: Option<u32>) -> Result<Gpu, CudaError> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "the NVIDIA driver library (libcuda.so) could not be loaded: no NVIDIA driver on this host".into(),
            ));
        }
        result::init().map_err(|error| {
            CudaError::Unavailable(format!("cuInit failed: {error} (no usable NVIDIA GPU)"))
        })?;
        let count = result::device::get_count()
            .map_err(|error| CudaError::Unavailable(format!("cuDeviceGetCount failed: {error}")))?;
        if count <= 0 {
            return Err(CudaError::Unavailable(
                "the driver reports no CUDA device".into(),
            ));
        }
        if let Some(device) = only.filter(|&d| i64::from(d) >= i64::from(count)) {
            return Err(CudaError::NoSuchDevice {
                device,
                count: count as usize,
            });
        }
        let mut contexts = Vec::new();
        for ordinal in 0..count {
            let device = ordinal as u32;
            if only.is_some_and(|d| d != device) {
                contexts.push(None);
                continue;
            }
            let handle = result::device::get(ordinal).map_err(failed(device, "cuDeviceGet"))?;
            // SAFETY: `handle` came from cuDeviceGet.
            let raw = unsafe { result::primary_ctx::retain(handle) }
                .map_err(failed(device, "cuDevicePrimaryCtxRetain"))?;
            contexts.push(Some(Context { raw, device }));
        }
        Ok(Gpu { contexts })
    }

    /// How many devices there are.
    pub fn device_count(&self) -> usize {
        self.contexts.len()
    }

    fn context(&self, device: u32) -> Result<Context, CudaError> {
        self.contexts
            .get(device as usize)
            .copied()
            .flatten()
            .ok_or(CudaError::NoSuchDevice {
                device,
                count: self.contexts.len(),
            })
    }

    /// Free and total memory of every device this process opened.
    pub fn memory(&self) -> Result<Vec<DeviceMemory>, CudaError> {
        self.contexts
            .iter()
            .flatten()
            .map(|context| {
                context.make_current()?;
                let (free, total) =
                    result::mem_get_info().map_err(failed(context.device, "cuMemGetInfo"))?;
                Ok(DeviceMemory {
                    device: context.device,
                    free_bytes: free as u64,
                    total_bytes: total as u64,
                })
            })
            .collect()
    }

    /// Opens a worker's exported allocation (`cuIpcOpenMemHandle`, lazy peer access).
    /// The mapping stays open — and the exporter's memory allocated, even after the
    /// exporter died — until [`DeviceMapping::close`] or drop.
    pub fn open_ipc(
        &self,
        device: u32,
        handle: &[u8; IPC_HANDLE_BYTES],
        offset: u64,
        nbytes: u64,
    ) -> Result<DeviceMapping, CudaError> {
        let context = self.context(device)?;
        context.make_current()?;
        let mut raw_handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (dst, &src) in raw_handle.reserved.iter_mut().zip(handle) {
            *dst = src as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; the handle is plain bytes the driver
        // validates; the flag is the documented one for IPC opens.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                raw_handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(failed(device, "cuIpcOpenMemHandle"))?;
        let mapping = DeviceMapping {
            context,
            base,
            offset,
            nbytes,
            kind: MappingKind::Ipc,
            open: true,
        };
        // The handle names a whole allocation; the window must lie inside it.
        let mut range_base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: valid out-pointers; `base` is a live device address of this context.
        unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut size, base) }
            .result()
            .map_err(|error| mapping.driver("cuMemGetAddressRange", error))?;
        let available = (size as u64).saturating_sub(base - range_base);
        if offset.checked_add(nbytes).is_none_or(|end| end > available) {
            // Dropping `mapping` closes it.
            return Err(CudaError::OutOfRange {
                offset,
                nbytes,
                size: available,
            });
        }
        Ok(mapping)
    }

    /// Imports and maps a worker's CUDA virtual-memory allocation from the POSIX fd
    /// `cuMemExportToShareableHandle` gave (`cuMemImportFromShareableHandle`, then
    /// `cuMemAddressReserve`, `cuMemMap` of all `allocation_bytes` and `cuMemSetAccess`).
    /// The imported handle is released at once: the mapping alone keeps the memory,
    /// also after the exporter died, until [`DeviceMapping::close`] or drop unmaps it.
    /// The fd stays the caller's.
    pub fn import_vmm(
        &self,
        device: u32,
        fd: BorrowedFd<'_>,
        window: VmmWindow,
    ) -> Result<DeviceMapping, CudaError> {
        let VmmWindow {
            allocation_bytes,
            offset,
            nbytes,
        } = window;
        if offset
            .checked_add(nbytes)
            .is_none_or(|end| end > allocation_bytes)
        {
            return Err(CudaError::OutOfRange {
                offset,
                nbytes,
                size: allocation_bytes,
            });
        }
        let context = self.context(device)?;
        context.make_current()?;
        let size = usize::try_from(allocation_bytes).map_err(|_| CudaError::OutOfRange {
            offset,
            nbytes,
            size: allocation_bytes,
        })?;
        let granularity = vmm_granularity(device)?;
        if size == 0 || size % granularity != 0 {
            return Err(CudaError::Granularity {
                allocation_bytes,
                granularity: granularity as u64,
            });
        }
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        // SAFETY: `handle` is a valid out-pointer; for the POSIX fd type the driver reads
        // the fd's number from the pointer's value and does not take the fd.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                os_handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(failed(device, "cuMemImportFromShareableHandle"))?;
        let mapped = map_vmm(context, handle, size);
        // SAFETY: `handle` came from the import above and is released once; a mapping
        // made from it keeps the memory.
        let released = unsafe { sys::cuMemRelease(handle) }.result();
        let base = mapped?;
        let mapping = DeviceMapping {
            context,
            base,
            offset,
            nbytes,
            kind: MappingKind::Vmm { size },
            open: true,
        };
        released.map_err(|error| mapping.driver("cuMemRelease", error))?;
        Ok(mapping)
    }

    /// Page-locks host memory for DMA (`cuMemHostRegister`, portable across every
    /// context), e.g. the L1 pool.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the process exits (it is never unregistered).
    pub unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<(), CudaError> {
        let context = self
            .contexts
            .iter()
            .flatten()
            .next()
            .copied()
            .ok_or(CudaError::Unavailable("no device context is open".into()))?;
        context.make_current()?;
        // SAFETY: the caller guarantees the range is mapped for the process's life.
        unsafe {
            sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), len, 0x1 /* PORTABLE */)
        }
        .result()
        .map_err(failed(context.device, "cuMemHostRegister"))
    }
}

/// The window of a CUDA VMM allocation a worker registers.
#[derive(Copy, Clone, Debug)]
pub struct VmmWindow {
    /// The allocation's size, as `cuMemCreate` made it (all of it is mapped).
    pub allocation_bytes: u64,
    /// Where the window starts in the allocation.
    pub offset: u64,
    /// The window's length.
    pub nbytes: u64,
}

/// A pinned device allocation's properties on `device`, as VMM calls take them.
fn vmm_properties(device: u32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and a pointer, for which all zero is valid.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = device_location(device);
    prop
}

fn device_location(device: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as i32,
    }
}

/// The size every VMM allocation and mapping on `device` is a multiple of.
fn vmm_granularity(device: u32) -> Result<usize, CudaError> {
    let prop = vmm_properties(device);
    let mut granularity = 0usize;
    // SAFETY: valid pointers to a local and a properties struct.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .map_err(failed(device, "cuMemGetAllocationGranularity"))?;
    Ok(granularity.max(1))
}

/// Reserves `size` bytes of device addresses, maps `handle` there and lets this
/// context read and write it; undone in reverse order on failure.
fn map_vmm(
    context: Context,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
) -> Result<sys::CUdeviceptr, CudaError> {
    let device = context.device;
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; no fixed address, default alignment.
    unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) }
        .result()
        .map_err(failed(device, "cuMemAddressReserve"))?;
    // SAFETY: `base..base + size` was reserved above; `handle` is a live import.
    let mapped = unsafe { sys::cuMemMap(base, size, 0, handle, 0) }
        .result()
        .map_err(failed(device, "cuMemMap"));
    let access = sys::CUmemAccessDesc {
        location: device_location(device),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let result = mapped.and_then(|()| {
        // SAFETY: the range is mapped; one access descriptor.
        unsafe { sys::cuMemSetAccess(base, size, &access, 1) }
            .result()
            .map_err(failed(device, "cuMemSetAccess"))
            .inspect_err(|_| {
                // SAFETY: mapped just above, unmapped once.
                let _ = unsafe { sys::cuMemUnmap(base, size) };
            })
    });
    if result.is_err() {
        // SAFETY: reserved above, freed once.
        let _ = unsafe { sys::cuMemAddressFree(base, size) };
    }
    result.map(|()| base)
}

/// An open mapping of `[offset, offset + nbytes)` of a worker's device allocation: a
/// CUDA IPC open, or a VMM import.
#[derive(Debug)]
pub struct DeviceMapping {
    context: Context,
    base: sys::CUdeviceptr,
    offset: u64,
    nbytes: u64,
    kind: MappingKind,
    open: bool,
}

/// How a [`DeviceMapping`] was made, and so how it is undone.
#[derive(Copy, Clone, Debug)]
enum MappingKind {
    /// `cuIpcOpenMemHandle`: closed with `cuIpcCloseMemHandle`.
    Ipc,
    /// `cuMemMap` of `size` bytes at `base`: unmapped and the addresses freed.
    Vmm { size: usize },
}

impl DeviceMapping {
    /// The mapped window's size in bytes.
    pub fn len(&self) -> u64 {
        self.nbytes
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.nbytes == 0
    }

    fn device_address(&self, offset: u64, nbytes: usize) -> Result<sys::CUdeviceptr, CudaError> {
        let end = offset.checked_add(nbytes as u64);
        if end.is_none_or(|end| end > self.nbytes) {
            return Err(CudaError::OutOfRange {
                offset,
                nbytes: nbytes as u64,
                size: self.nbytes,
            });
        }
        Ok(self.base + self.offset + offset)
    }

    /// Device → host of `nbytes` at `offset` of the window into `dst`: on this thread's
    /// copy stream (`cuMemcpyDtoHAsync`), waited for before it returns.
    ///
    /// # Safety
    /// `dst..dst + nbytes` must be writable host memory that nothing else writes during
    /// the call (an L1 slot reserved for this copy).
    pub unsafe fn copy_to_host(
        &self,
        offset: u64,
        dst: *mut u8,
        nbytes: usize,
    ) -> Result<(), CudaError> {
        let src = self.device_address(offset, nbytes)?;
        self.context.make_current()?;
        let stream = self.context.stream()?;
        // SAFETY: the source range is inside the open mapping (checked above); the
        // caller guarantees the destination until this returns, after the copy is done.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, nbytes, stream) }
            .result()
            .map_err(|error| self.driver("cuMemcpyDtoHAsync", error))?;
        self.context.synchronize(stream)
    }

    /// Host → device of `nbytes` from `src` to `offset` of the window: on this thread's
    /// copy stream (`cuMemcpyHtoDAsync`), waited for before it returns.
    ///
    /// # Safety
    /// `src..src + nbytes` must be readable host memory for the whole call.
    pub unsafe fn copy_from_host(
        &self,
        offset: u64,
        src: *const u8,
        nbytes: usize,
    ) -> Result<(), CudaError> {
        let dst = self.device_address(offset, nbytes)?;
        self.context.make_current()?;
        let stream = self.context.stream()?;
        // SAFETY: the destination range is inside the open mapping (checked above); the
        // caller guarantees the source until this returns, after the copy is done.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), nbytes, stream) }
            .result()
            .map_err(|error| self.driver("cuMemcpyHtoDAsync", error))?;
        self.context.synchronize(stream)
    }

    /// Closes the mapping (`cuIpcCloseMemHandle`, or `cuMemUnmap` and
    /// `cuMemAddressFree`): exactly once, so the exporter's memory can go back to the
    /// device.
    pub fn close(mut self) -> Result<(), CudaError> {
        self.close_once()
    }

    fn close_once(&mut self) -> Result<(), CudaError> {
        if !std::mem::take(&mut self.open) {
            return Ok(());
        }
        self.context.make_current()?;
        match self.kind {
            // SAFETY: `base` was returned by cuIpcOpenMemHandle and, `open` being true
            // until now, has not been closed.
            MappingKind::Ipc => unsafe { sys::cuIpcCloseMemHandle(self.base) }
                .result()
                .map_err(|error| self.driver("cuIpcCloseMemHandle", error)),
            MappingKind::Vmm { size } => {
                // SAFETY: `base..base + size` was reserved and mapped by import_vmm and,
                // `open` being true until now, not unmapped; the addresses are freed
                // after the unmap, whether or not it succeeded.
                let unmapped = unsafe { sys::cuMemUnmap(self.base, size) }.result();
                // SAFETY: as above.
                let freed = unsafe { sys::cuMemAddressFree(self.base, size) }.result();
                unmapped
                    .map_err(|error| self.driver("cuMemUnmap", error))
                    .and(freed.map_err(|error| self.driver("cuMemAddressFree", error)))
            }
        }
    }

    fn driver(&self, call: &'static str, error: result::DriverError) -> CudaError {
        failed(self.context.device, call)(error)
    }
}

impl Drop for DeviceMapping {
    fn drop(&mut self) {
        if let Err(error) = self.close_once() {
            tracing::error!(%error, "closing a CUDA mapping failed");
        }
    }
}

mod export;

pub use export::{CudaAllocator, ExportedBuffer, PinnedHost};
