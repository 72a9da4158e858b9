"""The maths of compression, on arrays: SVD (lowrank), activation-whitened and Fisher-weighted SVD (whitening,
fisher), sequential refits (sequential), Nyström MLP narrowing (nystrom), and factors quantized as their weight was
(quantization)."""
