"""The HTTP surface: every router, the dependencies they share, the exception handlers.

Thin routes over the features below (``proxy.gateway``, ``proxy.data``, ``proxy.judge``,
``proxy.training``, ``proxy.admin``): a route validates, calls one service, wraps the result.
No feature imports this package. ``proxy._app`` runs every request past the ``Door`` (browsers,
foreign hosts, body size), mounts ``ROUTERS`` and hands the plain generation paths
(``GENERATION_PATHS``) to ``serve_generation`` before Starlette's middleware.
"""

from fastapi import APIRouter

from proxy.api import (
    _adapters,
    _admin,
    _admin_policies,
    _dashboard,
    _dashboard_actions,  # noqa: F401 (its routes join _dashboard.forms as it is imported)
    _dashboard_review,
    _data,
    _health,
    _judge,
    _openai,
)
from proxy.api._door import Door
from proxy.api._handlers import add_error_handlers
from proxy.api._openai import GENERATION_PATHS, serve_generation

ROUTERS: tuple[APIRouter, ...] = (
    _openai.router,
    _data.router,
    _admin.router,
    _admin_policies.router,
    _judge.router,
    _dashboard.router,
    _dashboard.forms,  # its routes are _dashboard_actions'
    _dashboard_review.router,
    _adapters.router,
    _health.router,
)

__all__ = ["GENERATION_PATHS", "ROUTERS", "Door", "add_error_handlers", "serve_generation"]
