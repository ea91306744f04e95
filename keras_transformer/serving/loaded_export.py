"""A loaded SavedModel as Python sees it beside its signatures: the tokenizer its graph
holds and the limits fixed at export (its assets.extra metadata), and the checks that refuse,
with a `UsageError`, what the export cannot do as a run directory does
(`serving.saved_model_translation`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keras_transformer.decoding.alignment import DEFAULT_ALIGNMENT_LAYER
from keras_transformer.decoding.batch_decoder import count_tokens
from keras_transformer.decoding.defaults import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.errors import UsageError
from keras_transformer.serving.detailed_signatures import MAX_ALPHA, MAX_BEAM_SIZE
from keras_transformer.serving.saved_model import METADATA_FILE
from pipelines.tokenizer import SubwordTokenizer

__all__ = ["DETAILED_SIGNATURES", "Export", "check_prefixes", "check_segments",
           "check_supported", "export_tokenizer", "open_export", "resolve_limits"]

DETAILED_SIGNATURES = ("translate_details", "translate_prefix", "sample", "score")


@dataclass(frozen=True)
class Export:
    """A loaded SavedModel and what Python needs beside its signatures (`open_export`)."""

    path: Path
    signatures: Any
    tokenizer: SubwordTokenizer
    max_input_tokens: int
    max_extra_length: int
    max_beam_size: int
    alignment_layer: int
    decoder_layers: int | None
    beam_size: int = DEFAULT_BEAM_SIZE  # serving_default's (exported; an older export: none)
    alpha: float = DEFAULT_ALPHA

    @property
    def max_output_tokens(self) -> int:
        return self.max_input_tokens + self.max_extra_length

    def call(self, name: str, **inputs) -> dict[str, np.ndarray]:
        """The signature's outputs as numpy arrays."""
        return {key: value.numpy() for key, value in self.signatures[name](**inputs).items()}


