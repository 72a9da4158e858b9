"""Run the benchmark's kernel launches on a device, check their results, and time them.

A launch is one kernel on inputs of given shapes (benchmark.PROGRAMS launch each distinct one once or more
per MLP; the grid's launches are read off the programs' traces, then deduplicated). Each launch gets
random inputs (fixed seed; activations N(0, 1), weights N(0, 1)/sqrt(fan_in)), its output is compared with a
float64 NumPy reference, and its time on the device is set beside the cost model's (trace-only emulation).

Two devices:
  NeuronDevice    a Trainium NeuronCore through AWS's Neuron SDK. UNTESTED ON HARDWARE: written from the SDK
                  2.32 docs (see NeuronDevice) on a machine with neither the SDK nor a device.
  EmulatedDevice  a stand-in for tests: the kernel computes on the emulator, and its "measured" time is the
                  cost model's on that trace, with some parameters of the NeuronCore scaled by given factors
                  (a device whose DMA is slower than documented), so a fit has something to recover.

This process models the launches, so its kernels must be the emulator's (ONNX_NMM_NKI=emulator where NKI is
installed); NeuronDevice runs each launch in a child Python with the real NKI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from onnx_nmm.kernels.bench.benchmark import PROGRAMS, MlpShape, mlp_shapes
from onnx_nmm.kernels.bench.runner import estimate
from onnx_nmm.kernels.emulator import Placeholder, emulation
from onnx_nmm.kernels.emulator.dtypes import as_dtype
from onnx_nmm.kernels.nki_kernels.dense_matmul import dense_matmul, dense_matmul_lhsT
from onnx_nmm.kernels.nki_kernels.dense_mlp import dense_gated_mlp
from onnx_nmm.kernels.nki_kernels.fused_mlp import fused_svd_mlp
from onnx_nmm.kernels.nki_kernels.fused_xuv import fused_xuv
from onnx_nmm.kernels.nki_kernels.gated_activation import silu_mul, silu_mul_transposed
from onnx_nmm.kernels.nki_kernels.nki_api import USING_EMULATOR
from onnx_nmm.kernels.pricing.cost_model import model_traces
from onnx_nmm.kernels.pricing.hardware import NeuronCore, neuron_core

KERNELS = {kernel.__name__: kernel for kernel in (dense_matmul, dense_matmul_lhsT, dense_gated_mlp, fused_xuv, silu_mul,
                                                  silu_mul_transposed, fused_svd_mlp)}
# Inputs that are activations (the first ones); the rest are weights [fan_in, fan_out].
ACTIVATION_INPUTS = {"silu_mul": 2, "silu_mul_transposed": 2}
# Largest |output - reference| allowed, as a fraction of max |reference|.
ERROR_BOUNDS = {"bfloat16": 2e-2, "float32": 1e-4}
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel's name, its input shapes, their dtype and the Trainium target."""

    kernel: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    target: str


@dataclass
class DeviceRun:
    """What a device gives back for a launch: the kernel's output and its time per execution, in µs."""

    output: np.ndarray
    samples_us: list[float]


class Device(Protocol):
    target: str
    description: str

    def sdk_versions(self) -> dict[str, str]: ...

    def run(self, launch: Launch, inputs: list[np.ndarray]) -> DeviceRun: ...


# -- the launches -------------------------------------------------------------------------------------------
def grid_launches(models: tuple[MlpShape, ...], tokens: tuple[int, ...], target: str, dtype: str) -> list[Launch]:
    """Every distinct launch benchmark.PROGRAMS make over the grid, in the order they first occur."""
    launches = []
    for shape in models:
        for count in tokens:
            for variant, program in PROGRAMS.items():
                with emulation(target, trace_only=True) as session:
                    program(*(Placeholder(s, dtype) for s in mlp_shapes(shape, count, variant)))
                launches += [Launch(t.kernel, t.input_shapes, dtype, target) for t in session.traces]
    return list(dict.fromkeys(launches))


