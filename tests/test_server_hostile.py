"""Hostile input (issue #14): the real app, served in-process by uvicorn over a tiny checkpoint with a real BPE
tokenizer, answers generated hostile bodies on both endpoints, streaming or not, with 4xx and never 5xx, while a
valid greedy stream in flight keeps its tokens; one regression test per cause of the 500s the issue found (top_k
>= 2^31 failing the batch, lone surrogates, surrogates in echoed values, deep nesting, huge integers) and for
Content-Type / body size; and the engine's request isolation, below HTTP: a request whose values do not fit, whose
callback raises or whose round raises fails without taking down the others (no KV page leaks), while a device
failure still fails everything, logged.
"""

import json
import logging
import os
import subprocess
import sys
import threading

import httpx
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # server_fixtures lives next to this file

import server_fixtures as sf  # noqa: E402

from recguide_jax import LLM

from recguide_jax import SamplingParams

from recguide_jax.decoding.builtin import LinearStrategy  # noqa: E402
from recguide_jax.engine.thread import EngineThread
from recguide_jax.engine.requests import RequestError, SEED_RANGE  # noqa: E402
from recguide_jax.server.app import create_app
from recguide_jax.server import protocol  # noqa: E402

MODEL = "nld-hostile"
MAX_MODEL_LEN = 128
MAX_BODY_BYTES = 64 * 1024
VALID_PROMPT = "Natalia sold clips to 48 of her friends in April"
VALID_TOKENS = 48
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


# ---- the in-process server ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  ckpt = sf.build_checkpoint(tmp_path_factory.mktemp("hostile") / MODEL)
  # batches of up to 2: the valid stream shares its rounds with whatever hostile body got through validation
  return LLM(ckpt, "linear", 8, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, page_size=8, prefill_chunk=16,
             warmup=False, compile_cache_dir=None)


@pytest.fixture(scope="module")
def reference(llm):
  """The valid request's greedy output, run alone before the server starts: token strings and text."""
  (out,) = llm.generate([VALID_PROMPT], SamplingParams(max_tokens=VALID_TOKENS, temperature=0.0, ignore_eos=True))
  tokens = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in out.outputs[0].token_ids]
  return {"text": out.outputs[0].text, "tokens": tokens, "finish_reason": "length"}


@pytest.fixture(scope="module")
def server(llm, reference):
  thread = EngineThread(llm.engine).start()
  app = create_app(thread, llm.tokenizer, MODEL, max_body_bytes=MAX_BODY_BYTES)
  srv = sf.InProcessServer(app)
  yield srv
  srv.stop()
  assert not thread.is_alive()
  assert llm.engine.allocator.num_used == 0  # no KV page leaked by anything the tests sent
  llm.engine.allocator.check()


def valid_stream(base: str, on_first_chunk=None) -> dict:
  body = {"prompt": VALID_PROMPT, "max_tokens": VALID_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
          "stream": True}
  text, tokens, finish, error = "", [], None, None
  with httpx.stream("POST", base + COMPLETIONS, json=body, timeout=120) as r:
    assert r.status_code == 200, r.read()
    events = []
    for line in r.iter_lines():
      if line.startswith("data: "):
        events.append(line[6:])
        if on_first_chunk is not None and len(events) == 1:
          on_first_chunk()
  assert events[-1] == "[DONE]", events[-3:]
  for e in events[:-1]:
    ev = json.loads(e)
    if "error" in ev:
      error = ev["error"]
      continue
    for c in ev["choices"]:
      text += c["text"]
      finish = c["finish_reason"] or finish
      if c["logprobs"]:
        tokens += c["logprobs"]["tokens"]
  return {"text": text, "tokens": tokens, "finish_reason": finish, "error": error}


class ValidStreams:
  """Valid greedy streams back to back on a thread while a test sends hostile bodies; every run is recorded."""

  def __init__(self, base: str):
    self.base = base
    self.runs: list[dict] = []
    self.failure: BaseException | None = None
    self.started = threading.Event()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def _loop(self):
    try:
      while not self._stop.is_set():
        self.runs.append(valid_stream(self.base, self.started.set))
    except BaseException as e:  # reported by finish()
      self.failure = e
      self.started.set()

  def __enter__(self):
    self._thread.start()
    assert self.started.wait(120), "the valid stream never produced a chunk"
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join(180)

  def check(self, reference):
    assert self.failure is None, self.failure
    assert self.runs, "no valid stream completed"
    for run in self.runs:
      assert run["error"] is None, run["error"]
      assert run == {**reference, "error": None}


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
  assert r.status_code == status, (r.status_code, r.text[:500])
  r.content.decode("utf-8")  # the body is valid UTF-8 (strictly: no encoded surrogates)
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"], err
  assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), err
  if param is not None:
    assert err["param"] == param, err
  if code is not None:
    assert err["code"] == code, err
  return err


