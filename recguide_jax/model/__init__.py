"""The NLD model: configuration (`config`), the forward pass over stacked layers (`nld`), RoPE (`rope`) and our
checkpoint format (`checkpoint`)."""
