"""Trains a draft adapter by self-distillation: the frozen base model's greedy AR continuations of training prompts
are the targets of its own one-shot block drafts (adapter on for draft tokens only). The verifier is unchanged, so
greedy outputs stay identical and speculation stays lossless; only tau moves. NLD's adapter is a LoRA on o_proj
(the default); a plain Llama converted from a GGUF (SmolLM2) takes one on every projection plus its mask token's
embedding row (--lora_target_modules, --train_mask_embedding; see docs/smollm2_draft.md).

  python launch/distill_lora.py --output_dir runs/distill --export_dir checkpoints/nld-tiny-gsm8k

Phase 1 writes the targets (<output_dir>/targets.jsonl from GSM8K train, targets_chat.jsonl from the shipped chat
set's train split, eval_*.jsonl from held-out prompts; resumable wave by wave); phase 2 trains the adapter (orbax
checkpoints in <output_dir>/train_state; --resume continues a run); --export_dir writes the base weights + adapter,
--adapter_dir the adapter alone as a PEFT directory (for `convert_checkpoint.py --gguf ... --lora_dir`).
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
flags.DEFINE_integer("num_chat", 0, "Train prompts of the shipped chat set (benchmarks/data/chat_prompts.jsonl) "
                     "added to the GSM8K ones (their targets go to targets_chat.jsonl).")
flags.DEFINE_bool("targets_only", False, "Generate (or extend) the targets and stop.")
flags.DEFINE_bool("generate", True, "Generate the missing targets first (--nogenerate: train on the ones there are, "
                  "e.g. while another process extends them).")
flags.DEFINE_integer("num_eval", 0, "Held-out prompts per set (GSM8K test from --eval_data, the chat set's held-out "
                     "topics) whose targets measure tau during training (0: the last --val_fraction of the rows).")
cli.define_data_flag("test", name="eval_data", what="held-out tau")
flags.DEFINE_list("lora_target_modules", ["o_proj"], "Projections the adapter adapts (NLD's: o_proj; a plain "
                  "Llama: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj).")
flags.DEFINE_bool("train_mask_embedding", False, "Also train the mask token's embedding row (a vocabulary whose "
                  "mask token is a spare reserved token).")
flags.DEFINE_bool("resume", False, "Continue the training run in --output_dir (required when one is there).")
flags.DEFINE_integer("eval_batches", 8, "Held-out batches per tau evaluation.")
flags.DEFINE_integer("log_every", 10, "Log the training metrics every N steps.")
flags.DEFINE_bool("final_eval", True, "Print the held-out tau of the base draft and the adapter at the end.")
flags.DEFINE_string("adapter_dir", None, "If set, write the adapter alone here (PEFT: adapter_config.json + "
                    "adapter_model.safetensors, bf16), for `convert_checkpoint.py --gguf ... --lora_dir`.")
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


def _target_sets(base: str, tokenizer, data: str) -> tuple[list[dict], dict[str, list[dict]]]:
  """(training rows, {held-out set name: rows}): each set's greedy targets, generated where missing (the engine
  is built only then: its compile is most of a short run). The held-out sets come first, then the training sets
  grow --concurrency prompts at a time in turn, each wave saved, so a run stopped at any point keeps a balanced
  mix and the next one continues it."""
  from recguide_jax import benchmarks as bench
  from recguide_jax.benchmarks import chat
  from recguide_jax.train import distill
  out = FLAGS.output_dir
  evals = []
  if FLAGS.num_eval:  # held out: GSM8K test questions and the chat prompts of held-out topics
    evals = [("eval_gsm8k_test.jsonl", bench.gsm8k_prompts(cli.data_path("eval_data"), FLAGS.num_eval, tokenizer)),
             ("eval_chat_heldout.jsonl", chat.chat_prompts(tokenizer, "heldout", FLAGS.num_eval))]
  train = [("targets.jsonl", bench.gsm8k_prompts(data, FLAGS.num_prompts or 1 << 30, tokenizer))]
  if FLAGS.num_chat:
    train.append(("targets_chat.jsonl", chat.chat_prompts(tokenizer, "train", FLAGS.num_chat)))
  llm, rows = None, {}

  def extend(name, prompts, upto):
    nonlocal llm
    path = os.path.join(out, name)
    have = sum(1 for l in open(path) if l.strip()) if os.path.exists(path) else 0
    prompts = prompts[:max(have, upto) if FLAGS.generate else have]
    if have < len(prompts) and llm is None:
      from recguide_jax import LLM
      llm = LLM(base, policy="ar", max_num_seqs=FLAGS.concurrency, dtype=FLAGS.dtype,
                max_model_len=FLAGS.max_model_len, warmup=False)
    rows[name] = distill.generate_targets(llm, prompts, path, max_tokens=FLAGS.max_tokens, chunk=FLAGS.concurrency,
                                          concurrency=FLAGS.concurrency)

  for name, prompts in evals:
    extend(name, prompts, len(prompts))
  wave = 0
  while wave == 0 or (FLAGS.generate and any(len(rows[n]) < len(p) for n, p in train)):
    wave += 1
    for name, prompts in train:
      extend(name, prompts, wave * FLAGS.concurrency)
  rows_train = rows["targets.jsonl"]
  if "targets_chat.jsonl" in rows:
    rows_train = distill.interleave(rows_train, rows["targets_chat.jsonl"])
  return rows_train, {n[len("eval_"):-len(".jsonl")]: rows[n] for n, _ in evals if rows[n]}


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
  from recguide_jax.model.config import LORA_TARGET_MODULES
  bad = [m for m in FLAGS.lora_target_modules if m not in LORA_TARGET_MODULES]
  if bad or not FLAGS.lora_target_modules:
    sys.exit(f"error: --lora_target_modules: {bad or 'none'} (choose from {','.join(LORA_TARGET_MODULES)})")
  from recguide_jax import llm as llm_lib
  from recguide_jax.text.tokenizer import Tokenizer
  from recguide_jax.train import distill
  base = FLAGS.model or str(llm_lib.default_checkpoint())
  state_dir = os.path.join(FLAGS.output_dir, "train_state")
  if os.path.isdir(state_dir) and os.listdir(state_dir) and not FLAGS.resume and not FLAGS.targets_only:
    sys.exit(f"error: {state_dir} holds a training run; pass --resume to continue it or pick another --output_dir")
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  from recguide_jax.llm import DEFAULT_COMPILE_CACHE
  from recguide_jax.runtime.compilation import enable_compile_cache
  enable_compile_cache(str(DEFAULT_COMPILE_CACHE))  # a resumed run reuses the train/eval step executables
  rows, evals = _target_sets(base, Tokenizer.from_dir(base), data)
  if FLAGS.targets_only:
    print(f"{len(rows)} training target rows, held out: {({k: len(v) for k, v in evals.items()})}")
    return
  dc = distill.DistillConfig(
      out_dir=FLAGS.output_dir, base_checkpoint=base, lora_rank=FLAGS.lora_rank, lora_alpha=FLAGS.lora_alpha,
      lora_target_modules=tuple(m for m in LORA_TARGET_MODULES if m in FLAGS.lora_target_modules),
      train_mask_embedding=FLAGS.train_mask_embedding,
      seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size, total_steps=FLAGS.total_steps,
      warmup_steps=FLAGS.warmup_steps, lr=FLAGS.lr, block_sizes=sizes, block_probs=probs, mode_probs=modes,
      seed=FLAGS.seed, save_every=FLAGS.save_every, eval_every=FLAGS.eval_every, eval_batches=FLAGS.eval_batches,
      log_every=FLAGS.log_every)
  trainer = distill.DraftLoraTrainer(dc, rows, eval_rows=evals or None)
  trainer.run(FLAGS.steps)
  for name, val in (trainer.val_sets.items() if FLAGS.final_eval else ()):
    base_tau = trainer.accept_proxy(lora_on=False, val=val)
    lora_tau = trainer.accept_proxy(val=val)
    for blk in sizes:
      print(f"{name}: held-out teacher-forced tau at B={blk}: base draft {base_tau.get(blk, float('nan')):.3f} -> "
            f"with the adapter {lora_tau.get(blk, float('nan')):.3f} (step {trainer.step})")
  if FLAGS.adapter_dir:
    trainer.export_adapter(FLAGS.adapter_dir)
    print(f"wrote the draft adapter (step {trainer.step}) to {FLAGS.adapter_dir}")
  if FLAGS.export_dir and trainer.step >= dc.total_steps:
    trainer.export(FLAGS.export_dir)
    print(f"exported base + draft LoRA to {FLAGS.export_dir}")


if __name__ == "__main__":
  cli.run(main)
