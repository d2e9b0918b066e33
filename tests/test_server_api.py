"""vLLM-compatible request handling (issue #19): the real app served in-process over a tiny checkpoint with a real
BPE tokenizer, with an API key and CORS on.

Covers: the official `openai` client with the right key (works), a wrong or missing key (401 in OpenAI's error
shape, `openai.AuthenticationError`) while /health, /metrics, /version and /tokenize stay open; CORS preflight and
a disallowed origin; X-Request-Id honoured as the response id and echoed (a non-sane one replaced); unknown fields
ignored with a logged warning (strict mode: 400 naming the field); min_p, response_format, chat_template_kwargs and
stream_options.continuous_usage_stats; n samples (non-streamed and streamed, seeds per index, one shared
prefill), best_of, echo with prompt logprobs (also max_tokens=0 and streamed); /tokenize and /detokenize round
trips and their validation; /v1/models' max_model_len; the offline API's vLLM-shaped RequestOutput (its
CompletionOutputs, no flat fields); `serve.py` positional checkpoint errors.
"""

import contextlib
import dataclasses
import io
import json
import logging
import os
import sys

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # server_fixtures lives next to this file

import server_fixtures as sf  # noqa: E402

from recguide_jax import LLM

from recguide_jax import CompletionOutput, RequestOutput

from recguide_jax import SamplingParams  # noqa: E402
from recguide_jax.engine.thread import EngineThread  # noqa: E402
from recguide_jax.server.app import create_app
from recguide_jax.server import protocol  # noqa: E402
from recguide_jax.text.tokenizer import Tokenizer  # noqa: E402

MODEL = "nld-api"
MAX_MODEL_LEN = 128
API_KEY = "test-key-123"
ORIGIN = "https://ui.example.com"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
ECHO_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  ckpt = sf.build_checkpoint(tmp_path_factory.mktemp("api") / MODEL)
  return LLM(ckpt, "linear", 8, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, page_size=8, prefill_chunk=16,
             warmup=False, compile_cache_dir=None)


@pytest.fixture(scope="module")
def offline(llm):
  """The offline API's results, computed before the server's engine thread takes the engine over."""
  params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
  bar = io.StringIO()
  with contextlib.redirect_stderr(bar):  # use_tqdm defaults to True
    default_bar = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
  return {
      "generate": llm.generate(["Hello world", [5, 6, 7]], params, use_tqdm=False),
      "chat": llm.chat(CHAT, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False,
                       chat_template_kwargs={"unused": 1}),
      "hello": llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0],
      "three": llm.generate(["The quick brown fox"], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3,
                                                                   ignore_eos=True), use_tqdm=False)[0],
      "best": llm.generate(["The quick brown fox"], SamplingParams(max_tokens=6, temperature=1.0, seed=5, best_of=3,
                                                                  ignore_eos=True), use_tqdm=False)[0],
      "scored": llm.generate([ECHO_PROMPT], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1,
                                                          prompt_logprobs=1), use_tqdm=False)[0],
      "bar": bar.getvalue(), "default_bar": default_bar}


@pytest.fixture(scope="module")
def server(llm, offline):
  thread = EngineThread(llm.engine).start()
  app = create_app(thread, llm.tokenizer, MODEL, api_key=API_KEY, allowed_origins=[ORIGIN],
                   log_stats_interval_s=0)
  srv = sf.InProcessServer(app)
  yield srv
  srv.stop()
  assert llm.engine.allocator.num_used == 0


def client(server, key=API_KEY) -> openai.OpenAI:
  return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=120)


def post(server, path, body, key=API_KEY, headers=None) -> httpx.Response:
  auth = {"Authorization": f"Bearer {key}"} if key else {}
  return httpx.post(server.base + path, json=body, headers={**auth, **(headers or {})}, timeout=120)


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
  assert r.status_code == status, (r.status_code, r.text[:400])
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"], err
  assert err["type"] == "invalid_request_error", err
  if param is not None:
    assert err["param"] == param, err
  if code is not None:
    assert err["code"] == code, err
  return err


# ---- auth -------------------------------------------------------------------------------------------------------
def test_openai_client_with_the_right_key(server, offline):
  c = client(server)
  out = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0)
  assert out.choices[0].text == offline["hello"].outputs[0].text
  chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
  assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens <= 3
  assert [m.id for m in c.models.list().data] == [MODEL]


