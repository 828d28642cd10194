"""Where a block lives in an engine's paged KV tensors (needs PyTorch, not vLLM).

A paged KV tensor has one dimension of ``num_blocks``: dimension 0 on vLLM's CPU
backend (``[num_blocks, kv_heads, block_size, 2 * head_size]``) and on layouts that put
the block first, dimension 1 on those that put K/V first (``[2, num_blocks, ...]``).
One block of one layer is then one contiguous region per index of the dimensions laid
out before it in memory: one region, or a K and a V region. The GPU check
(``python/scripts/gpu_kv_check.py``) and the vLLM connector both use these helpers.

Sharing device memory with the server: :func:`cuda_buffer` gives the buffer a CUDA
tensor's storage registers as, a :class:`CudaIpcBuffer` for ``cudaMalloc`` memory and a
:class:`CudaVmmBuffer` (:func:`cuda_vmm_export`, ctypes on libcuda, no torch) for
``cuMemCreate`` memory such as PyTorch's expandable segments.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
from typing import Any, Iterator, List, Optional, Tuple, Union

from .buffers import CUDA_IPC_HANDLE_BYTES, CudaIpcBuffer, CudaVmmBuffer


def block_dim(tensor: Any, num_blocks: int) -> int:
    """The dimension of ``tensor`` that indexes blocks: 0 or 1, whichever has
    ``num_blocks`` entries (0 when both do)."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(
        f"a KV tensor of shape {tuple(tensor.shape)} has no dimension 0 or 1 of "
        f"{num_blocks} blocks; kvwarden supports block-first and K/V-first paged layouts"
    )


def block_regions(tensor: Any, dim: int, block_id: int) -> List[Tuple[int, int]]:
    """``(byte offset within the tensor's storage, nbytes)`` of each contiguous region
    holding block ``block_id``: one per index of the dimensions laid out before the
    block dimension in memory.

    The tensor may be a permuted view of a contiguous one (vLLM permutes its KV views
    for head-major layouts), or a slice of a larger one whose dimensions inside a block
    are contiguous (one layer of cross-layer blocks, ``[num_blocks, num_layers, ...]``
    indexed by layer): regions follow the memory order, and a region copied into another
    block's regions of a tensor of the same layout moves exactly that block."""
    # Memory order: dimensions by decreasing stride (stable, so ties keep their order).
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    physical = tensor.permute(order)
    position = order.index(dim)
    # One block of one outer index: the dimensions after the block's in memory order.
    inner = physical
    for _ in range(position + 1):
        inner = inner.select(0, 0)
    element = tensor.element_size()
    nbytes = inner.numel() * element
    stride = physical.stride()
    if not inner.is_contiguous() or (
        physical.shape[position] > 1 and stride[position] * element < nbytes
    ):
        raise ValueError(
            f"a KV tensor of shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())} "
            f"does not hold each block in contiguous byte ranges (its dimensions inside a "
            f"block, in memory order, are not contiguous); kvwarden copies blocks as "
            f"contiguous byte ranges"
        )
    base = physical.storage_offset()
    regions = []
    for outer in itertools.product(*(range(n) for n in physical.shape[:position])):
        first = base + sum(i * s for i, s in zip(outer, stride)) + block_id * stride[position]
        regions.append((first * element, nbytes))
    return regions


#: The version byte of the handle PyTorch's ``_share_cuda_()`` returns since it stopped
#: returning a bare ``cudaIpcMemHandle_t`` (torch 2.11 on an H200, driver 580): version,
#: the segment's type, then the type's payload.
TORCH_HANDLE_VERSION = 2
#: The type of a block ``cudaMalloc`` allocated: its payload is the 64-byte
#: ``cudaIpcMemHandle_t`` of the allocation's base.
TORCH_HANDLE_CUDA_MALLOC = ord("c")
#: The type of an expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``):
#: memory from ``cuMemCreate``, which has no CUDA IPC handle.
TORCH_HANDLE_EXPANDABLE = ord("e")


