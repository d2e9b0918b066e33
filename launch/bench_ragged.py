"""Adaptive block sizes batched four ways on the same plans (issue 36): one batch per planned block size
("bucketing"), one batch padded to the largest planned block ("padding"), the cheaper split per step as the cost
model prices it ("auto", the engine's default) and ragged steps (every row at its own block in one draft + one
verify forward), all priced with a hardware profile (default: the shipped B200 table).

The plans come from RecGuide's per-request adaptive rule (the paper's rule, `batch_priced=False`, overlap off)
deciding with the pricing profile. The run goes through the engine once per C on ragged steps, recording each
step's planned blocks; greedy runs repeat exactly and the rule reads only the requests' own histories and the load,
so every grouping would run these very plans (tests/test_ragged.py checks the groupings give the same tokens). Each
step is then priced as each grouping runs it: bucketing one draft + verify round per block size at its rows,
padding one round of all LinearSS rows at the largest block, auto the cheapest split (`grouping.cheapest_runs`), and
ragged `recguide.pricing.ragged_step_cost` (a ragged forward at its rows' mean block, `HardwareProfile.ragged_cost`);
AR rows cost one decode forward where they run apart. The ragged price is checked against the engine's own forward
ledger of the run. Also reported: decode forwards and the query tokens they compute, and the best fixed-B LinearSS
from docs/bench_recguide_priced.json (the same prompts, tokens and profile).

  python launch/bench_ragged.py --concurrency 8,16,32 --num_prompts 32 --max_tokens 128 --output_dir=docs
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("test", num_prompts=32, max_tokens=128)
flags.DEFINE_list("concurrency", ["8", "16", "32"], "Concurrency levels.")
flags.DEFINE_string("price_profile", "b200_nld8b", "Profile the runs are priced with and RecGuide decides with.")
flags.DEFINE_string("recguide_tables", None, "RecGuide's fitted adaptive-B tables JSON (default: the checkpoint's).")
flags.DEFINE_bool("check_ar", True, "Also run AR at each C and check the ragged run's greedy output against it.")
flags.DEFINE_string("fixed_from", os.path.join(ROOT, "docs", "bench_recguide_priced.json"), "Priced fixed-B "
                    "LinearSS results to compare with (bench_recguide.py --mode=priced, same prompts and profile).")
flags.DEFINE_bool("verify_truncation", True, "Also run the ragged steps with RecGuide's verify truncation (each row "
                  "verifies the head of its draft that pays at the load) and price that run by its own ledger.")
cli.define_output_flags("bench_ragged")

GROUPINGS = ("bucketing", "padding", "auto", "ragged")


def price_step(blocks, grouping: str, profile) -> tuple[float, int, int]:
  """(profile ms, decode forwards, query tokens) of one step whose rows are planned at `blocks` (1: AR), run as
  `grouping` runs it."""
  from recguide_jax.decoding.grouping import cheapest_runs
  from recguide_jax.recguide import pricing
  lin = sorted(b for b in blocks if b > 1)
  n_ar = len(blocks) - len(lin)
  if grouping == "ragged" and lin:
    return pricing.ragged_step_cost(blocks, profile), 2, 2 * sum(lin) + n_ar
  ms, fwd, tok = (profile.ar_cost(n_ar), 1, n_ar) if n_ar else (0.0, 0, 0)
  if not lin:
    return ms, fwd, tok
  sizes = sorted(set(lin))
  counts = [lin.count(b) for b in sizes]
  if grouping == "bucketing":
    runs = [[i] for i in range(len(sizes))]
  elif grouping == "padding":
    runs = [list(range(len(sizes)))]
  else:  # auto: the cheapest split into consecutive runs, as the engine's "auto" grouping prices it
    runs = cheapest_runs(counts, sizes, lambda c, b: profile.cost(c, b))[1]
  for run in runs:
    rows, blk = sum(counts[i] for i in run), sizes[run[-1]]
    ms += profile.cost(rows, blk)
    fwd += 2
    tok += 2 * rows * blk
  return ms, fwd, tok


def rule_policy(price, tables, **options):
  """RecGuide as the paper's per-request adaptive rule alone (overlap off, no batch pricing), deciding with the
  pricing profile."""
  from recguide_jax.recguide.controller import RecGuideStrategy
  return RecGuideStrategy(16, profile=price, tables=tables, fixed_regime="adaptive", overlap=False,
                          batch_priced=False, calibrate=False, **options)


def truncated_run(llm, prompts, params, c, price, tables, ar_out, ragged, best_fixed) -> dict:
  """The ragged run again with verify truncation on, priced by the engine's own ledger (its verify forwards run
  fewer tokens, and its plans may part from the untruncated run's as the histories do)."""
  import numpy as np
  from recguide_jax import benchmarks as bench
  llm.set_policy(rule_policy(price, tables, verify_truncation=True))
  llm.engine.bucketing = "ragged"
  llm.engine.forward_log = []
  reqs, _ = bench.run_concurrent(llm.engine, prompts, params, c)
  log, llm.engine.forward_log = llm.engine.forward_log, None
  outs = [r.output_ids for r in reqs]
  tokens = sum(len(o) for o in outs)
  ms = bench.priced_ms(log, price)
  blocks = [b for r in reqs for b in r.stats.block_sizes]
  decode = [e for e in log if e[0] in ("ragged_draft", "ragged_verify", "decode")]
  return {"grouping": "ragged_truncated", "concurrency": c, "priced_ms": ms, "priced_tokens_per_ms": tokens / ms,
          "decode_forwards": len(decode), "query_tokens": int(sum(t * (1 if k != "decode" else n)
                                                                  for k, t, n in decode)),
          "generated_tokens": tokens, "steps": sum(1 for e in log if e[0] in ("ragged_verify", "decode")),
          "vs_best_fixed": (tokens / ms) / best_fixed if best_fixed else None,
          "block_size_share": {str(b): float(np.mean([x == b for x in blocks])) for b in (1, 8, 16, 32)},
          "lossless": None if ar_out is None else outs == ar_out,
          # the untruncated ragged run's tokens/ms over this one's, as every row's `ragged_gain`
          "ragged_gain": (ragged["generated_tokens"] / ragged["priced_ms"]) / (tokens / ms),
          "unverified_drafts": bench.unverified_drafts(log),
          "drafted_tokens": sum(t for k, t, _ in log if k == "ragged_draft")}


