"""HF checkpoint conversion and logit parity against transformers' Ministral3 (the NLD backbone), fp32.

Each case is a tiny random `Ministral3ForCausalLM` written out as an HF NLD checkpoint, converted to our format and
loaded with `checkpoint.load_model`. Our single forward is then driven through every mode (causal, paged prefill +
decode, bidirectional draft over the cache, verify + crop, draft LoRA) and compared with torch logits computed
over the whole sequence under the equivalent full attention mask. Sequences run past 2 * original_max (16), so
YaRN and the Llama-4 query scale are both exercised.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_reference lives next to this file

import hf_reference as ref  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from recguide_jax.model import checkpoint  # noqa: E402
from recguide_jax.model.params import flatten_params  # noqa: E402
from pallas_kernels.common import causal_mask, full_mask  # noqa: E402
from recguide_jax.model.config import PRESETS, ConfigError, NLDConfig  # noqa: E402
from recguide_jax.convert.hf import ConversionError, convert_hf_checkpoint  # noqa: E402
from recguide_jax.cache.kv_cache import TRASH_PAGE, PageAllocator  # noqa: E402
from recguide_jax.model.nld import ForwardInputs  # noqa: E402
from recguide_jax.model import rope  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
ATOL = 1e-4
SEQ = 40  # positions 0..39: floor(p / 16) reaches 2, so the Llama-4 scale is 1 + 0.1 ln 3 at the end
# Prompt and block have one length, so the jitted forward compiles once per shape and case (compiles dominate).
PROMPT = BLOCK = 8

# GQA ratios 1, 2, 4; head_dim never hidden/heads; YaRN factor != 1 with ramps that straddle several frequencies;
# one case with attention_factor != 1 (mscale != mscale_all_dim) and one with rope_theta 1e9 (as NLD-14B).
CASES = {
    "gqa1": dict(heads=4, kv_heads=4, head_dim=24, layers=2, theta=1.0e4, factor=4.0, beta_fast=2.0, beta_slow=0.25),
    "gqa2": dict(heads=4, kv_heads=2, head_dim=32, layers=2, theta=1.0e6, factor=8.0, beta_fast=4.0, beta_slow=0.1,
                 mscale=1.0, mscale_all_dim=0.5),
    "gqa4_theta1e9": dict(heads=8, kv_heads=2, head_dim=16, layers=2, theta=1.0e9, factor=16.0),
}
SHARDS = {"gqa1": 1, "gqa2": 3, "gqa4_theta1e9": 1}
CLI_CASE = "gqa4_theta1e9"  # converted through launch/convert_checkpoint.py, the others through the library


def _run_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / "launch" / "convert_checkpoint.py"), *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


class Case:

  def __init__(self, name: str, root: pathlib.Path):
    self.name = name
    self.nld = ref.nld_config_dict(**CASES[name])
    self.torch_model = ref.build_model(self.nld, seed=len(name))
    self.tensors = ref.nld_state_dict(self.torch_model)
    self.hf_dir = ref.write_hf_dir(root / "hf", self.nld, self.tensors, shards=SHARDS[name])
    self.out_dir = root / "ours"
    if name == CLI_CASE:
      proc = _run_cli(f"--hf_dir={self.hf_dir}", f"--output_dir={self.out_dir}", "--dtype=float32")
      assert proc.returncode == 0, proc.stderr
      assert "wrote" in proc.stdout
    else:
      convert_hf_checkpoint(self.hf_dir, self.out_dir, dtype="float32", progress=False)
    self.model = checkpoint.load_model(self.out_dir)
    self.tokens = np.random.RandomState(len(name) + 7).randint(0, self.nld["vocab_size"], size=SEQ)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
  return Case(request.param, tmp_path_factory.mktemp(request.param))


# ---- driving our forward ---------------------------------------------------------------------------------------

@nnx.jit
def _apply(model, arrays: dict, cache):
  # Jitted because eager dispatch compiles every op for every new shape, which dominated the run time.
  return model(ForwardInputs(**arrays), cache)


class Paged:
  """One request in a paged cache whose pages are deliberately out of order (another request held pages first)."""

  def __init__(self, model, page_size: int = 4, num_pages: int = 24):
    self.model = model
    self.alloc = PageAllocator(num_pages, page_size, max_pages_per_seq=16)
    self.alloc.add("other")
    self.alloc.reserve("other", 3 * page_size)
    self.alloc.add("seq")
    self.alloc.reserve("seq", page_size)
    self.alloc.free("other")  # its pages come back and are handed to "seq" next: page table [4, 1, 2, 3, 5, ...]
    self.cache = model.new_cache(num_pages, page_size)

  @property
  def length(self) -> int:
    return self.alloc.length("seq")

  def forward(self, tokens, block_mask, *, write: bool, kv_write=None, lora_mask=None) -> np.ndarray:
    """Runs `tokens` at positions length..length+T-1 over the committed prefix; commits them if `write`."""
    start, t = self.length, len(tokens)
    if write:
      self.alloc.reserve("seq", start + t)
      kv_write = np.ones((t,), bool)
    page_table = self.alloc.page_table_row("seq", self.alloc.max_pages_per_seq)
    logits, self.cache = _apply(self.model, dict(
        tokens=np.asarray(tokens, np.int32)[None], positions=np.arange(start, start + t, dtype=np.int32)[None],
        block_mask=np.asarray(block_mask), prefix_len=np.asarray([start], np.int32), page_table=page_table[None],
        kv_write=None if kv_write is None else np.asarray(kv_write)[None],
        lora_mask=None if lora_mask is None else np.asarray(lora_mask)[None]), self.cache)
    if write:
      self.alloc.commit("seq", start + t)
    return np.asarray(logits[0])

  def crop(self, length: int) -> None:
    self.alloc.crop("seq", length)
    self.alloc.check()


def _full_forward(model, tokens, lora_mask=None) -> np.ndarray:
  """Causal forward over the whole sequence at positions 0..T-1, no cache (prefix_len None)."""
  t = len(tokens)
  logits, _ = _apply(model, dict(
      tokens=np.asarray(tokens, np.int32)[None], positions=np.arange(t, dtype=np.int32)[None],
      block_mask=causal_mask(t), lora_mask=None if lora_mask is None else np.asarray(lora_mask)[None]), None)
  return np.asarray(logits[0])


DIFFS: dict[str, float] = {}


def _close(ours: np.ndarray, theirs: np.ndarray, what: str, atol: float = ATOL) -> None:
  diff = float(np.abs(ours - theirs).max())
  DIFFS[what] = max(diff, DIFFS.get(what, 0.0))
  assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


@pytest.fixture(scope="module", autouse=True)
def _report_diffs():
  yield
  if DIFFS:
    print("\nmax abs logit diffs: " + ", ".join(f"{k}={v:.2e}" for k, v in sorted(DIFFS.items())))


# ---- RoPE tables ------------------------------------------------------------------------------------------------

def _rope_configs():
  out = {name: PRESETS[name].to_hf_dict() for name in ("nld-3b", "nld-14b")}
  out.update({name: ref.nld_config_dict(**kw) for name, kw in CASES.items()})
  out["no_truncate"] = ref.nld_config_dict(head_dim=64, theta=1.0e5, factor=6.0, orig=512, truncate=False)
  out["explicit_attention_factor"] = ref.nld_config_dict(head_dim=32, attention_factor=0.8)
  return out


@pytest.mark.parametrize("name,raw", list(_rope_configs().items()))
def test_rope_tables_match_transformers(name, raw):
  inv_freq, attention_factor = rope.rope_tables(NLDConfig.from_hf_dict(raw))
  hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](ref.ministral3_config(raw))
  # numpy's and torch's float32 pow differ by up to 1 ulp (seen: 1.5e-7 relative), below fp32 RoPE noise.
  np.testing.assert_allclose(inv_freq, hf_inv_freq.numpy(), rtol=1e-6, atol=0)
  assert attention_factor == pytest.approx(hf_factor, rel=1e-12)


@pytest.mark.parametrize("name,low,high", [("nld-3b", 20, 37), ("nld-14b", 13, 25)])
def test_rope_ramp_bounds_match_spec(name, low, high):
  # docs/spec/nld.md §2.4: dims below `low` keep the base frequency, dims from `high` on are divided by the factor (16).
  cfg = PRESETS[name]
  inv_freq, attention_factor = rope.rope_tables(cfg)
  base = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, 128, 2, dtype=np.float32) / 128))
  np.testing.assert_allclose(inv_freq[:low], base[:low], rtol=1e-6)
  np.testing.assert_allclose(inv_freq[high:], base[high:] / 16, rtol=1e-6)
  ramp = slice(low + 1, high)
  assert np.all(inv_freq[ramp] < base[ramp]) and np.all(inv_freq[ramp] > base[ramp] / 16)
  assert attention_factor == 1.0


# ---- parity ----------------------------------------------------------------------------------------------------

def test_converted_params_equal_hf_weights(case):
  flat = flatten_params(nnx.state(case.model, nnx.Param).to_pure_dict())
  # per-layer tensors are stacked: one [L, ...] tensor per layer parameter
  assert len(flat) == 9 + 3
  assert all(v.shape[0] == case.nld["num_hidden_layers"] for n, v in flat.items() if n.startswith("layers."))
  t = case.tensors
  np.testing.assert_array_equal(flat["embed_tokens.embedding"], t["encoder.embed_tokens.weight"].numpy())
  np.testing.assert_array_equal(flat["diffusion_head.kernel"], t["diffusion_head.weight"].numpy().T)
  np.testing.assert_array_equal(flat["layers.self_attn.k_proj.kernel"][1],
                                t["encoder.layers.1.self_attn.k_proj.weight"].numpy().T)
  np.testing.assert_array_equal(flat["layers.post_attention_layernorm.weight"][0],
                                t["encoder.layers.0.post_attention_layernorm.weight"].numpy())
  for name in ref.TOKENIZER_STUBS:
    assert (case.out_dir / name).read_text() == ref.TOKENIZER_STUBS[name]


def test_causal_forward(case):
  _close(_full_forward(case.model, case.tokens), ref.torch_logits(case.torch_model, case.tokens), "causal")


def test_prefill_then_decode(case):
  want = ref.torch_logits(case.torch_model, case.tokens)
  paged = Paged(case.model)
  _close(paged.forward(case.tokens[:PROMPT], causal_mask(PROMPT), write=True), want[:PROMPT], "prefill")
  for p in range(PROMPT, SEQ):
    _close(paged.forward(case.tokens[p:p + 1], causal_mask(1), write=True)[0], want[p], "decode")
  assert paged.length == SEQ


def test_draft_sees_prefix_and_block_and_leaves_cache(case):
  c = SEQ - BLOCK  # the draft block sits at positions 32..39, past 2 * original_max
  want_causal = ref.torch_logits(case.torch_model, case.tokens)
  paged = Paged(case.model)
  paged.forward(case.tokens[:PROMPT], causal_mask(PROMPT), write=True)
  for start in range(PROMPT, c, BLOCK):  # grow the prefix with causal block commits (verify without a crop)
    got = paged.forward(case.tokens[start:start + BLOCK], causal_mask(BLOCK), write=True)
    _close(got, want_causal[start:start + BLOCK], "verify")
  assert paged.length == c
  before = [np.asarray(paged.cache.k), np.asarray(paged.cache.v)]
  block = case.tokens[c:]
  want = ref.torch_logits(case.torch_model, case.tokens, ref.draft_mask(SEQ, c))[c:]
  # kv_write all False routes the block's K/V to the trash page only.
  _close(paged.forward(block, full_mask(BLOCK), write=False, kv_write=np.zeros(BLOCK, bool)), want, "draft")
  after = [np.asarray(paged.cache.k), np.asarray(paged.cache.v)]
  for a, b in zip(before, after):  # [L, num_pages, ...]: every layer's trash page
    keep = np.arange(a.shape[1]) != TRASH_PAGE
    assert np.array_equal(a[:, keep], b[:, keep]), "kv_write=False wrote outside the trash page"
  if case.name == "gqa2":  # kv_write=None (no scatter at all) costs one more compile, so one case is enough
    _close(paged.forward(block, full_mask(BLOCK), write=False), want, "draft")
    assert all(np.array_equal(a, b) for a, b in zip(after, [np.asarray(paged.cache.k), np.asarray(paged.cache.v)]))
  assert paged.length == c
  # The check is only meaningful if bidirectional attention inside the block changes the logits.
  assert np.abs(want_causal[c:] - want).max() > 1e-2


def test_verify_crop_and_continue(case):
  accepted = 3
  paged = Paged(case.model)
  paged.forward(case.tokens[:PROMPT], causal_mask(PROMPT), write=True)
  want = ref.torch_logits(case.torch_model, case.tokens[:PROMPT + BLOCK])[PROMPT:]
  _close(paged.forward(case.tokens[PROMPT:PROMPT + BLOCK], causal_mask(BLOCK), write=True), want, "verify")
  # Keep `accepted` block tokens; the stale K/V after them must never be seen again.
  start = PROMPT + accepted
  paged.crop(start)
  rng = np.random.RandomState(3)
  seq = np.concatenate([case.tokens[:start], rng.randint(0, case.nld["vocab_size"], SEQ - start)])
  want = ref.torch_logits(case.torch_model, seq)
  _close(paged.forward(seq[start:start + BLOCK], causal_mask(BLOCK), write=True), want[start:start + BLOCK],
         "verify")
  for p in range(start + BLOCK, SEQ):
    _close(paged.forward(seq[p:p + 1], causal_mask(1), write=True)[0], want[p], "decode_after_crop")


# ---- draft LoRA ---------------------------------------------------------------------------------------------------

LORA_R, LORA_ALPHA = 4, 12.0  # scale 3.0


@pytest.fixture(scope="module")
def lora_case(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora")
  nld = ref.nld_config_dict(**CASES["gqa2"])
  model = ref.build_model(nld, seed=11)
  hf_dir = ref.write_hf_dir(root / "hf", nld, ref.nld_state_dict(model))
  a, b = ref.random_lora(nld, LORA_R, seed=5)
  lora_dir = ref.write_lora_dir(hf_dir / "linear_spec_lora", a, b, LORA_R, LORA_ALPHA)
  cfg = convert_hf_checkpoint(hf_dir, root / "ours", dtype="float32", lora_dir=lora_dir, progress=False)
  tokens = np.random.RandomState(2).randint(0, nld["vocab_size"], size=SEQ)
  return dict(model=model, a=a, b=b, cfg=cfg, ours=checkpoint.load_model(root / "ours"), out=root / "ours",
              tokens=tokens)


def test_lora_config_written(lora_case):
  raw = json.loads((lora_case["out"] / "config.json").read_text())
  assert raw["draft_lora"] == {"r": LORA_R, "lora_alpha": LORA_ALPHA, "target_modules": ["o_proj"]}
  assert lora_case["ours"].cfg.lora_scale == LORA_ALPHA / LORA_R


def test_lora_per_token_switch(lora_case):
  tokens, model = lora_case["tokens"], lora_case["model"]
  on = np.random.RandomState(4).rand(SEQ) < 0.5
  with ref.lora_hooks(model, lora_case["a"], lora_case["b"], LORA_ALPHA / LORA_R, on):
    want = ref.torch_logits(model, tokens)
  _close(_full_forward(lora_case["ours"], tokens, lora_mask=on), want, "lora_causal")
  base = ref.torch_logits(model, tokens)
  _close(_full_forward(lora_case["ours"], tokens, lora_mask=np.zeros(SEQ, bool)), base, "lora_off")
  assert np.abs(want - base).max() > 1e-2  # the adapter really changes something


def test_lora_draft_over_base_cache(lora_case):
  # The linear self-speculation draft: prefix cached by the base model (LoRA off), LoRA on for the block only.
  tokens, model = lora_case["tokens"], lora_case["model"]
  paged = Paged(lora_case["ours"])
  # Prefill and draft share one compiled shape: explicit all-off LoRA mask, and a draft whose kv_write is all False.
  paged.forward(tokens[:PROMPT], causal_mask(PROMPT), write=True, lora_mask=np.zeros(PROMPT, bool))
  total = PROMPT + BLOCK
  with ref.lora_hooks(model, lora_case["a"], lora_case["b"], LORA_ALPHA / LORA_R, np.arange(total) >= PROMPT):
    want = ref.torch_logits(model, tokens[:total], ref.draft_mask(total, PROMPT))[PROMPT:]
  got = paged.forward(tokens[PROMPT:total], full_mask(BLOCK), write=False, kv_write=np.zeros(BLOCK, bool),
                      lora_mask=np.ones(BLOCK, bool))
  _close(got, want, "lora_draft")


# ---- bf16 ---------------------------------------------------------------------------------------------------------

def test_bf16_source_reads_exactly(tmp_path):
  # Released checkpoints are bf16, which safetensors' numpy reader cannot decode: the raw-bytes path must be exact.
  nld = ref.nld_config_dict(**CASES["gqa1"])
  model = ref.build_model(nld, seed=21)
  hf_dir = ref.write_hf_dir(tmp_path / "hf", nld, ref.nld_state_dict(model), dtype=torch.bfloat16)
  convert_hf_checkpoint(hf_dir, tmp_path / "ours", dtype="float32", progress=False)
  rounded = copy.deepcopy(model)
  with torch.no_grad():
    for p in rounded.parameters():
      p.copy_(p.bfloat16().float())
  tokens = np.random.RandomState(0).randint(0, 128, size=SEQ)
  _close(_full_forward(checkpoint.load_model(tmp_path / "ours"), tokens), ref.torch_logits(rounded, tokens),
         "bf16_source")


def test_bf16_output(tmp_path):
  nld = ref.nld_config_dict(**CASES["gqa2"])
  model = ref.build_model(nld, seed=22)
  tensors = ref.nld_state_dict(model)
  hf_dir = ref.write_hf_dir(tmp_path / "hf", nld, tensors)
  convert_hf_checkpoint(hf_dir, tmp_path / "ours", dtype="bfloat16", progress=False)
  ours = checkpoint.load_model(tmp_path / "ours")
  kernel = ours.layers.mlp.down_proj.kernel[1]  # row 1 of the stacked layers
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(kernel), tensors["encoder.layers.1.mlp.down_proj.weight"].numpy().T.astype(ml_dtypes.bfloat16))
  tokens = np.random.RandomState(1).randint(0, 128, size=SEQ)
  want = ref.torch_logits(model, tokens)
  got = _full_forward(ours, tokens)
  assert got.dtype == np.float32
  # bf16 weights and activations: close to fp32 relative to the logit range (seen: 4.5 % with these deliberately
  # sharp random weights) and mostly the same top token (seen: 95 %).
  _close(got, want, "bf16_output", atol=0.1 * np.abs(want).max())
  assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.85


# ---- conversion errors ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
  nld = ref.nld_config_dict(**CASES["gqa1"])
  return nld, ref.nld_state_dict(ref.build_model(nld, seed=0))


def _convert_broken(tmp_path, nld, tensors, **kw):
  hf_dir = ref.write_hf_dir(tmp_path / "hf", nld, tensors, shards=kw.pop("shards", 1))
  return hf_dir, lambda **more: convert_hf_checkpoint(hf_dir, tmp_path / "out", dtype="float32", progress=False,
                                                        **kw, **more)


@pytest.mark.parametrize("shards", [1, 2])
def test_missing_tensor(tmp_path, small, shards):
  nld, tensors = small
  tensors = dict(tensors)
  del tensors["encoder.layers.1.mlp.up_proj.weight"]
  _, run = _convert_broken(tmp_path, nld, tensors, shards=shards)
  with pytest.raises(ConversionError, match=r"missing tensor 'encoder\.layers\.1\.mlp\.up_proj\.weight'"):
    run()
  assert not (tmp_path / "out").exists()  # validated from headers before anything is written


@pytest.mark.parametrize("extra", ["encoder.layers.2.mlp.up_proj.weight", "encoder.rotary_emb.inv_freq"])
def test_unexpected_tensor(tmp_path, small, extra):
  nld, tensors = small
  tensors = {**tensors, extra: torch.zeros(3)}
  _, run = _convert_broken(tmp_path, nld, tensors)
  with pytest.raises(ConversionError, match=f"unexpected tensor '{extra}'"):
    run()


def test_misshaped_tensor(tmp_path, small):
  nld, tensors = small
  name = "encoder.layers.0.self_attn.k_proj.weight"
  tensors = {**tensors, name: tensors[name].T.contiguous()}  # [in, out] instead of torch's [out, in]
  _, run = _convert_broken(tmp_path, nld, tensors)
  with pytest.raises(ConversionError, match=f"tensor '{name}' .* has shape \\[64, 96\\], config implies \\[96, 64\\]"):
    run()


def test_missing_shard(tmp_path, small):
  nld, tensors = small
  hf_dir, run = _convert_broken(tmp_path, nld, tensors, shards=2)
  (hf_dir / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors .* does not exist"):
    run()


def test_missing_config_field(tmp_path, small):
  nld, tensors = small
  nld = {k: v for k, v in nld.items() if k != "head_dim"}
  _, run = _convert_broken(tmp_path, nld, tensors)
  with pytest.raises(ConfigError, match="'head_dim'"):
    run()


def test_lora_errors(tmp_path, small):
  nld, tensors = small
  hf_dir, run = _convert_broken(tmp_path, nld, tensors)
  a, b = ref.random_lora(nld, 4, seed=0)
  lora_dir = ref.write_lora_dir(tmp_path / "lora", a, b, r=8, alpha=16)  # config says r=8, tensors are rank 4
  with pytest.raises(ConversionError, match=r"tensor 'base_model\.model\.encoder\.layers\.0\.self_attn\.o_proj\."
                                            r"lora_A\.weight' .* has shape \[4, 96\], config implies \[8, 96\]"):
    run(lora_dir=lora_dir)
  ref.write_lora_dir(lora_dir, a, b, r=4, alpha=16)
  name_a, name_b = ref.lora_tensor_names(1)
  kept = {k: v for k, v in safetensors.torch.load_file(lora_dir / "adapter_model.safetensors").items() if k != name_b}
  safetensors.torch.save_file(kept, lora_dir / "adapter_model.safetensors")
  with pytest.raises(ConversionError, match=f"missing tensor '{name_b}'"):
    run(lora_dir=lora_dir)
  cfg = json.loads((lora_dir / "adapter_config.json").read_text())
  (lora_dir / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "o_proj"]}))
  with pytest.raises(ConversionError, match="'target_modules'"):
    run(lora_dir=lora_dir)


def test_cli_errors_are_one_line(tmp_path, small):
  nld, tensors = small
  name = "encoder.layers.1.mlp.down_proj.weight"
  hf_dir = ref.write_hf_dir(tmp_path / "hf", nld, {**tensors, name: tensors[name][:, :-1].contiguous()})
  (hf_dir / "linear_spec_lora").mkdir()
  proc = _run_cli(f"--hf_dir={hf_dir}", f"--output_dir={tmp_path / 'out'}")
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and f"'{name}'" in errors[0], proc.stderr
  assert "--lora_dir=" in proc.stderr  # hint: the adapter folder exists but was not asked for
  for args, flag in [((f"--hf_dir={tmp_path / 'nope'}",), "--hf_dir"),
                     ((f"--hf_dir={hf_dir}", f"--lora_dir={tmp_path / 'nope'}"), "--lora_dir")]:
    proc = _run_cli(*args, f"--output_dir={tmp_path / 'out'}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {flag}: {tmp_path / 'nope'} is not a directory"]
