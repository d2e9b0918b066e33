"""RecGuide on sampled requests at concurrency 1: overlap for sampled requests (point-mass drafts, the reference
rule) against greedy-only overlap, LinearSS B = 16 and AR, at each temperature, every run priced with a hardware
profile (default: the paper's B200 table) from its forward ledger. Requests are seeded (seed = --seed + index), so a
run repeats exactly; the policies' samples differ, and so do their output lengths.

  python launch/bench_recguide_sampled.py --temperatures 0.3,0.5,0.7,1.0 --num_prompts 16 --max_tokens 128

Reports go to --output_dir (default runs/bench_recguide_sampled): bench_recguide_sampled.{json,md}.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

cli.define_model_and_data_flags("test", num_prompts=16, max_tokens=128, max_model_len=512)
flags.DEFINE_list("temperatures", ["0.3", "0.5", "0.7", "1.0"], "Sampling temperatures, each run by every policy.")
flags.DEFINE_integer("seed", 100, "Request i samples with seed --seed + i.")
flags.DEFINE_string("price_profile", "b200_nld8b", "Profile RecGuide decides with and the runs are priced with.")
cli.define_output_flags("bench_recguide_sampled")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cli.quiet_logging()
  try:
    temperatures = [float(t) for t in FLAGS.temperatures]
  except ValueError:
    sys.exit(f"error: --temperatures: numbers expected, got {FLAGS.temperatures}")
  if not temperatures or min(temperatures) <= 0:
    sys.exit("error: --temperatures: every temperature must be > 0 (greedy runs: launch/bench_recguide.py)")
  data = cli.data_path()
  from recguide_jax import LLM, SamplingParams
  from recguide_jax import llm as llm_lib
  from recguide_jax.benchmarks import driver
  from recguide_jax.benchmarks.gsm8k import gsm8k_prompts
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.recguide import profile as prof_lib
  from recguide_jax.recguide.controller import RecGuideStrategy
  model = FLAGS.model or str(llm_lib.default_checkpoint())
  price = prof_lib.load_profile(FLAGS.price_profile)
  llm = LLM(model, policy="ar", block_sizes=(8, 16, 32), max_num_seqs=1, max_model_len=FLAGS.max_model_len,
            warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype)
  prompts = gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer)
  defaults = llm_lib.recguide_defaults(model)  # the tables shipped beside the checkpoint

  def recguide(overlap_max_temperature):
    return RecGuideStrategy(16, **{**defaults, "profile": price, "calibrate": False,
                                   "overlap_max_temperature": overlap_max_temperature})

  rows = []
  for t in temperatures:
    configs = [("ar", ARStrategy()), ("linear B=16", LinearStrategy(16)),
               ("recguide, greedy-only overlap", recguide(0.0)),
               ("recguide, overlap for sampled requests", recguide(t))]
    rates = {}
    for name, policy in configs:
      llm.set_policy(policy)
      llm.reset_prefix_cache()
      llm.engine.forward_log = []
      params = [SamplingParams(max_tokens=FLAGS.max_tokens, temperature=t, seed=FLAGS.seed + i)
                for i in range(len(prompts))]
      outs = llm.generate(prompts, params, use_tqdm=False)
      log, llm.engine.forward_log = llm.engine.forward_log, None
      tokens = sum(len(o.outputs[0].token_ids) for o in outs)
      decode = [kind for kind, _, _ in log if kind != "prefill"]
      ms = driver.priced_ms(log, price)
      rates[name] = tokens / ms
      rows.append({"temperature": t, "policy": name, "generated_tokens": tokens, "decode_forwards": len(decode),
                   "tokens_per_forward": tokens / max(len(decode), 1), "priced_ms": ms,
                   "priced_tokens_per_ms": tokens / ms,
                   "forwards": {k: decode.count(k) for k in sorted(set(decode))}})
    for r in rows[-len(configs):]:
      r["vs_linear16"] = r["priced_tokens_per_ms"] / rates["linear B=16"]
      print(f"T={t:g} {r['policy']}: {r['priced_tokens_per_ms']:.3f} tok/ms priced, {r['vs_linear16']:.3f}x LinearSS "
            f"B=16, {r['tokens_per_forward']:.2f} tokens per forward", flush=True)
  meta = {"model": model, "price_profile": FLAGS.price_profile, "num_prompts": len(prompts),
          "max_tokens": FLAGS.max_tokens, "seed": FLAGS.seed, "concurrency": 1}
  out_json, out_md = cli.report_path("bench_recguide_sampled.json"), cli.report_path("bench_recguide_sampled.md")
  with open(out_json, "w") as f:
    json.dump({"meta": meta, "results": rows}, f, indent=2)
  lines = [f"RecGuide on sampled requests, C = 1: {len(prompts)} GSM8K test prompts, {FLAGS.max_tokens} tokens, "
           f"seeded, priced with `{FLAGS.price_profile}` (launch/bench_recguide_sampled.py).", "",
           "| temperature | policy | priced tok/ms | vs LinearSS B=16 | tokens per forward | decode forwards |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    forwards = ", ".join(f"{k} {n}" for k, n in r["forwards"].items())
    lines.append(f"| {r['temperature']:g} | {r['policy']} | {r['priced_tokens_per_ms']:.3f} | {r['vs_linear16']:.3f}x "
                 f"| {r['tokens_per_forward']:.2f} | {forwards} |")
  with open(out_md, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
  cli.run(main)
