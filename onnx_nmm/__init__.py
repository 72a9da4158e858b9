"""onnx-nmm: SVD-factorize the linear layers of exported LLM graphs, lower them to fused NKI kernels."""

__version__ = "0.1.0"
