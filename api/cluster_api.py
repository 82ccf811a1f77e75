"""The REST API of a partitioned cluster: ``python -m api.cluster_api``.

Serves :func:`api.app.create_app` over :class:`advisor.cluster.query.ClusterQuery`, so
routers and operators use the same routes as for one advisor (docs/operations.md, "REST
API"); lookups go to each piece's owner, a partition being taken over answers 503 with
``Retry-After``.  Bearer tokens and limits come from ``KVADVISOR_API_*`` as for the
advisor's own API; without tokens only a loopback host is accepted.  The worker
registrations of its indexer routes are kept in the cluster's JetStream KV (``--state-bucket``,
:mod:`advisor.cluster.api_state`) and restored at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Sequence

from advisor.cluster.api_state import ApiStateError, RegistrationBucket
from advisor.cluster.node import ClusterClient
from advisor.cluster.query import ClusterQuery
from api.app import create_app
from api.auth import ApiSecuritySettings, InsecureBindError, check_bind
from api.server import serve_in_thread
from event_plane.partition import PartitionScheme


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; prints ``api http://HOST:PORT`` once it listens.

    Returns:
        0 after a clean stop; 2 when the host needs tokens that are not configured, or the
        stored registrations cannot be read (bad bucket name, another format).
    """
    ap = argparse.ArgumentParser(prog="python -m api.cluster_api", description="REST API of a scaled cluster")
    ap.add_argument("--nats", default=os.environ.get("KVADVISOR_CLUSTER_NATS_URL"),
                    help="NATS URL(s), comma-separated, each may carry user:password@ (default: "
                         "$KVADVISOR_CLUSTER_NATS_URL, which keeps a password off the command line)")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--trunk-depth", type=int, default=1)
    ap.add_argument("--stretch", type=int, default=64)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--retry-after", type=float, default=10.0, help="seconds in Retry-After during a take-over")
    ap.add_argument("--state-bucket", default="KVADVISOR_API",
                    help="JetStream KV bucket keeping the worker registrations across restarts")
    ap.add_argument("--state-replicas", type=int, default=1, choices=(1, 3),
                    help="replicas of that bucket when the API creates it (3 on a 3-node cluster)")
    a = ap.parse_args(argv)
    if not a.nats:
        ap.error("--nats or KVADVISOR_CLUSTER_NATS_URL is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    security = ApiSecuritySettings()
    try:
        check_bind(a.host, security)
    except InsecureBindError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    client = ClusterClient(a.nats, PartitionScheme(a.partitions, a.trunk_depth, a.stretch), a.namespace,
                           retry_after_s=a.retry_after)
    try:
        state = RegistrationBucket(client, a.namespace, a.state_bucket, a.state_replicas)
        app = create_app(ClusterQuery(client, state), security=security, bind_host=a.host)
    except ApiStateError as exc:
        print(f"error: {exc}", flush=True)
        client.close()
        return 2
    handle = serve_in_thread(app, a.host, a.port)
    print(f"api {handle.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    handle.stop()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
