"""REST API of kvadvisor: FastAPI app over an ``advisor.query.AdvisorQuery``, uvicorn in a thread."""

from api.app import ApiError, create_app
from api.dashboard import DashboardError, mount_dashboard
from api.server import ServerError, ServerHandle, serve_in_thread, serve_query

__all__ = [
    "ApiError",
    "DashboardError",
    "ServerError",
    "ServerHandle",
    "create_app",
    "mount_dashboard",
    "serve_in_thread",
    "serve_query",
]
