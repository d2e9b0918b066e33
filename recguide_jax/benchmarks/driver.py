"""Closed-loop drivers over the engine and the per-run metrics (decode-only tokens per forward, mean accepted
length, aggregate and per-request tokens/s, profiled time of a forward ledger).

Two ways to keep C requests in flight:
- `run_concurrent` pushes a prompt set through a closed loop of C and times it to the last token, so the ramp-up
  (C requests prefilled together) and the drain (fewer than C left at the end) are part of the figure;
- `run_steady` does the same over more prompts but times only the held window in which exactly C requests are in
  flight and the synchronised first cohort is gone, so a level measures the load it names.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import numpy as np


def run_concurrent(engine, prompts: list[list[int]], params, concurrency: int):
  """Keeps `concurrency` requests in flight (a new one joins as soon as one finishes). Returns (requests, wall s)."""
  pending = list(enumerate(prompts))
  live, done = [], {}
  t0 = time.perf_counter()
  while pending or live:
    while pending and len(live) < concurrency:
      i, p = pending.pop(0)
      live.append((i, engine.add_request(p, params)))
    engine.step()
    still = []
    for i, r in live:
      (done.__setitem__(i, r) if r.finished else still.append((i, r)))
    live = still
  wall = time.perf_counter() - t0
  return [done[i] for i in range(len(prompts))], wall


@dataclasses.dataclass(frozen=True)
class SteadyRun:
  """One closed-loop run of `run_steady`: its requests (in prompt order) and the held window.

  The window opens at the first engine step that starts after every request of the first cohort (the C requests
  admitted together at the start, whose prefills and early rounds are synchronised) has finished, and closes after
  the last step that starts with C requests in flight (later steps are the drain). Its time runs from the refill
  before its first step to the end of its last step, so the host work of admitting the replacements counts."""
  requests: list
  concurrency: int
  wall_s: float  # the whole run, ramp-up and drain included
  total_tokens: int  # tokens emitted, counted step by step over the whole run
  window_s: float
  window_tokens: int  # tokens emitted by the window's steps
  window_steps: int
  window_in_flight: tuple[int, int]  # (min, max) requests in flight at the start of a window step
  engine_in_flight: tuple[int, int] | None  # the same as the engine saw it (running during the step), if exposed

  @property
  def tokens_per_s(self) -> float:
    return self.window_tokens / self.window_s if self.window_s else 0.0

  @property
  def window_token_share(self) -> float:
    return self.window_tokens / self.total_tokens if self.total_tokens else 0.0


def run_steady(engine, prompts: list[list[int]], params, concurrency: int) -> SteadyRun:
  """A closed loop of `concurrency` requests over `prompts` (a finished request is replaced before the next engine
  step), timed over the held window only (see `SteadyRun`). Raises ValueError when there are too few prompts for a
  window (the first cohort must finish while prompts are still waiting)."""
  if concurrency < 1:
    raise ValueError(f"concurrency must be >= 1, got {concurrency}")
  pending = collections.deque(enumerate(prompts))
  live: list[tuple[int, object]] = []
  done: dict[int, object] = {}
  cohort: set[int] = set()
  # per step: loop start (before the refill), step end, requests in flight, engine's running count, tokens emitted,
  # and whether the first cohort had finished before the step started
  steps: list[tuple[float, float, int, int | None, int, bool]] = []
  t_run = time.perf_counter()
  while pending or live:
    t_loop = time.perf_counter()
    while pending and len(live) < concurrency:
      i, p = pending.popleft()
      live.append((i, engine.add_request(p, params)))
      if not steps:
        cohort.add(i)
    cohort_gone = bool(steps) and not cohort
    before = [len(r.output_ids) for _, r in live]
    finished = engine.step()
    running = getattr(engine, "running", None)  # requests still running after the step, plus those it finished
    engine_count = len(running) + len(finished) if running is not None and finished is not None else None
    emitted = sum(len(r.output_ids) - b for (_, r), b in zip(live, before))
    still = []
    for i, r in live:
      if r.finished:
        done[i] = r
        cohort.discard(i)
      else:
        still.append((i, r))
    steps.append((t_loop, time.perf_counter(), len(live), engine_count, emitted, cohort_gone))
    live = still
  wall = time.perf_counter() - t_run
  first = next((k for k, s in enumerate(steps) if s[5]), None)
  last = max((k for k, s in enumerate(steps) if s[2] == concurrency), default=None)
  if first is None or last is None or last < first:
    raise ValueError(f"no held window at concurrency {concurrency} over {len(prompts)} prompts: the first cohort "
                     "must finish while prompts are still waiting; use more prompts per level")
  window = steps[first:last + 1]
  counts = [s[3] for s in window]
  reqs = [done[i] for i in range(len(prompts))]
  return SteadyRun(requests=reqs, concurrency=concurrency, wall_s=wall, total_tokens=sum(s[4] for s in steps),
                   window_s=window[-1][1] - window[0][0], window_tokens=sum(s[4] for s in window),
                   window_steps=len(window), window_in_flight=(min(s[2] for s in window), max(s[2] for s in window)),
                   engine_in_flight=None if None in counts else (min(counts), max(counts)))


def summarize(reqs, wall_s: float) -> dict:
  tokens = sum(len(r.output_ids) for r in reqs)
  decode_fw = sum(r.stats.decode_forwards for r in reqs)
  accepted = [a for r in reqs for a in r.stats.accepted_lengths]
  per_req = [len(r.output_ids) / r.stats.latency_s for r in reqs if r.stats.latency_s]
  return {
      "requests": len(reqs), "generated_tokens": tokens, "wall_s": wall_s,
      "tokens_per_s": tokens / wall_s if wall_s else 0.0,
      "per_request_tokens_per_s": float(np.mean(per_req)) if per_req else 0.0,
      "decode_forwards": decode_fw,
      # per request, like the paper's decode-only TPF: tokens after the prefill's first token / decode forwards
      "tpf": float(np.mean([(len(r.output_ids) - 1) / r.stats.decode_forwards for r in reqs
                            if r.stats.decode_forwards])) if decode_fw else 0.0,
      "mean_accepted_length": float(np.mean(accepted)) if accepted else 0.0,
      "rounds": len(accepted),
  }


def overlap_counts(reqs) -> dict[str, int]:
  """The overlap branch outcome counters (Table 3) summed over requests."""
  out: dict[str, int] = {}
  for r in reqs:
    for k, v in getattr(r.strategy_state, "overlap", {}).items():
      out[k] = out.get(k, 0) + v
  return out


def median_runs(fn, repeats: int) -> tuple[list, dict]:
  """Runs fn() -> (reqs, wall) `repeats` times; returns the last requests and the summary of the median-wall run."""
  return median_of([fn() for _ in range(repeats)])


def median_of(runs: list[tuple[list, float]]) -> tuple[list, dict]:
  """The last run's requests and their summary at the median wall time of `runs` [(reqs, wall)]."""
  walls = [w for _, w in runs]
  med = statistics.median(walls)
  reqs, _ = runs[-1]
  out = summarize(reqs, med)
  out["wall_s_all"] = walls
  return reqs, out


