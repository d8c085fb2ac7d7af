"""Length-extrapolation evaluation: sliding-window perplexity, passkey retrieval, RoPE scaling
sweeps, attention-score statistics and reports (`python -m eval`, `python -m eval.report`)."""
