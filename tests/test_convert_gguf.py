"""GGUF conversion (recguide_jax/convert/gguf.py) against transformers' LlamaForCausalLM, fp32.

Each case is a tiny random Llama written to a GGUF by the `gguf` package (llama.cpp's writer) the way llama.cpp's
converter writes one: Q/K rows permuted by `LlamaModel.permute`, 2-D weights quantized (SmolLM2's Q8_0 embedding
and Q4_1 elsewhere, or F32), a byte-level BPE trained here by `tokenizers`, a ChatML template. The torch reference
holds the same dequantized weights in HF's layout, so the converted model must match it to fp32 rounding: logits of
a causal forward and the engine's greedy tokens.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from recguide_jax import LLM

from recguide_jax import SamplingParams

from recguide_jax.model import checkpoint
from recguide_jax.model.params import flatten_params
from recguide_jax.benchmarks import llama_cpp
from pallas_kernels.common import causal_mask
from recguide_jax.convert.hf import ConversionError
from recguide_jax.convert.gguf import convert_gguf_checkpoint
from recguide_jax.model.nld import ForwardInputs
from recguide_jax.text.tokenizer import Tokenizer as OurTokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
ATOL = 1e-4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"]
SPARE = "<empty_output>"  # the highest control token that is no bos/eos/pad/unk and not in the template: the mask
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["Tom has 3 apples and buys 25 more; how many apples does he have now?",
          "The capital of France is Paris, and the capital of Italy is Rome.",
          "def add(a, b):\n    return a + b  # 1234567890",
          "Hello world! Hello there, general Kenobi. It's a nice day, isn't it?"] * 4
TEXT = "Hello Tom, the capital of Italy has 1234 apples!\n  def f(x): return x"
DIMS = dict(hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, theta=1.0e5, ctx=128)
# tied: SmolLM2's layout (no output.weight, Q8_0 embedding, Q4_1 elsewhere); untied: F32 with an output.weight
CASES = {"tied_q8_q4": dict(tied=True, embd=gguf.GGMLQuantizationType.Q8_0, rest=gguf.GGMLQuantizationType.Q4_1),
         "untied_f32": dict(tied=False, embd=gguf.GGMLQuantizationType.F32, rest=gguf.GGMLQuantizationType.F32)}
CLI_CASE = "tied_q8_q4"  # converted through launch/convert_checkpoint.py --gguf, the other through the library

_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def train_bpe() -> Tokenizer:
  """A byte-level BPE as SmolLM2's (single digits, then GPT-2's regex), trained on CORPUS; specials get ids 0..4."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
  """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py, verbatim in numpy."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_reference(vocab: int, tied: bool, seed: int) -> LlamaForCausalLM:
  d = DIMS
  cfg = LlamaConfig(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=d["inter"],
                    num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                    head_dim=d["head_dim"], rms_norm_eps=1e-5, max_position_embeddings=d["ctx"],
                    rope_parameters={"rope_type": "default", "rope_theta": d["theta"]}, tie_word_embeddings=tied,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = LlamaForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # sharp attention and random norms, so a wrong layout shows
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
  return model


def quantize_reference(model: LlamaForCausalLM, embd, rest) -> dict[str, tuple[np.ndarray, object]]:
  """GGUF name -> (quantized data, GGML type) as llama.cpp writes them; the torch weights become their
  dequantized values (rows are quantized independently, so permuting rows commutes with it)."""
  heads, kv_heads = DIMS["heads"], DIMS["kv_heads"]
  out = {}
  with torch.no_grad():
    for name, p in model.named_parameters():
      w = p.numpy().astype(np.float32)
      if name == "model.embed_tokens.weight":
        g, qtype = "token_embd.weight", embd
      elif name == "model.norm.weight":
        g, qtype = "output_norm.weight", gguf.GGMLQuantizationType.F32
      elif name == "lm_head.weight":
        g, qtype = "output.weight", rest
      else:
        layer, sub = name[len("model.layers."):].split(".", 1)
        g = f"blk.{layer}.{_LAYER_NAMES[sub.rsplit('.', 1)[0]]}.weight"
        qtype = gguf.GGMLQuantizationType.F32 if w.ndim == 1 else rest
      q = gguf.quants.quantize(w, qtype)
      p.copy_(torch.from_numpy(np.array(gguf.quants.dequantize(q, qtype).reshape(w.shape))))
      if g.endswith("attn_q.weight"):
        q = llama_cpp_permute(q, heads, heads)
      elif g.endswith("attn_k.weight"):
        q = llama_cpp_permute(q, heads, kv_heads)
      out[g] = (q, qtype)
  return out


def write_gguf(path: pathlib.Path, tok: Tokenizer, tensors: dict, *, arch: str = "llama", skip: str | None = None
               ) -> pathlib.Path:
  d = DIMS
  spec = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(d["layers"])
  w.add_context_length(d["ctx"])
  w.add_embedding_length(d["hidden"])
  w.add_feed_forward_length(d["inter"])
  w.add_head_count(d["heads"])
  w.add_head_count_kv(d["kv_heads"])
  w.add_rope_freq_base(d["theta"])
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(d["head_dim"])
  w.add_vocab_size(len(tokens))
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(tokens)
  w.add_token_types([int(gguf.TokenType.CONTROL) if t in SPECIALS else int(gguf.TokenType.NORMAL) for t in tokens])
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  w.add_pad_token_id(2)
  w.add_add_bos_token(False)
  w.add_chat_template(CHAT_TEMPLATE)
  for name, (data, qtype) in tensors.items():
    if name != skip:
      w.add_tensor(name, data, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _run_cli(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  return subprocess.run([sys.executable, str(REPO / "launch" / "convert_checkpoint.py"), *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)


class Case:

  def __init__(self, name: str, root: pathlib.Path):
    self.name, kind = name, CASES[name]
    self.source_tok = train_bpe()
    self.torch_model = build_reference(self.source_tok.get_vocab_size(), kind["tied"], seed=len(name))
    self.tensors = quantize_reference(self.torch_model, kind["embd"], kind["rest"])
    self.gguf = write_gguf(root / "model.gguf", self.source_tok, self.tensors)
    self.out_dir = root / "ours"
    if name == CLI_CASE:
      proc = _run_cli(f"--gguf={self.gguf}", f"--output_dir={self.out_dir}", "--dtype=float32")
      assert proc.returncode == 0, proc.stderr
      assert "wrote" in proc.stdout
    else:
      convert_gguf_checkpoint(self.gguf, self.out_dir, progress=False)
    self.model = checkpoint.load_model(self.out_dir)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
  return Case(request.param, tmp_path_factory.mktemp(request.param))


def _torch_logits(model: LlamaForCausalLM, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor([list(tokens)])).logits[0].numpy()


def test_config_reads_the_gguf_metadata(case):
  cfg = case.model.cfg
  assert cfg.tie_word_embeddings is CASES[case.name]["tied"]
  assert (cfg.rope_type, cfg.rope_theta, cfg.llama_4_scaling_beta, cfg.rms_norm_eps) == ("default", 1.0e5, 0.0, 1e-5)
  assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
  assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 2)
  assert cfg.mask_token_id == SPECIALS.index(SPARE)
  assert ("diffusion_head.kernel" in checkpoint.param_shapes(cfg)) is not cfg.tie_word_embeddings


def test_logits_match_transformers(case):
  tokens = np.random.RandomState(3).randint(0, case.model.cfg.vocab_size, size=40)
  logits, _ = case.model(ForwardInputs(tokens=np.asarray(tokens, np.int32)[None],
                                       positions=np.arange(len(tokens), dtype=np.int32)[None],
                                       block_mask=causal_mask(len(tokens))))
  want = _torch_logits(case.torch_model, tokens)
  diff = float(np.abs(np.asarray(logits[0]) - want).max())
  assert diff <= ATOL, f"max abs logit diff {diff:.3g}"


def test_engine_greedy_tokens_match_transformers(case):
  llm = LLM(case.out_dir, policy="ar", max_num_seqs=1, max_model_len=64, page_size=8, prefill_chunk=16,
            compile_cache_dir=None, warmup=False)
  prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello Tom"}]))
  got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
  seq = list(prompt)
  for _ in range(12):  # the reference's greedy choice; the engine never emits the mask token
    last = _torch_logits(case.torch_model, seq)[-1]
    last[case.model.cfg.mask_token_id] = -np.inf
    seq.append(int(last.argmax()))
  assert list(got) == seq[len(prompt):]


def test_tokenizer_matches_the_gguf_vocab(case):
  ours = OurTokenizer.from_dir(case.out_dir)
  reader = gguf.GGUFReader(case.gguf)
  tokens = reader.get_field("tokenizer.ggml.tokens").contents()
  assert ours.vocab_size == len(tokens)
  assert all(ours.token_to_id(t) == i for i, t in enumerate(tokens))
  src = case.source_tok.encode(TEXT).ids
  assert ours.encode(TEXT) == src and len(src) < len(TEXT.encode())  # merges applied, as the source BPE
  assert ours.decode(ours.encode(TEXT)) == TEXT
  chat = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
  ids = ours.encode(chat)
  assert ids[0] == SPECIALS.index("<|im_start|>") and ids.count(SPECIALS.index("<|im_end|>")) == 1
  tok_cfg = json.loads((case.out_dir / "tokenizer_config.json").read_text())
  assert tok_cfg["chat_template"] == CHAT_TEMPLATE
  assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["mask_token"]) == ("<|im_start|>", "<|im_end|>", SPARE)


def test_the_peer_benchmark_twin_of_a_converted_llama_is_the_llama(case):
  """launch/bench_peer.py --model on a converted GGUF: its transformers twin is a LlamaForCausalLM (tied head where
  the GGUF ties it) computing the reference's logits."""
  sys.path.insert(0, str(REPO / "launch"))
  import bench_peer
  twin = bench_peer.checkpoint_twin(case.out_dir)
  assert isinstance(twin, LlamaForCausalLM) and twin.config.tie_word_embeddings is CASES[case.name]["tied"]
  tokens = np.random.RandomState(5).randint(0, case.model.cfg.vocab_size, size=24)
  np.testing.assert_allclose(_torch_logits(twin, tokens), _torch_logits(case.torch_model, tokens), atol=ATOL)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_a_dequantized_copy_holds_the_same_model(case, precision, tmp_path):
  """The llama.cpp peer's copies (benchmarks/llama_cpp.write_gguf): every metadata field as in the source, 2-D
  weights stored at the precision asked (norms F32), values the source's dequantized ones rounded to it; the F32
  copy converts to exactly the params and config the source does."""
  copy = llama_cpp.write_gguf(case.gguf, tmp_path / f"model.{precision}.gguf", precision)
  src, dst = gguf.GGUFReader(case.gguf), gguf.GGUFReader(copy)
  fields = lambda r: {k: f.contents() for k, f in r.fields.items()  # noqa: E731
                      if not k.startswith("GGUF.") and k != "general.file_type"}
  assert fields(dst) == fields(src)
  assert dst.get_field("general.file_type").contents() == {"f32": 0, "bf16": 32}[precision]
  assert llama_cpp.gguf_precision(copy) == precision.upper() and llama_cpp.gguf_precision(case.gguf) in ("Q4_1", "F32")
  by_name = {t.name: t for t in dst.tensors}
  assert set(by_name) == {t.name for t in src.tensors}
  for t in src.tensors:
    got = by_name[t.name]
    assert [int(d) for d in got.shape] == [int(d) for d in t.shape], t.name
    want = gguf.quants.dequantize(t.data, t.tensor_type)
    value = gguf.quants.dequantize(got.data, got.tensor_type)
    if len(t.shape) == 1 or precision == "f32":
      assert got.tensor_type == gguf.GGMLQuantizationType.F32
      np.testing.assert_array_equal(value, want, err_msg=t.name)
    else:
      assert got.tensor_type == gguf.GGMLQuantizationType.BF16
      np.testing.assert_allclose(value, want, rtol=2 ** -8, atol=0, err_msg=t.name)
  if precision == "f32":
    convert_gguf_checkpoint(copy, tmp_path / "from_copy", progress=False)
    assert (tmp_path / "from_copy" / "config.json").read_text() == (case.out_dir / "config.json").read_text()
    copied = flatten_params(nnx_state(checkpoint.load_model(tmp_path / "from_copy")))
    for name, value in flatten_params(nnx_state(case.model)).items():
      np.testing.assert_array_equal(np.asarray(copied[name]), np.asarray(value), err_msg=name)
  assert llama_cpp.write_gguf(case.gguf, copy, precision) == copy  # kept: already written from this source


