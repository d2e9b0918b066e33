from recguide_jax.model.nld import (ForwardInputs, KernelLayout, LayerLoop, NLDModel, abstract_model,
                                    kernel_layout_of, layer_loop_of, model_from_params, resolve_kernel_layout,
                                    resolve_layer_loop, shard_model, weights_platform, with_kernel_layout,
                                    with_layer_loop)

__all__ = ["ForwardInputs", "KernelLayout", "LayerLoop", "NLDModel", "abstract_model", "kernel_layout_of",
           "layer_loop_of", "model_from_params", "resolve_kernel_layout", "resolve_layer_loop", "shard_model",
           "weights_platform", "with_kernel_layout", "with_layer_loop"]
