"""Fits what RecGuide's verify truncation prices a drafted token by: runs LinearSS at a block size over GSM8K train
prompts, logs each round's draft confidences (top probability per slot) and accepted length, fits gamma of
P(accepted through drafted token j) ~ (running product of confidences through j)^gamma
(`recguide.fit.verify_fit`), reports the reliability table, and stores gamma as `verify_confidence_exponent` in the
checkpoint's `recguide_tables.json` (`RecGuideStrategy` uses it when not given).

  python launch/fit_verify_calibration.py --num_prompts 64 --offset 2000 --output_dir=docs
"""

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_and_data_flags("train", num_prompts=64, max_tokens=128)
flags.DEFINE_integer("offset", 2000, "First prompt index in --data.")
flags.DEFINE_list("block_sizes", ["16", "32"], "LinearSS block sizes whose rounds are logged.")
flags.DEFINE_integer("concurrency", 8, "Requests decoded together.")
flags.DEFINE_bool("write_tables", True, "Store the fitted gamma in the checkpoint's recguide_tables.json.")
cli.define_output_flags("fit_verify_calibration")


def main(argv):
  del argv
  cli.quiet_logging()
  import numpy as np
  from recguide_jax import LLM, SamplingParams, benchmarks as bench, llm as llm_lib
  from recguide_jax.decoding.builtin import LinearStrategy
  from recguide_jax.recguide import adaptive
  from recguide_jax.recguide.fit import verify_fit
  checkpoint = FLAGS.model or str(llm_lib.default_checkpoint())
  sizes = cli.int_list("block_sizes")
  llm = LLM(checkpoint, policy="ar", block_sizes=tuple(sizes), max_num_seqs=FLAGS.concurrency,
            max_model_len=FLAGS.max_model_len, warmup=False, attention=FLAGS.attention, dtype=FLAGS.dtype)
  data = cli.data_path()
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts, llm.tokenizer, offset=FLAGS.offset)
  confidence, accepted = [], []
  for blk in sizes:
    policy = LinearStrategy(blk)
    observe = policy.observe

    def logging_observe(outcome, observe=observe, blk=blk):  # every round's draft confidences and acceptance
      res, n = outcome.output.verify, outcome.batch.n
      if res is not None and res.draft_signals is not None:
        conf = np.asarray(res.draft_signals)[:n, 0, :blk]
        confidence.extend(conf)
        accepted.extend(np.asarray(outcome.output.accepted)[:n].tolist())
      observe(outcome)

    policy.observe = logging_observe
    llm.set_policy(policy)
    bench.run_concurrent(llm.engine, prompts, SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0),
                         FLAGS.concurrency)
  pi, hit = verify_fit.running_confidence(confidence, accepted)
  gamma, scores = verify_fit.fit_confidence_exponent(pi, hit)
  table = verify_fit.reliability(pi, hit, gamma)
  lines = ["| running confidence | drafted tokens | mean confidence | calibrated (^gamma) | accepted rate |",
           "|---|---|---|---|---|"]
  for row in table:
    lines.append(f"| [{row['from']:g}, {row['to']:g}) | {row['tokens']} | {row['running_confidence']:.4f} | "
                 f"{row['calibrated']:.4f} | {row['accepted_rate']:.4f} |")
  print(f"{len(confidence)} rounds, {len(pi)} drafted tokens: gamma {gamma:.2f} (log-likelihood "
        f"{scores[gamma]:.4f}; plain product {scores[1.0]:.4f})")
  print("\n".join(lines))
  tables_path = adaptive.tables_path(checkpoint)
  if FLAGS.write_tables and tables_path is not None:
    tables = adaptive.load_tables(tables_path)
    updated = dataclasses.replace(tables, verify_confidence_exponent=gamma, version="")
    updated.save(tables_path)
    print(f"wrote verify_confidence_exponent={gamma} to {tables_path} (version {updated.version})")
  result = {"checkpoint": checkpoint, "data": os.path.basename(data), "offset": FLAGS.offset,
            "num_prompts": FLAGS.num_prompts, "max_tokens": FLAGS.max_tokens, "block_sizes": sizes,
            "concurrency": FLAGS.concurrency, "rounds": len(confidence), "drafted_tokens": int(len(pi)),
            "gamma": gamma, "log_likelihood": {str(g): v for g, v in scores.items()}, "reliability": table,
            "command": "python launch/fit_verify_calibration.py " + " ".join(sys.argv[1:])}
  md = (f"Draft confidence calibration ({os.path.basename(str(checkpoint))}, GSM8K {os.path.basename(data)} "
        f"prompts {FLAGS.offset}..{FLAGS.offset + FLAGS.num_prompts - 1}, LinearSS B = {sizes}, greedy): "
        f"P(accepted through a drafted token) ~ (running confidence)^{gamma:g} "
        f"(launch/fit_verify_calibration.py).\n\n" + "\n".join(lines) + "\n")
  out_json, out_md = bench.write_report(result, md, cli.output_dir(), "fit_verify_calibration")
  print(f"wrote {out_json} and {out_md}")


if __name__ == "__main__":
  cli.run(main)
