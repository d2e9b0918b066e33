"""OpenAI-compatible HTTP server over the engine (`launch/serve.py` is the entry point)."""

from recguide_jax.server.app import create_app

__all__ = ["create_app"]