def test_write_gguf_names_the_precision(case, tmp_path):
  with pytest.raises(ValueError, match="precision must be one of"):
    llama_cpp.write_gguf(case.gguf, tmp_path / "x.gguf", "q4_0")


# ---- errors ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_tensors():
  tok = train_bpe()
  return tok, quantize_reference(build_reference(tok.get_vocab_size(), True, seed=0), gguf.GGMLQuantizationType.F32,
                                 gguf.GGMLQuantizationType.F32)


def test_other_architecture_is_named(small_tensors, tmp_path):
  path = write_gguf(tmp_path / "qwen.gguf", *small_tensors, arch="qwen2")
  with pytest.raises(ConversionError, match="general.architecture.*'qwen2'"):
    convert_gguf_checkpoint(path, tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named(small_tensors, tmp_path):
  path = write_gguf(tmp_path / "partial.gguf", *small_tensors, skip="blk.1.ffn_up.weight")
  with pytest.raises(ConversionError, match="missing tensor 'blk.1.ffn_up.weight'"):
    convert_gguf_checkpoint(path, tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


def test_cli_names_the_flag():
  proc = _run_cli("--gguf=/nonexistent/model.gguf", "--output_dir=/tmp/never")
  assert proc.returncode == 1 and "--gguf" in proc.stderr
  proc = _run_cli("--gguf=/nonexistent/model.gguf", "--hf_dir=/tmp", "--output_dir=/tmp/never")
  assert proc.returncode == 1 and "--hf_dir" in proc.stderr and "--gguf" in proc.stderr


def test_draft_adapter_attaches_at_conversion_and_keeps_the_verifier(small_tensors, tmp_path):
  """--lora_dir with --gguf: the PEFT draft adapter (LoRA on every projection + the mask token's embedding row)
  lands in the checkpoint, the verifier is the GGUF's model, and greedy LinearSS equals greedy AR."""
  from recguide_jax.decoding.builtin import ARStrategy
  from recguide_jax.model.config import LORA_TARGET_MODULES
  from recguide_jax.convert import peft
  path = write_gguf(tmp_path / "model.gguf", *small_tensors)
  base_cfg = convert_gguf_checkpoint(path, tmp_path / "base", progress=False)
  cfg = base_cfg.replace(lora_rank=4, lora_alpha=16.0, lora_target_modules=LORA_TARGET_MODULES)
  rng = np.random.default_rng(0)
  flat = {name: rng.normal(0, 0.3, sds.shape).astype(np.float32)
          for name, sds in checkpoint.param_shapes(cfg).items() if name.endswith(("lora_a", "lora_b"))}
  mask_row = rng.normal(0, 0.5, cfg.hidden_size).astype(np.float32)
  peft.write_adapter(tmp_path / "adapter", cfg, flat, mask_row, dtype="float32")
  proc = _run_cli(f"--gguf={path}", f"--output_dir={tmp_path / 'ours'}", "--dtype=float32",
                  f"--lora_dir={tmp_path / 'adapter'}")
  assert proc.returncode == 0, proc.stderr
  assert "draft LoRA r=4" in proc.stdout
  base, ours = checkpoint.load_model(tmp_path / "base"), checkpoint.load_model(tmp_path / "ours")
  assert ours.cfg == cfg
  got = flatten_params(nnx_state(ours))
  want = flatten_params(nnx_state(base))
  for name, value in got.items():
    if name in flat:
      np.testing.assert_array_equal(np.asarray(value), flat[name])
    elif name == "embed_tokens.embedding":
      rows = np.arange(cfg.vocab_size) != cfg.mask_token_id
      np.testing.assert_array_equal(np.asarray(value)[rows], np.asarray(want[name])[rows])
      np.testing.assert_array_equal(np.asarray(value)[cfg.mask_token_id], mask_row)
    else:
      np.testing.assert_array_equal(np.asarray(value), np.asarray(want[name]))
  llm = LLM(model=tmp_path / "ours", policy="linear", block_size=8, max_num_seqs=2, max_model_len=96, page_size=8,
            prefill_chunk=16, warmup=False, compile_cache_dir=None)
  prompts = [[5, 9, 17, 33, 40, 41], [60, 61, 62, 7]]
  params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
  spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  llm.set_policy(ARStrategy())
  assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == spec

  # only the mask token's row may be replaced: any other would change the verifier
  raw = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**raw, "trainable_token_indices": [7]}))
  with pytest.raises(ConversionError, match="'trainable_token_indices' may name only the mask token"):
    convert_gguf_checkpoint(path, tmp_path / "bad", lora_dir=tmp_path / "adapter", progress=False)
  (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": ["lm_head"]}))
  with pytest.raises(ConversionError, match="'target_modules'"):
    convert_gguf_checkpoint(path, tmp_path / "bad", lora_dir=tmp_path / "adapter", progress=False)


def nnx_state(model):
  from flax import nnx
  return nnx.state(model, nnx.Param).to_pure_dict()

