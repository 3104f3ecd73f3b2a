"""Process-wide values computed once, under a lock: what the threads of one process share.

A cache belongs to one request, but the model, the registered attention and the tables of this package are shared
by every thread that serves requests in the process (transformers' streaming recipe runs ``generate`` in a thread
beside the streamer; small servers answer each request in a thread over one model). A value computed after import
is therefore either guarded (:func:`computed_once`, or a lock where it is written) or computed with no side effect
and never written in place after it is made (then two threads computing it at once both get a correct value).
Each such place in the package says which in a comment.
"""

from __future__ import annotations

import functools
import threading

__all__ = ["computed_once"]


def computed_once(fn):
    """``functools.cache`` whose computation runs in one thread at a time: a value that is expensive or has side
    effects (compiling and loading the native read-out, defining a ``torch.library`` operator, logging a warning)
    is computed once per process and arguments, and a thread that asks meanwhile waits for it. A value already
    computed is read without the lock. ``cache_clear()`` forgets every value (for tests),
    ``cache_size()`` counts them."""
    values: dict = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def call(*args):
        try:
            return values[args]
        except KeyError:
            pass
        with lock:
            if args not in values:
                values[args] = fn(*args)
            return values[args]

    call.cache_clear = values.clear
    call.cache_size = values.__len__  # entries held (scripts/soak.py watches every process-wide table)
    return call
