"""What a rewrite is fitted to: calibration windows from texts, token ids or the model's own generations
(calibration_data, generated_text), and the activation statistics gathered over them (activation_stats)."""