@pytest.mark.parametrize("key", ["wrong-key", API_KEY + "x"])
def test_openai_client_with_a_wrong_key_is_401(server, key):
  with pytest.raises(openai.AuthenticationError) as e:
    client(server, key).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
  assert e.value.status_code == 401


def test_missing_key_is_401_in_openai_shape_and_open_routes_stay_open(server):
  for path in ("/v1/completions", "/v1/chat/completions"):
    r = post(server, path, {"prompt": "hi", "messages": CHAT}, key=None)
    err = assert_error(r, 401, code="invalid_api_key")
    assert "Bearer" in err["message"] and r.headers["www-authenticate"] == "Bearer"
  assert_error(httpx.get(server.base + "/v1/models", headers={"Authorization": "Basic abc"}), 401)
  assert httpx.get(server.base + "/health").status_code == 200
  assert httpx.get(server.base + "/metrics").status_code == 200
  assert httpx.get(server.base + "/version").json()["version"]
  assert post(server, "/tokenize", {"prompt": "hi"}, key=None).status_code == 200


# ---- CORS and request ids -----------------------------------------------------------------------------------------
def test_cors_preflight_and_headers(server):
  pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
         "Access-Control-Request-Headers": "authorization,content-type"}
  r = httpx.options(server.base + "/v1/chat/completions", headers=pre)  # no key: a browser sends none here
  assert r.status_code == 200, r.text
  assert r.headers["access-control-allow-origin"] == ORIGIN
  assert "POST" in r.headers["access-control-allow-methods"]
  assert "authorization" in r.headers["access-control-allow-headers"].lower()
  r = httpx.options(server.base + "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
  assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
  # a real request from the allowed origin gets the headers too, and may read X-Request-Id
  r = httpx.get(server.base + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
  assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
  assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_x_request_id_honoured_and_echoed(server):
  body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
  r = post(server, "/v1/completions", body, headers={"X-Request-Id": "trace-42.a"})
  assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a"
  assert r.json()["id"] == "cmpl-trace-42.a"
  r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True},
           headers={"X-Request-Id": "trace-43"})
  assert r.status_code == 200 and r.headers["x-request-id"] == "trace-43"
  first = json.loads(r.text.split("\n\n")[0][len("data: "):])
  assert first["id"] == "chatcmpl-trace-43"
  # not a sane id (spaces, too long): replaced by a fresh one, which is still echoed
  for bad in ("has space", "x" * 300):
    r = post(server, "/v1/completions", body, headers={"X-Request-Id": bad})
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and rid != bad and r.json()["id"] == f"cmpl-{rid}"
  # errors and open routes carry it too
  assert httpx.get(server.base + "/health", headers={"X-Request-Id": "h1"}).headers["x-request-id"] == "h1"
  assert post(server, "/v1/completions", body, key=None, headers={"X-Request-Id": "h2"}).headers["x-request-id"] \
      == "h2"


# ---- request fields --------------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
  body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "max_token": 5, "vendor_thing": {"a": 1}}
  with caplog.at_level(logging.WARNING, logger="recguide_jax.server"):
    r = post(server, "/v1/completions", body)
  assert r.status_code == 200, r.text
  assert r.json()["usage"]["completion_tokens"] <= 2
  warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
  assert warned and "max_token" in warned[0] and "vendor_thing" in warned[0]
  # the openai client's extra_body is how vLLM users send such fields
  out = client(server).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                               extra_body={"top_k": 1, "some_vllm_field": True})
  assert out.choices[0].message.content is not None


def test_strict_request_fields_refuses_unknown_fields(llm):
  tok = llm.tokenizer
  body = {"prompt": "Hello", "max_token": 5}
  with pytest.raises(protocol.APIError) as e:
    protocol.parse_completion(body, tok, MODEL, llm.cfg.vocab_size, strict=True)
  assert e.value.status == 400 and e.value.param == "max_token" and e.value.code == "unknown_parameter"
  with pytest.raises(protocol.APIError) as e:
    protocol.parse_chat({"messages": CHAT, "junk": 1}, tok, MODEL, llm.cfg.vocab_size, MAX_MODEL_LEN, strict=True)
  assert e.value.param == "junk"
  gen = protocol.parse_completion(body, tok, MODEL, llm.cfg.vocab_size)
  assert gen.ignored_fields == ("max_token",)
  # known but unsupported values are refused in both modes
  for strict in (False, True):
    with pytest.raises(protocol.APIError) as e:
      protocol.parse_completion({"prompt": "hi", "suffix": "!"}, tok, MODEL, llm.cfg.vocab_size, strict=strict)
    assert e.value.param == "suffix"


