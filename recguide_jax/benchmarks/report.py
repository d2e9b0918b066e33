"""Benchmark reports: `<name>.json` (the result) and `<name>.md` (its table) in one output directory."""

from __future__ import annotations

import json
import os
import pathlib


NOTES_MARK = "<!-- notes: written by hand, kept when the tables above are regenerated -->"


def kept_notes(path: str | os.PathLike) -> str:
  """The hand-written notes below NOTES_MARK in an earlier report at `path` (they survive a re-run), or ""."""
  path = pathlib.Path(path)
  if not path.exists():
    return ""
  old = path.read_text()
  return "\n" + NOTES_MARK + old.split(NOTES_MARK, 1)[1] if NOTES_MARK in old else ""


def write_report(result: dict, markdown: str, output_dir: str | os.PathLike, name: str) -> tuple[str, str]:
  """Writes a benchmark's `name`.json (the result) and `name`.md (its table, then the notes written by hand below
  the table it replaces: `kept_notes`) into `output_dir`; returns both paths."""
  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  js, md = out / f"{name}.json", out / f"{name}.md"
  js.write_text(json.dumps(result, indent=2) + "\n")
  md.write_text(markdown + kept_notes(md))
  return str(js), str(md)


def overlap_reuse(counts: dict) -> dict:
  """The paper's Table 3 from an overlap run's branch outcome counters (`driver.overlap_counts`): per kind of
  round end, how often a planned branch covered it (coverage) and how often that branch became the next draft
  (reuse), and the share of overlap rounds whose next draft forward a branch saved."""
  get = lambda k: int(counts.get(k, 0))  # noqa: E731
  rejected = get("correction_hit") + get("correction_miss") + get("no_hit")  # a draft token was rejected
  full = get("continuation_hit") + get("continuation_miss") + get("continuation_absent")  # the block accepted whole
  rounds = rejected + full
  share = lambda a, b: a / b if b else None  # noqa: E731
  return {"rounds": rounds, "rejected_rounds": rejected, "full_rounds": full,
          "correction_coverage": share(get("correction_hit") + get("correction_miss"), rejected),
          "correction_reuse": share(get("correction_hit"), rejected),
          "continuation_coverage": share(get("continuation_hit") + get("continuation_miss"), full),
          "continuation_reuse": share(get("continuation_hit"), full),
          "saved_draft_share": share(get("correction_hit") + get("continuation_hit"), rounds)}


def overlap_reuse_table(rows: list[tuple[str, dict]]) -> list[str]:
  """Markdown lines of `overlap_reuse` for (label, counters) rows (rows without an overlap round left out)."""
  pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
  lines = ["| run | overlap rounds | rejected / accepted whole | correction coverage | correction reuse | "
           "continuation coverage | continuation reuse | draft forwards saved |", "|" + "---|" * 8]
  for label, counts in rows:
    t = overlap_reuse(counts)
    if t["rounds"]:
      lines.append(f"| {label} | {t['rounds']} | {t['rejected_rounds']} / {t['full_rounds']} | "
                   f"{pct(t['correction_coverage'])} | {pct(t['correction_reuse'])} | "
                   f"{pct(t['continuation_coverage'])} | {pct(t['continuation_reuse'])} | "
                   f"{pct(t['saved_draft_share'])} |")
  return lines


def plot_frontier(series: dict, path: str | os.PathLike, xlabel: str, ylabel: str, title: str) -> str:
  """Aggregate throughput against per-request speed, one curve per label across its load levels (the paper's
  Figure 5): `series` {label: [(per-request, aggregate, point label)]}. Writes the PNG; returns its path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.8))
  for label, pts in series.items():
    if not pts:
      continue
    xs, ys, _ = zip(*pts)
    ax.plot(xs, ys, marker="o", label=label)
    for x, y, name in pts:
      ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
  ax.margins(x=0.1, y=0.1)  # room for the point labels
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)
