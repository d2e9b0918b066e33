"""Earlier name of launch/fit_tables.py (the fitted adaptive-B tables were called a "policy"); kept so existing
commands keep working. Same flags, same output.

  python launch/fit_tables.py --traces traces/*.jsonl --profile b200_nld8b --out checkpoints/x/recguide_tables.json
"""

import os
import runpy
import sys

if __name__ == "__main__":
  print("launch/fit_policy.py is deprecated; use launch/fit_tables.py (same flags)", file=sys.stderr)
  runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fit_tables.py"), run_name="__main__")