def torch_ipc_handle(shared: bytes, torch_version: str) -> bytes:
    """The ``cudaIpcMemHandle_t`` in what ``storage._share_cuda_()`` gave as its handle:
    the bare 64 bytes (older PyTorch), or version 2 of PyTorch's shareable handle of
    type ``c`` (a ``cudaMalloc`` block; 66 bytes). Anything else is refused with a
    message that names it, the torch version, and what to change."""
    shared = bytes(shared)
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) >= 2 and shared[0] == TORCH_HANDLE_VERSION:
        kind = shared[1]
        if kind == TORCH_HANDLE_CUDA_MALLOC and len(shared) == 2 + CUDA_IPC_HANDLE_BYTES:
            return shared[2:]
        if kind == TORCH_HANDLE_EXPANDABLE:
            raise ValueError(
                f"the KV cache is in an expandable segment (torch {torch_version}, "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): such memory "
                f"(cuMemCreate) has no CUDA IPC handle. Register the tensor with "
                f"kvwarden.kv_tensors.cuda_buffer(), which shares it as a cuda_vmm buffer "
                f"(cuda_vmm_export: its POSIX fd, over the Unix socket), or start the "
                f"engine with expandable_segments:False so that its KV cache is cudaMalloc'd"
            )
    described = (
        f"version {shared[0]}, type {chr(shared[1])!r}"
        if len(shared) >= 2 and 32 <= shared[1] < 127
        else "an unknown layout"
    )
    raise ValueError(
        f"torch {torch_version} shares this KV cache with a {len(shared)}-byte handle of "
        f"{described}; kvwarden reads the bare 64-byte cudaIpcMemHandle_t and version "
        f"{TORCH_HANDLE_VERSION} type 'c' (a cudaMalloc block, 66 bytes). Run the engine "
        f"with PyTorch's default CUDA caching allocator (no custom memory pool), or a "
        f"torch version whose handle kvwarden reads"
    )


def cuda_ipc_buffer(tensor: Any) -> CudaIpcBuffer:
    """The whole storage under a CUDA ``tensor`` as a :class:`CudaIpcBuffer`: offsets of
    :func:`block_regions` are offsets in it. Only for ``cudaMalloc`` memory (an
    expandable segment is refused, see :func:`torch_ipc_handle`); :func:`cuda_buffer`
    takes either."""
    if not tensor.is_cuda:
        raise ValueError(f"cuda_ipc_buffer needs a CUDA tensor, got one on {tensor.device}")
    return _ipc_buffer(*_share_cuda(tensor))


def cuda_buffer(
    tensor: Any, libcuda: Optional[ctypes.CDLL] = None
) -> Union[CudaIpcBuffer, CudaVmmBuffer]:
    """The whole storage under a CUDA ``tensor`` as the buffer it registers as: a
    :class:`CudaIpcBuffer` when ``cudaMalloc`` made its segment (torch's handle type
    ``c``, or the bare 64-byte handle of older torch), a :class:`CudaVmmBuffer` when it
    lies in an expandable segment (type ``e``: ``cuMemCreate`` memory, which has no CUDA
    IPC handle; exported by :func:`cuda_vmm_export`, refused when the storage spans
    several of the segment's allocations). Offsets of :func:`block_regions` are offsets
    in the buffer either way. A :class:`CudaVmmBuffer` owns an fd: close it after
    ``unregister_kv_cache``. ``libcuda``: as for :func:`cuda_vmm_export`."""
    if not tensor.is_cuda:
        raise ValueError(f"cuda_buffer needs a CUDA tensor, got one on {tensor.device}")
    device, handle, size_bytes, offset_bytes = _share_cuda(tensor)
    if handle[:2] == bytes((TORCH_HANDLE_VERSION, TORCH_HANDLE_EXPANDABLE)):
        storage = tensor.untyped_storage()
        index = tensor.device.index
        return cuda_vmm_export(
            storage.data_ptr(),
            storage.nbytes(),
            device if index is None else int(index),
            libcuda=libcuda,
        )
    return _ipc_buffer(device, handle, size_bytes, offset_bytes)


def _share_cuda(tensor: Any) -> Tuple[int, bytes, int, int]:
    """``(device, handle, size_bytes, offset_bytes)`` of ``storage._share_cuda_()`` for
    the tensor's storage: the handle names the allocation's base (or, type ``e``, the
    expandable segment), ``offset_bytes`` is where this storage starts in it."""
    shared = tensor.untyped_storage()._share_cuda_()
    return int(shared[0]), bytes(shared[1]), int(shared[2]), int(shared[3])


