"""What onnx-nmm raises when it cannot do what it was asked: one type per kind of trouble.

Every error says what is wrong and what to do, in the library's own terms. Where a message names an
option it writes a `{placeholder}` and says which option it means, so that each caller spells options
its own way: the Python API as the option's path in RewriteOptions ("ranks.keep"), the command line as
its flag ("--keep"). `str(error)` is the API's spelling; `error.message(spell)` any other.
"""

from __future__ import annotations

from collections.abc import Callable


class OnnxNmmError(Exception):
    """Base of every error onnx-nmm raises for bad input or an impossible request."""

    def __init__(self, template: str, **options: str):
        self.template = template
        self.options = options  # placeholder in the template → the option it names ("keep" → "ranks.keep")
        super().__init__(self.message())

    def message(self, spell: Callable[[str], str] = str) -> str:
        """The message with every option spelt by `spell` (given the option's path)."""
        if not self.options:
            return self.template
        return self.template.format(**{key: spell(option) for key, option in self.options.items()})


class OptionError(OnnxNmmError, ValueError):
    """An option's value, or a combination of options, that cannot be carried out."""


class ModelError(OnnxNmmError):
    """A model the request cannot use: not ONNX, missing weights, no linear layer, two models that differ."""


class DataError(OnnxNmmError):
    """Text, token ids, a tokenizer, model inputs or calibration statistics that cannot be used."""


class OutputError(OnnxNmmError):
    """An output that would overwrite the input, or a folder that is already there."""


class ExecutionError(OnnxNmmError):
    """Running a model failed: onnxruntime refused it, or the numbers became NaN or Inf."""


class MissingDependencyError(OnnxNmmError):
    """A Python package this request needs is not installed."""


NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"  # the Neuron SDK's only package repository


class NeuronSdkMissing(MissingDependencyError):
    """The Neuron SDK is not installed, so nothing can be traced for Trainium."""


class LoweringMismatch(OnnxNmmError):
    """The model lowered to PyTorch computes something else than onnxruntime does (a bug of the lowering)."""


class GenerationMismatch(OnnxNmmError):
    """A compiled folder's graphs generate something else than the model they were compiled from."""


class TrainingDiverged(OnnxNmmError):
    """Fine-tuning made the loss or the factors NaN or Inf."""
