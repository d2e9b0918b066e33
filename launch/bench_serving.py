"""Serving benchmark over HTTP, like `vllm bench serve`: a load generator against a running OpenAI-compatible server
(ours or any other), streamed requests timed on the client, optionally swept over load levels.

  # against a running server (vLLM's flags, dashed or underscored)
  python launch/bench_serving.py --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 256 \\
      --random-output-len 128 --num-prompts 64 --max-concurrency 8 --goodput ttft:500,tpot:50
  # a server on another machine: say so
  python launch/bench_serving.py --base-url http://gpu-box:8000 --allow-remote --num-prompts 24
  # start launch/serve.py itself (bundled model, a free loopback port), once per policy, sweep the load
  python launch/bench_serving.py --launch --policy linear,recguide --sweep 1,2,4,8 --num_prompts 24 \\
      --max_tokens 128 --output_dir docs

Load: without --sweep, one level like vLLM's: --request_rate req/s (`inf`, the default, sends everything at once;
Poisson arrivals, gamma with --burstiness, or fixed-interval with --arrival fixed) with at most --max_concurrency
requests in flight (0: no cap). --sweep runs several levels: concurrencies (`--sweep_over concurrency`: C clients,
each sends its next request when the previous one ends, at --request_rate) or request rates (`--sweep_over
request_rate`, under the --max_concurrency cap). Each level sends the same --num_prompts requests, in order.

Prompts (--dataset_name, vLLM's names): `gsm8k` (the default: GSM8K's `{"question": ...}` test split in the shared
data folder, or --dataset_path; read in place, never copied), `custom` (any jsonl with a `prompt` field, at
--dataset_path) or `random` (--random_input_len tokens drawn from the tokenizer's vocabulary, each request asking
for --random_output_len tokens, both spread by --random_range_ratio; --random_prefix_len tokens shared by every
prompt in front; the tokenizer is --tokenizer, default the launched or bundled model's). `--endpoint chat` sends
each prompt as one user message to /v1/chat/completions (the model's chat template, how the bundled model was
trained), `--endpoint completions` as raw text to /v1/completions.

Per level it reports request and token throughput, goodput (requests per second meeting every --goodput SLO, in
ms: `ttft`, `tpot`, `e2el`), per-request output speed, and for --percentile_metrics (`ttft`, `tpot`, `itl`,
`e2el`) the mean and --metric_percentiles (TTFT is the first non-empty text chunk, ITL the gaps between text chunks,
a speculative round's tokens arriving in one chunk; TPOT is (e2e - TTFT) / (output tokens - 1) per request); from
the responses' `speculation` field (the final stream chunk carries it) the mean accepted length per round, its
histogram, and the share of rounds by block size (1: plain AR rounds); and, when the server exports them, the same
acceptance figures from its /metrics (`recguide:spec_decode_*`) over the level. With --save_detailed (default on)
the JSON has every request's lengths, latencies, ITLs, finish reason and error. Outputs: <name>.json, <name>.md and
PNG plots (throughput vs per-request speed frontier across load, as the paper's Figure 5; accepted-length
histogram; TTFT / TPOT vs load) in --output_dir (default runs/bench_serving; `--output_dir docs` to update the
committed ones).

Only loopback servers are benchmarked unless --allow_remote (127.0.0.0/8, localhost, ::1); every level is bounded
by --num_prompts and --max_level_s, every request by --request_timeout_s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

FLAGS = flags.FLAGS
# GSM8K's test split in $RECGUIDE_GSM8K_DIR, else beside the repository (recguide_jax/benchmarks/gsm8k.py; not
# imported here, so that this HTTP client loads no jax)
GSM8K_TEST = os.path.join(os.environ.get("RECGUIDE_GSM8K_DIR") or os.path.normpath(
    os.path.join(ROOT, "..", "shared", "data", "gsm8k")), "test.jsonl")
SERVE = os.path.join(ROOT, "launch", "serve.py")
BUNDLED = os.path.join(ROOT, "checkpoints", "nld-tiny-gsm8k")  # recguide_jax.llm's default model (not imported: jax)
SWEEP_KINDS = ("concurrency", "request_rate")
DATASETS = ("gsm8k", "custom", "random")
PERCENTILES = (50, 90, 99)
# vLLM's --percentile-metrics names -> the report's keys
METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's SLO keys

if __name__ == "__main__":
  flags.DEFINE_string("base_url", None, "Server to benchmark, e.g. http://127.0.0.1:8000 (loopback unless "
                      "--allow_remote). Exactly one of --base_url and --launch.")
  flags.DEFINE_bool("allow_remote", False, "Allow a --base_url that is not a loopback address.")
  flags.DEFINE_bool("launch", False, "Start launch/serve.py on a free loopback port for each --policy, benchmark "
                    "it, stop it.")
  flags.DEFINE_list("policy", ["recguide"], "With --launch: the policies to serve, one server each (ar, diffusion, "
                    "linear, recguide; default serve.py's).")
  flags.DEFINE_string("model", None, "With --launch: the checkpoint to serve (default: the bundled model).")
  flags.DEFINE_list("serve_args", [], "With --launch: more flags for serve.py, comma-separated "
                    "(e.g. --block_size=16,--max_num_seqs=8).")
  flags.DEFINE_string("serve_log_dir", os.path.join(ROOT, "runs", "bench_serving"), "With --launch: where each "
                      "server's log goes.")
  flags.DEFINE_float("launch_timeout_s", 3600.0, "With --launch: longest wait for a server to load and compile.")
  flags.DEFINE_string("label", None, "Name of the run in the outputs (default: the policy with --launch, else the "
                      "served model's name).")
  flags.DEFINE_string("served_model_name", None, "Model name sent in requests (default: the first one /v1/models "
                      "lists).")
  flags.DEFINE_enum("endpoint", "chat", ["chat", "completions"], "/v1/chat/completions (prompt as one user message) "
                    "or /v1/completions (raw prompt).")
  flags.DEFINE_enum("dataset_name", "gsm8k", list(DATASETS), "gsm8k: GSM8K's questions; custom: a jsonl with a "
                    "`prompt` field (--dataset_path); random: random tokens (--random_input_len, ...).")
  flags.DEFINE_string("dataset_path", None, "jsonl of prompts: GSM8K's {\"question\": ...} or any {\"prompt\": ...} "
                      "(gsm8k default: $RECGUIDE_GSM8K_DIR/test.jsonl, else ../shared/data/gsm8k).")
  flags.DEFINE_integer("random_input_len", 128, "random: prompt tokens per request.")
  flags.DEFINE_integer("random_output_len", 128, "random: max_tokens per request (with --ignore_eos, the output "
                       "length).")
  flags.DEFINE_float("random_range_ratio", 0.0, "random: input and output lengths uniform in [len * (1 - r), "
                     "len * (1 + r)].")
  flags.DEFINE_integer("random_prefix_len", 0, "random: tokens of one shared prefix in front of every prompt.")
  flags.DEFINE_string("tokenizer", None, "random: checkpoint directory (or tokenizer.json) whose vocabulary the "
                      "tokens are drawn from (default: --model, else $RECGUIDE_CHECKPOINT, else the bundled model).")
  flags.DEFINE_integer("num_prompts", 24, "Requests per load level (the dataset's first ones).")
  flags.DEFINE_integer("max_tokens", 128, "max_tokens of every request (random: --random_output_len).")
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature of every request (0: greedy).")
  flags.DEFINE_bool("ignore_eos", False, "Ask for exactly max_tokens tokens (ignore_eos, a vLLM extension).")
  flags.DEFINE_enum("sweep_over", "concurrency", list(SWEEP_KINDS), "What --sweep sets per level.")
  flags.DEFINE_list("sweep", [], "Load levels to sweep: concurrencies, or request rates in req/s (`inf`: all at "
                    "once). Empty: one level at --request_rate under --max_concurrency.")
  flags.DEFINE_float("request_rate", math.inf, "Arrival rate (req/s; inf: all at once), unless --sweep_over "
                     "request_rate sweeps it.")
  flags.DEFINE_integer("max_concurrency", 0, "Most requests in flight (0: no cap), unless --sweep_over concurrency "
                       "sweeps it.")
  flags.DEFINE_enum("arrival", "poisson", ["poisson", "fixed"], "Inter-arrival times of open-loop levels.")
  flags.DEFINE_float("burstiness", 1.0, "Gamma shape of Poisson-process inter-arrivals (1: Poisson; < 1 burstier).")
  flags.DEFINE_list("percentile_metrics", ["ttft", "tpot", "itl", "e2el"], "Metrics whose percentiles the report "
                    "shows: ttft, tpot, itl, e2el.")
  flags.DEFINE_list("metric_percentiles", ["50", "90", "99"], "Percentiles of --percentile_metrics (e.g. 25,50,99.9).")
  flags.DEFINE_list("goodput", [], "SLOs, KEY:MS pairs (ttft, tpot, e2el), e.g. ttft:500,tpot:50: goodput counts "
                    "the requests per second that meet every one.")
  flags.DEFINE_bool("save_detailed", True, "Every request's figures in the JSON (lengths, TTFT, ITLs, E2E, finish "
                    "reason, error).")
  flags.DEFINE_integer("num_warmups", 2, "Requests sent (and not counted) before the first level of each run.")
  flags.DEFINE_integer("seed", 0, "Seed of the arrival times and of the random dataset.")
  flags.DEFINE_float("request_timeout_s", 600.0, "Longest a request may take; later it counts as failed.")
  flags.DEFINE_float("max_level_s", 1800.0, "Longest a load level may run; requests still open then are cancelled "
                     "and count as failed.")
  flags.DEFINE_string("output_dir", os.path.join(ROOT, "runs", "bench_serving"), "Where the JSON, markdown and "
                      "plots go (`docs` updates the committed ones).")
  flags.DEFINE_string("output_name", "bench_serving", "File name stem of the outputs.")
  flags.DEFINE_bool("progress", True, "Show a progress bar.")


class BenchError(ValueError):
  """A bad argument or an unusable server; the message names the flag."""


# ---- inputs ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
  """One request's prompt and, when the dataset sets it (random), its own max_tokens."""
  text: str
  max_tokens: int | None = None


