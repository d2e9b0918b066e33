"""Benchmark helpers shared by the launch scripts: GSM8K prompts, a fixed-concurrency driver over the engine, and
the metrics (decode-only tokens per forward, mean accepted length, aggregate and per-request tokens/s)."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

import numpy as np

from recguide_jax.engine import SamplingParams


def gsm8k_prompts(path: str | pathlib.Path, n: int, tokenizer, offset: int = 0) -> list[list[int]]:
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"GSM8K file {path} not found (pass --data)")
  rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()][offset:offset + n]
  if tokenizer is None:
    raise ValueError("the checkpoint has no tokenizer; GSM8K prompts need one")
  return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["question"].strip()}]))
          for r in rows]


def run_concurrent(engine, prompts: list[list[int]], params: SamplingParams, concurrency: int):
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
    for k, v in r.stats.overlap.items():
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
  from recguide_jax.runner import fused_slots
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
  return total


def paired_tau_gain(per_request: dict[int, list[tuple[int, int]]], small: int, large: int, resamples: int = 2000,
                    seed: int = 0) -> dict:
  """tau(large) - tau(small) on the same prompts, with a 95% bootstrap interval over prompts (rounds of one
  prompt are not independent, prompts are). per_request[B][i] = (accepted tokens, rounds) of prompt i."""
  a = np.asarray(per_request[small], float)
  b = np.asarray(per_request[large], float)
  idx = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
  diffs = b[idx, 0].sum(1) / b[idx, 1].sum(1) - a[idx, 0].sum(1) / a[idx, 1].sum(1)
  lo, hi = np.percentile(diffs, [2.5, 97.5])
  return {"diff": float(b[:, 0].sum() / b[:, 1].sum() - a[:, 0].sum() / a[:, 1].sum()), "ci95": [float(lo), float(hi)],
          "prompts": len(a)}


def paired_wall_ratios(target_walls: list[float], baseline_walls: dict[str, list[float]]) -> list[float]:
  """Per repeat k: the best baseline's wall time in repeat k over the target's (> 1: the target was faster). Repeats
  run interleaved (A B C, A B C, ...), so a slow spell of the machine slows both sides of a pair alike; the same
  greedy tokens are generated by every config, so wall time ratios are throughput ratios."""
  n = len(target_walls)
  if not baseline_walls or any(len(w) != n for w in baseline_walls.values()):
    raise ValueError("every baseline needs one wall time per repeat of the target")
  return [min(w[k] for w in baseline_walls.values()) / target_walls[k] for k in range(n)]


def paired_ratio_interval(target_walls: list[float], baseline_walls: list[float], resamples: int = 2000,
                          seed: int = 0) -> dict:
  """Target vs ONE baseline over interleaved repeats: the geometric mean of the per-repeat ratios baseline wall /
  target wall (> 1: the target was faster) with a 95% bootstrap interval over repeats, and a verdict: "ahead" or
  "behind" when the interval excludes 1, else "tie" (the difference is within the machine's run-to-run noise)."""
  return pooled_ratio_interval([(target_walls, baseline_walls)], resamples, seed)


def pooled_ratio_interval(levels: list[tuple[list[float], list[float]]], resamples: int = 2000, seed: int = 0) -> dict:
  """`paired_ratio_interval` pooled over several levels [(target walls, baseline walls)], each level with its own
  baseline: the geometric mean of every per-repeat ratio, each level weighted equally, and a 95% interval from a
  bootstrap that resamples repeats within each level (levels are fixed, not sampled)."""
  logs = []
  for target_walls, baseline_walls in levels:
    t, b = np.asarray(target_walls, float), np.asarray(baseline_walls, float)
    if len(t) != len(b) or len(t) == 0:
      raise ValueError("need one baseline wall time per repeat of the target")
    logs.append(np.log(b / t))
  if not logs:
    raise ValueError("need at least one level")
  rng = np.random.default_rng(seed)
  boot = np.mean([l[rng.integers(0, len(l), (resamples, len(l)))].mean(1) for l in logs], axis=0)
  lo, hi = np.exp(np.percentile(boot, [2.5, 97.5]))
  verdict = "ahead" if lo > 1 else "behind" if hi < 1 else "tie"
  return {"geomean": float(np.exp(np.mean([l.mean() for l in logs]))), "ci95": [float(lo), float(hi)],
          "verdict": verdict, "repeats": sum(len(l) for l in logs)}


def write_report(result: dict, markdown: str, output_dir: str | os.PathLike, name: str) -> tuple[str, str]:
  """Writes a benchmark's `name`.json (the result) and `name`.md (its table) into `output_dir`; returns both paths."""
  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  js, md = out / f"{name}.json", out / f"{name}.md"
  js.write_text(json.dumps(result, indent=2) + "\n")
  md.write_text(markdown)
  return str(js), str(md)
