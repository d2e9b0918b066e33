"""The OpenAI-compatible server, end to end: `launch/serve.py` runs as a subprocess over a tiny random checkpoint with
a real BPE tokenizer and chat template; the official `openai` client and raw httpx talk to it.

Covers: completions, chat and streams through the openai client; streamed text == non-streamed text (also with
stop strings and logprobs); OpenAI-shaped errors with the right status for every bad input while the server keeps
serving; 429 on a full queue; many concurrent streaming clients, some disconnecting, whose outputs equal offline
greedy generation, with no request lost, no pages leaked and no compilation after warm-up; /metrics parses and
agrees with the responses; engine failures become 500s / stream error events; SIGTERM drains in-flight streams
and exits 0.
"""

import asyncio
import json
import os
import socket
import sys

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # server_fixtures lives next to this file

import server_fixtures as sf  # noqa: E402

from recguide_jax import LLM

from recguide_jax import SamplingParams  # noqa: E402
from recguide_jax.server.streaming import TextDeltas, stop_position  # noqa: E402
from recguide_jax.text.tokenizer import Tokenizer  # noqa: E402

MODEL = "nld-test"  # the checkpoint directory's name: the default served model name
MAX_MODEL_LEN = 256
SERVER_ARGS = ("--max_num_seqs=8", f"--max_model_len={MAX_MODEL_LEN}", "--page_size=8", "--policy=linear",
               "--block_size=16", "--max_queue=40")

TEXT_PROMPTS = ["Hello world", "The quick brown fox", "How many clips did Natalia sell?", "def add(a, b):",
                "Betty is saving money", "Café über naïve", "1 2 3 4 5 6 7 8", "Weng earns $12 an hour"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
         [{"role": "user", "content": "Tell me about the lazy dog"}],
         [{"role": "user", "content": "Natalia sold clips"}, {"role": "assistant", "content": "48 clips."},
          {"role": "user", "content": "And in May?"}]]


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sf.build_checkpoint(tmp_path_factory.mktemp("server") / MODEL)


@pytest.fixture(scope="module")
def server_proc(ckpt, tmp_path_factory):
  """Started at once (not waited for) so its warm-up compiles while the test process computes offline outputs."""
  tmp = tmp_path_factory.mktemp("serve")
  proc = sf.ServerProcess(ckpt, tmp / "server.log", *SERVER_ARGS, f"--compile_cache_dir={tmp / 'xla'}")
  yield proc
  proc.kill()


@pytest.fixture(scope="module")
def offline_llm(ckpt, server_proc):
  # Same policy, block size, page size and length limit as the server; batch 1 so that only three step variants
  # compile here (greedy outputs do not depend on the batch: see test_engine's batch-invariance tests).
  return LLM(ckpt, "linear", 16, max_num_seqs=1, max_model_len=MAX_MODEL_LEN, page_size=8, warmup=False,
             compile_cache_dir=None)


@pytest.fixture(scope="module")
def server(server_proc, offline_llm):
  server_proc.wait_ready(timeout=300)
  return server_proc


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)


def greedy(max_tokens, **kw):
  return dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def offline_text(llm, prompt, max_tokens, chat=False):
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  (out,) = llm.chat(prompt, params) if chat else llm.generate(prompt, params)
  return out


def parse_sse(lines):
  """Data payloads of an SSE stream; asserts it ends with [DONE] and nothing follows."""
  events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
  assert events and events[-1] == "[DONE]", events[-3:]
  return [json.loads(e) for e in events[:-1]]


def stream_result(events, chat):
  text, finish, usage, spec = "", None, None, None
  for ev in events:
    assert "error" not in ev, ev
    if ev.get("usage"):
      usage, spec = ev["usage"], ev.get("speculation")
    for choice in ev["choices"]:
      text += (choice["delta"].get("content") or "") if chat else choice["text"]
      finish = choice["finish_reason"] or finish
  return text, finish, usage, spec


def post_stream(base, path, body):
  with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
    assert r.status_code == 200, r.read()
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_sse(list(r.iter_lines()))


def metrics(base) -> dict:
  """{(sample name, frozenset(labels)): value}; also checks the text parses."""
  text = httpx.get(base + "/metrics", timeout=10).text
  out = {}
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      out[(s.name, frozenset(s.labels.items()))] = s.value
  return out