def load_prompts(path: str, num: int, field: str | None = None) -> list[str]:
  """The first `num` prompts of a jsonl file: each record's `prompt`, else its `question` (GSM8K); `field`: only
  that one."""
  if num < 1:
    raise BenchError(f"--num_prompts must be >= 1, got {num}")
  if not path or not os.path.isfile(path):
    hint = (" (GSM8K is not in the repository: set RECGUIDE_GSM8K_DIR or pass --dataset_path)"
            if path == GSM8K_TEST else "")
    raise BenchError(f"--dataset_path: {path} is not a file{hint}")
  fields = (field,) if field else ("prompt", "question")
  prompts = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise BenchError(f"--dataset_path: {path}:{lineno} is not JSON: {e}") from None
      text = next((rec[k] for k in fields if k in rec), None) if isinstance(rec, dict) else None
      if not isinstance(text, str) or not text.strip():
        names = " or ".join(f"`{k}`" for k in fields)
        raise BenchError(f"--dataset_path: {path}:{lineno} has no non-empty string {names} field")
      prompts.append(text.strip())
      if len(prompts) == num:
        break
  if len(prompts) < num:
    raise BenchError(f"--num_prompts: {path} holds {len(prompts)} prompts, {num} asked for")
  return prompts


def load_tokenizer(path: str):
  """A `tokenizers.Tokenizer` from a checkpoint directory or a tokenizer.json (no jax needed)."""
  from tokenizers import Tokenizer
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise BenchError(f"--tokenizer: no tokenizer.json at {path}")
  return Tokenizer.from_file(file)


def _lengths(mean: int, ratio: float, num: int, rng: random.Random, least: int) -> list[int]:
  lo, hi = max(int(mean * (1 - ratio)), least), max(int(mean * (1 + ratio)), least)
  return [rng.randint(lo, hi) for _ in range(num)]


