"""GPU check of the vLLM connector's CUDA route: KV tensors laid out like vLLM's GPU
KV cache, registered over CUDA IPC (``CudaIpcBuffer``), every region of some blocks
stored, the blocks zeroed, retrieved into other blocks, and the bytes compared.

Then the asynchronous path the connector takes (``kvwarden.kv_routes.GpuRoute`` on a
``kvwarden.lanes.Lane``, exactly the connector's code, without vLLM): the saves of 64
blocks queued in 4 steps of 16 on a save lane and the load of them into other blocks on
a load lane, while this thread keeps writing other blocks of the same tensors (a
stand-in forward pass); then the loaded bytes are compared, and so are the blocks the
"forward pass" wrote (a transfer that touched them would show).

    KVWARDEN_BIN=target/release/kvwarden python3 python/scripts/gpu_kv_check.py

Last, the figures of the GPU route (``docs/targets.md``), on a Llama-3-8B-shaped cache
(32 layers of [2, blocks, 16, 8, 128] bf16: 2 MiB blocks) with its own server whose
``--slot-bytes`` fits one record: G4, the route saving and loading a 2,048-token
prefix (128 blocks, 256 MiB), in GB/s and over one pinned 8 MiB copy of the same run;
G5, L1 bytes a stored block takes per byte of it; G6, the p99 time per step the route
takes on the model runner's thread (staging 16 saves, handing them and a load of 16
to the lanes) while the lanes move them and a stand-in forward pass runs.

With ``GPU_KV_CHECK_ONLY=async``, only the asynchronous path, after a check of CUDA
virtual memory when the allocator is in expandable segments (``gpu-kv-check.sh`` runs it
under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): a tensor in an expandable
segment registered as a ``cuda_vmm`` buffer (``kv_tensors.cuda_buffer``: the POSIX fd of
``cuMemExportToShareableHandle``), its blocks stored, zeroed, retrieved and compared,
and what the driver exported printed (``gpu_kv vmm_fd_kind``: the server gives the
driver only a character device, an anonymous inode or a memfd).

Needs PyTorch with CUDA and msgpack (not vLLM). Exits 0 when every byte came back,
1 when some did not, 2 when it cannot run here (no torch, no CUDA, no binary).
"""

import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def cannot(why: str) -> None:
    print(f"gpu_kv_check: cannot run: {why}", file=sys.stderr)
    sys.exit(2)


try:
    import torch
except ImportError:
    cannot("PyTorch is not installed (pip install torch, a CUDA build)")
if not torch.cuda.is_available():
    cannot(f"torch {torch.__version__} sees no CUDA device (CPU-only build, no driver or no GPU)")
try:
    from kvwarden import Worker
    from kvwarden.kv_routes import BlockMoves, GpuRoute
    from kvwarden.buffers import CudaVmmBuffer
    from kvwarden.kv_tensors import block_dim, block_regions, cuda_buffer, cuda_ipc_buffer
    from kvwarden.lanes import Lane
except ImportError as error:
    cannot(f"{error} (pip install msgpack)")

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, LAYERS, MOVED = 2048, 16, 8, 128, 4, 64


def main() -> int:
    binary = os.environ.get("KVWARDEN_BIN", "target/release/kvwarden")
    if not os.access(binary, os.X_OK):
        cannot(
            f"no kvwarden binary at {binary}; cargo build --release -p kvwarden-cli or set KVWARDEN_BIN"
        )
    device = int(os.environ.get("GPU_CHECK_DEVICE", "0"))
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="kvw-gpu-") as tmp:
        sock = os.path.join(tmp, "kv.sock")
        server = start_server(binary, sock, "--l1-bytes", "2G")
        try:
            if os.environ.get("GPU_KV_CHECK_ONLY") == "async":
                # Under expandable segments: vLLM's tensors have no CUDA IPC handle, the
                # route's staging buffers must still register, and a tensor of such a
                # segment registers as cuda_vmm.
                expandable = "expandable_segments:true" in os.environ.get(
                    "PYTORCH_CUDA_ALLOC_CONF", ""
                ).lower().replace(" ", "")
                result = check_vmm(sock, device) if expandable else 0
                return result or check_async(sock, device)
            result = check(sock, device)
            result = result or check_async(sock, device)
        finally:
            server.terminate()
            server.wait(30)
        return result or figures(binary, tmp, device)


