"""Training loop for small NLD models: AR-only warm-up, then the joint AR + diffusion objective. optax AdamW with
warm-up and cosine decay, gradient clipping, orbax checkpoints that resume exactly (params, optimizer state, step;
the data order and noise are pure functions of (seed, step)), a progress bar and loss curves as PNG."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from recguide_jax.model import checkpoint as ckpt_lib
from recguide_jax.model.config import NLDConfig
from recguide_jax.model.nld import NLDModel
from recguide_jax.train import data as data_lib
from recguide_jax.train import objective


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  out_dir: str
  data_dir: str = "../shared/data/gsm8k"
  # model
  vocab_size: int = 2048
  hidden_size: int = 256
  num_layers: int = 6
  num_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 32
  intermediate_size: int = 768
  # data
  seq_len: int = 512
  batch_size: int = 8
  # schedule
  total_steps: int = 3000
  ar_steps: int = 300  # stage 1: AR only
  warmup_steps: int = 100
  lr: float = 1.5e-3
  min_lr_ratio: float = 0.05
  weight_decay: float = 0.1
  b2: float = 0.95
  clip_norm: float = 1.0
  # diffusion training block sizes and how often each is drawn
  block_sizes: tuple[int, ...] = (8, 16, 32)
  block_probs: tuple[float, ...] = (0.25, 0.35, 0.4)
  seed: int = 0
  save_every: int = 200
  eval_every: int = 500
  eval_batches: int = 8
  log_every: int = 10

  def model_config(self, tok_vocab: int) -> NLDConfig:
    return NLDConfig(
        vocab_size=tok_vocab, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_type="yarn", rope_theta=1.0e4,
        rope_factor=1.0, original_max_position_embeddings=4096, llama_4_scaling_beta=0.1,
        mask_token_id=data_lib.SPECIAL_TOKENS.index(data_lib.MASK),
        bos_token_id=data_lib.SPECIAL_TOKENS.index(data_lib.BOS),
        eos_token_ids=(data_lib.SPECIAL_TOKENS.index(data_lib.EOS),),
        pad_token_id=0, block_size=max(self.block_sizes))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.total_steps,
                                                end_value=tc.lr * tc.min_lr_ratio)
  return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay))


class Trainer:

  def __init__(self, tc: TrainConfig, *, docs=None, tokenizer=None, eval_docs=None, progress: bool = True):
    self.tc = tc
    self.out = pathlib.Path(tc.out_dir)
    self.out.mkdir(parents=True, exist_ok=True)
    self.progress = progress
    data_dir = pathlib.Path(tc.data_dir)
    if tokenizer is None:
      tok_path = self.out / "tokenizer.json"
      if tok_path.exists():  # resume: the tokenizer must not change under a checkpoint
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tok_path))
      else:
        rows = data_lib.load_gsm8k(data_dir / "train.jsonl")
        texts = [data_lib.render(data_lib.gsm8k_messages(r)) for r in rows]
        tokenizer = data_lib.train_tokenizer(texts, tc.vocab_size)
        data_lib.save_tokenizer(tokenizer, self.out)
    self.tokenizer = tokenizer
    if docs is None:
      docs = data_lib.encode_documents(tokenizer, data_lib.load_gsm8k(data_dir / "train.jsonl"))
    if eval_docs is None and (data_dir / "test.jsonl").exists():
      eval_docs = data_lib.encode_documents(tokenizer, data_lib.load_gsm8k(data_dir / "test.jsonl"))
    self.batches = data_lib.PackedBatches(docs, tc.seq_len, tc.batch_size, tc.seed)
    self.eval_batches = (data_lib.PackedBatches(eval_docs, tc.seq_len, tc.batch_size, seed=12345)
                         if eval_docs else None)
    self.cfg = tc.model_config(tokenizer.get_vocab_size())
    model = NLDModel(self.cfg, rngs=nnx.Rngs(tc.seed))
    self.graphdef, self.params = nnx.split(model)
    self._init_train_state()
    self._eval_fn = jax.jit(self._eval_loss)

  def _init_train_state(self) -> None:
    """Optimizer state for `self.params` (what trains), step 0, the orbax manager of <out_dir>/train_state."""
    self.tx = make_optimizer(self.tc)
    self.opt_state = self.tx.init(self.params)
    self.step = 0
    self.manager = ocp.CheckpointManager(self.out.absolute() / "train_state",
                                         options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    self._steps = {}

  # ---- steps ---------------------------------------------------------------------------------------------------------
  def block_size_at(self, step: int) -> int:
    rng = np.random.default_rng([self.tc.seed, step, 7])
    return int(rng.choice(self.tc.block_sizes, p=np.asarray(self.tc.block_probs) / sum(self.tc.block_probs)))

  def _train_step_fn(self, stage: str, block_size: int):
    key = (stage, block_size)
    if key in self._steps:
      return self._steps[key]
    mask_id = self.cfg.mask_token_id

    def step_fn(params, opt_state, x0, rng):
      def loss_fn(p):
        model = nnx.merge(self.graphdef, p)
        if stage == "ar":
          return objective.ar_loss(model, x0)
        return objective.joint_loss(model, x0, rng, block_size, mask_id)

      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics["grad_norm"] = optax.global_norm(grads)
      return params, opt_state, metrics

    fn = jax.jit(step_fn, donate_argnums=(0, 1))
    self._steps[key] = fn
    return fn

  def _eval_loss(self, params, x0):
    model = nnx.merge(self.graphdef, params)
    return objective.ar_loss(model, x0)[0]

  def train_step(self):
    s = self.step
    stage = "ar" if s < self.tc.ar_steps else "joint"
    blk = self.block_size_at(s)
    x0 = jnp.asarray(self.batches.batch(s))
    rng = jax.random.fold_in(jax.random.key(self.tc.seed), s)
    fn = self._train_step_fn(stage, blk if stage == "joint" else 0)
    self.params, self.opt_state, metrics = fn(self.params, self.opt_state, x0, rng)
    self.step += 1
    return {k: float(v) for k, v in metrics.items()} | {"step": s, "stage": stage, "block_size": blk}

  def eval_ar_loss(self) -> float | None:
    if self.eval_batches is None:
      return None
    n = min(self.tc.eval_batches, self.eval_batches.batches_per_epoch)
    losses = [float(self._eval_fn(self.params, jnp.asarray(self.eval_batches.batch(i)))) for i in range(n)]
    return float(np.mean(losses))

  # ---- checkpoints ---------------------------------------------------------------------------------------------------
  def save(self) -> None:
    self.manager.save(self.step, args=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}))
    self.manager.wait_until_finished()

  def restore(self) -> bool:
    latest = self.manager.latest_step()
    if latest is None:
      return False
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": self.params, "opt_state": self.opt_state})
    state = self.manager.restore(latest, args=ocp.args.StandardRestore(target))
    self.params, self.opt_state = state["params"], state["opt_state"]
    self.step = latest
    return True

  def export(self, directory: str | pathlib.Path) -> None:
    """Writes the serving checkpoint (config.json, params/, tokenizer files)."""
    directory = pathlib.Path(directory)
    ckpt_lib.save_model(directory, nnx.merge(self.graphdef, self.params))
    data_lib.save_tokenizer(self.tokenizer, directory)

  # ---- loop ----------------------------------------------------------------------------------------------------------
  def log_path(self) -> pathlib.Path:
    return self.out / "train_log.jsonl"

  def _truncate_log(self) -> None:
    path = self.log_path()
    if path.exists():
      keep = [l for l in path.read_text().splitlines() if l and json.loads(l)["step"] < self.step]
      path.write_text("".join(l + "\n" for l in keep))

  def evaluate(self) -> dict:
    """Held-out metrics logged every `eval_every` steps."""
    return {"eval_ar_ce": self.eval_ar_loss()}

  def progress_postfix(self, m: dict) -> dict:
    return {"loss": f"{m['loss']:.3f}", "ar": f"{m['ar_ce']:.3f}", "diff": f"{m['diff_ce']:.3f}"}

  def plot(self) -> None:
    plot_curves(self.log_path(), self.out / "loss_curves.png")

  def run(self, steps: int | None = None) -> None:
    """Trains until `total_steps` (or `steps` more steps), checkpointing every `save_every`."""
    resumed = self.restore()
    self._truncate_log()
    end = self.tc.total_steps if steps is None else min(self.tc.total_steps, self.step + steps)
    bar = None
    if self.progress:
      from tqdm import tqdm
      bar = tqdm(total=end, initial=self.step, desc="training" + (" (resumed)" if resumed else ""), unit="step")
    tokens_per_step = self.tc.batch_size * self.tc.seq_len
    t0 = time.perf_counter()
    with open(self.log_path(), "a") as log:
      while self.step < end:
        m = self.train_step()
        evaluated = bool(self.tc.eval_every and self.step % self.tc.eval_every == 0)
        if evaluated:
          m.update(self.evaluate())
        if m["step"] % self.tc.log_every == 0 or evaluated:
          m["elapsed_s"] = time.perf_counter() - t0
          log.write(json.dumps(m) + "\n")
          log.flush()
        if bar is not None:
          bar.update(1)
          bar.set_postfix(**self.progress_postfix(m),
                          tok_s=f"{tokens_per_step * (bar.n - bar.initial) / max(time.perf_counter() - t0, 1e-9) :.0f}")
        if self.step % self.tc.save_every == 0 or self.step == end:
          self.save()
    if bar is not None:
      bar.close()
    self.plot()


def plot_curves(log_path: pathlib.Path, png_path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(l) for l in log_path.read_text().splitlines() if l]
  if not rows:
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  steps = [r["step"] for r in rows]
  ax.plot(steps, [r["ar_ce"] for r in rows], label="AR CE (train)")
  joint = [r for r in rows if r["stage"] == "joint"]
  if joint:
    ax.plot([r["step"] for r in joint], [r["diff_ce"] for r in joint], label="diffusion CE (train, masked)")
  ev = [r for r in rows if r.get("eval_ar_ce") is not None]
  if ev:
    ax.plot([r["step"] for r in ev], [r["eval_ar_ce"] for r in ev], "o-", label="AR CE (GSM8K test)")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
