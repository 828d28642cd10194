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

impl Context {
    /// Makes the context current on the calling thread (cheap when it already is).
    fn make_current(self) -> Result<(), CudaError> {
        // SAFETY: `raw` came from cuDevicePrimaryCtxRetain and is never released while
        // the process runs.
        unsafe { result::ctx::set_current(self.raw) }.map_err(|error| CudaError::Driver {
            call: "cuCtxSetCurrent",
            device: self.device,
            error,
        })
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
            let driver = |call| {
                move |error| CudaError::Driver {
                    call,
                    device,
                    error,
                }
            };
            let handle = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
            // SAFETY: `handle` came from cuDeviceGet.
            let raw = unsafe { result::primary_ctx::retain(handle) }
                .map_err(driver("cuDevicePrimaryCtxRetain"))?;
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
                let (free, total) = result::mem_get_info().map_err(|error| CudaError::Driver {
                    call: "cuMemGetInfo",
                    device: context.device,
                    error,
                })?;
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
    /// exporter died — until [`IpcMapping::close`] or drop.
    pub fn open_ipc(
        &self,
        device: u32,
        handle: &[u8; IPC_HANDLE_BYTES],
        offset: u64,
        nbytes: u64,
    ) -> Result<IpcMapping, CudaError> {
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
        .map_err(|error| CudaError::Driver {
            call: "cuIpcOpenMemHandle",
            device,
            error,
        })?;
        let mapping = IpcMapping {
            context,
            base,
            offset,
            nbytes,
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
        .map_err(|error| CudaError::Driver {
            call: "cuMemHostRegister",
            device: context.device,
            error,
        })
    }
}

/// An open CUDA IPC mapping of `[offset, offset + nbytes)` of a worker's allocation.
#[derive(Debug)]
pub struct IpcMapping {
    context: Context,
    base: sys::CUdeviceptr,
    offset: u64,
    nbytes: u64,
    open: bool,
}

impl IpcMapping {
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

    /// Device → host (`cuMemcpyDtoH`) of `nbytes` at `offset` of the window into `dst`.
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
        // SAFETY: the source range is inside the open mapping (checked above); the
        // caller guarantees the destination.
        unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src, nbytes) }
            .result()
            .map_err(|error| self.driver("cuMemcpyDtoH", error))
    }

    /// Host → device (`cuMemcpyHtoD`) of `nbytes` from `src` to `offset` of the window.
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
        // SAFETY: the destination range is inside the open mapping (checked above); the
        // caller guarantees the source.
        unsafe { sys::cuMemcpyHtoD_v2(dst, src.cast(), nbytes) }
            .result()
            .map_err(|error| self.driver("cuMemcpyHtoD", error))
    }

    /// Closes the mapping (`cuIpcCloseMemHandle`): exactly once, so the exporter's memory
    /// can go back to the device.
    pub fn close(mut self) -> Result<(), CudaError> {
        self.close_once()
    }

    fn close_once(&mut self) -> Result<(), CudaError> {
        if !std::mem::take(&mut self.open) {
            return Ok(());
        }
        self.context.make_current()?;
        // SAFETY: `base` was returned by cuIpcOpenMemHandle and, `open` being true until
        // now, has not been closed.
        unsafe { sys::cuIpcCloseMemHandle(self.base) }
            .result()
            .map_err(|error| self.driver("cuIpcCloseMemHandle", error))
    }

    fn driver(&self, call: &'static str, error: result::DriverError) -> CudaError {
        CudaError::Driver {
            call,
            device: self.context.device,
            error,
        }
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(error) = self.close_once() {
            tracing::error!(%error, "closing a CUDA IPC mapping failed");
        }
    }
}

mod export;

pub use export::{ExportedBuffer, PinnedHost};