def random_inputs(launch: Launch, seed: int = 0) -> list[np.ndarray]:
    """Inputs scaled like a model's: activations N(0, 1), weights [fan_in, fan_out] N(0, 1)/sqrt(fan_in)."""
    rng = np.random.default_rng(seed)
    activations = ACTIVATION_INPUTS.get(launch.kernel, 1)
    arrays = [rng.standard_normal(shape) / (1.0 if i < activations else np.sqrt(shape[0]))
              for i, shape in enumerate(launch.shapes)]
    return [array.astype(as_dtype(launch.dtype)) for array in arrays]


def reference(kernel: str, inputs: list[np.ndarray]) -> np.ndarray:
    """What the kernel computes, in float64 NumPy on the same (rounded) inputs."""
    a = [np.asarray(x, dtype=np.float64) for x in inputs]
    if kernel == "dense_matmul":
        return a[0] @ a[1]
    if kernel == "dense_matmul_lhsT":
        return a[0].T @ a[1]
    if kernel == "fused_xuv":
        return a[0] @ a[1] @ a[2]
    if kernel == "silu_mul":
        return _silu(a[0]) * a[1]
    if kernel == "silu_mul_transposed":
        return (_silu(a[0]) * a[1]).T
    if kernel == "fused_svd_mlp":
        x, ug, vg, uu, vu, ud, vd = a
        return (_silu(x @ ug @ vg) * (x @ uu @ vu)) @ ud @ vd
    if kernel == "dense_gated_mlp":
        x, wg, wu, wd = a
        return (_silu(x @ wg) * (x @ wu)) @ wd
    raise ValueError(f"no reference for kernel {kernel!r}")


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


# -- running them -------------------------------------------------------------------------------------------
def bench_on_device(device: Device, launches: list[Launch], seed: int = 0, on_launch=None) -> dict:
    """Run, check and time every launch on `device`; the report (JSON-ready) with the modelled time beside
    each measured one. `on_launch(result)` is called as each launch is done."""
    results = []
    for launch in launches:
        result = measure(device, launch, seed)
        results.append(result)
        if on_launch is not None:
            on_launch(result)
    return {
        "device": device.description,
        "note": f"measured_us are measured on {device.description}; modelled_us are onnx-nmm's cost model "
                "(trace-only emulation, AWS's documented engine numbers)",
        "sdk": device.sdk_versions(),
        "seed": seed,
        "launches": results,
    }


def measure(device: Device, launch: Launch, seed: int = 0) -> dict:
    """One launch on the device: its time measured and modelled, and its largest error against the reference."""
    inputs = random_inputs(launch, seed)
    run = device.run(launch, inputs)
    expected = reference(launch.kernel, inputs)
    error = float(np.max(np.abs(np.asarray(run.output, dtype=np.float64) - expected)))
    bound = ERROR_BOUNDS[launch.dtype] * float(np.max(np.abs(expected)))
    p50, p99 = np.percentile(run.samples_us, [50, 99])
    return {
        "kernel": launch.kernel,
        "shapes": [list(shape) for shape in launch.shapes],
        "dtype": launch.dtype,
        "target": launch.target,
        "modelled_us": modelled_us(launch),
        "measured_us": {"p50": float(p50), "p99": float(p99), "samples": run.samples_us},
        "max_error": error,
        "error_bound": bound,
        "ok": bool(np.isfinite(error) and error <= bound),
    }


def modelled_us(launch: Launch) -> float:
    """The cost model's time for the launch on its documented target (trace-only emulation)."""
    return estimate(KERNELS[launch.kernel], *launch.shapes, dtype=launch.dtype, target=launch.target).total_s * 1e6


def launch_of(entry: dict) -> Launch:
    """The launch a device report's entry describes."""
    return Launch(entry["kernel"], tuple(tuple(s) for s in entry["shapes"]), entry["dtype"], entry["target"])


