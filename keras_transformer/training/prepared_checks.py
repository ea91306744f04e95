"""What a run checks of a prepared folder before training from it, with numpy alone: shared by
a run under TensorFlow (`run_data.find_prepared`) and a JAX run where TensorFlow is not
installed (`run_jax`), so that both refuse the same mismatches.

A folder prepared with another vocabulary size would give ids the model's embedding does not
have; one of other languages, tokenizer sample or subword sampling is another corpus; with
`--init-from`, a folder tokenized with another vocabulary than the old run's scrambles every
id the model learned.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from keras_transformer.errors import UsageError
from keras_transformer.training.fine_tuning import InitialRun, check_prepared_tokenizer
from pipelines.prepared_folder import PreparedError, sampling_settings

_LOG = logging.getLogger("keras_transformer")

if TYPE_CHECKING:
    from keras_transformer.training.config import TrainConfig
    from pipelines.prepared_folder import PreparedFolder


def check_prepared(config: TrainConfig, prepared: PreparedFolder,
                   initial: InitialRun | None = None,
                   tokenizer_data: list[str] | None = None) -> None:
    """Refuses prepared data made with settings other than this run's.

    Languages, vocabulary size, tokenizer sample and subword sampling must be equal (and
    `tokenizer_data`, the origins of --tokenizer-data's corpora, when given: opening them
    needs TensorFlow); the run's --max-length may be lower than the prepared one (longer
    pairs are then left out when batching); with --init-from (`initial`), the folder's
    tokenizer must be the old run's.

    Raises:
        UsageError: naming each difference.
    """
    data = config.data
    try:
        prepared.check_settings({"src_lang": data.src, "tgt_lang": data.tgt,
                                 "vocab_size": data.vocab_size,
                                 "tokenizer_sample": data.tokenizer_sample,
                                 **({"tokenizer_data": tokenizer_data} if tokenizer_data
                                    else {}),
                                 **sampling_settings(data.subword_samples, data.subword_alpha)})
    except PreparedError as error:
        raise UsageError(str(error)) from None
    if initial is not None:
        check_prepared_tokenizer(initial, prepared)
    longest = prepared.settings["max_length"]
    if data.max_length > longest:
        raise UsageError(f"--max-length {data.max_length} is above the {longest} that "
                         f"{prepared.directory} was prepared with; lower it, or prepare again")
    if data.max_length < longest:  # the batches leave the longer pairs out: say how many
        histograms = [shard["histogram"] for shard in prepared.manifest["shards"]]
        total = sum(sum(histogram) for histogram in histograms)
        longer = sum(sum(histogram[data.max_length + 1:]) for histogram in histograms)
        if longer:
            _LOG.info(f"{longer:,} of the {total:,} prepared pairs ({100 * longer / total:.2f}%) "
                      f"are longer than --max-length {data.max_length} positions (prepared "
                      f"with {longest}): left out of the batches")
