"""Offline API, vLLM-shaped: `LLM(model=..., policy=..., block_size=...)`, `llm.generate(prompts, sampling_params)`,
`llm.chat(conversations, sampling_params)`, `llm.get_tokenizer()`. The server and the benchmarks build on these
names."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Sequence

from recguide_jax.decoding.registry import make_strategy
from recguide_jax.decoding.strategy import Strategy
from recguide_jax.engine.config import EngineConfig
from recguide_jax.engine.build import build_engine
from recguide_jax.model.nld import (NLDModel, resolve_kernel_layout, resolve_layer_loop, resolve_projection_fusion,
                                    with_kernel_layout, with_layer_loop, with_projection_fusion)
from recguide_jax.engine.requests import Request, RequestError, SamplingParams, best_samples
from recguide_jax.text.tokenizer import Tokenizer
from recguide_jax.runtime.runner import step_variants

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BUNDLED_CHECKPOINT = REPO_ROOT / "checkpoints" / "nld-tiny-gsm8k"
DEFAULT_COMPILE_CACHE = pathlib.Path(os.environ.get("RECGUIDE_COMPILE_CACHE",
                                                    pathlib.Path.home() / ".cache" / "recguide_jax" / "xla"))
# AR decode steps per device call when nothing waits (`LLM(decode_steps=...)`): on this repo's CPU runs 4 gave most
# of what 8 did (bundled model, batch 1: 1.32x vs 1.45x the single step) at half the tokens a stream receives at once
DEFAULT_DECODE_STEPS = 4
# RecGuide, with the tables and profile shipped beside the checkpoint: it runs AR where speculation would not pay,
# so the default is never slower than AR by more than its calibration rounds (tests/test_default_policy.py)
DEFAULT_POLICY = "recguide"


def default_checkpoint() -> pathlib.Path:
  """`$RECGUIDE_CHECKPOINT` if set, else the model shipped in checkpoints/."""
  return pathlib.Path(os.environ.get("RECGUIDE_CHECKPOINT", BUNDLED_CHECKPOINT))


def recguide_defaults(checkpoint_dir: str | os.PathLike) -> dict:
  """RecGuide's data shipped beside a checkpoint: the fitted adaptive-B tables (`recguide_tables.json`; they also
  carry the overlap planner and margin threshold fitted for the model) and a hardware profile of the machine class it was measured on (`profile.json`), when present."""
  from recguide_jax.recguide import adaptive, profile as prof_lib
  path = pathlib.Path(checkpoint_dir)
  out = {}
  tables = adaptive.tables_path(path)
  if tables is not None:
    out["tables"] = adaptive.load_tables(tables)
  if (path / "profile.json").exists():
    out["profile"] = prof_lib.load_profile(path / "profile.json")
  return out


def checkpoint_dtype(checkpoint_dir: str | os.PathLike) -> str:
  """The dtype the checkpoint's params are stored in (what `dtype="auto"` serves), read from the orbax metadata
  without loading anything."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from recguide_jax.model.checkpoint import PARAMS_DIR, CheckpointError
  params = pathlib.Path(checkpoint_dir).absolute() / PARAMS_DIR
  if not params.exists():
    raise CheckpointError(f"{checkpoint_dir} has no {PARAMS_DIR}/ (run launch/convert_checkpoint.py first)")
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(params)
  stored = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  leaves = [x for x in jax.tree.leaves(stored) if hasattr(x, "dtype")]
  if not leaves:
    raise CheckpointError(f"{params} holds no arrays")
  return np.dtype(leaves[0].dtype).name


@dataclasses.dataclass
class CompletionOutput:
  """One generated sequence of a request (vLLM's `RequestOutput.outputs[i]`)."""
  index: int
  text: str
  token_ids: list[int]
  logprobs: list[dict] | None
  finish_reason: str | None
  cumulative_logprob: float | None = None  # the sum of its tokens' raw logprobs
  stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS, length)