def scaled_core(target: str | NeuronCore, factors: dict[str, float]) -> NeuronCore:
    """The target's NeuronCore with each named parameter multiplied by its factor."""
    core = neuron_core(target)
    return dataclasses.replace(core, **{name: getattr(core, name) * f for name, f in factors.items()})


class EmulatedDevice:
    """A stand-in device: computes on the emulator and reports as measured the modelled time of that trace on
    the target's NeuronCore with `factors` applied (e.g. {"dma_engine_bytes_per_s": 0.8}: DMA 20% slower)."""

    def __init__(self, target: str = "trn2", factors: dict[str, float] | None = None):
        self.target = target
        self.factors = dict(factors or {})
        self.core = scaled_core(target, self.factors)
        scaled = ", ".join(f"{name} x{f:g}" for name, f in self.factors.items())
        self.description = f"the NKI emulator as a {target} stand-in (times modelled{', ' + scaled if scaled else ''})"

    def sdk_versions(self) -> dict[str, str]:
        return {}

    def run(self, launch: Launch, inputs: list[np.ndarray]) -> DeviceRun:
        with emulation(self.target) as session:
            output = KERNELS[launch.kernel](*inputs)
        return DeviceRun(output, [model_traces(session.traces, self.core).total_s * 1e6])


# -- the real device ----------------------------------------------------------------------------------------
def missing_neuron() -> str | None:
    """What this machine lacks to run kernels on a Trainium device (None if nothing), as a short phrase.

    NKI is looked for by its package, not imported: this process keeps the emulator to model the launches
    (the child that runs them checks that it got the real NKI: nki_api.USING_EMULATOR is False there).
    PyPI's placeholder nki 0.0.1 counts as absent (nki_api wants 0.3 or later).
    """
    if importlib.util.find_spec("nki") is None:
        return "no `nki` found"
    version = importlib.metadata.version("nki")
    if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (0, 3):
        return f"nki {version} is PyPI's placeholder, not AWS's NKI 0.3 or later"
    if importlib.util.find_spec("neuronxcc") is None:
        return "no `neuronxcc` (neuronx-cc) found"
    if not glob.glob("/dev/neuron[0-9]*"):
        return "no Neuron device at /dev/neuron*; on a Trainium instance try `sudo modprobe neuron`"
    return None


