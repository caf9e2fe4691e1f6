"""The HTTP surface: every router, the dependencies they share, the exception handlers.

Thin routes over the features below (``proxy.gateway``, ``proxy.data``, ``proxy.judge``,
``proxy.training``, ``proxy.admin``): a route validates, calls one service, wraps the result.
No feature imports this package. ``proxy._app`` mounts ``ROUTERS`` and hands the plain
generation paths (``GENERATION_PATHS``) to ``serve_generation`` before Starlette's middleware.
"""

from fastapi import APIRouter

from proxy.api import _adapters, _admin, _dashboard, _dashboard_review, _data, _health, _judge, _openai
from proxy.api._handlers import add_error_handlers
from proxy.api._openai import GENERATION_PATHS, serve_generation

ROUTERS: tuple[APIRouter, ...] = (
    _openai.router,
    _data.router,
    _admin.router,
    _judge.router,
    _dashboard.router,
    _dashboard_review.router,
    _adapters.router,
    _health.router,
)

__all__ = ["GENERATION_PATHS", "ROUTERS", "add_error_handlers", "serve_generation"]
