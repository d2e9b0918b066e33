"""Fits RecGuide's overlap branch planning for a checkpoint: runs verification-overlapped drafting at
concurrency 1 (where overlap runs) on GSM8K train prompts with the paper's no-P3 rule for each margin threshold
delta of a grid, and with our expected-hit planner (`overlap.plan_expected_hit`, no threshold) for each tree width
(branch slots of the fused forward) of a grid; measures decode tokens per forward, the branch outcome counters and
the decode time priced with a hardware profile (the paper's B200 table by default, the one the adaptive tables are
fitted with); stores the best no-P3 delta (`overlap_delta`), and the planner and tree width with the most tokens
per priced ms (`overlap_planner`, `overlap_slots`) in the checkpoint's `recguide_tables.json`, which
`RecGuideStrategy` uses when they are not given. A wider tree hits more often (more tokens per forward) but each
fused forward carries more query tokens; the price decides, and tokens per forward break a price tie (within
0.1%; `overlap.best_sweep_row` says why).

For each width the expected-hit planner's prefix exponent gamma (`overlap.plan_expected_hit`) is fitted too: the
plain-product run's overlap rounds are logged and replayed with every gamma of --prefix_exponents
(`overlap.fit_prefix_exponent`); the best one is then run for real, and both runs compete in the sweep
(`overlap_prefix_exponent`).

  python launch/fit_delta.py --num_prompts 32 --deltas 0.05,0.1,0.2,0.3,0.4,0.5,0.6 --slots 3,4,5,6
"""

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("train", num_prompts=32, max_tokens=128)
flags.DEFINE_integer("offset", 0, "First prompt index in --data.")
flags.DEFINE_list("deltas", ["0.05", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6"], "Delta grid.")
flags.DEFINE_list("planners", ["no_p3", "expected_hit"], "Branch planners to compare (no_p3 sweeps --deltas).")
flags.DEFINE_list("slots", ["3", "4", "5", "6"], "Tree widths (branch slots) tried with the expected-hit planner.")
flags.DEFINE_list("prefix_exponents", [f"{g / 20:.2f}" for g in range(2, 21)],
                  "Prefix exponents gamma replayed for the expected-hit planner (1.0 = the plain product).")
flags.DEFINE_string("price_profile", "b200_nld8b", "Profile (shipped name or JSON path) the runs are priced with.")
flags.DEFINE_integer("block_size", 16, "Overlap block size B.")
flags.DEFINE_string("recguide_tables", None, "RecGuide's tables JSON to update (default: the checkpoint's "
                    "recguide_tables.json).")
cli.define_output_flags("fit_delta")  # the sweep; the fit goes into --recguide_tables


def main(argv):
  del argv
  cli.quiet_logging()
  try:
    deltas = sorted({float(d) for d in FLAGS.deltas})
  except ValueError:
    sys.exit(f"error: --deltas must be numbers, got {FLAGS.deltas}")
  if not deltas or deltas[0] < 0 or deltas[-1] > 1:
    sys.exit("error: --deltas must lie in [0, 1]")
  if FLAGS.block_size not in (8, 16, 32):
    sys.exit("error: --block_size must be 8, 16 or 32")
  data = cli.data_path()
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax import llm as llm_lib
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.recguide import adaptive, overlap as ov, profile as prof_lib
  from recguide_jax.recguide.fit import overlap_fit
  from recguide_jax.recguide.controller import RecGuideStrategy
  from recguide_jax.runtime.step_key import fused_kind
  if not FLAGS.planners or any(p not in ov.PLANNERS for p in FLAGS.planners):
    sys.exit(f"error: --planners must name some of {list(ov.PLANNERS)}, got {FLAGS.planners}")
  try:
    slot_grid = sorted({int(n) for n in FLAGS.slots})
  except ValueError:
    sys.exit(f"error: --slots must be integers, got {FLAGS.slots}")
  if not slot_grid or slot_grid[0] < 1 or slot_grid[-1] > ov.MAX_SLOTS:
    sys.exit(f"error: --slots must lie in [1, {ov.MAX_SLOTS}]")
  try:
    gamma_grid = sorted({float(g) for g in FLAGS.prefix_exponents} | {1.0})
  except ValueError:
    sys.exit(f"error: --prefix_exponents must be numbers, got {FLAGS.prefix_exponents}")
  if gamma_grid[0] <= 0 or gamma_grid[-1] > 2:
    sys.exit("error: --prefix_exponents must lie in (0, 2]")
  try:
    price = prof_lib.load_profile(FLAGS.price_profile)
  except prof_lib.ProfileError as e:
    sys.exit(f"error: --price_profile: {e}")
  checkpoint = FLAGS.model or str(llm_lib.default_checkpoint())
  tables_path = FLAGS.recguide_tables or str(adaptive.tables_path(checkpoint) or
                                             os.path.join(checkpoint, adaptive.TABLES_FILENAME))
  if not os.path.exists(tables_path):
    sys.exit(f"error: --recguide_tables {tables_path} does not exist (fit them with launch/fit_tables.py first)")
  try:
    tables = adaptive.load_tables(tables_path)
  except adaptive.TablesError as e:
    sys.exit(f"error: --recguide_tables: {e}")
  llm = LLM(checkpoint, policy="ar", block_sizes=(FLAGS.block_size,), max_num_seqs=1, warmup=False,
            attention=FLAGS.attention, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len)
  llm.runner.warmup(("prefill", "draft", "verify", "fused3", "gverify") + tuple(fused_kind(n) for n in slot_grid),
                    (FLAGS.block_size,))
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer, offset=FLAGS.offset)
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  llm.set_policy(ARStrategy())
  ar = [r.output_ids for r in bench.run_concurrent(llm.engine, prompts, params, 1)[0]]

  def priced_run(policy):
    llm.set_policy(policy)
    llm.engine.forward_log = []
    policy.overlap_log = [] if hasattr(policy, "overlap_log") else None  # RecGuide's own log
    reqs, _ = bench.run_concurrent(llm.engine, prompts, params, 1)
    ms = bench.priced_ms(llm.engine.forward_log, price)
    rounds = policy.overlap_log
    llm.engine.forward_log = None
    s = bench.summarize(reqs, 0.0)
    return reqs, s, s["generated_tokens"] / ms, rounds

  _, linear, linear_rate, _ = priced_run(LinearStrategy(FLAGS.block_size))
  rows = []

  def sweep_row(planner, d, slots, gamma=1.0):
    reqs, s, rate, rounds = priced_run(RecGuideStrategy(FLAGS.block_size, delta=d, planner=planner,
                                                      overlap_slots=slots, prefix_exponent=gamma,
                                                      fixed_regime="overlap", calibrate=False))
    outcomes = bench.overlap_counts(reqs)
    row = {"planner": planner, "delta": d, "slots": slots, "prefix_exponent": gamma if planner == "expected_hit"
           else None, "tpf": s["tpf"], "tpf_vs_linear": s["tpf"] / linear["tpf"], "priced_tokens_per_ms": rate,
           "priced_vs_linear": rate / linear_rate, "tau": s["mean_accepted_length"], "outcomes": outcomes,
           "lossless": [r.output_ids for r in reqs] == ar}
    rows.append(row)
    label = (f"no_p3 delta {d:.2f}" if d is not None else f"{planner} {slots} slots gamma {gamma:.2f}")
    print(f"{label:<32}: TPF {row['tpf']:.3f} ({row['tpf_vs_linear']:.2f}x LinearSS B={FLAGS.block_size}), "
          f"{rate:.3f} tok/ms priced ({row['priced_vs_linear']:.2f}x) lossless={row['lossless']} {outcomes}",
          flush=True)
    return rounds

  if "no_p3" in FLAGS.planners:
    for d in deltas:
      sweep_row("no_p3", d, ov.MAX_BRANCHES)
  if "expected_hit" in FLAGS.planners:
    for n in slot_grid:
      # the plain product's rounds, replayed with every gamma; the best gamma then runs for real
      rounds = sweep_row("expected_hit", None, n)
      gamma, replayed = overlap_fit.fit_prefix_exponent(rounds, FLAGS.block_size, n, gamma_grid)
      rows[-1]["replayed_correction_hits"] = replayed
      print(f"  replayed correction hits, {n} slots: gamma 1.00 {replayed[1.0]:.3f}, best gamma {gamma:.2f} "
            f"{replayed[gamma]:.3f}", flush=True)
      if gamma != 1.0:
        sweep_row("expected_hit", None, n, gamma)
  if not all(r["lossless"] for r in rows):
    sys.exit("error: an overlap run differed from greedy AR; not updating the tables")
  # the most tokens per priced ms; within 0.1% of it, the most tokens per forward (overlap.best_sweep_row)
  best = overlap_fit.best_sweep_row(rows)
  no_p3 = [r for r in rows if r["planner"] == "no_p3"]
  best_delta = overlap_fit.best_sweep_row(no_p3)["delta"] if no_p3 else tables.overlap_delta
  best_slots = best["slots"] if best["planner"] == "expected_hit" else None
  # what the chosen planner measured: the controller's prior for overlap's branch reuse rate (a branch reused = a hit)
  planned = sum(best["outcomes"].values())
  hits = best["outcomes"].get("correction_hit", 0) + best["outcomes"].get("continuation_hit", 0)
  hit_rate = hits / planned if planned else None
  updated = dataclasses.replace(tables, overlap_delta=best_delta, overlap_planner=best["planner"],
                                overlap_slots=best_slots, overlap_prefix_exponent=best["prefix_exponent"],
                                overlap_hit_rate=hit_rate, version="")
  updated.save(tables_path)
  out_json = cli.report_path("fit_delta.json")
  with open(out_json, "w") as f:
    json.dump({"checkpoint": checkpoint, "data": os.path.basename(data), "offset": FLAGS.offset,
               "num_prompts": FLAGS.num_prompts, "max_tokens": FLAGS.max_tokens, "block_size": FLAGS.block_size,
               "price_profile": price.name or FLAGS.price_profile, "linear_tpf": linear["tpf"],
               "linear_priced_tokens_per_ms": linear_rate, "sweep": rows, "best_planner": best["planner"],
               "best_delta": best_delta, "best_slots": best_slots,
               "best_prefix_exponent": best["prefix_exponent"]}, f, indent=2)
  print(f"best: {best['planner']} {best['slots']} slots, gamma {best['prefix_exponent']} "
        f"({best['priced_tokens_per_ms']:.3f} tok/ms priced, "
        f"{best['priced_vs_linear']:.2f}x LinearSS; TPF {best['tpf']:.3f}, {best['tpf_vs_linear']:.2f}x); "
        f"best no_p3 delta {best_delta}; wrote {tables_path} version {updated.version} and {out_json}")


if __name__ == "__main__":
  cli.run(main)