def random_prompts(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0) -> list[Prompt]:
  """vLLM's random dataset: prompts of tokens drawn uniformly from the vocabulary (special tokens left out), each
  `input_len` tokens (uniform in [len * (1 - r), len * (1 + r)]) after a shared prefix of `prefix_len` tokens, each
  asking for its own `output_len`. The ids are decoded to text and the text is re-encoded and cut until it is the
  asked length, so the server sees about that many tokens (its own tokenizer, chat template and BOS may add some)."""
  if num < 1:
    raise BenchError(f"--num_prompts must be >= 1, got {num}")
  if input_len < 1 or output_len < 1:
    raise BenchError(f"--random_input_len and --random_output_len must be >= 1, got {input_len}, {output_len}")
  if not 0 <= range_ratio < 1:
    raise BenchError(f"--random_range_ratio must be in [0, 1), got {range_ratio}")
  if prefix_len < 0:
    raise BenchError(f"--random_prefix_len must be >= 0, got {prefix_len}")
  special = set(tokenizer.get_added_tokens_decoder())
  vocab = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
  if not vocab:
    raise BenchError("--tokenizer: its vocabulary has no ordinary tokens")
  rng = random.Random(seed)

  def text_of(n: int) -> str:
    ids = [rng.choice(vocab) for _ in range(n)]
    for _ in range(4):  # decode/encode is not the identity: cut or top up until the text is n tokens
      text = tokenizer.decode(ids)
      ids = tokenizer.encode(text, add_special_tokens=False).ids
      if len(ids) == n:
        return text
      ids = ids[:n] + [rng.choice(vocab) for _ in range(n - len(ids))]
    return tokenizer.decode(ids)

  prefix = text_of(prefix_len) if prefix_len else ""
  ins = _lengths(input_len, range_ratio, num, rng, 1)
  outs = _lengths(output_len, range_ratio, num, rng, 1)
  return [Prompt(prefix + text_of(n), m) for n, m in zip(ins, outs)]


def check_loopback(base_url: str, allow_remote: bool = False) -> str:
  """The URL without a trailing slash (or /v1); raises unless its host is a loopback address or `allow_remote`."""
  parts = urllib.parse.urlsplit(base_url or "")
  if parts.scheme not in ("http", "https") or not parts.hostname:
    raise BenchError(f"--base_url must look like http://127.0.0.1:8000, got {base_url!r}")
  host = parts.hostname
  if host != "localhost" and not allow_remote:
    try:
      ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
      ok = False
    if not ok:
      raise BenchError(f"--base_url: {host} is not a loopback address (127.0.0.0/8, localhost, ::1); pass "
                       "--allow_remote to benchmark a server on another machine")
  return base_url.rstrip("/").removesuffix("/v1")


def parse_percentiles(values) -> tuple[float, ...]:
  try:
    out = tuple(float(v) for v in values)
  except ValueError:
    raise BenchError(f"--metric_percentiles must be numbers, got {list(values)}") from None
  if not out or not all(0 < p <= 100 for p in out):
    raise BenchError(f"--metric_percentiles must be in (0, 100], got {list(values)}")
  return out


def parse_percentile_metrics(values) -> list[str]:
  bad = [v for v in values if v not in METRICS]
  if bad or not values:
    raise BenchError(f"--percentile_metrics: {bad or values} not among {', '.join(METRICS)}")
  return list(values)


def parse_goodput(values) -> dict[str, float]:
  """`ttft:500,tpot:50` (spaces also separate, as vLLM's `--goodput ttft:500 tpot:50`) -> {metric: ms}."""
  out = {}
  for item in " ".join(values).replace(",", " ").split():
    key, sep, value = item.partition(":")
    if not sep or key not in GOODPUT_METRICS:
      raise BenchError(f"--goodput: {item!r} is not KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}")
    try:
      ms = float(value)
    except ValueError:
      raise BenchError(f"--goodput: {item!r}: {value!r} is not a number of milliseconds") from None
    if not ms > 0:
      raise BenchError(f"--goodput: {item!r}: the SLO must be > 0 ms")
    out[key] = ms
  return out


def parse_levels(sweep_over: str, values) -> list[float]:
  out = []
  for v in values:
    try:
      x = float(v)
    except ValueError:
      raise BenchError(f"--sweep: {v!r} is not a number") from None
    if sweep_over == "concurrency":
      if x == math.inf or x < 1 or x != int(x):
        raise BenchError(f"--sweep: a concurrency must be a positive integer, got {v!r}")
    elif not x > 0:
      raise BenchError(f"--sweep: a request rate must be > 0 (or inf), got {v!r}")
    out.append(x)
  if not out:
    raise BenchError("--sweep: no load levels")
  return out


@dataclasses.dataclass(frozen=True)
class Level:
  """One load level: at most `concurrency` requests in flight (0: no cap), arriving at `request_rate` req/s
  (inf: all at once) spaced by `arrival` ("poisson" with gamma shape `burstiness`, or "fixed"). `sweep_over`
  "single": the one level of a run without --sweep."""
  sweep_over: str
  load: float
  concurrency: int
  request_rate: float
  arrival: str = "poisson"
  burstiness: float = 1.0

  @property
  def name(self) -> str:
    if self.sweep_over == "concurrency":
      return f"C={int(self.load)}"
    rate = "rate=inf" if self.request_rate == math.inf else f"rate={self.request_rate:g}"
    return rate + (f", C<={self.concurrency}" if self.sweep_over == "single" and self.concurrency else "")


def make_levels(sweep_over: str | None, loads: list[float], *, request_rate: float = math.inf,
                max_concurrency: int = 0, arrival: str = "poisson", burstiness: float = 1.0) -> list[Level]:
  """The levels of --sweep (`sweep_over` None or no loads: vLLM's one level at request_rate under max_concurrency)."""
  if not burstiness > 0:
    raise BenchError(f"--burstiness must be > 0, got {burstiness}")
  if max_concurrency < 0:
    raise BenchError(f"--max_concurrency must be >= 0, got {max_concurrency}")
  if not request_rate > 0:
    raise BenchError(f"--request_rate must be > 0 (or inf), got {request_rate}")
  if sweep_over is None or not loads:
    return [Level("single", request_rate, max_concurrency, request_rate, arrival, burstiness)]
  if sweep_over == "concurrency":
    return [Level(sweep_over, x, int(x), request_rate, arrival, burstiness) for x in loads]
  return [Level(sweep_over, x, max_concurrency, x, arrival, burstiness) for x in loads]


