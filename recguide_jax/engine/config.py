"""One frozen configuration of the serving engine: the batch, the KV cache, the compiled block sizes, the queue,
bucketing, the attention implementation and dtype, and whatever else the runner's `RunnerConfig` takes (passed on
by name in `runner_options`). `LLM(...)`'s keyword arguments are the same options; it builds one of these."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from recguide_jax.model.config import BLOCK_SIZES

BUCKETING_CHOICES = (True, False, "auto", "ragged")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_num_seqs: int = 8  # the most requests decoded together (vLLM's name; `max_batch` in the runner)
  max_model_len: int = 1024
  num_pages: int | None = None  # KV cache pages; None: sized by the memory plan
  page_size: int = 16
  prefill_chunk: int = 64
  # block sizes to compile for every step kind, when several strategies will share one engine (None: the ones the
  # strategy plans); each must be one of BLOCK_SIZES' kind (>= 2)
  block_sizes: tuple[int, ...] | None = None
  dtype: str | None = None  # None / "auto": the checkpoint's
  rule: str = "leviathan"  # the acceptance rule of sampled verification
  compile_cache_dir: str | None = None
  warmup: bool = True
  max_queue: int = 1 << 16
  attention: str = "auto"
  # True: one batch per planned block size; False: planned block sizes share one batch padded to the largest;
  # "auto": per step, whichever the strategy's cost model prices cheaper; "ragged": LinearSS and AR requests of any
  # planned blocks share one ragged draft + verify forward, each at its own block (runtime/steps.py)
  bucketing: bool | str = "auto"
  gpu_memory_utilization: float | None = None  # of the device memory; what weights and activations leave is KV
  device_memory_gb: float | None = None
  # vLLM's automatic prefix caching: full prompt pages shared across requests by their token prefix (kv_cache.py)
  enable_prefix_caching: bool = True
  runner_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # other RunnerConfig fields by name

  def __post_init__(self):
    for name in ("max_num_seqs", "max_model_len", "page_size", "prefill_chunk", "max_queue"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
      raise ValueError(f"num_pages must be an integer >= 2 (one is the trash page), got {self.num_pages!r}")
    if self.block_sizes is not None:
      object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
      bad = [b for b in self.block_sizes if b < 2]
      if bad:
        raise ValueError(f"block_sizes must be >= 2 (the library's are {BLOCK_SIZES}), got {bad}")
    from recguide_jax.attention.dispatch import IMPLS
    if self.attention not in IMPLS:
      raise ValueError(f"attention must be one of {IMPLS}, got {self.attention!r}")
    if not any(self.bucketing is c or self.bucketing == c and isinstance(c, str) for c in BUCKETING_CHOICES):
      raise ValueError(f"bucketing must be one of {BUCKETING_CHOICES}, got {self.bucketing!r}")
    if not isinstance(self.enable_prefix_caching, bool):
      raise ValueError(f"enable_prefix_caching must be a boolean, got {self.enable_prefix_caching!r}")
    if self.compile_cache_dir is not None:
      object.__setattr__(self, "compile_cache_dir", os.fspath(self.compile_cache_dir))
    object.__setattr__(self, "runner_options", dict(self.runner_options))
    reserved = {"num_pages", "page_size", "max_model_len", "max_batch", "block_sizes", "prefill_chunk", "rule",
                "compile_cache_dir"} & set(self.runner_options)
    if reserved:
      raise ValueError(f"runner_options {sorted(reserved)} are engine options: pass them as such")

  def runner_config(self, block_sizes: tuple[int, ...], num_pages: int):
    """The runner's configuration for a strategy that plans `block_sizes`, with `num_pages` KV pages."""
    from recguide_jax.runtime.runner import RunnerConfig
    known = {f.name for f in dataclasses.fields(RunnerConfig)}
    unknown = sorted(set(self.runner_options) - known)
    if unknown:
      raise ValueError(f"runner_options {unknown} are not RunnerConfig fields (it has {sorted(known)})")
    return RunnerConfig(num_pages=num_pages, page_size=self.page_size, max_model_len=self.max_model_len,
                        max_batch=self.max_num_seqs, block_sizes=block_sizes, prefill_chunk=self.prefill_chunk,
                        rule=self.rule, compile_cache_dir=self.compile_cache_dir, **self.runner_options)
