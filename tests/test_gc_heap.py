"""The start-up heap frozen out of Python's collector (launch/serve.py), and the collector's pauses measured."""

import gc
import weakref

from recguide_jax.engine.gc_heap import GCPauses, freeze_startup_heap


class _Node:

  def __init__(self):
    self.me = self  # a reference cycle: only the collector frees it


def test_frozen_heap_still_collects_later_garbage_and_pauses_are_counted():
  before = _Node()
  try:
    assert freeze_startup_heap() > 0
    gc.collect()
    assert gc.get_freeze_count() > 0  # frozen objects are outside every generation: a full collection skips them
    frozen = weakref.ref(before)
    del before
    gc.collect()
    assert frozen() is not None  # frozen before it became garbage: never freed (why only a server's start-up heap)
    later = weakref.ref(_Node())
    with GCPauses() as pauses:
      gc.collect()
    assert later() is None  # made after the freeze: collected as usual
    assert pauses.runs == [0, 0, 1] and pauses.seconds[2] > 0 and pauses.longest == pauses.seconds[2]
    assert pauses._callback not in gc.callbacks
  finally:
    gc.unfreeze()  # the suite's later modules free their compiled programs by collection (conftest)
