"""Operator dashboard: one static HTML page that polls the JSON API.

``mount_dashboard(app)`` adds to an app built by :func:`api.app.create_app`:

==================================  ===============================================
``GET /dashboard``                  the page (HTML)
``GET /dashboard/static/{file}``    its CSS and JS, served from ``api/static/``
==================================  ===============================================

The page is plain HTML + CSS + vanilla JS, with uPlot (npm ``uplot``, MIT licence) vendored in
``api/static/vendor/`` for the history charts: no CDN, no build step, nothing fetched at
run time except the app's own ``/v1/stats``, ``/v1/volumes``, ``/v1/plans`` (every
``POLL_INTERVAL_MS``) and ``POST /v1/lookup`` (the lookup box).  It uses relative URLs,
so it also works when the app is served under a path prefix.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""Directory of the page and its assets."""

DASHBOARD_PATH = "/dashboard"
STATIC_PATH = "/dashboard/static"
POLL_INTERVAL_MS = 2000
"""How often the page polls the API (the value is also set in ``dashboard.js``)."""

_PAGE = "dashboard.html"
_ASSETS = ("dashboard.html", "dashboard.css", "dashboard.js", "dashboard_charts.js", "vendor/uPlot.iife.min.js",
           "vendor/uPlot.min.css", "vendor/uPlot.LICENSE")


class DashboardError(RuntimeError):
    """The dashboard's static files are missing (broken install) or its path is taken."""


def mount_dashboard(app: FastAPI) -> None:
    """Add ``GET /dashboard`` and its static assets to ``app``; a second call is a no-op.

    Args:
        app: the FastAPI app of :func:`api.app.create_app` (the page calls its ``/v1`` routes).

    Raises:
        DashboardError: an asset is missing from ``api/static/`` (package data not
            installed), or ``app`` has a ``/dashboard`` route that is not the dashboard's.
    """
    if getattr(app.state, "dashboard_mounted", False):
        return
    missing = [name for name in _ASSETS if not (STATIC_DIR / name).is_file()]
    if missing:
        raise DashboardError(f"dashboard assets missing from {STATIC_DIR}: {missing} (is api/static installed?)")
    taken = [p for r in app.routes if (p := getattr(r, "path", None)) in (DASHBOARD_PATH, STATIC_PATH)]
    if taken:
        raise DashboardError(f"app already serves {taken}; the dashboard needs {DASHBOARD_PATH} and {STATIC_PATH}")
    page = STATIC_DIR / _PAGE

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    def dashboard() -> FileResponse:
        # no-cache: after an upgrade the browser revalidates instead of showing an old page
        return FileResponse(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    app.mount(STATIC_PATH, StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    app.state.dashboard_mounted = True