def _ipc_buffer(device: int, handle: bytes, size_bytes: int, offset_bytes: int) -> CudaIpcBuffer:
    import torch

    return CudaIpcBuffer(
        torch_ipc_handle(handle, torch.__version__), device, offset_bytes, size_bytes
    )


# -- cuMemCreate memory: the driver API through ctypes ---------------------------------

#: ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``: the shareable handle is an fd.
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
#: ``CUDA_ERROR_INVALID_VALUE``: from ``cuMemRetainAllocationHandle``, the pointer is not
#: in memory ``cuMemCreate`` made.
CUDA_ERROR_INVALID_VALUE = 1

#: Names tried, in order, when no loaded driver library is given.
LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed: ``call`` names it, ``code`` is its ``CUresult`` and
    ``name`` that code's name (``cuGetErrorName``)."""

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.name = name


def load_libcuda(libcuda: Optional[ctypes.CDLL] = None) -> ctypes.CDLL:
    """``libcuda`` when given, else the NVIDIA driver library (``libcuda.so.1``, then
    ``libcuda.so``). Raises OSError naming what was tried."""
    if libcuda is not None:
        return libcuda
    failures = []
    for name in LIBCUDA_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError as error:
            failures.append(f"{name}: {error}")
    raise OSError(
        "cannot load the NVIDIA driver library to export CUDA virtual memory ("
        + "; ".join(failures)
        + "): run on a host with the NVIDIA driver, or pass the loaded library as libcuda="
    )


class _Driver:
    """The few driver calls :func:`cuda_vmm_export` makes, each checked: a failure
    raises :class:`CudaDriverError` naming the call and the ``CUresult``."""

    _SIGNATURES = {
        "cuInit": (ctypes.c_uint,),
        "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
        "cuCtxGetCurrent": (ctypes.POINTER(ctypes.c_void_p),),
        "cuCtxSetCurrent": (ctypes.c_void_p,),
        "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
        "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
        "cuDevicePrimaryCtxRelease": (ctypes.c_int,),
        "cuMemGetAddressRange_v2": (
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_ulonglong,
        ),
        "cuMemRetainAllocationHandle": (ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p),
        "cuMemExportToShareableHandle": (
            ctypes.c_void_p,
            ctypes.c_ulonglong,
            ctypes.c_int,
            ctypes.c_ulonglong,
        ),
        "cuMemRelease": (ctypes.c_ulonglong,),
        "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    }

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def function(self, name: str) -> Any:
        """A fresh function object (``lib[name]``), so that the signatures set here never
        change those of a library the caller passed and uses elsewhere."""
        try:
            function = self.lib[name]
        except AttributeError as error:
            raise OSError(
                f"the CUDA driver library {self.lib._name!r} has no {name}: CUDA virtual "
                f"memory export needs a driver of CUDA 10.2 or newer"
            ) from error
        function.argtypes = self._SIGNATURES[name]
        function.restype = ctypes.c_int
        return function

    def has(self, name: str) -> bool:
        try:
            self.lib[name]
        except AttributeError:
            return False
        return True

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            if self.function("cuGetErrorName")(code, ctypes.byref(text)) == 0 and text.value:
                return text.value.decode(errors="replace")
        except OSError:
            pass
        return f"CUresult {code}"

    def call(self, name: str, *args: Any, hint: str = "") -> None:
        """Runs ``name``; raises unless it answered ``CUDA_SUCCESS``."""
        code = int(self.function(name)(*args))
        if code != 0:
            raise self.error(name, code, hint)

    def error(self, name: str, code: int, hint: str = "") -> CudaDriverError:
        error_name = self.error_name(code)
        return CudaDriverError(
            name, code, error_name, f"{name} failed: {error_name} ({code}){hint}"
        )


@contextlib.contextmanager
def _some_context(driver: _Driver, device: int) -> Iterator[None]:
    """A context current on this thread for the span: the one already current, else
    ``device``'s primary context, retained for the span and released after (so its
    reference count ends where it began)."""
    driver.call("cuInit", 0)
    current = ctypes.c_void_p()
    driver.call("cuCtxGetCurrent", ctypes.byref(current))
    if current.value:
        yield
        return
    ordinal = ctypes.c_int()
    driver.call("cuDeviceGet", ctypes.byref(ordinal), device)
    release = (
        "cuDevicePrimaryCtxRelease_v2"
        if driver.has("cuDevicePrimaryCtxRelease_v2")
        else "cuDevicePrimaryCtxRelease"
    )
    primary = ctypes.c_void_p()
    driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(primary), ordinal.value)
    try:
        driver.call("cuCtxSetCurrent", primary)
        try:
            yield
        finally:
            driver.function("cuCtxSetCurrent")(None)
    finally:
        driver.function(release)(ordinal.value)


