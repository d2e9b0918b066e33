"""Benchmark and launch-script support: what `launch/*.py` share, kept out of the serving library.

- `cli`: the flag vocabulary every launch script uses (`--model`, `--concurrency`, `--output_dir`, `--dtype`,
  `--max_model_len`, `--num_prompts`, `--max_tokens`, `--data` / `--gsm8k_dir`), one name each, dashes or
  underscores, `run` (absl's app.run with --help listing every flag the script reads), output paths (`runs/<script>` by default) and command-line errors that name the flag;
- `gsm8k`: where GSM8K is read from (`$RECGUIDE_GSM8K_DIR`, else `../shared/data/gsm8k`) and its prompts;
- `unseen`: prompt sets the bundled RecGuide tables were not fitted on (shipped word problems, far GSM8K train);
- `driver`: closed-loop drivers over the engine (`run_concurrent`: a prompt set to the last token; `run_steady`:
  timed over the window that holds C requests in flight) and per-run metrics;
- `steady`: the held-load comparison of policies (interleaved repeats, medians, paired intervals);
- `stats`: paired bootstrap intervals; `report`: `<name>.json` + `<name>.md` writers;
- `llama_cpp`: llama.cpp as a peer (`launch/bench_peer.py --gguf`): a GGUF's weights written at another precision,
  and greedy decoding through llama-cpp-python.

The functions of `driver`, `stats`, `report` and `gsm8k` are re-exported here (`from recguide_jax import benchmarks as
bench; bench.run_concurrent(...)`)."""

from recguide_jax.benchmarks.driver import (SteadyRun, ledger_counts, loop_share, median_of,  # noqa: F401
                                            median_runs, overlap_counts, priced_ms, run_concurrent, run_steady,
                                            split_sequential_ledger, summarize, unverified_drafts)
from recguide_jax.benchmarks.gsm8k import GSM8K_ENV, default_gsm8k_dir, gsm8k_file, gsm8k_prompts  # noqa: F401
from recguide_jax.benchmarks.report import write_report  # noqa: F401
from recguide_jax.benchmarks.stats import (paired_rate_ratio, paired_ratio_interval, paired_tau_gain,  # noqa: F401
                                           paired_wall_ratios, pooled_ratio_interval)

__all__ = ["GSM8K_ENV", "SteadyRun", "default_gsm8k_dir", "gsm8k_file", "gsm8k_prompts", "ledger_counts",
           "loop_share", "median_of", "median_runs", "overlap_counts", "paired_rate_ratio", "paired_ratio_interval",
           "paired_tau_gain", "paired_wall_ratios", "pooled_ratio_interval", "priced_ms", "run_concurrent",
           "run_steady", "split_sequential_ledger", "summarize", "unverified_drafts", "write_report"]
