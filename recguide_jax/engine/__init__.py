"""The serving engine: `core` (the step loop), `scheduler` (admission and grouping), `prefill` (prompt chunks,
prompt scoring, n samples sharing one prefill), `output` (emission and incremental stop strings), `thread` (the engine
on its own thread), `config` (the frozen `EngineConfig`), `protocol` (the `ServingEngine` interface callers drive),
`build` (`build_engine`) and `requests` (`SamplingParams`, `Request`: numpy only, so the server validates requests
without jax)."""
