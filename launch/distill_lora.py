"""Trains NLD's draft LoRA (o_proj, all layers) by self-distillation: the frozen base model's greedy AR continuations
of GSM8K train prompts are the targets of its own one-shot block drafts (LoRA on for draft tokens only). The
verifier is unchanged, so greedy outputs stay identical and speculation stays lossless; only tau moves.

  python launch/distill_lora.py --output_dir runs/distill --export_dir checkpoints/nld-tiny-gsm8k

Phase 1 writes <output_dir>/targets.jsonl (resumable, chunk by chunk); phase 2 trains the adapter (orbax checkpoints in
<output_dir>/train_state, resumable); the export writes the base weights + adapter and `draft_lora` in config.json.
Re-running the same command resumes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flag("Base checkpoint dir, distilled for its own draft LoRA (default: the bundled model).")
cli.define_data_flag("train")
flags.DEFINE_integer("num_prompts", None, "Prompts from the start of --data (default: all).")
flags.DEFINE_integer("max_tokens", 160, "Greedy tokens per target continuation.")
flags.DEFINE_integer("concurrency", 64, "Requests in flight while generating targets.")
cli.define_dtype_flag()  # of the model that generates the targets (serve in the dtype you distil for)
flags.DEFINE_integer("max_model_len", 1024, "Longest prompt + target of the engine that generates the targets.")
flags.DEFINE_string("output_dir", None, "Run directory: targets.jsonl, orbax train state, log, curves.")
flags.DEFINE_string("export_dir", None, "If set, write the serving checkpoint (base + adapter) here at the end.")
flags.DEFINE_integer("lora_rank", 128, "Adapter rank (NLD: 128).")
flags.DEFINE_float("lora_alpha", 512.0, "Adapter alpha (NLD: 512, scale alpha/rank = 4).")
flags.DEFINE_integer("seq_len", 512, "Packed training sequence length (the step runs 2x this).")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_integer("total_steps", 900, "Optimizer steps.")
flags.DEFINE_integer("warmup_steps", 50, "Learning-rate warm-up steps.")
flags.DEFINE_float("lr", 1e-3, "Peak learning rate (AdamW, cosine decay).")
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "Draft block sizes trained.")
flags.DEFINE_list("block_probs", ["0.3", "0.35", "0.35"], "Probability of each block size per step.")
flags.DEFINE_list("mode_probs", ["0.6", "0.2", "0.2"],
                  "Block layouts: seeded (first token clean), unseeded (all masked), partially masked.")
flags.DEFINE_integer("seed", 0, "Seed for init, data order and masks.")
flags.DEFINE_integer("save_every", 100, "Checkpoint every N steps.")
flags.DEFINE_integer("eval_every", 150, "Held-out teacher-forced tau every N steps (0: off).")
flags.DEFINE_integer("steps", None, "Stop after this many more steps (for running in slices).")


def main(argv):
  del argv
  cli.quiet_logging()
  if not FLAGS.output_dir:
    sys.exit("error: --output_dir is required")
  data = cli.data_path()
  sizes, probs = cli.block_mix_flags()
  modes = cli.weights_flag("mode_probs", 3)  # seeded, unseeded, partial
  if FLAGS.lora_rank <= 0 or FLAGS.lora_alpha <= 0:
    sys.exit("error: --lora_rank and --lora_alpha must be positive")
  if FLAGS.warmup_steps >= FLAGS.total_steps:
    sys.exit("error: need --warmup_steps < --total_steps")
  from recguide_jax import LLM
  from recguide_jax import benchmarks as bench
  from recguide_jax import llm as llm_lib
  from recguide_jax.train import distill
  base = FLAGS.model or str(llm_lib.default_checkpoint())
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  llm = LLM(base, policy="ar", max_num_seqs=FLAGS.concurrency, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len)
  prompts = bench.gsm8k_prompts(data, FLAGS.num_prompts or 1 << 30, llm.tokenizer)
  rows = distill.generate_targets(llm, prompts, os.path.join(FLAGS.output_dir, "targets.jsonl"),
                                  max_tokens=FLAGS.max_tokens, concurrency=FLAGS.concurrency)
  del llm
  dc = distill.DistillConfig(
      out_dir=FLAGS.output_dir, base_checkpoint=base, lora_rank=FLAGS.lora_rank, lora_alpha=FLAGS.lora_alpha,
      seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, total_steps=FLAGS.total_steps,
      warmup_steps=FLAGS.warmup_steps, lr=FLAGS.lr, block_sizes=sizes, block_probs=probs, mode_probs=modes,
      seed=FLAGS.seed, save_every=FLAGS.save_every, eval_every=FLAGS.eval_every)
  trainer = distill.DraftLoraTrainer(dc, rows)
  trainer.run(FLAGS.steps)
  base_tau = trainer.accept_proxy(lora_on=False)
  lora_tau = trainer.accept_proxy()
  for blk in sizes:
    print(f"held-out teacher-forced tau at B={blk}: base draft {base_tau.get(blk, float('nan')):.3f} -> "
          f"with the adapter {lora_tau.get(blk, float('nan')):.3f}")
  if FLAGS.export_dir and trainer.step >= dc.total_steps:
    trainer.export(FLAGS.export_dir)
    print(f"exported base + draft LoRA to {FLAGS.export_dir}")


if __name__ == "__main__":
  cli.run(main)
