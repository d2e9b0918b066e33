"""The serving engine: `core` (the step loop), `scheduler` (admission and grouping), `prefill` (prompt chunks,
prompt scoring, n samples sharing one prefill), `output` (emission and incremental stop strings), `thread` (the engine
on its own thread), `config` (the frozen `EngineConfig`), `protocol` (the `ServingEngine` interface callers drive),
`build` (`build_engine`), `gc_heap` (the start-up heap frozen out of Python's collector, its pauses measured) and
`requests` (`SamplingParams`, `Request`: numpy only, so the server validates requests without jax)."""
