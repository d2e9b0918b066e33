"""Hostile-input fuzzing of the OpenAI-compatible server: counts of answers by status class, and whether a valid
stream that runs all the while comes through with the tokens it has when it runs alone.

  python launch/fuzz_server.py                                  # starts launch/serve.py (bundled model, linear)
  python launch/fuzz_server.py --policy=linear,recguide --output_dir=docs
  python launch/fuzz_server.py --base_url=http://127.0.0.1:8000 --count=300

Without --base_url it starts `launch/serve.py` on a free loopback port for each policy in --policy, and stops it after.
With --base_url it targets a running server, which must be on a loopback address (this is an attack tool: it never
sends anywhere else). It sends --count generated hostile bodies (both endpoints, about --stream_fraction of them
streaming, --concurrency at a time, within --time_limit_s), of these kinds:

  field         a valid body with 1-3 fields set to hostile values (huge, negative, wrong type, NaN, ...)
  edge          a valid body with 1-4 fields at the edges of their ranges (top_k = vocabulary size, seed -2^63,
                temperature 1e-40 or 100, 16 stop strings, ...): served, next to the valid stream in its batch
  unknown       extra fields, some with unprintable or huge names
  surrogate     a lone surrogate in some string (value, field name, model, stop, role...), escaped or raw
  utf8          invalid UTF-8 bytes spliced into a string (incl. the encoded surrogate \\xed\\xa0\\x80)
  deep          nesting 40-20,000 levels deep
  number        4,000-10,000-digit integers, 1e999, NaN / Infinity literals, very long decimals
  syntax        truncated or trailing garbage JSON, empty bodies, non-object top levels, random bytes
  content_type  a valid body under a non-JSON or non-UTF-8 Content-Type
  prompt        token-id prompts out of range, negative, boolean, nested, too long; empty strings
  messages      empty, non-object, wrong roles / content parts / names
  oversize      a body past the server's size limit (a handful)

Meanwhile one valid greedy stream (--valid_max_tokens tokens, ignore_eos) is restarted back to back; each run must
equal the reference taken before the fuzzing (text, token strings and count, finish reason). After the fuzzing the
server must be idle with no KV page in use. Writes `hostile_fuzz.json` and `hostile_fuzz.md` into --output_dir.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

from absl import app, flags

_BASE_URL = flags.DEFINE_string("base_url", None, "Base URL of a running server on a loopback address (e.g. "
                           "http://127.0.0.1:8000). Default: start launch/serve.py for each --policy.")
_MODEL = flags.DEFINE_string("model", None, "Checkpoint for the started server (default: the bundled one).")
_POLICY = flags.DEFINE_list("policy", ["recguide"], "Policies to start the server with, one run each (default "
                            "serve.py's; ignored with --base_url).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Block size of the started server.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 4, "--max_num_seqs of the started server.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "max_model_len of the started server.")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", "runs/fuzz/xla", "XLA compilation cache of the "
                                         "started server ('' disables it).")
_STARTUP_TIMEOUT = flags.DEFINE_float("startup_timeout_s", 900, "Longest wait for the started server to be ready.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 0, "Vocabulary size of the target's model, for boundary values "
                                   "(0: read from the checkpoint's config.json).")
_COUNT = flags.DEFINE_integer("count", 1200, "Hostile bodies per run.")
_STREAM_FRACTION = flags.DEFINE_float("stream_fraction", 0.4, "Fraction of the bodies that ask for a stream.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 12, "Hostile requests in flight at a time.")
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 900, "Stop sending new bodies after this long (per run).")
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout_s", 180, "Per-request timeout (a timeout is counted).")
_VALID_MAX_TOKENS = flags.DEFINE_integer("valid_max_tokens", 300, "Tokens of the valid stream that runs alongside.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the body generator.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/fuzz", "Where hostile_fuzz.json / .md go (docs to publish).")
_LOG_DIR = flags.DEFINE_string("server_log_dir", "runs/fuzz", "Where the started servers' logs go.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VALID_PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                "May. How many clips did Natalia sell altogether in April and May?\nAnswer:")
KINDS = ("field", "edge", "unknown", "surrogate", "utf8", "deep", "number", "syntax", "content_type", "prompt",
         "messages", "oversize")
# relative frequencies; oversize bodies are megabytes each, so only a handful
KIND_WEIGHTS = (22, 12, 6, 10, 8, 6, 8, 8, 6, 9, 9, 0.5)


@dataclasses.dataclass
class Case:
  """One generated request."""
  kind: str
  path: str
  body: bytes
  headers: dict
  stream: bool


# ---- the generator --------------------------------------------------------------------------------------------------
def hostile_values(vocab_size: int, max_model_len: int) -> list:
  """Values that are wrong for most fields: out of every array type's range, of the wrong type, not finite..."""
  ints = [0, -1, 1, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64,
          10**30, -10**30, vocab_size, vocab_size + 1, max_model_len, max_model_len + 1, 10**19]
  floats = [-0.0, 1e-40, 1e-320, 3.5e38, 1e308, -1e308, 0.5, 2.0, 100.5, -1.5, float("nan"), float("inf"),
            float("-inf")]
  strings = ["", "\udcff", "a\ud800b", "\x00", "NaN", "1", "true", "x" * 5000, "\u202e\ufeff", "\U0001F600",
             "<s></s><mask>", "{{ 7*7 }}"]
  others = [True, False, None, [], [1], [None], ["a"] * 40, [[[]]], {}, {"a": 1}, {"\udcff": 1}, [2**63],
            list(range(300))]
  return ints + floats + strings + others


