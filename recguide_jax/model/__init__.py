from recguide_jax.model.nld import ForwardInputs, NLDModel

__all__ = ["ForwardInputs", "NLDModel"]