def test_min_p_and_response_format(server):
  ok = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
  # min_p is served; vLLM's fields this engine lacks pass at their neutral values
  for extra in ({"min_p": 0}, {"min_p": 0.1}, {"response_format": {"type": "text"}},
                {"use_beam_search": False, "priority": 0, "guided_json": None, "allowed_token_ids": None,
                 "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True}):
    assert post(server, "/v1/completions", {**ok, **extra}).status_code == 200
  assert_error(post(server, "/v1/completions", {**ok, "min_p": 1.5}), 400, "min_p")
  for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
    err = assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                             "response_format": fmt}), 400, "response_format")
    assert "not supported" in err["message"]


def test_chat_template_kwargs(llm, server):
  template = ("{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
              "{{ suffix | default('') }}")
  tok = Tokenizer(llm.tokenizer._tok, template, "<s>", "</s>")
  plain = protocol.render_chat({"messages": CHAT}, tok)
  thinking = protocol.render_chat({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}, tok)
  assert tok.decode(plain) == "What is 2 + 2?" and tok.decode(thinking) == "<think>What is 2 + 2?"
  with pytest.raises(protocol.APIError) as e:
    protocol.render_chat({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, tok)
  assert e.value.param == "chat_template_kwargs.messages"
  with pytest.raises(protocol.APIError) as e:
    protocol.render_chat({"messages": CHAT, "chat_template_kwargs": [1]}, tok)
  assert e.value.param == "chat_template_kwargs"
  # over HTTP: accepted (the served template ignores unknown variables)
  r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                            "chat_template_kwargs": {"enable_thinking": False}})
  assert r.status_code == 200, r.text


