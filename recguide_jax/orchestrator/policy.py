"""Earlier import path of RecGuide's strategy (`orchestrator.controller`)."""

from recguide_jax.orchestrator.controller import (BLOCKS, PAPER_DELTA, OnlineStats, RecGuidePolicy,  # noqa: F401
                                                  RecGuideState, RecGuideStrategy)
