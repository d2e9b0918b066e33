"""The device side: step functions over the model state and the paged KV cache (`steps`), the runner that compiles
and runs them keyed by a frozen `StepKey` (`runner`, `step_key`), compile bookkeeping (`compilation`), device-side
sampling and acceptance (`sampling`) and draft uncertainty signals (`uncertainty`). It knows nothing of decoding
strategies."""
