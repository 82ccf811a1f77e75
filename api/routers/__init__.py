"""The REST API's routes, one ``APIRouter`` module per area (:func:`api.app.create_app` assembles them).

``blocks`` (blocks, lookups, locations), ``volumes`` (volumes, segments, register, drain),
``plans`` (plans, a policy round now, invalidate), ``stats`` (stats and health), ``metrics``
(Prometheus); the indexer-compatible routes are :mod:`api.indexer`, the dashboard
:mod:`api.dashboard`.  Each router takes the advisor's query interface and the ``read`` /
``admin`` scope dependencies (:mod:`api.auth`).
"""
