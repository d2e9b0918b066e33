"""Compile every step variant a server would build, for a target it does not run on, and check the programs.

`plan_and_compile` does what `LLM` / `launch/serve.py` do on the target before they serve: the memory plan
(`memory_plan.fit_activation`: a first activation reserve from the largest variant of each kind, then every variant
compiled at the plan's cache size, planned again while one needs more than the reserve). Each compiled variant is
then checked:
- its temporaries stay under `temp_limit` of the device's KV cache (a larger one is a copy of the cache),
- its transient memory stays within the activation peak the plan reserved,
- no weight is copied into another layout (a decode step exists to read the weights once; a re-laid copy reads
  and writes them again, and a copy hoisted out of a loop holds a second set of them),
- no sort runs over the whole vocabulary (top-p by sorting; the sampler selects without sorting).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Callable, Sequence


from recguide_jax.cache import memory_plan as memory_plan_lib
from recguide_jax.aot import inspect as hlo
from recguide_jax.aot.targets import Target


@dataclasses.dataclass(frozen=True)
class VariantReport:
  variant: str  # kind/B/batch
  label: str
  compile_s: float
  argument_bytes: int
  temp_bytes: int
  output_bytes: int
  alias_bytes: int
  transient_bytes: int  # temporaries + inputs and outputs that are neither weights nor cache
  large_buffers: tuple[hlo.Buffer, ...]  # instructions creating >= temp_limit of the cache
  weight_copies: tuple[hlo.Buffer, ...]  # weights (or a layer's slice of them) re-laid out
  vocabulary_sorts: tuple[str, ...]
  kernel_calls: dict

  def problems(self, cache_bytes: int, temp_limit: float, activation_bytes: int | None) -> list[str]:
    out = []
    if self.temp_bytes > temp_limit * cache_bytes:
      out.append(f"temporaries {self.temp_bytes / 1e9:.3f} GB > {temp_limit:.0%} of the device's KV cache "
                 f"({cache_bytes / 1e9:.2f} GB)" + "".join(f"; {b.opcode} {b.shape} ({b.op_name or b.name})"
                                                          for b in self.large_buffers[:3]))
    if activation_bytes is not None and self.transient_bytes > activation_bytes:
      out.append(f"transient {self.transient_bytes / 1e9:.3f} GB > the plan's activation reserve "
                 f"{activation_bytes / 1e9:.3f} GB")
    if self.weight_copies:
      out.append(f"weights copied into another layout ({len(self.weight_copies)} copies, "
                 f"{sum(b.nbytes for b in self.weight_copies) / 1e9:.3f} GB): "
                 + "; ".join(f"{b.opcode} {b.shape} ({b.op_name or b.name})" for b in self.weight_copies[:3]))
    if self.vocabulary_sorts:
      out.append(f"{len(self.vocabulary_sorts)} sort(s) over the whole vocabulary")
    return out


@dataclasses.dataclass(frozen=True)
class TargetReport:
  target: str
  policy: str
  tp: int
  plan: memory_plan_lib.MemoryPlan
  cache_bytes_per_device: int
  temp_limit: float
  variants: tuple[VariantReport, ...]
  probe_reserve_bytes: int = 0  # the first reserve: the largest variant of each kind (memory_plan.fit_activation)
  replans: tuple = ()  # (reserve, variant over it, its transient) per re-plan
  layer_loop: str = "scan"  # how the compiled forward runs the layers (nld.resolve_layer_loop for the target)

  @property
  def problems(self) -> dict[str, list[str]]:
    out = {}
    for v in self.variants:
      p = v.problems(self.cache_bytes_per_device, self.temp_limit, self.plan.activation_bytes)
      if p:
        out[v.variant] = p
    return out


def target_mesh(target: Target, tp: int):
  """One dp group's tp mesh over the target's first `tp` compile-only devices (every group compiles alike)."""
  from recguide_jax.parallel import sharding
  devices = target.devices()
  if tp > len(devices):
    raise ValueError(f"--tensor_parallel_size {tp} exceeds the {len(devices)} devices of --target {target.name}")
  return sharding.make_mesh(sharding.MeshShape(tp=tp), devices=devices[:tp])


def policy_runner_config(policy_name: str, *, block_size: int, max_num_seqs: int, max_model_len: int,
                         page_size: int, prefill_chunk: int, num_pages: int = 2, bucketing: bool | str = "auto",
                         **runner_options):
  """(strategy, RunnerConfig, kinds, block sizes) as `LLM(policy=policy_name, bucketing=bucketing)` builds them (its
  memory plan then sets num_pages): ragged steps add the ragged draft and verify of every packed-token bucket."""
  from recguide_jax.decoding.registry import make_strategy
  from recguide_jax.engine.config import EngineConfig
  from recguide_jax.llm import DEFAULT_DECODE_STEPS
  strategy = make_strategy(policy_name, block_size)
  sizes = tuple(sorted(set(strategy.block_sizes()))) or (block_size,)
  engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, page_size=page_size,
                               prefill_chunk=prefill_chunk,
                               runner_options={"decode_steps": DEFAULT_DECODE_STEPS, **runner_options})
  kinds = tuple(strategy.step_kinds()) + (("ragged",) if bucketing == "ragged" and isinstance(bucketing, str) else ())
  return strategy, engine_config.runner_config(sizes, num_pages), kinds, strategy.block_sizes()


def shapes_config(preset: str, lora_rank: int):
  """The model a compile runs: a preset of recguide_jax/model/config.py or a checkpoint directory's config.json, with
  NLD's draft LoRA of `lora_rank` added when the config has none. A ValueError names the flag."""
  import os
  from recguide_jax.model.config import PRESETS, NLDConfig
  if preset in PRESETS:
    cfg = PRESETS[preset]
  elif os.path.exists(os.path.join(preset, "config.json")):
    cfg = NLDConfig.from_json_file(os.path.join(preset, "config.json"))
  else:
    raise ValueError(f"--preset must be one of {sorted(PRESETS)} or a checkpoint directory, got {preset!r}")
  if lora_rank < 0:
    raise ValueError(f"--lora_rank must be >= 0, got {lora_rank}")
  if lora_rank and not cfg.lora_rank:
    cfg = cfg.replace(lora_rank=lora_rank, lora_alpha=4.0 * lora_rank)
  return cfg


