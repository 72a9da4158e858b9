"""Run `onnx-nmm` commands from the study scripts and keep each one, so the pages they write can list
the exact commands behind their numbers."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys


class CommandLog:
    def __init__(self):
        self.lines: list[str] = []

    def run(self, *argv) -> str:
        """Run `onnx-nmm ARGV` (this Python's package), echo and record it; return its stdout."""
        argv = [str(a) for a in argv]
        self.lines.append(shlex.join(["onnx-nmm", *argv]))
        print("$", self.lines[-1], flush=True)
        result = subprocess.run([sys.executable, "-m", "onnx_nmm", *argv], check=True, capture_output=True, text=True)
        return result.stdout

    def json(self, *argv) -> dict:
        """`run`, for a command given --json."""
        return json.loads(self.run(*argv))
