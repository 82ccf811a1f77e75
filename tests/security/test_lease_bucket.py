"""A deleted lease bucket is re-created, over a real JetStream: someone with JetStream rights
deletes ``KVADVISOR_LEASES`` under running advisors (on main every later round failed and
no partition was ever owned again); the keepers bind a new bucket, take the partitions
again, and no partition has two owners."""

from __future__ import annotations

import asyncio
import uuid

import nats
from security_helpers import wait_for

from advisor.cluster.leases import LeaseKeeper, LeaseSettings, lease_owners

P = 4


def test_a_deleted_lease_bucket_is_recreated_and_owned_again(js_url: str) -> None:
    bucket = "L" + uuid.uuid4().hex[:10]
    s = LeaseSettings(partitions=P, ttl_s=2.0, heartbeat_s=0.4, bucket=bucket, join_delay_s=0)
    ks = [LeaseKeeper(js_url, f"adv-{i}", s).start() for i in range(2)]
    try:
        wait_for(lambda: len(lease_owners(js_url, bucket)) == P, timeout=20, what="every partition owned")

        async def delete() -> None:
            nc = await nats.connect(js_url)
            await nc.jetstream().delete_key_value(bucket)
            await nc.close()

        asyncio.run(delete())
        wait_for(lambda: sum(k.counters["errors"] for k in ks) > 0, timeout=20, what="a failed round")

        def owned_again() -> bool:
            try:
                owners = lease_owners(js_url, bucket)
            except Exception:  # noqa: BLE001 - the bucket is not back yet
                return False
            sets = [k.owned() for k in ks]
            return len(owners) == P and sum(map(len, sets)) == P and set().union(*sets) == set(range(P))

        wait_for(owned_again, timeout=30, what="every partition owned again, once")
    finally:
        for k in ks:
            k.stop()
