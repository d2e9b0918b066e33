"""RecGuide vs AR vs fixed-B LinearSS, measured side by side in one run on this machine, at several concurrency
levels; every run is also priced with a hardware profile measured elsewhere (default: the paper's B200 table) to
report tokens per unit of profiled time, the paper's own objective. Greedy outputs are checked against AR.

  python launch/bench_recguide.py --concurrency 1,2,4,8,16,32 --num_prompts 32 --max_tokens 128

--mode=set (the default) pushes the --num_prompts prompts through a closed loop of C requests and times it to the
last token, so the drain (fewer than C requests left at the end) is part of every level. --mode=steady holds the
load instead: each level runs max(--num_prompts, --steady_requests_per_slot * C) requests through a closed loop of C
(a finished request is replaced before the next engine step) and times only the window in which C requests are in
flight, from the first step after the first cohort (the C requests that start together) has finished to the last
step that starts with C in flight (recguide_jax/benchmarks/driver.py, `run_steady`). RecGuide, AR and fixed-B
LinearSS 8/16/32 (one of which is the official fixed-B recipe at each C) run side by side, repeats interleaved, with
the medians and a paired bootstrap interval of RecGuide vs the fastest baseline per level and pooled over levels:

  python launch/bench_recguide.py --mode=steady --concurrency 1,2,4,8,16,32 --repeats 5 --profile docs/profile_cpu.json

With --ablations (the default) it adds a RecGuide row that never measures a regime it has not run (its price stays
the profile's); without --profile RecGuide prices with generic costs, how a profile-less deployment starts
(docs/bench_recguide_steady_noprofile.md).

--mode=priced judges by the price alone: AR and fixed-B LinearSS 8/16/32 run once per level (greedy runs repeat
exactly, so their forward ledgers do too) and, for each profile of --price_profiles, RecGuide deciding with that
profile (no wall-clock calibration); every run's ledger is priced with every profile, so RecGuide@P is compared with
every fixed alternative priced by the same P:

  python launch/bench_recguide.py --mode=priced --price_profiles=b200_nld8b,docs/profile_cpu.json --output_dir=docs

With --unseen (the default) it also runs C = 1 on prompt sets the tables were not fitted on
(`recguide_jax.benchmarks.unseen`: the shipped word problems and far GSM8K train questions): LinearSS B = 8 and 16 and
RecGuide deciding with each profile, reported beside GSM8K test's C = 1 as tokens per decode forward and the priced
ratio to LinearSS B = 16, so a controller that keeps overlap's gain only on its fitting set shows. Each ratio there
carries a 95% interval from a bootstrap over the set's prompts; --c1_samples adds further GSM8K samples to that table
(how far the ratio moves between samples of one distribution).

Reports go to --output_dir (default runs/bench_recguide): bench_recguide.{json,md}, bench_recguide_steady.{json,md}
or bench_recguide_priced.{json,md}. --mode=set's report also holds the overlap rows' branch coverage and reuse (the
paper's Table 3), the Table 5 (overlap parts) and Table 6 (adaptive B: padded, bucketed, cost-aware grouping,
ragged steps, ragged with verify truncation) ablation rows, and the throughput frontiers across C (the paper's
Figure 5; bench_recguide_frontier_{wall,priced}.png); --report_from=bench_recguide.json rewrites them from a run.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402
from recguide_jax.benchmarks.report import kept_notes  # noqa: E402
from recguide_jax.parallel import multihost as distributed  # noqa: E402

# --tensor_parallel_size/--data_parallel_size/--mesh (one host; on simulated CPU devices set XLA_FLAGS first)
distributed.define_mesh_flags()

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("test", num_prompts=32, max_tokens=128)
flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32"], "Concurrency levels.")
flags.DEFINE_integer("repeats", 1, "Repeats per point; the median wall time is reported.")
flags.DEFINE_string("profile", None, "Profile of THIS machine for RecGuide's switch (launch/profile.py output).")
flags.DEFINE_string("recguide_tables", None, "RecGuide's fitted adaptive-B tables JSON (default: the checkpoint's, "
                    "if any).")
flags.DEFINE_string("price_profile", "b200_nld8b", "Profile used to price the runs (name or path).")
flags.DEFINE_float("delta", None, "Margin threshold of risky draft positions (default: the tables' fitted "
                   "overlap_delta, else 0.5).")
flags.DEFINE_bool("ablations", True, "Also run the Table 5 (overlap) and Table 6 (adaptive) ablation rows; "
                  "--mode=steady: a RecGuide row without first measurements of the regimes it never ran.")
flags.DEFINE_enum("mode", "set", ["set", "steady", "priced"], "set: the prompt set through a closed loop of C, timed "
                  "to the last token; steady: a held load of C requests, timed over the window with C in flight; "
                  "priced: every run priced with each of --price_profiles (see above).")
flags.DEFINE_list("price_profiles", ["b200_nld8b"], "--mode=priced: the profiles (names or paths) RecGuide decides "
                  "with and every run is priced with.")
flags.DEFINE_bool("unseen", True, "--mode=priced: also run C = 1 on prompt sets the tables were not fitted on "
                  "(recguide_jax.benchmarks.unseen), --num_prompts of each.")
flags.DEFINE_list("c1_samples", [], "--mode=priced: further GSM8K samples run at C = 1 like the unseen sets, each "
                  "SPLIT@OFFSET (test@200: --num_prompts test questions from 200), to show how far the C = 1 ratio "
                  "moves between prompt samples of one distribution.")
flags.DEFINE_string("report_from", None, "--mode=set: write bench_recguide.md and its plots from this "
                    "bench_recguide.json instead of running.")
flags.DEFINE_integer("steady_requests_per_slot", 8, "--mode=steady: requests per level = max(--num_prompts, this * C) "
                     "(GSM8K questions, reused in turn if the file has fewer).")
cli.define_output_flags("bench_recguide")

# Table 6 rows: one mixed batch padded to the largest planned B, one batch per B, or per step whichever the policy's
# cost model prices cheaper (the engine's default, used by every other row)
BUCKETING = {"adaptive no bucketing": False, "adaptive + bucketing": True, "adaptive + ragged steps": "ragged",
             "adaptive + ragged, verify truncation": "ragged"}
# rows compared on this machine's wall clock (repeated --repeats times); every other row is priced (run once)
BASELINE_ROWS = ("ar", "linear B=8", "linear B=16", "linear B=32")
WALL_ROWS = BASELINE_ROWS + ("recguide",)
NO_FIRST_MEASUREMENTS = "recguide, no first measurements"  # --mode=steady ablation row
OFFICIAL_B = {1: 32, 2: 32, 4: 32, 8: 16, 16: 16, 32: 16, 64: 8, 128: 8}


def main(argv):
  del argv
  cli.quiet_logging()
  import numpy as np
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.recguide import profile as prof_lib
  from recguide_jax.recguide.controller import RecGuideStrategy
  if FLAGS.report_from:  # --mode=set's report from an earlier run's JSON
    with open(FLAGS.report_from) as f:
      return write_set_report(json.load(f))
  levels = cli.int_list("concurrency")
  if FLAGS.repeats < 1 or FLAGS.num_prompts < 1 or FLAGS.max_tokens < 1 or FLAGS.steady_requests_per_slot < 1:
    sys.exit("error: --repeats, --num_prompts, --max_tokens and --steady_requests_per_slot must be >= 1")
  data = cli.data_path()
  price = prof_lib.load_profile(FLAGS.price_profile)
  local = prof_lib.load_profile(FLAGS.profile) if FLAGS.profile else None
  llm = LLM(FLAGS.model, policy="ar", block_sizes=(8, 16, 32), max_num_seqs=max(levels),
            max_model_len=FLAGS.max_model_len, warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype,
            mesh=distributed.mesh_from_flags())
  from recguide_jax.recguide import adaptive
  tables = None
  tables_path = FLAGS.recguide_tables
  if tables_path is None:  # the tables shipped beside the checkpoint (the bundled one by default)
    from recguide_jax import llm as llm_lib
    found = adaptive.tables_path(FLAGS.model or str(llm_lib.default_checkpoint()))
    tables_path = str(found) if found else None
  if tables_path:
    tables = adaptive.load_tables(tables_path)
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)

  def recguide(profile=None, **kw):
    # on this machine's profile the switch calibrates with the wall clock; priced for another device it must not
    kw.setdefault("calibrate", profile is None)
    return RecGuideStrategy(16, delta=FLAGS.delta, profile=profile or local, tables=tables, **kw)

  default = recguide()  # the delta, planner and tree width the checkpoint's tables resolve to
  # the checkpoint's kinds plus the Table 5 rows' 3-slot tree (the paper's) and the Table 6 rows' ragged steps
  ablation_kinds = ("fused3", "ragged") if FLAGS.ablations and FLAGS.mode == "set" else ()
  if FLAGS.mode != "priced":  # priced runs are judged by their ledgers, not timed: variants compile as first used
    llm.runner.warmup(default.step_kinds() + ablation_kinds, (8, 16, 32))
  if FLAGS.mode == "steady":
    return held_load(llm, recguide, default, levels, params, data, tables_path)
  if FLAGS.mode == "priced":
    return priced(llm, recguide, levels, params, data, tables_path)
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer)

  results = []
  ar_outputs = {}
  for c in levels:
    configs = [("ar", ARStrategy())] + [(f"linear B={b}", LinearStrategy(b)) for b in (8, 16, 32)]
    # the controller decides with this machine's profile (wall clock) and, separately, with the pricing profile
    # (what it would do on that hardware; the run is then priced with the same profile)
    configs.append(("recguide", recguide()))
    configs.append((f"recguide@{price.name or 'price'}", recguide(profile=price)))
    if FLAGS.ablations and c == 1:  # Table 5: overlap components switched on in turn
      configs += [("overlap +1st corr", recguide(fixed_regime="overlap", planner="no_p3", components=("p1",))),
                  ("overlap +2nd corr", recguide(fixed_regime="overlap", planner="no_p3", components=("p1", "p2"))),
                  ("overlap +continuation", recguide(fixed_regime="overlap", planner="no_p3")),
                  ("overlap expected-hit planner", recguide(fixed_regime="overlap", planner="expected_hit",
                                                            overlap_slots=3, prefix_exponent=1.0))]
      slots, gamma = default.overlap_slots, default.prefix_exponent  # fitted for the checkpoint (fit_delta.py)
      if slots != 3:
        configs.append((f"overlap expected-hit, {slots} slots",
                        recguide(fixed_regime="overlap", planner="expected_hit", overlap_slots=slots,
                                 prefix_exponent=1.0)))
      if gamma != 1.0:
        configs.append((f"overlap expected-hit, {slots} slots, prefix exponent {gamma:g}",
                        recguide(fixed_regime="overlap", planner="expected_hit", overlap_slots=slots,
                                 prefix_exponent=gamma)))
    if FLAGS.ablations and c > 1 and tables is not None:  # Table 6 rows (no bucketing = padded mixed batches)
      # the paper's per-request rule as it is (batch_priced=False): what bucketing and grouping do to it
      table6 = dict(profile=price, fixed_regime="adaptive", overlap=False, batch_priced=False)
      configs += [("adaptive no bucketing", recguide(**table6)), ("adaptive + bucketing", recguide(**table6)),
                  ("adaptive + cost-aware grouping", recguide(**table6)),
                  ("adaptive + ragged steps", recguide(**table6)),  # ours: one draft + verify forward per step
                  ("adaptive + ragged, verify truncation", recguide(verify_truncation=True, **table6))]
    # repeats are interleaved across configs so a slow spell of the machine hits every config alike, and the order
    # of the wall-clock rows rotates by one each repeat (A B C, B C A, C A B, ...) so that no config always runs
    # right after the same (heavier or lighter) one; rows judged by their price or tokens per forward only (greedy
    # runs repeat exactly) run once, in the first repeat
    runs = {name: [] for name, _ in configs}
    logs = {name: [] for name, _ in configs}
    wall_configs = [(name, policy) for name, policy in configs if name in WALL_ROWS]
    for rep in range(FLAGS.repeats):
      k = rep % len(wall_configs)
      order = wall_configs[k:] + wall_configs[:k]
      for name, policy in order + ([(n, p) for n, p in configs if n not in WALL_ROWS] if rep == 0 else []):
        llm.set_policy(policy)
        llm.engine.bucketing = BUCKETING.get(name, "auto")
        llm.reset_prefix_cache()  # every config starts from the same cache (see `priced`)
        llm.engine.forward_log = []
        runs[name].append(bench.run_concurrent(llm.engine, prompts, params, c))
        logs[name] += llm.engine.forward_log
        llm.engine.forward_log = None
    for name, policy in configs:
      reqs, summary = bench.median_of(runs[name])
      log = logs[name]
      outs = [r.output_ids for r in reqs]
      if name == "ar":
        ar_outputs[c] = outs
      blocks = [b for r in reqs for b in r.stats.block_sizes]
      overlap = bench.overlap_counts(reqs)
      per_run_ms = bench.priced_ms(log, price) / len(runs[name])
      summary.update(
          policy=name, concurrency=c, lossless=all([r.output_ids for r in rr] == ar_outputs[c] for rr, _ in runs[name]),
          block_size_share={str(b): float(np.mean([x == b for x in blocks])) for b in (1, 8, 16, 32)} if blocks
          else {}, overlap=overlap, regimes=dict(getattr(policy, "regime_counts", {})),
          probes=getattr(policy, "probes", 0),
          priced_ms=per_run_ms, priced_tokens_per_ms=summary["generated_tokens"] / per_run_ms if per_run_ms else 0)
      results.append(summary)
      print(f"C={c:<3} {name:<24} {summary['tokens_per_s']:8.1f} tok/s  TPF {summary['tpf']:.2f}  "
            f"tau {summary['mean_accepted_length']:.2f}  priced {summary['priced_tokens_per_ms']:.3f} tok/ms  "
            f"lossless={summary['lossless']}", flush=True)
  by = {(r["policy"], r["concurrency"]): r for r in results}
  for r in results:
    c = r["concurrency"]
    fixed = by.get((f"linear B={OFFICIAL_B.get(c, 16)}", c))
    best = max((by[(p, c)] for p in BASELINE_ROWS if (p, c) in by),
               key=lambda x: x["tokens_per_s"])
    r["vs_best_baseline_wall"] = r["tokens_per_s"] / best["tokens_per_s"]
    if r["policy"] in WALL_ROWS and FLAGS.repeats > 1:  # the same ratio per interleaved repeat
      base = {p: by[(p, c)]["wall_s_all"] for p in BASELINE_ROWS if (p, c) in by}
      paired = bench.paired_wall_ratios(r["wall_s_all"], base)
      r["vs_best_baseline_wall_paired"] = {"median": float(np.median(paired)), "min": min(paired),
                                           "max": max(paired), "all": paired}
      # against the one baseline that is fastest by its median, with a bootstrap interval over the repeats:
      # whether a gap is real or within the machine's run-to-run noise
      r["vs_best_baseline_wall_interval"] = dict(bench.paired_ratio_interval(r["wall_s_all"], best["wall_s_all"]),
                                                 baseline=best["policy"])
    r["vs_official_fixed_priced"] = r["priced_tokens_per_ms"] / fixed["priced_tokens_per_ms"] if fixed else None
    r["tpf_vs_linear16"] = r["tpf"] / by[("linear B=16", c)]["tpf"]
  # RecGuide against the fastest baseline of each level, pooled over the levels: a small gap that no single level
  # resolves through the machine's noise can still show here
  pooled = None
  levels_iv = [(r["wall_s_all"], by[(r["vs_best_baseline_wall_interval"]["baseline"], r["concurrency"])]["wall_s_all"])
               for r in results if r["policy"] == "recguide" and "vs_best_baseline_wall_interval" in r]
  if levels_iv:
    pooled = bench.pooled_ratio_interval(levels_iv)
  meta = {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": FLAGS.num_prompts,
          "max_tokens": FLAGS.max_tokens, "repeats": FLAGS.repeats, "price_profile": FLAGS.price_profile,
          "local_profile": FLAGS.profile, "recguide_tables": tables_path,
          "delta": default.delta, "planner": default.planner, "overlap_slots": default.overlap_slots,
          "prefix_exponent": default.prefix_exponent,
          "compiles_after_warmup": llm.runner.compiles_after_warmup, **_host_meta(llm)}
  write_set_report({"meta": meta, "results": results, "recguide_vs_best_baseline_wall_pooled": pooled})


def write_set_report(report: dict) -> None:
  """--mode=set's bench_recguide.json and .md: the table, the overlap rows' branch coverage and reuse (the paper's
  Table 3) and the throughput frontiers (Figure 5: aggregate against per-request speed across C, on this machine's
  wall clock and priced) as PNGs beside it."""
  from recguide_jax.benchmarks import report as rep
  meta, results, pooled = report["meta"], report["results"], report.get("recguide_vs_best_baseline_wall_pooled")
  out_json, out_md = cli.report_path("bench_recguide.json"), cli.report_path("bench_recguide.md")
  with open(out_json, "w") as f:
    json.dump(report, f, indent=2)
  lines = ["| C | policy | tok/s | per-req tok/s | TPF | tau | vs best baseline (wall) | paired vs that baseline: "
           "geomean (95% CI) | priced tok/ms | vs official fixed B (priced) | B share 1/8/16/32 | lossless |",
           "|" + "---|" * 12]
  for r in results:
    share = "/".join(f"{100 * r['block_size_share'].get(str(b), 0):.0f}" for b in (1, 8, 16, 32))
    vs = f"{r['vs_official_fixed_priced']:.2f}x" if r["vs_official_fixed_priced"] else "-"
    paired = r.get("vs_best_baseline_wall_paired")
    wall = f"{r['vs_best_baseline_wall']:.2f}x" + (f" (per repeat {paired['min']:.2f}-{paired['max']:.2f})"
                                                     if paired else "")
    iv = r.get("vs_best_baseline_wall_interval")
    interval = (f"{iv['geomean']:.2f}x ({iv['ci95'][0]:.2f}-{iv['ci95'][1]:.2f}) {iv['verdict']}"
                if iv and iv["baseline"] != r["policy"] else "-")
    lines.append(f"| {r['concurrency']} | {r['policy']} | {r['tokens_per_s']:.1f} | "
                 f"{r['per_request_tokens_per_s']:.1f} | {r['tpf']:.2f} | {r['mean_accepted_length']:.2f} | "
                 f"{wall} | {interval} | {r['priced_tokens_per_ms']:.3f} | {vs} | {share} | "
                 f"{r['lossless']} |")
  if pooled:
    n_levels = sum(1 for r in results if r["policy"] == "recguide" and "vs_best_baseline_wall_interval" in r)
    lines.append(f"\nRecGuide vs the fastest baseline of each level, pooled over {n_levels} levels "
                 f"({pooled['repeats']} paired repeats): {pooled['geomean']:.3f}x (95% CI {pooled['ci95'][0]:.3f}-"
                 f"{pooled['ci95'][1]:.3f}), {pooled['verdict']}.")
  overlap = [(f"{r['policy']} (C = {r['concurrency']})", r["overlap"]) for r in results if r.get("overlap")]
  if overlap:
    lines += ["", "Overlap rounds by how they ended (the paper's Table 3): coverage = a planned branch covered the "
              "round's end (the rejected position, or the token after a block accepted whole); reuse = that branch "
              "became the next round's draft (its draft forward saved).", ""] + rep.overlap_reuse_table(overlap)
  plots = {}
  for key, x, y, xlabel, ylabel in (
      ("wall", "per_request_tokens_per_s", "tokens_per_s", "per-request speed (tokens/s)",
       "aggregate throughput (tokens/s)"),
      ("priced", None, "priced_tokens_per_ms", "per-request priced speed (tokens/ms, aggregate / C)",
       f"aggregate priced throughput (tokens/ms, {meta.get('price_profile')})")):
    series: dict = {}
    for r in results:  # RecGuide as it decides for this machine on the wall clock, for the pricing profile priced
      if r["policy"] in BASELINE_ROWS or (r["policy"] == "recguide" if key == "wall"
                                          else r["policy"].startswith("recguide@")):
        per_request = r[x] if x else r[y] / r["concurrency"]
        series.setdefault(r["policy"], []).append((per_request, r[y], f"C={r['concurrency']}"))
    name = f"bench_recguide_frontier_{key}.png"
    plots[key] = rep.plot_frontier(series, cli.report_path(name), xlabel, ylabel,
                                   f"Throughput vs per-request speed across C ({key})")
    lines += ["", f"![throughput frontier, {key}]({name})"]
  notes = kept_notes(out_md)
  with open(out_md, "w") as f:
    f.write(f"GSM8K test, {meta['num_prompts']} prompts, greedy, max {meta['max_tokens']} new tokens; wall clock on "
            f"this machine, priced with `{meta['price_profile']}`.\n\n" + "\n".join(lines) + "\n" + notes)
  print("\n".join(lines))
  print(f"wrote {out_json}, {out_md} and {', '.join(plots.values())}")


def _host_meta(llm) -> dict:
  """Where and when the figures were taken: wall-clock ratios compare only within a run, absolute tok/s only on
  the same CPU model (this repo's VMs have changed model and speed between sessions)."""
  import time

  import jax

  from recguide_jax.runtime import host_cpu
  return {"cpu_model": host_cpu.cpu_model(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "jax_backend": jax.default_backend(), "decode_steps": llm.runner.config.decode_steps,
          "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def held_load(llm, recguide, default, levels, params, data, tables_path):
  """--mode=steady: RecGuide vs AR and fixed-B LinearSS under a held load of C requests per level."""
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.benchmarks import steady
  need = max(max(FLAGS.num_prompts, FLAGS.steady_requests_per_slot * c) for c in levels)
  questions = bench.gsm8k_prompts(data, need, llm.tokenizer)
  prompts = [questions[i % len(questions)] for i in range(need)]  # the same prompts in the same order everywhere

  def configs(c):  # fresh policies per level: RecGuide's online calibration starts over at each load
    rows = ([("ar", ARStrategy())] + [(f"linear B={b}", LinearStrategy(b)) for b in (8, 16, 32)]
            + [("recguide", recguide())])
    if FLAGS.ablations:
      trusting = recguide()
      trusting.explore_margin = float("inf")  # a regime it never ran keeps the price the profile gives it
      rows.append((NO_FIRST_MEASUREMENTS, trusting))
    return rows

  def before_run(name):
    llm.engine.bucketing = "auto"
    llm.reset_prefix_cache()  # every config starts from the same cache (see `priced`)

  result = steady.held_load_comparison(
      llm, lambda c: prompts[:max(FLAGS.num_prompts, FLAGS.steady_requests_per_slot * c)], params, levels, configs,
      FLAGS.repeats, baselines=BASELINE_ROWS, target="recguide",
      official={c: f"linear B={OFFICIAL_B.get(c, 16)}" for c in levels}, before_run=before_run,
      log=lambda line: print(line, flush=True))
  result["meta"] = {"mode": "steady", "checkpoint": str(FLAGS.model or "bundled"), "data": data,
                    "num_prompts": FLAGS.num_prompts, "steady_requests_per_slot": FLAGS.steady_requests_per_slot,
                    "max_tokens": FLAGS.max_tokens, "repeats": FLAGS.repeats, "local_profile": FLAGS.profile,
                    "recguide_tables": tables_path, "delta": default.delta, "planner": default.planner,
                    "compiles_after_warmup": llm.runner.compiles_after_warmup, **_host_meta(llm),
                    "window": "from the first engine step after the first cohort of C requests has finished to the "
                              "last step that starts with C requests in flight"}
  table = steady.markdown(result, "recguide")
  out_json = cli.report_path("bench_recguide_steady.json")
  out_md = cli.report_path("bench_recguide_steady.md")
  with open(out_json, "w") as f:
    json.dump(result, f, indent=2)
  with open(out_md, "w") as f:
    f.write(f"Held load (`--mode=steady`): GSM8K test, max(--num_prompts={FLAGS.num_prompts}, "
            f"{FLAGS.steady_requests_per_slot} x C) requests per level through a closed loop of C, greedy, max "
            f"{FLAGS.max_tokens} new tokens, {FLAGS.repeats} interleaved repeats; throughput = tokens emitted in the "
            "window with C requests in flight (after the first cohort, before the drain) / its wall time, on this "
            "machine.\n\n" + table)
  print(table)
  print(f"wrote {out_json} and {out_md}")


def priced(llm, recguide, levels, params, data, tables_path):
  """--mode=priced: RecGuide deciding with each pricing profile against AR and every fixed-B LinearSS, all priced by
  that profile from their forward ledgers."""
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.recguide import profile as prof_lib
  # device-only prices credit none of the host time a pipelined call hides, so they must not charge its waste
  # either: the call run ahead after a request's last one (an EOS the host had not read yet) is device work no
  # decoding method needs, and it fell on the fixed policies only (RecGuide's speculative rounds do not run ahead)
  llm.engine.pipeline = False
  profiles = {}
  for spec in FLAGS.price_profiles:
    path = spec if os.path.exists(spec) else os.path.join(ROOT, spec)
    prof = prof_lib.load_profile(path if os.path.exists(path) else spec)
    profiles[prof.name or os.path.splitext(os.path.basename(spec))[0]] = prof
  samples = []  # --c1_samples as (split, offset), checked before the long runs
  for spec in FLAGS.c1_samples:
    split, _, offset = spec.partition("@")
    if split not in ("test", "train") or not offset.isdigit():
      sys.exit(f"error: --c1_samples entries are SPLIT@OFFSET with SPLIT test or train, got {spec!r}")
    samples.append((split, int(offset)))
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer)
  fixed = ("ar", "linear B=8", "linear B=16", "linear B=32")
  rows = []
  ledgers_at_1 = None  # GSM8K test's C = 1 runs, for the unseen prompt sets' table
  for c in levels:
    configs = ([("ar", ARStrategy())] + [(f"linear B={b}", LinearStrategy(b)) for b in (8, 16, 32)]
               + [(f"recguide@{name}", recguide(profile=prof)) for name, prof in profiles.items()])
    ledgers, ar_out = {}, None
    for name, policy in configs:
      llm.set_policy(policy)
      llm.engine.bucketing = "auto"
      # a prompt whose prefix is cached prefills at once, which changes how the decode steps batch: the config run
      # after another on the same prompts would decode differently (at C = 32 fixed B = 8 priced 4.339 warm, 4.263
      # cold), so every config starts from an empty prefix cache
      llm.reset_prefix_cache()
      llm.engine.forward_log = []
      reqs, _ = bench.run_concurrent(llm.engine, prompts, params, c)
      outs = [r.output_ids for r in reqs]
      ar_out = outs if name == "ar" else ar_out
      ledgers[name] = (llm.engine.forward_log, sum(len(o) for o in outs), outs == ar_out,
                       dict(getattr(policy, "regime_counts", {})),
                       [b for r in reqs for b in r.stats.block_sizes], [len(o) for o in outs])
      llm.engine.forward_log = None
    if c == 1:
      ledgers_at_1 = ledgers
    for pname, prof in profiles.items():
      rates = {}
      for name in fixed + (f"recguide@{pname}",):
        log, tokens, lossless, regimes, blocks, _ = ledgers[name]
        ms = bench.priced_ms(log, prof)
        rates[name] = tokens / ms
        rows.append({"price_profile": pname, "concurrency": c, "policy": name, "generated_tokens": tokens,
                     "priced_ms": ms, "priced_tokens_per_ms": tokens / ms, "lossless": lossless, "regimes": regimes,
                     "block_size_share": {str(b): blocks.count(b) / len(blocks) for b in (1, 8, 16, 32)}
                     if blocks else {}})
      best = max(fixed, key=lambda n: rates[n])
      official = f"linear B={OFFICIAL_B.get(c, 16)}"
      for r in rows[-len(rates):]:
        r.update(best_fixed=best, vs_best_fixed=r["priced_tokens_per_ms"] / rates[best],
                 vs_official_fixed=r["priced_tokens_per_ms"] / rates[official])
      rg = rows[-1]
      print(f"C={c:<3} priced with {pname}: recguide {rg['priced_tokens_per_ms']:.3f} tok/ms, best fixed {best} "
            f"{rates[best]:.3f} ({rg['vs_best_fixed']:.3f}x), official {official} ({rg['vs_official_fixed']:.3f}x), "
            f"lossless={rg['lossless']}", flush=True)
  unseen_rows = []  # C = 1: GSM8K test (the runs above) beside the prompt sets the tables were not fitted on
  if FLAGS.unseen:
    from recguide_jax.benchmarks import unseen
    sets = {"gsm8k_test": ledgers_at_1} if ledgers_at_1 else {}
    for set_name, set_prompts in unseen.prompt_sets(FLAGS.num_prompts, llm.tokenizer, FLAGS.gsm8k_dir).items():
      sets[set_name] = c1_ledgers(llm, recguide, profiles, set_prompts, params)
  else:
    sets = {"gsm8k_test": ledgers_at_1} if ledgers_at_1 and samples else {}
  for split, offset in samples:
    set_prompts = bench.gsm8k_prompts(bench.gsm8k_file(split, FLAGS.gsm8k_dir), FLAGS.num_prompts, llm.tokenizer,
                                      offset=offset)
    sets[f"gsm8k_{split}@{offset}"] = c1_ledgers(llm, recguide, profiles, set_prompts, params)
  for set_name, ledgers in sets.items():
    for pname, prof in profiles.items():
      unseen_rows.append(c1_row(set_name, pname, prof, ledgers))
      u = unseen_rows[-1]
      print(f"C=1 {set_name} priced with {pname}: tokens per forward linear B=16 "
            f"{u['linear16_tokens_per_forward']:.2f}, recguide {u['recguide_tokens_per_forward']:.2f}; recguide vs "
            f"linear B=16 {u['recguide_vs_linear16']:.3f}x (priced), lossless={u['lossless']}", flush=True)
  command = ("python launch/bench_recguide.py --mode=priced --price_profiles=" + ",".join(FLAGS.price_profiles)
             + f" --concurrency={','.join(map(str, levels))} --num_prompts={FLAGS.num_prompts} "
             f"--max_tokens={FLAGS.max_tokens} --output_dir=docs"
             + (f" --c1_samples={','.join(FLAGS.c1_samples)}" if FLAGS.c1_samples else ""))
  meta = {"mode": "priced", "checkpoint": str(FLAGS.model or "bundled"), "data": data,
          "num_prompts": FLAGS.num_prompts, "max_tokens": FLAGS.max_tokens, "price_profiles": FLAGS.price_profiles,
          "recguide_tables": tables_path, "recguide_tie_margin": configs[-1][1].tie_margin, "command": command,
          "compiles_after_warmup": llm.runner.compiles_after_warmup, "pipeline": llm.engine.pipeline}
  if FLAGS.unseen:
    from recguide_jax.benchmarks import unseen
    meta["unseen_prompt_sets"] = {"word_problems": os.path.relpath(unseen.WORD_PROBLEMS, ROOT),
                                  "gsm8k_train_unseen": f"GSM8K train from question {unseen.UNSEEN_TRAIN_OFFSET} (the "
                                                        f"tables: 0..{unseen.FITTED_TRAIN_PROMPTS - 1})"}
  lines = []
  for pname in profiles:
    lines += [f"\nPriced with `{pname}` (tokens per profiled ms, decode forwards only):\n",
              "| C | AR | linear B=8 | linear B=16 | linear B=32 | RecGuide | RecGuide vs best fixed | "
              "RecGuide vs official fixed B | RecGuide B share 1/8/16/32 | lossless |", "|" + "---|" * 10]
    for c in levels:
      mine = {r["policy"]: r for r in rows if r["price_profile"] == pname and r["concurrency"] == c}
      rg = mine[f"recguide@{pname}"]
      share = "/".join(f"{100 * rg['block_size_share'].get(str(b), 0):.0f}" for b in (1, 8, 16, 32))
      lines.append(f"| {c} | " + " | ".join(f"{mine[n]['priced_tokens_per_ms']:.3f}" for n in fixed) +
                   f" | {rg['priced_tokens_per_ms']:.3f} | {rg['vs_best_fixed']:.3f}x ({rg['best_fixed']}) | "
                   f"{rg['vs_official_fixed']:.3f}x | {share} | {all(r['lossless'] for r in mine.values())} |")
  if unseen_rows:
    lines += ["\nC = 1 on prompt sets the tables were not fitted on"
              + (" (and the --c1_samples GSM8K samples)" if samples else "") + ", beside GSM8K test (tokens per "
              "decode forward; "
              "RecGuide's verifications, plain or fused, and the draft forwards its reused branches saved; priced "
              "ratios with the profile RecGuide decides with; best fixed: of the fixed rows run on that set, AR and "
              "B = 8/16/32 on GSM8K test, B = 8/16 elsewhere):\n",
              "| prompt set | priced with | LinearSS B=16 tokens/forward | RecGuide tokens/forward | RecGuide drafts / "
              "verifications (saved) | RecGuide vs LinearSS B=16 (95% interval over prompts) | RecGuide vs best fixed | "
              "lossless |",
              "|" + "---|" * 8]
    for u in unseen_rows:
      lo, hi = u["recguide_vs_linear16_ci95"]
      lines.append(f"| {u['prompt_set']} | {u['price_profile']} | {u['linear16_tokens_per_forward']:.2f} | "
                   f"{u['recguide_tokens_per_forward']:.2f} | {u['recguide_forwards']['draft']} / "
                   f"{u['recguide_forwards']['verify']} ({u['recguide_forwards']['saved_drafts']}) | "
                   f"{u['recguide_vs_linear16']:.3f}x ({lo:.3f}-{hi:.3f}) | {u['recguide_vs_best_fixed']:.3f}x "
                   f"({u['best_fixed']}) | "
                   f"{u['lossless']} |")
  out_json = cli.report_path("bench_recguide_priced.json")
  out_md = cli.report_path("bench_recguide_priced.md")
  with open(out_json, "w") as f:
    json.dump({"meta": meta, "results": rows, "unseen_c1": unseen_rows}, f, indent=2)
  notes = kept_notes(out_md)
  with open(out_md, "w") as f:
    f.write(f"Priced (`--mode=priced`): GSM8K test, {FLAGS.num_prompts} prompts, greedy, max {FLAGS.max_tokens} new "
            "tokens, a closed loop of C; each run's forward ledger priced with each profile; RecGuide decides with "
            "the profile it is priced by (no wall-clock calibration); no call runs ahead (pipelining off: device "
            "prices credit no host time, so they charge no call wasted after a stop). Reproduce (GSM8K from "
            "--gsm8k_dir or $RECGUIDE_GSM8K_DIR):\n\n"
            f"    {command}\n" + "\n".join(lines) + "\n" + notes)
  print("\n".join(lines))
  print(f"wrote {out_json} and {out_md}")


def c1_ledgers(llm, recguide, profiles, prompts, params) -> dict:
  """C = 1 runs of LinearSS B = 8 and 16 and RecGuide deciding with each profile over `prompts`, as `priced` keeps
  them: {name: (forward ledger, tokens, same outputs as LinearSS B = 16, regime counts, block sizes, tokens per
  request)}."""
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import LinearStrategy
  configs = ([(f"linear B={b}", LinearStrategy(b)) for b in (16, 8)]
             + [(f"recguide@{name}", recguide(profile=prof)) for name, prof in profiles.items()])
  ledgers, reference = {}, None
  for name, policy in configs:
    llm.set_policy(policy)
    llm.engine.bucketing = "auto"
    llm.reset_prefix_cache()  # every config starts from the same cache (see `priced`)
    llm.engine.forward_log = []
    reqs, _ = bench.run_concurrent(llm.engine, prompts, params, 1)
    outs = [r.output_ids for r in reqs]
    reference = outs if reference is None else reference  # greedy LinearSS equals AR (tested), B = 16 runs first
    ledgers[name] = (llm.engine.forward_log, sum(len(o) for o in outs), outs == reference,
                     dict(getattr(policy, "regime_counts", {})), [b for r in reqs for b in r.stats.block_sizes],
                     [len(o) for o in outs])
    llm.engine.forward_log = None
  return ledgers


def c1_row(set_name: str, pname: str, prof, ledgers: dict) -> dict:
  """One prompt set's C = 1 figures for RecGuide deciding with and priced by `prof`: tokens per decode forward of
  LinearSS B = 16 and RecGuide, RecGuide's forwards by role, and its priced ratios to B = 16 and the best fixed run."""
  from recguide_jax import benchmarks as bench
  rates = {name: tokens / bench.priced_ms(log, prof) for name, (log, tokens, *_) in ledgers.items()}
  fixed = [name for name in ledgers if not name.startswith("recguide")]
  best = max(fixed, key=lambda n: rates[n])
  mine = f"recguide@{pname}"
  per_forward = {name: ledgers[name][1] / bench.ledger_counts(ledgers[name][0])["forwards"]
                 for name in ("linear B=16", mine)}
  # the same ratio per prompt, resampled: how far it moves with which prompts the set drew (C = 1 runs one request
  # after another, so each request's forwards are its own)
  per_prompt = {}
  for name in ("linear B=16", mine):
    parts = bench.split_sequential_ledger(ledgers[name][0])
    if len(parts) != len(ledgers[name][5]):
      raise ValueError(f"{name}: {len(parts)} request ledgers for {len(ledgers[name][5])} requests")
    per_prompt[name] = [(tok, bench.priced_ms(part, prof)) for tok, part in zip(ledgers[name][5], parts)]
  interval = bench.paired_rate_ratio(per_prompt[mine], per_prompt["linear B=16"])["ci95"]
  return {"prompt_set": set_name, "price_profile": pname, "tokens": ledgers[mine][1],
          "linear16_tokens_per_forward": per_forward["linear B=16"], "recguide_tokens_per_forward": per_forward[mine],
          "recguide_forwards": bench.ledger_counts(ledgers[mine][0]), "regimes": ledgers[mine][3],
          "priced_tokens_per_ms": {name: rates[name] for name in (*fixed, mine)},
          "recguide_vs_linear16": rates[mine] / rates["linear B=16"], "recguide_vs_linear16_ci95": interval,
          "best_fixed": best,
          "recguide_vs_best_fixed": rates[mine] / rates[best],
          "lossless": all(lossless for _, _, lossless, *_ in ledgers.values())}


if __name__ == "__main__":
  cli.run(main)
