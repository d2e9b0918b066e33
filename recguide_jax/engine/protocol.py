"""`ServingEngine`: what the offline `LLM`, `EngineThread` and the server ask of an engine. Both the single-group
`Engine` and `data_parallel.DataParallelEngine` implement it, and `engine.build.build_engine` returns one of them, so
callers never need to know which (the data-parallel engine once took a different `add_request` and every request
of a dp server failed with a TypeError)."""

from __future__ import annotations

import collections
from typing import Callable, Protocol, Sequence, runtime_checkable

from recguide_jax.engine.requests import Request, SamplingParams


@runtime_checkable
class ServingEngine(Protocol):
  """A continuous-batching engine, driven from one thread (`EngineThread` serialises access for servers)."""

  cfg: object  # the model's NLDConfig
  rc: object  # the RunnerConfig every group runs with (max_model_len, max_batch, page_size, ...)
  runner: object  # warmup / compiles_after_warmup / mark_warm; a `ReplicaRunners` for several groups
  tokenizer: object | None
  max_queue: int  # most requests waiting for a batch slot (over all groups)
  strategy: object  # the decoding strategy; setting it gives every group its own copy

  @property
  def waiting(self) -> Sequence[Request]: ...

  @property
  def running(self) -> Sequence[Request]: ...

  @property
  def totals(self) -> collections.Counter: ...

  @property
  def accepted_per_position(self) -> collections.Counter: ...

  @property
  def block_size_choices(self) -> collections.Counter: ...

  def kv_pages(self) -> tuple[int, int]:
    """(KV pages owned by requests, usable KV pages), over every group."""
    ...

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prompt prefix, in every group."""
    ...

  def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]: ...

  def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                  on_update: Callable | None = None, validated: bool = False, arrival: float | None = None,
                  prefill_source: str | None = None) -> Request: ...

  def abort(self, request_id: str) -> bool: ...

  def finish(self, r: Request, reason: str, error: str | None = None) -> None: ...

  def fail_all(self, message: str) -> None: ...

  def has_work(self) -> bool: ...

  def step(self) -> list[Request]: ...

  @property
  def stalled_on_compile(self) -> bool:
    """The last step ran nothing: every request that could run waits for a background compile."""
    ...

  def wait_for_compile(self, timeout: float) -> None:
    """Blocks up to `timeout` s while a background compile some request waits for runs."""
    ...

  def run_until_done(self) -> None: ...
