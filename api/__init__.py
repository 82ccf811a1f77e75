"""REST API of kvadvisor: FastAPI app over an ``advisor.ops.query.AdvisorQuery``, uvicorn in a thread.

Routes, scopes, paging and errors: docs/operations.md ("REST API"). The indexer-compatible
routes are :mod:`api.indexer`; auth is :mod:`api.auth`.
"""

from api.app import ApiError, create_app
from api.auth import ApiSecuritySettings
from api.indexer_registry import IndexerRegistry
from api.dashboard import DashboardError, mount_dashboard
from api.server import ServerError, ServerHandle, serve_in_thread, serve_query

__all__ = [
    "ApiError",
    "ApiSecuritySettings",
    "IndexerRegistry",
    "DashboardError",
    "ServerError",
    "ServerHandle",
    "create_app",
    "mount_dashboard",
    "serve_in_thread",
    "serve_query",
]
