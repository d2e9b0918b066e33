"""Offline API, vLLM-shaped: `LLM(checkpoint=..., policy=..., block_size=...)`, `llm.generate(prompts, params)`,
`llm.chat(conversations, params)`. The server and the benchmarks build on these names."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Sequence

from recguide_jax import policies as policies_lib
from recguide_jax.engine import Engine, Request, RequestError, SamplingParams
from recguide_jax.model import NLDModel
from recguide_jax.runner import Runner, RunnerConfig
from recguide_jax.tokenizer import Tokenizer

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BUNDLED_CHECKPOINT = REPO_ROOT / "checkpoints" / "nld-tiny-gsm8k"
DEFAULT_COMPILE_CACHE = pathlib.Path(os.environ.get("RECGUIDE_COMPILE_CACHE",
                                                    pathlib.Path.home() / ".cache" / "recguide_jax" / "xla"))


def default_checkpoint() -> pathlib.Path:
  """`$RECGUIDE_CHECKPOINT` if set, else the model shipped in checkpoints/."""
  return pathlib.Path(os.environ.get("RECGUIDE_CHECKPOINT", BUNDLED_CHECKPOINT))


def recguide_defaults(checkpoint_dir: str | os.PathLike) -> dict:
  """RecGuide's data shipped beside a checkpoint: the fitted adaptive-B tables (`recguide_policy.json`, which
  also carries the overlap planner and margin threshold fitted for the model) and a hardware profile of the machine
  class it was measured on (`profile.json`), when present."""
  from recguide_jax.orchestrator import adaptive, profile as prof_lib
  path = pathlib.Path(checkpoint_dir)
  out = {}
  if (path / "recguide_policy.json").exists():
    out["tables"] = adaptive.load_policy(path / "recguide_policy.json")
  if (path / "profile.json").exists():
    out["profile"] = prof_lib.load_profile(path / "profile.json")
  return out


@dataclasses.dataclass
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: str | None
  logprobs: list[dict] | None
  stats: dict

  @classmethod
  def from_request(cls, req: Request, prompt: str | None) -> "RequestOutput":
    return cls(req.request_id, prompt, list(req.prompt_ids), list(req.output_ids), req.text, req.finish_reason,
               list(req.logprobs) if req.params.logprobs is not None else None, req.stats.as_dict())


class LLM:
  """Loads a checkpoint, compiles the step variants its policy needs, and generates."""

  def __init__(self, checkpoint: str | os.PathLike | None = None, policy: str | policies_lib.Policy = "linear",
               block_size: int = 16, *, threshold: float = 0.9, max_batch: int = 8, max_model_len: int = 1024,
               num_pages: int | None = None, page_size: int = 16, prefill_chunk: int = 64,
               block_sizes: Sequence[int] | None = None, dtype: str | None = None, rule: str = "leviathan",
               compile_cache_dir: str | os.PathLike | None = DEFAULT_COMPILE_CACHE, warmup: bool = True,
               model: NLDModel | None = None, tokenizer: Tokenizer | None = None, max_queue: int = 1 << 16,
               attention: str = "auto", policy_kwargs: dict | None = None):
    from recguide_jax import checkpoint as ckpt_lib
    checkpoint_dir = None
    if model is None:
      path = pathlib.Path(checkpoint) if checkpoint is not None else default_checkpoint()
      checkpoint_dir = path
      if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
      model = ckpt_lib.load_model(path, dtype=dtype)
      if tokenizer is None and (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(path)
    from recguide_jax import attention_dispatch
    attention_dispatch.set_attention_impl(model, attention)  # before the runner splits the model
    self.model = model
    self.cfg = model.cfg
    self.tokenizer = tokenizer
    if policy == "recguide" and checkpoint_dir is not None:
      policy_kwargs = {**recguide_defaults(checkpoint_dir), **(policy_kwargs or {})}
    self.policy = policy if isinstance(policy, policies_lib.Policy) else policies_lib.make_policy(
        policy, block_size, threshold, **(policy_kwargs or {}))
    sizes = tuple(sorted(set(block_sizes or ()) | set(self.policy.block_sizes()))) or (block_size,)
    pages_per_seq = -(-(max_model_len + max(sizes + (prefill_chunk,))) // page_size)
    self.runner_config = RunnerConfig(
        num_pages=num_pages or max_batch * pages_per_seq + 1, page_size=page_size, max_model_len=max_model_len,
        max_batch=max_batch, block_sizes=sizes, prefill_chunk=prefill_chunk, rule=rule,
        compile_cache_dir=str(compile_cache_dir) if compile_cache_dir else None)
    self.runner = Runner(model, self.runner_config)
    self.engine = Engine(self.runner, self.policy, tokenizer=tokenizer, max_queue=max_queue)
    if warmup:
      if block_sizes:  # several policies will share this LLM: compile every kind for the requested sizes
        self.runner.warmup(("prefill", "draft", "verify", "denoise"), tuple(block_sizes))
      else:
        self.runner.warmup(self.policy.step_kinds(), self.policy.block_sizes())

  def set_policy(self, policy: str | policies_lib.Policy, block_size: int = 16, threshold: float = 0.9) -> None:
    """Switches the decoding policy for later requests (compiled variants are kept)."""
    self.policy = policy if isinstance(policy, policies_lib.Policy) else policies_lib.make_policy(
        policy, block_size, threshold)
    self.engine.policy = self.policy

  # ---- helpers -----------------------------------------------------------------------------------------------------
  def _encode(self, prompt) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer; pass token ids", "prompt")
      return self.tokenizer.encode(prompt), prompt
    return [int(t) for t in prompt], None

  @staticmethod
  def _is_single(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and
                                        all(isinstance(t, int) for t in prompts))

  def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = False) -> list[RequestOutput]:
    """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt, in order."""
    if self._is_single(prompts):
      prompts = [prompts]
    prompts = list(prompts)
    if params is None:
      params = SamplingParams()
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
      raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
    encoded = [self._encode(p) for p in prompts]
    reqs = []
    try:
      for (ids, _), p in zip(encoded, plist):
        reqs.append(self.engine.add_request(ids, p))
    except Exception:
      for r in reqs:
        self.engine.abort(r.request_id)
      raise
    bar = None
    if use_tqdm:
      from tqdm import tqdm
      bar = tqdm(total=len(reqs), desc="generating", unit="req")
    while any(not r.finished for r in reqs):
      done = self.engine.step()
      if bar is not None:
        bar.update(sum(1 for r in done if r in reqs))
    if bar is not None:
      bar.close()
    return [RequestOutput.from_request(r, text) for r, (_, text) in zip(reqs, encoded)]

  def chat(self, conversations, params: SamplingParams | Sequence[SamplingParams] | None = None,
           add_generation_prompt: bool = True) -> list[RequestOutput]:
    """conversations: a list of {role, content} messages, or a list of such lists."""
    if self.tokenizer is None:
      raise RequestError("this checkpoint has no tokenizer", "messages")
    single = isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict)
    convs = [conversations] if single else list(conversations)
    prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt) for c in convs]
    return self.generate(prompts, params)
