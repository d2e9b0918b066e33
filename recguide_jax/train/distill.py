"""Draft LoRA by self-distillation (docs/spec/nld.md §3.3): the verifier is the frozen base model, the draft is the same
model with a LoRA on every `o_proj` switched on for draft tokens only. The targets are the verifier's own greedy
continuations of training prompts, so the draft learns to predict exactly what verification will accept; the
verifier (LoRA off) is unchanged, so greedy outputs stay the same and speculation stays lossless.

Each training row packs (prompt + greedy continuation) documents into `seq_len` tokens. The noisy stream of the
doubled sequence `[x_t | x_0]` is cut into blocks of B (8, 16 or 32 per step) laid out the way the engine drafts:

- "seeded" blocks: the first token clean (the last committed token / a correction token), the rest masked
  (LinearSS drafts and correction branches);
- "unseeded" blocks: every token masked (the continuation branch, whose first token is the unknown bonus);
- a share of blocks masked at a random rate with the first token clean (the diffusion-mode denoiser's later
  iterations), so the adapter stays sane for partially filled blocks.

The loss is the cross-entropy on masked positions whose target is a continuation token (prompt tokens are data,
never drafted). Only the LoRA parameters train; base weights are frozen.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import optax
from flax import nnx

from recguide_jax.model import checkpoint as ckpt_lib
from recguide_jax.model import draft_head
from recguide_jax.model.config import DraftHead
from recguide_jax.model.params import flatten_params, unflatten_params
from recguide_jax.model.nld import ForwardInputs, NLDModel
from recguide_jax.train import data as data_lib
from recguide_jax.train.data import PackedBatches
from recguide_jax.train.trainer import Trainer

SEEDED, UNSEEDED, PARTIAL = 0, 1, 2


# ---- targets -------------------------------------------------------------------------------------------------------
def generate_targets(llm, prompts: list[list[int]], out_path: str | pathlib.Path, *, max_tokens: int,
                     chunk: int = 256, concurrency: int = 64, progress: bool = True) -> list[dict]:
  """Greedy AR continuations of `prompts` by `llm` (its policy is set to AR), appended to a JSONL file chunk by
  chunk so an interrupted run continues where it stopped. Returns every {"prompt": ids, "output": ids} row."""
  from recguide_jax import SamplingParams
  from recguide_jax import benchmarks as bench
  from recguide_jax.decoding.builtin import ARStrategy
  out_path = pathlib.Path(out_path)
  done = [json.loads(l) for l in out_path.read_text().splitlines() if l.strip()] if out_path.exists() else []
  if len(done) > len(prompts) or any(d["prompt"] != list(p) for d, p in zip(done, prompts)):
    raise ValueError(f"{out_path} holds targets for other prompts; delete it or pick another --output_dir")
  if len(done) == len(prompts):
    return done  # nothing to generate: `llm` may be None
  llm.set_policy(ARStrategy())
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(prompts), initial=len(done), desc="greedy targets", unit="prompt")
  with open(out_path, "a") as f:
    for lo in range(len(done), len(prompts), chunk):
      batch = prompts[lo:lo + chunk]
      reqs, _ = bench.run_concurrent(llm.engine, batch, params, concurrency)
      for p, r in zip(batch, reqs):
        row = {"prompt": list(map(int, p)), "output": list(map(int, r.output_ids))}
        f.write(json.dumps(row) + "\n")
        done.append(row)
      f.flush()
      if bar is not None:
        bar.update(len(batch))
  if bar is not None:
    bar.close()
  return done


def interleave(a: list, b: list) -> list:
  """a and b merged evenly (each keeps its order), so a held-out tail and every batch see both prompt sets."""
  n = len(a) + len(b)
  if not a or not b:
    return list(a) + list(b)
  out, i, j = [], 0, 0
  for k in range(n):
    if j >= len(b) or (i < len(a) and i * len(b) <= j * len(a)):
      out.append(a[i])
      i += 1
    else:
      out.append(b[j])
      j += 1
  return out


def target_documents(rows: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(documents, weights): prompt + continuation token ids, weight 1 on continuation tokens only."""
  docs, weights = [], []
  for r in rows:
    if not r["output"]:
      continue
    docs.append(np.asarray(r["prompt"] + r["output"], np.int32))
    weights.append(np.concatenate([np.zeros(len(r["prompt"]), np.float32), np.ones(len(r["output"]), np.float32)]))
  return docs, weights


