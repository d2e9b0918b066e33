"""Earlier import path of the runtime (`recguide_jax.runtime`), kept so existing imports keep working."""

from recguide_jax.runtime import *  # noqa: F401,F403
from recguide_jax.runtime import __all__  # noqa: F401