def edge_values(vocab_size: int) -> dict[str, list]:
  """Values at the edges of what each field accepts (all valid)."""
  return {"top_k": [vocab_size, 1, -1, 0], "seed": [-2**63, 2**63 - 1, 2**32, -1, 0],
          "temperature": [1e-40, 100, 0, 2.0], "top_p": [1e-300, 1.0, 0.5], "logprobs": [0, 5, 20],
          "stop": [["s"] * 16, "x" * 256, "\U0001F600"], "stop_token_ids": [[vocab_size - 1], list(range(256))],
          "ignore_eos": [True, False]}


def _valid_body(rng: random.Random, chat: bool, stream: bool) -> dict:
  body = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0, 0.7, 1.0])}
  if chat:
    body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "What is 2 + 2?", "Tell me a story"])}]
  else:
    body["prompt"] = rng.choice(["Hello", "Question: 3 + 4 =", "The quick brown fox"])
  if stream:
    body["stream"] = True
  return body


FIELDS_COMPLETION = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "logprobs", "ignore_eos", "stream", "stream_options", "model", "n", "echo", "logit_bias",
                     "presence_penalty", "user", "suffix", "min_tokens"]
FIELDS_CHAT = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
               "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "stream", "stream_options", "model", "n",
               "add_generation_prompt", "tools", "response_format", "tool_choice", "user"]


def _dumps(obj, rng: random.Random) -> bytes:
  """JSON bytes, lone surrogates as \\uXXXX escapes or (sometimes) as raw encoded surrogates."""
  if rng.random() < 0.5:
    return json.dumps(obj).encode()  # ensure_ascii: escapes; NaN / Infinity literals stay
  return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _strings_paths(obj, path=()):
  """Paths of every string value in obj."""
  if isinstance(obj, str):
    yield path
  elif isinstance(obj, dict):
    for k, v in obj.items():
      yield from _strings_paths(v, path + (k,))
  elif isinstance(obj, list):
    for i, v in enumerate(obj):
      yield from _strings_paths(v, path + (i,))


def _set(obj, path, value):
  for p in path[:-1]:
    obj = obj[p]
  obj[path[-1]] = value


def _get(obj, path):
  for p in path:
    obj = obj[p]
  return obj


