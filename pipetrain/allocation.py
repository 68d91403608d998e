"""Allocation-heavy pure work without the cyclic garbage collector's passes.

Building, validating and simulating a large schedule makes hundreds of thousands of small
tuples and keeps them; each of the collector's passes walks all of them again, which more
than doubles the time of such work. None of it makes reference cycles, so nothing is lost
by pausing the collector while it runs. What the work made and kept is then handed to the
oldest generation at once: left in the youngest, the first allocation after the pause would
walk all of it (a tenth of a large schedule's build), and walk it again a generation later.
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
            # freeze then unfreeze moves every tracked object to the oldest generation
            # without visiting it; skipped where a caller froze objects on purpose
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
