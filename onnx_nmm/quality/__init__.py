"""What a change cost: logit comparisons (metrics) and perplexity over token windows (perplexity)."""
