"""What a request is, apart from the engine that serves it: `SamplingParams` (vLLM's names and defaults, with
the validation that names the offending field), `Request` and its `RequestStats`, the errors a request can end
in, and the conversion of a request's sampling fields to the batch's host array types. numpy only: the server
validates requests with this module without importing the engine or jax."""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Any, Callable, Sequence

import numpy as np

from recguide_jax.runtime.step_key import COUNTED_FORWARDS

MAX_TOP_LOGPROBS = 20  # vLLM's cap on logprobs / top_logprobs / prompt_logprobs
# Bounds of the request fields that are not bounded by the model (vocabulary, max_model_len). Each one keeps a value
# inside the host array type it is written to, or a per-token cost (stop strings are searched in the decoded text of
# every step) small.
SEED_RANGE = (-2**63, 2**63 - 1)  # vLLM's: a signed 64-bit integer; folded to the 32-bit key word (`fold_seed`)
MAX_TEMPERATURE = 100.0
# vLLM's clamp: 0 < temperature < 0.01 samples at 0.01, so logits / temperature cannot overflow float32 (a denormal
# temperature would turn the softmax into NaN)
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: held-back stream tails are checked against every prefix of every stop
MAX_STOP_TOKEN_IDS = 256
MAX_SAMPLES = 16  # most samples (`n`) of one prompt: each is a request of its own in the engine
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (each is an entry of its row's sparse control list)
LOGIT_BIAS_CLAMP = 100.0  # vLLM's OpenAI layer clamps each bias to [-100, 100] (the OpenAI API's range)
PENALTY_RANGE = (-2.0, 2.0)  # vLLM's range of presence_penalty and frequency_penalty

def describe(value, limit: int = 40) -> str:
  """A short, always-encodable rendering of a client-supplied value for an error message: ASCII escapes instead of
  lone surrogates or other odd characters, no int-to-str conversion of huge integers, capped length."""
  if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
    return f"an integer of {value.bit_length()} bits"
  if isinstance(value, (str, int, float, bool)) or value is None:
    text = ascii(value)
  else:
    text = f"a value of type {type(value).__name__}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def fold_seed(seed: int) -> int:
  """A request seed (any integer in SEED_RANGE) -> the 32-bit word of its sampling keys. Seeds in [0, 2^32) are
  used as they are (their sampled streams do not change); a larger or negative seed goes through the splitmix64
  finaliser of its 64-bit two's complement, so every one of its bits counts and neighbours do not collide in a
  pattern (a plain xor of the halves maps -1 and 2^32 + 1 onto 0)."""
  s = int(seed)
  if 0 <= s < 2**32:
    return s
  mask = 0xFFFFFFFFFFFFFFFF
  u = s & mask
  u = ((u ^ (u >> 30)) * 0xBF58476D1CE4E5B9) & mask
  u = ((u ^ (u >> 27)) * 0x94D049BB133111EB) & mask
  return (u ^ (u >> 31)) & 0xFFFFFFFF


def seed_of_sample(seed: int | None, index: int) -> int | None:
  """Sample `index`'s seed (of `n` samples of one prompt): a given seed is shifted per sample (wrapped into the
  signed 64-bit range), so the samples stay independent and reproducible, and sample 0 is the `n=1` answer with
  that seed; without a seed each sample draws its own."""
  if seed is None or index == 0:
    return seed
  return (seed + index + 2**63) % 2**64 - 2**63


def best_samples(samples: Sequence, n: int) -> list:
  """`best_of`: the n of a prompt's samples (anything with a `cumulative_logprob`) of highest cumulative logprob,
  best first (vLLM's order)."""
  return sorted(samples, key=lambda s: -s.cumulative_logprob)[:n]


@dataclasses.dataclass(frozen=True)
class SamplingRow:
  """One request's row of the batch's sampling arrays, converted to their dtypes once, when the request is added,
  so a value that does not fit fails that request alone instead of the batch it would join."""
  temperature: np.float32
  top_k: np.int32
  top_p: np.float32
  seed: np.uint32
  # the sampling controls (vLLM's logits processors; runtime/sampling.py `apply_controls`): None when the request
  # sets none of them, so its batches run the steps without them
  controls: "ControlRow | None" = None


@dataclasses.dataclass(frozen=True)
class ControlRow:
  """A request's sampling controls in their array types. The token-keyed parts are sparse: the prompt's distinct
  tokens (for repetition_penalty), the logit_bias entries and the stop token ids min_tokens suppresses; the output
  tokens' counts are added per step (they grow)."""
  presence_penalty: np.float32
  frequency_penalty: np.float32
  repetition_penalty: np.float32
  min_p: np.float32
  min_tokens: int
  prompt_ids: np.ndarray  # [n] int32 distinct prompt tokens (empty unless repetition_penalty != 1)
  bias_ids: np.ndarray  # [n] int32
  bias: np.ndarray  # [n] float32
  stop_ids: np.ndarray  # [n] int32: suppressed while fewer than min_tokens tokens are out (empty if min_tokens 0)

  @property
  def penalizes_output(self) -> bool:
    return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def sampling_row(params: "SamplingParams", rng_seed: int, prompt_ids: Sequence[int] = (),
                 eos_token_ids: Sequence[int] = ()) -> SamplingRow:
  """Raises RequestError (naming the field) if a value does not fit its array type; silent float overflow counts.
  `prompt_ids` (repetition_penalty counts them) and `eos_token_ids` (min_tokens holds them back, as vLLM does
  whatever ignore_eos says) are only read when the request sets sampling controls."""
  temperature = float(params.temperature)
  if 0 < temperature < MIN_TEMPERATURE:
    temperature = MIN_TEMPERATURE
  fields = {"temperature": (temperature, np.float32), "top_k": (max(int(params.top_k), 0), np.int32),
            "top_p": (float(params.top_p), np.float32), "seed": (int(rng_seed), np.uint32)}
  out = {}
  for name, (value, dtype) in fields.items():
    info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
    if not (info.min <= value <= info.max) or (isinstance(value, float) and not np.isfinite(value)):
      raise RequestError(f"{name} {describe(value)} does not fit the engine's {np.dtype(dtype).name} array", name)
    out[name] = dtype(value)
  if params.has_controls:
    out["controls"] = control_row(params, prompt_ids, eos_token_ids)
  return SamplingRow(**out)


def control_row(params: "SamplingParams", prompt_ids: Sequence[int], eos_token_ids: Sequence[int]) -> ControlRow:
  floats = {}
  for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
    value = float(getattr(params, name) if getattr(params, name) is not None else NEUTRAL_CONTROLS[name])
    if not np.isfinite(np.float32(value)):
      raise RequestError(f"{name} {describe(value)} does not fit the engine's float32 array", name)
    floats[name] = np.float32(value)
  bias = params.logit_bias or {}
  bias_ids = np.fromiter((int(t) for t in bias), np.int32, len(bias))
  bias_values = np.fromiter((min(LOGIT_BIAS_CLAMP, max(-LOGIT_BIAS_CLAMP, float(v))) for v in bias.values()),
                            np.float32, len(bias))
  rep = floats["repetition_penalty"] != 1
  min_tokens = int(params.min_tokens or 0)
  stops = sorted(set(eos_token_ids) | set(params.stop_token_ids or ())) if min_tokens else []
  return ControlRow(**floats, min_tokens=min_tokens,
                    prompt_ids=np.unique(np.asarray(prompt_ids, np.int32)) if rep else np.zeros(0, np.int32),
                    bias_ids=bias_ids, bias=bias_values, stop_ids=np.asarray(stops, np.int32))


class RequestError(ValueError):
  """A request that can never be served (bad parameters, prompt too long); `param` names the offending field."""

  def __init__(self, message: str, param: str | None = None, code: int = 400):
    super().__init__(message)
    self.param = param
    self.code = code


class QueueFull(RequestError):

  def __init__(self, message: str):
    super().__init__(message, None, 429)


# vLLM's SamplingParams fields with no implementation here -> their neutral values (None is neutral for every one)
UNIMPLEMENTED_FIELDS = {"bad_words": ([], ()), "allowed_token_ids": (), "spaces_between_special_tokens": (True,)}
# the sampling controls (vLLM's penalties and logits processors) -> their neutral values (None counts as neutral)
NEUTRAL_CONTROLS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                    "min_tokens": 0, "logit_bias": {}}


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling parameters (vLLM-shaped names and defaults)."""
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 or -1: off
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  logprobs: int | None = None  # number of top logprobs per token (0: only the chosen token's)
  ignore_eos: bool = False
  # vLLM's: the logprob of every prompt token given the ones before it (the first has none) with this many top
  # entries; the prompt is then scored while it is prefilled, and max_tokens may be 0 (score only)
  prompt_logprobs: int | None = None
  n: int = 1  # samples of the prompt (`LLM.generate` gives each its own seed, `seed_of_sample`, and one prefill)
  # vLLM's: generate this many samples (>= n) and return the n with the highest cumulative logprob
  best_of: int | None = None
  # vLLM's sampling controls, applied to the logits of AR decoding and of every verify position alike
  # (runtime/sampling.py `apply_controls`): speculative output keeps AR's (greedy: equal, sampled: same distribution)
  presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
  frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
  repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens in the prompt or output
  min_p: float = 0.0  # drops tokens whose probability is below min_p times the most likely one's
  min_tokens: int = 0  # EOS and stop_token_ids are held back (and stop strings ignored) until this many are out
  logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
  # vLLM's output text options: a stop string that ends the output is kept in its text (and its tokens up to the
  # one completing it); special tokens (EOS, chat markers) are left out of the text (the token ids keep them)
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last this many tokens are used
  # vLLM's fields whose feature this engine does not have: accepted at their neutral value only (code written for
  # vLLM often passes them explicitly), refused otherwise, naming the field
  bad_words: Sequence[str] | None = None
  allowed_token_ids: Sequence[int] | None = None
  spaces_between_special_tokens: bool | None = None  # (only True: the tokenizer's decode has no such option)

  def __post_init__(self):
    for field, neutral in UNIMPLEMENTED_FIELDS.items():
      value = getattr(self, field)
      if value is not None and value not in neutral:
        off = " or ".join(repr(v) for v in (None, *neutral))
        raise RequestError(f"SamplingParams.{field}={value!r} is not implemented by this engine (only {off}, "
                           "vLLM's default, is accepted)", field)

  @property
  def has_controls(self) -> bool:
    """Whether any sampling control is set to a non-neutral value."""
    return any(getattr(self, f) is not None and getattr(self, f) != v for f, v in NEUTRAL_CONTROLS.items())

  @property
  def num_samples(self) -> int:
    """Samples generated for the prompt: best_of if set, else n."""
    return self.best_of if self.best_of is not None else self.n

  def sample(self, index: int) -> "SamplingParams":
    """The parameters of sample `index` of `n`: one sample, with that sample's seed."""
    return dataclasses.replace(self, n=1, best_of=None, seed=seed_of_sample(self.seed, index))

  def validate(self, vocab_size: int | None = None) -> "SamplingParams":
    """Checks every field's type and range (the ranges its host array type and the model allow); raises
    RequestError naming the field. Booleans are not integers here (`True` is no max_tokens)."""
    def bad(field, msg):
      raise RequestError(f"{field} {msg}", field)

    def is_int(v):
      return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    def is_number(v):
      return is_int(v) or (isinstance(v, (float, np.floating)) and not isinstance(v, bool))

    if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                             or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
      bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {describe(self.prompt_logprobs)}")
    least = 0 if self.prompt_logprobs is not None else 1  # only scoring the prompt may generate nothing
    if not is_int(self.max_tokens) or self.max_tokens < least:
      bad("max_tokens", f"must be a{' non-negative' if least == 0 else ' positive'} integer, got "
          f"{describe(self.max_tokens)}")
    if not is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
      bad("n", f"must be an integer in [1, {MAX_SAMPLES}], got {describe(self.n)}")
    if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= MAX_SAMPLES):
      bad("best_of", f"must be an integer in [n, {MAX_SAMPLES}] (n = {self.n}), got {describe(self.best_of)}")
    if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
      bad("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {describe(self.temperature)}")
    if not is_number(self.top_p) or not 0 < self.top_p <= 1:
      bad("top_p", f"must be in (0, 1], got {describe(self.top_p)}")
    top_k_max = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    if not is_int(self.top_k) or not -1 <= self.top_k <= top_k_max:
      bad("top_k", f"must be -1 or 0 (off) or an integer in [1, {top_k_max}] (the vocabulary size), got "
          f"{describe(self.top_k)}")
    if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
      bad("seed", f"must be an integer in [-2^63, 2^63 - 1], got {describe(self.seed)}")
    if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
      bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {describe(self.logprobs)}")
    if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                    or self.truncate_prompt_tokens < 1):
      bad("truncate_prompt_tokens", f"must be a positive integer, got {describe(self.truncate_prompt_tokens)}")
    for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
      if not isinstance(getattr(self, field), (bool, np.bool_)):
        bad(field, f"must be a boolean, got {describe(getattr(self, field))}")
    if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
      bad("stop", f"must be a string or a list of strings, got {describe(self.stop)}")
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
      bad("stop", f"holds {len(stops)} stop strings, at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
      if not isinstance(s, str) or not s:
        bad("stop", f"must be a non-empty string or a list of non-empty strings, got {describe(s)}")
      if len(s) > MAX_STOP_CHARS:
        bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
    if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
      bad("stop_token_ids", f"must be a list of token ids, got {describe(self.stop_token_ids)}")
    ids = list(self.stop_token_ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
      bad("stop_token_ids", f"holds {len(ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed")
    for t in ids:
      if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
        bad("stop_token_ids", f"holds an invalid token id {describe(t)}"
            + (f" (the vocabulary is [0, {vocab_size}))" if vocab_size is not None else ""))
    self._validate_controls(vocab_size, bad, is_int, is_number)
    return self

  def _validate_controls(self, vocab_size, bad, is_int, is_number) -> None:
    """vLLM's ranges: penalties in [-2, 2], repetition_penalty > 0, min_p in [0, 1], min_tokens in [0, max_tokens];
    logit_bias keys must be token ids of the vocabulary."""
    finite = lambda v: is_number(v) and np.isfinite(float(v))
    for field in ("presence_penalty", "frequency_penalty"):
      v = getattr(self, field)
      if v is not None and (not finite(v) or not PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1]):
        bad(field, f"must be a number in [-2, 2], got {describe(v)}")
    v = self.repetition_penalty
    if v is not None and (not finite(v) or not 0 < v <= np.finfo(np.float32).max):
      bad("repetition_penalty", f"must be a finite number greater than zero, got {describe(v)}")
    if self.min_p is not None and (not finite(self.min_p) or not 0 <= self.min_p <= 1):
      bad("min_p", f"must be a number in [0, 1], got {describe(self.min_p)}")
    if self.min_tokens is not None:
      if not is_int(self.min_tokens) or self.min_tokens < 0:
        bad("min_tokens", f"must be a non-negative integer, got {describe(self.min_tokens)}")
      if is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
        bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
    if self.logit_bias is not None:
      if not isinstance(self.logit_bias, dict):
        bad("logit_bias", f"must be a mapping of token ids to numbers, got {describe(self.logit_bias)}")
      if len(self.logit_bias) > MAX_LOGIT_BIAS:
        bad("logit_bias", f"holds {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS} are allowed")
      for t, v in self.logit_bias.items():
        if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
          bad("logit_bias", f"holds an invalid token id {describe(t)}"
              + (f" (the vocabulary is [0, {vocab_size}))" if vocab_size is not None else ""))
        if not finite(v):
          bad("logit_bias", f"values must be finite numbers, got {describe(v)} for token {t}")

  def truncate(self, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The part of a prompt the request uses: its last `truncate_prompt_tokens` tokens (all when unset)."""
    k = self.truncate_prompt_tokens
    return prompt_ids if k is None or len(prompt_ids) <= k else prompt_ids[-k:]

  @property
  def stop_strings(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


@dataclasses.dataclass
class RequestStats:
  """A request's speculation and timing figures. The decode-round fields (rounds, the accepted-length and block-size
  histories, decode forwards, draft tokens) are kept by the engine as arrays while the request runs
  (`engine.books.DecodeBooks`) and written here when it finishes."""
  rounds: int = 0
  accepted_lengths: list[int] = dataclasses.field(default_factory=list)
  block_sizes: list[int] = dataclasses.field(default_factory=list)
  # device forwards by kind (`StepKind` values; a fused verify counts as a verify)
  forwards: dict[str, int] = dataclasses.field(default_factory=lambda: {str(k): 0 for k in COUNTED_FORWARDS})
  draft_tokens: int = 0  # draft tokens offered to the verifier
  accepted_draft_tokens: int = 0
  ttft_s: float | None = None
  latency_s: float | None = None
  queue_s: float | None = None  # arrival -> admitted to the running batch (vLLM's queue time)

  @property
  def decode_forwards(self) -> int:
    return sum(v for k, v in self.forwards.items() if k != "prefill")

  def as_dict(self) -> dict:
    # the fields' own values, their containers copied: dataclasses.asdict deep-copies every history entry one by
    # one, and every request finishing in a step paid that on the engine thread
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d.update(accepted_lengths=list(self.accepted_lengths), block_sizes=list(self.block_sizes),
             forwards=dict(self.forwards), decode_forwards=self.decode_forwards)
    lengths = self.accepted_lengths
    d["mean_accepted_length"] = sum(lengths) / len(lengths) if lengths else 0.0
    return d


@dataclasses.dataclass
class Request:
  request_id: str
  prompt_ids: list[int]
  params: SamplingParams
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  output_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[dict] = dataclasses.field(default_factory=list)
  # the raw logprob of each output token (always kept: best_of ranks samples by their sum)
  token_logprobs: list[float] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
  # vLLM's: what ended a "stop" finish: the stop string or stop token id (None for EOS, length, abort, error)
  stop_reason: int | str | None = None
  error: str | None = None
  stats: RequestStats = dataclasses.field(default_factory=RequestStats)
  on_update: Callable[["Request", list[int]], None] | None = None
  # engine state
  seed_token: int | None = None  # emitted, not yet cached
  rng_seed: int = 0  # the 32-bit key word (fold_seed of the request's seed)
  round_counter: int = 0  # the second word of its sampling keys: advanced by the engine after each forward
  sampling: SamplingRow | None = None  # this request's sampling-array row, converted when it was added
  text: str | None = None  # set when finished (cut before a stop string if one matched)
  # the engine's incremental text of the output while stop strings are checked (`engine.output.StopText`)
  stop_text: Any = None
  error_code: int | None = None
  # the decoding strategy's own typed state for this request (set by its `on_admit`; the engine never reads it)
  strategy_state: Any = None
  # with params.prompt_logprobs: None for the first prompt token, then one logprob entry per prompt token
  prompt_logprobs: list[dict | None] | None = None
  # another sample of the same prompt whose prefill this one shares (its full prompt pages, `PageAllocator.fork`);
  # None once shared, or when there is none
  prefill_source: "Request | None" = dataclasses.field(default=None, repr=False)
  shared_prompt_tokens: int = 0  # prompt tokens taken from prefill_source's pages instead of computed
  num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (vLLM's name) instead of computed

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def cumulative_logprob(self) -> float:
    """The sum of the output tokens' raw logprobs (vLLM's `cumulative_logprob`)."""
    return float(sum(self.token_logprobs))


_OUTPUT_IDS = operator.attrgetter("output_ids")


def output_lengths(reqs: Sequence[Request]) -> np.ndarray:
  """Each of `reqs`' output tokens so far (read at C speed: every step reads them for every request)."""
  return np.fromiter(map(len, map(_OUTPUT_IDS, reqs)), np.int64, len(reqs))
