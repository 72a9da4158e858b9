"""Recovering quality after a rewrite: `finetune` (finetuning), the training loop over factors and narrowed weights
(factor_training), and the PyTorch modules that hold them (factor_adapters); for a model that does not fit in
memory twice (fits), one decoder layer at a time (layer_by_layer, on the cut of layer_pairs); the torch device it
trains on (device)."""
