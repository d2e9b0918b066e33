"""Text handling: the tokenizer and chat template (`tokenizer`) and incremental stop strings (`stop_strings`)."""