def arrival_offsets(level: Level, n: int, rng: random.Random) -> list[float]:
  """Send times (s from the level's start) of n requests."""
  if level.request_rate == math.inf:
    return [0.0] * n
  t, out = 0.0, []
  for _ in range(n):
    out.append(t)
    if level.arrival == "fixed":
      t += 1.0 / level.request_rate
    else:  # gamma inter-arrivals with mean 1 / rate; shape 1 is exponential (a Poisson process)
      t += rng.gammavariate(level.burstiness, 1.0 / (level.request_rate * level.burstiness))
  return out


# ---- one request -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
  ok: bool
  error: str | None = None
  start_s: float = 0.0  # from the level's start
  ttft_s: float | None = None
  e2e_s: float | None = None
  itl_s: list[float] = dataclasses.field(default_factory=list)
  prompt_tokens: int = 0
  output_tokens: int = 0
  finish_reason: str | None = None
  speculation: dict | None = None


async def send(client, base: str, endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float,
               ignore_eos: bool, timeout_s: float, t0: float) -> Result:
  """One streamed request, timed from before it is sent."""
  import httpx
  body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
          "stream_options": {"include_usage": True}}
  if ignore_eos:
    body["ignore_eos"] = True
  if endpoint == "chat":
    path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
  else:
    path, body["prompt"] = "/v1/completions", prompt
  start = time.perf_counter()
  res = Result(ok=False, start_s=start - t0)
  last = None
  try:
    async with asyncio.timeout(timeout_s):
      async with client.stream("POST", base + path, json=body) as r:
        if r.status_code != 200:
          res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
          return res
        async for line in r.aiter_lines():
          if not line.startswith("data: "):
            continue
          data = line[len("data: "):]
          if data == "[DONE]":
            break
          now = time.perf_counter()
          ev = json.loads(data)
          if "error" in ev:
            res.error = str(ev["error"].get("message", ev["error"]))[:200]
            return res
          for choice in ev.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
            if text:
              if last is None:
                res.ttft_s = now - start
              else:
                res.itl_s.append(now - last)
              last = now
            if choice.get("finish_reason"):
              res.finish_reason = choice["finish_reason"]
          if ev.get("speculation") is not None:  # the final chunk and the usage chunk carry it
            res.speculation = ev["speculation"]
          if ev.get("usage"):
            res.prompt_tokens = ev["usage"]["prompt_tokens"]
            res.output_tokens = ev["usage"]["completion_tokens"]
  except TimeoutError:
    res.error = f"no answer within --request_timeout_s={timeout_s:g}"
    return res
  except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
    res.error = f"{type(e).__name__}: {e}"[:200]
    return res
  res.e2e_s = time.perf_counter() - start
  res.ok = res.finish_reason is not None and res.ttft_s is not None
  if not res.ok:
    res.error = "the stream ended without text or a finish reason"
  return res


# ---- one load level --------------------------------------------------------------------------------------------------
async def run_level(base: str, model: str, prompts: list[str | Prompt], level: Level, *, endpoint: str = "chat",
                    max_tokens: int = 128, temperature: float = 0.0, ignore_eos: bool = False,
                    request_timeout_s: float = 600.0, max_level_s: float = 1800.0, seed: int = 0,
                    progress=None) -> tuple[list[Result], float]:
  """Sends every prompt once at this level's load; returns the results (in prompt order) and the wall time from
  the first send to the last answer."""
  import httpx
  offsets = arrival_offsets(level, len(prompts), random.Random(seed))
  cap = level.concurrency or len(prompts)
  gate = asyncio.Semaphore(cap)
  limits = httpx.Limits(max_connections=cap + 4, max_keepalive_connections=cap + 4)
  results: list[Result | None] = [None] * len(prompts)
  async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits,
                               headers=auth_headers()) as client:
    t0 = time.perf_counter()

    async def one(i: int):
      delay = offsets[i] - (time.perf_counter() - t0)
      if delay > 0:
        await asyncio.sleep(delay)
      async with gate:  # closed loop: a client sends its next request when its previous one ended
        p = prompts[i] if isinstance(prompts[i], Prompt) else Prompt(prompts[i])
        results[i] = await send(client, base, endpoint, model, p.text, p.max_tokens or max_tokens, temperature,
                                ignore_eos, request_timeout_s, t0)
      if progress is not None:
        progress.update(1)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    done, pending = await asyncio.wait(tasks, timeout=max_level_s)
    for t in pending:
      t.cancel()
    if pending:
      await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
  out = [r if r is not None else Result(ok=False, error=f"cancelled after --max_level_s={max_level_s:g}")
         for r in results]
  return out, wall


# ---- figures ---------------------------------------------------------------------------------------------------------
def percentiles(values, scale: float = 1.0, points=PERCENTILES) -> dict:
  """mean and the `points` percentiles (numpy's linear interpolation), scaled; None when there are no values."""
  import numpy as np
  if len(values) == 0:
    return {"mean": None, **{_pkey(p): None for p in points}}
  a = np.asarray(values, np.float64) * scale
  return {"mean": float(a.mean()), **{_pkey(p): float(np.percentile(a, p)) for p in points}}


def _pkey(p: float) -> str:
  return f"p{p:g}"


def _tpot_s(r: Result) -> float | None:
  if r.output_tokens > 1:
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
  return None


def meets(r: Result, slos_ms: dict[str, float]) -> bool:
  """Whether a finished request meets every SLO (vLLM's goodput: TPOT of a one-token output is 0)."""
  got = {"ttft": r.ttft_s, "tpot": _tpot_s(r) or 0.0, "e2el": r.e2e_s}
  return all(got[k] * 1e3 <= ms for k, ms in slos_ms.items())


