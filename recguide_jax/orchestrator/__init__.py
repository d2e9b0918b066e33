"""RecGuide (docs/spec/recguide.md §4-6), as a decoding strategy and its offline tooling.

Online (what serving runs): `controller` (the strategy: regime switch, adaptive B, its typed per-request state),
`overlap` (branch planner, tree layout, reuse rules), `overlap_round` (the fused verify + branches round),
`signals` (e_t, s_t, z_t), `value_model` (the lookup V_B(s, z)), `adaptive` (the rule and the frozen per-load
tables), `profile` (hardware profile T_C(B)), `calibration` (round costs measured online).
Offline (fitting what serving loads): `traces` (the shadow-trace schema), `shadow` (the shadow-trace collector),
`value_fit` (PAVA / value-model fitting), `rho_search` (the price rho_C), `overlap_fit` (planner fitting).
Everything but `overlap_round` (which calls the runner) is numpy-only.
"""

from recguide_jax.orchestrator.adaptive import (POLICY_FILENAME, TABLES_FILENAME, AdaptivePolicyTables,  # noqa: F401
                                                LevelPolicy, LevelTable, PolicyError, RecGuideTables, TablesError,
                                                cold_start_block, decide, load_policy, load_tables, nearest_level,
                                                tables_path)
from recguide_jax.orchestrator.profile import HardwareProfile, ProfileError, available_profiles, load_profile
from recguide_jax.orchestrator.rho_search import (RhoSolution, fixed_objective, group_rows, replay_objective,
                                                  solve_rho)
from recguide_jax.orchestrator.signals import (STRATA, RoundRecord, as_record, make_record, round_entropy, signal_s,
                                               stratum)
from recguide_jax.orchestrator.traces import load_trace_rows
from recguide_jax.orchestrator.value_fit import fit_value_model
from recguide_jax.orchestrator.value_model import TraceError, ValueModel

__all__ = [
    "STRATA", "TABLES_FILENAME", "HardwareProfile", "LevelTable", "ProfileError", "RecGuideTables", "RhoSolution",
    "RoundRecord", "TablesError", "TraceError", "ValueModel", "as_record", "available_profiles", "cold_start_block",
    "decide", "fit_value_model", "fixed_objective", "group_rows", "load_profile", "load_tables", "load_trace_rows",
    "make_record", "nearest_level", "replay_objective", "round_entropy", "signal_s", "solve_rho", "stratum",
    "tables_path",
    # earlier names of the fitted tables (kept as aliases)
    "AdaptivePolicyTables", "LevelPolicy", "POLICY_FILENAME", "PolicyError", "load_policy",
]
