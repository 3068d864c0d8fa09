"""Which session is open in this process, of either engine: one at a time.

The two engines do not nest, and each refuses to open while the other's session is open,
so both read and set these under one lock. They live apart from either engine so that
each engine's session and ``dtr.session`` (which opens either) can import them.
"""

from __future__ import annotations

import threading

lock = threading.Lock()
subclass = None  # the open dtr.engines.subclass.session.Session, if any
native = None  # the open dtr.engines.native.session.NativeSession, if any


def current():
    """The open session of either engine, if any."""
    return subclass if subclass is not None else native
