"""What a change cost: logit comparisons (metrics), perplexity over token windows (perplexity), and the
measurements the API offers on them: a model's perplexity on a text (evaluation, `evaluate`), two models'
outputs and perplexities compared (model_diff, `diff`)."""
