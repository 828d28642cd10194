"""The memory a worker registers: memfd-backed host buffers, CUDA IPC handles and
CUDA virtual-memory allocations (the POSIX fd ``cuMemExportToShareableHandle`` gives).

A memfd is anonymous: it has no name in ``/dev/shm``, so when the worker and the server
have both let go of it the pages are gone (failure mode 22). The server seals every
memfd it maps against shrinking, so buffers are created with ``MFD_ALLOW_SEALING``.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Dict, Optional, Union

#: Length of a ``cudaIpcMemHandle_t`` / ``CUipcMemHandle``.
CUDA_IPC_HANDLE_BYTES = 64


class MemfdBuffer:
    """Host memory shared with the server: a memfd mapped ``MAP_SHARED`` here.

    ``view`` is a writable ``memoryview`` of the whole buffer; what the engine writes
    there is what the server copies on ``store``, and ``retrieve`` writes into it.
    The worker keeps the fd open for as long as the buffer is registered, because a
    recovery after a server restart has to send it again.
    """

    def __init__(self, fd: int, nbytes: int, name: str) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.name = name
        self._mmap: Optional[mmap.mmap] = mmap.mmap(
            fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.view: memoryview = memoryview(self._mmap)

    @classmethod
    def create(cls, nbytes: int, name: str = "kvwarden-kv") -> "MemfdBuffer":
        """A new zero-filled buffer of ``nbytes`` bytes."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(
                f"a memfd buffer needs a positive integer size in bytes, got {nbytes!r}"
            )
        flags = getattr(os, "MFD_CLOEXEC", 1) | getattr(os, "MFD_ALLOW_SEALING", 2)
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes, name)
        except BaseException:
            os.close(fd)
            raise

    def wire(self, fd_index: int) -> Dict[str, Any]:
        """The ``buffer`` map of ``register_kv_cache``."""
        return {"kind": "memfd", "fd_index": fd_index, "nbytes": self.nbytes}

    def close(self) -> None:
        """Unmaps and closes the fd. Views handed out must have been released first."""
        if self._mmap is not None:
            self.view.release()
            self._mmap.close()
            self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "MemfdBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemfdBuffer(name={self.name!r}, nbytes={self.nbytes}, fd={self.fd})"


