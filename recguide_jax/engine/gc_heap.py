"""Python's cyclic garbage collector in a serving process: the start-up heap frozen, and its pauses measured.

After start-up a server's heap holds a few hundred thousand long-lived objects (jax, flax, the model's modules and
compiled steps). Python's oldest-generation collection walks all of them: a 100-300 ms pause every few seconds of
decoding, inside whatever step it lands in (an inter-token latency spike for every running request). Freezing the
heap once start-up is done moves those objects out of the collector's reach (CPython's `gc.freeze`, as vLLM does
after its engine starts); garbage made later is collected as before.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_heap() -> int:
  """Collects what start-up left as garbage, then freezes every surviving object; returns how many were frozen.
  For a long-lived process with one engine: frozen objects that later become cyclic garbage are never freed."""
  gc.collect()
  gc.freeze()
  return gc.get_freeze_count()


class GCPauses:
  """Counts the collector's runs and their seconds per generation while entered (`gc.callbacks`)."""

  def __init__(self):
    self.runs = [0, 0, 0]
    self.seconds = [0.0, 0.0, 0.0]
    self.longest = 0.0
    self._start = 0.0

  def _callback(self, phase: str, info: dict) -> None:
    if phase == "start":
      self._start = time.perf_counter()
      return
    dt = time.perf_counter() - self._start
    g = info["generation"]
    self.runs[g] += 1
    self.seconds[g] += dt
    self.longest = max(self.longest, dt)

  def __enter__(self) -> "GCPauses":
    gc.callbacks.append(self._callback)
    return self

  def __exit__(self, *exc) -> None:
    gc.callbacks.remove(self._callback)
