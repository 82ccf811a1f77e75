"""examples/vendor_subscriber.py, run as a program against a real ZMQ publisher."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from event_plane import PublisherConfig, ZmqPublisher, cleared, remove, store
from storage_backends.local_s3 import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vendor_subscriber.py"


def test_vendor_subscriber_example_builds_tree_and_lru() -> None:
    port, rport = free_port(), free_port()
    pub = ZmqPublisher("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", epoch=9, config=PublisherConfig(max_events=4))
    # two prefix families: 1 -> 2 -> 3 -> 4 -> 5 and 100 -> 101 -> 102, plus an orphan 500 (parent 499)
    fam_a = [store(h, 1, h - 1 if h > 1 else None, 4096, "g1") for h in range(1, 6)]
    fam_b = [store(100 + i, 100, 99 + i if i else None, 4096, "g2") for i in range(3)]
    history = fam_a + fam_b + [store(500, 499, 499, 4096, "vol-a")]  # 9 events: seqs 0, 1, 2 (1 event)
    try:
        pub.publish(history)
        pub.flush()
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), f"zmq://127.0.0.1:{port}?replay={rport}", "--max-events", "14",
             "--duration", "20", "--lru-capacity", "8"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stderr is not None
            assert proc.stderr.readline().startswith("subscribed")
            time.sleep(0.3)  # slow joiner
            # live: a re-Store (hit), Removes (one unknown), a Cleared of g2
            pub.publish([store(3, 1, 2, 4096, "g1"), remove(5, 1, 4, 4096, "g1"), remove(777, 777, None, 1, "g1"),
                         cleared("g2"), store(6, 1, 4, 4096, "g1")])
            pub.flush()
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        pub.close()
    assert proc.returncode == 0, err
    s = json.loads(out)
    assert (s["batches"], s["events"]) == (5, 14)  # 3 replayed + 2 live (max_events=4 split the live five)
    assert s["subscriber"] == {"gaps": 0, "replayed": 3, "unrecovered": 0, "dropped": 0}  # history via catch-up
    assert s["blocks"] == 6  # 1..4, 6 in g1 and the orphan 500; family b cleared, 5 removed
    assert s["blocks_by_location"] == {"g1": 5, "vol-a": 1}
    assert s["prefix_families"] == 2 and s["top_prefixes"][0] == {"prefix_hash": 1, "blocks": 5}
    assert (s["orphans"], s["unknown_removes"], s["duplicate_stores"]) == (1, 1, 1)
    lru = s["lru"]
    # 9 Stores into 8 slots evict block 1; re-Store of 3 is a hit; 5 and 100..102 leave with
    # their blocks; 6 is inserted last
    assert (lru["inserts"], lru["hits"], lru["evictions"]) == (10, 1, 1)
    assert lru["most_recent"] == [2, 4, 500, 3, 6]
    assert lru["size"] == 5 and lru["bytes"] == 5 * 4096
    assert s["resync_needed"] == []