def post(base, path, body=None, *, raw: bytes | None = None, headers=None, timeout=120) -> httpx.Response:
  if raw is None:
    raw = json.dumps(body).encode()
  return httpx.post(base + path, content=raw, headers={"content-type": "application/json", **(headers or {})},
                    timeout=timeout)


def check_answer(r: httpx.Response) -> None:
  """Any answer to any body: never >= 500; errors have OpenAI's shape; a 200 stream ends cleanly with no error
  event; a 200 body is a completion."""
  assert r.status_code < 500, (r.status_code, r.text[:500])
  if r.status_code >= 400:
    assert_openai_error(r, r.status_code)
    return
  assert r.status_code == 200, r.status_code
  if r.headers["content-type"].startswith("text/event-stream"):
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    for e in events[:-1]:
      assert "error" not in json.loads(e), e
  else:
    assert json.loads(r.text)["choices"], r.text[:300]


# ---- hostile body generators ----------------------------------------------------------------------------------------
SURROGATES = ["\udcff", "\ud800", "a\ud800b", "\udfff\ud800"]
BOUNDARY_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, 320, 321,
                 MAX_MODEL_LEN, MAX_MODEL_LEN + 1]
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(SURROGATES),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Co", "Cc", "Zs"]), max_size=4))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.one_of(st.text(max_size=6), st.sampled_from(SURROGATES)), c, max_size=3), max_leaves=8)
COMMON_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs",
                 "ignore_eos", "stream", "stream_options", "model", "n", "logit_bias", "user", "min_tokens",
                 "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
                 "guided_json", "priority"]
FIELDS = {COMPLETIONS: COMMON_FIELDS + ["prompt", "echo", "suffix", "best_of"],
          CHAT: COMMON_FIELDS + ["messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                 "tools", "response_format"]}
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]),
                                                             values),
                                           "content": st.one_of(st.text(max_size=12), values)},
                                          optional={"name": values}), max_size=3)


@st.composite
def hostile_request(draw):
  """(path, raw body, headers, stream): a small valid body with hostile fields, or hostile bytes."""
  path = draw(st.sampled_from([COMPLETIONS, CHAT]))
  stream = draw(st.booleans())
  body = {"max_tokens": draw(st.integers(1, 3)), "temperature": draw(st.sampled_from([0, 0.8])), "stream": stream}
  if path == CHAT:
    body["messages"] = draw(st.one_of(st.just([{"role": "user", "content": "What is 2 + 2?"}]), messages))
  else:
    body["prompt"] = draw(st.one_of(st.sampled_from(["Hello", "The quick brown fox"]), st.text(max_size=10),
                                    st.lists(st.integers(-5, 400), max_size=6), values))
  for name, value in draw(st.dictionaries(st.sampled_from(FIELDS[path] + ["junk", "\udcff"]), values,
                                          max_size=3)).items():
    body[name] = value
  raw = json.dumps(body).encode() if draw(st.booleans()) else \
      json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")  # lone surrogates as raw bytes too
  mutation = draw(st.sampled_from(["none"] * 6 + ["bytes", "truncate", "deep", "number"]))
  if mutation == "bytes":
    at = draw(st.integers(0, len(raw)))
    raw = raw[:at] + draw(st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc0\xaf", b"\xe2\x82", b"\x00"])) + raw[at:]
  elif mutation == "truncate":
    raw = raw[:draw(st.integers(0, len(raw) - 1))]
  elif mutation == "deep":
    depth = draw(st.sampled_from([63, 64, 65, 1000, 5000]))
    raw = raw[:-1] + b', "top_k": ' + b"[" * depth + b"]" * depth + b"}"
  elif mutation == "number":
    literal = draw(st.sampled_from([b"9" * 5000, b"1e999", b"NaN", b"-Infinity", b"0." + b"0" * 3000 + b"1"]))
    raw = raw[:-1] + b', "' + draw(st.sampled_from(["seed", "max_tokens", "temperature"])).encode() + b'": ' + \
        literal + b"}"
  headers = {"content-type": draw(st.sampled_from(["application/json"] * 8 + ["application/json; charset=utf-8",
                                                                              "text/plain", ""]))}
  return path, raw, headers, stream


HYPOTHESIS = settings(max_examples=150, deadline=None, print_blob=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                             HealthCheck.data_too_large])


