"""Shadow tracing through the engine: every round runs B = 8/16/32 from the same committed state, the committed
output stays greedy AR's, and the rows it writes are valid trace rows with one counterfactual length per B."""

import json

from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.recguide.fit import traces
from recguide_jax.recguide.fit.shadow import ShadowTraceStrategy

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 10, 11], [40] * 7]


def test_shadow_trace_is_lossless_and_writes_valid_rows(tiny_llm, tmp_path):
  tiny_llm.set_policy(ARStrategy())
  ar = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
  shadow = ShadowTraceStrategy("syn", seed=1)
  tiny_llm.set_policy(shadow)
  outs = tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == ar
  assert len(shadow.rows) == sum(o.metrics["rounds"] for o in outs)
  for o in outs:  # three drafts and three verifies per round, one of each committed
    assert o.metrics["forwards"]["draft"] == o.metrics["forwards"]["verify"] == 3 * o.metrics["rounds"]
  path = tmp_path / "shadow.jsonl"
  shadow.write(path)
  rows = traces.load_trace_rows(path)
  assert all(set(r["A"]) == {8, 16, 32} and all(1 <= a <= b for b, a in r["A"].items()) for r in rows)
  by_request = {}
  for line in path.read_text().splitlines():
    row = json.loads(line)
    by_request.setdefault(row["request_id"], []).append(row["round"])
  assert sorted(len(v) for v in by_request.values()) == sorted(o.metrics["rounds"] for o in outs)
  assert all(v == list(range(len(v))) for v in by_request.values())  # each request's rounds, in order
  assert any(r["s"] is not None and r["z"] is not None for r in rows)
  assert tiny_llm.engine.allocator.num_used == 0
