"""Device memory plan: how many KV cache pages fit beside the weights and the step activations.

vLLM's `--gpu-memory-utilization`, here `gpu_memory_utilization`: of one device's memory, that fraction is the
budget; the weights and the measured activation peak come off it first and the rest becomes KV pages:

    KV bytes = device memory * fraction - weights - activation peak
    pages    = KV bytes / (2 * layers * page_size * kv_heads * head_dim * dtype bytes)

The activation peak is measured, not guessed: step variants are compiled from abstract shapes
(`jax.ShapeDtypeStruct`: no weight and no KV page is allocated), and XLA's memory analysis of each executable gives
its temporaries plus the non-persistent inputs and outputs that live across it (a draft's `[b, B, V]`
distributions, which the next verify reads).
- On an accelerator (`fit_activation`; also `launch/aot_compile.py` for a chip this host does not have) every
  variant the server compiles, every batch bucket, is compiled at the plan's own cache size, and the plan is made
  again while one needs more than the reserve (the largest batch is not always the peak: NLD-8B's batch-1 decode on
  XLA:GPU needs more than its batch-32 one).
- On a CPU with a stated --device_memory_gb (`measure_activation`), the largest variant of each kind at two small
  cache sizes: XLA's CPU backend copies the cache in a donated update, so the growth per page is charged to every
  page of the plan.

The planning itself is a pure function of shapes and stated sizes, so a plan for an 8B model on an H200 can be
computed (and tested) without one: `python -m recguide_jax.cache.memory_report --presets nld-8b --devices h200` (the
probe then runs on this machine's CPU; see `memory_report.offline_plans` for how its figures are read). The server
plans before it loads anything and refuses a plan that does not fit, naming the numbers and the flag to change.

Per device: with tensor parallelism `tp` the weights and the KV heads split over `tp` devices (KV heads are
replicated when tp exceeds their number, as vLLM does); the plan and its refusal are per device (`plan_for_device(...,
mesh=...)`, `launch/serve.py --mesh`; `docs/memory_plans_mesh.md` for 4x / 8x TPU v5e and 2x 24 GB GPUs).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Mapping, Sequence

GB = 1e9  # decimal gigabytes, as device memory is quoted (an "H200 141 GB", an "L4 24 GB")
DEFAULT_FRACTION = 0.9  # vLLM's default --gpu-memory-utilization
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Stated device sizes for offline plans (docs/memory_plans.md): one device each, nominal memory.
DEVICES = {"h200": ("1x NVIDIA H200", 141.0), "l4": ("1x NVIDIA L4", 24.0), "v5e": ("1x TPU v5e chip", 16.0)}


class MemoryPlanError(ValueError):
  """The requested serving shape does not fit the device; the message names the figures and the flag to change."""


def _gb(n: float) -> str:
  return f"{n / GB:.2f} GB" if abs(n) >= 0.1 * GB else f"{n / 1e6:.1f} MB"


# ---- sizes ---------------------------------------------------------------------------------------------------------

def kv_heads_per_device(num_kv_heads: int, tp: int) -> int:
  """KV heads each of `tp` devices holds: an even split, or one (replicated) head each when tp >= the heads."""
  from recguide_jax.parallel import sharding
  try:
    return num_kv_heads * sharding.kv_replication(num_kv_heads, tp) // tp
  except sharding.MeshError as e:
    raise MemoryPlanError(str(e)) from None


def kv_page_bytes(cfg, page_size: int, dtype: str, tp: int = 1) -> int:
  """Bytes of one KV page on one device: K and V, every layer, `page_size` tokens."""
  return (2 * cfg.num_hidden_layers * page_size * kv_heads_per_device(cfg.num_key_value_heads, tp) * cfg.head_dim *
          DTYPE_BYTES[dtype])


def param_count(cfg) -> int:
  """Parameters of an NLD model of `cfg`: the backbone (NLDConfig.num_params) plus the draft LoRA.
  Closed form, so a plan for a 14B model needs no model built (tests check it against the abstract model)."""
  return cfg.num_params() + cfg.lora_num_params()


def weights_bytes(cfg, dtype: str, tp: int = 1) -> int:
  """Bytes of the model's parameters on one device. Under tensor parallelism, each tensor's shard by sharding.py's
  rules: the split dimensions / tp, the norms and the LoRA's B replicated, the KV projections replicated in groups
  when tp exceeds the KV heads; so a little more than 1/tp of the whole."""
  if tp == 1:
    return param_count(cfg) * DTYPE_BYTES[dtype]
  return _sharded_param_elements(cfg, tp) * DTYPE_BYTES[dtype]


@functools.lru_cache(maxsize=None)
def _sharded_param_elements(cfg, tp: int) -> int:
  from recguide_jax.parallel import sharding
  from recguide_jax.model.checkpoint import param_shapes
  try:
    run_cfg = sharding.mesh_config(cfg, tp)
  except sharding.MeshError as e:
    raise MemoryPlanError(str(e)) from None
  mesh = sharding.abstract_mesh(sharding.MeshShape(tp=tp))
  total = 0
  for name, sds in param_shapes(run_cfg).items():
    split = sum(1 for axis in sharding.param_spec(name, sds.shape, mesh) if axis is not None)
    total += math.prod(sds.shape) // tp ** split
  return total


# ---- the activation probe ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ActivationProfile:
  """Transient device bytes of the step variants at `num_pages` KV pages: base_bytes + per_page_bytes * pages."""
  base_bytes: int
  per_page_bytes: float
  variants: Mapping[str, int]  # "kind/B/bucket" -> transient bytes at the probe's first cache size
  probe_pages: int
  compile_seconds: float
  backend: str

  def at(self, num_pages: int) -> int:
    return int(self.base_bytes + self.per_page_bytes * num_pages)


def probe_variants(variants: Sequence[Any]) -> list[Any]:
  """Of a policy's variants (`StepKey`s), the largest of each kind: its biggest bucket, then block (the transient
  memory of a step grows with both)."""
  best: dict[str, Any] = {}
  for v in variants:
    size = lambda k: (k.batch, k.block, k.tokens)  # a ragged kind's largest: its most packed tokens
    if v.label not in best or size(v) > size(best[v.label]):
      best[v.label] = v
  return list(best.values())


def _abstract_runner(cfg, dtype: str, runner_config, attention: str, mesh=None) -> Any:
  """A `Runner` over abstract weights (`nnx.eval_shape`), hence an abstract KV cache: it lowers and compiles step
  variants at real shapes but allocates neither and cannot run them. With `mesh` (one dp group's tp mesh) the
  weights and the cache carry their shardings and XLA's memory analysis is per device."""
  import jax.numpy as jnp
  from flax import nnx

  from recguide_jax.attention import dispatch as attention_dispatch
  from recguide_jax.parallel import sharding
  from recguide_jax.model.nld import NLDModel, abstract_model
  from recguide_jax.runtime.runner import Runner
  dt = jnp.dtype(dtype)
  if mesh is not None:
    model = abstract_model(cfg, mesh, dtype=dt, attention_impl=attention)
    return Runner(model, runner_config, mesh=mesh,
                  cache_sharding=sharding.cache_sharding(mesh, model.cfg.num_key_value_heads))
  model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0)))
  attention_dispatch.set_attention_impl(model, attention)  # the kernel choice is part of the compiled graph
  return Runner(model, runner_config)


