"""The peer benchmark (launch/bench_peer.py) and the step-time-vs-max_model_len benchmark (launch/bench_context.py)
at tiny sizes: their main paths run end to end, write the JSON + markdown they promise, our fp32 greedy tokens equal
transformers' on the same converted weights, and the weight export behind `--model` is the exact inverse of the
converter. No wall-clock figure is asserted."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

import bench_context  # noqa: E402
import bench_peer  # noqa: E402

TINY = bench_peer.RandomModelSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256)


def _quiet(*args, **kwargs):
  del args, kwargs


def test_peer_tiny_random_model_matches_transformers(tmp_path):
  cfg = bench_peer.PeerConfig(model=TINY, dtypes=("float32",), batch_sizes=(2,), prompt_lens=(12,), new_tokens=6,
                              repeats=1, policies=("ar", "linear"), block_sizes=(8,), max_model_len=64, threads=1)
  result = bench_peer.run_peer(cfg, log=_quiet)
  js, md = bench_peer.write_outputs(result, tmp_path)
  data = json.loads(open(js).read())
  meta = data["meta"]
  assert meta["model"]["kind"] == "random" and meta["model"]["layers"] == 2 and meta["model"]["parameters"] > 0
  assert meta["torch_threads"] == 1 and meta["new_tokens"] == 6 and meta["policies"] == ["ar", "linear B=8"]
  assert meta["layer_loops"] == ["scan"]  # a model this small fits the host cache: the scanned layers
  assert meta["decode_steps"] == [4] and meta["cpu_model"]  # the LLM's default; where the figures were taken
  assert len(data["cells"]) == 1
  cell = data["cells"][0]
  assert (cell["dtype"], cell["batch"], cell["prompt_len"], cell["max_model_len"]) == ("float32", 2, 12, 64)
  assert set(cell["configs"]) == {"ours ar", "ours linear B=8", "theirs"}
  for name, row in cell["configs"].items():
    for key in ("tokens_per_s", "decode_tokens_per_s", "wall_s", "ttft_s", "warmup_wall_s"):
      assert row[key] > 0, (name, key)
    assert len(row["wall_s_all"]) == 1
    if name != "theirs":
      assert row["ratio_decode_tokens_per_s"] > 0 and row["repeats_identical"]
      # fp32, same weights: greedy tokens equal transformers' row by row, and LinearSS equals our AR (lossless)
      assert [r["equal"] for r in row["rows_vs_theirs"]] == [True, True], (name, row["rows_vs_theirs"])
      assert row["equal_rows_vs_theirs"] == row["equal_rows_vs_ours_ar"] == 2
  assert cell["ar_equal_to_theirs"] and bench_peer.fp32_mismatches(data) == []
  text = open(md).read()
  assert "| float32 | 2 | 12 | ours ar |" in text and "| float32 | 2 | 12 | theirs |" in text


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  """The tiny random transformers model and our checkpoint converted from it (2 layers: cheap compiles)."""
  return bench_peer.random_twin(TINY, tmp_path_factory.mktemp("tiny_peer"))


def test_a_difference_counts_as_a_near_tie_only_where_transformers_own_logits_tie():
  """fp32 programs that sum in different orders may take either side of a near-tie; anything else is a mismatch
  the benchmark exits on."""

  class Logits:  # transformers' output at every call: tokens 5 and 6 within rounding, token 7 far below
    def __call__(self, input_ids):
      logits = torch.zeros((1, input_ids.shape[1], 16))
      logits[0, -1, 5], logits[0, -1, 6], logits[0, -1, 7] = 8.0, 8.0 - 2e-5, 3.0
      return type("Out", (), {"logits": logits})()

  theirs = [[5, 9, 9], [5, 9, 9], [5, 9, 9]]
  ours = [[6, 1, 1], [7, 1, 1], [5, 9, 9]]
  rows = bench_peer.compare_rows(ours, theirs)
  bench_peer.tie_gaps(Logits(), [[1, 2], [1, 2], [1, 2]], ours, theirs, rows)
  assert rows[0]["near_tie"] and rows[0]["tie_gap"] == pytest.approx(2e-5 / 8, rel=0.01)  # fp32 logits
  assert not rows[1]["near_tie"] and rows[1]["tie_gap"] > bench_peer.NEAR_TIE_RELATIVE
  assert rows[2] == {"equal": True, "first_diff": None}
  cell = {"dtype": "float32", "batch": 3, "prompt_len": 2, "ar_equal_to_theirs": False}
  assert bench_peer.fp32_mismatches({"cells": [cell]}) == ["b=3 prompt=2"]


def test_checkpoint_export_inverts_the_converter(tiny_checkpoint):
  """The transformers twin of a converted checkpoint holds exactly the weights the checkpoint came from."""
  torch_model, ours = tiny_checkpoint
  twin = bench_peer.checkpoint_twin(ours)
  want, got = torch_model.state_dict(), twin.state_dict()
  assert set(want) == set(got)
  for name, tensor in want.items():
    np.testing.assert_array_equal(got[name].numpy(), tensor.numpy(), err_msg=name)


def test_export_rejects_unknown_and_misstacked_names():
  with pytest.raises(ValueError, match="'layers.0.self_attn.qkv_proj.kernel'"):
    bench_peer.export_state_dict({"layers.0.self_attn.qkv_proj.kernel": np.zeros((2, 2))}, num_layers=1)
  with pytest.raises(ValueError, match="'layers.mlp.up_proj.kernel' has leading axis 3, expected 2"):
    bench_peer.export_state_dict({"layers.mlp.up_proj.kernel": np.zeros((3, 4, 5))}, num_layers=2)
  # stacked and per-layer layouts give the same transformers tensors; the draft LoRA is not part of the AR model
  w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  stacked = bench_peer.export_state_dict({"layers.mlp.up_proj.kernel": w, "layers.self_attn.o_proj.lora_a": w}, 2)
  per_layer = bench_peer.export_state_dict({f"layers.{i}.mlp.up_proj.kernel": w[i] for i in range(2)}, 2)
  assert set(stacked) == set(per_layer) == {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
  for k in stacked:
    np.testing.assert_array_equal(stacked[k], per_layer[k])
  np.testing.assert_array_equal(stacked["model.layers.1.mlp.up_proj.weight"], w[1].T)


def test_peer_config_errors_name_the_flag():
  with pytest.raises(ValueError, match="--dtypes"):
    bench_peer.PeerConfig(dtypes=("float16",)).validate()
  with pytest.raises(ValueError, match="--policies"):
    bench_peer.PeerConfig(policies=("linear",)).validate()
  with pytest.raises(ValueError, match="--max_model_len 100"):
    bench_peer.PeerConfig(max_model_len=100).validate()
  with pytest.raises(ValueError, match="--policies recguide needs --model"):
    bench_peer.PeerConfig(policies=("ar", "recguide")).validate()
  with pytest.raises(ValueError, match="--block_sizes must be a subset of 8, 16, 32"):
    bench_peer.PeerConfig(block_sizes=(8, 12)).validate()
  with pytest.raises(ValueError, match="--llama_cpp must be a subset"):
    bench_peer.PeerConfig(llama_cpp=("q4_0",)).validate()
  with pytest.raises(ValueError, match="--gguf needs --model"):
    bench_peer.PeerConfig(gguf=__file__).validate()
  with pytest.raises(ValueError, match="--kv_heads"):
    bench_peer.PeerConfig(model=bench_peer.RandomModelSpec(heads=6, kv_heads=4)).validate()
  with pytest.raises(ValueError, match="--max_model_lens 32 cannot hold --context 24"):
    bench_context.ContextConfig(max_model_lens=(32,), context=24).validate()


def test_gsm8k_prompts_end_where_an_answer_starts(tmp_path):
  """Windows of chat-templated questions laid end to end, each ending at an open assistant turn: every prompt asks
  the model to answer, whatever its length."""

  class Chat:  # one token per character; the template closes the user turn and opens the assistant's
    def apply_chat_template(self, messages):
      return "<" + messages[0]["content"] + ">A:"

    def encode(self, text):
      return [ord(c) for c in text]

  data = tmp_path / "test.jsonl"
  data.write_text("".join(json.dumps({"question": f"question {i} " + "x" * (i % 7)}) + "\n" for i in range(80)))
  for n, length in ((1, 10), (4, 40), (8, 25)):
    prompts = bench_peer.make_prompts(n, length, 0, 0, Chat(), str(data))
    assert len(prompts) == n and len({tuple(p) for p in prompts}) == n
    assert all(len(p) == length and "".join(map(chr, p)).endswith(">A:") for p in prompts)
  with pytest.raises(ValueError, match="windows of 5000 tokens"):
    bench_peer.make_prompts(2, 5000, 0, 0, Chat(), str(data))


def test_context_bench_tiny(tmp_path, tiny_checkpoint):
  cfg = bench_context.ContextConfig(checkpoint=str(tiny_checkpoint[1]), max_model_lens=(64, 128), concurrency=(2,),
                                    context=20, policies=("ar", "linear"), block_size=8, rounds=2, repeats=1,
                                    page_size=8, prompt_source="random")
  result = bench_context.run_context(cfg, log=_quiet)
  js, md = bench_context.write_outputs(result, tmp_path)
  data = json.loads(open(js).read())
  assert data["meta"]["max_model_lens"] == [64, 128] and data["meta"]["prompt_source"] == "random"
  points = {(p["policy"], p["concurrency"], p["max_model_len"]): p for p in data["points"]}
  assert set(points) == {(p, 2, m) for p in ("ar", "linear B=8") for m in (64, 128)}
  for p in points.values():
    assert p["rounds"] == 2 and len(p["round_ms_all"]) == 2 and p["round_ms"] > 0
    assert p["context_first_round"] == 20 and 20 < p["context_at_last_round_max"] <= 20 + 8
  assert points[("ar", 2, 64)]["vs_smallest_max_model_len"] == 1.0
  assert points[("ar", 2, 64)]["context_at_last_round_max"] == 24  # an AR round is a call of 4 steps
  text = open(md).read()
  assert "| max_model_len | ar C=2 | linear B=8 C=2 |" in text and "| 128 |" in text
  assert "a call of 4 steps" in text and data["meta"]["decode_steps"] == 4


def test_context_bench_ar_alone_generates_enough_for_its_multi_step_rounds(tiny_checkpoint):
  """AR alone: each timed round is a call of `decode_steps` steps, so the requests must outlive rounds x steps
  tokens (one token per round ran out after two calls)."""
  for steps in (4, 1):
    cfg = bench_context.ContextConfig(checkpoint=str(tiny_checkpoint[1]), max_model_lens=(64,), concurrency=(1,),
                                      context=20, policies=("ar",), rounds=3, repeats=1, page_size=8,
                                      prompt_source="random", decode_steps=steps)
    assert cfg.max_new_tokens() == 3 * steps + 1
    (point,) = bench_context.run_context(cfg, log=_quiet)["points"]
    assert point["rounds"] == 3 and point["context_at_last_round_max"] == 20 + 2 * steps


def test_transformers_side_decodes_past_eos(tiny_checkpoint):
  """EOS is ignored on both sides: a transformers row that emits EOS keeps decoding (no stop, no padding)."""
  import copy
  torch_model, _ = tiny_checkpoint
  model = copy.deepcopy(torch_model)
  with torch.no_grad():
    model.lm_head.weight.zero_()  # all logits equal: greedy picks token 0 at every step
  model.config.eos_token_id = model.generation_config.eos_token_id = 0  # ... and token 0 is the model's EOS
  out = bench_peer.theirs_run(model, [[5, 6, 7, 8], [9, 10, 11, 12]], 5)
  assert out["tokens"] == [[0] * 5, [0] * 5]
