"""Greedy outputs of every decoding mode on the first GSM8K test prompts, as token ids in one JSON file; with
--baseline, compares them against an earlier run's and exits 1 naming the first prompt and mode that differ.

A refactoring that must not change behaviour is checked by running this before and after it:

  python launch/check_outputs.py --output_dir runs/greedy_before
  python launch/check_outputs.py --output_dir runs/greedy_after --baseline runs/greedy_before/check_outputs.json

Modes: ar, linear8/16/32 (LinearSS at a fixed block size), diffusion (block 32, threshold 0.9) and recguide
(the checkpoint's fitted tables and profile, with the online wall-clock calibration off so that the decisions, and
with them the batch shapes, depend on the outputs alone and not on the machine's speed).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags, logging  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Checkpoint dir (default: the bundled model).")
cli.define_data_flag("test", what="its first --num_prompts questions are the prompts")
flags.DEFINE_integer("num_prompts", 64, "Prompts from the start of --data.")
flags.DEFINE_integer("max_tokens", 128, "New tokens per request (greedy, stops at EOS).")
flags.DEFINE_integer("max_num_seqs", 8, "Requests decoded together.")
flags.DEFINE_list("modes", ["ar", "linear8", "linear16", "linear32", "diffusion", "recguide"], "Decoding modes.")
flags.DEFINE_string("output_dir", None, "Writes the token ids to <output_dir>/check_outputs.json.")
flags.DEFINE_string("baseline", None, "JSON file of an earlier run to compare against (exit 1 on a difference).")

MODES = ("ar", "linear8", "linear16", "linear32", "diffusion", "recguide")


def gsm8k_questions(path: str, n: int) -> list[str]:
  if not os.path.exists(path):
    sys.exit(f"error: --data {path} does not exist")
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r["question"].strip() for r in rows[:n]]


def strategy_for(mode: str, checkpoint):
  from recguide_jax import llm as llm_lib
  from recguide_jax.decoding.registry import make_strategy
  if mode == "ar":
    return make_strategy("ar")
  if mode.startswith("linear"):
    return make_strategy("linear", int(mode[len("linear"):]))
  if mode == "diffusion":
    return make_strategy("diffusion", 32, 0.9)
  return make_strategy("recguide", 16, calibrate=False,
                       **llm_lib.recguide_defaults(checkpoint or llm_lib.default_checkpoint()))


def first_difference(got: dict, want: dict) -> str | None:
  for mode in want["outputs"]:
    if mode not in got["outputs"]:
      continue
    for i, (a, b) in enumerate(zip(got["outputs"][mode], want["outputs"][mode])):
      if a != b:
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"mode {mode}, prompt {i}: first difference at output token {k} ({a[k:k + 4]} vs {b[k:k + 4]})"
  return None


def main(argv):
  del argv
  if flags.FLAGS["verbosity"].using_default_value:
    logging.set_verbosity(logging.WARNING)
  bad = [m for m in FLAGS.modes if m not in MODES]
  if bad:
    sys.exit(f"error: --modes holds {bad}; expected some of {','.join(MODES)}")
  if FLAGS.num_prompts <= 0 or FLAGS.max_tokens <= 0:
    sys.exit("error: --num_prompts and --max_tokens must be positive")
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax.model.config import BLOCK_SIZES
  llm = LLM(FLAGS.model, policy="ar", block_sizes=BLOCK_SIZES, max_num_seqs=FLAGS.max_num_seqs,
            max_model_len=1024, warmup=False)
  if llm.tokenizer is None:
    sys.exit("error: the checkpoint has no tokenizer")
  prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]))
             for q in gsm8k_questions(cli.data_path(), FLAGS.num_prompts)]
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  result = {"meta": {"checkpoint": str(FLAGS.model or "bundled"), "num_prompts": len(prompts),
                     "max_tokens": FLAGS.max_tokens, "max_num_seqs": FLAGS.max_num_seqs}, "outputs": {}}
  for mode in FLAGS.modes:
    llm.set_policy(strategy_for(mode, FLAGS.model))
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["outputs"][mode] = [list(o.outputs[0].token_ids) for o in outs]
    print(f"{mode:<10} {sum(len(o.outputs[0].token_ids) for o in outs)} tokens", flush=True)
  if FLAGS.output_dir:
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "check_outputs.json"), "w") as f:
      json.dump(result, f)
  if FLAGS.baseline:
    with open(FLAGS.baseline) as f:
      want = json.load(f)
    if want["meta"] != result["meta"]:
      sys.exit(f"error: the baseline was run with {want['meta']}, this run with {result['meta']}")
    diff = first_difference(result, want)
    if diff:
      print(f"DIFFERENT from {FLAGS.baseline}: {diff}")
      sys.exit(1)
    print(f"identical to {FLAGS.baseline} ({', '.join(m for m in result['outputs'] if m in want['outputs'])})")


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
