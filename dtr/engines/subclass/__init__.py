"""The subclass engine: managed tensors are a Python wrapper subclass (``CheckpointTensor``)
seen by a dispatch mode, with a C++ fast path per op (csrc/subclass/) and either core.

- ``session.py``: ``Session``, the ``dtr.enable()`` block of this engine, and its mode.
- ``runtime.py``: ``Runtime``, which runs each op, records its lineage and evicts.
- ``tensor.py``: ``CheckpointTensor`` and the handles behind it.
- ``tensor_args.py``: one op call's tensor arguments and where each one sits.
- ``recipe.py``: how an op is rerun to rebuild its outputs.
- ``view_replay.py``, ``volatile.py``, ``rebuildable_plain.py``, ``storage_keys.py``,
  ``rng.py``, ``kernel_peaks.py``, ``oom.py``, ``trace.py``: the runtime's pieces.
- ``undispatched_reads.py``: composite ops that read memory without dispatching an op.

This file imports nothing: the engine loads with ``session.py``.
"""
