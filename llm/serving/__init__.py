"""Serving: a continuous-batching engine over a paged KV cache (`engine.py`, `paged.py`),
the engine in a background thread with a bounded queue (`runner.py`) and an
OpenAI-compatible HTTP server over it (`server.py`; `python -m experiments.serve`)."""