def open_export(path: str | Path, loaded) -> Export:
    """The `Export` of a SavedModel version folder and its loaded object.

    Raises:
        UsageError: the folder lacks the export's metadata (assets.extra) or its graph holds
            no single sentencepiece model (not exported by `keras_transformer.export`).
    """
    path = Path(path)
    try:
        metadata = json.loads((path / METADATA_FILE).read_text(encoding="utf-8"))
        limits = (int(metadata["max_input_tokens"]), int(metadata["max_extra_length"]))
        numbers = (int(metadata.get("max_beam_size", MAX_BEAM_SIZE)),
                   int(metadata.get("alignment_layer", DEFAULT_ALIGNMENT_LAYER)),
                   metadata.get("model_config", {}).get("num_layers"),
                   int(metadata.get("beam_size", DEFAULT_BEAM_SIZE)),
                   float(metadata.get("alpha", DEFAULT_ALPHA)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UsageError(f"{path}: no readable {METADATA_FILE} ({error}); export the model "
                         "again with `python -m keras_transformer.export`.") from None
    return Export(path, loaded.signatures, export_tokenizer(path), *limits, *numbers)


def export_tokenizer(path: Path) -> SubwordTokenizer:
    """The export's tokenizer: the serialized sentencepiece model that its graph's
    `SentencepieceOp` holds (the tokenizer the signatures run)."""
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415 (rarely needed)

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((path / "saved_model.pb").read_bytes())
    models = {node.attr["model"].s
              for graph in (meta.graph_def for meta in proto.meta_graphs)
              for node in itertools.chain(graph.node, *(function.node_def for function
                                                        in graph.library.function))
              if node.op == "SentencepieceOp"}
    if len(models) != 1:
        raise UsageError(f"{path}: expected one sentencepiece model in the SavedModel's "
                         f"graph, found {len(models)}; export it with keras_transformer.export.")
    return SubwordTokenizer(models.pop())


def resolve_limits(export: Export, max_input_tokens: int | None,
                   max_output_tokens: int | None, extra_length: int | None) -> tuple[int, int]:
    """(max_input_tokens, extra_length): the export's unless given; what it cannot do refused."""
    name = f"{export.path} (a SavedModel)"
    max_input_tokens = export.max_input_tokens if max_input_tokens is None else max_input_tokens
    extra_length = export.max_extra_length if extra_length is None else extra_length
    if max_input_tokens > export.max_input_tokens:
        raise UsageError(f"{name}: max_input_tokens={max_input_tokens} is above its limit "
                         f"{export.max_input_tokens}, fixed at export; lower it (long lines "
                         "are split) or export again with a higher --max-input-tokens.")
    if extra_length != export.max_extra_length:
        raise UsageError(f"{name}: an output may have its source's tokens plus "
                         f"{export.max_extra_length}, fixed at export (extra_length="
                         f"{extra_length} asked).")
    if max_output_tokens is not None and max_output_tokens < max_input_tokens + extra_length:
        raise UsageError(f"{name}: max_output_tokens={max_output_tokens} is below its output "
                         f"limit, source tokens + {extra_length} (up to "
                         f"{max_input_tokens + extra_length}), fixed at export.")
    return max_input_tokens, extra_length


def check_segments(export: Export, segments, max_input_tokens: int) -> None:
    """A segment to truncate (`long_inputs` "truncate", or one word over the limit) is cut by
    the signatures at the export's limit: refused below it."""
    if max_input_tokens < export.max_input_tokens and any(
            "truncated" in segment.flags for segment in segments):
        line = next(segment.line for segment in segments if "truncated" in segment.flags)
        raise UsageError(f"{export.path} (a SavedModel): input line {line + 1} would be "
                         f"truncated at {max_input_tokens} tokens, but it truncates at its "
                         f"own limit, {export.max_input_tokens}; give no lower "
                         "max_input_tokens, or split long inputs.")


def check_prefixes(export: Export, prefixes: Sequence[str], options) -> None:
    """Forced prefixes (cleaned, "" for none) that `translate_prefix` cannot take refused."""
    prefixed = [prefix for prefix in prefixes if prefix]
    if not prefixed:
        return
    name = f"{export.path} (a SavedModel)"
    if options.num_hypotheses > 1 or options.sampling is not None:
        raise UsageError(f"{name}: its translate_prefix signature returns the best "
                         "hypothesis of a beam or greedy search: no n-best lists and no "
                         "sampling with a forced prefix (the run directory does both).")
    longest = max(count_tokens(export.tokenizer, prefixed))
    if longest > export.max_output_tokens - 1:
        raise UsageError(f"{name}: a prefix of {longest} tokens; it forces at most "
                         f"{export.max_output_tokens - 1} (its output limit, fixed at export).")


def check_supported(export: Export, options, names: Sequence[str]) -> None:
    """`UsageError` for settings the signatures would clip, or cannot take."""
    name = f"{export.path} (a SavedModel)"
    missing = [signature for signature in names if signature not in export.signatures]
    if missing:
        raise UsageError(f"{name}: no {', '.join(missing)} signature (an older export); "
                         "export it again with `python -m keras_transformer.export`.")
    if options.beam_size > export.max_beam_size or options.alpha > MAX_ALPHA:
        raise UsageError(f"{name}: beam_size at most {export.max_beam_size} (so "
                         f"num_hypotheses, --n-best, too) and alpha at most {MAX_ALPHA} (its "
                         f"signatures clip them), got {options.beam_size} and {options.alpha}.")
    if options.return_attention:
        raise UsageError(f"{name}: it returns alignments, not the attention behind them; "
                         "return_attention needs the run directory.")
    layers = export.decoder_layers or 1 << 30
    if options.return_alignment and (
            options.alignment_layer % layers != export.alignment_layer % layers):
        raise UsageError(f"{name}: its alignments come from decoder layer "
                         f"{export.alignment_layer}, fixed at export (asked: "
                         f"{options.alignment_layer}).")
