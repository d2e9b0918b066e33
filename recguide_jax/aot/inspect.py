"""What a compiled step's optimized HLO says about memory and speed on its device: the largest buffers it makes
(a cache-sized one in a step is a copy of the KV cache), copies of the weights into another layout (a second trip
through memory for bytes a decode step exists to read once) and sorts over the whole vocabulary (top-p by
sorting)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

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


def _outer_computations(hlo_text: str) -> list[list[tuple[str, str, str, str]]]:
  """The instructions (name, type, opcode, line) of each computation that is not a fusion body or a reducer."""
  comps = _computations(hlo_text)
  inner = {name for lines in comps.values() for line in lines for name in _INNER.findall(line)}
  return [[(*m.groups(), line) for line in lines if (m := _INSTRUCTION.match(line))]
          for comp, lines in comps.items() if comp not in inner]


def large_buffers(hlo_text: str, min_bytes: int) -> list[Buffer]:
  """Arrays of at least `min_bytes` that instructions of the program create (not parameters, views, loop carries
  or in-place updates), largest first. Fusions count by their outputs: their bodies live in registers or VMEM."""
  out = []
  for instructions in _outer_computations(hlo_text):
    for name, type_text, opcode, line in instructions:
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


# a layout change: a copy, a transpose, or a loop fusion made of one
_RELAYOUT = ("copy", "transpose")
# ops a weight passes through unchanged on its way to a matmul: views, moves, loop plumbing and slices
_WEIGHT_PATH = {"bitcast", "copy", "copy-start", "copy-done", "get-tuple-element", "reshape", "transpose", "slice",
                "dynamic-slice"}
_LAYOUT = re.compile(r"\[[\d,]*\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\(\d+\)")
_OPERANDS = re.compile(r"%([\w.\-]+)")


def _layout(type_text: str) -> str | None:
  """An array type's layout (minor-to-major order and tiling), its memory space left out; None if unstated."""
  m = _LAYOUT.search(type_text)
  return _MEMORY_SPACE.sub("", m.group(1)) if m and m.group(1) else None


def _operands(line: str, opcode: str) -> list[str]:
  args = line.split(opcode + "(", 1)[1].split(")", 1)[0]
  return _OPERANDS.findall(args)


def weight_copies(hlo_text: str, weight_shapes: Sequence[tuple[int, ...]], layer_axis: bool) -> list[Buffer]:
  """Instructions that re-lay out a weight: a copy or transpose (or a fusion of one) whose result has the elements of
  a weight array, or of one layer's slice of a stacked one (`layer_axis`: the weights carry a leading [L] axis), in
  any order of dimensions and another layout than its operand's, and whose operand comes from a whole weight array
  through views, moves and slices only (an activation of a weight's shape is not one). Asynchronous copies
  (copy-start/done: moves between memory spaces) are not counted."""
  whole = {tuple(s) for s in weight_shapes if len(s) >= 2}
  wanted = {tuple(sorted(s)) for s in whole}
  if layer_axis:
    wanted |= {tuple(sorted(s[1:])) for s in whole if len(s) >= 3}
    wanted |= {tuple(sorted((1,) + s[1:])) for s in whole if len(s) >= 3}
  out = []
  for instructions in _outer_computations(hlo_text):
    defs = {name: (type_text, opcode, line) for name, type_text, opcode, line in instructions}

    def from_weight(name: str) -> bool:
      for _ in range(16):  # a weight reaches its matmul in a few steps; a longer chain is computed
        if name not in defs:
          return False
        type_text, opcode, line = defs[name]
        arrays = _arrays(type_text)
        if len(arrays) == 1 and arrays[0][1] in whole:
          return True
        if not (opcode in _WEIGHT_PATH or (opcode == "fusion" and "slice" in name)):
          return False
        operands = _operands(line, opcode)
        if not operands:
          return False
        name = operands[0]
      return False

    for name, type_text, opcode, line in instructions:
      if not (opcode in _RELAYOUT or (opcode == "fusion" and name.startswith(_RELAYOUT))):
        continue
      arrays = _arrays(type_text)
      if len(arrays) != 1 or tuple(sorted(arrays[0][1])) not in wanted:
        continue
      operands = _operands(line, opcode)
      if not operands or not from_weight(operands[0]):
        continue
      source = defs[operands[0]][0]
      if opcode == "copy" and _layout(type_text) == _layout(source):
        continue  # the same layout, maybe in another memory space: a move, not a re-layout
      dt, dims = arrays[0]
      op = _OP_NAME.search(line)
      out.append(Buffer(name, opcode, f"{dt}[{','.join(map(str, dims))}]", math.prod(dims) * _DTYPE_BYTES[dt],
                        op.group(1) if op else ""))
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
