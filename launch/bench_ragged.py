"""Adaptive block sizes batched three ways, side by side on the same plans (issue 36): one batch per planned block
size ("bucketing"), one batch padded to the largest planned block ("padding"), and ragged steps (every row at its
own block in one draft + one verify forward). Each run's forward ledger is priced with a hardware profile (default:
the shipped B200 table; a ragged forward is priced by `HardwareProfile.ragged_cost`: its rows at their mean block);
also reported: decode forwards and the query tokens they compute, and the best fixed-B LinearSS priced the same way.
Greedy outputs are checked against AR.

The plans come from RecGuide's per-request adaptive rule (the paper's, `batch_priced=False`, overlap off) deciding
with the pricing profile, so every grouping runs the same blocks for the same requests (greedy runs repeat exactly,
and the rule reads only the requests' own histories and the load).

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
cli.define_output_flags("bench_ragged")

GROUPINGS = {"bucketing": True, "padding": False, "cost-aware (auto)": "auto", "ragged": "ragged"}


def query_tokens(log) -> int:
  """Query tokens the decode forwards of a ledger compute, padding rows of a padded batch's smaller plans
  included (a ledger's rows are live rows; batch-bucket padding rows are not counted for any grouping)."""
  from recguide_jax.runtime.step_key import parse_kind_label
  total = 0
  for kind, blk, rows in log:
    if kind in ("ragged_draft", "ragged_verify"):
      total += blk  # blk: the packed tokens
    elif kind == "decode":
      total += rows
    elif kind in ("draft", "verify", "gverify"):
      total += blk * rows
    elif kind.startswith("fused"):
      total += (1 + parse_kind_label(kind)[1]) * blk * rows
  return total


def main(argv):
  del argv
  cli.quiet_logging()
  import numpy as np
  from recguide_jax import LLM, SamplingParams, benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide import profile as prof_lib
  from recguide_jax.recguide.controller import RecGuideStrategy
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

  def run(policy, bucketing, c):
    llm.set_policy(policy)
    llm.engine.bucketing = bucketing
    llm.engine.forward_log = []
    reqs, wall = bench.run_concurrent(llm.engine, prompts, params, c)
    log, llm.engine.forward_log = llm.engine.forward_log, None
    outs = [r.output_ids for r in reqs]
    tokens = sum(len(o) for o in outs)
    ms = bench.priced_ms(log, price)
    blocks = [b for r in reqs for b in r.stats.block_sizes]
    return outs, {"generated_tokens": tokens, "priced_ms": ms, "priced_tokens_per_ms": tokens / ms,
                  "wall_s": wall, **bench.ledger_counts(log), "query_tokens": query_tokens(log),
                  "block_size_share": {str(b): float(np.mean([x == b for x in blocks])) for b in (1, 8, 16, 32)}}

  results = []
  for c in levels:
    ar_out, _ = run(ARStrategy(), "auto", c)
    rows = {}
    for b in (8, 16, 32):
      out, rows[f"linear B={b}"] = run(LinearStrategy(b), "auto", c)
      rows[f"linear B={b}"]["lossless"] = out == ar_out
    for name, bucketing in GROUPINGS.items():
      pol = RecGuideStrategy(16, profile=price, tables=tables, fixed_regime="adaptive", overlap=False,
                             batch_priced=False, calibrate=False)
      out, rows[f"adaptive, {name}"] = run(pol, bucketing, c)
      rows[f"adaptive, {name}"]["lossless"] = out == ar_out
    best_fixed = max((r for n, r in rows.items() if n.startswith("linear")), key=lambda r: r["priced_tokens_per_ms"])
    ragged = rows["adaptive, ragged"]["priced_tokens_per_ms"]
    for name, r in rows.items():
      r.update(policy=name, concurrency=c, vs_best_fixed=r["priced_tokens_per_ms"] / best_fixed["priced_tokens_per_ms"],
               ragged_vs_this=ragged / r["priced_tokens_per_ms"])
      results.append(r)
      print(f"C={c:<3} {name:<28} priced {r['priced_tokens_per_ms']:.3f} tok/ms  forwards {r['forwards']:5d}  "
            f"query tokens {r['query_tokens']:7d}  vs best fixed {r['vs_best_fixed']:.3f}  "
            f"ragged/this {r['ragged_vs_this']:.3f}  lossless={r['lossless']}", flush=True)
  meta = {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": FLAGS.num_prompts,
          "max_tokens": FLAGS.max_tokens, "price_profile": FLAGS.price_profile, "recguide_tables": tables_path,
          "compiled_variants": len(llm.runner._compiled)}
  out_json, out_md = cli.report_path("bench_ragged.json"), cli.report_path("bench_ragged.md")
  with open(out_json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  lines = ["| C | run | priced tok/ms | vs best fixed B | ragged vs this | decode forwards | query tokens | "
           "B share 1/8/16/32 | lossless |", "|" + "---|" * 9]
  for r in results:
    share = "/".join(f"{100 * r['block_size_share'].get(str(b), 0):.0f}" for b in (1, 8, 16, 32))
    lines.append(f"| {r['concurrency']} | {r['policy']} | {r['priced_tokens_per_ms']:.3f} | {r['vs_best_fixed']:.3f} | "
                 f"{r['ragged_vs_this']:.3f} | {r['forwards']} | {r['query_tokens']} | {share} | {r['lossless']} |")
  with open(out_md, "w") as f:
    f.write(f"GSM8K test, {FLAGS.num_prompts} prompts, greedy, max {FLAGS.max_tokens} new tokens, priced with "
            f"`{FLAGS.price_profile}` (launch/bench_ragged.py).\n\n" + "\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
  cli.run(main)
