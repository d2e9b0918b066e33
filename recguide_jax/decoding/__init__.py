"""Decoding strategies: the protocol (`strategy`), the generic rounds (`rounds`), the fixed strategies (`builtin`)
and the name registry (`registry`). RecGuide's strategy lives in `recguide_jax.recguide.controller`."""