# ---- objective -----------------------------------------------------------------------------------------------------
def draft_noise(key: jax.Array, x0: jax.Array, block_size: int, mask_token_id: int,
                mode_probs: tuple[float, float, float]):
  """Masks x0 [b, L] block by block in the engine's draft layouts. Returns (x_t, masked, mode [b, L])."""
  b, n = x0.shape
  k_mode, k_rate, k_mask = jax.random.split(key, 3)
  nb = n // block_size
  probs = jnp.asarray(mode_probs, jnp.float32) / sum(mode_probs)
  mode = jnp.repeat(jax.random.choice(k_mode, 3, (b, nb), p=probs), block_size, axis=1)
  rate = jnp.repeat(jax.random.uniform(k_rate, (b, nb)), block_size, axis=1)
  first = (jnp.arange(n) % block_size == 0)[None, :]
  partial = jax.random.uniform(k_mask, (b, n)) < rate
  masked = jnp.where(mode == UNSEEDED, True, jnp.where(mode == SEEDED, ~first, partial & ~first))
  return jnp.where(masked, mask_token_id, x0), masked, mode


def with_mask_embedding(frozen: nnx.State, mask_embed: jax.Array | None, mask_token_id: int) -> nnx.State:
  """The frozen state with `mask_embed` [H] as the mask token's embedding row (None: unchanged), a new State (the
  arrays of `frozen` are not touched). A tied head then also scores the mask token with it, which changes nothing
  served: sampling always excludes the mask token."""
  if mask_embed is None:
    return frozen
  emb = frozen["embed_tokens"]["embedding"]
  new = emb.replace(emb[...].at[mask_token_id].set(mask_embed.astype(emb[...].dtype)))
  return nnx.State({**frozen, "embed_tokens": nnx.State({**frozen["embed_tokens"], "embedding": new})})


def draft_logits(model, xt: jax.Array, x0: jax.Array, block_size: int, mask_token_id: int,
                 head: DraftHead = DraftHead.SAME_POSITION) -> jax.Array:
  """The draft's logits for each token of x_t [b, L] (index i drafts token i), from the doubled sequence
  [x_t | x_0] under the sbd block-diffusion mask, read as `head` drafts in serving (its in-block mask, the draft
  adapter on x_t's tokens it is on for, the position that drafts each token; model/draft_head.py)."""
  b, n = x0.shape
  pos = jnp.arange(n)
  lora = jnp.concatenate([draft_head.adapter_rows(head, xt, mask_token_id), jnp.zeros((b, n), bool)], axis=1)
  inp = ForwardInputs(tokens=jnp.concatenate([xt, x0], axis=1),
                      positions=jnp.broadcast_to(jnp.concatenate([pos, pos]), (b, 2 * n)), block_mask=None,
                      train_block_size=block_size, train_draft_head=head,
                      scale_positions=jnp.broadcast_to(jnp.arange(2 * n), (b, 2 * n)), lora_mask=lora)
  logits, _ = model(inp)
  return draft_head.align(head, logits[:, :n], block_size)


def draft_distill_loss(model, x0: jax.Array, weight: jax.Array, key: jax.Array, block_size: int, mask_token_id: int,
                       mode_probs: tuple[float, float, float], head: DraftHead = DraftHead.SAME_POSITION):
  """Mean CE of the draft on masked continuation tokens. Returns (loss, metrics)."""
  xt, masked, _ = draft_noise(key, x0, block_size, mask_token_id, mode_probs)
  if head is DraftHead.NEXT_POSITION:  # a block's first token is drafted by no position of its block
    masked = masked & (jnp.arange(x0.shape[1]) % block_size != 0)[None, :]
  logits = draft_logits(model, xt, x0, block_size, mask_token_id, head)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(lp, x0[..., None], axis=-1)[..., 0]
  w = masked * weight
  n = jnp.maximum(jnp.sum(w), 1.0)
  loss = jnp.sum(ce * w) / n
  acc = jnp.sum((jnp.argmax(logits, -1) == x0) * w) / n
  return loss, {"loss": loss, "draft_ce": loss, "draft_acc": acc}