def main(argv):
  del argv
  cli.quiet_logging()
  import numpy as np
  from recguide_jax import LLM, SamplingParams, benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy
  from recguide_jax.engine import core as engine_core
  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide import profile as prof_lib
  levels = cli.int_list("concurrency")
  price = prof_lib.load_profile(FLAGS.price_profile)
  llm = LLM(FLAGS.model, policy="ar", block_sizes=(8, 16, 32), max_num_seqs=max(levels),
            max_model_len=FLAGS.max_model_len, warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype)
  tables_path = FLAGS.recguide_tables
  if tables_path is None:
    from recguide_jax import llm as llm_lib
    found = adaptive.tables_path(FLAGS.model or str(llm_lib.default_checkpoint()))
    tables_path = str(found) if found else None
  tables = adaptive.load_tables(tables_path) if tables_path else None
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  prompts = bench.gsm8k_prompts(cli.data_path(), FLAGS.num_prompts, llm.tokenizer)
  fixed = {}
  if os.path.isfile(FLAGS.fixed_from):
    with open(FLAGS.fixed_from) as f:
      for r in json.load(f)["results"]:
        if r.get("price_profile") == price.name and r["policy"].startswith("linear B="):
          fixed.setdefault(r["concurrency"], {})[r["policy"]] = r["priced_tokens_per_ms"]

  steps: list[list[int]] = []
  group_plans = engine_core.group_plans

  def recording(planned, bucketing, round_cost):  # each step's planned blocks, in planning order
    steps.append([int(plan.block_size) for _, plan in planned])
    return group_plans(planned, bucketing, round_cost)

  engine_core.group_plans = recording
  results = []
  for c in levels:
    ar_out = None
    if FLAGS.check_ar:
      llm.set_policy(ARStrategy())
      llm.engine.bucketing = "auto"
      reqs, _ = bench.run_concurrent(llm.engine, prompts, params, c)
      ar_out = [r.output_ids for r in reqs]
    llm.set_policy(rule_policy(price, tables))
    llm.engine.bucketing = "ragged"
    llm.engine.forward_log = []
    steps.clear()
    reqs, _ = bench.run_concurrent(llm.engine, prompts, params, c)
    log, llm.engine.forward_log = llm.engine.forward_log, None
    outs = [r.output_ids for r in reqs]
    tokens = sum(len(o) for o in outs)
    blocks = [b for r in reqs for b in r.stats.block_sizes]
    share = {str(b): float(np.mean([x == b for x in blocks])) for b in (1, 8, 16, 32)}
    ledger_ms = bench.priced_ms(log, price)
    best_fixed = max(fixed.get(c, {}).values(), default=None)
    rows = {}
    for g in GROUPINGS:
      ms = fwd = tok = 0
      for blk in steps:
        a, b, t = price_step(blk, g, price)
        ms, fwd, tok = ms + a, fwd + b, tok + t
      rows[g] = {"grouping": g, "concurrency": c, "priced_ms": ms, "priced_tokens_per_ms": tokens / ms,
                 "decode_forwards": fwd, "query_tokens": tok, "generated_tokens": tokens, "steps": len(steps),
                 "vs_best_fixed": (tokens / ms) / best_fixed if best_fixed else None, "block_size_share": share,
                 "lossless": None if ar_out is None else outs == ar_out}
    rows["ragged"]["ledger_priced_ms"] = ledger_ms  # the engine's own ledger of the run
    for g, r in rows.items():
      r["ragged_gain"] = r["priced_ms"] / rows["ragged"]["priced_ms"]  # ragged's tokens/ms over this grouping's
      results.append(r)
      print(f"C={c:<3} {g:<10} priced {r['priced_tokens_per_ms']:.3f} tok/ms  forwards {r['decode_forwards']:5d}  "
            f"query tokens {r['query_tokens']:7d}  ragged gain {r['ragged_gain']:.3f}  vs best fixed "
            f"{r['vs_best_fixed'] or float('nan'):.3f}  lossless={r['lossless']}", flush=True)
    rows["ragged"]["ledger_matches"] = abs(ledger_ms - rows["ragged"]["priced_ms"]) <= 1e-6 * ledger_ms
    if not rows["ragged"]["ledger_matches"]:
      print(f"WARNING: the ragged run's ledger prices {ledger_ms:.3f} ms, its steps {rows['ragged']['priced_ms']:.3f}")
    if FLAGS.verify_truncation:
      r = truncated_run(llm, prompts, params, c, price, tables, ar_out, rows["ragged"], best_fixed)
      results.append(r)
      print(f"C={c:<3} {r['grouping']:<10} priced {r['priced_tokens_per_ms']:.3f} tok/ms  forwards "
            f"{r['decode_forwards']:5d}  query tokens {r['query_tokens']:7d}  over ragged "
            f"{1 / r['ragged_gain']:.3f}  unverified drafts {r['unverified_drafts']}  lossless={r['lossless']}",
            flush=True)
  meta = {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": FLAGS.num_prompts,
          "max_tokens": FLAGS.max_tokens, "price_profile": FLAGS.price_profile, "recguide_tables": tables_path,
          "fixed_from": FLAGS.fixed_from, "fixed_b": {str(c): v for c, v in fixed.items()},
          "command": "python launch/bench_ragged.py " + " ".join(sys.argv[1:])}
  out_json, out_md = cli.report_path("bench_ragged.json"), cli.report_path("bench_ragged.md")
  with open(out_json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  lines = ["| C | grouping | priced tok/ms | ragged gain over it | vs best fixed B | decode forwards | query tokens | "
           "B share 1/8/16/32 | lossless |", "|" + "---|" * 9]
  for r in results:
    share = "/".join(f"{100 * r['block_size_share'].get(str(b), 0):.0f}" for b in (1, 8, 16, 32))
    vs = f"{r['vs_best_fixed']:.3f}" if r["vs_best_fixed"] else "-"
    lines.append(f"| {r['concurrency']} | {r['grouping']} | {r['priced_tokens_per_ms']:.3f} | {r['ragged_gain']:.3f}x "
                 f"| {vs} | {r['decode_forwards']} | {r['query_tokens']} | {share} | {r['lossless']} |")
  with open(out_md, "w") as f:
    f.write(f"GSM8K test, {FLAGS.num_prompts} prompts, greedy, max {FLAGS.max_tokens} new tokens; RecGuide's "
            f"per-request adaptive plans priced with `{FLAGS.price_profile}` as each grouping runs them "
            f"(launch/bench_ragged.py).\n\n" + "\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
  cli.run(main)
