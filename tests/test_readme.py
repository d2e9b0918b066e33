"""The README renders: parsed as CommonMark (markdown-it-py), its code blocks are the ones written (a doubled or
unclosed fence would turn the rest of the page into one code block), its tables are tables, and the test command
it gives is the one `.ci/run` runs."""

import pathlib
import re

from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TOKENS = MarkdownIt("commonmark").enable("table").parse(README)
TEST_COMMAND = 'pip install -q -e ".[test]" && python -m pytest -q'


def test_code_blocks_are_the_fenced_ones():
  fences = [t for t in TOKENS if t.type == "fence"]
  opening = [i for i, line in enumerate(README.split("\n")) if re.match(r"^```\w", line)]
  assert len(fences) == len(opening), (len(fences), [i + 1 for i in opening])
  for t in fences:
    assert t.info in ("bash", "python"), t.map
    assert not re.search(r"^```", t.content, re.M), f"a fence inside the code block at line {t.map[0] + 1}"


def test_headings_and_tables_render():
  headings = [TOKENS[i + 1].content for i, t in enumerate(TOKENS) if t.type == "heading_open"]
  assert headings[0] == "recguide-jax" and "Quick start" in headings
  table_rows = sum(1 for line in README.split("\n") if line.startswith("|"))
  rendered = sum(1 for t in TOKENS if t.type == "tr_open")
  assert table_rows and rendered == table_rows - sum(1 for line in README.split("\n") if line.startswith("|---"))


def test_quick_start_test_command_is_what_ci_runs():
  assert TEST_COMMAND in README
  assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_readme_is_short():
  assert len(README.split("\n")) <= 200
