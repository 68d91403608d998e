"""Allocation-heavy pure work without the cyclic garbage collector's passes.

Building, validating and simulating a large schedule makes hundreds of thousands of small
tuples and keeps them; each of the collector's passes walks all of them again, which more
than doubles the time of such work. None of it makes reference cycles, so nothing is lost
by pausing the collector while it runs.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic garbage collector off; restore its state afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
