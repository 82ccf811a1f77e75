"""Fast-tier eviction policies replayed by the evaluator (``kvadvisor evaluate``).

One module per policy; each exposes ``simulate(trace, capacity) -> hits per request`` over
a :class:`~advisor.policy.eviction.compact.CompactTrace` (dense block ids, one flat array), and its
kernel is compiled with numba so that a 15-million-reference trace replays in seconds.

Hit rule (docs/traces.md): the longest prefix of a request's blocks held before the request
is served; every block of the request is then referenced first to last.

Registry: :data:`advisor.policy.eviction.registry.POLICIES`.
"""