def plan_and_compile(cfg, target: Target, *, policy: str, tp: int, dtype: str = "bfloat16", block_size: int = 16,
                     max_num_seqs: int = 32, max_model_len: int = 4096, page_size: int = 16, prefill_chunk: int = 64,
                     num_pages: int | None = None, fraction: float = memory_plan_lib.DEFAULT_FRACTION,
                     attention: str = "pallas", temp_limit: float = 0.1, startup_only: bool = False,
                     only: Sequence[str] = (), workers: int = 1, bucketing: bool | str = "auto",
                     progress: Callable[[str], None] = print) -> TargetReport:
  """The memory plan of `target` for `policy`, then every variant compiled at its cache size and checked.
  Raises memory_plan.MemoryPlanError when the plan does not fit the chip."""
  from recguide_jax.attention import dispatch as attention_dispatch
  from recguide_jax.cache.memory_plan import _abstract_runner, _nbytes, shard_shape
  from recguide_jax.model.nld import LayerLoop
  _, rc, kinds, blocks = policy_runner_config(policy, block_size=block_size, max_num_seqs=max_num_seqs,
                                              max_model_len=max_model_len, page_size=page_size,
                                              prefill_chunk=prefill_chunk, bucketing=bucketing)
  mesh = target_mesh(target, tp)
  plan = functools.partial(
      memory_plan_lib.plan_memory, cfg, dtype=dtype, page_size=page_size, max_model_len=max_model_len,
      max_num_seqs=max_num_seqs, max_block=rc.max_block, device=f"{target.chip.description} ({target.name})",
      device_bytes=target.chip.memory_bytes, fraction=fraction, num_pages=num_pages,
      weights=memory_plan_lib.weights_bytes(cfg, dtype, tp), tp=tp)

  def variants_of(runner):
    variants = runner.variants(kinds, blocks)
    if startup_only:
      variants = [v for v in variants if v.batch == rc.max_batch]
    if only:  # name patterns ("fused/32/*"): a partial plan, over these variants only
      variants = [v for v in variants if any(fnmatch.fnmatchcase(v.name, p) for p in only)]
      if not variants:
        raise ValueError(f"--variants {','.join(only)} matches none of the policy's variants")
    return variants

  with attention_dispatch.target_platform(target.platform.value):
    # the plan serve.py makes on the chip (memory_plan.fit_activation): its reserve from every variant compiled
    # at the plan's own cache size, so the variants reported below are those very programs
    progress(f"{target.name} tp={tp} {policy}:")
    fitted = memory_plan_lib.fit_activation(
        plan, lambda n: _abstract_runner(cfg, dtype, dataclasses.replace(rc, num_pages=n), attention, mesh),
        variants_of, progress=progress, backend=target.platform.value, workers=workers)
    plan, runner = fitted.plan, fitted.runner
    cache_bytes = _nbytes(runner.cache)
    vocab = runner.cfg.vocab_size // tp  # a sort of any vocabulary shard is a sort of the vocabulary
    weight_shapes = [shard_shape(w) for w in runner.weights]
    stacked = runner.layer_loop is LayerLoop.SCAN  # a layer's weights are slices of stacked arrays
    worst = max(fitted.transients, key=fitted.transients.get)
    progress(f"plan vs compiled: the largest variant of each kind reserved {fitted.probe.base_bytes / 1e9:.3f} GB; "
             f"the plan reserves {plan.activation_bytes / 1e9:.3f} GB; compiled at {plan.num_pages} pages, the most "
             f"any variant needs is {fitted.transients[worst] / 1e9:.3f} GB ({worst.name})")
    reports = []
    for v, transient in fitted.transients.items():
      compiled = runner.compiled(v)  # cached by fit_activation
      m = compiled.memory_analysis()
      text = compiled.as_text()
      report = VariantReport(
          variant=v.name, label=v.label, compile_s=round(fitted.seconds[v], 2),
          argument_bytes=int(m.argument_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
          output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes), transient_bytes=transient,
          large_buffers=tuple(hlo.large_buffers(text, int(temp_limit * cache_bytes))),
          weight_copies=tuple(hlo.weight_copies(text, weight_shapes, layer_axis=stacked)),
          vocabulary_sorts=tuple(hlo.vocabulary_sorts(text, vocab)), kernel_calls=hlo.kernel_calls(text))
      reports.append(report)
      flags = report.problems(cache_bytes, temp_limit, plan.activation_bytes)
      progress(f"  {v.name:18s} {report.compile_s:6.1f} s  args {report.argument_bytes / 1e9:7.3f} GB  temp "
               f"{report.temp_bytes / 1e9:6.3f} GB  transient {report.transient_bytes / 1e9:6.3f} GB"
               + (f"  PROBLEM: {'; '.join(flags)}" if flags else ""))
  return TargetReport(target=target.name, policy=policy, tp=tp, plan=plan, cache_bytes_per_device=cache_bytes,
                      temp_limit=temp_limit, variants=tuple(reports), probe_reserve_bytes=fitted.probe.base_bytes,
                      replans=tuple(fitted.rounds), layer_loop=runner.layer_loop.value)