def detail(r: Result) -> dict:
  """One request's figures for the JSON (vLLM's --save-detailed)."""
  ms = lambda x: None if x is None else x * 1e3  # noqa: E731
  tpot = _tpot_s(r) if r.ok else None
  return {"ok": r.ok, "start_s": r.start_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
          "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(tpot), "e2e_ms": ms(r.e2e_s), "itl_ms": [x * 1e3 for x in r.itl_s],
          "finish_reason": r.finish_reason, "error": r.error}


def summarize(results: list[Result], wall_s: float, points=PERCENTILES, goodput: dict[str, float] | None = None,
              save_detailed: bool = False) -> dict:
  ok = [r for r in results if r.ok]
  out_tokens = sum(r.output_tokens for r in ok)
  in_tokens = sum(r.prompt_tokens for r in ok)
  tpot = [t for t in map(_tpot_s, ok) if t is not None]
  speed = [r.output_tokens / r.e2e_s for r in ok if r.e2e_s]
  lengths, blocks, hits, misses, forwards = [], {}, 0, 0, 0
  for r in ok:
    spec = r.speculation or {}
    lengths += spec.get("accepted_lengths") or []
    for b in spec.get("block_sizes") or []:
      blocks[int(b)] = blocks.get(int(b), 0) + 1
    for k, v in (spec.get("overlap") or {}).items():
      if k.endswith("_hit"):
        hits += v
      else:
        misses += v
    forwards += spec.get("decode_forwards") or 0
  rounds = len(lengths)
  hist: dict[str, int] = {}
  for a in sorted(lengths):
    hist[str(a)] = hist.get(str(a), 0) + 1
  rate = (lambda x: x / wall_s if wall_s > 0 else 0.0)  # noqa: E731
  out = {
      "completed": len(ok), "failed": len(results) - len(ok),
      "errors": sorted({r.error for r in results if not r.ok and r.error})[:5],
      "duration_s": wall_s,
      "prompt_tokens": in_tokens, "output_tokens": out_tokens,
      "request_throughput": rate(len(ok)),
      "output_throughput": rate(out_tokens),
      "total_token_throughput": rate(in_tokens + out_tokens),
      "per_request_output_tok_s": percentiles(speed, points=points),
      "ttft_ms": percentiles([r.ttft_s for r in ok], 1e3, points),
      "tpot_ms": percentiles(tpot, 1e3, points),
      "itl_ms": percentiles([x for r in ok for x in r.itl_s], 1e3, points),
      "e2e_ms": percentiles([r.e2e_s for r in ok], 1e3, points),
      "rounds": rounds,
      "mean_accepted_length": sum(lengths) / rounds if rounds else None,
      "tokens_per_forward": sum(lengths) / forwards if forwards else None,
      "accepted_length_hist": hist,
      "block_size_shares": {str(b): n / rounds for b, n in sorted(blocks.items())} if rounds else {},
      "overlap": {"hits": hits, "misses": misses},
  }
  if goodput:
    good = sum(meets(r, goodput) for r in ok)
    out["goodput"] = {"slo_ms": dict(goodput), "good_requests": good, "request_goodput": rate(good)}
  if save_detailed:
    out["requests"] = [detail(r) for r in results]
  return out


def scrape_metrics(client, base: str) -> dict | None:
  """The server's speculative-decoding counters from /metrics (None when it has none or cannot be read)."""
  try:
    from prometheus_client.parser import text_string_to_metric_families
    r = client.get(base + "/metrics", timeout=30)
    if r.status_code != 200:
      return None
    out = {"block_size_rounds": {}}
    for fam in text_string_to_metric_families(r.text):
      for s in fam.samples:
        name = s.name.removeprefix("recguide:")
        if name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                    "spec_decode_num_accepted_tokens_total", "overlap_hits_total", "overlap_misses_total"):
          out[name.removesuffix("_total")] = out.get(name.removesuffix("_total"), 0) + s.value
        elif name == "block_size_rounds_total":
          out["block_size_rounds"][s.labels["block_size"]] = s.value
    return out if "spec_decode_num_drafts" in out else None
  except Exception:  # not our server, or its metrics are not vLLM-shaped: the client-side figures still stand
    return None


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
  if before is None or after is None:
    return None
  d = {k: after[k] - before.get(k, 0) for k in after if k != "block_size_rounds"}
  blocks = {b: after["block_size_rounds"][b] - before["block_size_rounds"].get(b, 0)
            for b in after["block_size_rounds"]}
  d["block_size_rounds"] = {b: n for b, n in blocks.items() if n}
  drafts = d.get("spec_decode_num_drafts", 0)
  # vLLM's convention: 1 + accepted / drafts (the bonus token included), over the draft rounds only
  d["mean_acceptance_length"] = 1 + d.get("spec_decode_num_accepted_tokens", 0) / drafts if drafts else None
  tokens = d.get("spec_decode_num_draft_tokens", 0)
  d["draft_acceptance_rate"] = d.get("spec_decode_num_accepted_tokens", 0) / tokens if tokens else None
  return d


# ---- a run: every level against one server ---------------------------------------------------------------------------
def auth_headers() -> dict[str, str]:
  """`Authorization: Bearer $OPENAI_API_KEY` when it is set (a server started with --api-key), as vLLM's bench."""
  key = os.environ.get("OPENAI_API_KEY")
  return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base: str) -> str:
  import httpx
  try:
    r = httpx.get(base + "/v1/models", timeout=30, headers=auth_headers())
    return r.json()["data"][0]["id"]
  except Exception as e:
    raise BenchError(f"--base_url: cannot read {base}/v1/models: {type(e).__name__}: {e}") from None


