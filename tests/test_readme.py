"""The README renders: its code fences pair up, and no fence line follows another (a doubled opening fence makes the
rest of the page one code block)."""

import os

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_code_fences_pair_up():
  with open(README) as f:
    fences = [i for i, line in enumerate(f.read().split("\n")) if line.startswith("```")]
  assert len(fences) % 2 == 0, f"unclosed code fence in README.md (fence lines {[i + 1 for i in fences]})"
  doubled = [a + 1 for a, b in zip(fences, fences[1:]) if b == a + 1]
  assert not doubled, f"README.md lines {doubled}: a fence line right after another"
