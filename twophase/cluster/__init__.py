"""Engines on Ray: replicas behind one OpenAI endpoint, or prefill and decode on different
workers with the prompt's K/V pulled between them.

- ``host.py``: one engine in a Ray worker (an ``EngineLoop`` over an ``LLM``), what both a
  replica and a prefill or decode worker are.
- ``workers.py``: the replicas as a Ray Serve deployment (``router.py`` sends a request to the
  replica most likely to hold its prompt's prefix), and prefill and decode workers as actors.
- ``transport.py``: K/V blocks through Ray's object store (``KVTransport``).
- ``frontend.py``: ``ClusterLoop``, what the HTTP layer (``twophase.server.app``) talks to.
- ``board.py``: the workers' Prometheus figures, gathered for ``/metrics``.
- ``launch.py``: start (or join) the Ray cluster, the workers, and stop them.
"""
