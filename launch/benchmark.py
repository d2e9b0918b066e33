"""AR vs fixed-B LinearSS, side by side in one run: decode-only tokens per forward (TPF), mean accepted length per
round (tau), aggregate and per-request tokens/s at each concurrency, medians of repeats. Writes JSON + markdown.

  python launch/benchmark.py --batch_sizes 1,8 --num_prompts 32 --max_tokens 128
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from recguide_jax import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("test", num_prompts=32, max_tokens=128)
flags.DEFINE_list("batch_sizes", ["1", "8"], "Concurrency levels.")
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "LinearSS block sizes.")
flags.DEFINE_integer("repeats", 3, "Repeats per point (the median wall time is reported).")
flags.DEFINE_string("out_json", os.path.join(ROOT, "docs", "bench_linear.json"), "Output JSON.")
flags.DEFINE_string("out_md", os.path.join(ROOT, "docs", "bench_linear.md"), "Output markdown table.")


def main(argv):
  del argv
  cli.quiet_logging()
  try:
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    blocks = [int(b) for b in FLAGS.block_sizes]
  except ValueError:
    sys.exit("error: --batch_sizes and --block_sizes must be integers")
  if any(b <= 0 for b in batch_sizes) or any(b not in (8, 16, 32) for b in blocks):
    sys.exit("error: --batch_sizes must be positive and --block_sizes in {8, 16, 32}")
  if FLAGS.repeats <= 0 or FLAGS.num_prompts <= 0 or FLAGS.max_tokens <= 0:
    sys.exit("error: --repeats, --num_prompts and --max_tokens must be positive")
  from recguide_jax import LLM, SamplingParams, bench, policies
  llm = LLM(FLAGS.checkpoint, policy="ar", block_sizes=tuple(blocks), max_batch=max(batch_sizes),
            max_model_len=1024, warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype)
  llm.runner.warmup(("prefill", "draft", "verify"), tuple(blocks))
  prompts = bench.gsm8k_prompts(FLAGS.data, FLAGS.num_prompts, llm.tokenizer)
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  configs = [("ar", policies.ARPolicy())] + [(f"linear B={b}", policies.LinearPolicy(b)) for b in blocks]
  results, outputs = [], {}
  for conc in batch_sizes:
    for name, policy in configs:
      llm.set_policy(policy)
      reqs, summary = bench.median_runs(lambda: bench.run_concurrent(llm.engine, prompts, params, conc),
                                        FLAGS.repeats)
      outputs[(name, conc)] = [r.output_ids for r in reqs]
      summary.update(policy=name, concurrency=conc,
                     lossless=outputs[(name, conc)] == outputs.get(("ar", conc), outputs[(name, conc)]),
                     loop_share=bench.loop_share(outputs[(name, conc)]))
      results.append(summary)
      print(f"C={conc:<3} {name:<12} TPF {summary['tpf']:.2f}  tau {summary['mean_accepted_length']:.2f}  "
            f"{summary['tokens_per_s']:.1f} tok/s  lossless={summary['lossless']}", flush=True)
  by = {(r["policy"], r["concurrency"]): r for r in results}
  for r in results:
    r["speedup_vs_ar"] = r["tokens_per_s"] / by[("ar", r["concurrency"])]["tokens_per_s"]
  meta = {"checkpoint": str(FLAGS.checkpoint or "bundled"), "num_prompts": FLAGS.num_prompts,
          "max_tokens": FLAGS.max_tokens, "repeats": FLAGS.repeats, "compiles_after_warmup":
              llm.runner.compiles_after_warmup}
  os.makedirs(os.path.dirname(FLAGS.out_json), exist_ok=True)
  with open(FLAGS.out_json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  lines = ["| C | policy | TPF | tau | tok/s | per-request tok/s | speedup vs AR | lossless |",
           "|---|---|---|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r['concurrency']} | {r['policy']} | {r['tpf']:.2f} | {r['mean_accepted_length']:.2f} | "
                 f"{r['tokens_per_s']:.1f} | {r['per_request_tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                 f"{r['lossless']} |")
  with open(FLAGS.out_md, "w") as f:
    f.write(f"GSM8K test, {FLAGS.num_prompts} prompts, greedy, max {FLAGS.max_tokens} new tokens, median of "
            f"{FLAGS.repeats} repeats.\n\n" + "\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