def start_server(binary: str, sock: str, *args: str) -> subprocess.Popen:
    server = subprocess.Popen([binary, "serve", "--socket", sock, "--http", "off", *args])
    while not os.path.exists(sock):
        if server.poll() is not None:
            cannot(f"kvwarden serve exited with {server.returncode}")
        time.sleep(0.05)
    return server


def check(sock: str, device: int) -> int:
    g = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    shape_kv_first = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)  # FlashAttention
    shape_block_first = (NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)  # FlashInfer
    layers = []
    for i in range(LAYERS):
        shape = shape_kv_first if i % 2 == 0 else shape_block_first
        t = torch.randn(shape, generator=g, device=f"cuda:{device}").to(torch.bfloat16)
        layers.append((t, block_dim(t, NUM_BLOCKS)))
    # One allocation holding two layers, as vLLM may carve several out of one buffer.
    shared = torch.randn((2,) + shape_kv_first, generator=g, device=f"cuda:{device}").to(
        torch.bfloat16
    )
    layers += [(shared[0], 1), (shared[1], 1)]
    torch.cuda.synchronize()

    buffers, index_of = [], {}
    for t, _ in layers:
        base = t.untyped_storage().data_ptr()
        if base not in index_of:
            index_of[base] = len(buffers)
            buffers.append(cuda_ipc_buffer(t))
    src = list(range(MOVED))
    dst = list(range(NUM_BLOCKS - MOVED, NUM_BLOCKS))
    expected = [t.index_select(d, torch.tensor(src, device=t.device)).clone() for t, d in layers]
    worker = Worker(sock)
    try:
        print(
            "registered:",
            worker.register_kv_cache(buffers, model_name="gpu-kv-check"),
            len(buffers),
            "buffers",
        )
        moved = 0
        started = time.perf_counter()
        for li, (t, d) in enumerate(layers):
            b = index_of[t.untyped_storage().data_ptr()]
            for block in src:
                for part, (offset, nbytes) in enumerate(block_regions(t, d, block)):
                    if not worker.store(f"{li}/{block}/{part}".encode(), b, offset, nbytes):
                        print(f"FAIL: store of layer {li} block {block} part {part} refused")
                        return 1
                    moved += nbytes
        stored_s = time.perf_counter() - started
        for t, d in layers:
            t.index_fill_(d, torch.tensor(dst, device=t.device), 0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for li, (t, d) in enumerate(layers):
            b = index_of[t.untyped_storage().data_ptr()]
            for block, into in zip(src, dst):
                for part, (offset, nbytes) in enumerate(block_regions(t, d, into)):
                    got = worker.retrieve(f"{li}/{block}/{part}".encode(), b, offset, nbytes=nbytes)
                    if got != nbytes:
                        print(
                            f"FAIL: retrieve of layer {li} block {block} part {part}: "
                            f"{got!r}, expected {nbytes}"
                        )
                        return 1
        retrieved_s = time.perf_counter() - started
        torch.cuda.synchronize()
        bad = [
            li
            for li, ((t, d), want) in enumerate(zip(layers, expected))
            if not torch.equal(t.index_select(d, torch.tensor(dst, device=t.device)), want)
        ]
    finally:
        worker.shutdown()
    if bad:
        print(f"FAIL: the bytes of layers {bad} differ after store and retrieve")
        return 1
    print(f"gpu_kv ok layers {len(layers)} blocks {MOVED} bytes {moved}")
    print(f"gpu_kv store_GBps {moved / stored_s / 1e9:.2f} (one round trip per region)")
    print(f"gpu_kv retrieve_GBps {moved / retrieved_s / 1e9:.2f} (one round trip per region)")
    return 0


class _Backoff:
    """The connector's backoff, reduced to what the route calls."""

    retry_after_seconds = 5.0

    def __init__(self) -> None:
        self.failures = 0

    def failed(self) -> None:
        self.failures += 1


def gpu_route(layers, worker, staging: int, queue: int, model_name: str) -> "GpuRoute":
    """The connector's GPU route over ``layers``, hosted as the connector hosts it."""
    host = SimpleNamespace(
        _rank=0,
        _layers=layers,
        _worker=worker,
        _backoff=_Backoff(),
        _staging_blocks=staging,
        _save_queue_blocks=queue,
        _layout=b"\0" * 8,
        _model_name=model_name,
    )
    return GpuRoute(host)


def vllm_layers(device: int, seed: int):
    """(name, tensor, block dim) of KV tensors laid out like vLLM's GPU KV cache."""
    g = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    shapes = [
        (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),  # FlashAttention: K/V first
        (NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),  # FlashInfer: blocks first
    ]
    layers = []
    for i in range(LAYERS):
        t = torch.randn(shapes[i % 2], generator=g, device=f"cuda:{device}").to(torch.bfloat16)
        layers.append((f"layer{i}", t, block_dim(t, NUM_BLOCKS)))
    return layers


def check_vmm(sock: str, device: int) -> int:
    """A KV tensor in an expandable segment (cuMemCreate memory) registered as a
    cuda_vmm buffer: blocks stored, zeroed, retrieved into other blocks, compared."""
    import stat

    g = torch.Generator(device=f"cuda:{device}").manual_seed(3)
    # 4 MiB: inside one of the segment's allocations (it grows in pieces of ~20 MiB).
    t = torch.randn((2, 64, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), generator=g, device=f"cuda:{device}")
    t = t.to(torch.bfloat16)
    torch.cuda.synchronize()
    d = block_dim(t, 64)
    try:
        buffer = cuda_buffer(t)
    except (ValueError, OSError) as error:
        print(f"FAIL: vmm: the expandable segment's tensor did not export: {error}")
        return 1
    if not isinstance(buffer, CudaVmmBuffer):
        print(f"FAIL: vmm: an expandable segment's tensor gave {buffer!r}, not a CudaVmmBuffer")
        return 1
    mode = os.fstat(buffer.fd).st_mode
    link = os.readlink(f"/proc/self/fd/{buffer.fd}")
    kind = "chr" if stat.S_ISCHR(mode) else "regular" if stat.S_ISREG(mode) else oct(mode)
    kind = f"{kind} {link}"
    print(f"gpu_kv vmm_fd_kind {kind} allocation_bytes {buffer.allocation_bytes}")
    src, dst = list(range(8)), list(range(56, 64))
    expected = t.index_select(d, torch.tensor(src, device=t.device)).clone()
    worker = Worker(sock)
    try:
        print("vmm: registered:", worker.register_kv_cache([buffer], model_name="gpu-kv-vmm"))
        for block in src:
            for part, (offset, nbytes) in enumerate(block_regions(t, d, block)):
                if not worker.store(f"vmm/{block}/{part}".encode(), 0, offset, nbytes):
                    print(f"FAIL: vmm: store of block {block} part {part} refused")
                    return 1
        t.index_fill_(d, torch.tensor(dst, device=t.device), 0)
        torch.cuda.synchronize()
        for block, into in zip(src, dst):
            for part, (offset, nbytes) in enumerate(block_regions(t, d, into)):
                got = worker.retrieve(f"vmm/{block}/{part}".encode(), 0, offset, nbytes=nbytes)
                if got != nbytes:
                    print(f"FAIL: vmm: retrieve of block {block} part {part}: {got!r}")
                    return 1
        torch.cuda.synchronize()
        same = torch.equal(t.index_select(d, torch.tensor(dst, device=t.device)), expected)
    finally:
        worker.shutdown()
        buffer.close()
    if not same:
        print("FAIL: vmm: the bytes differ after store and retrieve")
        return 1
    print(f"gpu_kv vmm_ok blocks {len(src)} (cuda_vmm: an expandable segment's tensor)")
    return 0


def check_async(sock: str, device: int) -> int:
    layers = vllm_layers(device, 1)
    torch.cuda.synchronize()
    worker = Worker(sock)
    route = gpu_route(layers, worker, 64, MOVED, "gpu-kv-check-async")
    saves, loads = Lane("gpu-check-save"), Lane("gpu-check-load")
    src = list(range(MOVED))
    dst = list(range(NUM_BLOCKS - MOVED, NUM_BLOCKS))
    forward = list(range(MOVED, 2 * MOVED))  # the stand-in forward pass's blocks
    keys = [b"async/%d" % block for block in src]
    expected = [t.index_select(d, torch.tensor(src, device=t.device)).clone() for _, t, d in layers]
    g = torch.Generator(device=f"cuda:{device}").manual_seed(2)
    try:
        route.register(worker)
        print(f"async: registered, {route.parts} L1 slot(s) a block")
        stored: list = []
        last_written = {}  # layer name → what the stand-in forward pass wrote last

        def run_forward(until_idle: Lane) -> int:
            """Writes the forward blocks until the lane is idle; how many passes ran."""
            passes = 0
            while not until_idle.idle() or passes == 0:
                for name, t, d in layers:
                    index = torch.tensor(forward, device=t.device)
                    shape = list(t.shape)
                    shape[d] = len(forward)
                    values = torch.randn(shape, generator=g, device=t.device).to(t.dtype)
                    t.index_copy_(d, index, values)
                    last_written[name] = values
                passes += 1
            torch.cuda.synchronize()
            return passes

        started = time.perf_counter()
        for step in range(4):  # four steps, 16 blocks each, as vLLM's steps would queue them
            part = slice(step * MOVED // 4, (step + 1) * MOVED // 4)
            job, dropped = route.stage_save(BlockMoves("r", keys[part], src[part]))
            if job is None or dropped:
                print(f"FAIL: async: step {step}'s save was dropped ({dropped} blocks)")
                return 1
            saves.submit(lambda job=job: stored.append(job()))
        save_passes = run_forward(saves)
        saved_s = time.perf_counter() - started
        if stored != [MOVED // 4] * 4:
            print(f"FAIL: async: the save lane stored {stored}, expected {[MOVED // 4] * 4}")
            return 1
        for _, t, d in layers:
            t.index_fill_(d, torch.tensor(dst, device=t.device), 0)
        torch.cuda.synchronize()
        loaded: list = []
        started = time.perf_counter()
        loads.submit(lambda: loaded.append(route.load(BlockMoves("r", keys, dst))))
        # The stand-in forward pass runs meanwhile, on its own blocks again.
        load_passes = run_forward(loads)
        loaded_s = time.perf_counter() - started
        torch.cuda.synchronize()
        if loaded != [MOVED]:
            print(f"FAIL: async: the load lane loaded {loaded}, expected [{MOVED}]")
            return 1
        bad = [
            name
            for (name, t, d), want in zip(layers, expected)
            if not torch.equal(t.index_select(d, torch.tensor(dst, device=t.device)), want)
        ]
        clobbered = [
            name
            for name, t, d in layers
            if not torch.equal(
                t.index_select(d, torch.tensor(forward, device=t.device)), last_written[name]
            )
        ]
    finally:
        saves.stop(30.0)
        loads.stop(30.0)
        worker.shutdown()
    if bad:
        print(f"FAIL: async: the bytes of {bad} differ after the save and load lanes")
        return 1
    if clobbered:
        print(f"FAIL: async: the forward pass's blocks of {clobbered} changed under the lanes")
        return 1
    nbytes = MOVED * route.block_bytes()
    print(f"gpu_kv async_ok layers {len(layers)} blocks {MOVED} bytes {nbytes}")
    print(
        f"gpu_kv async_save_GBps {nbytes / saved_s / 1e9:.2f} "
        f"(4 batches on the save lane, {save_passes} forward passes meanwhile)"
    )
    print(
        f"gpu_kv async_load_GBps {nbytes / loaded_s / 1e9:.2f} "
        f"(1 batch on the load lane, {load_passes} forward passes meanwhile)"
    )
    return 0


G_LAYERS, G_BLOCKS, G_PREFIX, G_STEP, G_STEPS = 32, 640, 128, 16, 200


def pinned_GBps(device: int) -> "tuple[float, float]":
    """One stream's pinned 8 MiB copies: (device to host, host to device) GB/s."""
    size = 8 << 20
    dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    rates = []
    for copy in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, True)):
        for _ in range(8):
            copy()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(64):
            copy()
        torch.cuda.synchronize()
        rates.append(64 * size / (time.perf_counter() - started) / 1e9)
    return rates[0], rates[1]


def figures(binary: str, tmp: str, device: int) -> int:
    from kvwarden import prefix

    layers = []
    g = torch.Generator(device=f"cuda:{device}").manual_seed(3)
    for i in range(G_LAYERS):
        shape = (2, G_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
        t = torch.randn(shape, generator=g, device=f"cuda:{device}").to(torch.bfloat16)
        layers.append((f"layer{i}", t, 1))
    block = G_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_SIZE * 2
    slot = -(-(block + prefix.RECORD_HEADER_BYTES) // 64) * 64
    sock = os.path.join(tmp, "figures.sock")
    server = start_server(binary, sock, "--l1-bytes", "4G", "--slot-bytes", str(slot))
    worker = Worker(sock)
    route = gpu_route(layers, worker, 2 * G_STEP, G_PREFIX, "gpu-kv-figures")
    saves, loads = Lane("figures-save"), Lane("figures-load")
    try:
        route.register(worker)
        d2h, h2d = pinned_GBps(device)
        src = list(range(G_PREFIX))
        dst = list(range(G_PREFIX, 2 * G_PREFIX))
        nbytes = G_PREFIX * route.block_bytes()
        save_s, load_s = [], []
        for round_ in range(4):  # the first is a warm-up
            keys = [b"g4/%d/%d" % (round_, b) for b in src]
            keys = [k.ljust(prefix.KEY_BYTES, b".") for k in keys]
            torch.cuda.synchronize()
            started = time.perf_counter()
            job, dropped = route.stage_save(BlockMoves("g4", keys, src))
            stored = job() if job is not None else 0
            save_s.append(time.perf_counter() - started)
            if stored != G_PREFIX or dropped:
                print(f"FAIL: figures: saved {stored} of {G_PREFIX} blocks ({dropped} dropped)")
                return 1
            started = time.perf_counter()
            loaded = route.load(BlockMoves("g4", keys, dst))
            load_s.append(time.perf_counter() - started)
            if loaded != G_PREFIX:
                print(f"FAIL: figures: loaded {loaded} of {G_PREFIX} blocks")
                return 1
        bad = [
            name
            for name, t, d in layers
            if not torch.equal(
                t.index_select(d, torch.tensor(src, device=t.device)),
                t.index_select(d, torch.tensor(dst, device=t.device)),
            )
        ]
        if bad:
            print(f"FAIL: figures: the loaded bytes of {bad[:4]} differ from the saved")
            return 1
        save_GBps = nbytes / min(save_s[1:]) / 1e9
        load_GBps = nbytes / min(load_s[1:]) / 1e9
        print(f"gpu_kv pinned_8MiB_d2h_GBps {d2h:.2f}")
        print(f"gpu_kv pinned_8MiB_h2d_GBps {h2d:.2f}")
        print(f"gpu_kv G4_save_GBps {save_GBps:.2f} (2,048 tokens, {nbytes >> 20} MiB, best of 3)")
        print(f"gpu_kv G4_load_GBps {load_GBps:.2f}")
        print(f"gpu_kv G4_save_over_pinned {save_GBps / d2h:.2f} x")
        print(f"gpu_kv G4_load_over_pinned {load_GBps / h2d:.2f} x")
        l1 = worker.status()["l1"]
        used = l1["slots_used"] * l1["slot_bytes"]
        print(
            f"gpu_kv G5_l1_use {4 * nbytes / used:.3f} "
            f"({4 * G_PREFIX} blocks in {l1['slots_used']} slots of {l1['slot_bytes']} bytes)"
        )

        # G6: the model runner's share of a step, 16 saves and a load of 16 a step.
        hooks = []
        a = torch.randn((4096, 4096), device=f"cuda:{device}", dtype=torch.bfloat16)
        for step in range(G_STEPS):
            keys = [(b"g6/%d/%d" % (step, b)).ljust(prefix.KEY_BYTES, b".") for b in range(G_STEP)]
            ids = [(step * G_STEP + b) % G_PREFIX for b in range(G_STEP)]
            previous = [(b"g4/3/%d" % b).ljust(prefix.KEY_BYTES, b".") for b in ids]
            started = time.perf_counter()
            job, _ = route.stage_save(BlockMoves("g6", keys, ids))
            if job is not None:
                saves.submit(job)
            into = [G_PREFIX + 2 * G_STEP + b for b in range(G_STEP)]
            load = BlockMoves("g6", previous, into)
            loads.submit(lambda moves=load: route.load(moves))
            hooks.append(time.perf_counter() - started)
            for _ in range(20):  # the stand-in forward pass, then its sampling's sync
                a = torch.tanh(a @ a * 1e-3)
            torch.cuda.current_stream().synchronize()
        hooks.sort()
        p99 = hooks[int(0.99 * (len(hooks) - 1))]
        print(
            f"gpu_kv G6_hooks_p99_ms {p99 * 1e3:.3f} "
            f"(p50 {hooks[len(hooks) // 2] * 1e3:.3f}, {G_STEPS} steps of {G_STEP} saves "
            f"and {G_STEP} loads)"
        )
    finally:
        saves.stop(60.0)
        loads.stop(60.0)
        worker.shutdown()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