def test_continuous_usage_stats(server):
  body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
  r = post(server, "/v1/completions", body)
  assert r.status_code == 200
  events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n") if e.startswith("data: {")]
  text_chunks = [e for e in events if e["choices"]]
  assert text_chunks and all(e["usage"] is not None for e in text_chunks)
  counts = [e["usage"]["completion_tokens"] for e in text_chunks]
  assert counts == sorted(counts) and counts[-1] == 12
  assert all(e["usage"]["prompt_tokens"] == text_chunks[0]["usage"]["prompt_tokens"] for e in text_chunks)
  assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12  # the include_usage chunk
  assert_error(post(server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": "yes"}}), 400,
               "stream_options.continuous_usage_stats")


def test_n_independent_samples(server, offline):
  c = client(server)
  # greedy: every sample is the greedy answer
  out = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, n=2)
  assert [ch.index for ch in out.choices] == [0, 1]
  assert all(ch.text == offline["hello"].outputs[0].text for ch in out.choices)
  assert out.usage.completion_tokens == sum(len(offline["hello"].outputs[0].token_ids) for _ in range(2))
  assert out.usage.prompt_tokens == len(offline["hello"].prompt_token_ids)
  # sampled with a seed: reproducible, choice 0 equals the n=1 answer with that seed, choices differ
  kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=1.0, seed=7,
            extra_body={"ignore_eos": True})
  a = c.completions.create(n=3, **kw)
  b = c.completions.create(n=3, **kw)
  one = c.completions.create(n=1, **kw)
  texts = [ch.text for ch in a.choices]
  assert texts == [ch.text for ch in b.choices] and texts[0] == one.choices[0].text
  assert len(set(texts)) > 1, texts  # 12 tokens at temperature 1 from a random model: equal only by accident
  assert all(ch.model_extra["speculation"] for ch in a.choices)
  # choice i is the n=1 answer with seed 7 + i
  assert texts[2] == c.completions.create(**{**kw, "seed": 9}).choices[0].text
  chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, n=2)
  assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
  # streamed: each chunk names its choice; the streamed choices are the non-streamed ones
  streamed = ["", "", ""]
  usage = None
  for ch in c.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
    for choice in ch.choices:
      streamed[choice.index] += choice.text
    usage = ch.usage or usage
  assert streamed == texts and usage.completion_tokens == a.usage.completion_tokens
  deltas = ["", ""]
  for ch in c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, n=2, stream=True):
    for choice in ch.choices:
      deltas[choice.index] += choice.delta.content or ""
  assert deltas == [chat.choices[0].message.content] * 2
  assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": 17}), 400, "n")
  assert_error(post(server, "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}), 400, "best_of")
  assert_error(post(server, "/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}), 400, "best_of")


def test_best_of_returns_the_highest_cumulative_logprob(server, llm, offline):
  samples = offline["three"].outputs
  best = max(samples, key=lambda o: o.cumulative_logprob)
  alone = offline["best"]
  assert alone.outputs[0].token_ids == best.token_ids and len(alone.outputs) == 1
  out = client(server).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=1.0,
                                          seed=5, n=1, best_of=3, extra_body={"ignore_eos": True})
  assert [ch.text for ch in out.choices] == [best.text]
  two = client(server).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=1.0,
                                          seed=5, n=2, best_of=3, extra_body={"ignore_eos": True})
  ranked = sorted(samples, key=lambda o: -o.cumulative_logprob)
  assert [ch.text for ch in two.choices] == [o.text for o in ranked[:2]]


def test_n_samples_share_the_prompt_prefill(server, llm):
  totals = llm.engine.totals
  shared, computed = totals["prompt_tokens_shared"], totals["prompt_tokens"]
  prompt_len = len(llm.tokenizer.encode(ECHO_PROMPT))
  out = client(server).completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=2, temperature=0, n=2)
  assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text
  full = (prompt_len - 1) // 8 * 8  # the prompt's full pages (page_size 8), never its last token
  assert full > 0 and totals["prompt_tokens_shared"] - shared == full
  assert totals["prompt_tokens"] - computed == 2 * prompt_len - full  # the prompt is computed once
  llm.engine.allocator.check()


def test_echo_with_prompt_logprobs(server, llm, offline):
  """lm-eval's loglikelihood request: echo=true, max_tokens=0, logprobs=1."""
  c = client(server)
  ref = offline["scored"]
  prompt_ids = ref.prompt_token_ids
  out = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
  (choice,) = out.choices
  assert choice.text == ECHO_PROMPT and out.usage.completion_tokens == 0
  lp = choice.logprobs
  assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert lp.token_logprobs[1:] == pytest.approx([e["logprob"] for e in ref.prompt_logprobs[1:]], abs=1e-5)
  assert all(len(top) == 1 for top in lp.top_logprobs[1:])
  assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
  # echo with generation: the prompt, then the greedy continuation; logprobs of both in one run
  out = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0)
  (choice,) = out.choices
  assert choice.text == ECHO_PROMPT + ref.outputs[0].text
  assert len(choice.logprobs.tokens) == len(prompt_ids) + len(ref.outputs[0].token_ids)
  assert choice.logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(
      [e["logprob"] for e in ref.outputs[0].logprobs], abs=1e-5)
  # streamed: the prompt first (with its logprobs), then the continuation
  chunks = list(c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=3, echo=True, logprobs=1,
                                     temperature=0, stream=True))
  assert "".join(ch.choices[0].text for ch in chunks) == ECHO_PROMPT + ref.outputs[0].text
  assert chunks[0].choices[0].text == ECHO_PROMPT and chunks[0].choices[0].logprobs.token_logprobs[0] is None
  # echo without logprobs: the prompt's text only, nothing scored
  out = c.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=2, echo=True, temperature=0)
  assert out.choices[0].text.startswith(ECHO_PROMPT) and out.choices[0].logprobs is None
  assert_error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")
  llm.engine.allocator.check()


