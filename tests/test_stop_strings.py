"""Stop strings and incremental detokenization: the engine's emission and the stream share one checker whose work
is linear in the output's length, and the incremental rule cuts exactly where a whole decode would."""

import numpy as np
import pytest

from recguide_jax.engine import output
from recguide_jax.engine.requests import Request, SamplingParams
from recguide_jax.server.streaming import TextDeltas
from recguide_jax.text.stop_strings import StopChecker
from recguide_jax.text.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
  from recguide_jax.llm import BUNDLED_CHECKPOINT
  return Tokenizer.from_dir(BUNDLED_CHECKPOINT)


def _request(stops, max_tokens, include=False, skip_special=True):
  # 50 stop strings: more than a request may carry (MAX_STOP_STRINGS), so the params are not validated here
  return Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stops, ignore_eos=True,
                                                include_stop_str_in_output=include,
                                                skip_special_tokens=skip_special))


def _emit_all(tokenizer, ids, stops, round_len=8, include=False, skip_special=True):
  r = _request(stops, len(ids) + 1, include, skip_special)
  for i in range(0, len(ids), round_len):
    _, reason = output.append_tokens(r, ids[i:i + round_len], [0.0] * round_len, None, None, frozenset(), tokenizer)
    if reason is not None:
      r.finish_reason = reason  # what the engine's finish would record
      break
  return r


def _stops_absent_from(tokenizer, ids, n, rng):
  text = tokenizer.decode(ids)
  stops = []
  while len(stops) < n:
    s = "".join(rng.choice(list("QXZ#@"), size=int(rng.integers(3, 9))))
    if s not in text:
      stops.append(s)
  return stops


@pytest.mark.parametrize("n", [2000, 4000])
def test_stop_checking_work_is_linear_in_output_length(tokenizer, n):
  rng = np.random.default_rng(0)
  ids = [int(t) for t in rng.integers(4, tokenizer.vocab_size, n)]
  stops = _stops_absent_from(tokenizer, ids, 50, rng)
  r = _emit_all(tokenizer, ids, stops)
  assert r.finish_reason is None and len(r.output_ids) == n
  st = r.stop_text
  text_len, longest, rounds = len(st.detokenizer.text), st.checker.longest, n // 8
  # each round searches its new text plus the longest stop string's reach back, for each of the 50 stop strings
  assert st.checker.scanned <= 50 * (text_len + rounds * longest)
  # each token is decoded in a window of the few tokens since the last complete character
  assert st.detokenizer.decoded_tokens <= 2 * n * 4
  # a quadratic check (the whole text per round) would have scanned ~ rounds * text_len / 2 per stop string
  assert st.checker.scanned < 50 * rounds * text_len / 20
  # and the stream's deltas over the same tokens, in the same rounds, do linear work too
  deltas = TextDeltas(tokenizer, stops)
  sent = "".join(deltas.update(ids[:i + 8]) for i in range(0, n, 8))
  assert sent == st.detokenizer.text[:len(sent)] and len(sent) >= text_len - longest
  assert deltas.stops.scanned <= 50 * (text_len + rounds * longest)
  assert deltas.detokenizer.decoded_tokens <= 2 * n * 4


def _cut_by_whole_decode(tokenizer, ids, stops, include=False):
  """The engine's rule as a whole decode states it: the shortest token prefix whose text reaches the earliest stop
  string, and the text before it; with `include` (include_stop_str_in_output), the shortest prefix whose text holds
  the whole stop string, and the text up to its end."""
  text = tokenizer.decode(ids)
  hits = [(text.find(s), s) for s in stops if s in text]
  if not hits:
    return None
  pos, stop = min(hits, key=lambda hit: hit[0])
  end = pos + len(stop) if include else pos
  reach = end - 1 if include else pos
  n = next((k for k in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:k])) > reach), len(ids))
  return ids[:n], text[:end]


@pytest.mark.parametrize("include", [False, True])
def test_incremental_cut_equals_the_whole_decode_rule(tokenizer, include):
  rng = np.random.default_rng(1)
  pieces = ["ab", " +", "\u00e9", "\u20ac", "\U0001F600", "x y", "12"]
  checked = 0
  for _ in range(200):
    ids = []
    for _ in range(int(rng.integers(2, 12))):
      ids += (tokenizer.encode(str(rng.choice(pieces))) if rng.random() < 0.6
              else [int(rng.integers(4, tokenizer.vocab_size))])
    text = tokenizer.decode(ids)
    if not text:
      continue
    start = int(rng.integers(0, len(text)))
    stops = [text[start:start + int(rng.integers(1, 4))], "never-there"]
    if "\ufffd" in stops[0]:
      # a byte that does not complete a character decodes to U+FFFD; the incremental text holds complete
      # characters only, so a stop string containing U+FFFD is where it differs from the whole decode (by design)
      continue
    want = _cut_by_whole_decode(tokenizer, ids, stops, include)
    r = _emit_all(tokenizer, ids, stops, round_len=int(rng.integers(1, 5)), include=include)
    if want is None:
      assert r.finish_reason is None and r.output_ids == ids
    else:
      checked += 1
      assert (r.output_ids, r.text, r.finish_reason, r.stop_reason) == (want[0], want[1], "stop", stops[0])
      assert r.text.endswith(stops[0]) == include
  assert checked > 100


def test_checker_holds_back_stop_prefixes_and_finds_late_matches():
  c = StopChecker(["</end>", "STOP"])
  assert c.find("abc</e") is None and c.held_back("abc</e") == 3
  assert c.find("abc</end>xyz") == 3  # the match straddles the previous check's end
  assert StopChecker(["ST"]).held_back("xS") == 1 and StopChecker([]).find("anything") is None


def test_incremental_detokenizer_reaches_like_whole_decodes(tokenizer):
  ids = tokenizer.encode("a \u20ac b \U0001F600!")
  d = IncrementalDetokenizer(tokenizer)
  d.add(ids)
  assert d.text == tokenizer.decode(ids)
  assert d.reach == [len(tokenizer.decode(ids[:k + 1])) for k in range(len(ids))]


def test_special_tokens_in_the_text_only_when_asked(tokenizer):
  """skip_special_tokens=False (vLLM's) keeps special tokens' text in the output text and its stream, where a stop
  string can then match it; the default leaves them out. The token ids are the same either way."""
  end = tokenizer.token_to_id("<|end|>")
  ids = tokenizer.encode("ab 12") + [end] + tokenizer.encode(" x y")
  for skip in (True, False):
    r = _request([], len(ids) + 1, skip_special=skip)
    output.append_tokens(r, ids, [0.0] * len(ids), None, None, frozenset(), tokenizer)
    text = output.final_text(r, tokenizer)
    assert r.output_ids == ids and ("<|end|>" in text) != skip
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    deltas = TextDeltas.for_params(tokenizer, r.params)
    assert deltas.update(ids) + deltas.finish(text) == text
  r = _emit_all(tokenizer, ids, ["<|end|>"], round_len=2, skip_special=False)
  cut = ids.index(end)
  assert (r.finish_reason, r.output_ids, r.text) == ("stop", ids[:cut + 1], tokenizer.decode(ids[:cut]))
  assert _emit_all(tokenizer, ids, ["<|end|>"], round_len=2).finish_reason is None  # its text is skipped
