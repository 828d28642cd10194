"""CUDA virtual memory (``cuMemCreate``: PyTorch's expandable segments, vLLM's sleep-mode
pool) registered as a ``cuda_vmm`` buffer: :func:`kvwarden.kv_tensors.cuda_vmm_export`
and :class:`kvwarden.CudaVmmBuffer`, with no GPU and no torch.

The driver is the stand-in libcuda (``tests/fixtures/libcuda_standin.c``, built here with
``cc``), loaded into this process with ctypes and put on the server's
``LD_LIBRARY_PATH``: its "device memory" is a memfd mapped at a host address of the
calling process, its ``cuMemExportToShareableHandle`` gives a duplicate of that memfd and
its ``cuMemImportFromShareableHandle`` maps it in the server, so the bytes a test writes
with ``ctypes.memmove`` are the bytes the real server stores, and what it retrieves is
read back the same way. An allocation here is laid out as an expandable segment lays it
out: pieces of one granularity, each its own ``cuMemCreate``, mapped back to back in one
reserved address range.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from typing import Any, Iterator, List, Optional

import pytest
from real_server import RealServer, find_binary

from kvwarden import CudaIpcBuffer, CudaVmmBuffer, MemfdBuffer, Worker
from kvwarden.kv_tensors import CudaDriverError, cuda_buffer, cuda_vmm_export

STANDIN_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "libcuda_standin.c"
)
#: The stand-in's allocation granularity (cuMemGetAllocationGranularity).
GRANULARITY = 2 << 20

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` of the CUDA 12 header."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class StandIn:
    """The stand-in driver: where it was built, its accounting directory, the library
    loaded into this process, with device 0's primary context current on this thread."""

    def __init__(self, library_dir: str, state_dir: str) -> None:
        self.library_dir = library_dir
        self.state_dir = state_dir
        self.lib = ctypes.CDLL(os.path.join(library_dir, "libcuda.so.1"))
        self.check("cuInit", 0)
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
        self.ctx = ctx
        self.make_current()

    def check(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        assert code == 0, f"stand-in {name} answered CUresult {code}"

    def make_current(self) -> None:
        self.check("cuCtxSetCurrent", self.ctx)

    def current(self) -> Optional[int]:
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", ctypes.byref(ctx))
        return ctx.value

    def env(self) -> dict:
        """What makes a child process (the server) use the stand-in."""
        return {"LD_LIBRARY_PATH": self.library_dir, "KVWARDEN_CUDA_STANDIN_DIR": self.state_dir}


class Segment:
    """``pieces`` allocations of ``piece_bytes`` each (``cuMemCreate``), mapped back to
    back at ``ptr`` in one reserved range and made read-write: the layout of an
    expandable segment. ``exportable``: requested with the POSIX fd handle type."""

    def __init__(
        self, standin: StandIn, pieces: int = 1, piece_bytes: int = GRANULARITY, exportable=True
    ) -> None:
        self.standin = standin
        self.lib = standin.lib
        self.piece_bytes = piece_bytes
        self.size = pieces * piece_bytes
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else 0
        prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0)
        granularity = ctypes.c_size_t()
        standin.check(
            "cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop), 0
        )
        assert piece_bytes % granularity.value == 0, (piece_bytes, granularity.value)
        base = ctypes.c_ulonglong()
        standin.check(
            "cuMemAddressReserve",
            ctypes.byref(base),
            ctypes.c_size_t(self.size),
            ctypes.c_size_t(0),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        )
        self.ptr = base.value
        self.handles: List[int] = []
        access = CUmemAccessDesc(
            CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        for piece in range(pieces):
            handle = ctypes.c_ulonglong()
            standin.check(
                "cuMemCreate",
                ctypes.byref(handle),
                ctypes.c_size_t(piece_bytes),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            )
            self.handles.append(handle.value)
            standin.check(
                "cuMemMap",
                ctypes.c_ulonglong(self.piece(piece)),
                ctypes.c_size_t(piece_bytes),
                ctypes.c_size_t(0),
                ctypes.c_ulonglong(handle.value),
                ctypes.c_ulonglong(0),
            )
            # Per piece, as the range of one mapping (the stand-in's cuMemSetAccess takes
            # one mapping's range at a time).
            standin.check(
                "cuMemSetAccess",
                ctypes.c_ulonglong(self.piece(piece)),
                ctypes.c_size_t(piece_bytes),
                ctypes.byref(access),
                ctypes.c_size_t(1),
            )

    def piece(self, index: int) -> int:
        """The address of allocation ``index``."""
        return self.ptr + index * self.piece_bytes

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.ptr + offset, data, len(data))

    def read(self, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self.ptr + offset, nbytes)

    def close(self) -> None:
        for index, handle in enumerate(self.handles):
            self.standin.check(
                "cuMemUnmap",
                ctypes.c_ulonglong(self.piece(index)),
                ctypes.c_size_t(self.piece_bytes),
            )
            self.standin.check("cuMemRelease", ctypes.c_ulonglong(handle))
        self.standin.check(
            "cuMemAddressFree", ctypes.c_ulonglong(self.ptr), ctypes.c_size_t(self.size)
        )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build the stand-in libcuda")
    root = tmp_path_factory.mktemp("standin")
    library_dir = root / "lib"
    library_dir.mkdir()
    built = subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(library_dir / "libcuda.so.1"),
            STANDIN_SOURCE,
            "-lpthread",
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, f"the stand-in libcuda does not compile:\n{built.stderr}"
    # The server's driver loader asks for libcuda.so first.
    os.symlink("libcuda.so.1", library_dir / "libcuda.so")
    state_dir = str(root / "state")
    before = os.environ.get("KVWARDEN_CUDA_STANDIN_DIR")
    os.environ["KVWARDEN_CUDA_STANDIN_DIR"] = state_dir  # read by the stand-in's cuInit
    try:
        driver = StandIn(str(library_dir), state_dir)
        missing = [
            name
            for name in (
                "cuMemCreate",
                "cuMemExportToShareableHandle",
                "cuMemRetainAllocationHandle",
            )
            if not hasattr(driver.lib, name)
        ]
        assert not missing, f"the stand-in libcuda lacks {missing}"
        yield driver
    finally:
        if before is None:
            os.environ.pop("KVWARDEN_CUDA_STANDIN_DIR", None)
        else:
            os.environ["KVWARDEN_CUDA_STANDIN_DIR"] = before


