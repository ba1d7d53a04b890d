"""Serving: the engine behind an event loop (`async_engine.py`) and an OpenAI-compatible HTTP server."""
