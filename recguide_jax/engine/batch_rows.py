"""The per-request rows a batch's host arrays are built from, gathered once per batch composition.

A request's sampling row, its emission kind and its budget do not change while it runs, and in steady decoding the
batch is the same requests step after step. So the engine keeps the rows of the last few compositions (keyed by the
requests themselves: the key is built and compared without reading any request) and each step's arrays become
slices and gathers of them, not Python loops over requests (vLLM's persistent batch, for the parts that persist).
A cached composition can hold finished requests (a pipelined call's rows): the engine reads only its live rows.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from recguide_jax.engine import output
from recguide_jax.engine.requests import Request


@dataclasses.dataclass(frozen=True)
class BatchRows:
  """Rows 0..n-1 of a batch: each request's page-table row, sampling row and emission facts."""
  table_rows: np.ndarray  # [n] int64: each request's row of the allocator's page table (`PageAllocator.table_rows`)
  temperature: np.ndarray  # [n] float32
  top_k: np.ndarray  # [n] int32
  top_p: np.ndarray  # [n] float32
  seed: np.ndarray  # [n] uint32: the first word of each row's sampling key
  top_logprobs: np.ndarray  # [n] int32 (SamplingParams.logprobs; 0 none)
  has_controls: bool  # some row sets sampling controls (penalties, min_p, min_tokens, logit_bias)
  plain: np.ndarray  # [n] bool: `output.plain` (emission needs no per-token work)
  notify: np.ndarray  # [n] bool: the request has an update callback (`Request.on_update`)
  ignore_eos: np.ndarray  # [n] bool
  max_tokens: np.ndarray  # [n] int64


def gather_rows(reqs: Sequence[Request], table_rows: np.ndarray, tokenizer) -> BatchRows:
  """The rows of `reqs` (each with its sampling row converted: `Engine._sampling_ready`)."""
  rows = [r.sampling for r in reqs]
  n = len(reqs)
  return BatchRows(
      table_rows=table_rows,
      temperature=np.fromiter((s.temperature for s in rows), np.float32, n),
      top_k=np.fromiter((s.top_k for s in rows), np.int32, n),
      top_p=np.fromiter((s.top_p for s in rows), np.float32, n),
      seed=np.fromiter((s.seed for s in rows), np.uint32, n),
      top_logprobs=np.fromiter((r.params.logprobs or 0 for r in reqs), np.int32, n),
      has_controls=any(s.controls is not None for s in rows),
      plain=np.fromiter((output.plain(r, tokenizer) for r in reqs), bool, n),
      notify=np.fromiter((r.on_update is not None for r in reqs), bool, n),
      ignore_eos=np.fromiter((r.params.ignore_eos for r in reqs), bool, n),
      max_tokens=np.fromiter((r.params.max_tokens for r in reqs), np.int64, n))


class RowCache:
  """The rows of the most recent batch compositions (a step may run a few batches: one per round and block). The key
  is the requests' ids; an entry holds its requests, so no id of it can be reused by another object meanwhile."""

  def __init__(self, size: int = 8):
    self.size = size
    self._last: tuple = (None, None)  # (the last list asked for, its rows)
    self._rows: collections.OrderedDict[tuple, tuple[tuple, BatchRows]] = collections.OrderedDict()

  def get(self, reqs: Sequence[Request], build) -> BatchRows:
    """The rows of `reqs`, built by `build()` unless this composition is cached."""
    last, rows = self._last
    if reqs is last and len(reqs) == len(rows.table_rows):  # the same batch list again (a pipelined call's next)
      return rows
    key = tuple(map(id, reqs))  # no request is read
    hit = self._rows.get(key)
    if hit is None:
      # a composition holding a finished request is never asked for again (a batch takes running requests only):
      # its entry would only keep those requests, and their outputs, alive
      for dead in [k for k, (rs, _) in self._rows.items() if any(r.finish_reason is not None for r in rs)]:
        del self._rows[dead]
      hit = self._rows[key] = (tuple(reqs), build())
      if len(self._rows) > self.size:
        self._rows.popitem(last=False)
    else:
      self._rows.move_to_end(key)
    self._last = (reqs, hit[1])  # (a batch's list is not changed once built)
    return hit[1]

  def clear(self) -> None:
    self._rows.clear()
    self._last = (None, None)