@HYPOTHESIS
@given(case=hostile_request())
def _hostile_example(base, case):
  path, raw, headers, stream = case
  r = httpx.post(base + path, content=raw, headers=headers, timeout=120)
  check_answer(r)


def test_hostile_bodies_never_5xx_and_valid_stream_unharmed(server, reference):
  """Property: hypothesis-generated hostile bodies on both endpoints, streaming and not, get no answer >= 500, and
  the valid greedy streams running meanwhile produce exactly the tokens they produce alone."""
  with ValidStreams(server.base) as valid:
    _hostile_example(server.base)
  valid.check(reference)


# ---- regression tests: the five causes of 500s -----------------------------------------------------------------------
def test_top_k_past_int32_or_int64_is_400_and_fails_no_neighbour(server, reference):
  """Cause 1: top_k 2^31 passed validation and overflowed the int32 batch array, failing the whole batch."""
  results = {}

  def hostile():
    for top_k in (2**31, 2**63, 2**64, -2**63, 321):
      results[top_k] = post(server.base, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "top_k": top_k})
    # in range: joins the valid stream's batch (a sampled row next to a greedy one)
    results["ok"] = post(server.base, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "top_k": 320, "seed": 2**63 - 1,
                                                    "temperature": 0.9})

  sender = threading.Thread(target=hostile)
  run = valid_stream(server.base, on_first_chunk=sender.start)  # the bodies arrive while it decodes
  sender.join()
  assert run == {**reference, "error": None}
  for top_k in (2**31, 2**63, 2**64, -2**63, 321):
    err = assert_openai_error(results[top_k], 400, "top_k")
    assert "320" in err["message"]  # names the bound: the vocabulary size
  assert results["ok"].status_code == 200, results["ok"].text


