//! Per-(instance, module) contexts: what the server holds for a worker, built and freed
//! off the event loop.
//!
//! The shell keeps each context under the node's `ContextId` until the node says
//! `Job::Free`; the node never frees a context while a copy uses it.

use super::closer::PeerFd;
use crate::cuda::{DeviceMapping, Gpu, IPC_HANDLE_BYTES, VmmWindow};
use crate::memfd::{self, SharedMapping};
use crate::protocol::{BufferSpec, ErrorCode, ProtocolError};
use rustix::fd::AsFd;
use std::sync::Arc;

/// What the server holds for a server-driven entry: the buffers it registered. (An
/// engine-driven entry holds nothing here: its reservations and pins are the node's.)
#[derive(Debug)]
pub struct Context {
    /// In registration order: `store`/`retrieve` name them by index.
    pub buffers: Vec<RegisteredBuffer>,
    /// The model the worker serves (status only).
    pub model_name: String,
}

/// One registered buffer.
#[derive(Debug)]
pub enum RegisteredBuffer {
    /// A worker's memfd, mapped shared.
    Memfd(SharedMapping),
    /// A mapping of a window of a worker's device allocation (`cuda_ipc` or
    /// `cuda_vmm`). Dropping it closes the mapping (`cuIpcCloseMemHandle`, or
    /// `cuMemUnmap`), which lets the device take the memory back once its exporter is
    /// gone.
    Cuda(DeviceMapping),
}

impl RegisteredBuffer {
    /// The buffer's size in bytes.
    pub fn len(&self) -> u64 {
        match self {
            RegisteredBuffer::Memfd(mapping) => mapping.len() as u64,
            RegisteredBuffer::Cuda(mapping) => mapping.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `[offset, offset + nbytes)` lies inside the buffer.
    pub fn contains(&self, offset: u64, nbytes: u64) -> bool {
        offset
            .checked_add(nbytes)
            .is_some_and(|end| end <= self.len())
    }

    /// Copies `nbytes` at `offset` of this buffer into `[slot_offset..)` of the L1 pool.
    /// False (copying nothing, or failing on the device) when a range is out of bounds
    /// or the driver refused.
    pub fn copy_to_l1(
        &self,
        offset: u64,
        pool: &SharedMapping,
        slot_offset: u64,
        nbytes: u64,
    ) -> bool {
        match self {
            RegisteredBuffer::Memfd(src) => {
                SharedMapping::copy(src, offset, pool, slot_offset, nbytes)
            }
            RegisteredBuffer::Cuda(src) => {
                let (Some(dst), Ok(len)) =
                    (pool.range_ptr(slot_offset, nbytes), usize::try_from(nbytes))
                else {
                    return false;
                };
                // SAFETY: `dst` points to `nbytes` bytes of the pool, inside a slot that
                // the L1 store reserved for this copy alone; `pool` outlives the call.
                let copied = unsafe { src.copy_to_host(offset, dst, len) };
                copied
                    .inspect_err(
                        |error| tracing::error!(%error, "copy from a CUDA buffer to L1 failed"),
                    )
                    .is_ok()
            }
        }
    }

    /// Copies `nbytes` from `[slot_offset..)` of the L1 pool to `offset` of this buffer.
    pub fn copy_from_l1(
        &self,
        pool: &SharedMapping,
        slot_offset: u64,
        offset: u64,
        nbytes: u64,
    ) -> bool {
        match self {
            RegisteredBuffer::Memfd(dst) => {
                SharedMapping::copy(pool, slot_offset, dst, offset, nbytes)
            }
            RegisteredBuffer::Cuda(dst) => {
                let (Some(src), Ok(len)) =
                    (pool.range_ptr(slot_offset, nbytes), usize::try_from(nbytes))
                else {
                    return false;
                };
                // SAFETY: `src` points to `nbytes` bytes of a pinned (committed) slot of
                // the pool, which `pool` keeps mapped for the whole call.
                let copied = unsafe { dst.copy_from_host(offset, src, len) };
                copied
                    .inspect_err(
                        |error| tracing::error!(%error, "copy from L1 to a CUDA buffer failed"),
                    )
                    .is_ok()
            }
        }
    }
}

/// What a build needs: the buffer specs with the fds each memfd buffer uses.
#[derive(Debug)]
pub struct BuildRequest {
    /// The specs, each with its fd when it travels as one (memfd, cuda_vmm).
    pub buffers: Vec<(BufferSpec, Option<PeerFd>)>,
    /// The model name.
    pub model_name: String,
    /// The GPUs, when the host has them (the node refused CUDA buffers otherwise).
    pub gpu: Option<Arc<Gpu>>,
    /// Memfds on hugetlbfs are accepted (`--allow-hugetlb-buffers`).
    pub allow_hugetlb: bool,
}

/// `statfs.f_type` of hugetlbfs (`HUGETLBFS_MAGIC`).
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Whether `fd` lives on hugetlbfs (`memfd_create(MFD_HUGETLB)`): its pages come from
/// the node's huge-page pool, reserved by the server's mapping and charged to it.
fn on_hugetlbfs(fd: impl AsFd) -> bool {
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)] // f_type's width varies
    rustix::fs::fstatfs(fd).is_ok_and(|fs| i64::from(fs.f_type as i64) == HUGETLBFS_MAGIC)
}

