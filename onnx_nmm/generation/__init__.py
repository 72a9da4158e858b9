"""Text from a model: greedy or sampled decoding over a KV cache (decoding), `generate` (generate), and the check that
a rewritten model still answers as the dense one did (answers)."""
