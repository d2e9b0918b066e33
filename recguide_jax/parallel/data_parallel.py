"""Data parallelism: `dp` groups, each a whole runner + engine on its own `tp` sub-mesh, behind one router.

Design: one step per group. Every group holds a copy of the weights (sharded over its tp devices) and its own KV
pages and page allocator; the router assigns each new request to the least-loaded group (running + waiting
requests, then KV pages in use), and `step` runs one engine iteration of every group that has work, the groups
concurrently from a thread each (a step's device work and its blocking result transfer release the GIL, so the
groups' programs overlap on their devices).

Why not one SPMD step with the batch and the page pool sharded over dp: a single program makes every group run
the same step kind, block size and batch bucket each round, and RecGuide chooses those per request and load (an
overlap round in one group while another runs B = 32 would pad both to the union of their step shapes, or wait for
each other). Separate programs keep each group's own bucket and regime, need no cross-group synchronisation per
round and reuse the single-group engine unchanged. What they cost is one host dispatch per group per round (not
measured against the single-program design: no multi-device accelerator was at hand).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from typing import Callable, Sequence

from recguide_jax.engine.requests import Request, SamplingParams
from recguide_jax.engine.scheduler import check_queue
from recguide_jax.parallel import sharding


def strategy_copy(strategy):
  """A group's own copy of a decoding strategy (`Strategy.clone`: its per-load calibration and controller state must
  not be shared by groups stepping concurrently)."""
  return strategy.clone()


def resolve_mesh(mesh, devices=None):
  """None, a spec string ('dp=2,tp=4'), a MeshShape or a Mesh -> a Mesh or None (one device, no mesh)."""
  if mesh is None or isinstance(mesh, sharding.Mesh):
    return mesh
  shape = sharding.parse_mesh(mesh) if isinstance(mesh, str) else mesh
  if not isinstance(shape, sharding.MeshShape):
    raise TypeError(f"mesh must be a spec string, a MeshShape or a jax Mesh, got {type(mesh).__name__}")
  return sharding.make_mesh(shape, devices)


def build_runners(model, runner_config, mesh) -> list:
  """One Runner per dp group of `mesh` (None: one runner on the model's device), each over the model's weights
  placed on its group's tp sub-mesh (a model already on a group's sub-mesh is used as it is)."""
  from recguide_jax.model.nld import shard_model
  from recguide_jax.runtime.runner import Runner
  if mesh is None:
    return [Runner(model, runner_config)]
  runners = []
  for sub in sharding.replica_meshes(mesh):
    placed = model if _on_mesh(model, sub) else shard_model(model, sub)
    runners.append(Runner(placed, runner_config, mesh=sub,
                          cache_sharding=sharding.cache_sharding(sub, placed.cfg.num_key_value_heads)))
  return runners


def _on_mesh(model, mesh) -> bool:
  import jax
  from flax import nnx
  leaf = jax.tree.leaves(nnx.state(model.embed_tokens, nnx.Param))[0]
  sh = getattr(leaf, "sharding", None)
  return isinstance(sh, sharding.NamedSharding) and sh.mesh == mesh


class ReplicaRunners:
  """The groups' runners seen as one for what callers ask of "the runner": warm-up (every group compiles its own
  variants; each group's executables are for its own devices), the compile counter, the config and cfg."""

  def __init__(self, runners: Sequence):
    self.runners = list(runners)

  def warmup(self, *args, **kwargs):
    seconds = {}
    for r in self.runners:
      seconds.update(r.warmup(*args, **kwargs))
    # the compile counter is process-wide: a group marked warm before the next group compiled would count those
    self.mark_warm()
    return seconds

  @property
  def compiles_after_warmup(self) -> int:
    # the counter is process-wide, so any group's figure already counts every group's compiles
    return max(r.compiles_after_warmup for r in self.runners)

  def mark_warm(self) -> None:
    for r in self.runners:
      r.mark_warm()

  def __getattr__(self, name):  # cfg, config, buckets, bucket_for, ...: the same on every group
    return getattr(self.runners[0], name)