/// Builds a server-driven context: checks and seals each memfd, then maps it. Runs on
/// the context pool, never on the event loop. What a peer sent is asked first whether
/// it is a memfd (`F_GET_SEALS`, which no file system is consulted for) and nothing else
/// is done with an fd of another kind; every fd goes to a closer thread when dropped.
pub fn build(request: BuildRequest) -> Result<Context, ProtocolError> {
    let mut buffers = Vec::with_capacity(request.buffers.len());
    for (index, (spec, fd)) in request.buffers.into_iter().enumerate() {
        match (spec, fd) {
            (BufferSpec::Memfd { nbytes, .. }, Some(fd)) => {
                let mapping = map_memfd(index, &fd, nbytes, request.allow_hugetlb)?;
                // The fd is closed here; the mapping keeps the memory.
                buffers.push(RegisteredBuffer::Memfd(mapping));
            }
            (
                BufferSpec::CudaIpc {
                    device,
                    handle,
                    offset,
                    nbytes,
                },
                None,
            ) => {
                let spec = (device, handle.as_slice(), offset, nbytes);
                let mapping = open_cuda_ipc(index, request.gpu.as_deref(), spec)?;
                buffers.push(RegisteredBuffer::Cuda(mapping));
            }
            (
                BufferSpec::CudaVmm {
                    device,
                    allocation_bytes,
                    offset,
                    nbytes,
                    ..
                },
                Some(fd),
            ) => {
                let window = VmmWindow {
                    allocation_bytes,
                    offset,
                    nbytes,
                };
                let mapping = import_cuda_vmm(index, request.gpu.as_deref(), device, &fd, window)?;
                // The fd is closed here; the mapping keeps the memory.
                buffers.push(RegisteredBuffer::Cuda(mapping));
            }
            (spec, _) => {
                return Err(ProtocolError::new(
                    ErrorCode::Internal,
                    format!(
                        "register_kv_cache: buffers[{index}] reached the build without its fd: {spec:?}"
                    ),
                ));
            }
        }
    }
    Ok(Context {
        buffers,
        model_name: request.model_name,
    })
}

/// buffers[`index`], a memfd of `nbytes`: checked and sealed, refused on hugetlbfs
/// unless allowed, then mapped.
fn map_memfd(
    index: usize,
    fd: &PeerFd,
    nbytes: u64,
    allow_hugetlb: bool,
) -> Result<SharedMapping, ProtocolError> {
    memfd::check_and_seal(fd, nbytes).map_err(|e| {
        ProtocolError::new(
            ErrorCode::BadArgs,
            format!("register_kv_cache: buffers[{index}]: {e}"),
        )
    })?;
    if !allow_hugetlb && on_hugetlbfs(fd) {
        return Err(ProtocolError::new(
            ErrorCode::BadArgs,
            format!(
                "register_kv_cache: buffers[{index}] is a memfd on hugetlbfs \
                 (MFD_HUGETLB): mapping it would reserve the node's huge pages for \
                 the server and charge them to it; register a plain memfd, or have \
                 the operator allow them (serve --allow-hugetlb-buffers)"
            ),
        ));
    }
    let len = usize::try_from(nbytes).map_err(|_| {
        ProtocolError::new(
            ErrorCode::BadArgs,
            format!("register_kv_cache: buffers[{index}].nbytes {nbytes} does not fit this machine's address space"),
        )
    })?;
    SharedMapping::map(fd, len).map_err(|e| {
        ProtocolError::new(
            ErrorCode::Internal,
            format!("register_kv_cache: mapping buffers[{index}] ({nbytes} bytes) failed: {e}"),
        )
    })
}