# ---- tokenize / detokenize / models ---------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server, llm):
  text = "Natalia sold clips to 48 of her friends"
  r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
  assert r.status_code == 200, r.text
  out = r.json()
  assert out["tokens"] == llm.tokenizer.encode(text) and out["count"] == len(out["tokens"])
  assert out["max_model_len"] == MAX_MODEL_LEN
  back = post(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
  assert back.status_code == 200 and back.json() == {"prompt": text}
  # messages are rendered by the chat template: the same count a chat completion reports as prompt_tokens
  msgs = post(server, "/tokenize", {"messages": CHAT}).json()
  chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
  assert msgs["count"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [5, True]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
])
def test_tokenize_detokenize_validation(server, path, body, param):
  r = post(server, path, body)
  assert_error(r, 404 if param == "model" else 400, param)


def test_models_have_max_model_len(server):
  r = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
  (entry,) = r.json()["data"]
  assert entry["id"] == MODEL and entry["max_model_len"] == MAX_MODEL_LEN


# ---- offline API -------------------------------------------------------------------------------------------------
def test_request_output_has_vllm_shape(llm, offline):
  """A RequestOutput's sequences are only in `outputs` (vLLM's shape): no flat text/token_ids beside them."""
  assert [f.name for f in dataclasses.fields(RequestOutput)] == [
      "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "metrics"]
  for out in offline["generate"]:
    (seq,) = out.outputs
    assert isinstance(seq, CompletionOutput) and seq.index == 0
    assert len(seq.token_ids) == 5 and seq.finish_reason == "length" and len(seq.logprobs) == 5
    assert out.finished and out.metrics["rounds"] >= 1
    assert not any(hasattr(out, name) for name in ("text", "token_ids", "logprobs", "finish_reason", "stats"))
  (chat,) = offline["chat"]
  prompt_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT))
  assert chat.prompt_token_ids == prompt_ids and chat.outputs[0].text


def test_generate_progress_bar(offline):
  assert "Processed prompts" in offline["bar"] and "1/1" in offline["bar"]
  assert offline["default_bar"][0].outputs[0].finish_reason in ("length", "stop")


# ---- serve.py ----------------------------------------------------------------------------------------------------
def test_serve_positional_checkpoint_errors(tmp_path):
  r = sf.run_cli(str(tmp_path / "a"), str(tmp_path / "b"))
  assert r.returncode == 1 and "only one positional argument" in r.stderr
  r = sf.run_cli(str(tmp_path / "missing"))
  assert r.returncode == 1 and "--model" in r.stderr and "missing is not a directory" in r.stderr
  r = sf.run_cli(str(tmp_path), f"--model={tmp_path / 'other'}")
  assert r.returncode == 1 and "disagree" in r.stderr
  r = sf.run_cli("-h")
  assert r.returncode == 0 and "--api_key" in r.stdout and "--allowed_origins" in r.stdout


# ---- issue #38: a batch of prompts, stop_reason, logprobs up to 20 ----------------------------------------------------
def test_list_of_prompts_gives_one_choice_per_prompt_and_sample(server):
  c = client(server)
  prompts = ["Hello world", "The quick brown fox"]
  kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
  alone = [c.completions.create(prompt=p, **kw) for p in prompts]
  out = c.completions.create(prompt=prompts, n=2, **kw)
  # vLLM's order: choice i * n + j is sample j of prompt i
  assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
  assert [ch.text for ch in out.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
  assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
  assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
  # token-id prompts: a list of lists, as lm-eval sends them
  ids = [httpx.post(server.base + "/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
  by_ids = c.completions.create(prompt=ids, **kw)
  assert [ch.text for ch in by_ids.choices] == [a.choices[0].text for a in alone]
  # streamed: every chunk names its choice, and the choices are the non-streamed ones
  streamed = [""] * 4
  finished = set()
  for chunk in c.completions.create(prompt=prompts, n=2, stream=True, **kw):
    for choice in chunk.choices:
      streamed[choice.index] += choice.text
      if choice.finish_reason:
        finished.add(choice.index)
  assert streamed == [ch.text for ch in out.choices] and finished == {0, 1, 2, 3}
  # echo puts each choice's own prompt first
  echoed = c.completions.create(prompt=prompts, echo=True, **kw)
  assert [ch.text for ch in echoed.choices] == [p + a.choices[0].text for p, a in zip(prompts, alone)]
  # one bad prompt refuses the batch, naming it, and queues nothing
  err = assert_error(post(server, "/v1/completions", {"prompt": [[5, 6], [10**6]], "max_tokens": 2}), 400, "prompt")
  assert "prompt[1]" in err["message"]
  assert_error(post(server, "/v1/completions", {"prompt": ["hi", ""], "max_tokens": 2}), 400, "prompt")
  assert_error(post(server, "/v1/completions", {"prompt": ["hi", 5], "max_tokens": 2}), 400, "prompt")


def test_stop_reason(server, offline):
  ref = offline["generate"][0]  # "Hello world", 5 greedy tokens, ignore_eos
  ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
  base = {"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
  c = client(server)
  out = c.completions.create(model=MODEL, **{k: v for k, v in base.items() if k != "ignore_eos"},
                             extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]})
  assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == ids[2]
  stop = text[-3:]
  assert stop.strip(), text  # a stop string the greedy text reaches
  r = post(server, "/v1/completions", {**base, "stop": ["\x01never\x01", stop]}).json()["choices"][0]
  assert r["finish_reason"] == "stop" and r["stop_reason"] == stop and stop not in r["text"]
  r = post(server, "/v1/completions", base).json()["choices"][0]
  assert r["finish_reason"] == "length" and r["stop_reason"] is None
  chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]
  assert "stop_reason" in chat and chat["stop_reason"] is None
  last = None
  for chunk in c.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]}):
    last = chunk.choices[0] if chunk.choices and chunk.choices[0].finish_reason else last
  assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == ids[2]


