"""Scaled mode: advisors that each own partitions of the index (leases, replicas, movers, expiry).

``python -m advisor.cluster`` runs one cluster advisor (:func:`main`).  Modules: ``node``
(:class:`ClusterNode`, :class:`ClusterClient`), ``parts`` (the settings, the partition
replica and what the parts see of the node), ``leases``, ``partition_fold``, ``mover``,
``expiry``, ``metrics``, ``query`` (the API's view of a cluster, ``ClusterQuery``).  The
cluster's REST API is ``python -m api.cluster_api``.
"""

from advisor.cluster.node import (
    ClusterClient,
    ClusterNode,
    ClusterSettings,
    PartitionUnavailable,
    main,
    query_subject,
)

__all__ = [
    "ClusterClient",
    "ClusterNode",
    "ClusterSettings",
    "main",
    "PartitionUnavailable",
    "query_subject",
]