def m(snapshot, name, model_name=MODEL, **labels):
  """A series' value; every series carries the served model's name (vLLM's model_name label)."""
  return snapshot.get((name, frozenset({"model_name": model_name, **labels}.items())), 0.0)


async def wait_idle(base, timeout=60.0):
  """Until nothing runs or waits and no KV page is owned (aborts are processed between engine steps)."""
  deadline = asyncio.get_running_loop().time() + timeout
  while True:
    snap = metrics(base)
    if (m(snap, "recguide:num_requests_running") == 0 and m(snap, "recguide:num_requests_waiting") == 0
        and m(snap, "recguide:kv_cache_pages_used") == 0):
      return snap
    assert asyncio.get_running_loop().time() < deadline, "server did not go idle"
    await asyncio.sleep(0.2)


# ---- incremental detokenization ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(ckpt):
  return Tokenizer.from_dir(ckpt)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_text_deltas_concatenate_to_final_text(tokenizer, data):
  """Random token streams (byte tokens split UTF-8 characters) emitted in random chunks, with stop strings cut
  from the text: the deltas never need taking back and add up to the final text, as the engine would stop."""
  # text with multi-byte characters (several byte tokens each) mixed with random tokens
  pieces = data.draw(st.lists(st.one_of(st.text(alphabet="ab +\u00e9\u045e\u20ac\U0001F600", min_size=1, max_size=6),
                                        st.integers(4, tokenizer.vocab_size - 1)), min_size=1, max_size=12))
  ids = [t for p in pieces for t in (tokenizer.encode(p) if isinstance(p, str) else [p])]
  full = tokenizer.decode(ids)
  stops = []
  if full and data.draw(st.booleans()):
    start = data.draw(st.integers(0, len(full) - 1))
    stops.append(full[start:start + data.draw(st.integers(1, 4))])
  include = data.draw(st.booleans())  # include_stop_str_in_output
  deltas, out, emitted, i = TextDeltas(tokenizer, stops, include), "", [], 0
  while i < len(ids):
    n = data.draw(st.integers(1, 6))
    emitted += ids[i:i + n]
    i += n
    out += deltas.update(emitted)  # the engine reports the tokens of the step that hit a stop string too
    if stop_position(tokenizer.decode(emitted), stops) is not None:
      break
  # the engine's rule over the whole output: cut before the earliest stop string (with include: after it)
  text = tokenizer.decode(emitted)
  pos = stop_position(text, stops)
  final = text if pos is None else text[:pos + (len(stops[0]) if include else 0)]
  out += deltas.finish(final)
  assert out == final


# ---- CLI ----------------------------------------------------------------------------------------------------------
def test_cli_rejects_bad_flags(ckpt, server_proc, tmp_path):
  bad_json = tmp_path / "profile.json"
  bad_json.write_text("{not json")
  taken = socket.socket()
  taken.bind(("127.0.0.1", 0))
  taken.listen()
  cases = [(["--port=abc"], "--port"), (["--port=70000"], "--port"), (["--block_size=1"], "--block_size"),
           (["--threshold=1.5"], "--threshold"), (["--max-num-seqs=0"], "--max_num_seqs"), (["--rule=fast"], "--rule"),
           (["--model=/no/such/dir"], "--model"), ([f"--profile={bad_json}"], "--profile"),
           (["--policy=bogus"], "--policy"), (["--port", str(taken.getsockname()[1])], "--port"),
           (["--bucketing=wide"], "--bucketing"), (["--recguide_verify_truncation"], "--recguide_verify_truncation"),
           (["--recguide_overlap_block_sizes=8,12"], "--recguide_overlap_block_sizes")]
  for args, flag in cases:
    argv = args if any(a.startswith("--model") for a in args) else [f"--model={ckpt}", *args]
    res = sf.run_cli(*argv)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, (args, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], (args, res.stderr)
  taken.close()


# ---- basic routes and the openai client ---------------------------------------------------------------------------
def test_models_health_and_metrics_format(server):
  assert httpx.get(server.base + "/health").status_code == 200
  models = httpx.get(server.base + "/v1/models").json()
  assert models["object"] == "list" and [d["id"] for d in models["data"]] == [MODEL]
  snap = metrics(server.base)
  assert m(snap, "recguide:compilations_after_warmup") == 0
  assert m(snap, "recguide:kv_cache_pages_total") > 0
  for status in ("stop", "length", "abort", "error"):
    assert ("recguide:request_success_total", frozenset({("model_name", MODEL), ("finished_reason", status)})) in snap