class DataParallelEngine:
  """dp engines behind the `ServingEngine` protocol (engine/protocol.py) the LLM, `EngineThread` and the server
  use. A request lives in one group from admission to finish."""

  def __init__(self, engines: Sequence):
    if len(engines) < 2:
      raise ValueError("a data-parallel engine needs at least two groups")
    self.engines = list(engines)
    self.runner = ReplicaRunners([e.runner for e in self.engines])
    first = self.engines[0]
    # configured alike on every group (build_engine passes each the same options)
    self.cfg, self.rc, self.tokenizer, self.max_queue = first.cfg, first.rc, first.tokenizer, first.max_queue
    self._home: dict[str, int] = {}
    self._ids = itertools.count()
    self._pool = concurrent.futures.ThreadPoolExecutor(len(self.engines), thread_name_prefix="dp-step")

  # ---- routing -----------------------------------------------------------------------------------------------------
  def load(self, i: int) -> tuple[int, int]:
    e = self.engines[i]
    return len(e.running) + len(e.waiting), e.kv_pages()[0]

  def pick(self) -> int:
    """The least-loaded group: fewest running + waiting requests, then fewest KV pages in use, then the lowest id."""
    return min(range(len(self.engines)), key=lambda i: self.load(i) + (i,))

  def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    return self.engines[0].validate_request(prompt_ids, params)

  def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                  on_update: Callable | None = None, validated: bool = False, arrival: float | None = None,
                  prefill_source: str | None = None) -> Request:
    if not validated:
      prompt_ids = self.validate_request(prompt_ids, params)
    check_queue(len(self.waiting), self.max_queue)  # every group's queue, as one engine's queue would hold them
    # a sample of n joins the group of the sample whose prefill it shares (pages live in one group's cache)
    i = self._home.get(prefill_source) if prefill_source is not None else None
    i = self.pick() if i is None else i
    rid = request_id or f"req-{next(self._ids)}"  # unique across groups (each engine counts its own)
    req = self.engines[i].add_request(prompt_ids, params, rid, on_update, validated=True, arrival=arrival,
                                      prefill_source=prefill_source)
    self._home[req.request_id] = i
    return req

  def abort(self, request_id: str) -> bool:
    i = self._home.pop(request_id, None)
    return self.engines[i].abort(request_id) if i is not None else False

  def finish(self, r: Request, reason: str, error: str | None = None) -> None:
    i = self._home.pop(r.request_id, None)
    # a request no group admitted (its add failed) is finished by group 0: nothing of it is in any cache
    self.engines[0 if i is None else i].finish(r, reason, error)

  def fail_all(self, message: str) -> None:
    for e in self.engines:
      e.fail_all(message)
    self._home.clear()

  def step(self) -> list[Request]:
    """One iteration of every group with work, concurrently; the requests that finished in any of them."""
    busy = [e for e in self.engines if e.has_work()]
    if not busy:
      return []
    if len(busy) == 1:
      done = busy[0].step()
    else:
      done = [r for part in self._pool.map(lambda e: e.step(), busy) for r in part]
    for r in done:
      self._home.pop(r.request_id, None)
    return done

  @property
  def stalled_on_compile(self) -> bool:
    """Every group with work ran nothing in its last step: each waits for a background compile (a group that can
    run keeps the others stepping)."""
    busy = [e for e in self.engines if e.has_work()]
    return bool(busy) and all(e.stalled_on_compile for e in busy)

  def wait_for_compile(self, timeout: float) -> None:
    for e in self.engines:
      if e.has_work() and e.stalled_on_compile:
        e.wait_for_compile(timeout)
        return

  def reset_prefix_cache(self) -> bool:
    return all([e.reset_prefix_cache() for e in self.engines])

  def has_work(self) -> bool:
    return any(e.has_work() for e in self.engines)

  def run_until_done(self) -> None:
    while self.has_work():
      self.step()
      if self.stalled_on_compile:
        self.wait_for_compile(0.05)

  # ---- state over the groups ---------------------------------------------------------------------------------------
  @property
  def waiting(self) -> list[Request]:
    return [r for e in self.engines for r in e.waiting]

  @property
  def running(self) -> list[Request]:
    return [r for e in self.engines for r in e.running]

  @property
  def totals(self) -> collections.Counter:
    return sum((e.totals for e in self.engines), collections.Counter())

  @property
  def accepted_per_position(self) -> collections.Counter:
    return sum((e.accepted_per_position for e in self.engines), collections.Counter())

  @property
  def block_size_choices(self) -> collections.Counter:
    return sum((e.block_size_choices for e in self.engines), collections.Counter())

  def kv_pages(self) -> tuple[int, int]:
    used, usable = zip(*(e.kv_pages() for e in self.engines))
    return sum(used), sum(usable)

  @property
  def strategy(self):
    return self.engines[0].strategy

  @strategy.setter
  def strategy(self, strategy) -> None:
    for i, e in enumerate(self.engines):
      e.strategy = strategy if i == 0 else strategy_copy(strategy)

  @property
  def bucketing(self):
    """How the groups run a step's mixed block sizes (`EngineConfig.bucketing`), set on every group alike."""
    return self.engines[0].bucketing

  @bucketing.setter
  def bucketing(self, bucketing) -> None:
    for e in self.engines:
      e.bucketing = bucketing

  def close(self) -> None:
    self._pool.shutdown(wait=False)


def first_group(mesh):
  """The first dp group's sub-mesh (where a checkpoint is restored before the other groups copy it), or None."""
  return None if mesh is None else sharding.replica_meshes(mesh)[0]
