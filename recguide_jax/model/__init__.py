from recguide_jax.model.nld import ForwardInputs, NLDModel, abstract_model, model_from_params, shard_model

__all__ = ["ForwardInputs", "NLDModel", "abstract_model", "model_from_params", "shard_model"]
