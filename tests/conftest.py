import os
import shutil
from pathlib import Path

import pytest
from exported_models import CACHE, exported_model
from threadpoolctl import threadpool_limits


def pytest_configure(config):
    CACHE.mkdir(parents=True, exist_ok=True)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # xdist runs a worker per core: threads of BLAS or torch on top of that oversubscribe the cores, and
        # OpenBLAS's spinning threads then make a small eigendecomposition a hundred times slower
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        threadpool_limits(1)


@pytest.fixture
def export():
    """export(architecture, exporter, external_data=False, seed=0, cache=False, opset=None, positions=True) -> path
    of a cached export."""
    return exported_model


@pytest.fixture
def copied_export(tmp_path):
    """A private copy of a cached export (model and external data), for tests that write beside it."""

    def copy(architecture: str, exporter: str, external_data: bool = False) -> Path:
        source = exported_model(architecture, exporter, external_data).parent
        target = tmp_path / f"{architecture}-{exporter}"
        shutil.copytree(source, target)
        return target / "model.onnx"

    return copy