def generate(rng: random.Random, *, vocab_size: int, max_model_len: int, model: str, max_body_bytes: int,
             stream_fraction: float = 0.4, kind: str | None = None) -> Case:
  """One hostile request (see the module docstring for the kinds)."""
  kind = kind or rng.choices(KINDS, KIND_WEIGHTS)[0]
  chat = rng.random() < 0.5
  path = CHAT if chat else COMPLETIONS
  stream = rng.random() < stream_fraction
  body = _valid_body(rng, chat, stream)
  headers = {"content-type": "application/json"}
  fields = FIELDS_CHAT if chat else FIELDS_COMPLETION
  values = hostile_values(vocab_size, max_model_len)
  raw = None
  if kind == "field":
    for _ in range(rng.randint(1, 3)):
      body[rng.choice(fields)] = rng.choice(values)
    if rng.random() < 0.3:
      body["model"] = rng.choice([model, model + "x", "\udcff", "a\ud800b", "", "x" * 300])
  elif kind == "edge":
    edges = edge_values(vocab_size)
    for name in rng.sample(sorted(edges), rng.randint(1, 4)):
      value = rng.choice(edges[name])
      if name == "logprobs" and chat:
        body["logprobs"], body["top_logprobs"] = True, value
      else:
        body[name] = value
  elif kind == "unknown":
    for _ in range(rng.randint(1, 3)):
      name = rng.choice(["\udcff", "max_token", "x" * 3000, "", "\x00", "prompt\ud800", "🙂", "__proto__"])
      body[name] = rng.choice(values)
  elif kind == "surrogate":
    if rng.random() < 0.2:
      body[rng.choice(["\udcff", "a\ud800", "\udfff\ud800"])] = 1
    else:
      if rng.random() < 0.3:
        body["stop"] = ["ok", "x\udcffy"]
      if rng.random() < 0.3:
        body["model"] = "a\ud800b"
      if chat and rng.random() < 0.4:
        body["messages"][0][rng.choice(["role", "content", "name"])] = "user\udcff"
      paths = list(_strings_paths(body))
      p = rng.choice(paths)
      s = _get(body, p)
      i = rng.randint(0, len(s))
      _set(body, p, s[:i] + rng.choice(["\udcff", "\ud800", "\udbff\udbff", "\udfff"]) + s[i:])
  elif kind == "utf8":
    raw = _dumps(body, rng)
    bad = rng.choice([b"\xed\xa0\x80", b"\xff", b"\xc0\xaf", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80\x80",
                      b"\xfe\xff"])
    quotes = [i for i, c in enumerate(raw) if c == ord('"')]
    at = rng.choice(quotes) + 1 if quotes and rng.random() < 0.85 else rng.randint(0, len(raw))
    raw = raw[:at] + bad + raw[at:]
  elif kind == "deep":
    depth = rng.choice([40, 63, 64, 65, 100, 990, 1000, 5000, 20000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    nested = opener * depth + "1" + closer * depth
    field = rng.choice(fields + ["deep"])
    raw = _dumps({k: v for k, v in body.items() if k != field}, rng)[:-1] + b', "' + field.encode() + b'": ' + \
        nested.encode() + b"}"
    if rng.random() < 0.2:
      raw = nested.encode()
  elif kind == "number":
    field = rng.choice(["max_tokens", "top_k", "seed", "temperature", "logprobs", "prompt", "stop_token_ids"])
    literal = rng.choice(["9" * rng.choice([4299, 4301, 5000, 10000]), "-" + "1" * 5000, "1e999", "-1e999", "NaN",
                          "Infinity", "-Infinity", "0." + "0" * 5000 + "1", "1" + "0" * 400 + ".5", "1E400",
                          "123456789012345678901234567890"])
    if field in ("prompt", "stop_token_ids"):
      literal = f"[5, {literal}]"
    raw = _dumps({k: v for k, v in body.items() if k != field}, rng)[:-1] + \
        f', "{field}": {literal}}}'.encode()
  elif kind == "syntax":
    good = _dumps(body, rng)
    raw = rng.choice([good[:rng.randint(0, len(good) - 1)], good + b"garbage", good + b"}", b"", b" ", b"null",
                      b"[]", b"[1, 2]", b'"prompt"', b"42", b"true", b"{,}", b"{'prompt': 'x'}", b'{"prompt"}',
                      bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), b"\xef\xbb\xbf" + good,
                      good.replace(b":", b"=", 1), b'{"prompt": "a" "b"}', b'{"prompt": "\\x41"}',
                      b'{"prompt": "unterminated'])
  elif kind == "content_type":
    headers = {"content-type": rng.choice([
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml",
        "application/json; charset=utf-16", "application/json; charset=latin-1", "image/png", "json",
        "application/json; charset=utf-8", "application/vnd.api+json", "", "*/*", "application/jsonx",
        "text/json"])}
  elif kind == "prompt":
    bad = rng.choice([[vocab_size], [-1], [5, True], [5, 1.5], [[5, 6], [7]], [[5, 6]], [[]], [], "", ["a", ""],
                      [[5, 6], [vocab_size]], ["Hello"] * 3, [[5]] * 40, ["x"] * 5000, [[5], ["a"]],
                      [5] * (max_model_len + rng.randint(0, 50)), [2**63], [5, None], [5, "6"], {"a": 1},
                      ["a", 5], [["a"]], [5] * 3000, "\x00" * 10, " " * 3000])
    if chat:
      body["messages"] = [{"role": "user", "content": bad}]
    else:
      body["prompt"] = bad
  elif kind == "messages":
    body.pop("prompt", None)
    path = CHAT
    body["messages"] = rng.choice([
        [], {}, "hi", [None], [1], [[]], [{}], [{"role": "user"}], [{"content": "hi"}],
        [{"role": 5, "content": "hi"}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [None]}],
        [{"role": "user", "content": "hi", "name": 5}], [{"role": "user", "content": "hi", "name": ["x"]}],
        [{"role": "", "content": ""}], [{"role": "robot", "content": "hi"}],
        [{"role": "user", "content": "x"}] * 2000, [{"role": "user", "content": "{% raw %}"}],
        [{"role": "user", "content": "hi", "tool_calls": [{"x": 1}]}], [{"role": "user", "content": None}]])
  elif kind == "oversize":
    pad = max_body_bytes + rng.randint(1, 1024)
    body["prompt" if not chat else "user"] = "a" * pad
  if raw is None:
    raw = _dumps(body, rng)
  return Case(kind, path, raw, headers, bool(stream))


