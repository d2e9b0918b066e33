"""What a compiled step's optimized HLO says about memory and speed on its device: the largest buffers it makes
(a cache-sized one in a step is a copy of the KV cache) and sorts over the whole vocabulary (top-p by sorting)."""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
# an instruction line of HLO text: `%name = TYPE opcode(` with TYPE an array shape or a tuple of them
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# results that are views, loop plumbing or in-place updates of a buffer that already exists
_NOT_NEW = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "call", "constant",
            "dynamic-update-slice", "scatter", "after-all", "opt-barrier", "copy-start", "copy-done"}


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One HLO instruction's array result."""
  name: str
  opcode: str
  shape: str  # "bf16[139264,16,256]"
  nbytes: int
  op_name: str  # the jax source op (metadata), "" if none


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text)
          if dt in _DTYPE_BYTES]


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INNER = re.compile(r"(?:\bfusion\(.*\bcalls=|to_apply=)%?([\w.\-]+)")
# in-place updates XLA makes inside a fusion: the output is the (donated or loop-carried) operand's own buffer
_IN_PLACE = ("scatter", "dynamic_update_slice", "dynamic-update-slice")


def _computations(hlo_text: str) -> dict[str, list[str]]:
  comps, current = {}, None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():
      m = _COMPUTATION.match(line)
      current = m.group(1) if m else None
      if current:
        comps[current] = []
    elif current is not None:
      comps[current].append(line)
  return comps


def large_buffers(hlo_text: str, min_bytes: int) -> list[Buffer]:
  """Arrays of at least `min_bytes` that instructions of the program create (not parameters, views, loop carries
  or in-place updates), largest first. Fusions count by their outputs: their bodies live in registers or VMEM."""
  comps = _computations(hlo_text)
  inner = {name for lines in comps.values() for line in lines for name in _INNER.findall(line)}
  out = []
  for comp, lines in comps.items():
    if comp in inner:
      continue
    for line in lines:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      name, type_text, opcode = m.groups()
      if opcode in _NOT_NEW or type_text.startswith("("):
        continue
      op = _OP_NAME.search(line)
      op_name = op.group(1) if op else ""
      if opcode == "fusion" and (name.startswith(_IN_PLACE) or op_name.endswith(_IN_PLACE)):
        continue
      arrays = _arrays(type_text)
      if len(arrays) != 1:
        continue
      dt, dims = arrays[0]
      nbytes = math.prod(dims) * _DTYPE_BYTES[dt]
      if nbytes >= min_bytes:
        out.append(Buffer(name, opcode, f"{dt}[{','.join(map(str, dims))}]", nbytes, op_name))
  return sorted(out, key=lambda b: -b.nbytes)


def vocabulary_sorts(hlo_text: str, vocab: int) -> list[str]:
  """Sort instructions (XLA's `sort` or a CUB radix-sort custom call) over an axis of at least `vocab` elements:
  the lines of the program that sort whole vocabularies."""
  found = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    _, type_text, opcode = m.groups()
    target = _CUSTOM_TARGET.search(line) if opcode == "custom-call" else None
    is_sort = opcode == "sort" or (target is not None and "sort" in target.group(1).lower())
    if is_sort and any(dims and max(dims) >= vocab for _, dims in _arrays(type_text)):
      found.append(line.strip()[:200])
  return found


def kernel_calls(hlo_text: str) -> dict[str, int]:
  """Custom calls by target (`tpu_custom_call` for Mosaic kernels, `__gpu$xla.gpu.triton` for Triton ones)."""
  counts: dict[str, int] = {}
  for target in _CUSTOM_TARGET.findall(hlo_text):
    counts[target] = counts.get(target, 0) + 1
  return counts
