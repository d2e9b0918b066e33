"""RecGuide orchestration (recguide.md sections 4-6).

Adaptive drafting: `profile` (hardware profile T_C(B)), `value_model` (signals s, z and the fitted V_B(s, z)),
`adaptive` (the rule argmax_B V_B(s, z) - rho_C T_C(B), the rho search and the versioned policy tables). These are
numpy-only. Overlap and the controller live in `overlap` and `policy`.
"""

from recguide_jax.orchestrator.adaptive import (POLICY_FILENAME, AdaptivePolicyTables, LevelPolicy, PolicyError,
                                                RhoSolution, cold_start_block, decide, fixed_objective, group_rows,
                                                load_policy, nearest_level, replay_objective, solve_rho)
from recguide_jax.orchestrator.profile import HardwareProfile, ProfileError, available_profiles, load_profile
from recguide_jax.orchestrator.value_model import (STRATA, RoundRecord, TraceError, ValueModel, as_record,
                                                   fit_value_model, load_trace_rows, make_record, round_entropy,
                                                   signal_s, stratum)

__all__ = [
    "POLICY_FILENAME", "STRATA", "AdaptivePolicyTables", "HardwareProfile", "LevelPolicy", "PolicyError",
    "ProfileError", "RhoSolution", "RoundRecord", "TraceError", "ValueModel", "as_record", "available_profiles",
    "cold_start_block", "decide", "fit_value_model", "fixed_objective", "group_rows", "load_policy", "load_profile",
    "load_trace_rows", "make_record", "nearest_level", "replay_objective", "round_entropy", "signal_s",
    "solve_rho", "stratum",
]
