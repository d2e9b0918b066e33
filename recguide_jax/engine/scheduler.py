"""Admission and grouping: whether a request can ever be served (`validate`), which waiting requests join the
running batch (FIFO, while a batch slot and their worst-case KV pages are free), and how a step's plans become
batches (one per round and block size, LinearSS-style rounds of different planned blocks merged where the
strategy's cost model prices that cheaper)."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from recguide_jax.decoding.grouping import cheapest_runs
from recguide_jax.cache.kv_cache import PageAllocator
from recguide_jax.decoding.strategy import Round, RoundPlan
from recguide_jax.engine.requests import QueueFull, Request, RequestError, SamplingParams, describe


def check_queue(queued: int, max_queue: int) -> None:
  """The queue-full rule (the engine's, the data-parallel router's and the engine thread's inbox alike)."""
  if queued >= max_queue:
    raise QueueFull(f"the request queue is full ({max_queue} waiting)")


@dataclasses.dataclass
class Group:
  """Requests whose plans share a round, run at `block`; `planned[i]` is the block request i was planned at and
  `verify_price[i]` its plan's `RoundPlan.verify_price`."""
  round: Round
  block: int
  reqs: list
  planned: list[int]
  verify_price: list[float] = dataclasses.field(default_factory=list)


class Scheduler:
  """The waiting queue, the running batch and the KV pages pledged to it."""

  def __init__(self, allocator: PageAllocator, max_batch: int, max_block: int):
    self.allocator = allocator
    self.max_batch = max_batch
    self.max_block = max_block
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.pledged: dict[str, int] = {}  # worst-case pages promised to each running request

  def pages_needed(self, prompt_len: int, params: SamplingParams) -> int:
    # worst case: the whole generation plus one block written past it by a verify
    return self.allocator.pages_for(prompt_len + params.max_tokens + self.max_block)

  def validate(self, prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
               ) -> list[int]:
    """Checks that a request can ever be admitted (its fields, its prompt, its worst-case pages) without touching
    any state; returns the prompt as ints (the part `params.truncate_prompt_tokens` keeps). Raises RequestError
    naming the field."""
    params.validate(vocab_size)
    if isinstance(prompt_ids, (str, bytes)) or any(
        isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) for t in prompt_ids):
      raise RequestError("prompt must be a list of token ids (integers)", "prompt")
    prompt_ids = [int(t) for t in params.truncate(prompt_ids)]
    if not prompt_ids:
      raise RequestError("prompt must not be empty", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
      raise RequestError(f"prompt holds token id {describe(bad[0])} outside the vocabulary [0, {vocab_size})",
                         "prompt")
    if len(prompt_ids) >= max_model_len:
      raise RequestError(f"prompt has {len(prompt_ids)} tokens, max_model_len is {max_model_len}", "prompt", 413)
    if len(prompt_ids) + params.max_tokens > max_model_len:
      raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len {max_model_len}", "max_tokens")
    if self.pages_needed(len(prompt_ids), params) > self.allocator.num_pages - 1:
      raise RequestError("request needs more KV pages than the cache has", "max_tokens")
    return prompt_ids

  def admit(self) -> list[Request]:
    """Moves waiting requests into the running batch (FIFO: nothing overtakes the oldest); returns them, pages
    pledged and their slots taken (the caller adds them to the allocator)."""
    free_budget = self.allocator.num_pages - 1 - sum(self.pledged.values())
    admitted = []
    while self.waiting and len(self.running) < self.max_batch:
      req = self.waiting[0]
      need = self.pages_needed(len(req.prompt_ids), req.params)
      if need > free_budget:
        break
      self.waiting.popleft()
      free_budget -= need
      self.pledged[req.request_id] = need
      self.running.append(req)
      req.stats.queue_s = time.perf_counter() - req.arrival
      admitted.append(req)
    return admitted

  def release(self, req: Request) -> bool:
    """Drops `req`'s pledge; True if it held one (its pages are then the caller's to free)."""
    return self.pledged.pop(req.request_id, None) is not None

  def take_finished(self) -> list[Request]:
    done = [r for r in self.running if r.finished]
    if done:
      self.running = [r for r in self.running if not r.finished]
    return done


def group_plans(planned: list[tuple[Request, RoundPlan]], bucketing: bool | str,
                round_cost: Callable[[int, int], float | None]) -> list[Group]:
  """A step's plans as batches, in first-planned order: one per (round, block size), then rounds that allow it
  (`Round.pads_to_largest`) merged across block sizes: always (bucketing False), never (True), or as the cost
  model prices cheapest ("auto"); "ragged": every plan whose round runs as a ragged row joins one ragged round
  (`ragged_groups`)."""
  groups: dict[tuple, Group] = {}
  for req, plan in planned:
    g = groups.get((plan.round, plan.block_size))
    if g is None:
      g = groups[(plan.round, plan.block_size)] = Group(plan.round, plan.block_size, [], [])
    g.reqs.append(req)
    g.planned.append(plan.block_size)
    g.verify_price.append(plan.verify_price)
  out = list(groups.values())
  if bucketing == "ragged" and isinstance(bucketing, str):
    return ragged_groups(out)
  if bucketing is True:
    return out
  rounds = dict.fromkeys(g.round for g in out if g.round.pads_to_largest)
  for rnd in rounds:
    out = merge_groups(out, rnd, None if bucketing is False else round_cost)
  return out


def merge_groups(groups: list[Group], rnd, round_cost: Callable[[int, int], float | None] | None) -> list[Group]:
  """Merges `rnd`'s groups of different planned B into batches padded to their largest B; each request keeps at
  most its own planned B of the verified tokens. `round_cost=None` merges all of them (bucketing off, the paper's
  "+s_t"/"+z_t" rows). Otherwise every split of the B-sorted groups into consecutive runs is priced with
  round_cost(batch, B) (one round per run, at the run's largest B) and the cheapest wins, ties to separate
  buckets (`decoding.grouping.cheapest_runs`, which strategies price whole-step plans with); without a known cost
  the groups stay separate."""
  mine = sorted((g for g in groups if g.round is rnd), key=lambda g: g.block)
  if len(mine) <= 1:
    return groups
  if round_cost is None:
    best_runs = [list(range(len(mine)))]
  else:
    total, best_runs = cheapest_runs([len(g.reqs) for g in mine], [g.block for g in mine], round_cost)
    if total is None:
      return groups
  out = [g for g in groups if g.round is not rnd]
  for run in best_runs:
    blk = mine[run[-1]].block
    merged = Group(rnd, blk, [], [])
    for i in run:
      merged.reqs.extend(mine[i].reqs)
      merged.planned.extend(mine[i].planned)
      merged.verify_price.extend(mine[i].verify_price)
    out.append(merged)
  return out


def ragged_groups(groups: list[Group]) -> list[Group]:
  """Groups whose round runs as ragged rows (`Round.ragged_round`: LinearSS and AR) merged into one group of that
  ragged round whose rows keep their own planned blocks, when some row drafts (AR rows alone stay an AR round:
  its multi-step decode needs no draft); the other groups as they are."""
  out = list(groups)
  for ragged in dict.fromkeys(g.round.ragged_round for g in groups if g.round.ragged_round is not None):
    mine = [g for g in out if g.round.ragged_round is ragged]
    if not any(b > 1 for g in mine for b in g.planned):
      continue
    merged = Group(ragged, max(b for g in mine for b in g.planned), [], [])
    for g in mine:
      merged.reqs.extend(g.reqs)
      merged.planned.extend(g.planned)
      merged.verify_price.extend(g.verify_price)
    out = [g for g in out if g.round.ragged_round is not ragged] + [merged]
  return out
