"""Benchmark reports: `<name>.json` (the result) and `<name>.md` (its table) in one output directory."""

from __future__ import annotations

import json
import os
import pathlib


def write_report(result: dict, markdown: str, output_dir: str | os.PathLike, name: str) -> tuple[str, str]:
  """Writes a benchmark's `name`.json (the result) and `name`.md (its table) into `output_dir`; returns both paths."""
  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  js, md = out / f"{name}.json", out / f"{name}.md"
  js.write_text(json.dumps(result, indent=2) + "\n")
  md.write_text(markdown)
  return str(js), str(md)