def loop_share(outputs: list[list[int]], min_period: int = 1, max_period: int = 16, min_repeats: int = 3) -> float:
  """Share of outputs that end in a repetition loop: the tail repeats a period-k pattern >= min_repeats times."""
  def looped(ids):
    for k in range(min_period, max_period + 1):
      tail = ids[-k * min_repeats:]
      if len(tail) == k * min_repeats and all(tail[j] == tail[j % k] for j in range(len(tail))):
        return True
    return False
  return float(np.mean([looped(o) for o in outputs])) if outputs else 0.0


def priced_ms(forward_log, profile) -> float:
  """Decode-only profiled time of a run from the engine's forward ledger (`Engine.forward_log`): every forward
  charged by `profile` at its own batch size and kind (prefill excluded)."""
  from recguide_jax.runtime.step_key import fused_slots
  total = 0.0
  for kind, blk, rows in forward_log:
    if kind == "draft":
      total += profile.forward_costs(rows, blk)[0]
    elif kind in ("verify", "gverify"):
      total += profile.forward_costs(rows, blk)[1]
    elif kind.startswith("fused"):
      total += profile.fused_cost(rows, blk, fused_slots(kind))
    elif kind == "decode":
      total += profile.ar_cost(rows)
    elif kind in ("ragged_draft", "ragged_verify"):  # blk: the packed query tokens of the forward
      total += profile.ragged_cost(rows, blk, kind == "ragged_draft")
  return total


def unverified_drafts(forward_log) -> int:
  """Drafted tokens of a run's ragged steps that no verify ran (0 unless verifies were truncated), from the
  engine's forward ledger: a ragged verify runs each drafting row's block and one token per AR row."""
  totals = {k: [0, 0] for k in ("ragged_draft", "ragged_verify")}
  for kind, tokens, rows in forward_log:
    if kind in totals:
      totals[kind][0] += tokens
      totals[kind][1] += rows
  (drafted, drafting), (verified, rows) = totals["ragged_draft"], totals["ragged_verify"]
  return drafted + (rows - drafting) - verified


def split_sequential_ledger(forward_log) -> list[list]:
  """A forward ledger of requests run one after another (concurrency 1) cut into one ledger per request: each
  starts at its prefill (one or more chunks). Per-prompt priced times are what a bootstrap over prompts resamples.
  A forward of more than one row means requests overlapped: there is no per-request cut, ValueError."""
  out: list[list] = []
  last = None
  for entry in forward_log:
    kind, _, rows = entry
    if rows != 1:
      raise ValueError(f"a {kind} forward of {rows} rows: the requests did not run one after another")
    if kind == "prefill" and last != "prefill":
      out.append([])
    if not out:
      raise ValueError("the ledger does not start with a prefill")
    out[-1].append(entry)
    last = kind
  return out


VERIFICATIONS = ("verify", "gverify")  # forward kinds that verify a block; "fused*" (verify + branches) too


def ledger_counts(forward_log) -> dict[str, int]:
  """Decode forwards of a forward ledger (`Engine.forward_log`) by role: "draft", "verify" (a fused verify +
  branches forward counts here), "decode" (AR steps) and "forwards", their total (prefill excluded, as in TPF);
  "saved_drafts": verifications that ran without a draft forward of their own (an overlap branch was reused)."""
  counts = {"draft": 0, "verify": 0, "decode": 0}
  for kind, _, _ in forward_log:
    if kind == "draft" or kind == "decode":
      counts[kind] += 1
    elif kind == "ragged_draft":
      counts["draft"] += 1
    elif kind in VERIFICATIONS or kind.startswith("fused") or kind == "ragged_verify":
      counts["verify"] += 1
  counts["forwards"] = counts["draft"] + counts["verify"] + counts["decode"]
  counts["saved_drafts"] = counts["verify"] - counts["draft"]
  return counts
