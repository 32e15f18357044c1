"""The OpenAI-compatible server: `eyas serve` (see docs/serving.md).

Imported lazily, so that `python -m eyas.serve.api_server` and a plain `import eyas.serve` stay light."""
from __future__ import annotations

__all__ = ["create_app", "add_serve_parser", "run_serve", "AsyncEngine"]


def __getattr__(name):
    if name in ("create_app", "add_serve_parser", "run_serve"):
        from eyas.serve import api_server
        return getattr(api_server, name)
    if name == "AsyncEngine":
        from eyas.serve.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