def test_openai_client_completion_chat_and_streams(client, offline_llm):
  resp = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
  assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
  (choice,) = resp.choices
  assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
  assert choice.text == offline_text(offline_llm, TEXT_PROMPTS[0], 12).outputs[0].text
  assert resp.usage.completion_tokens == 12
  assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
  spec = resp.model_extra["speculation"]
  assert spec["rounds"] == len(spec["accepted_lengths"]) == len(spec["block_sizes"]) > 0
  assert set(spec["block_sizes"]) == {16} and spec["forwards"]["verify"] == spec["rounds"]
  assert 1 + sum(spec["accepted_lengths"]) >= 12 and spec["ttft_s"] > 0
  assert spec["mean_accepted_length"] >= 1 and spec["draft_tokens"] == 15 * spec["rounds"]

  chat = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_completion_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True})
  assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
  assert chat.choices[0].message.role == "assistant"
  assert chat.choices[0].message.content == offline_text(offline_llm, CHATS[0], 10, chat=True).outputs[0].text
  assert chat.usage.completion_tokens == 10 and "speculation" in chat.model_extra

  chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=12, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}))
  assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
  assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

  chunks = list(client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=10, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}))
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == "length"


# ---- streamed == non-streamed -------------------------------------------------------------------------------------
def _stop_candidates(text):
  """(stop string, position) pairs: one at the start and one inside, each its first occurrence."""
  out = []
  for start in (0, 7, 12):
    s = text[start:start + 3]
    if len(s) == 3 and "\ufffd" not in s and text.find(s) == start:
      out.append((s, start))
  return out