def seeded_accept_proxy(model, x0: jax.Array, weight: jax.Array, block_size: int, mask_token_id: int,
                        head: DraftHead = DraftHead.SAME_POSITION):
  """LinearSS on teacher-forced blocks: for every block whose tokens are all continuation tokens, the draft sees
  the clean prefix and the block's first token, and greedy verification would accept 1 + the number of leading
  draft positions equal to the verifier's greedy tokens (the targets). Returns (sum of accepted lengths, blocks)."""
  b, n = x0.shape
  first = (jnp.arange(n) % block_size == 0)[None, :]
  xt = jnp.where(first, x0, mask_token_id)
  logits = draft_logits(model, xt, x0, block_size, mask_token_id, head)
  ok = (jnp.argmax(logits, -1) == x0).reshape(b, n // block_size, block_size)
  lead = jnp.sum(jnp.cumprod(ok[..., 1:], axis=-1), axis=-1) + 1
  full = jnp.all(weight.reshape(b, n // block_size, block_size) > 0, axis=-1)
  return jnp.sum(jnp.where(full, lead, 0)), jnp.sum(full)


# ---- trainer -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistillConfig:
  out_dir: str
  base_checkpoint: str
  lora_rank: int = 128
  lora_alpha: float = 512.0  # NLD's adapter: r 128, alpha 512 (scale 4)
  lora_target_modules: tuple[str, ...] = ("o_proj",)  # NLD's; a plain Llama's adapter may take every projection
  train_mask_embedding: bool = False  # also train the mask token's embedding row (a vocabulary without one)
  seq_len: int = 512
  batch_size: int = 8
  total_steps: int = 1000
  warmup_steps: int = 50
  lr: float = 1e-3
  min_lr_ratio: float = 0.05
  weight_decay: float = 0.0
  b2: float = 0.99
  clip_norm: float = 1.0
  block_sizes: tuple[int, ...] = (8, 16, 32)
  block_probs: tuple[float, ...] = (0.3, 0.35, 0.35)
  mode_probs: tuple[float, float, float] = (0.6, 0.2, 0.2)  # seeded, unseeded, partially masked blocks
  val_fraction: float = 0.03
  seed: int = 0
  save_every: int = 100
  eval_every: int = 200
  eval_batches: int = 8
  log_every: int = 10


def _is_lora(path, value) -> bool:
  del value
  return bool(path) and path[-1] in ("lora_a", "lora_b")


def with_fresh_lora(base, rank: int, alpha: float, seed: int, target_modules: tuple[str, ...] = ("o_proj",)):
  """A model with `base`'s weights (any adapter it had is dropped) and a new zero-effect LoRA (B = 0)."""
  cfg = base.cfg.replace(lora_rank=rank, lora_alpha=alpha, lora_target_modules=tuple(target_modules))
  param_dtype = jax.tree.leaves(nnx.state(base, nnx.Param))[0].dtype
  model = NLDModel(cfg, rngs=nnx.Rngs(seed), dtype=param_dtype, param_dtype=param_dtype)
  base_flat = {k: v for k, v in flatten_params(nnx.state(base, nnx.Param).to_pure_dict()).items()
               if not k.endswith(("lora_a", "lora_b"))}
  state = nnx.state(model, nnx.Param)
  flat = flatten_params(state.to_pure_dict()) | base_flat
  nnx.replace_by_pure_dict(state, unflatten_params(state.to_pure_dict(), flat))
  nnx.update(model, state)
  return model


class DraftLoraTrainer(Trainer):
  """Trains only the draft LoRA of a frozen base checkpoint on self-distillation targets. Checkpointing, resume and
  the loop are the joint trainer's (the train state holds the adapter and its optimizer state only)."""

  # pylint: disable-next=super-init-not-called
  def __init__(self, dc: DistillConfig, rows: list[dict], *, progress: bool = True,
               eval_rows: dict[str, list[dict]] | None = None):
    """`eval_rows`: named held-out target sets ({"gsm8k_test": rows, ...}); each gets its own teacher-forced tau
    (`eval_tau_<name>_<B>`). Without them the last `val_fraction` of `rows` is held out."""
    self.tc = dc
    self.out = pathlib.Path(dc.out_dir)
    self.out.mkdir(parents=True, exist_ok=True)
    self.progress = progress
    self.base_dir = pathlib.Path(dc.base_checkpoint)
    base = ckpt_lib.load_model(self.base_dir)
    model = with_fresh_lora(base, dc.lora_rank, dc.lora_alpha, dc.seed, dc.lora_target_modules)
    self.cfg = model.cfg
    self.graphdef, lora, self.frozen = nnx.split(model, _is_lora, ...)
    # what trains: the adapter, and the mask token's embedding row (initialised from the base row)
    self.params = {"lora": lora}
    if dc.train_mask_embedding:
      self.params["mask_embed"] = jnp.asarray(model.embed_tokens.embedding[...][self.cfg.mask_token_id])
    docs, weights = target_documents(rows)
    n_val = max(1, int(len(docs) * dc.val_fraction)) if dc.val_fraction > 0 and not eval_rows else 0
    split = len(docs) - n_val
    self.batches = data_lib.PackedBatches(docs[:split], dc.seq_len, dc.batch_size, dc.seed, weights=weights[:split])
    if not self.batches.batches_per_epoch:
      raise ValueError(f"{len(docs[:split])} training documents fill no batch of {dc.batch_size} x {dc.seq_len} "
                       "tokens: generate more targets or lower --batch_size / --seq_len")
    self.val_sets = {}
    for name, r in (eval_rows or ({"val": rows[split:]} if n_val else {})).items():
      d, w = target_documents(r)
      val = data_lib.PackedBatches(d, dc.seq_len, min(dc.batch_size, 4), 12345, weights=w)
      if val.batches_per_epoch:  # too few held-out tokens for one batch: not measured
        self.val_sets[name] = val
    self.val_batches = next(iter(self.val_sets.values()), None)
    self._init_train_state()  # the adapter (self.params) is what trains
    self._proxy = {}

  def _merge(self, params, frozen):
    frozen = with_mask_embedding(frozen, params.get("mask_embed"), self.cfg.mask_token_id)
    return nnx.merge(self.graphdef, params["lora"], frozen)

  def model(self):
    return self._merge(self.params, self.frozen)

  def _train_step_fn(self, block_size: int):
    if block_size in self._steps:
      return self._steps[block_size]
    dc, mask_id = self.tc, self.cfg.mask_token_id

    def step_fn(lora, opt_state, frozen, x0, weight, rng):
      def loss_fn(p):
        return draft_distill_loss(self._merge(p, frozen), x0, weight, rng, block_size, mask_id, dc.mode_probs,
                                  self.cfg.draft_head)

      (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(lora)
      updates, opt_state = self.tx.update(grads, opt_state, lora)
      metrics["grad_norm"] = optax.global_norm(grads)
      return optax.apply_updates(lora, updates), opt_state, metrics

    self._steps[block_size] = jax.jit(step_fn, donate_argnums=(0, 1))
    return self._steps[block_size]

  def train_step(self) -> dict:
    s = self.step
    blk = self.block_size_at(s)
    x0, w = self.batches.weighted_batch(s)
    rng = jax.random.fold_in(jax.random.key(self.tc.seed), s)
    self.params, self.opt_state, metrics = self._train_step_fn(blk)(self.params, self.opt_state, self.frozen,
                                                                      jnp.asarray(x0), jnp.asarray(w), rng)
    self.step += 1
    return {k: float(v) for k, v in metrics.items()} | {"step": s, "block_size": blk}

  def accept_proxy(self, lora_on: bool = True, val: PackedBatches | None = None) -> dict[int, float]:
    """Teacher-forced LinearSS accepted length per block size on held-out targets (`val`, default the first held-out
    set; see seeded_accept_proxy); lora_on=False measures the base model's draft the same way (adapter off, the
    base mask embedding)."""
    val = self.val_batches if val is None else val
    if val is None:
      return {}
    out = {}
    n = min(self.tc.eval_batches, max(val.batches_per_epoch, 1))
    params = self.params if lora_on else {"lora": jax.tree.map(jnp.zeros_like, self.params["lora"])}
    for blk in self.tc.block_sizes:
      if blk not in self._proxy:
        mask_id = self.cfg.mask_token_id
        self._proxy[blk] = jax.jit(lambda p, f, x, w, blk=blk: seeded_accept_proxy(
            self._merge(p, f), x, w, blk, mask_id, self.cfg.draft_head))
      total = count = 0
      for i in range(n):
        x0, w = val.weighted_batch(i)
        s, c = self._proxy[blk](params, self.frozen, jnp.asarray(x0), jnp.asarray(w))
        total, count = total + int(s), count + int(c)
      out[blk] = total / max(count, 1)
    return out

  def evaluate(self) -> dict:
    if len(self.val_sets) <= 1:
      return {f"eval_tau_proxy_{b}": v for b, v in self.accept_proxy().items()}
    out = {}
    for name, val in self.val_sets.items():
      out |= {f"eval_tau_{name}_{b}": v for b, v in self.accept_proxy(val=val).items()}
    return out

  def progress_postfix(self, m: dict) -> dict:
    return {"ce": f"{m['draft_ce']:.3f}", "acc": f"{m['draft_acc']:.3f}", "B": m["block_size"]}

  def plot(self) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(l) for l in self.log_path().read_text().splitlines() if l]
    if not rows:
      return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [None] if len(self.val_sets) <= 1 else list(self.val_sets)
    for blk in self.tc.block_sizes:
      r = [x for x in rows if x["block_size"] == blk]
      ax1.plot([x["step"] for x in r], [x["draft_ce"] for x in r], label=f"draft CE, B={blk} (train)")
      for name in names:
        key = f"eval_tau_proxy_{blk}" if name is None else f"eval_tau_{name}_{blk}"
        ev = [x for x in rows if x.get(key) is not None]
        ax2.plot([x["step"] for x in ev], [x[key] for x in ev], "o-", label=f"B={blk}" + (f" {name}" if name else ""))
    ax1.set_xlabel("step"), ax1.set_ylabel("cross-entropy (nats)"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel("teacher-forced tau (held-out)"), ax2.legend(), ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(self.out / "loss_curves.png", dpi=110)
    plt.close(fig)

  def export_adapter(self, directory: str | pathlib.Path, dtype: str = "bfloat16") -> None:
    """Writes the adapter alone as a PEFT directory (convert/peft.py), attached to the base at conversion."""
    from recguide_jax.convert import peft
    flat = {k: np.asarray(v) for k, v in flatten_params(self.params["lora"].to_pure_dict()).items()}
    mask = self.params.get("mask_embed")
    peft.write_adapter(directory, self.cfg, flat, None if mask is None else np.asarray(mask), dtype=dtype)

  def export(self, directory: str | pathlib.Path) -> None:
    """Writes the serving checkpoint: the base weights plus the adapter, config.json with `draft_lora`, and every
    other file of the base checkpoint directory (tokenizer, model card, policy, profile) that is not there yet."""
    import shutil
    directory = pathlib.Path(directory)
    if directory.resolve() != self.base_dir.resolve():
      directory.mkdir(parents=True, exist_ok=True)
      for f in self.base_dir.iterdir():
        if f.is_file() and f.name != ckpt_lib.CONFIG_FILE and not (directory / f.name).exists():
          shutil.copy2(f, directory / f.name)
    ckpt_lib.save_model(directory, self.model())