def test_lone_surrogates_and_invalid_utf8_are_400_naming_the_field(server):
  """Cause 2: a lone surrogate reached the tokenizer (TypeError -> 500); raw b'\\xed\\xa0\\x80' passed json.loads."""
  base = server.base
  assert_openai_error(post(base, COMPLETIONS, {"prompt": "\udcff", "max_tokens": 2}), 400, "prompt",
                      "invalid_encoding")
  assert_openai_error(post(base, COMPLETIONS, raw=b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'), 400, "prompt",
                      "invalid_encoding")
  assert_openai_error(post(base, COMPLETIONS, raw=b'{"prompt": "\xff", "max_tokens": 2}'), 400, "prompt")
  assert_openai_error(post(base, CHAT, {"messages": [{"role": "user", "content": "x\ud800"}]}), 400,
                      "messages[0].content")
  assert_openai_error(post(base, CHAT, raw=b'{"messages": [{"role": "us\xed\xa0\x80er", "content": "hi"}]}'), 400,
                      "messages[0].role")
  assert_openai_error(post(base, CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\udfff"}]}), 400,
                      "messages[0].name")
  assert_openai_error(post(base, COMPLETIONS, {"prompt": "hi", "stop": ["ok", "\udcff"]}), 400, "stop[1]")
  # a valid pair of escapes is one character, not a surrogate
  r = post(base, COMPLETIONS, {"prompt": "\U0001F600 hi", "max_tokens": 2, "temperature": 0})
  assert r.status_code == 200, r.text


def test_surrogates_in_echoed_values_are_escaped(server):
  """Cause 3: an error message quoting an unknown field named '\\udcff' or a model 'a\\ud800b' could not be
  encoded, so the 400/404 became a 500."""
  base = server.base
  err = assert_openai_error(post(base, COMPLETIONS, {"prompt": "hi", "\udcff": 1}), 400)
  assert "\\udcff" in err["message"] and err["param"] == "\\udcff"
  err = assert_openai_error(post(base, COMPLETIONS, {"prompt": "hi", "model": "a\ud800b"}), 400, "model")
  assert "\\ud800" in err["message"]
  # values that are valid text but not the served model / a known field are still quoted, escaped and capped
  err = assert_openai_error(post(base, COMPLETIONS, {"prompt": "hi", "model": "\u202e" + "m" * 500}), 404, "model")
  assert "\\u202e" in err["message"] and len(err["message"]) < 200
  # unknown fields are ignored by default (vLLM's behaviour; their names are logged escaped and capped), so a huge
  # one is refused only in strict mode, with a capped message (tests/test_server_api.py covers both modes)
  with pytest.raises(protocol.APIError) as e:
    protocol.parse_chat({"messages": [{"role": "user", "content": "hi"}], "x" * 3000: 1}, None, MODEL, 320,
                        MAX_MODEL_LEN, strict=True)
  assert e.value.code == "unknown_parameter" and len(e.value.message) < 200 and len(e.value.param) <= 120


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_deep_nesting_is_400(server, path):
  """Cause 4: nesting past ~990 levels raised RecursionError in the body parser."""
  for raw in (b"[" * 5000 + b"]" * 5000, b'{"prompt": "hi", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
              b'{"a":' * 5000 + b"1" + b"}" * 5000, b"[" * 60_000):
    err = assert_openai_error(post(server.base, path, raw=raw), 400, None, "invalid_json")
    assert "deeper" in err["message"]
  # brackets inside strings are text, not nesting
  r = post(server.base, COMPLETIONS, {"prompt": "hi", "stop": ["[" * 100 + "{" * 100], "max_tokens": 1})
  assert r.status_code == 200, r.text


def test_huge_number_literals_are_400(server):
  """Cause 5: an integer literal over 4,300 digits raised ValueError (Python's int-conversion limit), uncaught."""
  base = server.base
  for field, literal in [("max_tokens", b"9" * 5000), ("seed", b"-" + b"1" * 5000), ("prompt", b"[5, " + b"7" * 5000
                                                                                        + b"]"),
                         ("temperature", b"1e999"), ("temperature", b"NaN"), ("top_p", b"Infinity"),
                         ("temperature", b"0." + b"0" * 5000 + b"1")]:
    raw = b'{"prompt": "hi", "' + field.encode() + b'": ' + literal + b"}" if field != "prompt" else \
        b'{"prompt": ' + literal + b"}"
    assert_openai_error(post(base, COMPLETIONS, raw=raw), 400, None, "invalid_json")
  # numbers in range but past their fields' types are refused by the field checks
  for body, param in [({"prompt": "hi", "seed": 2**63}, "seed"), ({"prompt": "hi", "seed": -2**63 - 1}, "seed"),
                      ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens"), ({"prompt": [5, 10**30]}, "prompt"),
                      ({"prompt": "hi", "stop_token_ids": [2**63]}, "stop_token_ids"),
                      ({"prompt": "hi", "logprobs": 2**63}, "logprobs"),
                      ({"prompt": "hi", "temperature": 1e300}, "temperature")]:
    assert_openai_error(post(base, COMPLETIONS, body), 400, param)
  for seed in SEED_RANGE:  # the documented seed range is served
    r = post(base, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "seed": seed, "temperature": 1.0})
    assert r.status_code == 200, r.text


# ---- other field bounds ---------------------------------------------------------------------------------------------
FIELD_ERRORS = [
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"top_k": 321}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 1.0}, "top_k"),
    ({"top_p": True}, "top_p"), ({"temperature": False}, "temperature"), ({"temperature": 101}, "temperature"),
    ({"seed": True}, "seed"), ({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"stop": ["s"] * 17}, "stop"), ({"stop": ["s" * 257]}, "stop"), ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [320]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"prompt": [5, True]}, "prompt"), ({"prompt": [[5, 6], [320]]}, "prompt"), ({"prompt": [[5, 6], []]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"stream": 1}, "stream"),
]


def test_field_bounds(server):
  base = server.base
  for extra, param in FIELD_ERRORS:
    assert_openai_error(post(base, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **extra}), 400, param)
  for extra, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                       ({"max_completion_tokens": True}, "max_completion_tokens"), ({"messages": []}, "messages"),
                       ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name")]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    assert_openai_error(post(base, CHAT, body), 400, param)
  # the edges themselves are served: top_k = vocabulary size, tiny temperatures (clamped like vLLM), -1 / 0 top_k
  for extra in ({"top_k": 320}, {"top_k": -1}, {"temperature": 1e-40}, {"temperature": 100}, {"stop": ["s"] * 16},
                {"stop_token_ids": [319]}):
    r = post(base, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 200, (extra, r.text)


# ---- Content-Type and body size -------------------------------------------------------------------------------------
def test_content_type(server):
  base, body = server.base, json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
  for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "json",
                "application/json; charset=utf-16", "application/jsonx"):
    err = assert_openai_error(post(base, COMPLETIONS, raw=body, headers={"content-type": ctype}), 415,
                              code="unsupported_media_type")
    assert "application/json" in err["message"] or "UTF-8" in err["message"]
  for ctype in ("application/json", "Application/JSON; charset=UTF-8", "application/vnd.api+json"):
    assert post(base, COMPLETIONS, raw=body, headers={"content-type": ctype}).status_code == 200, ctype
  # no Content-Type at all: read as JSON (as FastAPI does)
  r = httpx.post(base + COMPLETIONS, content=body, timeout=60)
  assert "content-type" not in r.request.headers and r.status_code == 200, r.text