def test_logprobs_up_to_20(server):
  c = client(server)
  kw = dict(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
  top20 = c.completions.create(logprobs=20, **kw).choices[0].logprobs
  top5 = c.completions.create(logprobs=5, **kw).choices[0].logprobs
  assert top20.tokens == top5.tokens and len(top20.top_logprobs) == 4
  for t20, t5, chosen in zip(top20.top_logprobs, top5.top_logprobs, top20.token_logprobs):
    values = list(t20.values())
    assert len(t20) == 20 and values == sorted(values, reverse=True)
    assert list(t20.items())[:5] == list(t5.items())  # the 5-pass and the 20-pass branches agree
    assert chosen == pytest.approx(values[0])  # greedy: the chosen token is the top one
  chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                   top_logprobs=20)
  assert all(len(item.top_logprobs) == 20 for item in chat.choices[0].logprobs.content)
  assert_error(post(server, "/v1/completions", {"prompt": "hi", "logprobs": 21}), 400, "logprobs")
  assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}), 400,
               "top_logprobs")


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [5, True]}, "prompt", "prompt[1] must be an integer"),
    ({"prompt": [[5], ["a"]]}, "prompt", "prompt[1][0] must be an integer"),
    ({"prompt": {"a": 1}}, "prompt", "prompt must be a string, a list of strings, a list of token ids"),
    ({"prompt": [5], "stop": [1]}, "stop", "stop[0] must be a string"),
    ({"prompt": [5], "n": True}, "n", "n must be an integer, got true"),
    ({"prompt": [5], "temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"prompt": [5], "logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"prompt": [5], "stream": True, "stream_options": {"nope": 1}}, "stream_options.nope", "unrecognized"),
    ({"prompt": [[5]] * 1025}, "prompt", "at most 1024"),
])
def test_request_models_name_the_field(body, param, words):
  """pydantic's errors become one OpenAI-shaped 400 naming the field and quoting the value (no model needed)."""
  with pytest.raises(protocol.APIError) as e:
    protocol.parse_completion(body, None, MODEL, 320)
  assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_sampling_controls_are_served_and_checked(server):
  """vLLM's penalties, min_p, min_tokens and logit_bias are served (200);
  a value the engine cannot take is a 400 naming the field."""
  body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "presence_penalty": 0.5,
          "frequency_penalty": 0.4, "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 3, "logit_bias": {"9": 2.0}}
  r = post(server, "/v1/completions", body)
  assert r.status_code == 200, r.text[:400]
  for field, value in [("logit_bias", {"999999": 1.0}), ("presence_penalty", 2.5), ("repetition_penalty", 0),
                       ("min_p", 1.5), ("min_tokens", 7)]:
    assert_error(post(server, "/v1/completions", {**body, field: value}), 400, field)
