"""reference.prefetch in isolation: what no conformance rule can see from outside a loader."""
from __future__ import annotations

import gc
import threading
import time
import weakref

from reference.prefetch import Prefetcher


class Item:
    pass


def test_stop_frees_the_items_the_queue_held():
    """A consumer that stops after one item: the receiver's queued items are dropped at stop(), not kept until
    the prefetcher itself is collected (an error's traceback keeps it alive in the caller's frames)."""
    made: list[weakref.ref] = []

    def source():
        for _ in range(50):
            item = Item()
            made.append(weakref.ref(item))
            yield item

    receiver = Prefetcher(source, window=4, wait_s=5.0, where="test").start()
    consumer = iter(receiver)
    first = next(consumer)
    deadline = time.monotonic() + 5
    while len(made) < 4 and time.monotonic() < deadline:  # the receiver fills its window
        time.sleep(0.005)
    assert len(made) == 4, f"the receiver took {len(made)} items, its window is 4"
    receiver.stop()
    receiver.join()
    gc.collect()
    alive = [i for i, ref in enumerate(made) if ref() is not None]
    assert alive == [0], f"items still referenced after stop(): {alive} (only the consumer's own, 0, may be)"
    assert receiver not in gc.garbage and first is not None
    assert not any(t.is_alive() for t in threading.enumerate() if t is receiver._thread)
