"""Our weights as a CTranslate2 model (`ctranslate2.specs.TransformerSpec`), for users who
serve with CTranslate2 (the optional extra `ctranslate2`; no TensorFlow at inference).

The mapping (CTranslate2 4.8, python/ctranslate2/specs/transformer_spec.py):
- post-norm layers (`pre_norm=False`: `LN(x + sublayer(x))`, no final LayerNorm), our
  LayerNorm epsilon, ReLU or GELU feed-forward;
- the one shared embedding matrix as source embedding, target embedding and output
  projection (CTranslate2 stores equal arrays once), scaled by sqrt(d_model) on input;
- our own sinusoidal table as `position_encodings` (CTranslate2's built-in table puts sines
  and cosines in two halves; ours interleaves them, 3.5);
- Keras kernels are (in, out) and per head; CTranslate2 wants (out, in), with the
  self-attention's query, key and value fused into one matrix and the cross-attention's key
  and value into another;
- the SentencePiece pieces as one shared vocabulary; sources end with EOS (`add_source_eos`)
  and the decoder starts from BOS, as in our pipelines.

The directory is written as a hidden sibling, fsynced and renamed into place, so a reader
never finds half of it; a full, over-quota, read-only or failing disk raises `StorageError`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from keras_transformer.decoding.alignment import DEFAULT_ALIGNMENT_LAYER
from keras_transformer.decoding.defaults import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.layers.embedding import sinusoidal_encoding
from pipelines import storage
from pipelines.storage import StorageError

# The run's beam size and alpha beside the CTranslate2 files (`export_ctranslate2`).
DECODING_FILE = "decoding.json"

# Rows of the position table: CTranslate2's default longest input (1024) and decoding (256).
POSITIONS = 1024


def transformer_spec(model, tokenizer, alignment_layer: int = DEFAULT_ALIGNMENT_LAYER):
    """The `ctranslate2.specs.TransformerSpec` holding `model`'s weights.

    Args:
        model: a post-norm `keras_transformer.model.transformer.Transformer` (float32 weights).
        tokenizer: its `pipelines.tokenizer.SubwordTokenizer`.
        alignment_layer: the decoder layer whose attention (all heads averaged) CTranslate2
            returns with `return_attention`, as our alignments read it.

    Raises:
        ValueError: a pre-norm model (not converted yet), or a vocabulary that does not
            match the model's.
    """
    import sentencepiece as spm
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    if config.pre_norm:
        raise ValueError("only post-norm models (the paper's) convert to CTranslate2 here")
    processor = spm.SentencePieceProcessor(model_proto=tokenizer.model_proto)
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    if len(pieces) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(pieces)} pieces, the model a vocabulary of "
                         f"{config.vocab_size}")
    weights = {w.path: np.asarray(w.numpy(), dtype=np.float32) for w in model.weights}
    activation = {"relu": common_spec.Activation.RELU,
                  "gelu": common_spec.Activation.GELU}[config.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (config.num_layers, config.num_layers), config.num_heads, pre_norm=False,
        activation=activation, alignment_layer=alignment_layer,
        alignment_heads=config.num_heads)
    d_model = config.d_model
    embedding = weights["source_embedding/embeddings"]
    positions = np.asarray(sinusoidal_encoding(np.arange(POSITIONS), d_model,
                                               config.max_wavelength), np.float32)
    for side in (spec.encoder, spec.decoder):
        side.scale_embeddings = True
        side.position_encodings.encodings = positions
    spec.encoder.embeddings[0].weight = embedding
    if config.tie_embeddings:  # 3.4: one matrix for both embeddings and the output
        spec.decoder.embeddings.weight = spec.decoder.projection.weight = embedding
    else:  # CTranslate2's projection is (vocab, d_model); our kernel (d_model, vocab)
        spec.decoder.embeddings.weight = weights["target_embedding/embeddings"]
        spec.decoder.projection.weight = np.ascontiguousarray(
            weights["output_projection/kernel"].T)

    def linear(target, *names: str) -> None:
        """`target` = the dense layers `names`, as one (out, in) matrix and bias."""
        # Kernels are (in, out), or per head (in, heads, depth) and (heads, depth, out): the
        # bias has the output's size in every case.
        biases = [weights[f"{name}/bias"].reshape(-1) for name in names]
        target.weight = np.concatenate([weights[f"{name}/kernel"].reshape(-1, bias.size).T
                                        for name, bias in zip(names, biases, strict=True)])
        target.bias = np.concatenate(biases)

    def norm(target, name: str) -> None:
        target.gamma, target.beta = weights[f"{name}/norm/gamma"], weights[f"{name}/norm/beta"]

    def feed_forward(target, prefix: str) -> None:
        linear(target.linear_0, f"{prefix}/feed_forward/inner")
        linear(target.linear_1, f"{prefix}/feed_forward/output")
        norm(target.layer_norm, f"{prefix}/feed_forward_block")

    def self_attention(target, prefix: str) -> None:
        own = f"{prefix}/self_attention"
        linear(target.linear[0], f"{own}/query", f"{own}/key", f"{own}/value")
        linear(target.linear[1], f"{own}/attention_output")
        norm(target.layer_norm, f"{prefix}/self_attention_block")

    for index, layer in enumerate(spec.encoder.layer):
        self_attention(layer.self_attention, f"encoder_layer_{index}")
        feed_forward(layer.ffn, f"encoder_layer_{index}")
    for index, layer in enumerate(spec.decoder.layer):
        prefix = f"decoder_layer_{index}"
        cross = f"{prefix}/cross_attention"
        self_attention(layer.self_attention, prefix)
        linear(layer.attention.linear[0], f"{cross}/query")
        linear(layer.attention.linear[1], f"{cross}/key", f"{cross}/value")
        linear(layer.attention.linear[2], f"{cross}/attention_output")
        norm(layer.attention.layer_norm, f"{prefix}/cross_attention_block")
        feed_forward(layer.ffn, prefix)

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.layer_norm_epsilon = config.layer_norm_epsilon
    spec.config.add_source_eos = True
    spec.config.unk_token = processor.id_to_piece(processor.unk_id())
    spec.config.bos_token = spec.config.decoder_start_token = processor.id_to_piece(
        processor.bos_id())
    spec.config.eos_token = processor.id_to_piece(processor.eos_id())
    return spec


def export_ctranslate2(model, tokenizer, directory: str | os.PathLike,
                       quantization: str | None = None,
                       alignment_layer: int = DEFAULT_ALIGNMENT_LAYER, *,
                       beam_size: int = DEFAULT_BEAM_SIZE,
                       alpha: float = DEFAULT_ALPHA) -> Path:
    """Writes the CTranslate2 model directory `directory` (model.bin, config.json,
    shared_vocabulary.json), our SentencePiece model as `sentencepiece.model`, and
    `decoding.json`, {"beam_size": ..., "alpha": ...}: the settings to pass to
    `translate_with_ctranslate2` (a run's, chosen on val: `export` writes them, as a
    SavedModel's serving_default has them; CTranslate2 itself reads only its own files).

    Args:
        quantization: None (float32 weights) or a CTranslate2 quantization, e.g. "int8".
        alignment_layer: the decoder layer behind `return_attention` (`transformer_spec`).
        beam_size, alpha: written to decoding.json.

    Raises:
        FileExistsError: `directory` exists.
        StorageError: the disk is full, over quota, read-only or failing: names `directory`
            and the bytes it needed; nothing of it is left.
    """
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; choose a new directory")
    spec = transformer_spec(model, tokenizer, alignment_layer)
    spec.validate()
    spec.optimize(quantization=quantization)
    # model.bin holds the (quantized) weights; the vocabulary and config are a few KB more.
    needed = _spec_bytes(spec) + len(tokenizer.model_proto)
    staging = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = storage.staging_folder(directory.parent, f".{directory.name}.tmp-")
        spec.save(str(staging))
        storage.write_bytes(staging / "sentencepiece.model", tokenizer.model_proto)
        storage.write_json(staging / DECODING_FILE,
                           {"beam_size": int(beam_size), "alpha": float(alpha)})
        storage.replace_folder(staging, directory)
    except BaseException as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        # spec.save reports a full disk as Python's OSError (errno 28); a StorageError of
        # a file in the staging folder is re-said about `directory`.
        failure = None
        if isinstance(error, StorageError):
            failure = StorageError(error.errno, directory, needed)
        elif isinstance(error, Exception):
            failure = storage.storage_error(error, directory, needed)
        if failure is not None:
            raise failure from None
        raise
    return directory


def _spec_bytes(spec) -> int:
    """Bytes of a spec's weights as model.bin stores them (aliases are names, not arrays)."""
    return sum(value.num_bytes() for _, value in spec.variables(ordered=True)
               if not isinstance(value, str))


def translate_with_ctranslate2(translator, processor, texts: list[str], beam_size: int = 4,
                               alpha: float = 0.6, extra_length: int = 50,
                               max_batch_size: int = 32) -> list[str]:
    """Translates `texts` with a CTranslate2 `Translator` as our beam search would.

    CTranslate2 divides a hypothesis' log-probability by length^penalty; ours (Wu et al.,
    2016, as the paper) by ((5 + length) / 6)^alpha, EOS counted. So CTranslate2 returns its
    `beam_size` best hypotheses, scored almost unnormalised (a 1e-9 penalty), with twice
    the finished hypotheses before it stops (patience 2), and they are ranked here by ours.
    On 200 Multi30k test sentences this gave our beam-4 output for every one of them
    (BENCHMARKS.md); greedy (`beam_size=1`) needs no re-ranking.

    Args:
        translator: a `ctranslate2.Translator` on an `export_ctranslate2` directory.
        processor: a `sentencepiece.SentencePieceProcessor` on its `sentencepiece.model`.
        texts: source sentences.
        extra_length: the longest output is the longest input (in pieces) + this, as ours.

    Returns:
        The translations, detokenized.
    """
    pieces = [processor.encode(text, out_type=str) for text in texts]
    longest = max((len(p) for p in pieces), default=0) + 1 + extra_length
    results = translator.translate_batch(
        pieces, beam_size=beam_size, num_hypotheses=beam_size, patience=2 if beam_size > 1 else 1,
        length_penalty=1e-9 if beam_size > 1 else 0.0, return_scores=True,
        max_batch_size=max_batch_size, max_decoding_length=longest)

    def penalised(hypothesis_and_score) -> float:
        tokens, score = hypothesis_and_score
        return score / ((5.0 + len(tokens) + 1) / 6.0) ** alpha  # + 1: EOS

    return [processor.decode(max(zip(r.hypotheses, r.scores, strict=True), key=penalised)[0])
            for r in results]