def cuda_vmm_export(
    ptr: int, nbytes: int, device: int, libcuda: Optional[ctypes.CDLL] = None
) -> CudaVmmBuffer:
    """``[ptr, ptr + nbytes)`` of CUDA virtual memory (``cuMemCreate``: an expandable
    segment, vLLM's sleep-mode pool) as a :class:`CudaVmmBuffer`: the POSIX fd
    ``cuMemExportToShareableHandle`` gives for the allocation holding ``ptr``, the
    allocation's size, and the window's offset in it. The server imports the fd and maps
    the whole allocation, so the window must lie inside that one allocation.

    ``device`` is the CUDA ordinal the memory lives on (its primary context is made
    current for the calls when this thread has none). ``libcuda``: a loaded driver
    library, else :func:`load_libcuda`. Raises ValueError when the pointer is not VMM
    memory or the window does not fit the allocation, :class:`CudaDriverError` when a
    driver call fails. The caller owns the returned buffer's fd.
    """
    for label, value, least in (("ptr", ptr, 1), ("nbytes", nbytes, 1), ("device", device, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(
                f"cuda_vmm_export {label} must be an integer >= {least}, got {value!r}"
            )
    driver = _Driver(load_libcuda(libcuda))
    with _some_context(driver, device):
        handle = ctypes.c_ulonglong()
        code = int(
            driver.function("cuMemRetainAllocationHandle")(
                ctypes.byref(handle), ctypes.c_void_p(ptr)
            )
        )
        if code == CUDA_ERROR_INVALID_VALUE:
            raise ValueError(
                f"pointer {ptr:#x} is not in CUDA virtual memory (cuMemCreate): "
                f"cuMemRetainAllocationHandle answered {driver.error_name(code)} ({code}). "
                f"Memory cudaMalloc made registers as a cuda_ipc buffer (CudaIpcBuffer; "
                f"kvwarden.kv_tensors.cuda_buffer picks the kind for a tensor)"
            )
        if code != 0:
            raise driver.error("cuMemRetainAllocationHandle", code, f" for pointer {ptr:#x}")
        try:
            return _export(driver, handle.value, ptr, nbytes, device)
        finally:
            # The retain took a reference on the allocation: give it back, also on failure.
            driver.function("cuMemRelease")(handle.value)


def _export(driver: _Driver, handle: int, ptr: int, nbytes: int, device: int) -> CudaVmmBuffer:
    base = ctypes.c_ulonglong()
    size = ctypes.c_size_t()
    driver.call(
        "cuMemGetAddressRange_v2",
        ctypes.byref(base),
        ctypes.byref(size),
        ptr,
        hint=f" for pointer {ptr:#x}",
    )
    offset = ptr - base.value
    if offset < 0 or offset + nbytes > size.value:
        raise ValueError(
            f"[{ptr:#x}, {ptr + nbytes:#x}) ({nbytes} bytes) does not fit the cuMemCreate "
            f"allocation holding {ptr:#x}, which is [{base.value:#x}, "
            f"{base.value + size.value:#x}) ({size.value} bytes; the window starts at offset "
            f"{offset}): the memory spans several cuMemCreate allocations (an expandable "
            f"segment grows in pieces, each its own allocation). Register one buffer per "
            f"allocation, or "
            f"run the engine without expandable_segments "
            f"(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False) so that it is cudaMalloc'd"
        )
    fd = ctypes.c_int(-1)
    code = int(
        driver.function("cuMemExportToShareableHandle")(
            ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
    )
    if code != 0:
        raise driver.error(
            "cuMemExportToShareableHandle",
            code,
            f" for the allocation at {base.value:#x}: its cuMemCreate must request "
            f"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (prop.requestedHandleTypes) for it to "
            f"be shared with the server",
        )
    try:
        return CudaVmmBuffer(fd.value, device, size.value, offset, nbytes)
    except BaseException:
        os.close(fd.value)
        raise