def test_stream_equals_nonstream(server, offline_llm):
  cases = []
  for prompt in TEXT_PROMPTS:
    cases.append(("/v1/completions", {"prompt": prompt, **greedy(48)}, False))
  for conv in CHATS:
    cases.append(("/v1/chat/completions", {"messages": conv, **greedy(48)}, True))
  stop_cases = 0
  for path, body, chat in list(cases):
    full = httpx.post(server.base + path, json=body, timeout=60).json()
    text = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    for k, (stop, pos) in enumerate(_stop_candidates(text)):
      cases.append((path, {**body, "stop": [stop]}, chat))
      if k == 0:  # and kept in the text (vLLM's include_stop_str_in_output)
        cases.append((path, {**body, "stop": [stop], "include_stop_str_in_output": True}, chat))
      stop_cases += 1
  assert stop_cases >= 3
  for path, body, chat in cases:
    full = httpx.post(server.base + path, json=body, timeout=60).json()
    assert "choices" in full, (path, body, full)
    choice = full["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    events = post_stream(server.base, path, {**body, "stream_options": {"include_usage": True}})
    s_text, s_finish, s_usage, s_spec = stream_result(events, chat)
    assert s_text == text, (path, body)
    assert s_finish == choice["finish_reason"] and s_usage == full["usage"]
    assert s_spec["accepted_lengths"] == full["speculation"]["accepted_lengths"]
    if chat:
      assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    if "stop" in body:
      stop, include = body["stop"][0], body.get("include_stop_str_in_output", False)
      assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
      unstopped = httpx.post(server.base + path, json={k: v for k, v in body.items() if k != "stop"}).json()
      ref = unstopped["choices"][0]["message"]["content"] if chat else unstopped["choices"][0]["text"]
      # cut right before the stop string, even at position 0, or right after it
      assert text == ref[:ref.find(stop) + (len(stop) if include else 0)]
    else:
      prompt = body.get("messages") or body["prompt"]
      assert text == offline_text(offline_llm, prompt, 48, chat=chat).outputs[0].text


def test_truncate_prompt_tokens_uses_the_prompts_last_tokens(server):
  """vLLM's truncate_prompt_tokens: the answer, usage and echo are those of the prompt's last k tokens sent alone;
  a chat's default max_tokens is the rest of the context after them."""
  prompt = TEXT_PROMPTS[2]
  ids = httpx.post(server.base + "/tokenize", json={"prompt": prompt}).json()["tokens"]
  k = len(ids) // 2
  assert k >= 2
  cut = httpx.post(server.base + "/v1/completions",
                   json={"prompt": prompt, **greedy(8), "truncate_prompt_tokens": k, "echo": True}).json()
  short = httpx.post(server.base + "/v1/completions", json={"prompt": ids[-k:], **greedy(8), "echo": True}).json()
  assert cut["usage"] == short["usage"] and cut["usage"]["prompt_tokens"] == k
  assert cut["choices"][0]["text"] == short["choices"][0]["text"]
  chat = httpx.post(server.base + "/v1/chat/completions",
                    json={"messages": CHATS[2], "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 5})
  assert chat.status_code == 200, chat.text
  assert chat.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": MAX_MODEL_LEN - 5,
                                  "total_tokens": MAX_MODEL_LEN}


def test_return_tokens_as_token_ids_names_each_token_by_its_id(server):
  """vLLM's return_tokens_as_token_ids: logprobs name each token (and each top entry) `token_id:<id>`, streamed
  alike; the ids are the tokens the plain answer names by their text."""
  def ids_of(names):
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.removeprefix("token_id:")) for n in names]

  body = {"prompt": TEXT_PROMPTS[1], **greedy(12), "logprobs": 2}
  plain = httpx.post(server.base + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
  named = httpx.post(server.base + "/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
  lp = named["choices"][0]["logprobs"]
  ids = ids_of(lp["tokens"])
  texts = [httpx.post(server.base + "/detokenize", json={"tokens": [i]}).json()["prompt"] for i in ids]
  assert texts == plain["tokens"] and lp["token_logprobs"] == pytest.approx(plain["token_logprobs"])
  assert all(len(ids_of(list(top))) == 2 for top in lp["top_logprobs"])
  events = post_stream(server.base, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
  assert [t for ev in events for c in ev["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
  chat = {"messages": CHATS[0], **greedy(6), "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
  content = httpx.post(server.base + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
  assert len(ids_of([c["token"] for c in content])) == 6 and all(ids_of([c["top_logprobs"][0]["token"]])
                                                                 for c in content)


def test_stream_logprobs_match_nonstream(server):
  body = {"prompt": TEXT_PROMPTS[1], **greedy(20), "logprobs": 2}
  full = httpx.post(server.base + "/v1/completions", json=body).json()
  lp = full["choices"][0]["logprobs"]
  assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 20
  assert all(len(t) == 2 for t in lp["top_logprobs"])
  events = post_stream(server.base, "/v1/completions", body)
  tokens = [t for ev in events for c in ev["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
  values = [v for ev in events for c in ev["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
  assert tokens == lp["tokens"] and values == pytest.approx(lp["token_logprobs"])

  body = {"messages": CHATS[1], **greedy(12), "logprobs": True, "top_logprobs": 3}
  full = httpx.post(server.base + "/v1/chat/completions", json=body).json()
  content = full["choices"][0]["logprobs"]["content"]
  assert len(content) == 12 and all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)
  events = post_stream(server.base, "/v1/chat/completions", body)
  streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
  assert [e["token"] for e in streamed] == [c["token"] for c in content]


# ---- bad input ------------------------------------------------------------------------------------------------------
COMPLETION_ERRORS = [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output"),
    ({"prompt": "hi", "skip_special_tokens": 1}, 400, "skip_special_tokens"),
    ({"prompt": "hi", "spaces_between_special_tokens": False}, 400, "spaces_between_special_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": "4"}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "allowed_token_ids": [5, 6]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": ["x"]}, 400, "bad_words"),
    ({"prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ({"prompt": "hi", "guided_choice": ["yes", "no"]}, 400, "guided_choice"),
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "hi", "priority": 3}, 400, "priority"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 17}, 400, "n"),
    ({"prompt": "hi", "best_of": 0}, 400, "best_of"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": 123}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": [5, 10**6]}, 400, "prompt"),
    ({"prompt": [5, True]}, 400, "prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, 413, "prompt"),
]
CHAT_ERRORS = [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    ({"messages": CHATS[0], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": CHATS[0], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHATS[0], "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"messages": CHATS[0], "logprobs": 1}, 400, "logprobs"),
    ({"messages": CHATS[0], "n": 17}, 400, "n"),
    ({"messages": CHATS[0], "temperature": -1}, 400, "temperature"),
    ({"messages": CHATS[0], "model": "nope"}, 404, "model"),
    ({"messages": CHATS[0], "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": CHATS[0], "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ({"messages": CHATS[0], "guided_regex": "[0-9]+"}, 400, "guided_regex"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, 413, "messages"),
]


def _assert_error(r, status, param):
  assert r.status_code == status, (r.status_code, r.text)
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"], err
  assert err["param"] == param, err
  assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
  return err


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, client):
  base = server.base
  with httpx.Client(base_url=base, timeout=30) as h:
    for body, status, param in COMPLETION_ERRORS:
      _assert_error(h.post("/v1/completions", json=body), status, param)
    for body, status, param in CHAT_ERRORS:
      _assert_error(h.post("/v1/chat/completions", json=body), status, param)
    for path in ("/v1/completions", "/v1/chat/completions"):
      err = _assert_error(h.post(path, content=b"{not json", headers={"content-type": "application/json"}), 400, None)
      assert err["code"] == "invalid_json"
      _assert_error(h.post(path, json=[1, 2]), 400, None)
      _assert_error(h.post(path, content=b"\xff\xfe"), 400, None)
    _assert_error(h.get("/v1/nope"), 404, None)
    _assert_error(h.get("/v1/completions"), 405, None)
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model=MODEL, prompt="hi", n=0)
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="gpt-4", prompt="hi")
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model=MODEL, messages=CHATS[0], temperature=-1)
  # still serving
  resp = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
  assert resp.usage.completion_tokens == 5
  assert httpx.get(base + "/health").status_code == 200
  snap = metrics(base)
  assert m(snap, "recguide:http_errors_total", code="400") >= len(COMPLETION_ERRORS) - 4


def test_queue_full_gives_429(server):
  """More streams than max_batch + max_queue (8 + 40): the overflow gets 429, the rest are served or cancelled."""

  async def flood():
    async with httpx.AsyncClient(base_url=server.base, timeout=60,
                                 limits=httpx.Limits(max_connections=100)) as h:
      statuses, bodies = [], []

      async def one(i):
        body = {"prompt": TEXT_PROMPTS[i % 8], **greedy(200), "stream": True}
        async with h.stream("POST", "/v1/completions", json=body) as r:
          statuses.append(r.status_code)
          if r.status_code != 200:
            bodies.append(json.loads(await r.aread()))
          else:
            await asyncio.sleep(1.0)  # hold the slot while the others arrive, then hang up

      await asyncio.gather(*(one(i) for i in range(72)))
      return statuses, bodies

  statuses, bodies = asyncio.run(flood())
  assert set(statuses) <= {200, 429}
  assert statuses.count(429) >= 1 and statuses.count(200) >= 8
  for b in bodies:
    assert b["error"]["type"] == "rate_limit_error" and b["error"]["code"] == "rate_limit_exceeded"
  asyncio.run(wait_idle(server.base))
  r = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", **greedy(4)})
  assert r.status_code == 200


# ---- concurrency, disconnects and metrics -------------------------------------------------------------------------
def test_concurrent_streams_with_disconnects(server, offline_llm):
  jobs = []  # (kind, path, body, chat, prompt, max_tokens)
  for i in range(36):
    chat = i % 3 == 2
    prompt = CHATS[i % len(CHATS)] if chat else TEXT_PROMPTS[i % len(TEXT_PROMPTS)]
    max_tokens = [24, 40, 64, 17][i % 4]
    kind = "hangup" if i % 4 == 3 else "stream"
    if kind == "hangup":
      max_tokens = 180
    path = "/v1/chat/completions" if chat else "/v1/completions"
    key = "messages" if chat else "prompt"
    jobs.append((kind, path, {key: prompt, **greedy(max_tokens)}, chat, prompt, max_tokens))
  for i in range(3):  # non-streaming clients that give up while queued behind everyone
    jobs.append(("timeout", "/v1/completions", {"prompt": TEXT_PROMPTS[i], **greedy(220)}, False, None, 220))
  expected = {}
  for kind, _, _, chat, prompt, max_tokens in jobs:
    if kind == "stream":
      key = (json.dumps(prompt), max_tokens)
      if key not in expected:
        expected[key] = offline_text(offline_llm, prompt, max_tokens, chat=chat)
  before = metrics(server.base)

  async def run_all():
    async with httpx.AsyncClient(base_url=server.base, timeout=120,
                                 limits=httpx.Limits(max_connections=100)) as h:

      async def one(kind, path, body, chat):
        if kind == "timeout":
          await asyncio.sleep(0.05)  # arrive last: queued behind the streams
          with pytest.raises(httpx.ReadTimeout):
            await h.post(path, json=body, timeout=httpx.Timeout(60, read=0.15))
          return None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with h.stream("POST", path, json=body) as r:
          assert r.status_code == 200, await r.aread()
          if kind == "hangup":
            async for _ in r.aiter_lines():
              break  # one line, then close the connection mid-stream
            return None
          lines = [ln async for ln in r.aiter_lines()]
        return stream_result(parse_sse(lines), chat)

      return await asyncio.gather(*(one(k, p, b, c) for k, p, b, c, _, _ in jobs))

  results = asyncio.run(run_all())
  after = asyncio.run(wait_idle(server.base))
  served = 0
  tokens = 0
  for (kind, _, _, chat, prompt, max_tokens), res in zip(jobs, results):
    if kind != "stream":
      assert res is None
      continue
    text, finish, use, spec = res
    exp = expected[(json.dumps(prompt), max_tokens)]
    assert text == exp.outputs[0].text and finish == exp.outputs[0].finish_reason
    assert use["completion_tokens"] == len(exp.outputs[0].token_ids)
    assert use["prompt_tokens"] == len(exp.prompt_token_ids)
    served += 1
    tokens += use["completion_tokens"]
  hangups = sum(1 for j in jobs if j[0] != "stream")
  delta = {s: m(after, "recguide:request_success_total", finished_reason=s) - m(before, "recguide:request_success_total", finished_reason=s)
           for s in ("stop", "length", "abort", "error")}
  assert delta["error"] == 0
  assert delta["stop"] + delta["length"] + delta["abort"] == len(jobs)  # no request lost
  assert delta["abort"] == hangups
  assert m(after, "recguide:kv_cache_pages_used") == 0 and m(after, "recguide:num_requests_running") == 0
  assert m(after, "recguide:num_requests_waiting") == 0
  assert m(after, "recguide:compilations_after_warmup") == 0
  # the aborted requests' tokens count too, so served tokens are a lower bound here; exact check below
  gen = m(after, "recguide:generation_tokens_total") - m(before, "recguide:generation_tokens_total")
  assert gen >= tokens and served == len(jobs) - hangups


def test_metrics_agree_with_responses(server):
  before = asyncio.run(wait_idle(server.base))
  answers = []
  with httpx.Client(base_url=server.base, timeout=60) as h:
    for i, prompt in enumerate(TEXT_PROMPTS[:4]):
      answers.append(h.post("/v1/completions", json={"prompt": prompt, **greedy(10 + 5 * i)}).json())
    answers.append(h.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 30, "temperature": 0,
                                                   "stop_token_ids": [2]}).json())
    for conv in CHATS[:2]:
      events = post_stream(server.base, "/v1/chat/completions",
                           {"messages": conv, **greedy(15), "stream_options": {"include_usage": True}})
      text, finish, use, spec = stream_result(events, True)
      answers.append({"choices": [{"finish_reason": finish}], "usage": use, "speculation": spec})
  after = metrics(server.base)

  def d(name, **labels):
    return m(after, name, **labels) - m(before, name, **labels)

  for status in ("stop", "length"):
    assert d("recguide:request_success_total", finished_reason=status) == sum(
        a["choices"][0]["finish_reason"] == status for a in answers)
  assert d("recguide:generation_tokens_total") == sum(a["usage"]["completion_tokens"] for a in answers)
  assert d("recguide:prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
  assert d("recguide:e2e_request_latency_seconds_count") == len(answers)
  assert d("recguide:time_to_first_token_seconds_count") == len(answers)
  specs = [a["speculation"] for a in answers]
  rounds = sum(s["rounds"] for s in specs)
  assert d("recguide:block_size_rounds_total", block_size="16") == rounds
  assert d("recguide:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in specs)
  assert d("recguide:spec_decode_num_accepted_tokens_total") == sum(s["accepted_draft_tokens"] for s in specs)
  assert d("recguide:spec_decode_num_drafts_total") == rounds
  accepted_positions = sum(d("recguide:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                           for p in range(15))
  assert accepted_positions == sum(s["accepted_draft_tokens"] for s in specs)
  assert d("recguide:forwards_total", kind="prefill") >= 1 and d("recguide:forwards_total", kind="verify") >= 1
  assert not any(name.startswith("recguide:overlap") for name, _ in after)  # LinearSS exports no RecGuide series


# ---- in-process app: engine failures, several apps per process ----------------------------------------------------
def test_engine_failure_is_500_and_error_event(offline_llm):
  from fastapi.testclient import TestClient

  from recguide_jax.engine.thread import EngineThread
  from recguide_jax.server.app import create_app

  thread = EngineThread(offline_llm.engine).start()
  app = create_app(thread, offline_llm.tokenizer, "inproc")
  other = create_app(thread, offline_llm.tokenizer, "other", shutdown_engine=False)  # own registry: no clash
  assert b"recguide:request_success_total" in other.state.metrics.render()
  runner = offline_llm.runner  # every AR or LinearSS round reads its verification back through read_verify

  def boom(*args, **kwargs):
    raise RuntimeError("injected device failure")

  with TestClient(app) as tc:
    body = {"prompt": "Hello", **greedy(8)}
    assert tc.post("/v1/completions", json=body).status_code == 200
    runner.read_verify = boom
    try:
      r = tc.post("/v1/completions", json=body)
      err = _assert_error(r, 500, None)
      assert "injected device failure" in err["message"] and err["code"] == "engine_error"
      with tc.stream("POST", "/v1/chat/completions", json={"messages": CHATS[0], **greedy(8), "stream": True}) as r:
        assert r.status_code == 200
        events = parse_sse(list(r.iter_lines()))
      assert events[0]["choices"][0]["delta"]["role"] == "assistant"
      assert events[-1]["error"]["type"] == "server_error" and "injected" in events[-1]["error"]["message"]
    finally:
      del runner.read_verify
    assert tc.post("/v1/completions", json=body).status_code == 200  # keeps serving
    assert tc.get("/health").status_code == 200
    snap = {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(tc.get("/metrics").text) for s in f.samples}
    assert m(snap, "recguide:request_success_total", "inproc", finished_reason="error") == 2
    assert m(snap, "recguide:http_errors_total", "inproc", code="500") == 2
    assert m(snap, "recguide:kv_cache_pages_used", "inproc") == 0
  assert not thread._thread.is_alive()  # the app's shutdown stopped the engine thread
  assert offline_llm.engine.allocator.num_used == 0


# ---- shutdown -----------------------------------------------------------------------------------------------------
def test_sigterm_drains_inflight_streams_then_exits(server):
  """Runs last: SIGTERM while streams are in flight; each still ends with [DONE], then the process exits 0."""

  async def run():
    async with httpx.AsyncClient(base_url=server.base, timeout=120) as h:
      started = asyncio.Event()
      count = 0

      async def one(i):
        nonlocal count
        body = {"prompt": TEXT_PROMPTS[i % 8], **greedy(200), "stream": True}
        async with h.stream("POST", "/v1/completions", json=body) as r:
          assert r.status_code == 200
          lines = []
          async for ln in r.aiter_lines():
            lines.append(ln)
            if ln.startswith("data: ") and not started.is_set():
              count += 1
              if count == 4:
                started.set()
        return stream_result(parse_sse(lines), False)

      tasks = [asyncio.ensure_future(one(i)) for i in range(12)]
      await asyncio.wait_for(started.wait(), 60)
      code = asyncio.get_running_loop().run_in_executor(None, server.terminate, 120)
      results = await asyncio.gather(*tasks)
      return results, await code

  results, code = asyncio.run(run())
  assert all(finish == "length" and use is None for _, finish, use, _ in results)
  assert code == 0, server.log()[-3000:]
  log = server.log()
  assert "Shutting down" in log and "stopping the engine" in log
  with pytest.raises(httpx.TransportError):
    httpx.get(server.base + "/health", timeout=2)
