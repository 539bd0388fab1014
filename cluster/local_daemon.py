"""Hold a local multi-node Ray cluster open until SIGTERM/SIGINT; used by cluster/local.sh.

    python cluster/local_daemon.py RUN_DIR NUM_NODES PORT

Writes ``RUN_DIR/address`` once every node is up and removes it on exit. The
cluster is :func:`loomray.testing.cluster.local_cluster` (loopback only, fast failure
detection unless ``LOOMRAY_FAST_FAILOVER=0``), not ``ray start``: a node started
with ``ray start --address=127.0.0.1:...`` either refuses to join (when
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) or rewrites 127.0.0.1 to the host's
external address (otherwise) -- see docs/ray-notes.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from loomray.testing.cluster import local_cluster


def main() -> None:
    run_dir, num_nodes, port = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()
    address_file = run_dir / "address"
    with local_cluster(num_nodes=num_nodes, connect=False, namespace="loomray",
                       fast_failure_detection=os.environ.get("LOOMRAY_FAST_FAILOVER", "1") == "1",
                       worker_resources={"loomray_session": 100},
                       head_node_args={"gcs_server_port": port, "temp_dir": str(run_dir / "ray")}) as lc:
        # After the nodes start: Ray's Node objects install SIGTERM handlers of their own.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        address_file.write_text(lc.address + "\n")
        print(f"cluster up at {lc.address}: {num_nodes} node(s)", flush=True)
        stop.wait()
        address_file.unlink(missing_ok=True)
        print("stopping", flush=True)
    print(f"stopped; processes killed after the grace period: {lc.leftover}", flush=True)


if __name__ == "__main__":
    main()
