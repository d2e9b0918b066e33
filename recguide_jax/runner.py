"""Jitted, ahead-of-time compiled step functions over the paged KV cache.

Every step is a pure function of (params, cache, small per-request arrays) with static shapes: one compiled
variant per (kind, block size, batch bucket). The host pads a batch to its bucket (padding rows use the trash page
and never write real pages) and only reads small results back (tokens, accepted lengths, logprobs); logits and
draft distributions stay on the device.

Kinds:
- `prefill`  causal chunk of `prefill_chunk` tokens (or B tokens to commit a diffusion block); writes K/V of the
             valid tokens and samples the next token at each row's last valid index.
- `draft`    bidirectional block [seed, MASK...] over the cached prefix, draft LoRA on, cache untouched; samples
             the draft tokens and keeps their distributions on the device.
- `verify`   causal block; writes all B K/V entries and runs speculative acceptance against the draft
             distributions (which stay on the device between the draft and the verify).
- `decode`   plain AR decode: a verify of a block of 1 with no draft, so it takes no draft distribution (nothing
             of vocabulary size crosses to the device per step, only the small per-request arrays).
- `denoise`  NLD's block-diffusion loop (confidence threshold) as one on-device while loop of draft forwards.

The model's layers are one scanned module, so a variant's compile time does not grow with depth, and `warmup`
compiles the variants concurrently (XLA compiles outside the GIL).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recguide_jax import sampling
from recguide_jax.kv_cache import KVCache
from recguide_jax.model import ForwardInputs, NLDModel
from recguide_jax.orchestrator.overlap import MAX_BRANCHES

BLOCK_SIZES = (8, 16, 32)
MAX_COMPILE_WORKERS = 8  # default bound on concurrent variant compiles in `Runner.warmup`


class CompileCounter:
  """Counts backend compilations process-wide; `after_warmup` is what the stats and /metrics expose."""

  _lock = threading.Lock()
  _total = 0
  _installed = False

  @classmethod
  def install(cls) -> None:
    with cls._lock:
      if cls._installed:
        return
      cls._installed = True

      def listener(event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
          with cls._lock:
            cls._total += 1

      jax.monitoring.register_event_duration_secs_listener(listener)

  @classmethod
  def total(cls) -> int:
    return cls._total


def enable_compile_cache(directory: str | None) -> None:
  """Persistent XLA compilation cache, so a restart reuses the previous run's executables."""
  if not directory:
    return
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
  out, b = [], 1
  while b < max_batch:
    out.append(b)
    b *= 2
  out.append(max_batch)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
  num_pages: int = 512
  page_size: int = 16
  max_model_len: int = 1024
  max_batch: int = 8
  block_sizes: tuple[int, ...] = BLOCK_SIZES
  prefill_chunk: int = 64
  rule: str = "leviathan"
  compile_cache_dir: str | None = None

  def __post_init__(self):
    for name in ("num_pages", "page_size", "max_model_len", "max_batch", "prefill_chunk"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.rule not in sampling.RULES:
      raise ValueError(f"rule must be one of {sampling.RULES}, got {self.rule!r}")
    bad = [b for b in self.block_sizes if b < 2]
    if bad:
      raise ValueError(f"block sizes must be >= 2, got {bad}")

  @property
  def max_block(self) -> int:
    return max(self.block_sizes + (self.prefill_chunk,))

  @property
  def pages_per_seq(self) -> int:
    # A verify may write up to one block past the last emitted token, so leave room for it.
    return math.ceil((self.max_model_len + self.max_block) / self.page_size)


@dataclasses.dataclass
class SamplingArrays:
  """Per-row sampling parameters of a padded batch (numpy, host side)."""
  temperature: np.ndarray  # [b] float32
  top_k: np.ndarray  # [b] int32
  top_p: np.ndarray  # [b] float32
  keys: np.ndarray  # [b, 2] uint32

  @classmethod
  def greedy(cls, b: int) -> "SamplingArrays":
    return cls(np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros((b, 2), np.uint32))

  def args(self):
    return (self.temperature, self.top_k, self.top_p, self.keys)


@dataclasses.dataclass
class VerifyResult:
  accepted: np.ndarray  # [b]
  tokens: np.ndarray  # [b, B]
  logprobs: np.ndarray  # [b, B]
  top_logprobs: np.ndarray  # [b, B, K]
  top_ids: np.ndarray  # [b, B, K]
  entropy: np.ndarray  # [b, B] verifier entropy per position (nats, mask excluded)
  draft_tokens: np.ndarray | None = None  # [b, B] filled by the engine for linear rounds
  draft_signals: np.ndarray | None = None  # [b, 3, B]
  kind: str = "linear"  # "linear" | "overlap" (which round produced it)


def fused_kind(slots: int) -> str:
  """The step kind of a fused verify+branches forward with `slots` branch slots ("fused": the paper's tree)."""
  if slots < 1:
    raise ValueError(f"a fused forward needs at least one branch slot, got {slots}")
  return "fused" if slots == MAX_BRANCHES else f"fused{slots}"


def fused_slots(kind: str) -> int:
  """Inverse of `fused_kind`."""
  return MAX_BRANCHES if kind == "fused" else int(kind[len("fused"):])


def draft_signals(logits: jax.Array, drafted: jax.Array, cfg) -> jax.Array:
  """RecGuide's draft uncertainty per position (recguide.md 4.1), from the raw draft distribution with the mask
  token excluded (EOS stays): confidence p(top1), margin p(top1) - p(top2), and the runner-up ("alternative")
  token: the most likely token other than the drafted one, the mask and EOS. Returns float32 [b, 3, B]."""
  probs = jax.nn.softmax(sampling.exclude_token(logits.astype(jnp.float32), cfg.mask_token_id), axis=-1)
  top2, _ = sampling.top_n(probs, 2)
  conf, margin = top2[..., 0], top2[..., 0] - top2[..., 1]
  excl = probs.at[..., cfg.mask_token_id].set(-1.0)
  for e in cfg.eos_token_ids:
    excl = excl.at[..., e].set(-1.0)
  excl = jnp.where(jax.nn.one_hot(drafted, probs.shape[-1], dtype=bool), -1.0, excl)
  alt = jnp.argmax(excl, axis=-1)
  alt = jnp.where(jnp.max(excl, axis=-1) > 0, alt, -1)
  return jnp.stack([conf, margin, alt.astype(jnp.float32)], axis=1)


def verifier_entropy(logits: jax.Array, cfg) -> jax.Array:
  lp = jax.nn.log_softmax(sampling.exclude_token(logits.astype(jnp.float32), cfg.mask_token_id), axis=-1)
  return -jnp.sum(jnp.where(jnp.isfinite(lp), jnp.exp(lp) * lp, 0.0), axis=-1)


class Runner:
  """Owns the params, the device KV cache and the compiled step variants.

  With an abstract model (from `nnx.eval_shape`, weights as `jax.ShapeDtypeStruct`s; see `Runner.abstract`) the
  cache is abstract too: such a runner lowers and compiles every variant at real shapes without allocating the
  weights or the cache, and cannot run them (compile benchmarks, memory planning)."""

  def __init__(self, model: NLDModel, config: RunnerConfig = RunnerConfig()):
    CompileCounter.install()
    enable_compile_cache(config.compile_cache_dir)
    self.cfg = model.cfg
    self.config = config
    self.graphdef, self.state = nnx.split(model)
    embedding = jax.tree.leaves(nnx.state(model.embed_tokens, nnx.Param))[0]
    cache_args = (self.cfg.num_hidden_layers, config.num_pages, config.page_size, self.cfg.num_key_value_heads,
                  self.cfg.head_dim, embedding.dtype)
    if isinstance(embedding, jax.ShapeDtypeStruct):
      self.cache = KVCache.abstract(*cache_args, sharding=embedding.sharding)
    else:
      # the cache lives with the weights (the devices the checkpoint was restored onto)
      placed = isinstance(embedding, jax.Array) and not isinstance(embedding, jax.core.Tracer)
      self.cache = KVCache.create(*cache_args, sharding=embedding.sharding if placed else None)
    self.buckets = batch_buckets(config.max_batch)
    self._compiled: dict[tuple, Any] = {}
    self._compiled_lock = threading.Lock()
    self._compiles_at_warmup: int | None = None
    self.lock = threading.Lock()

  @classmethod
  def abstract(cls, cfg, config: RunnerConfig = RunnerConfig(), dtype=jnp.bfloat16) -> "Runner":
    """A runner over abstract weights and an abstract cache of `cfg` in `dtype` (nothing is allocated)."""
    model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=dtype, param_dtype=dtype))
    return cls(model, config)

  # ---- bookkeeping ---------------------------------------------------------------------------------------------
  def bucket_for(self, n: int) -> int:
    for b in self.buckets:
      if b >= n:
        return b
    raise ValueError(f"batch of {n} exceeds max_batch {self.config.max_batch}")

  @property
  def compiles_after_warmup(self) -> int:
    if self._compiles_at_warmup is None:
      return 0
    return CompileCounter.total() - self._compiles_at_warmup

  def mark_warm(self) -> None:
    self._compiles_at_warmup = CompileCounter.total()

  # ---- pure step functions ---------------------------------------------------------------------------------------
  def _model(self, state) -> NLDModel:
    return nnx.merge(self.graphdef, state)

  def _prefill_fn(self, chunk: int):
    cfg = self.cfg
    mask = jnp.tril(jnp.ones((chunk, chunk), bool))

    def fn(state, cache, tokens, valid, prefix_len, page_table, last_idx, temperature, top_k, top_p, keys):
      positions = prefix_len[:, None] + jnp.arange(chunk)[None, :]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=valid)
      model = self._model(state)
      h, cache = model.hidden(inp, cache)
      h_last = jnp.take_along_axis(h, last_idx[:, None, None], axis=1)  # only the last valid token's logits
      logits = model.logits(h_last)  # [b, 1, V]
      probs = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id)
      (k,) = sampling.split_keys(keys, 1)
      tok = sampling.draw(k, probs, temperature <= 0)  # [b, 1]
      lp, top_lp, top_ids = sampling.raw_logprobs(logits, tok, cfg.mask_token_id)
      return cache, tok[:, 0], lp[:, 0], top_lp[:, 0], top_ids[:, 0]

    return fn

  def _draft_fn(self, blk: int, lora: bool):
    cfg = self.cfg
    mask = jnp.ones((blk, blk), bool)

    def fn(state, cache, seed, prefix_len, page_table, temperature, top_k, top_p, keys):
      b = seed.shape[0]
      tokens = jnp.full((b, blk), cfg.mask_token_id, jnp.int32).at[:, 0].set(seed)
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      lora_mask = jnp.ones((b, blk), bool) if (lora and cfg.lora_rank) else None
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, lora_mask=lora_mask)
      logits, _ = self._model(state)(inp, cache)
      q = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id)
      (k,) = sampling.split_keys(keys, 1)
      drafted = sampling.draw(k, q, temperature <= 0)
      drafted = drafted.at[:, 0].set(seed)
      return drafted, q, draft_signals(logits, drafted, cfg)

    return fn

  def _verify_fn(self, blk: int, rule: str):
    cfg = self.cfg
    mask = jnp.tril(jnp.ones((blk, blk), bool))

    def fn(state, cache, tokens, q, write, prefix_len, page_table, temperature, top_k, top_p, keys):
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=jnp.broadcast_to(write[:, None], tokens.shape))
      logits, cache = self._model(state)(inp, cache)
      p = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id)
      # AR decode (q None): a block of 1 has no draft token, so acceptance only draws the bonus token from p and
      # never reads q; p stands in for it (the same draw as with any q, and nothing is uploaded for it)
      accepted, out = sampling.accept(rule, keys, p, p if q is None else q, tokens, temperature <= 0)
      lp, top_lp, top_ids = sampling.raw_logprobs(logits, out, cfg.mask_token_id)
      return cache, accepted, out, lp, top_lp, top_ids, verifier_entropy(logits, cfg)

    return fn

  def _decode_fn(self, rule: str):
    """Plain AR decode: `_verify_fn` at a block of 1 without the draft distribution argument."""
    verify = self._verify_fn(1, rule)

    def fn(state, cache, tokens, write, prefix_len, page_table, temperature, top_k, top_p, keys):
      return verify(state, cache, tokens, None, write, prefix_len, page_table, temperature, top_k, top_p, keys)

    return fn

  def _fused_fn(self, blk: int, branches: int):
    """RecGuide's fused forward for greedy requests: verify the B draft tokens (causal, committed) and, in the same
    forward, draft up to `branches` prospective next blocks laid out as a tree (see orchestrator/overlap.py).
    With branches = 0 this is a greedy verify of host-provided draft tokens (a reused branch block)."""
    cfg = self.cfg

    def fn(state, cache, tokens, positions, mask, lora, write, prefix_len, page_table, temperature, top_k, top_p,
           keys):
      b = tokens.shape[0]
      inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                          page_table=page_table, kv_write=write, lora_mask=lora if cfg.lora_rank else None)
      logits, cache = self._model(state)(inp, cache)
      v_logits = logits[:, :blk]
      drafted = tokens[:, :blk]
      p = sampling.processed_probs(v_logits, temperature, top_k, top_p, cfg.mask_token_id)
      # the reference rule (accept while an independent verifier sample equals the draft) needs no draft
      # distribution, so no [b, B, V] point mass is built; for the greedy rows overlap serves it is "accept while
      # the verifier's argmax equals the draft", the same as every other rule
      accepted, out = sampling.accept("reference", keys, p, p, drafted, temperature <= 0)
      lp, top_lp, top_ids = sampling.raw_logprobs(v_logits, out, cfg.mask_token_id)
      ent = verifier_entropy(v_logits, cfg)
      if not branches:
        return cache, accepted, out, lp, top_lp, top_ids, ent
      br_logits = logits[:, blk:].reshape(b * branches, blk, -1)
      br_in = tokens[:, blk:].reshape(b * branches, blk)
      br_tok = jnp.argmax(sampling.exclude_token(br_logits, cfg.mask_token_id), axis=-1).astype(jnp.int32)
      # a correction block keeps its alt token in slot 0; the continuation's slot 0 is the guessed bonus
      br_tok = br_tok.at[:, 0].set(jnp.where(br_in[:, 0] != cfg.mask_token_id, br_in[:, 0], br_tok[:, 0]))
      sig = draft_signals(br_logits, br_tok, cfg)
      return (cache, accepted, out, lp, top_lp, top_ids, ent, br_tok.reshape(b, branches, blk),
              sig.reshape(b, branches, 3, blk))

    return fn

  def _denoise_fn(self, blk: int):
    """NLD `generate` inner loop: each iteration is one bidirectional forward; commit the most confident masked
    position plus every masked position whose confidence >= threshold; stop when no mask is left or an EOS has
    no mask before it. Rows whose loop is done stop changing; `steps` counts each row's forwards."""
    cfg = self.cfg
    mask = jnp.ones((blk, blk), bool)
    eos = jnp.asarray(cfg.eos_token_ids, jnp.int32)

    def fn(state, cache, seed, prefix_len, page_table, threshold, temperature, top_k, top_p, keys, active):
      b = seed.shape[0]
      model = self._model(state)
      positions = prefix_len[:, None] + jnp.arange(blk)[None, :]
      tokens0 = jnp.full((b, blk), cfg.mask_token_id, jnp.int32).at[:, 0].set(seed)
      typed = jax.random.wrap_key_data(keys)

      def running(tokens):
        is_mask = tokens == cfg.mask_token_id
        is_eos = jnp.isin(tokens, eos)
        # an EOS with no mask before it ends the block
        masks_before = jnp.cumsum(is_mask, axis=1) - is_mask
        done_eos = jnp.any(is_eos & (masks_before == 0), axis=1)
        return jnp.any(is_mask, axis=1) & ~done_eos & active

      def cond(carry):
        tokens, steps, i = carry
        return jnp.any(running(tokens)) & (i < blk)

      def body(carry):
        tokens, steps, i = carry
        live = running(tokens)
        inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=mask, prefix_len=prefix_len,
                            page_table=page_table)
        logits, _ = model(inp, cache)
        raw = jax.nn.softmax(sampling.exclude_token(logits, cfg.mask_token_id), axis=-1)
        probs = sampling.processed_probs(logits, temperature, top_k, top_p, cfg.mask_token_id)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(typed)
        cand = jax.vmap(sampling.sample)(step_keys, probs)
        conf = jnp.take_along_axis(raw, cand[..., None], axis=-1)[..., 0]  # untempered confidence
        is_mask = tokens == cfg.mask_token_id
        conf = jnp.where(is_mask, conf, -jnp.inf)
        best = jnp.argmax(conf, axis=1)
        take = (conf >= threshold[:, None]) | (jnp.arange(blk)[None, :] == best[:, None])
        take = take & is_mask & live[:, None]
        tokens = jnp.where(take, cand, tokens)
        return tokens, steps + live.astype(jnp.int32), i + 1

      tokens, steps, _ = jax.lax.while_loop(cond, body, (tokens0, jnp.zeros((b,), jnp.int32), jnp.int32(0)))
      return tokens, steps

    return fn

  # ---- compilation -------------------------------------------------------------------------------------------------
  def _spec(self, kind: str, blk: int, b: int) -> tuple[Callable, tuple, tuple]:
    """(function, example args after (state, cache), donate) for one variant."""
    cfg, rc = self.cfg, self.config
    P = rc.pages_per_seq
    i32 = lambda *s: np.zeros(s, np.int32)
    samp = SamplingArrays.greedy(b).args()
    V = cfg.vocab_size
    if kind == "prefill":
      return (self._prefill_fn(blk), (i32(b, blk), np.zeros((b, blk), bool), i32(b), i32(b, P), i32(b)) + samp,
              (1,))
    if kind == "draft":
      return self._draft_fn(blk, lora=True), (i32(b), i32(b), i32(b, P)) + samp, ()
    if kind == "decode":
      if blk != 1:
        raise ValueError(f"decode is a block of 1, got {blk}")
      return self._decode_fn(rc.rule), (i32(b, 1), np.zeros((b,), bool), i32(b), i32(b, P)) + samp, (1,)
    if kind == "verify":
      q = jax.ShapeDtypeStruct((b, blk, V), jnp.float32)
      return (self._verify_fn(blk, rc.rule), (i32(b, blk), q, np.zeros((b,), bool), i32(b), i32(b, P)) + samp,
              (1,))
    if kind.startswith("fused") or kind == "gverify":
      nb = fused_slots(kind) if kind != "gverify" else 0
      qn = (1 + nb) * blk
      return (self._fused_fn(blk, nb), (i32(b, qn), i32(b, qn), np.zeros((b, qn, qn), bool),
                                        np.zeros((b, qn), bool), np.zeros((b, qn), bool), i32(b), i32(b, P)) + samp,
              (1,))
    if kind == "denoise":
      return (self._denoise_fn(blk), (i32(b), i32(b), i32(b, P), np.zeros(b, np.float32)) + samp +
              (np.zeros(b, bool),), ())
    raise ValueError(kind)

  def lower(self, kind: str, blk: int, b: int):
    """The lowered (not yet compiled) variant: its HLO and, once compiled, its memory analysis."""
    f, args, donate = self._spec(kind, blk, b)
    return jax.jit(f, donate_argnums=donate).lower(self.state, self.cache, *args)

  def compiled(self, kind: str, blk: int, b: int):
    key = (kind, blk, b)
    fn = self._compiled.get(key)
    if fn is None:
      fn = self.lower(kind, blk, b).compile()
      with self._compiled_lock:
        fn = self._compiled.setdefault(key, fn)
    return fn

  def variants(self, kinds: tuple[str, ...], block_sizes: tuple[int, ...] | None = None) -> list[tuple[str, int, int]]:
    """Every (kind, block, bucket) the given step kinds need for `block_sizes` (default: the configured ones)."""
    sizes = self.config.block_sizes if block_sizes is None else block_sizes
    out = []
    for b in self.buckets:
      if "prefill" in kinds:
        out.append(("prefill", self.config.prefill_chunk, b))
      if "verify" in kinds:
        out.append(("decode", 1, b))  # AR decode, and the regime every speculative policy may fall back to
      for blk in sizes:
        for kind in ("draft", "verify", "denoise", "gverify") + tuple(k for k in kinds if k.startswith("fused")):
          if kind in kinds:
            out.append((kind, blk, b))
        if "denoise" in kinds:
          out.append(("prefill", blk, b))  # commits a denoised block
    return list(dict.fromkeys(out))

  def warmup(self, kinds=("prefill", "draft", "verify"), block_sizes: tuple[int, ...] | None = None,
             progress: bool = True, workers: int | None = None) -> dict[tuple[str, int, int], float]:
    """Compiles every variant `kinds` x `block_sizes` needs, `workers` at a time (default: one per CPU core, at most
    `MAX_COMPILE_WORKERS`, which bounds the host memory of concurrent compiles on large VMs): the
    Python tracing of one variant overlaps the XLA compilation of others, which runs outside the GIL. Returns the
    seconds each compiled variant took from its start (what was already compiled is skipped). Everything compiled
    after this counts in `compiles_after_warmup`."""
    todo = [v for v in self.variants(kinds, block_sizes) if v not in self._compiled]
    seconds: dict[tuple[str, int, int], float] = {}
    bar = None
    if progress and todo:
      from tqdm import tqdm
      bar = tqdm(total=len(todo), desc="compiling step variants", unit="variant")

    def compile_one(v):
      t0 = time.perf_counter()
      self.compiled(*v)
      return v, time.perf_counter() - t0

    workers = max(1, min(len(todo), workers or min(os.cpu_count() or 1, MAX_COMPILE_WORKERS)))
    try:
      with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        for fut in concurrent.futures.as_completed([pool.submit(compile_one, v) for v in todo]):
          v, dt = fut.result()  # re-raises a failed compile here
          seconds[v] = dt
          if bar is not None:
            bar.update()
    finally:
      if bar is not None:
        bar.close()
    self.mark_warm()
    return seconds

  # ---- calls (host arrays in, host arrays out) ---------------------------------------------------------------------
  def prefill(self, tokens, valid, prefix_len, page_table, last_idx, samp: SamplingArrays):
    b, chunk = tokens.shape
    fn = self.compiled("prefill", chunk, b)
    self.cache, tok, lp, top_lp, top_ids = fn(self.state, self.cache, tokens, valid, prefix_len, page_table,
                                              last_idx, *samp.args())
    return jax.device_get((tok, lp, top_lp, top_ids))  # one device->host transfer for all results

  def draft(self, seed, prefix_len, page_table, blk: int, samp: SamplingArrays):
    """Returns device arrays: draft tokens [b, B], their distributions [b, B, V] (for `verify`) and the draft
    signals [b, 3, B] (confidence, top-1/top-2 margin, runner-up token)."""
    fn = self.compiled("draft", blk, seed.shape[0])
    return fn(self.state, self.cache, seed, prefix_len, page_table, *samp.args())

  def verify(self, tokens, q, write, prefix_len, page_table, samp: SamplingArrays) -> VerifyResult:
    b, blk = tokens.shape
    if q is None:  # AR decode: nothing to accept; its variant takes no draft distribution at all
      if blk != 1:
        raise ValueError("verify without draft distributions is only AR decode (block of 1)")
      fn = self.compiled("decode", 1, b)
      self.cache, acc, out, lp, top_lp, top_ids, ent = fn(self.state, self.cache, tokens, write, prefix_len,
                                                          page_table, *samp.args())
    else:
      fn = self.compiled("verify", blk, b)
      self.cache, acc, out, lp, top_lp, top_ids, ent = fn(self.state, self.cache, tokens, q, write, prefix_len,
                                                          page_table, *samp.args())
    return VerifyResult(*jax.device_get((acc, out, lp, top_lp, top_ids, ent)))

  def fused(self, tokens, positions, mask, lora, write, prefix_len, page_table, samp: SamplingArrays, blk: int):
    """Greedy verify of tokens[:, :blk] plus the tree's branch drafts (qn = (1 + slots) B query tokens). Returns
    (VerifyResult, branch tokens [b, slots, B] or None, branch signals [b, slots, 3, B] or None)."""
    b, qn = tokens.shape
    if qn % blk:
      raise ValueError(f"a fused tree holds whole blocks: {qn} query tokens at block {blk}")
    kind = fused_kind(qn // blk - 1) if qn > blk else "gverify"
    fn = self.compiled(kind, blk, b)
    outs = fn(self.state, self.cache, tokens, positions, mask, lora, write, prefix_len, page_table, *samp.args())
    self.cache = outs[0]
    host = jax.device_get(outs[1:])
    res = VerifyResult(*host[:6])
    if kind == "gverify":
      return res, None, None
    return res, host[6], host[7]

  def denoise(self, seed, prefix_len, page_table, threshold, blk: int, samp: SamplingArrays, active):
    fn = self.compiled("denoise", blk, seed.shape[0])
    tokens, steps = fn(self.state, self.cache, seed, prefix_len, page_table, threshold, *samp.args(), active)
    return jax.device_get((tokens, steps))
