"""Issue 42 (failure mode 74) with a real engine: vLLM publishes its KV events over
ZMQ with the kvwarden connector, a subscriber decodes them with vLLM's own msgspec
classes (as llm-d's indexer does), and the blocks it sees announced on medium ``CPU``
are exactly those kvwarden can serve the engine: after stores, for a subscriber that
joins late, after an L1 eviction, a warm and a cold restart, and an engine killed and
restarted in place; a server that goes away has them withdrawn. The server's own
stream (``kvwarden serve --kv-events``, no engine in the loop) is held to the same
check: after stores, for a late subscriber (its replay), after an eviction, and after a
cold and a warm restart."""

from __future__ import annotations

import os
import time
from typing import Dict, Iterator, List, Set

import pytest
from conftest import RealServer
from engine import Engine
from engine_child import BLOCK_SIZE
from test_engine import FAST, A, B, D, wait_until

from kvwarden import Worker, prefix


class Subscriber:
    """A ZMQ SUB on the engine's stream; ``held`` is the (hash, medium) set announced."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.held: Set = set()
        #: AllBlocksCleared events received.
        self.cleared = 0
        #: Each announced block's parent and tokens.
        self.blocks: Dict = {}

    def drain(self, quiet_ms: int = 0) -> None:
        """Applies every batch received; with ``quiet_ms``, until none came for that
        long (the engine is idle: what it published has all arrived)."""
        while self._socket.poll(quiet_ms):
            _topic, _seq, payload = self._socket.recv_multipart()
            self.apply(payload)

    def replay(self, endpoint: str) -> None:
        """Joins late: every batch the engine still buffers, from its replay socket."""
        dealer = self._zmq.Context.instance().socket(self._zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        try:
            while True:
                assert dealer.poll(30_000), "the replay socket did not answer"
                _, _topic, seq, payload = dealer.recv_multipart()
                if not payload:
                    return  # the end-of-sequence marker
                self.apply(payload)
        finally:
            dealer.close(0)

    def apply(self, payload: bytes) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in self._decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                self.held.update((h, event.medium) for h in event.block_hashes)
                parent = event.parent_block_hash
                for h in event.block_hashes:
                    self.blocks[h] = (parent, list(event.token_ids))
                    parent = h
            elif isinstance(event, BlockRemoved):
                self.held.difference_update((h, event.medium) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.cleared += 1

    def tokens(self, block_hash) -> List[int]:
        """The prompt prefix a block ends, from the announced parents and tokens."""
        chain = []
        while block_hash is not None:
            parent, tokens = self.blocks[block_hash]
            chain.append(tokens)
            block_hash = parent
        return [t for tokens in reversed(chain) for t in tokens]

    def close(self) -> None:
        self._socket.close(0)


#: A prompt shorter than a block: a step that saves nothing.
STEP = [5] * 20


@pytest.fixture
def events_engine(model: str, module_tmp: str, short_tmp: str, request) -> Iterator:
    """A server of its own, an engine publishing its KV events to an ipc endpoint, and
    a subscriber (joined before the first block is stored). With ``small_pool`` (the
    test's parameter), L1 holds 16 blocks, in a file a restart adopts."""
    from conftest import find_binary

    extra: List[str] = []
    small = getattr(request, "param", None) == "small_pool"
    if small:
        secret = os.path.join(short_tmp, "l1-secret")
        with open(secret, "wb") as out:
            out.write(os.urandom(32))
        os.chmod(secret, 0o600)
        extra = ["--l1-file", os.path.join(short_tmp, "l1"), "--l1-secret-file", secret]
    # The server announces this uid's blocks itself too (the node-scoped stream).
    node_events = (f"ipc://{short_tmp}/node-events", f"ipc://{short_tmp}/node-replay")
    extra += ["--kv-events", f"uid-{os.getuid()}={node_events[0]},replay={node_events[1]}"]
    server = RealServer(
        find_binary(),
        os.path.join(short_tmp, "events.sock"),
        os.path.join(short_tmp, "events-server.log"),
        reap_timeout_seconds=60.0,
        registration_grace_seconds=120.0,
        extra_args=extra,
        # A block's shard (2 layers, K and V, 32 tokens × 2 heads × 32) is 16 KiB.
        slot_bytes="64K" if small else "1M",
        l1_bytes="1M" if small else "64M",
    )
    server.start()
    server.kv_events = node_events
    endpoint = f"ipc://{short_tmp}/kv-events"
    replay = f"ipc://{short_tmp}/kv-replay"
    engines: List[Engine] = []

    def new_engine() -> Engine:
        """An engine on this stream (another one: an engine restarted in place)."""
        engines.append(
            Engine(
                model,
                os.path.join(module_tmp, f"events-engine-{len(engines)}.log"),
                server.socket_path,
                kv_events_endpoint=endpoint,
                kv_events_replay=replay,
                kvwarden_events_interval_seconds=0.0,
                **FAST,
            )
        )
        return engines[-1]

    try:
        engine = new_engine()
        subscriber = Subscriber(endpoint)
        server.node = Subscriber(server.kv_events[0])
        try:
            yield server, engine, subscriber, endpoint, replay, new_engine
        finally:
            subscriber.close()
            server.node.close()
    finally:
        for engine in engines:
            engine.close()
        server.stop()


def loadable(socket_path: str, engine: Engine, prompt) -> int:
    """How many leading blocks of ``prompt`` kvwarden serves the engine (rank 0)."""
    keys = prefix.chain_keys(bytes.fromhex(engine.ready["root"]), prompt, BLOCK_SIZE)
    with Worker(socket_path) as worker:
        return worker.lookup([prefix.rank_key(k, 0) for k in keys])


def mismatches(server: RealServer, engine: Engine, view: Subscriber, prompts) -> List[str]:
    """How ``view``'s blocks on medium CPU differ from what kvwarden serves the engine:
    every block announced must be served with its whole prefix (rebuilt from the
    announced parents and tokens), and every block of ``prompts`` served (with its
    prefix) must be announced. Empty: they agree."""
    cpu = {h for h, medium in view.held if medium == "CPU"}
    wrong = []
    for block_hash in cpu:
        tokens = view.tokens(block_hash)
        blocks = len(tokens) // BLOCK_SIZE
        if loadable(server.socket_path, engine, tokens) != blocks:
            wrong.append(f"block {blocks} of a prompt announced, not served")
    prefixes = {tuple(view.tokens(h)) for h in cpu}
    for p, prompt in enumerate(prompts):
        for n in range(1, loadable(server.socket_path, engine, prompt) + 1):
            if tuple(prompt[: n * BLOCK_SIZE]) not in prefixes:
                wrong.append(f"prompt {p}'s block {n} served, not announced")
    return wrong


def agreed(server: RealServer, engine: Engine, subscriber: Subscriber, prompts) -> bool:
    """Steps the engine once (a prompt that saves nothing), then compares."""
    engine.generate([STEP], max_tokens=1)
    subscriber.drain(quiet_ms=200)
    return not mismatches(server, engine, subscriber, prompts)


def same_blocks(node: Subscriber, engine_view: Subscriber) -> bool:
    """Whether the server's stream holds exactly the engine stream's blocks on CPU."""
    engine_view.drain(quiet_ms=200)
    return node.held == {(h, m) for h, m in engine_view.held if m == "CPU"}


def node_agrees(server: RealServer, engine: Engine, prompts, rejoin: bool = False) -> bool:
    """Steps the engine once (its scheduler describes the blocks it announced to the
    server), then compares the server's own stream with what it serves. With
    ``rejoin``, the subscriber first replays the (restarted) server's stream from its
    start, as a subscriber does that sees the sequence start over."""
    engine.generate([STEP], max_tokens=1)
    if rejoin:
        server.node.held.clear()
        server.node.replay(server.kv_events[1])
    server.node.drain(quiet_ms=200)
    return not mismatches(server, engine, server.node, prompts)


def test_the_blocks_a_subscriber_sees_on_cpu_are_those_kvwarden_serves(events_engine) -> None:
    server, engine, subscriber, endpoint, replay, _ = events_engine
    time.sleep(0.5)  # the SUB's connect completes before the first event (ZMQ slow joiner)
    engine.generate([A], max_tokens=8)
    # The engine steps again (another prompt): its scheduler reads kv_events and
    # announces A's blocks, saved after A's last step.
    served = loadable(server.socket_path, engine, A)
    assert served == 9, "A's 9 full blocks are stored"

    def announced() -> bool:
        engine.generate([B], max_tokens=2)
        subscriber.drain()
        return len({h for h, m in subscriber.held if m == "CPU"}) >= served

    wait_until(announced, "A's blocks announced on medium CPU", timeout=60.0)
    # Once everything the (now idle) engine published has arrived, the live subscriber,
    # and one that joins late and replays the engine's buffer, each hold what kvwarden
    # serves the engine.
    subscriber.drain(quiet_ms=500)
    late = Subscriber(endpoint)
    try:
        late.replay(replay)
        for who, view in (("live", subscriber), ("late", late)):
            assert mismatches(server, engine, view, [A]) == [], who
    finally:
        late.close()
    # The server's own stream: every block A's engine described, once all its shards
    # are held; a subscriber that joins late replays the same from the server.
    wait_until(
        lambda: node_agrees(server, engine, [A]) and same_blocks(server.node, subscriber),
        "the server's stream announces what the engine's does on CPU",
    )
    late = Subscriber(server.kv_events[0])
    try:
        late.replay(server.kv_events[1])
        assert late.held == server.node.held, "a late subscriber replays the same"
        assert late.cleared == 1, "the stream began with AllBlocksCleared"
    finally:
        late.close()

    # The server goes away: the engine's next steps withdraw every CPU block.
    server.stop()

    def withdrawn() -> bool:
        engine.generate([D], max_tokens=2)
        subscriber.drain()
        return not any(m == "CPU" for _, m in subscriber.held)

    wait_until(withdrawn, "every kvwarden block withdrawn", timeout=60.0)

    # It comes back cold (an empty L1): nothing is announced until blocks are stored
    # again, and then exactly those.
    server.start()
    wait_until(
        lambda: agreed(server, engine, subscriber, [A]), "nothing announced of the cold server"
    )
    assert not any(m == "CPU" for _, m in subscriber.held)
    # The cold server's stream starts over with AllBlocksCleared and announces nothing.
    assert node_agrees(server, engine, [A], rejoin=True)
    assert server.node.held == set() and server.node.cleared >= 1

    def stored_again() -> bool:
        # (Saved once the engine's workers have registered with the new server.)
        engine.generate([A], max_tokens=1)
        return (
            agreed(server, engine, subscriber, [A]) and loadable(server.socket_path, engine, A) == 9
        )

    wait_until(stored_again, "A's blocks stored again and announced")
    wait_until(
        lambda: node_agrees(server, engine, [A]) and same_blocks(server.node, subscriber),
        "the restarted server's stream announces A's blocks again",
    )
    assert len(server.node.held) == 9


@pytest.mark.parametrize("events_engine", ["small_pool"], indirect=True)
def test_after_an_eviction_and_a_warm_restart_a_subscriber_sees_what_kvwarden_serves(
    events_engine,
) -> None:
    """L1 holds 16 blocks: D's 9 after A's 9 evict some of A's, and every block of A
    that cannot be loaded any more (evicted, or after one evicted) is withdrawn; then
    kvwarden restarts warm, adopts its pool, and the subscriber again sees exactly what
    it serves."""
    server, engine, subscriber, _, _, _ = events_engine
    time.sleep(0.5)  # the SUB's connect completes before the first event (ZMQ slow joiner)
    engine.generate([A], max_tokens=1)
    wait_until(
        lambda: (
            agreed(server, engine, subscriber, [A]) and loadable(server.socket_path, engine, A) == 9
        ),
        "A's 9 blocks served and announced",
    )
    announced_before = len(subscriber.held)
    engine.generate([D], max_tokens=1)
    wait_until(
        lambda: (
            agreed(server, engine, subscriber, [A, D])
            and loadable(server.socket_path, engine, D) == 9
        ),
        "D's blocks announced, and A's evicted ones withdrawn",
    )
    assert loadable(server.socket_path, engine, A) < 9, "D's blocks evicted some of A's"
    assert len(subscriber.held) < announced_before + 9, "some of A's blocks withdrawn"
    # The server's own stream withdrew them too.
    wait_until(
        lambda: node_agrees(server, engine, [A, D]) and same_blocks(server.node, subscriber),
        "the server's stream withdrew what the engine's did",
    )

    # A warm restart: the server adopts its pool, and the engine, after its resync,
    # announces what it serves.
    served_d = loadable(server.socket_path, engine, D)
    server.restart()
    wait_until(
        lambda: (
            agreed(server, engine, subscriber, [A, D])
            and loadable(server.socket_path, engine, D) > 0
        ),
        "what the restarted server adopted, announced",
    )
    assert loadable(server.socket_path, engine, D) == served_d, "D adopted whole"
    # The restarted server's stream: what the engine describes again, once served.
    wait_until(
        lambda: node_agrees(server, engine, [A, D], rejoin=True) and len(server.node.held) > 0,
        "the restarted server's stream announces what it adopted",
    )


@pytest.mark.parametrize("events_engine", ["small_pool"], indirect=True)
def test_an_engine_killed_and_restarted_in_place_leaves_no_stale_block(events_engine) -> None:
    """The publishing rank SIGKILLed, then the engine restarted in place on the same
    stream (llm-d-router #2853): while no engine runs, kvwarden evicts the blocks the
    killed one announced, which a subscriber still holds (the control: stale). The
    restarted engine's first batch begins with AllBlocksCleared, so the subscriber
    forgets every block of the killed engine (kvwarden's here; the engine's own too,
    with vLLM's prefix caching on), and then holds exactly what kvwarden serves the
    new one."""
    from conftest import store_blocks

    server, engine, subscriber, _, _, new_engine = events_engine
    time.sleep(0.5)  # the SUB's connect completes before the first event (ZMQ slow joiner)
    engine.generate([A], max_tokens=1)
    wait_until(
        lambda: (
            agreed(server, engine, subscriber, [A]) and loadable(server.socket_path, engine, A) == 9
        ),
        "A's 9 blocks served and announced",
    )
    engine.kill()
    # 16 chunks of the same tenant fill L1: every block of A is evicted.
    store_blocks(server.socket_path, [b"filler-%d" % i for i in range(16)])
    assert loadable(server.socket_path, engine, A) == 0
    subscriber.drain(quiet_ms=200)
    assert mismatches(server, engine, subscriber, [A]), "control: A's blocks are stale"

    restarted = new_engine()
    restarted.generate([B], max_tokens=1)
    wait_until(
        lambda: (
            agreed(server, restarted, subscriber, [A, B])
            and loadable(server.socket_path, restarted, B) == 9
        ),
        "the killed engine's blocks forgotten, B's announced",
    )
    assert subscriber.cleared == 2, "each engine's first batch began with AllBlocksCleared"