class NeuronDevice:
    """One NeuronCore of the Trainium machine this runs on. UNTESTED ON HARDWARE (no device or SDK here).

    Written from the Neuron SDK 2.32 / NKI 0.6 documentation (the NKI guide's profiling and benchmarking pages):
    - run: a child Python imports the real NKI with NKI_ARTIFACTS_DIR set (NKI reads it when it is imported,
      hence the child) and NEURON_PLATFORM_TARGET_OVERRIDE the target, and calls the kernel on NumPy arrays:
      NKI compiles it, runs it on the device, returns the output and keeps the NEFF in that directory;
    - time: `neuron-explorer capture` (profiling the 2nd execution, past warm-up) + `view --output-format
      summary-json`, reading total_time (seconds, on-device), once per sample; or, given `nrtpy_python` (an
      interpreter with nrtpy, which cannot share an environment with nki as of SDK 2.32),
      NrtpyModel.benchmark(mode="device") there, whose durations_ms are the samples.
    """

    def __init__(self, target: str, samples: int = 20, nrtpy_python: str | None = None):
        self.target = target
        self.samples = samples
        self.nrtpy_python = nrtpy_python
        devices = sorted(glob.glob("/dev/neuron[0-9]*"))
        self.description = f"Trainium ({target}), NeuronCore 0 of {devices[0] if devices else '/dev/neuron?'}"

    def sdk_versions(self) -> dict[str, str]:
        versions = {}
        for package in ("nki", "neuronx-cc"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[package] = importlib.metadata.version(package)
        return versions

    def run(self, launch: Launch, inputs: list[np.ndarray]) -> DeviceRun:
        with tempfile.TemporaryDirectory(prefix="onnx-nmm-device-") as work:
            work = Path(work)
            names = list(_argument_names(launch.kernel))[: len(inputs)]
            for name, array in zip(names, inputs):
                np.save(work / f"{name}.npy", array)
            output = self._compile_and_run(launch, names, work)
            neff = max(work.glob("**/*.neff"), key=lambda path: path.stat().st_mtime)
            timing = self._time_with_nrtpy if self.nrtpy_python else self._time_with_neuron_explorer
            return DeviceRun(output, timing(neff, names, work))

    def _compile_and_run(self, launch: Launch, names: list[str], work: Path) -> np.ndarray:
        env = {**os.environ, "NKI_ARTIFACTS_DIR": str(work), "NEURON_PLATFORM_TARGET_OVERRIDE": launch.target}
        env.pop("ONNX_NMM_NKI", None)
        _check_call([sys.executable, "-m", "onnx_nmm.kernels.bench.device", launch.kernel, launch.dtype, str(work),
                     *names], env=env)
        return np.load(work / "output.npy")

    def _time_with_neuron_explorer(self, neff: Path, names: list[str], work: Path) -> list[float]:
        explorer = shutil.which("neuron-explorer") or "/opt/aws/neuron/bin/neuron-explorer"
        pairs = [part for name in names for part in (name, str(work / f"{name}.npy"))]
        samples = []
        for i in range(self.samples):
            profile = work / f"profile-{i}"
            profile.mkdir()
            _check_call([explorer, "capture", "-n", str(neff), "-s", str(profile / "profile.ntff"),
                         "--num-exec", "2", "--profile-nth-exec", "2", *pairs])
            summary = _check_call([explorer, "view", "-d", str(profile), "--output-format", "summary-json"])
            samples.append(_find_key(json.loads(summary), "total_time") * 1e6)
        return samples

    def _time_with_nrtpy(self, neff: Path, names: list[str], work: Path) -> list[float]:
        env = {**os.environ, "LD_LIBRARY_PATH": f"/opt/aws/neuron/lib:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        printed = _check_call([self.nrtpy_python, "-c", NRTPY_BENCHMARK, str(neff), str(work), str(self.samples),
                               *names],
                              env=env)
        return [ms * 1e3 for ms in json.loads(printed.strip().splitlines()[-1])]


# Run by the nrtpy interpreter: argv = neff, folder of <name>.npy inputs, iterations, input names.
NRTPY_BENCHMARK = """
import json, sys
import numpy as np
from nrtpy import NrtpyModel, NrtpyTensor
neff, folder, iterations, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
model = NrtpyModel.load_from_neff(neff)
inputs = {n: NrtpyTensor.from_numpy(np.load(f"{folder}/{n}.npy"), name=n) for n in names}
result = model.benchmark(inputs=inputs, warmup_iter=10, benchmark_iter=iterations, mode="device")
print(json.dumps(list(result.durations_ms)))
"""


def _argument_names(kernel: str):
    """The kernel's parameter names: the NEFF's input names (as in the SDK's nrtpy tutorial)."""
    return inspect.signature(KERNELS[kernel]).parameters


def _check_call(command: list[str], env: dict | None = None) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {tail[0]}")
    return done.stdout


def _find_key(tree, key: str) -> float:
    """The first value of `key` anywhere in a JSON tree (the summary's schema may change between versions)."""
    if isinstance(tree, dict):
        if key in tree:
            return float(tree[key])
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            with contextlib.suppress(KeyError):
                return _find_key(item, key)
    raise KeyError(key)


def _child(kernel: str, dtype: str, folder: str, *names: str) -> None:
    """In the child Python: run the kernel with the real NKI on the saved inputs, save its output as float32."""
    if USING_EMULATOR:
        raise SystemExit("the child found no real NKI (0.3 or later) to run the kernel with")
    inputs = [np.load(f"{folder}/{name}.npy").view(as_dtype(dtype)) for name in names]
    output = KERNELS[kernel](*inputs)
    np.save(f"{folder}/output.npy", np.asarray(output).astype(np.float32))


if __name__ == "__main__":
    _child(*sys.argv[1:])
