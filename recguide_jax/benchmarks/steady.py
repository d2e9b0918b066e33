"""Held-load comparison: policies side by side at several concurrency levels, each run a `run_steady` closed loop
timed over its held window, repeats interleaved across the policies, medians, and a paired interval of one target
policy (RecGuide) against the fastest baseline of each level and pooled over the levels.

Throughput here is window tokens per window second. Each policy decodes the same prompts in the same order and
greedy outputs are equal (checked), but the window's contents depend on when requests finish, so the comparison is
of throughputs, not of wall times of the same work."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

from recguide_jax.benchmarks import driver, stats


def held_load_comparison(llm, prompts_for_level: Callable[[int], list[list[int]]], params,
                         levels: Sequence[int], make_configs: Callable[[int], list[tuple[str, object]]],
                         repeats: int, baselines: Sequence[str], target: str, official: dict[int, str] | None = None,
                         before_run: Callable[[str], None] | None = None, log: Callable[[str], None] | None = print,
                         ) -> dict:
  """Runs every config of `make_configs(C)` [(name, policy)] `repeats` times at each level C over
  `prompts_for_level(C)`, interleaved (the order rotates by one each repeat, so no config always follows the same
  one), and returns {"results": rows, "levels": per-level comparisons, "pooled": target vs the fastest baseline
  pooled over levels (None with one repeat)}. `official[C]` names the config that is the official fixed-B recipe
  at C; `before_run(name)` is called after the policy is set and before each run."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  rows, level_rows = [], []
  for c in levels:
    prompts = prompts_for_level(c)
    configs = make_configs(c)
    names = [n for n, _ in configs]
    if target not in names or not any(b in names for b in baselines):
      raise ValueError(f"level {c} needs the target {target!r} and at least one of the baselines {list(baselines)}")
    runs: dict[str, list[driver.SteadyRun]] = {n: [] for n in names}
    for rep in range(repeats):
      k = rep % len(configs)
      for name, policy in configs[k:] + configs[:k]:
        llm.set_policy(policy)
        if before_run is not None:
          before_run(name)
        runs[name].append(driver.run_steady(llm.engine, prompts, params, c))
    reference = [r.output_ids for r in runs[names[0]][0].requests]
    by_name = {}
    for name, policy in configs:
      rr = runs[name]
      tps = [r.tokens_per_s for r in rr]
      last = rr[-1].requests
      blocks = [b for r in last for b in r.stats.block_sizes]
      row = dict(driver.summarize(last, statistics.median(r.wall_s for r in rr)), policy=name, concurrency=c,
                 requests=len(prompts), held_tokens_per_s=statistics.median(tps), held_tokens_per_s_all=tps,
                 window_s_all=[r.window_s for r in rr], window_tokens_all=[r.window_tokens for r in rr],
                 window_token_share=statistics.median(r.window_token_share for r in rr),
                 window_steps=statistics.median(r.window_steps for r in rr),
                 window_in_flight=[min(r.window_in_flight[0] for r in rr), max(r.window_in_flight[1] for r in rr)],
                 engine_in_flight=None if any(r.engine_in_flight is None for r in rr) else
                 [min(r.engine_in_flight[0] for r in rr), max(r.engine_in_flight[1] for r in rr)],
                 tokens_counted=[r.total_tokens for r in rr],
                 tokens_generated=[sum(len(q.output_ids) for q in r.requests) for r in rr],
                 lossless=all([q.output_ids for q in r.requests] == reference for r in rr),
                 official_fixed_b=official is not None and official.get(c) == name,
                 block_size_share={str(b): float(np.mean([x == b for x in blocks])) for b in (1, 8, 16, 32)}
                 if blocks else {}, regimes=dict(getattr(policy, "regime_counts", {})),
                 probes=getattr(policy, "probes", 0))
      rows.append(row)
      by_name[name] = row
      if log:
        log(f"C={c:<3} {name:<14} held {row['held_tokens_per_s']:8.1f} tok/s  (window: "
            f"{100 * row['window_token_share']:.0f}% of tokens, {row['window_steps']:.0f} steps)  TPF {row['tpf']:.2f}"
            f"  lossless={row['lossless']}")
    present = [b for b in baselines if b in by_name]
    best = max(present, key=lambda b: by_name[b]["held_tokens_per_s"])
    for row in by_name.values():
      row["vs_best_baseline_held"] = row["held_tokens_per_s"] / by_name[best]["held_tokens_per_s"]
    tgt = by_name[target]
    level = {"concurrency": c, "fastest_baseline": best, "official_fixed_b": (official or {}).get(c),
             "ratio_median": float(np.median(np.asarray(tgt["held_tokens_per_s_all"])
                                             / np.asarray(by_name[best]["held_tokens_per_s_all"])))}
    if repeats > 1:  # seconds per token: the interval's baseline/target ratio is then target/baseline throughput
      level["interval"] = stats.paired_ratio_interval(_inverse(tgt), _inverse(by_name[best]))
      official_name = level["official_fixed_b"]
      if official_name in by_name:
        level["vs_official_interval"] = stats.paired_ratio_interval(_inverse(tgt), _inverse(by_name[official_name]))
    level_rows.append(level)
  pooled = None
  if repeats > 1:
    by = {(r["policy"], r["concurrency"]): r for r in rows}
    pooled = stats.pooled_ratio_interval([(_inverse(by[(target, lv["concurrency"])]),
                                           _inverse(by[(lv["fastest_baseline"], lv["concurrency"])]))
                                          for lv in level_rows])
  return {"results": rows, "levels": level_rows, "pooled": pooled}


