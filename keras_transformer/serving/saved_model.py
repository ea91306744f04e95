"""Export a trained model and its tokenizer as one SavedModel for TF Serving.

The SavedModel maps UTF-8 text to translated text entirely in the graph: cleaning, sentencepiece
tokenization (the tokenizer is a `tf.Module` attribute), beam search and detokenization. Running
it needs only `tensorflow` and `tensorflow_text` (whose ops the stock `tensorflow/serving` image
links since TF Serving 2.10).

Signatures:
    serving_default: inputs string (N,) -> outputs string (N,)
        (beam size and length penalty fixed at export, paper 6.1 defaults 4 and 0.6).
    translate: inputs string (N,), beam_size int32 (), alpha float32 ()
        -> outputs string (N,), scores float32 (N,); beam_size 1 decodes greedily.
    translate_nbest: same inputs -> outputs string (N, beam_size), scores (N, beam_size),
        best first.
    translate_details, translate_prefix, sample, score: n-best details (log-probs,
        finished flags, pieces, token log-probs, alignments), forced prefixes, seeded sampling
        and forced decoding of given pairs (`serving.detailed_signatures`).
TF2 signatures have no optional inputs, and TF Serving's row format ({"instances": [...]})
needs a single-input signature, so the tunable beam size and penalty live in `translate`.

Bounds (hostile input never crashes or hangs): invalid UTF-8 is replaced by U+FFFD, control
characters and Unicode spaces are folded to one space; each text is cut to
16 * max_input_tokens characters, then to max_input_tokens subword tokens (EOS included); each
output has at most min(input tokens + max_extra_length, max_input_tokens + max_extra_length)
tokens; beam_size is clipped to [1, max_beam_size], alpha to [0, 10] (NaN/inf -> default);
batches are sorted by length and decoded in chunks of `chunk_size` sentences, so memory stays
bounded for any batch size. Every input yields one output string; an empty input (nothing
left after cleaning) an empty string with score 0.

Mixed precision: a model trained under mixed_bfloat16 is rebuilt in float32 with the same
weights (its variables are float32 already), because float32 runs on every serving CPU and GPU.

Layout: `<export_base>/<version>/` with integer versions, as TF Serving watches. A version is
written to a hidden temporary folder beside it, fsynced and renamed into place
(`pipelines.storage.replace_folder`), so the server never sees a half-written version and a
killed export leaves only a temporary folder (removed by the next export once its process is
gone). A full, over-quota, read-only or failing disk raises `StorageError` naming the version
folder; the temporary folder is removed and the versions already there are untouched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import tensorflow as tf

from keras_transformer.decoding import inference_decoder
from keras_transformer.decoding.alignment import DEFAULT_ALIGNMENT_LAYER
from keras_transformer.decoding.inference_decoder import InferenceModel
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
    encode_texts,
    length_penalty,
)
from keras_transformer.serving.detailed_signatures import (
    MAX_BEAM_SIZE,
    DetailedSignatures,
    clip_beam_and_alpha,
)
from pipelines import storage
from pipelines.constants import PAD_ID
from pipelines.storage import StorageError

__all__ = ["TranslationModule", "export_saved_model", "latest_version", "serving_model"]

DEFAULT_CHUNK_SIZE = 32
METADATA_FILE = "assets.extra/keras_transformer.json"
_TEMP_PREFIX = ".tmp-export-"
# The signatures are traced with autograph off (as in decoding): explicit control flow only.
_STRINGS = tf.TensorSpec([None], tf.string, name="inputs")
_BEAM = tf.TensorSpec([], tf.int32, name="beam_size")
_ALPHA = tf.TensorSpec([], tf.float32, name="alpha")


class TranslationModule(DetailedSignatures, tf.Module):
    """Text-to-text translation with the model and tokenizer as tracked attributes.

    Args:
        model: a float32 `Transformer` (see `serving_model`).
        tokenizer: the `SubwordTokenizer` the model was trained with.
        beam_size, alpha: defaults of `serving_default`.
        max_input_tokens: source tokens kept per text (EOS included).
        max_extra_length: output tokens allowed beyond the source length (paper: 50).
        chunk_size: sentences decoded together; larger batches are split.
        jit_compile: run the decoding loop as XLA-compiled segments inside the SavedModel
            (see `keras_transformer.decoding.loops`). TF Serving runs it only with
            `--xla_cpu_compilation_enabled=true` on CPUs; the first request of each new shape
            compiles (seconds).
        alignment_layer: the decoder layer whose cross-attention gives the alignments of
            `translate_details` and `score` (`decoding.alignment`).
    """

    def __init__(self, model, tokenizer, *, beam_size: int = DEFAULT_BEAM_SIZE,
                 alpha: float = DEFAULT_ALPHA,
                 max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
                 max_extra_length: int = DEFAULT_EXTRA_LENGTH,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, jit_compile: bool = False,
                 alignment_layer: int = DEFAULT_ALIGNMENT_LAYER):
        super().__init__(name="translator")
        if not 1 <= beam_size <= MAX_BEAM_SIZE:
            raise ValueError(f"beam_size must be in [1, {MAX_BEAM_SIZE}], got {beam_size}.")
        if max_input_tokens < 1 or max_extra_length < 0 or chunk_size < 1:
            raise ValueError("max_input_tokens and chunk_size must be >= 1, "
                             "max_extra_length >= 0.")
        # The decoder's weights stored in the decoding step's layout (fused Q/K/V kernels, the
        # transposed output projection): computed once here and saved, not at every request.
        self.model = InferenceModel(model) if inference_decoder.supports(model) else model
        self.tokenizer = tokenizer
        self.beam_size, self.alpha = int(beam_size), float(alpha)
        self.max_input_tokens, self.max_extra_length = int(max_input_tokens), int(max_extra_length)
        self.max_output_tokens = self.max_input_tokens + self.max_extra_length
        self.chunk_size = int(chunk_size)
        self.jit_compile = bool(jit_compile)
        self.alignment_layer = int(alignment_layer)

    @tf.function(input_signature=[_STRINGS], autograph=False)
    def serve(self, inputs):
        """serving_default: translations (N,) of texts (N,) with the export-time settings."""
        # Calls `translate`, whose searches are the ones every signature shares
        # (`DetailedSignatures`): nothing of its own is traced.
        results = self.translate(inputs, tf.constant(self.beam_size), tf.constant(self.alpha))
        return {"outputs": results["outputs"]}

    @tf.function(input_signature=[_STRINGS, _BEAM, _ALPHA], autograph=False)
    def translate(self, inputs, beam_size, alpha):
        """Best translations (N,) and their length-penalized log-prob scores (N,)."""
        outputs, scores = self._translate(inputs, beam_size, alpha, nbest=False)
        return {"outputs": outputs, "scores": scores}

    @tf.function(input_signature=[_STRINGS, _BEAM, _ALPHA], autograph=False)
    def translate_nbest(self, inputs, beam_size, alpha):
        """All beam_size hypotheses (N, beam_size) per text, best first, with scores."""
        outputs, scores = self._translate(inputs, beam_size, alpha, nbest=True)
        return {"outputs": outputs, "scores": scores}

    def _translate(self, inputs, beam_size, alpha, nbest: bool):
        texts = tf.reshape(inputs, [-1])
        beam_size, alpha = clip_beam_and_alpha(beam_size, alpha)
        sources = encode_texts(self.tokenizer, texts, self.max_input_tokens)
        count = tf.shape(texts)[0]
        # Sorting by length keeps padding (and the longest sentence's step count) per chunk low.
        order = tf.argsort(sources.row_lengths(), stable=True)
        num_chunks = (count + self.chunk_size - 1) // self.chunk_size
        width = beam_size if nbest else 1

        def chunk(index, outputs, scores):
            rows = order[index * self.chunk_size: (index + 1) * self.chunk_size]
            ids, chunk_scores = tf.cond(
                tf.equal(beam_size, 1),
                lambda: self._greedy(tf.gather(sources, rows).to_tensor(), alpha),
                lambda: self._beam(tf.gather(sources, rows).to_tensor(), beam_size, alpha, nbest))
            ids = tf.reshape(ids, [-1, tf.shape(ids)[-1]])
            texts = self.tokenizer.detokenize(ids)
            # A model may emit byte pieces that do not form valid UTF-8; JSON needs it valid.
            texts = tf.strings.unicode_transcode(texts, "UTF-8", "UTF-8", errors="replace")
            return (index + 1, outputs.write(index, tf.reshape(texts, [-1, width])),
                    scores.write(index, tf.reshape(chunk_scores, [-1, width])))

        outputs = tf.TensorArray(tf.string, size=num_chunks, infer_shape=False,
                                 element_shape=[None, None])
        scores = tf.TensorArray(tf.float32, size=num_chunks, infer_shape=False,
                                element_shape=[None, None])
        _, outputs, scores = tf.while_loop(
            lambda index, *_: index < num_chunks, chunk, (tf.constant(0), outputs, scores))
        empty = tf.equal(count, 0)
        inverse = tf.math.invert_permutation(order)
        outputs = tf.cond(empty, lambda: tf.zeros([0, width], tf.string),
                          lambda: tf.gather(outputs.concat(), inverse))
        scores = tf.cond(empty, lambda: tf.zeros([0, width], tf.float32),
                         lambda: tf.gather(scores.concat(), inverse))
        # An empty line (nothing left after cleaning) translates to an empty string, score 0,
        # as in the Python API: no sentence is made up from EOS alone.
        blank = tf.equal(sources.row_lengths(), 1)[:, None]  # nothing but EOS
        outputs = tf.where(blank, tf.constant(""), outputs)
        scores = tf.where(blank, 0.0, scores)
        if nbest:
            return outputs, scores
        return outputs[:, 0], scores[:, 0]


    def _beam(self, source_ids, beam_size, alpha, nbest: bool):
        """ids (n, k, T) and length-penalized scores (n, k); k = beam_size if nbest else 1:
        the search every beam signature shares (`DetailedSignatures._beam_search`)."""
        return self._beam_search(source_ids, beam_size, alpha, self._no_prefix(source_ids),
                                 beam_size if nbest else tf.constant(1))

    def _greedy(self, source_ids, alpha):
        """Beam size 1 is greedy decoding (as in `translate_texts`; a one-beam search also
        weighs finished runner-up hypotheses, for a few % more time): ids (n, 1, T) and
        scores (n, 1), penalized as beam search's."""
        ids, scores = self._greedy_ids(source_ids)  # shared (`DetailedSignatures`)
        lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.int32), axis=-1)
        return ids, scores / length_penalty(lengths, alpha)