def shard_shape(x) -> tuple[int, ...]:
  """The shape of one device's part of `x` (its shard under a NamedSharding, else the whole)."""
  import jax
  sh = getattr(x, "sharding", None)
  return tuple(sh.shard_shape(x.shape) if isinstance(sh, jax.sharding.NamedSharding) else x.shape)


def _nbytes(tree) -> int:
  """Bytes on one device (a sharded leaf counts its shard, as XLA's per-device memory analysis does)."""
  import jax
  return sum(math.prod(shard_shape(x)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _transient_bytes(compiled, persistent: int) -> int:
  """Temporaries + inputs and outputs that are neither weights nor cache (donated outputs alias the cache). At
  least the temporaries: a step that does not read some weights (a decode: the draft LoRA) has them pruned from its
  arguments."""
  m = compiled.memory_analysis()
  return int(max(m.temp_size_in_bytes, m.temp_size_in_bytes + m.argument_size_in_bytes - persistent
                 + m.output_size_in_bytes - m.alias_size_in_bytes))


def measure_activation(cfg, dtype: str, runner_config, kinds: Sequence[str], block_sizes: Sequence[int], *,
                       attention: str = "auto", progress: bool = False, mesh=None) -> ActivationProfile:
  """Compiles the largest variant of each step kind from abstract shapes and reads XLA's memory analysis.

  Cache writers (variants that donate the cache) are compiled again at twice the pages: their growth per page (a
  backend copying the cache in the update) goes into `per_page_bytes`; readers cannot grow with it."""
  import jax
  from recguide_jax.cache.kv_cache import pages_per_seq  # jax is imported only when a plan is made
  n1 = pages_per_seq(runner_config.max_model_len, runner_config.max_block, runner_config.page_size) + 1
  t0 = time.perf_counter()
  runners = {}
  for n in (n1, 2 * n1):
    runners[n] = _abstract_runner(cfg, dtype, dataclasses.replace(runner_config, num_pages=n), attention, mesh)
  todo = probe_variants(runners[n1].variants(tuple(kinds), tuple(block_sizes)))

  def transient(n: int, variant) -> tuple[int, bool]:
    runner = runners[n]
    if progress:
      print(f"memory plan: compiling {variant} at {n} KV pages to measure its activations", file=sys.stderr,
            flush=True)
    compiled = runner.compiled(variant)
    writes = bool(compiled.memory_analysis().alias_size_in_bytes)  # donates the cache: it updates it
    return _transient_bytes(compiled, _nbytes(runner.state) + _nbytes(runner.cache)), writes

  # XLA compiles outside the GIL: the variants compile concurrently, as in Runner.warmup
  with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    first = dict(zip(todo, pool.map(lambda v: transient(n1, v), todo)))
    writers = [v for v in todo if first[v][1]]  # readers cannot grow with the pages
    second = dict(zip(writers, pool.map(lambda v: transient(2 * n1, v)[0], writers)))
  measured: dict[str, int] = {}
  slopes, base = [0.0], 0
  for v in todo:
    at1 = first[v][0]
    measured[v.name] = at1
    slope = max(0.0, (second[v] - at1) / n1) if v in second else 0.0
    slopes.append(slope)
    base = max(base, at1 - int(slope * n1))
  return ActivationProfile(base_bytes=base, per_page_bytes=max(slopes), variants=measured, probe_pages=n1,
                           compile_seconds=time.perf_counter() - t0, backend=jax.default_backend())


# ---- the activation reserve from the compiled programs at the planned size (accelerators) --------------------------

# where the first reserve is measured: the cache that leaves this share of the budget to the activations. libtpu
# refuses a program whose arguments and temporaries exceed HBM: at a cache that fills the whole budget a step needing
# more than the rest (1.45 GB on a v5e) would not compile at all, though it fits the plan's smaller cache
PROBE_RESERVE_SHARE = 0.1
RESERVE_HEADROOM = 1.02  # on the largest transient measured: buffer assignment may differ a little between cache sizes
MAX_PLAN_ROUNDS = 3


def reserve_bytes(peak: int) -> int:
  """The activation reserve for a measured transient peak: RESERVE_HEADROOM over it, in whole MiB."""
  mib = 2 ** 20
  return -(-int(peak * RESERVE_HEADROOM) // mib) * mib


@dataclasses.dataclass
class FittedPlan:
  """A plan whose activation reserve covers every variant as compiled at the plan's own cache size."""
  plan: "MemoryPlan"
  runner: Any  # the abstract runner at plan.num_pages, every variant compiled (`runner.compiled(v)` is cached)
  transients: dict  # StepKey -> transient bytes at plan.num_pages
  seconds: dict  # StepKey -> compile seconds (the last round's)
  probe: ActivationProfile  # the first reserve: the largest variant of each kind (see fit_activation)
  rounds: list  # per re-plan: (reserve it had, the variant over it, that variant's transient)


def _map(pool, fn, items) -> list:
  """`pool.map` with each task in a copy of the caller's context: the compiles trace under its context variables
  (`attention.dispatch.target_platform`: without it a worker thread lowers a TPU step with the reference attention,
  26 GB of temporaries for NLD-8B's draft/32/32 on a v5e)."""
  return [f.result() for f in [pool.submit(contextvars.copy_context().run, fn, x) for x in items]]


def _compiled(runner, v, num_pages: int):
  """`runner.compiled(v)`; a program the compiler cannot fit in the device's memory at all is a MemoryPlanError that
  names the variant, any other failure says which variant it was."""
  try:
    return runner.compiled(v)
  except Exception as e:
    if "RESOURCE_EXHAUSTED" in str(e):
      raise MemoryPlanError(f"memory plan: {v.name} at {num_pages} KV pages does not fit the device: "
                            f"{str(e).splitlines()[0][:300]}") from None
    e.add_note(f"compiling {v.name} at {num_pages} KV pages")
    raise


def fit_activation(plan, runner_at, variants_of, progress=None, backend: str = "",
                   workers: int | None = None) -> FittedPlan:
  """The memory plan of an accelerator from its own compiler, measured where the cache will be.

  `plan(activation=None)` -> MemoryPlan; `runner_at(num_pages)` -> an abstract Runner; `variants_of(runner)` -> the
  StepKeys the server compiles (every batch bucket). First the reserve is the transient peak of the largest variant
  of each kind (`probe_variants`) compiled at the cache that leaves PROBE_RESERVE_SHARE of the budget to the
  activations (less, and libtpu may refuse a program that fits the final plan); then every variant is compiled at
  the plan's pages, and when one needs more than the reserve (NLD-8B on two H100s: linear's batch-1 decode, 1.02 GB
  over the 0.89 GB of its batch-32 variants) the plan is made again with that peak, its variants recompiled at the
  new size, until every variant fits (MemoryPlanError after MAX_PLAN_ROUNDS, or when the cache no longer fits).
  `workers` variants compile at once (default: one per core, at most 8; XLA compiles outside the GIL)."""
  say = progress or (lambda line: None)
  most = plan()
  if most.sized_by == "memory" and most.budget_bytes:
    share = int(PROBE_RESERVE_SHARE * most.budget_bytes)
    most = plan(activation=ActivationProfile(share, 0.0, {}, 0, 0.0, backend))
  workers = max(1, workers or min(os.cpu_count() or 1, 8))
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return _fit(plan, runner_at, variants_of, say, backend, most, pool)


def _probe(runner_at, variants_of, say, backend, most, pool) -> ActivationProfile:
  """The first reserve: the largest variant of each kind compiled at `most`'s cache (its runner freed on return)."""
  t0 = time.perf_counter()
  runner = runner_at(most.num_pages)
  held = _nbytes(runner.state) + _nbytes(runner.cache)
  todo = probe_variants(variants_of(runner))
  say(f"memory plan: the largest variant of each kind ({len(todo)}) at {most.num_pages} KV pages")
  peaks = dict(zip([v.name for v in todo],
                   _map(pool, lambda v: _transient_bytes(_compiled(runner, v, most.num_pages), held), todo)))
  return ActivationProfile(base_bytes=reserve_bytes(max(peaks.values())), per_page_bytes=0.0, variants=peaks,
                           probe_pages=most.num_pages, compile_seconds=time.perf_counter() - t0, backend=backend)


def _fit(plan, runner_at, variants_of, say, backend, most, pool) -> FittedPlan:
  probe = _probe(runner_at, variants_of, say, backend, most, pool)
  activation, rounds = probe, []
  for _ in range(MAX_PLAN_ROUNDS):
    fitted = plan(activation=activation)
    runner = runner_at(fitted.num_pages)
    held = _nbytes(runner.state) + _nbytes(runner.cache)
    variants = variants_of(runner)
    say(f"{fitted.summary()}\nmemory plan: compiling every variant ({len(variants)}) at {fitted.num_pages} KV pages")
    transients, seconds = {}, {}

    def measure(v, runner=runner, held=held):
      t0 = time.perf_counter()
      compiled = _compiled(runner, v, fitted.num_pages)
      seconds[v] = time.perf_counter() - t0
      transients[v] = _transient_bytes(compiled, held)
      say(f"  {v.name:18s} {seconds[v]:6.1f} s  transient {transients[v] / GB:6.3f} GB")

    _map(pool, measure, variants)
    transients = {v: transients[v] for v in variants}  # in the runner's order
    worst = max(transients, key=transients.get)
    if transients[worst] <= fitted.activation_bytes:
      return FittedPlan(fitted, runner, transients, seconds, probe, rounds)
    rounds.append((fitted.activation_bytes, worst.name, transients[worst]))
    say(f"memory plan: {worst.name} needs {_gb(transients[worst])} at {fitted.num_pages} pages, more than the "
        f"{_gb(fitted.activation_bytes)} reserved: planning again with it")
    activation = dataclasses.replace(probe, base_bytes=reserve_bytes(transients[worst]),
                                     variants={v.name: t for v, t in transients.items()},
                                     probe_pages=fitted.num_pages)
  raise MemoryPlanError(f"memory plan: the activation reserve did not settle in {MAX_PLAN_ROUNDS} rounds "
                        f"({', '.join(f'{n} needs {_gb(t)} > {_gb(r)}' for r, n, t in rounds)})")


# ---- the plan ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """One device's memory: weights + activations + KV pages, against `fraction` of its memory (if known)."""
  device: str  # what the memory figure is of: "cuda:0 (NVIDIA H200)", "stated 1x NVIDIA L4", "cpu:0"
  device_bytes: int | None  # None: unknown (CPU), the KV cache is sized from flags and nothing is checked
  fraction: float | None
  dtype: str
  tp: int
  weights_bytes: int
  activation_bytes: int | None  # measured transient peak at `num_pages` (None: not measured)
  kv_page_bytes: int
  num_pages: int  # including the trash page
  page_size: int
  max_model_len: int
  pages_per_seq: int
  max_num_seqs: int
  sized_by: str  # "memory" (the fraction) or "flags" (--num_pages, or the CPU default)

  @property
  def kv_bytes(self) -> int:
    return self.num_pages * self.kv_page_bytes

  @property
  def kv_tokens(self) -> int:
    return (self.num_pages - 1) * self.page_size  # the trash page holds nothing

  @property
  def max_seqs_at_max_len(self) -> int:
    """How many sequences of max_model_len fit at once (admission pledges each one's worst case)."""
    return (self.num_pages - 1) // self.pages_per_seq

  @property
  def budget_bytes(self) -> int | None:
    return None if self.device_bytes is None or self.fraction is None else int(self.device_bytes * self.fraction)

  @property
  def total_bytes(self) -> int:
    return self.weights_bytes + (self.activation_bytes or 0) + self.kv_bytes

  def summary(self) -> str:
    act = "not measured" if self.activation_bytes is None else _gb(self.activation_bytes)
    head = (f"memory plan ({self.device}, {self.dtype}" + (f", tp={self.tp}" if self.tp > 1 else "") + "): ")
    if self.budget_bytes is not None:
      head += (f"{self.fraction:.2f} of {_gb(self.device_bytes)} = {_gb(self.budget_bytes)}; ")
    return (head + f"weights {_gb(self.weights_bytes)}, activations {act}, KV cache {_gb(self.kv_bytes)} = "
            f"{self.num_pages} pages of {self.page_size} tokens ({self.kv_tokens} tokens, sized by {self.sized_by}), "
            f"{self.max_seqs_at_max_len} sequence{'' if self.max_seqs_at_max_len == 1 else 's'} of max_model_len "
            f"{self.max_model_len} "
            f"(max_num_seqs {self.max_num_seqs})")

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(kv_bytes=self.kv_bytes, kv_tokens=self.kv_tokens, max_seqs_at_max_len=self.max_seqs_at_max_len,
               budget_bytes=self.budget_bytes, total_bytes=self.total_bytes)
    return out


def plan_memory(cfg, *, dtype: str, page_size: int, max_model_len: int, max_num_seqs: int, max_block: int,
                device: str, device_bytes: int | None, fraction: float | None = None, num_pages: int | None = None,
                weights: int | None = None, activation: ActivationProfile | None = None, tp: int = 1) -> MemoryPlan:
  """The plan for one device. With `device_bytes` and `fraction`, KV pages = what is left of the budget after the
  weights and the activations (unless `num_pages` fixes them, which is then checked against the budget); without,
  the cache holds `num_pages` or `max_num_seqs` full-length sequences (+ the trash page), unchecked.
  Raises MemoryPlanError (naming the figures and the flag to change) when the plan does not fit."""
  if dtype not in DTYPE_BYTES:
    raise MemoryPlanError(f"--dtype must be one of {', '.join(DTYPE_BYTES)} here, got {dtype!r}")
  if fraction is not None and not 0 < fraction <= 1:
    raise MemoryPlanError(f"--gpu_memory_utilization must be in (0, 1], got {fraction}")
  if device_bytes is not None and device_bytes <= 0:
    raise MemoryPlanError(f"--device_memory_gb must be > 0, got {device_bytes / GB}")
  weights = weights_bytes(cfg, dtype, tp) if weights is None else weights
  page = kv_page_bytes(cfg, page_size, dtype, tp)
  from recguide_jax.cache.kv_cache import pages_per_seq  # jax is imported only when a plan is made
  per_seq = pages_per_seq(max_model_len, max_block, page_size)
  where = f"{device}" + (f" (per device, tp={tp})" if tp > 1 else "")
  if device_bytes is not None and fraction is None:
    fraction = DEFAULT_FRACTION
  budget = None if device_bytes is None else int(device_bytes * fraction)
  act = activation
  if budget is not None and num_pages is None:  # the fraction sizes the cache
    base = act.base_bytes if act else 0
    per_page = page + (act.per_page_bytes if act else 0.0)
    left = budget - weights - base
    if left <= 0:
      what = f"weights {_gb(weights)}" + (f" + activations {_gb(base)}" if act else "")
      fixes = [] if weights >= budget else ["raise --gpu_memory_utilization",
                                            "lower --max_num_seqs (activations grow with the batch)"]
      fixes += ["use --dtype bfloat16"] * (DTYPE_BYTES[dtype] > 2) + ["use a device with more memory"]
      raise MemoryPlanError(
          f"memory plan does not fit on {where}: {what} exceed --gpu_memory_utilization {fraction:.2f} of "
          f"{_gb(device_bytes)} = {_gb(budget)}, leaving nothing for the KV cache; {', '.join(fixes)}")
    pages = int(left // per_page)
    if pages - 1 < per_seq:
      raise MemoryPlanError(
          f"memory plan does not fit on {where}: {_gb(budget)} (--gpu_memory_utilization {fraction:.2f} of "
          f"{_gb(device_bytes)}) - weights {_gb(weights)} - activations {_gb(base)} leaves {_gb(left)} = "
          f"{max(pages - 1, 0)} KV pages of {page_size} tokens, fewer than the {per_seq} pages one sequence of "
          f"--max_model_len {max_model_len} needs; lower --max_model_len or raise --gpu_memory_utilization")
    sized_by = "memory"
  else:
    pages = num_pages if num_pages is not None else max_num_seqs * per_seq + 1
    if pages - 1 < per_seq:
      raise MemoryPlanError(f"--num_pages {pages} holds {pages - 1} usable pages, fewer than the {per_seq} pages "
                            f"one sequence of --max_model_len {max_model_len} needs; raise --num_pages or lower "
                            f"--max_model_len")
    sized_by = "flags"
  plan = MemoryPlan(device=device, device_bytes=device_bytes, fraction=fraction if budget is not None else None,
                    dtype=dtype, tp=tp, weights_bytes=weights, activation_bytes=act.at(pages) if act else None,
                    kv_page_bytes=page, num_pages=pages, page_size=page_size, max_model_len=max_model_len,
                    pages_per_seq=per_seq, max_num_seqs=max_num_seqs, sized_by=sized_by)
  if budget is not None and plan.total_bytes > budget:  # only a fixed --num_pages can get here
    room = int((budget - weights - (act.base_bytes if act else 0)) //
               (page + (act.per_page_bytes if act else 0.0)))
    raise MemoryPlanError(
        f"memory plan does not fit on {where}: weights {_gb(weights)} + activations "
        f"{_gb(plan.activation_bytes or 0)} + KV cache {_gb(plan.kv_bytes)} (--num_pages {pages}) = "
        f"{_gb(plan.total_bytes)} > {_gb(budget)} (--gpu_memory_utilization {fraction:.2f} of "
        f"{_gb(device_bytes)}); lower --num_pages (at most {max(room, 0)} fit) or raise --gpu_memory_utilization")
  return plan


# ---- the running device --------------------------------------------------------------------------------------------

def _memory_stats(device) -> dict:
  try:
    return device.memory_stats() or {}
  except Exception:  # some backends raise instead of returning None
    return {}


def device_memory_bytes(device) -> int | None:
  """What the device's allocator may hand out (`bytes_limit`), or None where the backend reports none (CPU). On a
  GPU this is XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the card; launch/serve.py raises it to 0.95."""
  limit = _memory_stats(device).get("bytes_limit")
  return int(limit) if limit else None


def device_bytes_in_use(device) -> int | None:
  """Bytes the device's allocator has handed out now (`bytes_in_use`), or None where the backend reports none."""
  in_use = _memory_stats(device).get("bytes_in_use")
  return None if in_use is None else int(in_use)


def resident_bytes(model, device) -> int:
  """Bytes of `model`'s arrays (weights, adapters) already held on `device`: the plan counts them as its own."""
  import jax
  from flax import nnx
  total = 0
  for x in jax.tree.leaves(nnx.state(model)):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
  return total


def check_free(plan: MemoryPlan, device, resident: int = 0) -> None:
  """Refuses a plan the device cannot hold beside what this process already keeps there (another LLM, an engine
  not yet freed): vLLM's startup check. `resident`: bytes of the plan's own weights already on the device."""
  in_use = device_bytes_in_use(device)
  if in_use is None or plan.device_bytes is None:
    return
  held = max(in_use - resident, 0)
  free = plan.device_bytes - held
  if plan.total_bytes <= free:
    return
  most = max(free / plan.device_bytes, 0.0)
  raise MemoryPlanError(
      f"memory plan does not fit beside what this process already holds on {plan.device}: it needs "
      f"{_gb(plan.total_bytes)} (--gpu_memory_utilization {plan.fraction or DEFAULT_FRACTION:.2f} of "
      f"{_gb(plan.device_bytes)}), but {_gb(held)} is held by other arrays (another LLM or engine still alive?), "
      f"leaving {_gb(max(free, 0))}; free them first, or lower --gpu_memory_utilization to at most {most:.2f} "
      f"(or --num_pages)")


def device_description(device) -> str:
  kind = getattr(device, "device_kind", "") or ""
  return f"{device.platform}:{device.id}" + (f" ({kind})" if kind and kind.lower() != device.platform else "")


def plan_for_device(cfg, *, dtype: str, runner_config, kinds: Sequence[str], block_sizes: Sequence[int],
                    fraction: float | None = None, device_memory_gb: float | None = None,
                    num_pages: int | None = None, attention: str = "auto", device=None,
                    measure: bool = True, mesh=None, model=None) -> MemoryPlan:
  """The plan of a server about to start on `device` (default: the first jax device), before anything is loaded.

  `mesh` ('dp=2,tp=4', a MeshShape or a jax Mesh): the plan is per device of a dp group's tp mesh (each group holds
  the weights whole, split over its tp devices, and its own KV pages), its activations measured on that mesh.

  Device memory: `device_memory_gb` if stated, else the allocator's limit (GPU/TPU). Known memory means the plan
  comes from it (fraction default 0.9) with a measured activation peak; unknown memory (CPU) means the cache is
  sized from the flags as before, and `fraction` alone is an error naming --device_memory_gb.

  The allocator's limit is the whole device: arrays this process already holds there (another LLM), other than
  `model`'s own weights, must leave the plan room, or it is refused (`check_free`) before anything is allocated."""
  import jax
  tp, group = 1, None
  if mesh is not None:
    from recguide_jax.parallel import data_parallel
    from recguide_jax.parallel import sharding
    group = data_parallel.first_group(data_parallel.resolve_mesh(mesh))
    tp = sharding.mesh_size(group, sharding.TP)
    device = device or group.devices.flat[0]
  device = device or jax.devices()[0]
  if device_memory_gb is not None:
    device_bytes, name = int(device_memory_gb * GB), f"stated {device_memory_gb:g} GB ({device_description(device)})"
  else:
    device_bytes, name = device_memory_bytes(device), device_description(device)
  if fraction is not None and device_bytes is None:
    raise MemoryPlanError(f"--gpu_memory_utilization needs the device's memory, and {name} reports none; pass "
                          f"--device_memory_gb")
  plan = functools.partial(
      plan_memory, cfg, dtype=dtype, page_size=runner_config.page_size, max_model_len=runner_config.max_model_len,
      max_num_seqs=runner_config.max_batch, max_block=runner_config.max_block, device=name,
      device_bytes=device_bytes, fraction=fraction, num_pages=num_pages, weights=weights_bytes(cfg, dtype, tp),
      tp=tp)
  if device_bytes is None:
    return plan()
  resident = resident_bytes(model, device) if model is not None else 0
  if device_memory_gb is None:  # a stated size is the user's own account of the device
    check_free(plan(), device, resident)
  if not measure:
    return plan()
  plan()  # refuses at once (before the probe's compiles) what cannot fit even without activations
  if device.platform == "cpu":  # a stated --device_memory_gb: XLA:CPU copies the cache in a donated update
    return plan(activation=measure_activation(cfg, dtype, runner_config, kinds, block_sizes, attention=attention,
                                              mesh=group if tp > 1 else None))
  # an accelerator: every variant the server compiles, compiled at the plan's own cache size (`fit_activation`);
  # the warm-up then compiles the same programs (from the compile cache when one is set)
  runner_at = lambda n: _abstract_runner(cfg, dtype, dataclasses.replace(runner_config, num_pages=n), attention,
                                         group if tp > 1 else None)
  fitted = fit_activation(plan, runner_at, lambda r: r.variants(tuple(kinds), tuple(block_sizes)),
                          backend=device.platform).plan
  if device_memory_gb is None:
    check_free(fitted, device, resident)
  return fitted
