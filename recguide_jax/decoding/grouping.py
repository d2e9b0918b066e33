"""How requests planned at different block sizes share batches: the cheapest split of the block sizes (sorted) into
consecutive runs, each run one batch padded to its largest block. The engine groups a step's plans with it
(`engine.scheduler.merge_groups`) and a strategy that prices whole-step plans (RecGuide's controller) prices them
with it, so both see the same cost of a mixed batch."""

from __future__ import annotations

import itertools
from typing import Callable, Mapping, Sequence


def cheapest_runs(sizes: Sequence[int], blocks: Sequence[int], round_cost: Callable[[int, int], float | None]
                  ) -> tuple[float | None, list[list[int]]]:
  """(total cost, runs) of the cheapest split of groups into consecutive runs.

  sizes[i] requests are planned at blocks[i] (blocks ascending, distinct); a run [i, ..., j] is one round of
  sum(sizes[i..j]) rows at blocks[j], priced round_cost(rows, block). Ties keep more (separate) runs. The total is
  None when round_cost has no price for some run (the caller then keeps the groups separate)."""
  n = len(sizes)
  if n != len(blocks) or n == 0:
    raise ValueError(f"need one size per block and at least one group, got sizes {list(sizes)}, blocks "
                     f"{list(blocks)}")
  if n == 1:  # one group is one batch: no split to search (a fixed plan, every row at one block)
    return round_cost(sizes[0], blocks[0]), [[0]]
  best, best_runs = None, [[i] for i in range(n)]
  for cuts in itertools.product((False, True), repeat=n - 1):  # cuts[i - 1]: a new run starts at group i
    runs = [[0]]
    for i in range(1, n):
      if cuts[i - 1]:
        runs.append([i])
      else:
        runs[-1].append(i)
    costs = [round_cost(sum(sizes[i] for i in run), blocks[run[-1]]) for run in runs]
    if any(c is None for c in costs):
      return None, [[i] for i in range(n)]
    total = sum(costs)
    if best is None or total < best - 1e-12 or (abs(total - best) <= 1e-12 and len(runs) > len(best_runs)):
      best, best_runs = total, runs
  return best, best_runs


def plan_cost(counts: Mapping[int, int], round_cost: Callable[[int, int], float | None]) -> float | None:
  """The cost of one step planned as `counts` (rows per block), batched the cheapest way (`cheapest_runs`)."""
  blocks = sorted(counts)
  if not blocks:
    return 0.0
  return cheapest_runs([counts[b] for b in blocks], blocks, round_cost)[0]