def _inverse(row: dict) -> list[float]:
  return [1.0 / t for t in row["held_tokens_per_s_all"]]


def markdown(result: dict, target: str) -> str:
  """The held-load table: one row per (C, policy), then the target vs the fastest baseline per level and pooled."""
  lines = ["| C | policy | held tok/s (median) | vs fastest baseline | window share of tokens | window steps | "
           "in flight (window) | TPF | tau | B share 1/8/16/32 | lossless |", "|" + "---|" * 11]
  for r in result["results"]:
    share = "/".join(f"{100 * r['block_size_share'].get(str(b), 0):.0f}" for b in (1, 8, 16, 32))
    name = r["policy"] + (" (official fixed B)" if r["official_fixed_b"] else "")
    lo, hi = r["window_in_flight"]
    in_flight = str(lo) if lo == hi else f"{lo}-{hi}"
    lines.append(f"| {r['concurrency']} | {name} | {r['held_tokens_per_s']:.1f} | {r['vs_best_baseline_held']:.3f}x | "
                 f"{100 * r['window_token_share']:.0f}% | {r['window_steps']:.0f} | {in_flight} | "
                 f"{r['tpf']:.2f} | {r['mean_accepted_length']:.2f} | {share or '-'} | {r['lossless']} |")
  lines += ["", f"| C | fastest baseline | {target} / it, median of paired repeats | paired interval (95%) | "
            f"{target} / official fixed B (95%) |", "|---|---|---|---|---|"]
  for lv in result["levels"]:
    iv, ov = lv.get("interval"), lv.get("vs_official_interval")
    fmt = lambda x: f"{x['geomean']:.3f}x ({x['ci95'][0]:.3f}-{x['ci95'][1]:.3f}) {x['verdict']}" if x else "-"
    lines.append(f"| {lv['concurrency']} | {lv['fastest_baseline']} | {lv['ratio_median']:.3f}x | {fmt(iv)} | "
                 f"{fmt(ov)} |")
  p = result.get("pooled")
  if p:
    lines.append(f"\n{target} vs the fastest baseline of each level, pooled over {len(result['levels'])} levels "
                 f"({p['repeats']} paired repeats): {p['geomean']:.3f}x (95% CI {p['ci95'][0]:.3f}-"
                 f"{p['ci95'][1]:.3f}), {p['verdict']}.")
  return "\n".join(lines) + "\n"
