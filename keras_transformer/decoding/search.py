"""6.1 decoding: beam search (beam 4, length penalty alpha = 0.6, max length input + 50), greedy.

Both searches run as one `tf.while_loop` in a `tf.function`, with the model's key/value cache:
the encoder and the encoder-decoder keys/values are computed once per batch, and each step feeds
one new position per hypothesis. `use_cache=False` re-runs the decoder over the whole prefix at
every step instead (the reference that tests and the benchmark compare against).

A float32 `Transformer` (or an `InferenceModel`, as exports hold) runs its decoding steps in the
serving layout (`keras_transformer.decoding.inference_decoder`: the same tokens, fewer ops);
a mixed_bfloat16 `Transformer` (logits come back float32 either way) and any object with
`encode`/`initial_cache`/`decode` are searched through those methods. Called eagerly they run a cached, compiled `tf.function` per model and
option set; called inside a `tf.function` (as the SavedModel export does) they trace inline.

Outputs are dense int32 ids without BOS: the generated tokens, ending with EOS when the model
emitted one within the length limit (a hypothesis cut by the limit has none), then 0-padding.
PAD and BOS are never generated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import tensorflow as tf

from keras_transformer.decoding.defaults import (  # noqa: F401  (search's own settings)
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.decoding.loops import (
    NEG_INF,
    beam_loop,
    greedy_loop,
    length_penalty,
)
from keras_transformer.decoding.sampling import Sampling
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID

__all__ = [
    "BOS_ID", "EOS_ID", "NEG_INF", "PAD_ID", "beam_search", "clean_texts", "encode_texts",
    "greedy_search", "length_penalty",
]

# Characters kept per text before tokenizing, per allowed token: bounds tokenizer time on
# absurdly long lines while keeping far more than any sentence of max_input_tokens needs.
CHARS_PER_TOKEN = 16
# "No cap" for max_length as a tensor; any real limit is far below.
_NO_LIMIT = 2**30

_SOURCE_SPEC = tf.TensorSpec([None, None], tf.int32, name="source_ids")
_PREFIX_SPEC = tf.TensorSpec([None, None], tf.int32, name="prefix_ids")
_SEEDS_SPEC = tf.TensorSpec([None], tf.uint32, name="seeds")
_SCALARS = {
    "beam_size": tf.TensorSpec([], tf.int32), "alpha": tf.TensorSpec([], tf.float32),
    "extra_length": tf.TensorSpec([], tf.int32), "max_length": tf.TensorSpec([], tf.int32),
    "min_length": tf.TensorSpec([], tf.int32), "force_length": tf.TensorSpec([], tf.int32),
}
# One compiled search per (model, variant), kept on the model itself so that it lives and
# dies with it (a module-level cache keyed by model would keep every model alive: the
# functions close over it). The loops use tf.while_loop/tf.cond explicitly, so autograph
# (whose source conversion of the search and every Keras layer costs seconds per trace) is off.
_CACHE_ATTRIBUTE = "_keras_transformer_searches"


def _prepare_source(source_ids):
    """int32 (batch, max(source_length, 1)): a zero-width batch would give empty attention."""
    source_ids = tf.convert_to_tensor(source_ids)
    source_ids = tf.cast(source_ids, tf.int32)
    width = tf.shape(source_ids)[1]
    return tf.pad(source_ids, [[0, 0], [0, tf.maximum(1 - width, 0)]])


def compiled_per_model(model, key: tuple, build) -> Any:
    """The `tf.function` for `key` on `model`, traced once per model and key."""
    per_model = getattr(model, _CACHE_ATTRIBUTE, None)
    if per_model is None:
        per_model = {}
        try:
            # object.__setattr__: Keras would otherwise track the dict as model state.
            object.__setattr__(model, _CACHE_ATTRIBUTE, per_model)
        except (AttributeError, TypeError):  # e.g. __slots__: compile for this call only
            return build()
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def _prepare_prefix(prefix_ids):
    """int32 (batch, max(P, 1)), or None: tokens forced at the first steps, 0-padded."""
    if prefix_ids is None:
        return None
    prefix_ids = tf.cast(tf.convert_to_tensor(prefix_ids), tf.int32)
    if prefix_ids.shape.rank != 2:
        raise ValueError(f"prefix_ids must be (batch, length), got shape {prefix_ids.shape}.")
    width = tf.shape(prefix_ids)[1]
    return tf.pad(prefix_ids, [[0, 0], [0, tf.maximum(1 - width, 0)]])


def _prepare_seeds(sampling, seeds):
    """uint32 (batch,) per-sentence seeds, or None without sampling."""
    if sampling is None:
        return None
    if seeds is None:
        raise ValueError("sampling needs seeds: one per sentence (decoding.sampling.line_seeds).")
    return tf.cast(tf.convert_to_tensor(seeds), tf.uint32)


def _options(extra_length, max_length, min_length, force_length) -> dict[str, tf.Tensor]:
    if extra_length < 0 or min_length < 0:
        raise ValueError("extra_length and min_length must be >= 0.")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}.")
    if force_length is not None and force_length < 1:
        raise ValueError(f"force_length must be >= 1, got {force_length}.")
    return {
        "extra_length": tf.constant(extra_length, tf.int32),
        "max_length": tf.constant(_NO_LIMIT if max_length is None else max_length, tf.int32),
        "min_length": tf.constant(min_length, tf.int32),
        "force_length": tf.constant(force_length or 0, tf.int32),
    }


def greedy_search(
    model,
    source_ids,
    max_length: int | None = None,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    use_cache: bool = True,
    min_length: int = 0,
    force_length: int | None = None,
    jit_compile: bool = False,
    prefix_ids=None,
    sampling: Sampling | None = None,
    seeds=None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Greedy decoding of a batch: the most likely token at every step (or a sampled one).

    Args:
        model: a `Transformer`, an `InferenceModel`, or any object with the Transformer's
            encode/initial_cache/decode API.
        source_ids: int (batch, source_length), 0-padded source token ids.
        max_length: absolute cap on generated tokens (EOS included), on top of `extra_length`.
        extra_length: each sentence may produce up to its source length (non-PAD tokens) plus
            this many tokens (paper 6.1: 50).
        use_cache: incremental decoding with the key/value cache (False: re-run the prefix).
        min_length: EOS is forbidden until this many tokens (EOS included) are generated.
        force_length: if set, EOS is forbidden and every output has exactly this many tokens
            (for fixed-shape benchmarks); overrides the other length settings.
        jit_compile: run the steps as XLA-compiled segments (cached decoding only): on
            CPU faster for small batches and greedy search, slower for beam search over
            large batches; each new (rows, source width, length) bucket costs seconds of
            compilation, so it pays off for long runs of similar batches.
        prefix_ids: int (batch, P), 0-padded: target tokens forced at the first steps (no
            BOS, no EOS); their log-probabilities count in the score. The limit grows to at
            least P + 1 tokens.
        sampling: draw each token at random (`decoding.sampling.Sampling`) instead of taking
            the most likely one.
        seeds: uint32 (batch,) with `sampling`: each sentence's seed
            (`decoding.sampling.line_seeds` of the user's seed and the line's index).

    Returns:
        (ids int32 (batch, T): tokens ending with EOS unless cut by the limit, then 0-padded;
         scores float32 (batch,): summed log-probabilities of the tokens).
    """
    options = _options(extra_length, max_length, min_length, force_length)
    source_ids = _prepare_source(source_ids)
    extras = {"prefix": _prepare_prefix(prefix_ids),
              "seeds": _prepare_seeds(sampling, seeds)}
    extras = {name: value for name, value in extras.items() if value is not None}
    if tf.inside_function():
        return greedy_loop(model, source_ids, use_cache=use_cache, jit_compile=jit_compile,
                           sampling=sampling, **options, **extras)

    def build():
        specs = {"prefix": _PREFIX_SPEC, "seeds": _SEEDS_SPEC}
        signature = ([_SOURCE_SPEC] + [_SCALARS[name] for name in options]
                     + [specs[name] for name in extras])

        def search(source, *args):
            named = dict(zip(extras, args[len(options):], strict=True))
            return greedy_loop(model, source, *args[:len(options)], use_cache=use_cache,
                               jit_compile=jit_compile, sampling=sampling, **named)
        return tf.function(search, input_signature=signature, autograph=False)

    # The seed reaches the search as `seeds` (a tensor): one trace serves every seed.
    traced = None if sampling is None or not sampling.static else replace(sampling, seed=0)
    key = ("greedy", use_cache, jit_compile, "prefix" in extras, traced)
    search = compiled_per_model(model, key, build)
    return search(source_ids, *options.values(), *extras.values())


