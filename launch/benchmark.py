"""AR vs fixed-B LinearSS, side by side in one run: decode-only tokens per forward (TPF), mean accepted length per
round (tau), aggregate and per-request tokens/s at each concurrency, medians of repeats. Writes JSON + markdown.

  python launch/benchmark.py --concurrency 1,8 --num_prompts 32 --max_tokens 128   # -> runs/benchmark/
  python launch/benchmark.py --concurrency 1,8 --output_dir docs                   # the published docs/bench_linear.*
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402
from recguide_jax.parallel import multihost as distributed  # noqa: E402

# --tensor_parallel_size/--data_parallel_size/--mesh (one host; on simulated CPU devices set XLA_FLAGS first)
distributed.define_mesh_flags()

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("test", num_prompts=32, max_tokens=128)
flags.DEFINE_list("concurrency", ["1", "8"], "Concurrency levels (requests in flight).")
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "LinearSS block sizes.")
flags.DEFINE_integer("repeats", 3, "Repeats per point (the median wall time is reported).")
cli.define_output_flags("benchmark")


def main(argv):
  del argv
  cli.quiet_logging()
  batch_sizes = cli.int_list("concurrency")
  blocks = cli.int_list("block_sizes")
  if any(b not in (8, 16, 32) for b in blocks):
    sys.exit("error: --block_sizes must be in {8, 16, 32}")
  if FLAGS.repeats <= 0 or FLAGS.num_prompts <= 0 or FLAGS.max_tokens <= 0:
    sys.exit("error: --repeats, --num_prompts and --max_tokens must be positive")
  data = cli.data_path()
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  llm = LLM(FLAGS.model, policy="ar", block_sizes=tuple(blocks), max_num_seqs=max(batch_sizes),
            max_model_len=FLAGS.max_model_len, warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype,
            mesh=distributed.mesh_from_flags())
  llm.runner.warmup(("prefill", "draft", "verify"), tuple(blocks))
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer)
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  configs = [("ar", ARStrategy())] + [(f"linear B={b}", LinearStrategy(b)) for b in blocks]
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
  meta = {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": FLAGS.num_prompts,
          "max_tokens": FLAGS.max_tokens, "repeats": FLAGS.repeats, "compiles_after_warmup":
              llm.runner.compiles_after_warmup}
  out_json, out_md = cli.report_path("bench_linear.json"), cli.report_path("bench_linear.md")
  with open(out_json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  lines = ["| C | policy | TPF | tau | tok/s | per-request tok/s | speedup vs AR | lossless |",
           "|---|---|---|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r['concurrency']} | {r['policy']} | {r['tpf']:.2f} | {r['mean_accepted_length']:.2f} | "
                 f"{r['tokens_per_s']:.1f} | {r['per_request_tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                 f"{r['lossless']} |")
  with open(out_md, "w") as f:
    f.write(f"GSM8K test, {FLAGS.num_prompts} prompts, greedy, max {FLAGS.max_tokens} new tokens, median of "
            f"{FLAGS.repeats} repeats.\n\n" + "\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
  cli.run(main)
