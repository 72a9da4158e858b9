"""The four ways a rewrite compresses its targets, and what each needs: the one module that reads a method's
name (besides the options that check it and the CLI that takes it).

    svd      W = P Σ Qᵀ truncated                                  nothing but the weights
    whiten   Sᵀ·W = P Σ Qᵀ,  G = XᵀX = S Sᵀ                          the inputs' Gram XᵀX (calibration)
    fisher   Sᵀ·W·T = P Σ Qᵀ,  G_out = T Tᵀ                          XᵀX and each output's gradient Gram GᵀG:
                                                                    the KL a truncation adds is predicted
    nystrom  each MLP narrowed to the neurons that matter, its      XᵀX, and a held-out Gram that chooses
             down projection refitted; other targets whitened       the refit's ridge
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a method does to a layer and what it needs. `factorizes_as`: the decomposition of the layers it
    factorizes, as the report's rows name it."""

    name: str
    factorizes_as: str
    weighted: bool = False  # factors weighted by the inputs' Gram: needs calibration statistics
    output_grams: bool = False  # weighted by each output's gradient Gram too (fisher)
    narrows_mlps: bool = False  # MLPs narrowed as modules, not factorized

    @property
    def calibrated(self) -> bool:
        """Whether it learns from calibration data."""
        return self.weighted

    @property
    def fits_sequentially(self) -> bool:
        """Whether sequential calibration applies: weighted factors, or (layer by layer) a narrowed MLP's output
        projection, refitted to the compressed model's inputs."""
        return self.weighted


SVD = Method("svd", "svd")
WHITEN = Method("whiten", "whiten", weighted=True)
FISHER = Method("fisher", "fisher", weighted=True, output_grams=True)
NYSTROM = Method("nystrom", "whiten", weighted=True, narrows_mlps=True)
METHODS = {method.name: method for method in (SVD, WHITEN, FISHER, NYSTROM)}


def method_named(name: str) -> Method:
    """The method called `name` (one of METHODS; the options check the name first)."""
    return METHODS[name]