def test_body_size_limit_is_413(server):
  big = json.dumps({"prompt": "a" * MAX_BODY_BYTES}).encode()
  assert_openai_error(post(server.base, COMPLETIONS, raw=big), 413, code="request_too_large")

  def chunks():  # no Content-Length: the limit holds while reading
    for _ in range(MAX_BODY_BYTES // 1024 + 2):
      yield b" " * 1024

  r = httpx.post(server.base + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
  assert "content-length" not in r.request.headers
  assert_openai_error(r, 413, code="request_too_large")
  r = post(server.base, COMPLETIONS, {"prompt": "hi", "max_tokens": 1})
  assert r.status_code == 200


def test_fuzz_script_against_the_in_process_server(server, tmp_path):
  """launch/fuzz_server.py end to end with a small count: its report counts every body, with no 5xx."""
  res = subprocess.run([sys.executable, str(sf.REPO / "launch" / "fuzz_server.py"), f"--base_url={server.base}",
                        "--count=30", "--concurrency=4", "--valid_max_tokens=24", "--vocab_size=320",
                        f"--output_dir={tmp_path}", "--seed=3"], cwd=sf.REPO, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  report = json.loads((tmp_path / "hostile_fuzz.json").read_text())
  (run,) = report["runs"]
  assert report["passed"] and run["bodies_sent"] == 30 and sum(run["status_classes"].values()) == 30
  assert run["responses_5xx"] == 0 and run["valid_stream"]["runs_during_fuzz"] >= 1
  assert "| 5xx |" in (tmp_path / "hostile_fuzz.md").read_text()
  # the script only targets loopback addresses
  res = subprocess.run([sys.executable, str(sf.REPO / "launch" / "fuzz_server.py"), "--base-url=http://192.0.2.1:80",
                        "--count=1"], cwd=sf.REPO, capture_output=True, text=True, timeout=120)
  assert res.returncode != 0 and "loopback" in res.stderr


# ---- request isolation in the engine (no HTTP) -----------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 30], [7, 7, 7, 8, 9, 10], [40, 41, 42]]


@pytest.fixture
def engine(tiny_llm):
  tiny_llm.set_policy(LinearStrategy(8))
  eng = tiny_llm.engine
  assert not eng.has_work()
  yield eng
  assert not eng.has_work()
  assert eng.allocator.num_used == 0  # every failed request's pages were freed
  eng.allocator.check()


@pytest.fixture
def alone(engine):
  reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
  engine.run_until_done()
  return [r.output_ids for r in reqs]


def _run(engine, reqs):
  while engine.has_work():
    engine.step()
  return reqs


def test_engine_bad_sampling_row_fails_alone(engine, alone, caplog):
  # values that bypass validation are refused when the request is added, before it can join a batch
  for top_k in (2**31, 2**63):
    with pytest.raises(RequestError) as e:
      engine.add_request([5, 6], SamplingParams(max_tokens=4, top_k=top_k), validated=True)
    assert e.value.param == "top_k"
  # a request changed after it was added is converted before batching: it fails alone, logged with a traceback
  reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
  engine.step()  # all three are admitted, prefilled and share a decode batch from now on
  bad = engine.add_request([11, 12, 13], GREEDY)
  bad.params = SamplingParams(max_tokens=24, temperature=0.0, top_k=2**63)
  bad.sampling = None
  with caplog.at_level(logging.ERROR, logger="recguide_jax.engine"):
    _run(engine, reqs)
  assert bad.finish_reason == "error" and "top_k" in bad.error
  assert [r.output_ids for r in reqs] == alone and all(r.finish_reason == "length" for r in reqs)
  assert any(rec.exc_info and bad.request_id in rec.getMessage() for rec in caplog.records)


def test_engine_failing_callback_or_plan_fails_alone(engine, alone, monkeypatch):
  def broken_callback(req, new):
    if new:
      raise RuntimeError("client bridge broke")

  reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
  cb = engine.add_request([20, 21], GREEDY, on_update=broken_callback)
  planned = engine.add_request([22, 23, 24], GREEDY)
  real_plan = engine.strategy.plan_step

  def plan_step(view):  # a strategy bug that shows with one request of the step
    if planned in view.requests:
      raise ValueError("policy bug for this request")
    return real_plan(view)

  monkeypatch.setattr(engine.strategy, "plan_step", plan_step)
  _run(engine, reqs)
  assert cb.finish_reason == "error" and "callback" in cb.error
  assert planned.finish_reason == "error" and "policy bug" in planned.error
  assert [r.output_ids for r in reqs] == alone


def test_engine_failing_round_fails_its_batch_only(engine, alone, monkeypatch):
  """A host-side error inside a batched round fails that batch's requests; the engine keeps serving."""
  real = engine.runner.read_verify  # every LinearSS round reads its verification back through it
  calls = {"n": 0}

  def flaky_verify(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 2:
      raise RuntimeError("injected failure in one round")
    return real(*args, **kwargs)

  monkeypatch.setattr(engine.runner, "read_verify", flaky_verify)
  victims = [engine.add_request(p, GREEDY) for p in PROMPTS]
  _run(engine, victims)
  assert all(r.finish_reason == "error" and "injected failure" in r.error for r in victims)
  later = [engine.add_request(p, GREEDY) for p in PROMPTS]
  _run(engine, later)
  assert [r.output_ids for r in later] == alone


def test_engine_device_failure_fails_all_logged(tiny_llm, caplog, monkeypatch):
  """A runtime error from XLA is a device failure: the engine thread fails every request, with a log record."""
  tiny_llm.set_policy(LinearStrategy(8))
  eng = tiny_llm.engine

  def device_error(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("INTERNAL: injected device failure")

  monkeypatch.setattr(eng.runner, "read_verify", device_error)  # every AR or LinearSS round reads back through it
  thread = EngineThread(eng).start()
  done = threading.Event()
  finished = []

  def on_update(req, new):
    if req.finished:
      finished.append(req)
      if len(finished) == 2:
        done.set()

  with caplog.at_level(logging.ERROR):
    for i, p in enumerate(PROMPTS[:2]):
      thread.submit(p, GREEDY, f"dev-{i}", on_update)
    assert done.wait(120)
    thread.shutdown()
  assert all(r.finish_reason == "error" and "injected device failure" in r.error for r in finished)
  assert isinstance(thread.error, jax.errors.JaxRuntimeError)
  assert any("failing all" in rec.getMessage() for rec in caplog.records)
  assert any(rec.exc_info for rec in caplog.records if rec.name == "recguide_jax.engine")
  assert eng.allocator.num_used == 0 and not eng.has_work()


def test_seed_folding_keeps_small_seeds_and_uses_every_bit():
  from recguide_jax.engine.requests import fold_seed
  assert [fold_seed(s) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
  assert len({fold_seed(s) for s in (1, 2**32 + 1, -1, -2**63, 2**63 - 1)}) == 5
  assert all(0 <= fold_seed(s) < 2**32 for s in (-2**63, 2**63 - 1, -1))
  np.uint32(fold_seed(-2**63))  # fits the key array


def test_completion_top_logprobs_keep_every_entry(tmp_path):
  """Two top tokens that decode to the same text (byte tokens of a split UTF-8 character) stay two entries."""
  from recguide_jax.server import responses
  from recguide_jax.text.tokenizer import Tokenizer
  sf.build_tokenizer(tmp_path)
  tok = Tokenizer.from_dir(tmp_path)
  euro = tok.encode("\u20ac")  # three byte tokens, each of which decodes alone to U+FFFD
  assert len(euro) >= 2 and tok.decode([euro[0]]) == tok.decode([euro[1]])
  entry = {"token_id": euro[0], "logprob": -0.5, "top_logprobs": {euro[0]: -0.5, euro[1]: -1.0, 65: -2.0}}
  out, _ = responses.completion_logprobs(tok, [entry], 0)
  (top,) = out["top_logprobs"]
  assert len(top) == 3 and sorted(top.values()) == [-2.0, -1.0, -0.5]
  assert top[out["tokens"][0]] == -0.5  # the top entry keeps the text the token list shows