# ---- running ------------------------------------------------------------------------------------------------------
def check_loopback(url: str) -> str:
  """The URL without a trailing slash; raises ValueError unless its host is a loopback address."""
  parsed = urllib.parse.urlparse(url)
  if parsed.scheme not in ("http", "https") or not parsed.hostname:
    raise ValueError(f"--base_url must be an http(s) URL, got {url!r}")
  host = parsed.hostname
  try:
    addrs = {info[4][0] for info in socket.getaddrinfo(host, parsed.port or 80)}
  except socket.gaierror as e:
    raise ValueError(f"--base_url: cannot resolve {host}: {e}") from None
  if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
    raise ValueError(f"--base_url must point at a loopback address (this tool only attacks local servers), got {host}")
  return url.rstrip("/")


def status_class(status: int) -> str:
  return f"{status // 100}xx"


async def _send(client, case: Case, timeout: float) -> dict:
  """Sends one case; {"status", "class", "stream_error", "error", "retried", ...}. A connection that breaks before
  any answer is retried once on a fresh connection (a pooled keep-alive connection can be closed by the server's
  idle timeout just as it is reused); a body that makes the server drop the connection fails the retry too."""
  out = await _send_once(client, case, timeout)
  if out["status"] is None and out["error"] != "timeout":
    first = out["error"]
    out = await _send_once(client, case, timeout)
    out["retried"] = first
  return out


async def _send_once(client, case: Case, timeout: float) -> dict:
  import httpx
  out = {"kind": case.kind, "path": case.path, "stream": case.stream, "status": None, "stream_error": None,
         "error": None, "retried": None, "body_head": ascii(case.body[:120])}
  try:
    async with client.stream("POST", case.path, content=case.body, headers=case.headers, timeout=timeout) as r:
      out["status"] = r.status_code
      ctype = r.headers.get("content-type", "")
      if r.status_code == 200 and ctype.startswith("text/event-stream"):
        events = []
        async for line in r.aiter_lines():
          if line.startswith("data: "):
            events.append(line[6:])
        if not events or events[-1] != "[DONE]":
          out["stream_error"] = "stream did not end with [DONE]"
        else:
          for e in events[:-1]:
            ev = json.loads(e)
            if "error" in ev:
              out["stream_error"] = ev["error"].get("message", "error event")[:200]
      else:
        data = await r.aread()
        if r.status_code >= 400:
          err = json.loads(data).get("error", {})
          if set(err) != {"message", "type", "param", "code"}:
            out["error"] = f"not an OpenAI error body: {data[:200]!r}"
          if r.status_code >= 500:
            out["error"] = (out["error"] or "") + f" {err.get('message', '')[:300]}"
        elif r.status_code == 200:
          json.loads(data)
  except httpx.TimeoutException:
    out["error"] = "timeout"
  except (httpx.TransportError, json.JSONDecodeError, UnicodeDecodeError) as e:
    out["error"] = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
  out["class"] = status_class(out["status"]) if out["status"] is not None else "no answer"
  return out