def beam_search(
    model,
    source_ids,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    num_return: int | None = 1,
    use_cache: bool = True,
    max_length: int | None = None,
    min_length: int = 0,
    force_length: int | None = None,
    jit_compile: bool = False,
    prefix_ids=None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Beam search of a batch with the GNMT length penalty ((5 + length) / 6) ** alpha.

    Args:
        model: a `Transformer`, an `InferenceModel`, or any object with the Transformer's
            encode/initial_cache/decode API.
        source_ids: int (batch, source_length), 0-padded source token ids.
        beam_size: hypotheses kept per sentence (paper: 4). May be a scalar int32 tensor
            inside a `tf.function`.
        alpha: length penalty exponent (paper: 0.6); 0 ranks by plain log-probability. Must be
            >= 0 for the early stop to be exact. May be a scalar float32 tensor.
        extra_length, max_length, min_length, force_length, use_cache, jit_compile,
            prefix_ids: as in `greedy_search`.
        num_return: hypotheses returned per sentence, best first (<= beam_size); None for all
            beam_size of them. Inside a `tf.function` it may be a scalar int32 tensor in
            [1, beam_size] (outputs then keep their num_return axis, even for 1).

    Returns:
        num_return == 1 (an int): (ids int32 (batch, T), scores float32 (batch,));
        otherwise (ids (batch, num_return, T), scores (batch, num_return)), best first.
        Ids end with EOS unless cut by the length limit, then 0-padded; scores are
        log-prob / length penalty.
    """
    fixed_return = not tf.is_tensor(num_return)  # None, or a Python or numpy integer
    if fixed_return and num_return is not None:
        num_return = int(num_return)
        if num_return < 1:
            raise ValueError(f"num_return must be >= 1, got {num_return}.")
        if isinstance(beam_size, int) and num_return > beam_size:
            raise ValueError(f"num_return={num_return} exceeds beam_size={beam_size}.")
    if isinstance(alpha, (int, float)) and alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}.")
    options = _options(extra_length, max_length, min_length, force_length)
    source_ids = _prepare_source(source_ids)
    beam_size = tf.cast(beam_size, tf.int32)
    alpha = tf.cast(alpha, tf.float32)
    prefix = _prepare_prefix(prefix_ids)
    if not fixed_return and not tf.inside_function():
        raise ValueError("num_return may be a tensor only inside a tf.function.")
    if tf.inside_function():
        ids, scores = beam_loop(model, source_ids, beam_size, alpha, num_return=num_return,
                                use_cache=use_cache, jit_compile=jit_compile, prefix=prefix,
                                **options)
    else:
        def build():
            names = ["beam_size", "alpha", *options]
            signature = [_SOURCE_SPEC] + [_SCALARS[name] for name in names]

            def search(source, *args):
                named = {} if prefix is None else {"prefix": args[-1]}
                return beam_loop(model, source, *args[:len(names)], num_return=num_return,
                                 use_cache=use_cache, jit_compile=jit_compile, **named)
            return tf.function(
                search, autograph=False,
                input_signature=signature + ([] if prefix is None else [_PREFIX_SPEC]))

        key = ("beam", use_cache, num_return, jit_compile, prefix is not None)
        search = compiled_per_model(model, key, build)
        ids, scores = search(source_ids, beam_size, alpha, *options.values(),
                             *(() if prefix is None else (prefix,)))
    if fixed_return and num_return == 1:
        return ids[:, 0], scores[:, 0]
    return ids, scores


# --- text in: the same cleaning for the Python API, the CLIs and the SavedModel ---


def clean_texts(texts, max_chars: int):
    """Makes arbitrary byte strings safe to tokenize; works eagerly and in graphs.

    Invalid UTF-8 becomes U+FFFD, each run of control characters and Unicode spaces becomes
    one space, ends are stripped, and at most `max_chars` characters are kept.

    Args:
        texts: tf.string (N,).
        max_chars: characters kept per text.

    Returns:
        tf.string (N,), valid UTF-8.
    """
    texts = tf.strings.unicode_transcode(
        texts, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD)
    texts = tf.strings.substr(texts, 0, max_chars, unit="UTF8_CHAR")
    return tf.strings.strip(tf.strings.regex_replace(texts, r"[\p{Cc}\p{Z}]+", " "))


def encode_texts(tokenizer, texts, max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS):
    """Source ids as the model was trained on them: subword pieces, then EOS.

    Args:
        tokenizer: a `pipelines.tokenizer.SubwordTokenizer` (anything with `tokenize`).
        texts: tf.string (N,) (or a list of str), any bytes.
        max_input_tokens: ids kept per text, EOS included (longer inputs are truncated).

    Returns:
        int32 RaggedTensor (N, (length)), every row ending with EOS (an empty text is [EOS]).
    """
    if max_input_tokens < 1:
        raise ValueError(f"max_input_tokens must be >= 1, got {max_input_tokens}.")
    texts = tf.reshape(tf.convert_to_tensor(texts, tf.string), [-1])
    pieces = tokenizer.tokenize(clean_texts(texts, CHARS_PER_TOKEN * max_input_tokens))
    pieces = tf.cast(pieces[:, : max_input_tokens - 1], tf.int32)
    eos = tf.RaggedTensor.from_tensor(tf.fill([pieces.nrows(), 1], EOS_ID))
    return tf.concat([pieces, eos], axis=1)
