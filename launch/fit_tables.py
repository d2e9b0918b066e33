"""Fits RecGuide's adaptive-B tables from shadow traces: the value model V_B(s, z) (docs/spec/recguide.md §5.2),
then rho_C per concurrency level by the exact 1-D search (§5.4) against a hardware profile's T_C(B). Writes the
versioned tables JSON ("recguide-tables/1", `recguide_tables.json`) that the engine loads, and prints per level the
chosen-B shares and the objective (macro tokens/ms/request on a replay of the traces) against every fixed B.

  python launch/fit_tables.py --traces traces/*.jsonl --profile b200_nld8b --output_dir checkpoints/x

Trace rows: see recguide_jax/recguide/value_model.py.
"""

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from recguide_jax.benchmarks import cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("traces", None, "Shadow-trace JSONL files (globs allowed).")
flags.DEFINE_string("profile", "b200_nld8b", "Hardware profile: a shipped name or a profile JSON path.")
flags.DEFINE_list("concurrency", None, "Load levels C to solve rho for (default: every level the profile measured).")
flags.DEFINE_integer("bins", 24, "Signal bins of the value model.")
flags.DEFINE_bool("strata", True, "Fit per-z strata (previous B, full) where they have enough rows.")
flags.DEFINE_string("output_dir", None, "Where the tables go: <output_dir>/recguide_tables.json (a checkpoint "
                    "directory, to ship them with the model).")
flags.DEFINE_string("version", "", "Version tag stored in the tables (default: a hash of their content).")
flags.DEFINE_string("notes", "", "Free-text notes stored in the tables.")
flags.DEFINE_integer("cv_folds", 5, "Out-of-fold validation over this many folds of requests (0: none): the value "
                     "model's held-out error and the rule's held-out gain over the best fixed B per level, printed "
                     "and written to <output_dir>/recguide_tables_validation.json.")


def _expand(patterns):
  paths = []
  for p in patterns:
    hits = sorted(glob.glob(p))
    if not hits:
      sys.exit(f"error: --traces {p!r} matches no file")
    paths.extend(hits)
  return paths


def main(argv):
  del argv
  from recguide_jax.recguide import adaptive, profile as profile_lib
  from recguide_jax.recguide.fit import rho_search, traces, value_fit
  from recguide_jax.recguide import value_model as vm
  if not FLAGS.traces:
    sys.exit("error: --traces is required")
  if not FLAGS.output_dir:
    sys.exit("error: --output_dir is required")
  if FLAGS.bins < 1:
    sys.exit("error: --bins must be >= 1")
  if FLAGS.cv_folds < 0 or FLAGS.cv_folds == 1:
    sys.exit("error: --cv_folds must be 0 (no validation) or at least 2")
  try:
    prof = profile_lib.load_profile(FLAGS.profile)
    rows = traces.load_trace_rows(_expand(FLAGS.traces))
    model = value_fit.fit_value_model(rows, bins=FLAGS.bins, strata=FLAGS.strata)
    groups = rho_search.group_rows(rows)
  except (profile_lib.ProfileError, vm.TraceError) as e:
    sys.exit(f"error: {e}")
  levels = sorted(set(cli.int_list("concurrency"))) if FLAGS.concurrency else sorted(prof.draft_verify_ms)
  blocks = tuple(b for b in prof.block_sizes if b in model.block_sizes)
  if not blocks:
    sys.exit(f"error: the profile's blocks {list(prof.block_sizes)} and the traces' blocks "
             f"{list(model.block_sizes)} do not overlap")
  n_req = sum(len(r) for r in groups.values())
  print(f"{len(rows)} rounds, {n_req} requests, {len(groups)} datasets; value model tables: "
        + ", ".join(f"{name} ({t.rows} rows, {t.num_bins} bins)" for name, t in model.tables.items()))
  out_levels, level_inputs = [], {}
  for c in levels:
    costs = prof.costs(c, blocks)
    cold = adaptive.cold_start_block(c)
    if cold not in costs:
      cold = min(costs)
    level_inputs[c] = (costs, cold)
    sol = rho_search.solve_rho(groups, model, costs, cold_start=cold)
    out_levels.append(adaptive.LevelTable(c, sol.rho, costs, cold, sol.objective, dict(sol.fixed_objectives),
                                          dict(sol.shares)))
    best_b = sol.best_fixed_block
    best_fixed = sol.fixed_objectives[best_b]
    shares = " / ".join(f"B{b} {100 * sol.shares[b]:.1f}%" for b in blocks)
    print(f"C={c:<4} rho={sol.rho:.5g}  shares {shares}  objective {sol.objective:.5g} tok/ms/req  "
          f"best fixed B={best_b} {best_fixed:.5g} ({100 * (sol.objective / best_fixed - 1):+.2f}%)  "
          f"recipe B={cold} {sol.fixed_objectives[cold]:.5g}  [{sol.candidates} prices]", flush=True)
  tables = adaptive.RecGuideTables(model, tuple(out_levels), prof.name or FLAGS.profile, FLAGS.version,
                                   FLAGS.notes)
  path = tables.save(os.path.join(FLAGS.output_dir, adaptive.TABLES_FILENAME))
  print(f"wrote {path} (version {tables.version}, profile {tables.profile})")
  if FLAGS.cv_folds:
    _validate(rows, level_inputs)


def _validate(rows, level_inputs) -> None:
  import json

  from recguide_jax.recguide.fit import validation, value_fit
  from recguide_jax.recguide import value_model as vm
  try:
    result = validation.cross_validate(
        rows, level_inputs, FLAGS.cv_folds,
        fit=lambda train: value_fit.fit_value_model(train, bins=FLAGS.bins, strata=FLAGS.strata))
  except vm.TraceError as e:
    print(f"no out-of-fold validation: {e}")
    return
  print(f"out of fold ({result.folds} folds of {result.requests} requests; each fold scored by the tables fitted on "
        "the others):")
  for e in result.value_errors:
    print(f"  V_B B={e.block_size:<3} MAE {e.mae:.3f} tokens (unconditional mean: {e.baseline_mae:.3f}, skill "
          f"{e.skill:+.3f}); mean predicted {e.mean_predicted:.3f} vs realized {e.mean_realized:.3f}")
  for lv in result.levels:
    print(f"  C={lv.concurrency:<4} rule {lv.rule:.5g} vs best fixed B {lv.best_fixed:.5g} tok/ms/req: "
          f"{100 * (lv.gain - 1):+.2f}% (folds {min(lv.fold_gains):.3f}..{max(lv.fold_gains):.3f}x)")
  path = os.path.join(FLAGS.output_dir, "recguide_tables_validation.json")
  with open(path, "w") as f:
    json.dump(result.to_json(), f, indent=1)
    f.write("\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
