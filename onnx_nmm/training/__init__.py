"""Recovering quality after a rewrite: `finetune` (finetuning), the training loop over factors and narrowed weights
(factor_training), and the PyTorch modules that hold them (factor_adapters)."""
