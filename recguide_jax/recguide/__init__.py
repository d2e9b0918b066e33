"""RecGuide (docs/spec/recguide.md §4-6) as a decoding strategy.

`controller` (the strategy: regime switch, adaptive B, its typed per-request state), `overlap` (branch planner, tree
layout, reuse rules), `overlap_round` (the fused verify + branches round), `signals` (e_t, s_t, z_t), `value_model`
(the lookup V_B(s, z)), `adaptive` (the rule and the frozen per-load tables), `profile` (hardware profile T_C(B)),
`calibration` (round costs measured online), `estimates`; the offline fitting tools are in `fit/`. Everything but
`overlap_round` (which calls the runner) is numpy-only."""
