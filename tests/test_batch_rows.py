import numpy as np

from recguide_jax.engine.batch_rows import RowCache, gather_rows
from recguide_jax.engine.requests import Request, SamplingParams, sampling_row


def _request(i: int, **params) -> Request:
  p = SamplingParams(**{"max_tokens": 10 + i, **params})
  r = Request(f"r{i}", [1, 2, 3], p)
  r.sampling = sampling_row(p, 7 + i, r.prompt_ids, (0,))
  return r


def test_gather_rows_reads_each_request_once_into_arrays():
  reqs = [_request(0), _request(1, temperature=0.7, top_k=5, top_p=0.9, logprobs=2),
          _request(2, ignore_eos=True, stop=["x"]), _request(3, presence_penalty=0.5)]
  reqs[2].on_update = lambda r, new: None
  rows = gather_rows(reqs, np.array([4, 0, 2, 1]), tokenizer=object())
  assert rows.table_rows.tolist() == [4, 0, 2, 1]
  np.testing.assert_allclose(rows.temperature, [1, 0.7, 1, 1])  # vLLM's default temperature is 1
  assert rows.top_k.tolist()[1] == 5 and rows.top_logprobs.tolist() == [0, 2, 0, 0]
  assert rows.seed.tolist() == [r.sampling.seed for r in reqs]
  # logprobs and stop strings (with a tokenizer) need per-token emission; ignore_eos and budgets are per row
  assert rows.plain.tolist() == [True, False, False, True]
  assert rows.notify.tolist() == [False, False, True, False]  # an update callback is called per step
  assert rows.ignore_eos.tolist() == [False, False, True, False]
  assert rows.max_tokens.tolist() == [10, 11, 12, 13]
  assert rows.has_controls and not gather_rows(reqs[:3], np.arange(3), None).has_controls


def test_row_cache_is_keyed_by_the_requests_themselves():
  reqs = [_request(i) for i in range(3)]
  built = []
  cache = RowCache(size=2)

  def build(rs):
    built.append(tuple(r.request_id for r in rs))
    return gather_rows(rs, np.arange(len(rs)), None)

  first = cache.get(reqs, lambda: build(reqs))
  assert cache.get(list(reqs), lambda: build(reqs)) is first  # another list of the same requests: a hit
  cache.get(reqs[::-1], lambda: build(reqs[::-1]))  # another order is another batch
  # equal-looking requests that are other objects miss
  twins = [_request(i) for i in range(3)]
  cache.get(twins, lambda: build(twins))
  assert len(built) == 3
  # the least recently used composition was evicted (size 2); the entry kept its requests alive meanwhile
  cache.get(reqs, lambda: build(reqs))
  assert len(built) == 4


def test_row_cache_lets_go_of_finished_requests():
  """A composition with a finished request is never batched again: the next miss drops it (and its requests)."""
  import gc
  import weakref
  cache = RowCache(size=8)
  old = [_request(i) for i in range(3)]
  cache.get(old, lambda rows=old: gather_rows(rows, np.arange(3), None))
  old[1].finish_reason = "stop"
  alive = weakref.ref(old[1])
  running = [old[0], old[2]]
  cache.get(running, lambda: gather_rows(running, np.arange(2), None))
  del old
  gc.collect()
  assert alive() is None
  assert cache.get(list(running), lambda: None) is not None  # the running composition stays cached
