"""OpenAI-compatible HTTP server over the engine (`launch/serve.py` is the entry point; `app.create_app`)."""