/// buffers[`index`], a CUDA IPC buffer `(device, handle, offset, nbytes)`: opened on
/// this host's GPU, when it has one.
fn open_cuda_ipc(
    index: usize,
    gpu: Option<&Gpu>,
    (device, handle, offset, nbytes): (u64, &[u8], u64, u64),
) -> Result<DeviceMapping, ProtocolError> {
    let Some(gpu) = gpu else {
        return Err(ProtocolError::new(
            ErrorCode::Unavailable,
            format!(
                "register_kv_cache: buffers[{index}] is a cuda_ipc buffer, but this server has no GPU"
            ),
        ));
    };
    let bad = |message: String| ProtocolError::new(ErrorCode::BadArgs, message);
    let handle: &[u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
        bad(format!(
            "register_kv_cache: buffers[{index}].handle is {} bytes; a CUDA IPC handle is bin({IPC_HANDLE_BYTES})",
            handle.len()
        ))
    })?;
    let device = u32::try_from(device).map_err(|_| {
        bad(format!(
            "register_kv_cache: buffers[{index}].device {device} is not a device ordinal"
        ))
    })?;
    gpu.open_ipc(device, handle, offset, nbytes).map_err(|e| {
        ProtocolError::new(
            ErrorCode::BadArgs,
            format!(
                "register_kv_cache: buffers[{index}] (cuda_ipc, device {device}, offset {offset}, nbytes {nbytes}): {e}; \
                 send the cuIpcGetMemHandle handle of a live allocation's base, from a process on this host"
            ),
        )
    })
}

/// buffers[`index`], a CUDA VMM allocation's exported fd: asked what it is first (only a
/// memfd or a character device goes to the driver), then imported and mapped on this
/// host's GPU, when it has one.
fn import_cuda_vmm(
    index: usize,
    gpu: Option<&Gpu>,
    device: u64,
    fd: &PeerFd,
    window: VmmWindow,
) -> Result<DeviceMapping, ProtocolError> {
    let Some(gpu) = gpu else {
        return Err(ProtocolError::new(
            ErrorCode::Unavailable,
            format!(
                "register_kv_cache: buffers[{index}] is a cuda_vmm buffer, but this server has no GPU"
            ),
        ));
    };
    let bad = |message: String| ProtocolError::new(ErrorCode::BadArgs, message);
    let device = u32::try_from(device).map_err(|_| {
        bad(format!(
            "register_kv_cache: buffers[{index}].device {device} is not a device ordinal"
        ))
    })?;
    if let Some(kind) = not_a_vmm_export(fd) {
        return Err(bad(format!(
            "register_kv_cache: buffers[{index}] is a cuda_vmm buffer, but its fd is {kind}; \
             send the fd cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) \
             gave for the allocation"
        )));
    }
    let VmmWindow {
        allocation_bytes,
        offset,
        nbytes,
    } = window;
    gpu.import_vmm(device, fd.as_fd(), window).map_err(|e| {
        bad(format!(
            "register_kv_cache: buffers[{index}] (cuda_vmm, device {device}, allocation_bytes \
             {allocation_bytes}, offset {offset}, nbytes {nbytes}): {e}; send the POSIX fd of a \
             live cuMemCreate allocation made with requestedHandleTypes = \
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, and its size"
        ))
    })
}

/// What `fd` is when it cannot be a CUDA VMM export, or None when it may be. The
/// driver exports a character device's fd or an anonymous inode's (and the stand-in
/// driver of the tests a memfd); anything else — a socket, a pipe, a file on a file
/// system a neighbour runs — is refused before the driver acts on it. Asked without
/// consulting a file system: `F_GET_SEALS`, the fd's name in `/proc/self/fd` (the
/// kernel's `anon_inode:` prefix, which no path can take: a path starts with `/`), then
/// `statx` with `AT_STATX_DONT_SYNC`.
fn not_a_vmm_export(fd: &PeerFd) -> Option<&'static str> {
    use rustix::fd::AsRawFd;
    use rustix::fs::{AtFlags, FileType, StatxFlags};
    if rustix::fs::fcntl_get_seals(fd).is_ok() {
        return None;
    }
    let name = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()));
    if name.is_ok_and(|name| {
        name.as_os_str()
            .as_encoded_bytes()
            .starts_with(b"anon_inode:")
    }) {
        return None;
    }
    let flags = AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC;
    let Ok(stat) = rustix::fs::statx(fd, "", flags, StatxFlags::TYPE) else {
        return Some("of a kind the kernel would not say");
    };
    match FileType::from_raw_mode(u32::from(stat.stx_mode)) {
        FileType::CharacterDevice => None,
        FileType::Socket => Some("a socket"),
        FileType::Fifo => Some("a pipe"),
        FileType::Directory => Some("a directory"),
        FileType::RegularFile => Some("a regular file"),
        FileType::BlockDevice => Some("a block device"),
        FileType::Symlink => Some("a symbolic link"),
        FileType::Unknown => Some("of an unknown kind"),
    }
}