async def valid_stream(client, max_tokens: int, timeout: float) -> dict:
  """The valid greedy stream: its text, token strings, completion tokens and finish reason (or an error)."""
  body = {"prompt": VALID_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
          "stream": True, "stream_options": {"include_usage": True}}
  text, tokens, finish, usage, error = "", [], None, None, None
  try:
    async with client.stream("POST", COMPLETIONS, json=body, timeout=timeout) as r:
      if r.status_code != 200:
        return {"error": f"status {r.status_code}: {(await r.aread())[:300]!r}"}
      events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
      error = "stream did not end with [DONE]"
    for e in events[:-1]:
      ev = json.loads(e)
      if "error" in ev:
        error = ev["error"]["message"]
        continue
      if ev.get("usage"):
        usage = ev["usage"]
      for c in ev["choices"]:
        text += c["text"]
        finish = c["finish_reason"] or finish
        if c.get("logprobs"):
          tokens += c["logprobs"]["tokens"]
  except Exception as e:  # a broken connection is a result here, not a crash of the fuzzer
    error = f"{type(e).__name__}: {e}"
  return {"text": text, "tokens": tokens, "finish_reason": finish,
          "completion_tokens": usage["completion_tokens"] if usage else None, "error": error}


def _same(a: dict, ref: dict) -> bool:
  return a.get("error") is None and all(a[k] == ref[k] for k in ("text", "tokens", "finish_reason",
                                                                  "completion_tokens"))


