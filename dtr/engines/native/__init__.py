"""The native engine: managed tensors are a C++ TensorImpl under a private dispatch key,
and every op is served in C++ (csrc/native/).

- ``session.py``: ``NativeSession``, ``enable()`` and ``is_managed()``, the engine's
  public entry points (``dtr.enable(engine="native")`` opens a ``NativeSession``).
- ``key.py``: the dispatch key the engine owns (PrivateUse3), and whether it is free.
- ``undispatched_reads.py``: tensor methods that read memory without dispatching an op.

This file imports nothing, so that the engine-choosing rule (``dtr/engines/__init__.py``)
can ask ``key.py`` without loading the engine.
"""