@pytest.fixture
def segment(standin: StandIn) -> Iterator[Segment]:
    """Two 2 MiB allocations back to back, as an expandable segment grows."""
    standin.make_current()
    made = Segment(standin, pieces=2)
    yield made
    made.close()


@pytest.fixture
def server(
    standin: StandIn, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RealServer]:
    binary = find_binary()
    if binary is None:
        pytest.skip(
            "no kvwarden binary: set KVWARDEN_BIN, or build target/debug/kvwarden with "
            "`cargo build -p kvwarden-cli` (python/ci.sh does both)"
        )
    for name, value in standin.env().items():
        monkeypatch.setenv(name, value)  # the server's environment: a "GPU"
    started = RealServer(
        binary, os.path.join(short_tmp, "kvwarden.sock"), os.path.join(short_tmp, "server.log")
    ).start()
    try:
        yield started
        started.check_no_ping_answered_false()
    finally:
        started.stop()
        print(f"--- server log ({started.log_path}) ---\n{started.log_tail(60)}")


# -- (a) end to end through the real server ---------------------------------------------


@pytest.mark.real_server
def test_vmm_bytes_stored_and_retrieved_through_the_real_server(
    standin: StandIn, segment: Segment, server: RealServer
) -> None:
    # The window starts inside the second allocation, as a tensor in a grown segment.
    offset_in_piece, nbytes = 4096, 256 << 10
    ptr = segment.piece(1) + offset_in_piece
    data = bytes((i * 7 + 3) % 251 for i in range(nbytes))
    segment.write(segment.piece_bytes + offset_in_piece, data)

    buffer = cuda_vmm_export(ptr, nbytes, 0, libcuda=standin.lib)
    assert (buffer.device, buffer.allocation_bytes, buffer.offset, buffer.nbytes) == (
        0,
        GRANULARITY,
        offset_in_piece,
        nbytes,
    ), buffer
    worker = Worker(server.socket_path)
    try:
        assert worker.register_kv_cache([buffer], "vmm-model") == "created"
        assert worker.store(b"vmm-block", 0, 1024, 64 << 10) is True
        segment.write(segment.piece_bytes + offset_in_piece, bytes(nbytes))  # zero it
        assert segment.read(segment.piece_bytes + offset_in_piece, nbytes) == bytes(nbytes)
        assert worker.retrieve(b"vmm-block", 0, 1024, nbytes=64 << 10) == 64 << 10
        got = segment.read(segment.piece_bytes + offset_in_piece, nbytes)
        assert got[1024 : 1024 + (64 << 10)] == data[1024 : 1024 + (64 << 10)]
        assert got[:1024] == bytes(1024), "nothing written before the range"
        assert got[1024 + (64 << 10) :] == bytes(nbytes - 1024 - (64 << 10)), "nor after it"
        # Retrieved into another place of the window: the server's mapping is the memory.
        assert worker.retrieve(b"vmm-block", 0, 128 << 10, nbytes=64 << 10) == 64 << 10
        moved = segment.read(segment.piece_bytes + offset_in_piece + (128 << 10), 64 << 10)
        assert moved == data[1024 : 1024 + (64 << 10)]
        assert worker.unregister_kv_cache() is True
    finally:
        worker.shutdown()
        buffer.close()
    assert buffer.fd == -1