class CudaIpcBuffer:
    """A CUDA allocation shared by IPC handle: what ``cudaIpcGetMemHandle`` returns for
    the allocation's base, the device it lives on, and where the buffer sits in it.

    The handle is given as raw bytes so this package needs no CUDA binding. With
    PyTorch, ``tensor.untyped_storage()._share_cuda_()`` returns (among others) the
    device, the handle of the allocation's base and the storage's offset in it; add the
    tensor's own ``storage_offset() * element_size()`` to that offset.
    """

    def __init__(self, handle: bytes, device: int, offset: int, nbytes: int) -> None:
        handle = bytes(handle)
        if len(handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(
                f"a CUDA IPC handle is {CUDA_IPC_HANDLE_BYTES} bytes, got {len(handle)}; pass "
                f"the raw bytes of cudaIpcMemHandle_t of the allocation's base"
            )
        for label, value in (("device", device), ("offset", offset), ("nbytes", nbytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CUDA IPC buffer {label} must be an integer >= 0, got {value!r}")
        if nbytes == 0:
            raise ValueError("CUDA IPC buffer nbytes must be > 0, got 0")
        self.handle = handle
        self.device = device
        self.offset = offset
        self.nbytes = nbytes

    def wire(self) -> Dict[str, Any]:
        """The ``buffer`` map of ``register_kv_cache``."""
        return {
            "kind": "cuda_ipc",
            "device": self.device,
            "handle": self.handle,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    def __repr__(self) -> str:
        return f"CudaIpcBuffer(device={self.device}, offset={self.offset}, nbytes={self.nbytes})"


class CudaVmmBuffer:
    """A CUDA virtual-memory allocation (``cuMemCreate``: PyTorch's expandable segments,
    vLLM's sleep-mode pool) shared by the POSIX fd ``cuMemExportToShareableHandle``
    returned for it, and the window ``[offset, offset + nbytes)`` of it the buffer is.

    Such memory has no CUDA IPC handle; the fd travels with the registration frame
    (``SCM_RIGHTS``, like a memfd's, so only over the Unix socket), the server imports it
    and maps the whole allocation, ``allocation_bytes`` as ``cuMemCreate`` made it.
    :func:`kvwarden.kv_tensors.cuda_vmm_export` makes one from a device pointer.

    The buffer owns the fd: the worker keeps it open for as long as the buffer is
    registered (a recovery after a server restart sends it again); :meth:`close` it after
    ``unregister_kv_cache``. When the constructor raises, the fd stays the caller's.
    """

    def __init__(
        self, fd: int, device: int, allocation_bytes: int, offset: int, nbytes: int
    ) -> None:
        for label, value in (
            ("fd", fd),
            ("device", device),
            ("allocation_bytes", allocation_bytes),
            ("offset", offset),
            ("nbytes", nbytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CUDA VMM buffer {label} must be an integer >= 0, got {value!r}")
        for label, value in (("allocation_bytes", allocation_bytes), ("nbytes", nbytes)):
            if value == 0:
                raise ValueError(f"CUDA VMM buffer {label} must be > 0, got 0")
        if offset + nbytes > allocation_bytes:
            raise ValueError(
                f"CUDA VMM buffer window [offset {offset}, offset + nbytes {offset + nbytes}) "
                f"ends past the allocation's {allocation_bytes} bytes; a buffer must lie "
                f"inside the one cuMemCreate allocation the fd exports (register one buffer "
                f"per allocation)"
            )
        self.fd = fd
        self.device = device
        self.allocation_bytes = allocation_bytes
        self.offset = offset
        self.nbytes = nbytes

    def wire(self, fd_index: int) -> Dict[str, Any]:
        """The ``buffer`` map of ``register_kv_cache``; ``fd_index`` is the fd's index
        among the frame's fds."""
        return {
            "kind": "cuda_vmm",
            "fd_index": fd_index,
            "device": self.device,
            "allocation_bytes": self.allocation_bytes,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    def close(self) -> None:
        """Closes the fd (the allocation itself stays its owner's). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "CudaVmmBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CudaVmmBuffer(device={self.device}, allocation_bytes={self.allocation_bytes}, "
            f"offset={self.offset}, nbytes={self.nbytes}, fd={self.fd})"
        )


Buffer = Union[MemfdBuffer, CudaIpcBuffer, CudaVmmBuffer]

#: The buffers whose fd travels with the registration frame (``SCM_RIGHTS``): only
#: over the Unix socket.
FD_BUFFERS = (MemfdBuffer, CudaVmmBuffer)


class EnginePool:
    """The server's L1 pool, mapped into this worker (engine-driven mode).

    The worker writes KV data into a reserved slot between ``prepare_store`` and
    ``commit_store``, and reads a pinned slot between ``prepare_retrieve`` and
    ``commit_retrieve``. A restarted server has a new pool: recovery maps it afresh, so
    hold a :class:`Slot` only for the span of one prepare/commit pair.
    """

    def __init__(self, fd: int, slot_bytes: int, num_slots: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.nbytes = slot_bytes * num_slots
        try:
            size = os.fstat(fd).st_size
            if size < self.nbytes:
                raise ValueError(
                    f"the server's pool memfd holds {size} bytes, less than slot_bytes "
                    f"{slot_bytes} × num_slots {num_slots}"
                )
            self._mmap = mmap.mmap(
                fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            # The mapping keeps the pages; the fd itself is not needed any more.
            os.close(fd)
        self.view: memoryview = memoryview(self._mmap)

    def close(self) -> None:
        """Unmaps, unless a slot view is still alive (then the GC unmaps later)."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass


class Slot:
    """A region of the pool the server handed out for one key.

    ``view`` is the region ``[offset, offset + nbytes)`` of the mapped pool: write the
    KV bytes there before ``commit_store``, read them before ``commit_retrieve``.
    """

    def __init__(
        self, pool: EnginePool, key: bytes, offset: int, nbytes: int, slot: Optional[int]
    ) -> None:
        if offset + nbytes > pool.nbytes:
            raise ValueError(
                f"the server named pool bytes [{offset}, {offset + nbytes}) but the pool "
                f"holds {pool.nbytes}"
            )
        self.pool = pool
        self.key = key
        self.offset = offset
        self.nbytes = nbytes
        self.slot = slot
        self.view: memoryview = pool.view[offset : offset + nbytes]

    def __repr__(self) -> str:
        return f"Slot(slot={self.slot}, offset={self.offset}, nbytes={self.nbytes})"
