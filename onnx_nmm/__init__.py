"""onnx-nmm: SVD-factorize the linear layers of exported LLM graphs, lower them to fused NKI kernels.

The Python API; the `onnx-nmm` command is a thin shell over it (one function per command):

    import onnx_nmm

    result = onnx_nmm.rewrite("llama.onnx", onnx_nmm.RewriteOptions(ranks=onnx_nmm.RankOptions(keep=0.8)))
    result.save("llama.nmm.onnx")
    onnx_nmm.diff("llama.onnx", "llama.nmm.onnx")

Models may be paths or in-memory models (onnx_ir.Model, onnx.ModelProto); an in-memory model is never
changed. Every error is an OnnxNmmError subclass saying what is wrong and what to do.
"""

__version__ = "0.1.0"

from onnx_nmm.calibration.sources import GeneratedText
from onnx_nmm.calibration.tokens import is_tokenizer_folder, load_tokenizer
from onnx_nmm.errors import (
    DataError,
    ExecutionError,
    GenerationMismatch,
    LoweringMismatch,
    MissingDependencyError,
    ModelError,
    NeuronSdkMissing,
    OnnxNmmError,
    OptionError,
    OutputError,
    TrainingDiverged,
)
from onnx_nmm.export import TinyShape, build_model, export_causal_lm, export_checkpoint, load_gguf_causal_lm
from onnx_nmm.generation.answers import AnswerCheck, check_answers
from onnx_nmm.generation.decode_speed import Benchmark, BenchOptions, ModelSpeed, bench
from onnx_nmm.generation.decoding import Decoder, DecoderState
from onnx_nmm.generation.generate import GenerateOptions, Generation, generate
from onnx_nmm.inspection import Inspection, LayerInfo, inspect
from onnx_nmm.layerwise.dry_run import LayerwisePlan, plan_layerwise
from onnx_nmm.layerwise.memory import too_large_for_memory
from onnx_nmm.layerwise.rewrite import rewrite_layerwise
from onnx_nmm.model_io import check_output_path, external_data_path
from onnx_nmm.options import CalibrationOptions, FactorizationOptions, RankOptions, RewriteOptions, Selection
from onnx_nmm.pipeline import LayerOutcome, RewriteReport, RewriteResult, rewrite
from onnx_nmm.progress import Phase, Progress
from onnx_nmm.quality.evaluation import Evaluation, TextOptions, evaluate
from onnx_nmm.quality.model_diff import Diff, DiffOptions, TextDiff, diff, diff_on_text
from onnx_nmm.ranks.rank_plan import Dense, RankPlan
from onnx_nmm.runtime.backend_runner import RUN_BACKENDS, ModelRunner, RunResult, run_model
from onnx_nmm.runtime.causal_lm import CausalLm
from onnx_nmm.runtime.compiled_folder import is_compiled_folder
from onnx_nmm.runtime.host import describe_machine
from onnx_nmm.scale import RewritePlan, StreamOptions, plan_rewrite, rewrite_streamed, work_dir_of
from onnx_nmm.training.finetuning import FinetuneOptions, FinetuneResult, TrainingData, TrainingOptions, finetune
from onnx_nmm.trainium.compilation import compile
from onnx_nmm.trainium.compile_steps import Compilation, CompileOptions
from onnx_nmm.trainium.decoder_shape import DecoderShape, decoder_shape, decoder_shape_of_config, factorized
from onnx_nmm.trainium.speed import TrainiumEstimate, TrainiumOptions, estimate_trainium

__all__ = [
    "AnswerCheck", "bench", "Benchmark", "BenchOptions", "build_model", "CalibrationOptions", "CausalLm",
    "check_answers", "check_output_path",
    "Compilation", "compile", "CompileOptions", "DataError", "Decoder", "decoder_shape", "decoder_shape_of_config",
    "DecoderShape", "DecoderState", "Dense", "describe_machine", "Diff", "diff", "diff_on_text", "DiffOptions",
    "estimate_trainium", "evaluate", "Evaluation", "ExecutionError", "export_causal_lm", "export_checkpoint",
    "external_data_path", "FactorizationOptions", "factorized", "finetune", "FinetuneOptions", "FinetuneResult",
    "generate", "GeneratedText", "GenerateOptions", "Generation", "GenerationMismatch", "inspect", "Inspection",
    "is_compiled_folder", "is_tokenizer_folder", "LayerInfo",
    "LayerOutcome", "load_gguf_causal_lm", "load_tokenizer", "LoweringMismatch", "MissingDependencyError",
    "ModelError", "ModelRunner", "ModelSpeed", "NeuronSdkMissing", "OnnxNmmError", "OptionError", "OutputError",
    "LayerwisePlan", "Phase", "plan_layerwise", "plan_rewrite", "Progress", "RankOptions", "RankPlan", "rewrite",
    "rewrite_streamed", "RewriteOptions",
    "RewritePlan", "RewriteReport", "RewriteResult", "rewrite_layerwise", "RUN_BACKENDS", "run_model", "RunResult",
    "Selection",
    "StreamOptions", "TextDiff", "TextOptions", "TinyShape", "TrainingData", "TrainingDiverged", "TrainingOptions",
    "TrainiumEstimate", "TrainiumOptions", "too_large_for_memory", "work_dir_of",
]