def _metric(text: str, name: str, **labels) -> float:
  """Sum of the samples called `name` whose labels include `labels` in a Prometheus text exposition."""
  from prometheus_client.parser import text_string_to_metric_families
  return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def fuzz(base: str, *, vocab_size: int, count: int, seed: int, concurrency: int, stream_fraction: float,
               time_limit_s: float, request_timeout_s: float, valid_max_tokens: int, max_body_bytes: int | None = None,
               log=print) -> dict:
  """Runs one fuzzing session against `base`; returns the report (see write_report)."""
  import httpx
  # idle pooled connections expire before the server's keep-alive timeout (uvicorn: 5 s) can close them under us
  limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4,
                        keepalive_expiry=2.0)
  async with httpx.AsyncClient(base_url=base, limits=limits, timeout=request_timeout_s) as client:
    card = (await client.get("/v1/models")).json()["data"][0]
    model, max_model_len = card["id"], int(card["max_model_len"])
    if max_body_bytes is None:
      from recguide_jax.server.body import DEFAULT_MAX_BODY_BYTES
      max_body_bytes = DEFAULT_MAX_BODY_BYTES
    log(f"target {base}: model {model}, max_model_len {max_model_len}, vocab {vocab_size}")
    reference = await valid_stream(client, valid_max_tokens, request_timeout_s)
    if reference.get("error"):
      raise RuntimeError(f"the valid stream fails even alone: {reference['error']}")
    log(f"reference stream alone: {reference['completion_tokens']} tokens")
    metrics_before = (await client.get("/metrics")).text

    rng = random.Random(seed)
    cases = [generate(rng, vocab_size=vocab_size, max_model_len=max_model_len, model=model,
                      max_body_bytes=max_body_bytes, stream_fraction=stream_fraction) for _ in range(count)]
    results: list[dict] = []
    valid_runs: list[dict] = []
    done = asyncio.Event()
    t0 = time.monotonic()

    async def valid_loop():
      while not done.is_set():  # back to back, so a valid stream is in flight while the bodies arrive
        run = await valid_stream(client, valid_max_tokens, request_timeout_s)
        run["t_end_s"] = round(time.monotonic() - t0, 2)
        valid_runs.append(run)

    queue: asyncio.Queue = asyncio.Queue()
    for c in cases:
      queue.put_nowait(c)

    async def worker():
      while not queue.empty() and time.monotonic() - t0 < time_limit_s:
        case = queue.get_nowait()
        results.append(await _send(client, case, request_timeout_s))
        if len(results) % 200 == 0:
          log(f"{len(results)}/{count} bodies sent, {time.monotonic() - t0:.0f} s")

    looper = asyncio.ensure_future(valid_loop())
    await asyncio.sleep(0.5)  # the valid stream is decoding before the first hostile body arrives
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    fuzz_s = time.monotonic() - t0
    done.set()
    await looper
    # idle: nothing running or queued, no KV page held
    deadline = time.monotonic() + 120
    while True:
      metrics_after = (await client.get("/metrics")).text
      idle = (_metric(metrics_after, "recguide_running_requests") == 0
              and _metric(metrics_after, "recguide_queue_depth") == 0
              and _metric(metrics_after, "recguide_kv_pages_in_use") == 0)
      if idle or time.monotonic() > deadline:
        break
      await asyncio.sleep(0.5)
    health = (await client.get("/health")).status_code
    after_alone = await valid_stream(client, valid_max_tokens, request_timeout_s)

  by_class = collections.Counter(r["class"] for r in results)
  by_status = collections.Counter(str(r["status"]) for r in results)
  by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for r in results:
    by_kind[r["kind"]][r["class"]] += 1
  bad = [r for r in results if r["class"] in ("5xx", "no answer") or r["stream_error"] or r["error"]]
  overlapping = valid_runs  # each started before the last hostile answer came back
  errors_delta = (_metric(metrics_after, "recguide_requests_total", status="error")
                  - _metric(metrics_before, "recguide_requests_total", status="error"))
  return {
      "target": base, "model": model, "max_model_len": max_model_len, "vocab_size": vocab_size,
      "bodies_generated": count, "bodies_sent": len(results), "seed": seed, "concurrency": concurrency,
      "stream_fraction_requested": stream_fraction,
      "streaming_bodies": sum(r["stream"] for r in results),
      "by_endpoint": dict(collections.Counter(r["path"] for r in results)),
      "status_classes": dict(sorted(by_class.items())), "statuses": dict(sorted(by_status.items())),
      "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
      "responses_5xx": by_class.get("5xx", 0), "no_answer": by_class.get("no answer", 0),
      "stream_error_events": sum(1 for r in results if r["stream_error"]),
      "connections_retried": sum(1 for r in results if r["retried"]),
      "problems": [{k: r[k] for k in ("kind", "path", "stream", "status", "stream_error", "error", "body_head")}
                   for r in bad[:20]],
      "retried_after_a_broken_connection": [{k: r[k] for k in ("kind", "path", "status", "retried", "body_head")}
                                            for r in results if r["retried"]][:20],
      "fuzz_seconds": round(fuzz_s, 1),
      "valid_stream": {
          "max_tokens": valid_max_tokens, "reference_tokens": reference["completion_tokens"],
          "runs_during_fuzz": len(overlapping), "runs_equal_to_reference": sum(_same(v, reference) for v in overlapping),
          "equal_after_fuzz": _same(after_alone, reference),
          "failures": [{k: v.get(k) for k in ("error", "completion_tokens", "finish_reason")}
                       for v in overlapping if not _same(v, reference)][:5]},
      "engine_errors_during_fuzz": errors_delta,
      "idle_after": {"running": _metric(metrics_after, "recguide_running_requests"),
                     "queue_depth": _metric(metrics_after, "recguide_queue_depth"),
                     "kv_pages_in_use": _metric(metrics_after, "recguide_kv_pages_in_use")},
      "health_after": health,
  }


def vocab_size_of(checkpoint: str | None) -> int:
  if checkpoint is None:
    sys.path.insert(0, REPO)
    from recguide_jax import llm as llm_lib
    checkpoint = str(llm_lib.default_checkpoint())
  with open(os.path.join(checkpoint, "config.json")) as f:
    return int(json.load(f)["vocab_size"])


