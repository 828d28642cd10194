"""A worker process for tests that need to SIGKILL or SIGSTOP a real worker.

Registers a memfd buffer, stores once (which starts the heartbeat), prints one JSON
line ``{"instance_id": ...}`` and then answers commands on stdin, one JSON line each:
``state`` → health and recovery counts, ``store KEY`` → the store's result,
``exit`` → clean shutdown.
"""

from __future__ import annotations

import json
import logging
import sys

from kvwarden import MemfdBuffer, Worker


def main() -> None:
    socket_path, interval = sys.argv[1], float(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    buffer = MemfdBuffer.create(1 << 16, "child-kv")
    worker = Worker(socket_path, heartbeat_interval_seconds=interval, request_timeout_seconds=5.0)
    worker.register_kv_cache([buffer], "child-model")
    buffer.view[:4] = b"kid!"
    stored = worker.store(b"child-key", nbytes=4)
    print(json.dumps({"instance_id": worker.instance_id, "stored": stored}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "state":
            print(
                json.dumps(
                    {
                        "healthy": worker.healthy.is_set(),
                        "recoveries": worker.recoveries,
                        "recoveries_ok": worker.recoveries_ok,
                    }
                ),
                flush=True,
            )
        elif command[0] == "store":
            print(json.dumps({"stored": worker.store(command[1].encode(), nbytes=4)}), flush=True)
        elif command[0] == "exit":
            worker.shutdown()
            print(json.dumps({"bye": True}), flush=True)
            return


if __name__ == "__main__":
    main()
