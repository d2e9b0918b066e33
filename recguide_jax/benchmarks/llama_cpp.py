"""llama.cpp as a peer (launch/bench_peer.py --gguf): its plain greedy decoding on a GGUF, and the same weights
written at another precision.

`write_gguf` writes a GGUF holding a source GGUF's weights dequantized and stored at F32, F16 or BF16 (1-D tensors,
the norms, stay F32 as llama.cpp's own converter keeps them), with every metadata field copied, so llama.cpp runs
the same dequantized weights our engine converts, at the precision our engine runs them.

`LlamaCppPeer` runs `llama-cpp-python` (the `peers` extra: `pip install -e ".[peers]"`, which builds llama.cpp from
the package's source), batch 1, greedy, a fixed number of new tokens (EOS ignored), timing the first token apart
from the rest as the other sides are timed.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import time

import gguf
import numpy as np

# the precisions a dequantized copy may be written at: name -> GGML type
PRECISIONS = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16}
# llama.cpp's `general.file_type` (enum llama_ftype) of an all-F32 / mostly-F16 / mostly-BF16 file
_FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}
# reader fields that describe the file itself: the writer sets them
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.file_type")


def gguf_precision(path: str | os.PathLike) -> str:
  """The GGML type most of the file's 2-D tensors are stored at, e.g. 'Q4_1', 'F32'."""
  reader = gguf.GGUFReader(str(path))
  kinds = [t.tensor_type.name for t in reader.tensors if len(t.shape) > 1]
  return max(set(kinds), key=kinds.count) if kinds else "F32"


def _field_value(field: gguf.ReaderField):
  """A metadata field's value as the writer takes it (a list for an array)."""
  if field.types[0] == gguf.GGUFValueType.ARRAY:
    return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
  return _scalar(field.parts[field.data[0]], field.types[0])


def _scalar(part: np.ndarray, vtype: gguf.GGUFValueType):
  if vtype == gguf.GGUFValueType.STRING:
    return bytes(part).decode("utf-8")
  value = part.tolist()
  return value[0] if isinstance(value, list) and len(value) == 1 else value


def write_gguf(src: str | os.PathLike, dst: str | os.PathLike, precision: str) -> pathlib.Path:
  """Writes `dst`: `src`'s metadata and tensors, every tensor dequantized and stored at `precision` (f32, f16, bf16;
  1-D tensors stay F32). Returns dst. Idempotent: an existing dst newer than src is kept."""
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
  src, dst = pathlib.Path(src), pathlib.Path(dst)
  if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
    return dst
  reader = gguf.GGUFReader(str(src))
  arch = _field_value(reader.fields["general.architecture"])
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = dst.with_name(dst.name + ".partial")
  writer = gguf.GGUFWriter(str(tmp), arch)
  for key, field in reader.fields.items():
    if key in _HEADER_FIELDS or key == "general.architecture":
      continue
    sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, _field_value(field), field.types[0], sub_type=sub_type)
  writer.add_file_type(_FILE_TYPES[precision])
  target = PRECISIONS[precision]
  for t in reader.tensors:
    # numpy order: [out, in] for a weight (GGUF lists dims fastest first); the writer reverses it back
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    qtype = target if w.ndim > 1 else gguf.GGMLQuantizationType.F32
    data = w if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(w, qtype)
    writer.add_tensor(t.name, data, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(tmp, dst)
  return dst


def llama_cpp_module():
  """llama-cpp-python, imported by name: the `peers` extra, not a dependency of the package."""
  try:
    return importlib.import_module("llama_cpp")
  except ImportError as e:
    raise ImportError("the llama.cpp peer needs llama-cpp-python; install it with `pip install -e \".[peers]\"` "
                      f"(it builds llama.cpp from source) ({e})") from e


class LlamaCppPeer:
  """One GGUF loaded in llama.cpp, decoding one request at a time with `threads` threads."""

  def __init__(self, path: str | os.PathLike, *, n_ctx: int, threads: int):
    llama_cpp = llama_cpp_module()
    self.path = pathlib.Path(path)
    self.precision = gguf_precision(path)
    self.version = getattr(llama_cpp, "__version__", "unknown")
    self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                               n_threads_batch=threads, verbose=False)

  def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy decoding of each prompt in turn, exactly `new_tokens` tokens (EOS ignored). The time to the first
    token is the sum over prompts of each one's prefill + first token."""
    tokens, ttft = [], 0.0
    t0 = time.perf_counter()
    for prompt in prompts:
      self.llm.reset()  # no prompt prefix is reused from the previous run: every prompt is prefilled whole
      row = []
      start = time.perf_counter()
      for tok in self.llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                   reset=True):
        if not row:
          ttft += time.perf_counter() - start
        row.append(int(tok))
        if len(row) == new_tokens:
          break
      tokens.append(row)
    return {"tokens": tokens, "wall_s": time.perf_counter() - t0, "ttft_s": ttft}
