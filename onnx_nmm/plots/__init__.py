"""The figures behind `--plot`: a rewrite's report, a benchmark, a fine-tuning run (matplotlib, imported on use)."""
