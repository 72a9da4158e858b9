"""Running kernels and timing them: on the emulator or modelled (runner), the modelled benchmark of the MLPs
(benchmark), on a device (device) and the cost model's parameters fitted to a device's times (device_fit)."""
