"""Trainium: `compile` (compilation), the NKI kernel plan of each custom op (neuron), the model's shape as a decoder
(decoder_shape) and the modelled end-to-end speed (speed)."""