def serving_model(model):
    """The model in float32: itself, or a float32 copy of a mixed-precision model.

    Raises:
        TypeError: if `model` cannot be rebuilt from its config (not a Keras model).
    """
    if model.compute_dtype == "float32":
        return model
    config = dict(model.get_config(), dtype="float32")
    copy = type(model).from_config(config)
    copy.set_weights(model.get_weights())
    return copy


def latest_version(export_base: str | Path) -> int | None:
    """The highest integer version folder holding a saved_model.pb under `export_base`."""
    versions = [int(path.name) for path in Path(export_base).glob("*")
                if path.name.isdigit() and (path / "saved_model.pb").is_file()]
    return max(versions, default=None)


def export_saved_model(
    model,
    tokenizer,
    export_base: str | Path,
    version: int | None = None,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    max_extra_length: int = DEFAULT_EXTRA_LENGTH,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    jit_compile: bool = False,
) -> Path:
    """Writes `<export_base>/<version>/` (SavedModel + assets.extra metadata), atomically.

    Args:
        model: a trained `Transformer` (float32 or mixed precision).
        tokenizer: its `SubwordTokenizer`.
        export_base: the model's folder, e.g. saved_models/<name>.
        version: integer version; default: one more than the highest existing (or 1).
        max_input_tokens, max_extra_length, beam_size, alpha, chunk_size, jit_compile: see
            `TranslationModule`.

    Returns:
        The version folder.

    Raises:
        FileExistsError: if the version already exists.
        ValueError: for a non-positive version or invalid settings.
        StorageError: the disk is full, over quota, read-only or failing: names the version
            folder and the bytes it needed if known (its weights; the graph adds a few MB);
            nothing of it is left, earlier versions are untouched.
    """
    export_base = Path(export_base)
    with storage.errors_about(export_base):  # a read-only or full disk already here
        export_base.mkdir(parents=True, exist_ok=True)
    storage.remove_stale_temporaries(export_base, _TEMP_PREFIX)
    if version is None:  # after every version folder, also one without a saved_model.pb
        version = max((int(path.name) for path in export_base.glob("*")
                       if path.name.isdigit()), default=0) + 1
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}.")
    target = export_base / str(version)
    if target.exists():
        raise FileExistsError(f"{target} already exists; pick another version or omit it.")

    module = TranslationModule(
        serving_model(model), tokenizer, beam_size=beam_size, alpha=alpha,
        max_input_tokens=max_input_tokens, max_extra_length=max_extra_length,
        chunk_size=chunk_size, jit_compile=jit_compile)
    estimate = _weight_bytes(model, tokenizer)
    staging = None
    try:
        staging = storage.staging_folder(export_base, f"{_TEMP_PREFIX}{os.getpid()}-")
        signatures = {
            "serving_default": module.serve,
            "translate": module.translate,
            "translate_nbest": module.translate_nbest,
            "translate_details": module.translate_details,
            "translate_prefix": module.translate_prefix,
            "sample": module.sample,
            "score": module.score,
        }
        # No gradient functions: decoding computes none (the LayerNorm takes its hand-written
        # gradient only under a tape), and each load of a SavedModel that holds some
        # registers them in TensorFlow's gradient registry for the life of the process.
        tf.saved_model.save(module, str(staging), signatures=signatures,
                            options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
        metadata = {
            "beam_size": module.beam_size, "alpha": module.alpha,
            "max_input_tokens": module.max_input_tokens,
            "max_extra_length": module.max_extra_length,
            "max_output_tokens": module.max_output_tokens,
            "max_beam_size": MAX_BEAM_SIZE, "chunk_size": module.chunk_size,
            "jit_compile": module.jit_compile, "alignment_layer": module.alignment_layer,
            "model_config": _jsonable(model.get_config()),
            "vocab_size": int(tokenizer.vocab_size),
        }
        (staging / METADATA_FILE).parent.mkdir(exist_ok=True)
        storage.write_json(staging / METADATA_FILE, metadata)
        # Fails rather than merge into a version that appeared meanwhile (not empty).
        storage.replace_folder(staging, target)
    except BaseException as error:
        written = storage.folder_bytes(staging) if staging is not None else 0
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        # Built after the removal, so that the free space it reports is what is left. The
        # weights are a lower bound of the size: past them, the graph's is unknown.
        failure = _storage_failure(error, target, estimate if written < estimate else None)
        if failure is not None:
            raise failure from None
        raise
    return target


def _storage_failure(error: BaseException, target: Path,
                     needed: int | None) -> StorageError | None:
    """`error` as a `StorageError` about the version folder `target`, if the storage failed.

    TensorFlow reports a full disk as a `ResourceExhaustedError` (or another `OpError`) with
    the errno text in its message. `replace_folder` raises one about `target` already, with
    the exact size; a write of the metadata one about a file in the temporary folder, which
    is gone now.
    """
    if not isinstance(error, Exception):
        return None  # KeyboardInterrupt, SystemExit: not the storage
    if isinstance(error, StorageError):
        return error if error.path == target else StorageError(error.errno, target, needed)
    return storage.storage_error(error, target, needed)


def _weight_bytes(model, tokenizer) -> int:
    """A lower bound of an export's size: its float32 weights and the sentencepiece model
    (the graph adds a few MB, unknown before it is serialized)."""
    return 4 * sum(math.prod(weight.shape) for weight in model.weights) + len(
        tokenizer.model_proto)


def _jsonable(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))