@dataclasses.dataclass
class RequestOutput:
  """A finished request, shaped as vLLM's: its sequences are `outputs[i]` (`out.outputs[0].text`)."""
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  # with SamplingParams.prompt_logprobs: None for the first prompt token, then {"token_id", "logprob",
  # "top_logprobs"} per prompt token (the entries' shape of CompletionOutput.logprobs)
  prompt_logprobs: list[dict | None] | None
  outputs: list[CompletionOutput]
  metrics: dict  # the first sample's RequestStats.as_dict()

  @property
  def finished(self) -> bool:
    return True  # outputs are returned only once their request has finished

  @classmethod
  def from_samples(cls, reqs: Sequence[Request], prompt: str | None, n: int | None = None) -> "RequestOutput":
    """The output of a prompt's samples: `outputs[i]` is sample i, or with `n` < len(reqs) (best_of) the n
    samples of highest cumulative logprob, best first (vLLM's order); the id and the metrics are the first
    sample's."""
    outs = [CompletionOutput(i, r.text, list(r.output_ids), list(r.logprobs) if r.params.logprobs is not None
                             else None, r.finish_reason, r.cumulative_logprob, r.stop_reason)
            for i, r in enumerate(reqs)]
    if n is not None and n < len(outs):
      outs = best_samples(outs, n)
      outs = [dataclasses.replace(o, index=i) for i, o in enumerate(outs)]
    first = reqs[0]
    prompt_lps = next((r.prompt_logprobs for r in reqs if r.prompt_logprobs is not None), None)
    return cls(first.request_id, prompt, list(first.prompt_ids), list(prompt_lps) if prompt_lps is not None else None,
               outs, first.stats.as_dict())


