"""Running a model: onnxruntime sessions (ort_runner), the backends of `run` (backend_runner), a causal LM's feeds
(causal_lm), intermediate values read from a graph (graph_probe), and the machine it runs on (host)."""
