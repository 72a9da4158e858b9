"""The torch device fine-tuning trains on (`FinetuneOptions.device`): checked before any work, so that a device
torch does not know, or cannot use on this machine, is one line of error and not a crash after the lowering."""

from __future__ import annotations

from onnx_nmm.errors import OptionError

DEFAULT_DEVICE = "cpu"
NO_DATA = "meta"  # a device torch knows that holds shapes and no numbers


def check_device(device: str) -> None:
    """Raise OptionError unless torch can compute on `device` ("cpu", "cuda", "cuda:1", "mps", ...)."""
    if device == DEFAULT_DEVICE:
        return  # always there; torch is not imported for it
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise OptionError(f"{{device}} {device!r} is no torch device: give cpu, cuda, cuda:N or mps",
                          device="device") from None
    if parsed.type == NO_DATA:
        raise OptionError(f"{{device}} {device!r} holds no numbers to train: give cpu, cuda, cuda:N or mps",
                          device="device")
    try:
        torch.empty(1, device=parsed)
    except (RuntimeError, AssertionError) as error:  # torch says "Torch not compiled with CUDA enabled" by assert
        raise OptionError(f"{{device}} {device!r} is not usable on this machine ({_first_sentence(error)}): give "
                          "cpu, or a device this machine has", device="device") from None


def _first_sentence(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text.split(". ")[0].removesuffix(".")