class LLM:
  """Loads a checkpoint, compiles the step variants its policy needs, and generates."""

  def __init__(self, model: str | os.PathLike | NLDModel | None = None,
               policy: str | Strategy = DEFAULT_POLICY,
               block_size: int = 16, *, threshold: float = 0.9, max_num_seqs: int = 8, max_model_len: int = 1024,
               num_pages: int | None = None, page_size: int = 16, prefill_chunk: int = 64,
               block_sizes: Sequence[int] | None = None, dtype: str | None = None, rule: str = "leviathan",
               compile_cache_dir: str | os.PathLike | None = DEFAULT_COMPILE_CACHE, warmup: bool = True,
               tokenizer: Tokenizer | None = None, max_queue: int = 1 << 16, attention: str = "auto",
               policy_kwargs: dict | None = None, gpu_memory_utilization: float | None = None,
               device_memory_gb: float | None = None, background_compile: bool = False, mesh=None,
               runner_options: dict | None = None, bucketing: bool | str = "auto", warmup_prompt_logprobs: bool = False,
               layer_loop: str = "auto", kernel_layout: str = "auto", projection_fusion: str = "auto",
               decode_steps: int = DEFAULT_DECODE_STEPS,
               enable_prefix_caching: bool = True):
    """vLLM's names where they exist: `model` (a checkpoint directory: config.json, params/, tokenizer files;
    default `$RECGUIDE_CHECKPOINT`, else the bundled model; or an `NLDModel` already in memory), `max_num_seqs` (the
    most requests decoded together), `gpu_memory_utilization`, `max_model_len`, `dtype` ("auto": the checkpoint's).
    An `NLDModel` passed in is arranged for its layer loop (`with_layer_loop`): on a GPU that copies stacked layers
    into per-layer buffers, so a caller who keeps the stacked model holds its weights twice; pass one already
    arranged (`with_layer_loop(model, "auto")`), as launch/device_check.py does.

    KV cache size: `num_pages` if given; else, where the device's memory is known (GPU/TPU, or stated by
    `device_memory_gb`), what `gpu_memory_utilization` (default 0.9) of it leaves after the weights and the
    measured activation peak (see memory_plan.py); else (CPU) room for `max_num_seqs` sequences of `max_model_len`.
    The plan is made, logged and checked before the weights are loaded; one that does not fit raises
    `MemoryPlanError` (a ValueError) naming the figures and the option to change. It is kept as `memory_plan`.

    `background_compile`: warm-up compiles only the largest batch bucket of each step variant and the rest on a
    background thread; until a smaller bucket is built its batches run padded in the largest (no request waits on
    a compile). Shortens start-up; what a server wants, while benchmarks want every bucket before they time.

    `runner_options`: any other `RunnerConfig` field by name. `bucketing`: True, one batch per planned block size;
    False, planned block sizes share a batch padded to the largest; "auto", whichever the strategy's cost model
    prices cheaper per step; "ragged", LinearSS and AR requests share one ragged draft + verify forward per step,
    each at its own planned block (compiled per packed-token bucket, not per block size). The options are kept as one frozen `engine_config` (`engine.EngineConfig`).

    `warmup_prompt_logprobs`: warm-up (and the memory plan) also covers the prefill variant that scores the prompt
    (`SamplingParams.prompt_logprobs`); otherwise the first request that asks for prompt logprobs compiles it.

    `layer_loop`: "auto", "scan" or "unrolled", how the forward runs the decoder layers (`model.LayerLoop`; auto:
    unrolled on GPUs, and on a CPU device without a mesh for weights larger than its last-level cache when the
    planned step variants fit Linux's memory-mapping limit unrolled; else scanned).
    `kernel_layout`: "auto", "in_out" or "out_in", how the dense layers hold their kernels (`model.KernelLayout`;
    auto: out_in, whose small matmuls XLA:CPU runs faster, on a CPU device without a mesh, else in_out).
    `projection_fusion`: "auto", "separate" or "fused", whether q/k/v and gate/up run as one matmul each
    (`model.ProjectionFusion`; auto: fused on a CPU device without a mesh, else separate; fused refuses a mesh).
    `decode_steps`: AR decode steps one device call may run (vLLM's multi-step scheduling; `RunnerConfig`): used
    while no request waits to be admitted or prefilled, it saves a dispatch, a read-back and the host's per-step work
    on all but one of the steps; a request stops at its own stop condition inside the call. 1 turns it off.
    `enable_prefix_caching` (vLLM's, on by default): full KV pages of prompts are kept and shared by their token
    prefix, so a request repeating an earlier prompt's prefix (a system prompt, few-shot examples) prefills only
    the rest; `reset_prefix_cache()` forgets them."""
    from absl import logging

    from recguide_jax.attention import dispatch as attention_dispatch

    from recguide_jax.cache import memory_plan
    from recguide_jax.model import checkpoint as ckpt_lib
    from recguide_jax.model.config import NLDConfig
    fraction = gpu_memory_utilization
    if dtype is not None and dtype not in memory_plan.DTYPE_NAMES:
      raise ValueError(f"dtype must be one of {', '.join(memory_plan.DTYPE_NAMES)}, got {dtype!r}")
    checkpoint_dir = None
    if not isinstance(model, NLDModel):
      if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint directory or an NLDModel, got {type(model).__name__}")
      path = pathlib.Path(model) if model is not None else default_checkpoint()
      checkpoint_dir = path
      if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
      if not (path / ckpt_lib.CONFIG_FILE).exists():
        raise ckpt_lib.CheckpointError(f"{path} has no {ckpt_lib.CONFIG_FILE}")
      cfg = NLDConfig.from_json_file(path / ckpt_lib.CONFIG_FILE)
      dtype = checkpoint_dtype(path) if dtype in (None, "auto") else dtype
    else:
      import jax
      from flax import nnx
      cfg = model.cfg
      dtype = jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype.name
    self.cfg = cfg
    if max_model_len > cfg.max_position_embeddings:  # past it positions are untrained, and the cache is sized by it
      raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings}); use at most that")
    if policy == "recguide" and checkpoint_dir is not None:
      policy_kwargs = {**recguide_defaults(checkpoint_dir), **(policy_kwargs or {})}
    self.strategy = policy if isinstance(policy, Strategy) else make_strategy(
        policy, block_size, threshold, **(policy_kwargs or {}))
    sizes = tuple(sorted(set(block_sizes or ()) | set(self.strategy.block_sizes()))) or (block_size,)
    # what warmup compiles (and what the memory probe measures the largest of)
    if block_sizes:  # several policies will share this LLM: every kind for the requested sizes
      self._kinds, self._kind_sizes = ("prefill", "draft", "verify", "denoise"), tuple(block_sizes)
    else:
      self._kinds, self._kind_sizes = self.strategy.step_kinds(), self.strategy.block_sizes()
    if warmup_prompt_logprobs:
      self._kinds = tuple(self._kinds) + ("score",)
    if bucketing == "ragged" and isinstance(bucketing, str):  # the ragged draft + verify of every token bucket
      self._kinds = tuple(self._kinds) + ("ragged",)
    self.engine_config = EngineConfig(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_pages=num_pages or None, page_size=page_size,
        prefill_chunk=prefill_chunk, block_sizes=tuple(block_sizes) if block_sizes else None, dtype=dtype, rule=rule,
        compile_cache_dir=str(compile_cache_dir) if compile_cache_dir else None, warmup=warmup, max_queue=max_queue,
        attention=attention, bucketing=bucketing, gpu_memory_utilization=fraction, device_memory_gb=device_memory_gb,
        enable_prefix_caching=enable_prefix_caching,
        runner_options={"background_compile": background_compile, "layer_loop": layer_loop,
                        "kernel_layout": kernel_layout, "projection_fusion": projection_fusion,
                        "decode_steps": decode_steps,
                        **(runner_options or {})})
    config = self.engine_config.runner_config(sizes, num_pages=2)  # the memory plan sizes the cache
    if compile_cache_dir:  # the memory probe's compiles are cached too
      from recguide_jax.runtime.compilation import enable_compile_cache
      enable_compile_cache(config.compile_cache_dir)
    self.memory_plan = memory_plan.plan_for_device(
        cfg, dtype=dtype, runner_config=config, kinds=self._kinds, block_sizes=self._kind_sizes, fraction=fraction,
        device_memory_gb=device_memory_gb, num_pages=num_pages or None, attention=attention, mesh=mesh,
        model=model if checkpoint_dir is None else None)
    logging.info("%s", self.memory_plan.summary())
    from recguide_jax.parallel import data_parallel  # mesh: 'dp=2,tp=4', a MeshShape or a jax Mesh (sharding.py)
    self.mesh = data_parallel.resolve_mesh(mesh)
    if checkpoint_dir is not None:  # only now, with a plan that fits; on a mesh, straight into the first group's shards
      model = ckpt_lib.load_model(checkpoint_dir, dtype=dtype, mesh=data_parallel.first_group(self.mesh))
      if tokenizer is None and (checkpoint_dir / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(checkpoint_dir)
    attention_dispatch.set_attention_impl(model, attention)  # before the runner splits the model
    # arranged here, not only in the runner, so that the stacked weights are not also kept alive by `self.model`
    loop = resolve_layer_loop(config.layer_loop, model, self.mesh,
                              variants=len(step_variants(config, self._kinds, self._kind_sizes)))
    layout = resolve_kernel_layout(config.kernel_layout, model, self.mesh)
    fusion = resolve_projection_fusion(config.projection_fusion, model, self.mesh)
    model = with_kernel_layout(with_projection_fusion(with_layer_loop(model, loop), fusion), layout)
    self.model = model
    self.tokenizer = tokenizer
    self.runner_config = dataclasses.replace(config, num_pages=self.memory_plan.num_pages, layer_loop=loop,
                                             kernel_layout=layout, projection_fusion=fusion)
    self.engine = build_engine(model, self.runner_config, self.strategy, mesh=self.mesh,
                               tokenizer=tokenizer, max_queue=max_queue, bucketing=self.engine_config.bucketing,
                               enable_prefix_caching=self.engine_config.enable_prefix_caching)
    self.runner = self.engine.runner
    if warmup:
      self.runner.warmup(self._kinds, self._kind_sizes)

  def set_policy(self, policy: str | Strategy, block_size: int = 16, threshold: float = 0.9) -> None:
    """Switches the decoding policy for later requests (compiled variants are kept)."""
    self.strategy = policy if isinstance(policy, Strategy) else make_strategy(
        policy, block_size, threshold)
    self.engine.strategy = self.strategy

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prompt prefix (vLLM's `LLM.reset_prefix_cache`)."""
    return self.engine.reset_prefix_cache()

  def get_tokenizer(self) -> Tokenizer:
    """The checkpoint's tokenizer (vLLM's `LLM.get_tokenizer()`)."""
    if self.tokenizer is None:
      raise RequestError("this model has no tokenizer (a checkpoint without tokenizer.json, or an NLDModel passed "
                         "without `tokenizer=`)", "tokenizer")
    return self.tokenizer

  # ---- helpers -----------------------------------------------------------------------------------------------------
  def _encode(self, prompt) -> tuple[list[int], str | None]:
    if isinstance(prompt, dict):  # vLLM's TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": [...]}
      unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
      if unknown or len(prompt) != 1:
        raise RequestError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids'"
                           + (f" (got {', '.join(map(repr, unknown))})" if unknown else ""), "prompt")
      prompt = next(iter(prompt.values()))
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer; pass token ids", "prompt")
      return self.tokenizer.encode(prompt), prompt
    return [int(t) for t in prompt], None

  @staticmethod
  def _is_single(prompts) -> bool:
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and
                                        all(isinstance(t, int) for t in prompts))

  def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """prompts: a string, a list of token ids, vLLM's prompt dict ({"prompt": text} or {"prompt_token_ids": ids}),
    or a list of any of them. Returns one output per prompt, in order, with `sampling_params.n` samples in its
    `outputs` (they share the prompt's prefill; sample i has seed `seed + i`; with `best_of`, that many are
    generated and the n of highest cumulative logprob returned). One SamplingParams for every prompt, or a list of
    one per prompt. use_tqdm: a progress bar over finished prompts (as vLLM's)."""
    if self._is_single(prompts):
      prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None:
      sampling_params = SamplingParams()
    plist = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
             else [sampling_params] * len(prompts))
    if len(plist) != len(prompts):
      raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
    encoded = [self._encode(p) for p in prompts]
    groups: list[list[Request]] = []  # each prompt's samples (params.n); they share the prompt's prefill
    try:
      for (ids, _), p in zip(encoded, plist):
        self.engine.validate_request(ids, p)  # `n` and `best_of` before they are expanded
        group = [self.engine.add_request(ids, p.sample(0))]
        groups.append(group)
        for i in range(1, p.num_samples):
          group.append(self.engine.add_request(ids, p.sample(i), prefill_source=group[0].request_id))
    except Exception:
      for r in (r for g in groups for r in g):
        self.engine.abort(r.request_id)
      raise
    bar = None
    if use_tqdm:
      from tqdm import tqdm
      bar = tqdm(total=len(groups), desc="Processed prompts", unit="prompt")
    pending = list(groups)  # a prompt counts once all of its samples have finished
    while pending:
      self.engine.step()
      left = [g for g in pending if not all(r.finished for r in g)]
      if bar is not None:
        bar.update(len(pending) - len(left))
      pending = left
    if bar is not None:
      bar.close()
    return [RequestOutput.from_samples(g, text, p.n) for g, (_, text), p in zip(groups, encoded, plist)]

  def chat(self, conversations, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
           add_generation_prompt: bool = True, use_tqdm: bool = True,
           chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
    """conversations: a list of {role, content} messages, or a list of such lists. chat_template_kwargs: extra
    variables for the chat template (as vLLM's)."""
    if self.tokenizer is None:
      raise RequestError("this checkpoint has no tokenizer", "messages")
    single = isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict)
    convs = [conversations] if single else list(conversations)
    prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt, **(chat_template_kwargs or {}))
               for c in convs]
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
