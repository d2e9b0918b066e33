"""Collects RecGuide shadow traces: every round runs B = 8/16/32 from the same committed state and logs the
counterfactual accepted lengths plus the history signals (s, z). Use prompts the policy is not evaluated on (GSM8K
train by default); then fit with launch/fit_tables.py.

  python launch/shadow_trace.py --num_prompts 200 --output_dir runs/shadow_gsm8k
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("train", num_prompts=200, max_tokens=128)
flags.DEFINE_integer("offset", 0, "First prompt index.")
flags.DEFINE_integer("concurrency", 8, "Requests in flight.")
flags.DEFINE_integer("seed", 0, "Exploration seed.")
flags.DEFINE_string("dataset", "gsm8k", "Dataset label written into each row.")
flags.DEFINE_string("output_dir", None, "Writes <output_dir>/shadow_trace.jsonl.")


def main(argv):
  del argv
  cli.quiet_logging()
  if not FLAGS.output_dir:
    sys.exit("error: --output_dir is required")
  data = cli.data_path()
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax.recguide.fit.shadow import ShadowTraceStrategy
  policy = ShadowTraceStrategy(FLAGS.dataset, FLAGS.seed)
  llm = LLM(FLAGS.model, policy=policy, max_num_seqs=FLAGS.concurrency, max_model_len=FLAGS.max_model_len,
            attention=FLAGS.attention, dtype=FLAGS.dtype)
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer, offset=FLAGS.offset)
  bench.run_concurrent(llm.engine, prompts, SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0),
                       FLAGS.concurrency)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  path = os.path.join(FLAGS.output_dir, "shadow_trace.jsonl")
  policy.write(path)
  print(f"wrote {len(policy.rows)} rounds from {FLAGS.num_prompts} requests to {path}")


if __name__ == "__main__":
  cli.run(main)