def run_benchmark(base: str, prompts: list[str | Prompt], levels: list[Level], *, label: str,
                  model: str | None = None, endpoint: str = "chat", max_tokens: int = 128, temperature: float = 0.0,
                  ignore_eos: bool = False, num_warmups: int = 2, request_timeout_s: float = 600.0,
                  max_level_s: float = 1800.0, seed: int = 0, progress: bool = False, extra: dict | None = None,
                  allow_remote: bool = False, percentiles_at=PERCENTILES, goodput: dict[str, float] | None = None,
                  save_detailed: bool = True) -> dict:
  """Every level in turn against the server at `base`; the run's JSON record."""
  import httpx
  base = check_loopback(base, allow_remote)
  model = model or served_model(base)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(prompts) * len(levels), desc=f"{label}", unit="req", dynamic_ncols=True)
  kw = dict(endpoint=endpoint, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
            request_timeout_s=request_timeout_s, max_level_s=max_level_s)
  if num_warmups > 0:  # compile caches, connection setup: not counted
    warm = Level("concurrency", num_warmups, num_warmups, math.inf)
    asyncio.run(run_level(base, model, (prompts * num_warmups)[:num_warmups], warm, **kw))
  out = []
  load_start = _load_avg()
  with httpx.Client(headers=auth_headers()) as scraper:
    for i, level in enumerate(levels):
      before = scrape_metrics(scraper, base)
      results, wall = asyncio.run(run_level(base, model, prompts, level, seed=seed + i, progress=bar, **kw))
      after = scrape_metrics(scraper, base)
      row = {"name": level.name, "sweep_over": level.sweep_over, "load": _num(level.load),
             "concurrency": level.concurrency or None, "request_rate": _num(level.request_rate),
             "arrival": level.arrival if level.request_rate != math.inf else None,
             **summarize(results, wall, percentiles_at, goodput, save_detailed),
             "server_metrics": metrics_delta(before, after)}
      out.append(row)
      if bar is not None:
        bar.set_postfix_str(f"{level.name}: {row['output_throughput']:.0f} tok/s")
  if bar is not None:
    bar.close()
  # a shared machine's other work slows the server down: the 1-minute load average says how busy it was
  return {"label": label, "model": model, "base_url": base, **(extra or {}),
          "host_load_avg_1m": {"start": load_start, "end": _load_avg()}, "levels": out}


def _load_avg() -> float | None:
  try:
    return round(os.getloadavg()[0], 2)
  except (OSError, AttributeError):
    return None


def _num(x: float):
  """JSON has no infinity: an infinite rate is written as the string "inf"."""
  if x == math.inf:
    return "inf"
  return int(x) if float(x).is_integer() else x


# ---- outputs ---------------------------------------------------------------------------------------------------------
def _fmt(x, digits=1):
  return "-" if x is None else f"{x:.{digits}f}"


def _ppp(d: dict, digits=1, points=PERCENTILES) -> str:
  return " / ".join(_fmt(d.get(_pkey(p)), digits) for p in points)


_TITLES = {"ttft": ("TTFT", 1), "tpot": ("TPOT", 2), "itl": ("ITL", 2), "e2el": ("E2E", 0)}


