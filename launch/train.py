"""Trains a small NLD model on GSM8K with the joint AR + block-diffusion objective and exports a serving checkpoint.

  python launch/train.py --output_dir runs/tiny --total_steps 1500 --export_dir checkpoints/nld-tiny-gsm8k

Re-running the same command resumes from the latest checkpoint in --output_dir (exactly: same batches, same noise).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Run directory: tokenizer, orbax train state, log, loss curves.")
cli.define_gsm8k_dir_flag()
flags.DEFINE_string("export_dir", None, "If set, write the serving checkpoint here when training ends.")
flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size (incl. special tokens).")
flags.DEFINE_integer("hidden_size", 256, "Model width.")
flags.DEFINE_integer("num_layers", 4, "Decoder layers.")
flags.DEFINE_integer("num_heads", 8, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 2, "KV heads (GQA).")
flags.DEFINE_integer("head_dim", 32, "Head dimension.")
flags.DEFINE_integer("intermediate_size", 768, "SwiGLU hidden size.")
flags.DEFINE_integer("seq_len", 512, "Training sequence length (the joint step runs 2x this).")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_integer("total_steps", 1500, "Total optimizer steps (both stages).")
flags.DEFINE_integer("ar_steps", 150, "AR-only warm-up steps (stage 1).")
flags.DEFINE_integer("warmup_steps", 50, "Learning-rate warm-up steps.")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay.")
flags.DEFINE_float("clip_norm", 1.0, "Gradient clipping (global norm).")
flags.DEFINE_list("block_sizes", ["8", "16", "32"], "Diffusion training block sizes.")
flags.DEFINE_list("block_probs", ["0.25", "0.35", "0.4"], "Probability of each training block size.")
flags.DEFINE_integer("seed", 0, "Seed for init, data order and noise.")
flags.DEFINE_integer("save_every", 100, "Checkpoint every N steps.")
flags.DEFINE_integer("eval_every", 250, "Held-out AR loss on GSM8K test every N steps (0: off).")
flags.DEFINE_integer("steps", None, "Stop after this many more steps (for running in slices).")


def main(argv):
  del argv
  cli.quiet_logging()
  if not FLAGS.output_dir:
    sys.exit("error: --output_dir is required")
  if not os.path.exists(os.path.join(FLAGS.gsm8k_dir, "train.jsonl")):
    sys.exit(f"error: --gsm8k_dir {FLAGS.gsm8k_dir} has no train.jsonl (pass --gsm8k_dir=DIR or set "
             "$RECGUIDE_GSM8K_DIR; GSM8K is not part of the repository)")
  sizes, probs = cli.block_mix_flags()
  if not 0 <= FLAGS.ar_steps < FLAGS.total_steps or FLAGS.warmup_steps >= FLAGS.total_steps:
    sys.exit("error: need 0 <= --ar_steps < --total_steps and --warmup_steps < --total_steps")
  from recguide_jax.train.trainer import TrainConfig, Trainer
  tc = TrainConfig(
      out_dir=FLAGS.output_dir, data_dir=FLAGS.gsm8k_dir, vocab_size=FLAGS.vocab_size, hidden_size=FLAGS.hidden_size,
      num_layers=FLAGS.num_layers, num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
      head_dim=FLAGS.head_dim, intermediate_size=FLAGS.intermediate_size, seq_len=FLAGS.seq_len,
      batch_size=FLAGS.batch_size, total_steps=FLAGS.total_steps, ar_steps=FLAGS.ar_steps,
      warmup_steps=FLAGS.warmup_steps, lr=FLAGS.lr, weight_decay=FLAGS.weight_decay, clip_norm=FLAGS.clip_norm,
      block_sizes=sizes, block_probs=probs, seed=FLAGS.seed, save_every=FLAGS.save_every,
      eval_every=FLAGS.eval_every)
  trainer = Trainer(tc)
  trainer.run(FLAGS.steps)
  logging.info("finished at step %d; held-out AR CE %.4f", trainer.step, trainer.eval_ar_loss() or float("nan"))
  if FLAGS.export_dir and trainer.step >= tc.total_steps:
    trainer.export(FLAGS.export_dir)
    print(f"exported serving checkpoint to {FLAGS.export_dir}")


if __name__ == "__main__":
  cli.run(main)