def passed(report: dict) -> bool:
  v = report["valid_stream"]
  return (report["responses_5xx"] == 0 and report["no_answer"] == 0 and report["stream_error_events"] == 0
          and v["runs_during_fuzz"] >= 1 and v["runs_equal_to_reference"] == v["runs_during_fuzz"]
          and v["equal_after_fuzz"] and report["idle_after"]["kv_pages_in_use"] == 0 and report["health_after"] == 200)


def markdown(runs: list[dict]) -> str:
  lines = ["# Hostile-input fuzzing of the server", "",
           "Generated by `python launch/fuzz_server.py " + " ".join(sys.argv[1:]) + "`: hostile request bodies "
           "(both endpoints, about 40% streaming; kinds in the script's docstring) against `launch/serve.py`, "
           "while one valid greedy stream is restarted back to back. Every run of that stream must equal its "
           "reference taken alone before the fuzzing (text, token strings, count, finish reason); afterwards the "
           "server must be idle with no KV page in use.", "",
           "What the server refuses (module docstrings of `recguide_jax/server/body.py`, `schema.py` (the "
           "pydantic request models), `protocol.py`, `app.py` and `SamplingParams.validate`): a declared non-JSON Content-Type or a charset other than UTF-8 -> 415 (no "
           "Content-Type is read as JSON, as FastAPI does); a body over the size limit (4 MiB by default) -> 413; "
           "invalid UTF-8, a lone surrogate in any string or field name, nesting deeper than 64, a number literal "
           "longer than 64 characters, NaN / Infinity / an overflowing float, malformed JSON -> 400; every field "
           "checked against the range of its array type and the model (top_k in [-1, vocabulary size], seed in "
           "[-2^63, 2^63 - 1], max_tokens within max_model_len, temperature in [0, 100], at most 16 stop strings of "
           "256 characters, at most 256 stop token ids in the vocabulary, booleans that are booleans, at most 1024 "
           "prompts in a batch, each in the vocabulary and within max_model_len) -> 400. "
           "Error messages escape and cap the values they quote.", ""]
  lines += ["| policy | bodies | streaming | 2xx | 4xx | 5xx | no answer | stream error events | valid streams "
            "equal / run during fuzz | equal after | KV pages in use after | seconds | pass |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in runs:
    c, v = r["status_classes"], r["valid_stream"]
    lines.append(f"| {r.get('policy', '?')} | {r['bodies_sent']} | {r['streaming_bodies']} | {c.get('2xx', 0)} | "
                 f"{c.get('4xx', 0)} | {c.get('5xx', 0)} | {r['no_answer']} | {r['stream_error_events']} | "
                 f"{v['runs_equal_to_reference']} / {v['runs_during_fuzz']} ({v['reference_tokens']} tokens each) | "
                 f"{v['equal_after_fuzz']} | {int(r['idle_after']['kv_pages_in_use'])} | {r['fuzz_seconds']} | "
                 f"{'yes' if passed(r) else 'NO'} |")
  for r in runs:
    lines += ["", f"## {r.get('policy', '?')}: statuses", "",
              "| status | count |", "|---|---|"] + [f"| {s} | {n} |" for s, n in r["statuses"].items()]
    lines += ["", "| kind | " + " | ".join(sorted({k for v in r["by_kind"].values() for k in v})) + " |"]
    classes = sorted({k for v in r["by_kind"].values() for k in v})
    lines += ["|---|" + "---|" * len(classes)]
    lines += [f"| {kind} | " + " | ".join(str(v.get(c, 0)) for c in classes) + " |" for kind, v in r["by_kind"].items()]
    lines += ["", f"Connections that broke before an answer and were retried once: {r['connections_retried']}."]
    if r["problems"]:
      lines += ["", "Problems (first 20):", ""] + [f"- `{json.dumps(p)}`" for p in r["problems"]]
  return "\n".join(lines) + "\n"


def write_report(runs: list[dict], output_dir: str) -> tuple[str, str]:
  os.makedirs(output_dir, exist_ok=True)
  jpath, mpath = os.path.join(output_dir, "hostile_fuzz.json"), os.path.join(output_dir, "hostile_fuzz.md")
  with open(jpath, "w") as f:
    json.dump({"command": "python launch/fuzz_server.py " + " ".join(sys.argv[1:]), "runs": runs,
               "passed": all(passed(r) for r in runs)}, f, indent=1)
  with open(mpath, "w") as f:
    f.write(markdown(runs))
  return jpath, mpath


# ---- the server ---------------------------------------------------------------------------------------------------
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(policy: str, log_path: str):
  """launch/serve.py on a free loopback port; (process, base URL, log file)."""
  import httpx
  port = _free_port()
  cmd = [sys.executable, os.path.join(REPO, "launch", "serve.py"), f"--port={port}", "--host=127.0.0.1",
         f"--policy={policy}", f"--block_size={_BLOCK_SIZE.value}", f"--max_num_seqs={_MAX_NUM_SEQS.value}",
         f"--max_model_len={_MAX_MODEL_LEN.value}", f"--compile_cache_dir={_COMPILE_CACHE_DIR.value}"]
  if _MODEL.value:
    cmd.append(f"--model={_MODEL.value}")
  log_file = open(log_path, "w")
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + _STARTUP_TIMEOUT.value
  try:
    while time.monotonic() < deadline:
      if proc.poll() is not None:
        raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
      try:
        if httpx.get(base + "/health", timeout=2).status_code == 200:
          return proc, base, log_file
      except httpx.TransportError:
        pass
      time.sleep(1)
    raise TimeoutError(f"the server was not ready after {_STARTUP_TIMEOUT.value} s; see {log_path}")
  except BaseException:  # incl. SIGTERM / Ctrl-C while it starts: never leave the server behind
    stop_server(proc, log_file)
    raise


def stop_server(proc, log_file) -> None:
  proc.terminate()
  try:
    proc.wait(60)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  log_file.close()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the cleanups (the server)
  import logging
  logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
  for flag, ok, msg in [("count", _COUNT.value >= 1, "must be >= 1"),
                        ("concurrency", _CONCURRENCY.value >= 1, "must be >= 1"),
                        ("stream_fraction", 0 <= _STREAM_FRACTION.value <= 1, "must be in [0, 1]"),
                        ("valid_max_tokens", _VALID_MAX_TOKENS.value >= 1, "must be >= 1")]:
    if not ok:
      raise app.UsageError(f"--{flag} {msg}")
  vocab_size = _VOCAB_SIZE.value or vocab_size_of(_MODEL.value)
  kwargs = dict(vocab_size=vocab_size, count=_COUNT.value, seed=_SEED.value, concurrency=_CONCURRENCY.value,
                stream_fraction=_STREAM_FRACTION.value, time_limit_s=_TIME_LIMIT.value,
                request_timeout_s=_REQUEST_TIMEOUT.value, valid_max_tokens=_VALID_MAX_TOKENS.value)
  runs = []
  if _BASE_URL.value:
    try:
      base = check_loopback(_BASE_URL.value)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    report = asyncio.run(fuzz(base, **kwargs))
    report["policy"] = "(--base_url)"
    runs.append(report)
  else:
    os.makedirs(_LOG_DIR.value, exist_ok=True)
    for policy in _POLICY.value:
      log_path = os.path.join(_LOG_DIR.value, f"serve_{policy}.log")
      print(f"starting launch/serve.py --policy={policy} (log: {log_path})", flush=True)
      proc, base, log_file = start_server(policy, log_path)
      try:
        report = asyncio.run(fuzz(base, **kwargs))
      finally:
        stop_server(proc, log_file)
      report["policy"] = policy
      report["server"] = {"block_size": _BLOCK_SIZE.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                          "max_model_len": _MAX_MODEL_LEN.value, "model": _MODEL.value or "bundled"}
      runs.append(report)
      write_report(runs, _OUTPUT_DIR.value)  # after each policy, so a later one that fails keeps the earlier
  jpath, mpath = write_report(runs, _OUTPUT_DIR.value)
  for r in runs:
    print(f"{r['policy']}: {r['bodies_sent']} bodies, classes {r['status_classes']}, valid streams "
          f"{r['valid_stream']['runs_equal_to_reference']}/{r['valid_stream']['runs_during_fuzz']} equal, "
          f"KV pages in use after {r['idle_after']['kv_pages_in_use']:.0f}: {'PASS' if passed(r) else 'FAIL'}")
  print(f"wrote {jpath} and {mpath}")
  sys.exit(0 if all(passed(r) for r in runs) else 1)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