# -- (b) the window must lie in one allocation ------------------------------------------


@pytest.mark.real_server
def test_a_window_in_one_allocation_registers_one_past_it_is_refused_naming_it(
    standin: StandIn, segment: Segment, server: RealServer
) -> None:
    start = 1 << 20  # 1 MiB into the first allocation
    fits = GRANULARITY - start  # up to the allocation's end
    fds = open_fds()
    with pytest.raises(ValueError) as refused:
        cuda_vmm_export(segment.ptr + start, fits + 1, 0, libcuda=standin.lib)
    message = str(refused.value)
    for named in (
        f"{segment.ptr + start:#x}",
        f"{fits + 1} bytes",
        f"{GRANULARITY} bytes",
        f"offset {start}",
        "several cuMemCreate allocations",
        "one buffer per allocation",
        "expandable_segments",
    ):
        assert named in message, (named, message)
    assert open_fds() == fds, "a refusal exports no fd and releases the retained handle"

    # The control: the same start, up to the allocation's end; and the next allocation
    # as a buffer of its own (one buffer per allocation).
    first = cuda_vmm_export(segment.ptr + start, fits, 0, libcuda=standin.lib)
    second = cuda_vmm_export(segment.piece(1), GRANULARITY, 0, libcuda=standin.lib)
    assert (first.offset, first.nbytes) == (start, fits)
    assert (second.offset, second.nbytes) == (0, GRANULARITY)
    segment.write(start, b"first-piece")
    segment.write(GRANULARITY + 5, b"second-piece")
    worker = Worker(server.socket_path)
    try:
        assert worker.register_kv_cache([first, second], "vmm-model") == "created"
        assert worker.store(b"one", 0, 0, 11) is True
        assert worker.store(b"two", 1, 5, 12) is True
        assert worker.retrieve(b"one", 1, 100, nbytes=11) == 11
        assert worker.retrieve(b"two", 0, 100, nbytes=12) == 12
        assert segment.read(GRANULARITY + 100, 11) == b"first-piece"
        assert segment.read(start + 100, 12) == b"second-piece"
    finally:
        worker.shutdown()
        first.close()
        second.close()


def test_a_window_crossing_into_the_next_allocation_is_refused(
    standin: StandIn, segment: Segment
) -> None:
    # Ends in the second allocation, starts in the first: the allocation holding the
    # pointer is the first, and the window runs past it.
    with pytest.raises(ValueError, match="several cuMemCreate allocations"):
        cuda_vmm_export(segment.piece(1) - 16, 32, 0, libcuda=standin.lib)


# -- (c) memory that is not cuMemCreate's -----------------------------------------------


def test_a_host_pointer_is_refused_naming_cuda_malloc_and_cuda_ipc(standin: StandIn) -> None:
    host = ctypes.create_string_buffer(4096)
    fds = open_fds()
    with pytest.raises(ValueError) as refused:
        cuda_vmm_export(ctypes.addressof(host), 4096, 0, libcuda=standin.lib)
    message = str(refused.value)
    assert f"{ctypes.addressof(host):#x}" in message
    assert "not in CUDA virtual memory" in message
    assert "cuMemRetainAllocationHandle" in message and "CUDA_ERROR_INVALID_VALUE" in message
    assert "cudaMalloc" in message and "cuda_ipc" in message, message
    assert open_fds() == fds


