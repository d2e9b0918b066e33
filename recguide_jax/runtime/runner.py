"""The runner: owns the model state, the device KV cache and the compiled step variants, and runs them.

One compiled variant per `StepKey` (kind, block, batch bucket, branch slots), all with static shapes. The host
pads a batch to its bucket (padding rows use the trash page and never write real pages) and only reads small
results back (tokens, accepted lengths, logprobs); logits and draft distributions stay on the device. Every
device call goes through `execute`, the one point a multi-host leader mirrors to its followers.

Start-up: the layers are one scanned module, so a variant's compile time does not grow with depth (on a CPU
device, weights larger than its cache run unrolled by default: `RunnerConfig.layer_loop`); `warmup` compiles
variants concurrently (XLA compiles outside the GIL), and with `background` it compiles only the largest batch
bucket of each variant before returning (every batch fits it) and builds the smaller buckets on a background
thread; `bucket_for` routes a batch to the smallest bucket that is ready, so no request waits on a compile.

With a mesh, every variant is jitted with explicit shardings: the state's own, the cache's (`cache_sharding`),
the draft distributions [b, B, V] split over the vocabulary as the logits are (`sharding.step_io_sharding`), and
replicated small host inputs and results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from recguide_jax.runtime import sampling

from recguide_jax.parallel import sharding
from recguide_jax.cache.kv_cache import KVCache, pages_per_seq, storage_dtype
from recguide_jax.model.nld import (KernelLayout, LayerLoop, NLDModel, ProjectionFusion, resolve_kernel_layout,
                                    resolve_layer_loop, resolve_projection_fusion, weights_platform,
                                    with_kernel_layout, with_layer_loop, with_projection_fusion)
from recguide_jax.runtime.compilation import (BackgroundCompiler, CompileCounter, check_mapping_headroom,
                                              compile_with_options, enable_compile_cache, variant_compiler_options)
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.runtime.step_key import StepKey, StepKind, batch_buckets, parse_kind_label, ragged_token_buckets
from recguide_jax.runtime.steps import (DecodeInputs, DenoiseInputs, DraftInputs, FusedInputs, PrefillInputs,
                                        RaggedDraftInputs, RaggedVerifyInputs, SamplingArrays, StepFunctions,
                                        VerifyInputs, example_inputs)

MAX_COMPILE_WORKERS = 8  # default bound on concurrent variant compiles in `Runner.warmup`


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
  # warm up only the largest batch bucket and compile the smaller ones on a background thread (see module doc)
  background_compile: bool = False
  # how the forward runs the decoder layers (model/nld.py `LayerLoop`; AUTO: see there)
  layer_loop: LayerLoop = LayerLoop.AUTO
  # how the dense layers hold their kernels (model/nld.py `KernelLayout`; AUTO: [out, in] on a CPU without a mesh)
  kernel_layout: KernelLayout = KernelLayout.AUTO
  # whether q/k/v and gate/up are one matmul each (model/nld.py `ProjectionFusion`; AUTO: fused on a CPU, no mesh)
  projection_fusion: ProjectionFusion = ProjectionFusion.AUTO
  # XLA options ({name: value} or pairs) of every variant this runner compiles: per executable, not per process
  compiler_options: tuple[tuple[str, Any], ...] = ()
  # AR decode steps one device call may run (vLLM's multi-step scheduling): the host dispatches and reads back once
  # per `decode_steps` tokens; the engine uses it when nothing waits to be admitted or prefilled (engine/core.py)
  decode_steps: int = 1

  def __post_init__(self):
    object.__setattr__(self, "layer_loop", LayerLoop.parse(self.layer_loop))
    object.__setattr__(self, "kernel_layout", KernelLayout.parse(self.kernel_layout))
    object.__setattr__(self, "projection_fusion", ProjectionFusion.parse(self.projection_fusion))
    opts = dict(self.compiler_options)  # a mapping or (name, value) pairs
    object.__setattr__(self, "compiler_options", tuple(sorted((str(k), v) for k, v in opts.items())))
    for name in ("num_pages", "page_size", "max_model_len", "max_batch", "prefill_chunk", "decode_steps"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.rule not in sampling.RULES:
      raise ValueError(f"rule must be one of {sampling.RULES}, got {self.rule!r}")
    bad = [b for b in self.block_sizes if b < 2]
    if bad:
      raise ValueError(f"block sizes must be >= 2, got {bad}")
    if self.decode_steps > self.max_block:  # a request may write this far past its last token (pages_per_seq)
      raise ValueError(f"decode_steps must be at most {self.max_block} (the largest block or prefill chunk), got "
                       f"{self.decode_steps}")

  @property
  def max_block(self) -> int:
    return max(self.block_sizes + (self.prefill_chunk,))

  @property
  def ragged_width(self) -> int:
    """The most query tokens one row of a ragged step holds: the largest block."""
    return max(self.block_sizes) if self.block_sizes else 1

  @property
  def ragged_buckets(self) -> tuple[int, ...]:
    """Packed-token buckets a ragged step is compiled for (they do not depend on the set of block sizes)."""
    return ragged_token_buckets(self.max_batch, self.ragged_width)

  @property
  def pages_per_seq(self) -> int:
    return pages_per_seq(self.max_model_len, self.max_block, self.page_size)


def step_variants(config: RunnerConfig, kinds: Sequence[str | StepKind], block_sizes: tuple[int, ...] | None = None,
                  batches: Sequence[int] | None = None) -> list[StepKey]:
  """Every variant the given step kinds (labels such as "fused2" allowed) need for `block_sizes` (default: the
  configured ones), for every batch bucket of `config` (or those of `batches`)."""
  sizes = config.block_sizes if block_sizes is None else block_sizes
  ragged = "ragged" in kinds  # every packed-token bucket of RAGGED_DRAFT and RAGGED_VERIFY
  kinds = [k for k in kinds if k != "ragged"]
  parsed = [parse_kind_label(k) for k in kinds]
  kind_set = {k for k, _ in parsed}
  slot_counts = [s for k, s in parsed if k == StepKind.FUSED]
  out: list[StepKey] = []
  buckets = batch_buckets(config.max_batch)
  for b in buckets if batches is None else [b for b in buckets if b in batches]:
    if StepKind.PREFILL in kind_set:
      out.append(StepKey(StepKind.PREFILL, config.prefill_chunk, b))
    if StepKind.SCORE in kind_set:  # only when asked for: prompt logprobs
      out.append(StepKey(StepKind.SCORE, config.prefill_chunk, b))
    if StepKind.VERIFY in kind_set:
      out.append(StepKey(StepKind.DECODE, 1, b))  # AR decode, the regime every speculative policy may fall back to
      if config.decode_steps > 1:
        out.append(StepKey(StepKind.DECODE, 1, b, steps=config.decode_steps))
    for blk in sizes:
      for kind in (StepKind.DRAFT, StepKind.VERIFY, StepKind.DENOISE, StepKind.GVERIFY):
        if kind in kind_set:
          out.append(StepKey(kind, blk, b))
      for slots in slot_counts:
        out.append(StepKey(StepKind.FUSED, blk, b, slots))
      if StepKind.DENOISE in kind_set:
        out.append(StepKey(StepKind.PREFILL, blk, b))  # commits a denoised block
  if ragged:
    for t in config.ragged_buckets:
      for kind in (StepKind.RAGGED_DRAFT, StepKind.RAGGED_VERIFY):
        out.append(ragged_key(config, kind, t))
  return list(dict.fromkeys(out))


def ragged_key(config: RunnerConfig, kind: StepKind, tokens: int) -> StepKey:
  """The ragged variant of `kind` for `tokens` packed tokens (the smallest bucket of `config` that holds them)."""
  fits = [t for t in config.ragged_buckets if t >= tokens]
  if not fits:
    raise ValueError(f"{tokens} packed tokens exceed the largest ragged bucket {config.ragged_buckets[-1]}")
  return StepKey(kind, config.ragged_width, config.max_batch, tokens=fits[0])


class VariantNotReady(Exception):
  """A step variant warm-up did not plan is compiling on the background thread: the rows that need it wait (the
  engine runs the others), instead of every request waiting on the compile."""

  def __init__(self, key: StepKey):
    super().__init__(f"step variant {key} is compiling in the background")
    self.key = key


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


VERIFY_RESULTS = len(dataclasses.fields(VerifyResult)) - 2  # a decode's or verify's outputs before its next inputs


def _spec_of(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class Runner:
  """Owns the params, the device KV cache and the compiled step variants.

  With an abstract model (from `nnx.eval_shape`, weights as `jax.ShapeDtypeStruct`s; see `Runner.abstract`) the
  cache is abstract too: such a runner lowers and compiles every variant at real shapes without allocating the
  weights or the cache, and cannot run them (compile benchmarks, memory planning).

  `mesh`: run every step inside it with explicit shardings; place the model state on it first (its leaves'
  shardings are the weights' in_shardings). `cache_sharding`: the KV pages' sharding (default: with the weights'
  devices, replicated over a mesh)."""

  def __init__(self, model: NLDModel, config: RunnerConfig = RunnerConfig(), mesh: Mesh | None = None,
               cache_sharding: jax.sharding.Sharding | None = None):
    CompileCounter.install()
    enable_compile_cache(config.compile_cache_dir)
    self.cfg = model.cfg
    self.config = config
    self.mesh = mesh
    self.layer_loop = resolve_layer_loop(config.layer_loop, model, mesh)
    self.platform = (sharding.mesh_platform(mesh) if mesh is not None
                     else weights_platform(model) or jax.default_backend())
    self.kernel_layout = resolve_kernel_layout(config.kernel_layout, model, mesh)
    self.projection_fusion = resolve_projection_fusion(config.projection_fusion, model, mesh)
    arranged = with_projection_fusion(with_layer_loop(model, self.layer_loop), self.projection_fusion)
    self.graphdef, self.state = nnx.split(with_kernel_layout(arranged, self.kernel_layout))
    # what every call passes: the state's leaves as a flat list (steps.py)
    self.weights, state_def = jax.tree.flatten(self.state)
    self.steps = StepFunctions(self.cfg, self.graphdef, state_def, config.rule)
    embedding = jax.tree.leaves(nnx.state(model.embed_tokens, nnx.Param))[0]
    self._weight_dtype = embedding.dtype
    if cache_sharding is None and mesh is not None:
      cache_sharding = NamedSharding(mesh, PartitionSpec())
    cache_args = (self.cfg.num_hidden_layers, config.num_pages, config.page_size, self.cfg.num_key_value_heads,
                  self.cfg.head_dim, embedding.dtype)
    if isinstance(embedding, jax.ShapeDtypeStruct):
      self.cache = KVCache.abstract(*cache_args, sharding=cache_sharding or embedding.sharding)
    else:
      # the cache lives with the weights (the devices the checkpoint was restored onto) unless told otherwise
      placed = isinstance(embedding, jax.Array) and not isinstance(embedding, jax.core.Tracer)
      # on the CPU a bf16/fp16 cache holds raw bits (kv_cache.storage_dtype: XLA:CPU moves those natively)
      self.cache = KVCache.create(*cache_args[:-1], storage_dtype(embedding.dtype, self.platform),
                                  sharding=cache_sharding or (embedding.sharding if placed else None))
    # what a variant is lowered against: shapes, dtypes and shardings only (never the live arrays, which a step
    # running concurrently with a background compile may have donated)
    self._weights_spec = [_spec_of(x) for x in self.weights]
    self._cache_spec = jax.tree.map(_spec_of, self.cache)
    self.buckets = batch_buckets(config.max_batch)
    self._compiled: dict[StepKey, Any] = {}
    self._compiled_lock = threading.Lock()
    self._planned: set[StepKey] = set()  # variants warm-up promised; a bucket is routed to once all of its are built
    self._deferred: set[StepKey] = set()  # variants outside the plan queued on the background compiler
    self._ready_buckets: set[int] = set(self.buckets)
    self._background: BackgroundCompiler | None = None
    self._compiles_at_warmup: int | None = None
    self.before_execute: Callable[[StepKey, Any], None] | None = None  # multi-host leader: mirror each call
    # after a warm-up with background compiles: a variant warm-up did not plan (sampling controls of a new length,
    # prompt scoring) is compiled on the background thread while the requests that need it wait (VariantNotReady)
    self.defer_unplanned = False
    self.lock = threading.Lock()

  @classmethod
  def abstract(cls, cfg, config: RunnerConfig = RunnerConfig(), dtype=jnp.bfloat16, **kwargs) -> "Runner":
    """A runner over abstract weights and an abstract cache of `cfg` in `dtype` (nothing is allocated)."""
    model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=dtype, param_dtype=dtype))
    return cls(model, config, **kwargs)

  # ---- bookkeeping ---------------------------------------------------------------------------------------------
  def bucket_for(self, n: int) -> int:
    """The smallest batch bucket that holds `n` rows and whose variants are all built (with a background compile
    still running, a larger bucket than needed: padding rows cost compute, never a wait)."""
    fits = [b for b in self.buckets if b >= n]
    if not fits:
      raise ValueError(f"batch of {n} exceeds max_batch {self.config.max_batch}")
    for b in fits:
      if b in self._ready_buckets:
        return b
    return fits[-1]

  @property
  def compiles_after_warmup(self) -> int:
    """Compiles since warm-up ended: in line, and the background compiles of variants warm-up did not plan."""
    if self._compiles_at_warmup is None:
      return 0
    with self._compiled_lock:
      deferred = sum(1 for k in self._deferred if k in self._compiled)
    return CompileCounter.total() - self._compiles_at_warmup + deferred

  @property
  def background_pending(self) -> int:
    """Variants still queued or compiling on the background compiler."""
    return self._background.pending if self._background is not None else 0

  def wait_background(self, timeout: float | None = None) -> bool:
    """Blocks until the background compiler has built everything queued; False on timeout."""
    return self._background.wait(timeout) if self._background is not None else True

  def mark_warm(self) -> None:
    self._compiles_at_warmup = CompileCounter.total()

  def close(self) -> None:
    """Drops queued background compiles and waits for the one in flight."""
    if self._background is not None:
      self._background.shutdown()

  # ---- compilation -------------------------------------------------------------------------------------------------
  def _jit(self, key: StepKey, inputs):
    fn = self.steps.build(key)
    donate = (1,) if key.kind.writes_cache else ()
    if self.mesh is None:
      return jax.jit(fn, donate_argnums=donate)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    placed = lambda spec: spec.sharding if isinstance(spec.sharding, NamedSharding) else replicated
    weights_sh = [placed(x) for x in self._weights_spec]
    cache_sh = jax.tree.map(placed, self._cache_spec)
    io = lambda x: sharding.step_io_sharding(self.mesh, x.shape, self.cfg.vocab_size)
    in_sh = (weights_sh, cache_sh, jax.tree.map(io, inputs))
    with sharding.mesh_context(self.mesh):
      outs = jax.eval_shape(fn, self._weights_spec, self._cache_spec, inputs)
    out_sh = jax.tree.map(io, outs)
    if key.kind.writes_cache:
      out_sh = (cache_sh,) + tuple(out_sh[1:])
    return jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)

  def lower(self, key: StepKey):
    """The lowered (not yet compiled) variant: its HLO and, once compiled, its memory analysis."""
    inputs = example_inputs(key, self.config.pages_per_seq, self.cfg.vocab_size)
    jitted = self._jit(key, inputs)
    with sharding.mesh_context(self.mesh):  # traced inside the mesh: activation constraints, per-shard kernels
      return jitted.lower(self._weights_spec, self._cache_spec, inputs)

  def compiled(self, key: StepKey):
    fn = self._compiled.get(key)
    if fn is None:
      fn = self._compile(key)
      with self._compiled_lock:
        fn = self._compiled.setdefault(key, fn)
    return fn

  def compiler_options(self, key: StepKey) -> dict[str, Any]:
    """The XLA options variant `key` compiles with (compilation.py `variant_compiler_options`)."""
    return variant_compiler_options(dict(self.config.compiler_options), self.platform,
                                    key.rows, self.kernel_layout is KernelLayout.OUT_IN,
                                    narrow_weights=jnp.dtype(self._weight_dtype).itemsize < 4)

  def _compile(self, key: StepKey):
    if self.platform == "cpu":
      check_mapping_headroom()
    return compile_with_options(self.lower(key), self.compiler_options(key), dict(self.config.compiler_options))

  def variants(self, kinds: Sequence[str | StepKind], block_sizes: tuple[int, ...] | None = None,
               batches: Sequence[int] | None = None) -> list[StepKey]:
    """`step_variants` of this runner's config."""
    return step_variants(self.config, kinds, block_sizes, batches)

  def ragged_key(self, kind: StepKind, tokens: int) -> StepKey:
    """`ragged_key` of this runner's config."""
    return ragged_key(self.config, kind, tokens)

  def warmup(self, kinds=("prefill", "draft", "verify"), block_sizes: tuple[int, ...] | None = None,
             progress: bool = True, workers: int | None = None, background: bool | None = None,
             batches: Sequence[int] | None = None) -> dict[StepKey, float]:
    """Compiles every variant `kinds` x `block_sizes` needs (for the batch buckets in `batches`, default every
    bucket), `workers` at a time (default: one per CPU core, at most `MAX_COMPILE_WORKERS`, which bounds the host
    memory of concurrent compiles on large VMs): the Python tracing of one variant overlaps the XLA compilation of
    others, which runs outside the GIL. With `background` (default: the config's `background_compile`) only the
    largest batch bucket planned is compiled here and the rest is queued on the background compiler, smallest
    bucket first. Returns the seconds each variant compiled here took from its
    start (what was already compiled is skipped). Everything compiled after this, other than the background
    compiler's queue, counts in `compiles_after_warmup`."""
    background = self.config.background_compile if background is None else background
    planned = self.variants(kinds, block_sizes, batches)
    with self._compiled_lock:
      self._planned.update(planned)
    todo = [v for v in planned if v not in self._compiled]
    later: list[StepKey] = []
    if background and planned:
      top = max(v.batch for v in planned)
      later = sorted((v for v in todo if v.batch != top), key=lambda v: v.batch)
      todo = [v for v in todo if v.batch == top]
    self._refresh_ready()
    seconds = self._compile_now(todo, progress, workers)
    self._refresh_ready()
    self.mark_warm()
    if background:
      self.defer_unplanned = True
    if later:
      self._background_compiler().submit(later)
    return seconds

  def _background_compiler(self) -> BackgroundCompiler:
    if self._background is None:
      self._background = BackgroundCompiler(self.compiled, lambda key: self._refresh_ready())
    return self._background

  def _refresh_ready(self) -> None:
    """A bucket is routable once every planned variant of it is compiled."""
    with self._compiled_lock:
      missing = {v.batch for v in self._planned if v not in self._compiled}
      self._ready_buckets = set(self.buckets) - missing

  def _compile_now(self, todo: list[StepKey], progress: bool, workers: int | None) -> dict[StepKey, float]:
    seconds: dict[StepKey, float] = {}
    if not todo:
      return seconds
    bar = None
    if progress:
      from tqdm import tqdm
      bar = tqdm(total=len(todo), desc="compiling step variants", unit="variant")

    def compile_one(v):
      t0 = time.perf_counter()
      self.compiled(v)
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
    return seconds

  # ---- execution -------------------------------------------------------------------------------------------------
  def execute(self, key: StepKey, inputs) -> tuple:
    """Runs variant `key` on (weights, cache, inputs), `inputs` the kind's typed inputs (steps.py); a step that writes
    K/V replaces the cache (the old one is donated). Returns the step's other outputs as device arrays. The inputs
    are numpy arrays, except the draft distributions a VERIFY takes, which a DRAFT returned on the device."""
    fn = self._compiled.get(key)
    if fn is None and self.defer_unplanned and key not in self._planned:
      self._defer(key)
    if self.before_execute is not None:
      self.before_execute(key, inputs)
    fn = fn or self.compiled(key)
    outs = fn(self.weights, self.cache, inputs)
    if key.kind.writes_cache:
      self.cache, outs = outs[0], outs[1:]
    return tuple(outs)

  def _defer(self, key: StepKey) -> None:
    """Queues `key` first on the background compiler (once) and raises VariantNotReady; a variant whose background
    compile failed is compiled here instead, so its error reaches the requests that need it."""
    compiler = self._background_compiler()
    if key in compiler.failures:
      return
    with self._compiled_lock:
      queued = key in self._deferred
      self._deferred.add(key)
    if not queued:
      compiler.submit([key], first=True)
    raise VariantNotReady(key)

  # ---- calls (host arrays in, host arrays out) ---------------------------------------------------------------------
  def prefill(self, tokens, valid, prefix_len, page_table, last_idx, samp: SamplingArrays, targets=None):
    """One prompt chunk; returns (tokens, lp, top_lp, top_ids) of the token sampled after each row's last valid
    one. With `targets` [b, chunk] (the prompt token after each position) it runs the SCORE variant and also
    returns the targets' logprobs [b, chunk] and top entries [b, chunk, K] (ids [b, chunk, K]). SCORE is not
    warmed up unless asked for (`warmup(kinds=(..., "score"))`): its first use compiles it, and counts in
    `compiles_after_warmup`, since that request did wait for it."""
    b, chunk = tokens.shape
    kind = StepKind.PREFILL if targets is None else StepKind.SCORE
    inputs = PrefillInputs(tokens, valid, prefix_len, page_table, last_idx, samp, targets)
    # one device->host transfer for all results
    return jax.device_get(self.execute(StepKey(kind, chunk, b, controls=samp.controls_len), inputs))

  def draft(self, seed, prefix_len, page_table, blk: int, samp: SamplingArrays):
    """Returns device arrays: draft tokens [b, B], their distributions [b, B, V] (for `verify`) and the draft
    signals [b, 3, B] (confidence, top-1/top-2 margin, runner-up token)."""
    return self.execute(StepKey(StepKind.DRAFT, blk, seed.shape[0], controls=samp.controls_len),
                        DraftInputs(seed, prefix_len, page_table, samp))

  def verify(self, tokens, q, write, prefix_len, page_table, samp: SamplingArrays, steps: int = 1) -> VerifyResult:
    """A verify of `tokens` [b, B] against the draft distributions `q`, or with `q` None an AR decode of the seed
    tokens [b, 1] for `steps` steps (results [b, steps]; the steps' sampling keys count up from samp.keys)."""
    b, blk = tokens.shape
    if q is None:  # AR decode: nothing to accept; its variant takes no draft distribution at all
      outs = self.dispatch_decode(tokens, write, prefix_len, page_table, samp, steps)
    elif steps != 1:
      raise ValueError("only an AR decode (q None) runs several steps per call")
    else:
      outs = self.dispatch_verify(tokens, q, write, prefix_len, page_table, samp)
    return self.read_verify(outs)

  def dispatch_verify(self, tokens, q, write, prefix_len, page_table, samp: SamplingArrays) -> tuple:
    """A verify of `tokens` [b, B] against the draft distributions `q`, dispatched without waiting: the device arrays
    of a `VerifyResult`. `prefix_len` may be a device array (a pipelined round's, from the verify before it)."""
    b, blk = tokens.shape
    return self.execute(StepKey(StepKind.VERIFY, blk, b, controls=samp.controls_len),
                        VerifyInputs(tokens, q, write, prefix_len, page_table, samp))

  def dispatch_decode(self, tokens, write, prefix_len, page_table, samp: SamplingArrays, steps: int = 1) -> tuple:
    """An AR decode of the seed tokens [b, 1] (numpy, or the device tokens of the call before it) for `steps` steps,
    dispatched without waiting: the device arrays of a `VerifyResult` (its tokens at index 1, [b, steps])."""
    b, blk = tokens.shape
    if blk != 1:
      raise ValueError("verify without draft distributions is only AR decode (block of 1)")
    return self.execute(StepKey(StepKind.DECODE, 1, b, steps=steps, controls=samp.controls_len),
                        DecodeInputs(tokens, write, prefix_len, page_table, samp))

  @staticmethod
  def read_verify(outs) -> VerifyResult:
    """A dispatched decode or verify's result on the host (waits for it: one device->host transfer)."""
    return VerifyResult(*jax.device_get(outs[:VERIFY_RESULTS]))

  @staticmethod
  def next_inputs(outs) -> tuple:
    """A dispatched decode or verify's (next seed, next committed lengths), still on the device: what the call
    after it starts from (a decode's seeds are [b, 1], a verify's [b])."""
    return outs[VERIFY_RESULTS], outs[VERIFY_RESULTS + 1]

  def fused(self, tokens, positions, mask, lora, write, prefix_len, page_table, samp: SamplingArrays, blk: int):
    """Greedy verify of tokens[:, :blk] plus the tree's branch drafts (qn = (1 + slots) B query tokens). Returns
    (VerifyResult, branch tokens [b, slots, B] or None, branch signals [b, slots, 3, B] or None)."""
    b, qn = tokens.shape
    if qn % blk:
      raise ValueError(f"a fused tree holds whole blocks: {qn} query tokens at block {blk}")
    slots = qn // blk - 1
    key = StepKey(StepKind.FUSED if slots else StepKind.GVERIFY, blk, b, slots, controls=samp.controls_len)
    outs = self.execute(key, FusedInputs(tokens, positions, mask, lora, write, prefix_len, page_table, samp))
    host = jax.device_get(outs)
    res = VerifyResult(*host[:6])
    if not slots:
      return res, None, None
    return res, host[6], host[7]

  def ragged_draft(self, seed, row_len, prefix_len, page_table, samp: SamplingArrays):
    """Drafts of every row at its own block row_len [R] (0: none) in one forward (R = max_batch rows). Returns
    device arrays in the row layout: tokens [R, W], distributions [R, W, V], signals [R, 3, W] (W the largest
    block)."""
    key = self.ragged_key(StepKind.RAGGED_DRAFT, int(np.sum(row_len)))
    return self.execute(key, RaggedDraftInputs(seed, row_len, prefix_len, page_table, samp))

  def dispatch_ragged_verify(self, drafted, q, seed, row_len, write, prefix_len, page_table,
                             samp: SamplingArrays) -> tuple:
    """Verifies every row at its own block row_len [R] in one forward, dispatched without waiting: LinearSS rows
    their draft (`drafted`, `q` from `ragged_draft`), AR rows (row_len 1) decode their seed. The device arrays of
    a `VerifyResult` [R, W] (`read_verify`), then the next call's inputs (`next_inputs`). `seed`, `prefix_len`
    may be device arrays (a pipelined step's, from the verify before it)."""
    key = self.ragged_key(StepKind.RAGGED_VERIFY, int(np.sum(row_len)))
    return self.execute(key, RaggedVerifyInputs(drafted, q, seed, row_len, write, prefix_len, page_table, samp))

  def denoise(self, seed, prefix_len, page_table, threshold, blk: int, samp: SamplingArrays, active):
    outs = self.execute(StepKey(StepKind.DENOISE, blk, seed.shape[0], controls=samp.controls_len),
                        DenoiseInputs(seed, prefix_len, page_table, threshold, samp, active))
    return jax.device_get(outs)

