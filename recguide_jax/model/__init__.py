from recguide_jax.model.nld import (ForwardInputs, LayerLoop, NLDModel, abstract_model, layer_loop_of,
                                    model_from_params, resolve_layer_loop, shard_model, weights_platform,
                                    with_layer_loop)

__all__ = ["ForwardInputs", "LayerLoop", "NLDModel", "abstract_model", "layer_loop_of", "model_from_params",
           "resolve_layer_loop", "shard_model", "weights_platform", "with_layer_loop"]