def markdown(report: dict, plots: dict[str, str] | None = None) -> str:
  cfg = report["config"]
  points = tuple(cfg.get("metric_percentiles") or PERCENTILES)
  shown = cfg.get("percentile_metrics") or list(METRICS)
  goodput = cfg.get("goodput") or {}
  load = (f"load swept over {cfg['sweep_over']} ({', '.join(str(x) for x in cfg['sweep'])})" if cfg.get("sweep")
          else f"request rate {cfg.get('request_rate', 'inf')}, max concurrency {cfg.get('max_concurrency') or '-'}")
  dataset = cfg["dataset"]
  if cfg.get("dataset_name") == "random":
    dataset = (f"random ({cfg['random_input_len']} input / {cfg['random_output_len']} output tokens, range ratio "
               f"{cfg['random_range_ratio']:g}, shared prefix {cfg['random_prefix_len']})")
  slos = ", ".join(f"{k} <= {v:g} ms" for k, v in goodput.items())
  head = ["run", "load", "ok", "req/s", "out tok/s"] + (["goodput req/s"] if goodput else []) + ["per-req tok/s"]
  head += [_TITLES[m][0] for m in shown] + ["tau", "server tau", "B shares"]
  lines = ["# Serving benchmark (launch/bench_serving.py)", "",
           f"`{cfg['command']}`", "",
           f"{cfg['num_prompts']} prompts per level from `{dataset}` via `/v1/"
           f"{'chat/completions' if cfg['endpoint'] == 'chat' else 'completions'}`, max_tokens "
           f"{cfg['max_tokens'] if cfg.get('dataset_name') != 'random' else cfg['random_output_len']}, "
           f"temperature {cfg['temperature']:g}{', ignore_eos' if cfg['ignore_eos'] else ''}; {load}; streamed, "
           f"timed on the client. {report.get('machine', '')}", "",
           f"Latencies in ms as {' / '.join(_pkey(p) for p in points)}. per-req tok/s: mean over requests of output "
           "tokens / e2e. "
           + (f"goodput: requests per second meeting every SLO ({slos}). " if goodput else "")
           + "tau: mean tokens per decode round from the responses' `speculation` (the bonus token included); server "
           "tau: 1 + accepted / drafts from /metrics over the level (draft rounds only). B shares: decode rounds by "
           "block size (1: plain AR rounds).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for run in report["runs"]:
    for lv in run["levels"]:
      shares = ", ".join(f"{b}: {100 * s:.0f}%" for b, s in lv["block_size_shares"].items()) or "-"
      sm = lv.get("server_metrics") or {}
      cells = [run["label"], lv["name"], f"{lv['completed']}/{lv['completed'] + lv['failed']}",
               f"{lv['request_throughput']:.2f}", f"{lv['output_throughput']:.1f}"]
      if goodput:
        cells.append(_fmt((lv.get("goodput") or {}).get("request_goodput"), 2))
      cells.append(_fmt(lv["per_request_output_tok_s"]["mean"]))
      cells += [_ppp(lv[METRICS[m]], _TITLES[m][1], points) for m in shown]
      cells += [_fmt(lv["mean_accepted_length"], 2), _fmt(sm.get("mean_acceptance_length"), 2), shares]
      lines.append("| " + " | ".join(cells) + " |")
  loads = [f"{run['label']} {run['host_load_avg_1m']['start']} -> {run['host_load_avg_1m']['end']}"
           for run in report["runs"] if run.get("host_load_avg_1m", {}).get("start") is not None]
  if loads:
    lines += ["", f"The host's 1-minute load average (start -> end of each run; {os.cpu_count()} cores): "
              + "; ".join(loads) + ". Other work on a shared host slows the server: compare runs made together."]
  if plots:
    lines += [""] + [f"![{k}]({os.path.basename(v)})" for k, v in plots.items()]
  return "\n".join(lines) + "\n"


def plot(report: dict, output_dir: str, name: str) -> dict[str, str]:
  """Writes the PNGs; returns {title: path}."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from recguide_jax.benchmarks.report import plot_frontier
  runs = report["runs"]
  paths = {}
  sweep_over = report["config"]["sweep_over"]

  # 1. throughput vs per-request speed across load (the paper's Figure 5)
  series = {run["label"]: [(lv["per_request_output_tok_s"]["mean"], lv["output_throughput"], lv["name"])
                           for lv in run["levels"] if lv["per_request_output_tok_s"]["mean"] is not None]
            for run in runs}
  paths["throughput vs per-request speed"] = plot_frontier(
      series, os.path.join(output_dir, f"{name}_frontier.png"), "per-request output speed (tokens/s, mean over "
      "requests)", "total output throughput (tokens/s)", "Throughput vs per-request speed across load")

  # 2. accepted length per round, pooled over the levels of each run
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  hists = []
  for run in runs:
    pooled: dict[int, int] = {}
    for lv in run["levels"]:
      for k, v in lv["accepted_length_hist"].items():
        pooled[int(k)] = pooled.get(int(k), 0) + v
    hists.append((run["label"], pooled))
  top = max([max(h) for _, h in hists if h] or [1])
  width = 0.8 / max(len(hists), 1)
  for i, (label, h) in enumerate(hists):
    total = sum(h.values()) or 1
    xs = list(range(1, top + 1))
    ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [h.get(x, 0) / total for x in xs], width=width, label=label)
  ax.set_xlabel("tokens accepted per decode round (bonus token included)")
  ax.set_ylabel("share of rounds")
  ax.set_title("Accepted length per round (all load levels)")
  ax.grid(alpha=0.3, axis="y")
  ax.legend()
  fig.tight_layout()
  paths["accepted length histogram"] = os.path.join(output_dir, f"{name}_accepted_hist.png")
  fig.savefig(paths["accepted length histogram"], dpi=110)
  plt.close(fig)

  # 3. TTFT and TPOT against load (a sweep only: one level has no curve)
  if sweep_over == "single" or not report["config"].get("sweep"):
    return paths
  points = tuple(report["config"].get("metric_percentiles") or PERCENTILES)
  lo, hi = _pkey(min(points)), _pkey(max(points))
  fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0))
  for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
    for j, run in enumerate(runs):
      loads = [lv["load"] if lv["load"] != "inf" else float("nan") for lv in run["levels"]]
      color = f"C{j}"
      ax.plot(loads, [lv[key][lo] for lv in run["levels"]], marker="o", color=color, label=f"{run['label']} {lo}")
      if hi != lo:
        ax.plot(loads, [lv[key][hi] for lv in run["levels"]], marker="^", ls="--", color=color,
                label=f"{run['label']} {hi}")
    ax.set_xscale("log", base=2)
    ticks = sorted({lv["load"] for run in runs for lv in run["levels"] if lv["load"] != "inf"})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(sweep_over.replace("_", " ") + (" (req/s)" if sweep_over == "request_rate" else ""))
    ax.set_ylabel(title)
    ax.set_title(f"{title.split()[0]} vs load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  paths["TTFT and TPOT vs load"] = os.path.join(output_dir, f"{name}_latency.png")
  fig.savefig(paths["TTFT and TPOT vs load"], dpi=110)
  plt.close(fig)
  return paths


def write_outputs(report: dict, output_dir: str, name: str, plots: bool = True) -> dict[str, str]:
  os.makedirs(output_dir, exist_ok=True)
  pngs = plot(report, output_dir, name) if plots else {}
  report = {**report, "plots": [os.path.basename(p) for p in pngs.values()]}
  paths = {"json": os.path.join(output_dir, f"{name}.json"), "md": os.path.join(output_dir, f"{name}.md")}
  with open(paths["json"], "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")
  with open(paths["md"], "w") as f:
    f.write(markdown(report, pngs))
  return {**paths, **{f"png:{k}": v for k, v in pngs.items()}}


# ---- --launch --------------------------------------------------------------------------------------------------------
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LaunchedServer:
  """launch/serve.py on a free loopback port, its output in a log file; a context manager that stops it."""

  def __init__(self, policy: str, log_path: str, checkpoint: str | None = None, serve_args=(),
               timeout_s: float = 1200.0):
    self.port = free_port()
    self.base = f"http://127.0.0.1:{self.port}"
    self.log_path = log_path
    cmd = [sys.executable, SERVE, f"--policy={policy}", "--host=127.0.0.1", f"--port={self.port}", *serve_args]
    if checkpoint:
      cmd.append(f"--model={checkpoint}")
    self.cmd = cmd
    self.timeout_s = timeout_s
    self.proc = None

  def __enter__(self) -> "LaunchedServer":
    import httpx
    os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
    self._log = open(self.log_path, "w")
    self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + self.timeout_s
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        self._log.close()
        tail = open(self.log_path).read()[-2000:]
        raise BenchError(f"--launch: serve.py exited with {self.proc.returncode} while starting:\n{tail}")
      try:
        if httpx.get(self.base + "/health", timeout=2).status_code == 200:
          return self
      except httpx.TransportError:
        pass
      time.sleep(1.0)
    self.__exit__(None, None, None)
    raise BenchError(f"--launch_timeout_s: serve.py was not healthy after {self.timeout_s:g} s (log: {self.log_path})")

  def __exit__(self, *exc) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)  # graceful: drains, exits 0
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    if not self._log.closed:
      self._log.close()


def machine() -> str:
  cpus = os.cpu_count()
  return f"Measured on {cpus} CPU cores (jax CPU backend unless the server has an accelerator)."


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}")
  f = FLAGS
  import logging as std_logging
  for noisy in ("httpx", "httpcore", "matplotlib"):  # one INFO line per request otherwise
    std_logging.getLogger(noisy).setLevel(std_logging.WARNING)
  try:
    if bool(f.base_url) == bool(f.launch):
      raise BenchError("--base_url / --launch: give exactly one (a running server's URL, or --launch to start one)")
    for name in ("max_tokens", "request_timeout_s", "max_level_s"):
      if not f[name].value > 0:
        raise BenchError(f"--{name} must be > 0, got {f[name].value}")
    if f.num_warmups < 0:
      raise BenchError(f"--num_warmups must be >= 0, got {f.num_warmups}")
    if not 0 <= f.temperature <= 100:
      raise BenchError(f"--temperature must be in [0, 100], got {f.temperature}")
    prompts = dataset_prompts(f)
    loads = parse_levels(f.sweep_over, f.sweep) if f.sweep else []
    levels = make_levels(f.sweep_over if loads else None, loads, request_rate=f.request_rate,
                         max_concurrency=f.max_concurrency, arrival=f.arrival, burstiness=f.burstiness)
    points = parse_percentiles(f.metric_percentiles)
    shown = parse_percentile_metrics(f.percentile_metrics)
    goodput = parse_goodput(f.goodput)
    if f.launch and not f.policy:
      raise BenchError("--policy: at least one policy to --launch")
    if f.base_url:
      check_loopback(f.base_url, f.allow_remote)
  except BenchError as e:
    sys.exit(f"error: {e}")

  kw = dict(model=f.served_model_name, endpoint=f.endpoint, max_tokens=f.max_tokens, temperature=f.temperature,
            ignore_eos=f.ignore_eos, num_warmups=f.num_warmups, request_timeout_s=f.request_timeout_s,
            max_level_s=f.max_level_s, seed=f.seed, progress=f.progress, percentiles_at=points, goodput=goodput,
            save_detailed=f.save_detailed)
  path = f.dataset_path or (GSM8K_TEST if f.dataset_name == "gsm8k" else None)
  # the default data lives beside the repository (shared/data/gsm8k), recorded relative to the repository root
  dataset = "random" if f.dataset_name == "random" else (os.path.relpath(path, ROOT) if path == GSM8K_TEST
                                                          else path)
  report = {
      "benchmark": "bench_serving", "version": 2,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": machine(),
      "config": {"command": "python launch/bench_serving.py " + " ".join(argv_for_record()),
                 "dataset_name": f.dataset_name, "dataset": dataset, "endpoint": f.endpoint,
                 "num_prompts": f.num_prompts, "max_tokens": f.max_tokens, "temperature": f.temperature,
                 "ignore_eos": f.ignore_eos, "random_input_len": f.random_input_len,
                 "random_output_len": f.random_output_len, "random_range_ratio": f.random_range_ratio,
                 "random_prefix_len": f.random_prefix_len,
                 "sweep_over": f.sweep_over if loads else None, "sweep": [_num(x) for x in loads],
                 "arrival": f.arrival, "burstiness": f.burstiness, "request_rate": _num(f.request_rate),
                 "max_concurrency": f.max_concurrency, "percentile_metrics": shown,
                 "metric_percentiles": list(points), "goodput": goodput, "seed": f.seed,
                 "num_warmups": f.num_warmups},
      "runs": [],
  }
  failed = []
  if f.launch:
    for policy in f.policy:
      log_path = os.path.join(f.serve_log_dir, f"{f.output_name}_serve_{policy}.log")
      print(f"starting serve.py --policy={policy} (log: {log_path})", flush=True)
      try:
        with LaunchedServer(policy, log_path, f.model, f.serve_args, f.launch_timeout_s) as server:
          report["runs"].append(run_benchmark(server.base, prompts, levels, label=f.label or policy,
                                              extra={"policy": policy, "serve_args": list(f.serve_args)}, **kw))
      except BenchError as e:  # the other policies still run
        print(f"error: {e}", file=sys.stderr, flush=True)
        failed.append(policy)
        continue
      write_outputs(report, f.output_dir, f.output_name)  # after every run: a later failure loses nothing
  else:
    try:
      run = run_benchmark(f.base_url, prompts, levels, label=f.label or "", allow_remote=f.allow_remote, **kw)
    except BenchError as e:
      sys.exit(f"error: {e}")
    run["label"] = run["label"] or run["model"]
    report["runs"].append(run)
  if not report["runs"]:
    sys.exit("error: no run finished")
  paths = write_outputs(report, f.output_dir, f.output_name)
  print(markdown(report), flush=True)
  for kind, path in paths.items():
    print(f"wrote {kind}: {path}")
  if failed:
    sys.exit(f"error: --policy {','.join(failed)}: the server did not start (see the logs in {f.serve_log_dir})")


def dataset_prompts(f) -> list[str | Prompt]:
  """--num_prompts prompts of --dataset_name."""
  if f.dataset_name == "random":
    path = f.tokenizer or f.model or os.environ.get("RECGUIDE_CHECKPOINT") or BUNDLED
    return random_prompts(load_tokenizer(path), f.num_prompts, f.random_input_len, f.random_output_len,
                          f.random_range_ratio, f.random_prefix_len, f.seed)
  if f.dataset_name == "custom":
    if not f.dataset_path:
      raise BenchError("--dataset_path: --dataset_name custom reads a jsonl with a `prompt` field; give its path")
    return load_prompts(f.dataset_path, f.num_prompts, "prompt")
  return load_prompts(f.dataset_path or GSM8K_TEST, f.num_prompts)


def argv_for_record() -> list[str]:
  """The flags as given on the command line (what the report says it ran)."""
  return [a for a in sys.argv[1:]]


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