def test_cu_mem_alloc_memory_is_refused_naming_cuda_ipc(standin: StandIn) -> None:
    standin.make_current()
    ptr = ctypes.c_ulonglong()
    standin.check("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
    try:
        with pytest.raises(ValueError, match="cudaMalloc.*cuda_ipc"):
            cuda_vmm_export(ptr.value, 1 << 20, 0, libcuda=standin.lib)
    finally:
        standin.check("cuMemFree_v2", ptr)


def test_a_driver_error_names_the_call_and_the_cu_result(
    standin: StandIn, segment: Segment
) -> None:
    # No current context: the primary context of device 7, which the stand-in lacks.
    standin.check("cuCtxSetCurrent", None)
    try:
        with pytest.raises(CudaDriverError) as failed:
            cuda_vmm_export(segment.ptr, 4096, 7, libcuda=standin.lib)
        assert standin.current() is None
    finally:
        standin.make_current()
    error = failed.value
    assert (error.call, error.code, error.name) == ("cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE")
    assert str(error) == "cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE (101)"


def test_an_allocation_made_without_the_posix_fd_handle_type_is_refused_by_the_export(
    standin: StandIn,
) -> None:
    standin.make_current()
    private = Segment(standin, pieces=1, exportable=False)  # requestedHandleTypes 0
    fds = open_fds()
    try:
        try:
            exported: Optional[CudaVmmBuffer] = cuda_vmm_export(
                private.ptr, 4096, 0, libcuda=standin.lib
            )
        except CudaDriverError as error:
            failed: Optional[CudaDriverError] = error
            exported = None
        else:
            failed = None
        # Counted before the allocation goes: the failed export leaves no fd behind.
        fds_after = open_fds()
    finally:
        private.close()
    if exported is not None:
        exported.close()
    assert exported is None, "an allocation made without a POSIX fd handle type exported"
    assert failed is not None
    assert failed.call == "cuMemExportToShareableHandle"
    message = str(failed)
    assert message.startswith(f"cuMemExportToShareableHandle failed: {failed.name} ")
    assert "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in message, message
    assert fds_after == fds, "the retained handle was released on the failure too"


def test_without_a_current_context_the_primary_one_is_used_and_let_go(
    standin: StandIn, segment: Segment
) -> None:
    standin.check("cuCtxSetCurrent", None)
    try:
        with cuda_vmm_export(segment.ptr, 4096, 0, libcuda=standin.lib) as buffer:
            assert (buffer.offset, buffer.allocation_bytes) == (0, GRANULARITY)
            assert buffer.fd >= 0
            # The fd is the allocation: what it maps is what the segment holds.
            segment.write(0, b"through the fd")
            assert os.pread(buffer.fd, 14, 0) == b"through the fd"
        assert buffer.fd == -1, "the context manager closed the fd"
        assert standin.current() is None, "the thread is left as it was found"
    finally:
        standin.make_current()


def test_cuda_buffer_of_an_expandable_segment_tensor_is_a_vmm_buffer(
    standin: StandIn, segment: Segment
) -> None:
    storage = types.SimpleNamespace(
        _share_cuda_=lambda: (0, b"\x02e" + bytes(40), GRANULARITY, 0),
        data_ptr=lambda: segment.piece(1) + 512,
        nbytes=lambda: 8192,
    )
    tensor = types.SimpleNamespace(
        is_cuda=True, device=types.SimpleNamespace(index=0), untyped_storage=lambda: storage
    )
    with cuda_buffer(tensor, libcuda=standin.lib) as buffer:
        assert isinstance(buffer, CudaVmmBuffer)
        assert (buffer.offset, buffer.nbytes, buffer.allocation_bytes) == (512, 8192, GRANULARITY)


def test_cuda_buffer_of_a_cuda_malloc_tensor_is_an_ipc_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.11.0"))
    handle = bytes(range(64))
    storage = types.SimpleNamespace(_share_cuda_=lambda: (1, b"\x02c" + handle, 4096, 1024))
    tensor = types.SimpleNamespace(
        is_cuda=True, device=types.SimpleNamespace(index=1), untyped_storage=lambda: storage
    )
    buffer = cuda_buffer(tensor)
    assert isinstance(buffer, CudaIpcBuffer)
    assert buffer.wire() == {
        "kind": "cuda_ipc",
        "device": 1,
        "handle": handle,
        "offset": 1024,
        "nbytes": 4096,
    }
    cpu = types.SimpleNamespace(is_cuda=False, device="cpu")
    with pytest.raises(ValueError, match="cuda_buffer needs a CUDA tensor"):
        cuda_buffer(cpu)


# -- (d) the buffer itself --------------------------------------------------------------


def test_wire_is_the_cuda_vmm_map() -> None:
    fd = os.memfd_create("vmm-wire", os.MFD_CLOEXEC)
    buffer = CudaVmmBuffer(fd, device=1, allocation_bytes=4 << 20, offset=4096, nbytes=1 << 20)
    assert buffer.wire(3) == {
        "kind": "cuda_vmm",
        "fd_index": 3,
        "device": 1,
        "allocation_bytes": 4 << 20,
        "offset": 4096,
        "nbytes": 1 << 20,
    }
    assert "allocation_bytes=4194304" in repr(buffer)
    buffer.close()
    buffer.close()  # idempotent
    assert buffer.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"fd": -1}, "fd must be an integer >= 0, got -1"),
        ({"fd": 3.0}, "fd must be an integer >= 0, got 3.0"),
        ({"device": -2}, "device must be an integer >= 0, got -2"),
        ({"device": True}, "device must be an integer >= 0, got True"),
        ({"allocation_bytes": 0}, "allocation_bytes must be > 0, got 0"),
        ({"offset": -1}, "offset must be an integer >= 0, got -1"),
        ({"offset": "0"}, "offset must be an integer >= 0, got '0'"),
        ({"nbytes": 0}, "nbytes must be > 0, got 0"),
        ({"offset": 4096, "nbytes": GRANULARITY}, "ends past the allocation's 2097152 bytes"),
    ],
)
def test_bad_values_are_refused_naming_them(kwargs: dict, named: str) -> None:
    values = {"fd": 5, "device": 0, "allocation_bytes": GRANULARITY, "offset": 0, "nbytes": 4096}
    values.update(kwargs)
    with pytest.raises(ValueError) as refused:
        CudaVmmBuffer(**values)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "args, named",
    [
        ((0, 4096, 0), "ptr must be an integer >= 1, got 0"),
        ((4096, 0, 0), "nbytes must be an integer >= 1, got 0"),
        ((4096, 4096, -1), "device must be an integer >= 0, got -1"),
    ],
)
def test_cuda_vmm_export_refuses_bad_values_before_loading_a_driver(
    args: tuple, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        cuda_vmm_export(*args)


def test_register_sends_the_fd_with_the_frame(fake: Any) -> None:
    fd = os.memfd_create("vmm-fake", os.MFD_CLOEXEC)
    with CudaVmmBuffer(fd, 0, GRANULARITY, 0, 4096) as vmm, MemfdBuffer.create(4096) as host:
        worker = Worker(fake.path)
        try:
            worker.register_kv_cache([CudaIpcBuffer(b"h" * 64, 0, 0, 64), vmm, host], "m")
        finally:
            worker.shutdown()
        record = fake.ops("register_kv_cache")[0]
        assert record.nfds == 2, "the VMM fd and the memfd"
        kinds = [(b["kind"], b.get("fd_index")) for b in record.args[1]]
        assert kinds == [("cuda_ipc", None), ("cuda_vmm", 0), ("memfd", 1)]


def test_register_refuses_a_closed_vmm_buffer_and_tcp(fake: Any) -> None:
    fd = os.memfd_create("vmm-closed", os.MFD_CLOEXEC)
    vmm = CudaVmmBuffer(fd, 0, GRANULARITY, 0, 4096)
    vmm.close()
    worker = Worker(fake.path)
    try:
        with pytest.raises(ValueError, match="was closed"):
            worker.register_kv_cache([vmm], "m")
    finally:
        worker.shutdown()
    fd = os.memfd_create("vmm-tcp", os.MFD_CLOEXEC)
    with CudaVmmBuffer(fd, 0, GRANULARITY, 0, 4096) as vmm:
        tcp = Worker(tcp_address="127.0.0.1:1")
        try:
            with pytest.raises(ValueError, match="CudaVmmBuffer, whose fd cannot travel over TCP"):
                tcp.register_kv_cache([vmm], "m")
        finally:
            tcp.shutdown()
