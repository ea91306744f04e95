"""The data of a training run: its corpora and its prepared training data (`pipelines.prepared`).

Library code of `run_training`: every function takes the run's `TrainConfig` and raises
`UsageError` (one line, exit status 2 in the command) for what the user must change.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keras_transformer import run_directory
from keras_transformer.cluster.workers import wait_for_all
from keras_transformer.decoding.synthetic_corpus import PROVENANCE_FILE
from keras_transformer.errors import UsageError
from keras_transformer.training import prepared_checks
from keras_transformer.training.config import DataConfig, TrainConfig, comma_separated
from keras_transformer.training.fine_tuning import InitialRun
from pipelines.carving import Carving, carve_corpus
from pipelines.corpora import (
    TFDS_PREFIX,
    CorpusError,
    available_splits,
    load_corpus,
    mixed_corpus,
    open_corpus,
    scan_corpus,
    source_languages,
)
from pipelines.prepared import (
    MANIFEST_FILE,
    PreparedCorpus,
    PreparedError,
    prepare_corpus,
)
from pipelines.tfds_corpora import resolve_split
from pipelines.tokenizer import SubwordTokenizer

# What `keras_transformer.back_translate` writes beside a synthetic corpus.
SYNTHETIC_PROVENANCE = PROVENANCE_FILE
# How long a non-chief worker waits for the chief to prepare the training data.
PREPARE_WAIT_SECONDS = 3 * 3600

if TYPE_CHECKING:
    from keras_transformer.cluster.workers import Cluster
    from pipelines.corpora import CorpusScan, CorpusSplit, ParallelCorpus
    from pipelines.prepared import PreparedCorpus


def open_training_split(data: DataConfig, carving: Carving | None = None) -> CorpusSplit:
    """The run's training split: --data's (what `carving` left of it, if given), mixed with
    --add-data and --synthetic corpora (`pipelines.corpora.mixed_corpus`) when given.

    Raises:
        CorpusError: a corpus is missing or of other languages.
        UsageError: a synthetic folder whose back-translation has not finished or was
            made for the other direction (`check_synthetic_folder`).
    """
    where = dict(data_dir=data.data_dir, manual_dir=data.manual_dir)
    real = (carving.train if carving is not None
            else open_corpus(data.data, data.train_split, data.src, data.tgt, **where))
    added = [open_corpus(folder, "train", data.src, data.tgt)
             for folder in comma_separated(data.add_data, str)]
    synthetic = []
    for folder in comma_separated(data.synthetic, str):
        check_synthetic_folder(Path(folder), data.src, data.tgt)
        synthetic.append(open_corpus(folder, "train", data.src, data.tgt))
    return mixed_corpus(real, added=added, synthetic=synthetic,
                        upsample_real=data.upsample_real, synthetic_tag=data.synthetic_tag)


def check_synthetic_folder(folder: Path, src: str, tgt: str) -> None:
    """Refuses a --synthetic folder whose back-translation (its provenance.json, when it has
    one) is unfinished or made for the other direction: its genuine side would then be
    the sources and the machine translations the targets, silently.

    Raises:
        UsageError: naming the folder, what its provenance says and what to do.
    """
    provenance = folder / SYNTHETIC_PROVENANCE
    if not provenance.is_file():
        return  # synthetic pairs made elsewhere: taken as they are
    try:
        record = run_directory.read_json(provenance)
    except (OSError, ValueError) as error:
        raise UsageError(f"--synthetic {folder}: {provenance} cannot be read ({error}); run "
                         "the back_translate command that made the folder again") from None
    made_for = (record.get("src_lang"), record.get("tgt_lang"))
    if None not in made_for and made_for != (src, tgt):
        raise UsageError(
            f"--synthetic {folder} was back-translated for a {made_for[0]}→{made_for[1]} model "
            f"({provenance}), not this run's {src}→{tgt}: its train.{made_for[1]} is the "
            f"genuine side; give the folder made with --src {src} --tgt {tgt}")
    if not record.get("complete"):
        done, total = record.get("lines_done"), (record.get("input") or {}).get("lines")
        lines = f", {done:,} of {total:,} lines" if None not in (done, total) else ""
        last_session = (record.get("sessions") or [{}])[-1]
        how = ("run the same back_translate command again to finish it"
               if last_session.get("max_lines") is None else
               "it stopped at its --max-lines: run the back_translate command again without "
               "--max-lines to finish it")
        raise UsageError(f"--synthetic {folder}: its back-translation has not finished "
                         f"({provenance}: complete is false{lines}); "
                         f"{how}")


def carve_missing_splits(data: DataConfig, seed: int) -> Carving | None:
    """--data's train split with its val and/or test pairs carved out (`pipelines.carving`)
    when the folder lacks them, and its noise dropped with --clean-train; None when neither
    applies (the corpus is used as it is, its identity unchanged).

    Carved: the val split when --val-split is val (or validation) and the folder has none;
    the test split when --test-split is test or none and the folder has none (carved even
    for none, so that the training pairs do not depend on whether a run scores a test set,
    and `prepare` and `train` agree). Only a local folder of one source language is carved,
    with --carve-pairs above 0; elsewhere a missing split is the error it always was.

    Raises:
        UsageError: the train split is invalid or too small to carve from.
    """
    local = not data.data.startswith(TFDS_PREFIX) and "," not in data.src
    missing = []
    if local and data.carve_pairs > 0:
        try:
            splits = available_splits(data.data)
            resolve_split(data.train_split, splits, data.data)
        except CorpusError:  # no folder or no train split: reported as before
            return None
        wanted = [("val", data.val_split.lower() in ("val", "validation")),
                  ("test", data.test_split.lower() in ("test", "none"))]
        for name, carvable in wanted:
            try:
                resolve_split(name, splits, data.data)
            except CorpusError:
                if carvable:
                    missing.append(name)
    if not missing and not data.clean_train:
        return None
    try:
        split = open_corpus(data.data, data.train_split, data.src, data.tgt,
                            data_dir=data.data_dir, manual_dir=data.manual_dir)
        return carve_corpus(split, missing, carve_pairs=data.carve_pairs, seed=seed,
                            clean=data.clean_train)
    except CorpusError as error:
        raise UsageError(f"train data: {error}") from None


def open_tokenizer_data(data: DataConfig) -> list[CorpusSplit]:
    """The train splits of --tokenizer-data (text for the vocabulary only).

    Raises:
        CorpusError: a corpus is missing or of other languages.
    """
    return [open_corpus(folder, "train", data.src, data.tgt)
            for folder in comma_separated(data.tokenizer_data, str)]


def load_corpora(config: TrainConfig) -> dict[str, Any]:
    """The train split (opened, not read) and the val(/test) `ParallelCorpus` objects; with
    several source languages, also "test:<language>" for each one after the first.

    A folder without val/test has them carved out of train, and --clean-train drops the
    training noise (`carve_missing_splits`): then "data_report" holds the counts.

    `CorpusError` becomes `UsageError`, except for a train split that is absent where the
    data were prepared elsewhere (--prepared): its `UsageError` is kept as "train_error",
    raised only if the data must be prepared.
    """
    data = config.data
    where = dict(data_dir=data.data_dir, manual_dir=data.manual_dir)
    corpora: dict[str, Any] = {"train": None}
    carving = carve_missing_splits(data, config.optimization.seed)
    if carving is not None:
        corpora["data_report"] = carving.report
    try:
        corpora["train"] = open_training_split(data, carving)
    except CorpusError as error:
        if not data.prepared:
            raise UsageError(f"train data: {error}") from None
        corpora["train_error"] = UsageError(f"train data: {error}")
    # Several source languages (--src de,fr,cs): the first one is validated on and gives
    # the headline test score; every one is scored on test ("test_by_source").
    first, *others = source_languages(data.src)
    roles = [("val", data.val_split, first)]
    if data.test_split.lower() != "none":
        roles += [("test", data.test_split, first)] + [
            (f"test:{language}", data.test_split, language) for language in others]
    for role, split, language in roles:
        if carving is not None and role in carving.held_out:
            corpora[role] = carving.held_out[role]
            continue
        try:
            corpora[role] = load_corpus(data.data, split, language, data.tgt, **where)
        except CorpusError as error:
            raise UsageError(f"{role.split(':')[0]} data: {error}") from None
    return corpora


def prepared_dir(config: TrainConfig) -> Path:
    """Where the prepared training data live: --prepared, else <run>/prepared."""
    if config.data.prepared:
        return Path(config.data.prepared)
    return Path(config.output.out) / run_directory.PREPARED_DIR


def check_prepared(config: TrainConfig, prepared, initial: InitialRun | None = None) -> None:
    """`prepared_checks.check_prepared`, with the origins of --tokenizer-data's corpora.

    Raises:
        UsageError: naming each difference.
    """
    origins = ([split.origin for split in open_tokenizer_data(config.data)]
               if config.data.tokenizer_data else None)
    prepared_checks.check_prepared(config, prepared, initial, origins)


def find_prepared(config: TrainConfig, corpora: dict[str, Any], will_overwrite: bool,
                  initial: InitialRun | None = None) -> PreparedCorpus | None:
    """The complete, matching, undamaged prepared data of this run, or None if they must be
    made. Every shard file's checksum is verified (`PreparedCorpus.verify`).

    Raises:
        UsageError: prepared data made with other settings, from files changed since, or
            damaged; or none and no train split to prepare them from.
    """
    directory = prepared_dir(config)
    inside_run = not config.data.prepared
    if inside_run and will_overwrite:
        return None  # deleted with the run directory
    if not (directory / MANIFEST_FILE).is_file():
        if directory.exists() and any(directory.iterdir()):
            raise UsageError(f"--prepared {directory} exists but holds no prepared corpus "
                             f"({MANIFEST_FILE} is missing); delete it or choose another")
        if "train_error" in corpora:
            raise corpora["train_error"]
        return None
    try:
        prepared = PreparedCorpus.load(directory)
        if corpora["train"] is not None:
            prepared.check_source(corpora["train"])
    except PreparedError as error:
        raise UsageError(str(error)) from None
    check_prepared(config, prepared, initial)
    try:
        prepared.verify()  # after the cheap checks: it reads every byte
    except PreparedError as error:
        raise UsageError(str(error)) from None
    return prepared


def scan_training_text(config: TrainConfig, train_split: CorpusSplit,
                       report: Callable[[str], None]) -> CorpusScan:
    """The one validating pass over the training text (`pipelines.corpora.scan_corpus`)."""
    report(f"validating and sampling the training split of {config.data.data} ...")
    try:
        return scan_corpus(train_split, sample_pairs=config.data.tokenizer_sample,
                           seed=config.optimization.seed)
    except CorpusError as error:
        raise UsageError(f"train data: {error}") from None


def training_data(config: TrainConfig, train_split: CorpusSplit | None,
                  prepared: PreparedCorpus | None, scan: CorpusScan | None, cluster: Cluster,
                  report: Callable[[str], None],
                  validation: ParallelCorpus | None = None,
                  initial: InitialRun | None = None) -> PreparedCorpus:
    """The run's `PreparedCorpus`: found earlier, prepared now by the chief (from `scan`,
    with the token ids of `validation`, the run's val split, if given:
    `pipelines.numpy_batches.validation_batches` reads them), or, on other workers, read
    once the chief has it.

    In a multi-worker run every worker waits at one barrier until the chief has the data
    (up to PREPARE_WAIT_SECONDS); a worker lost meanwhile fails it at once. Data read here
    (the chief's, on other workers) are verified (`PreparedCorpus.verify`) as
    `find_prepared` verifies those found; data just prepared by this process are not: their
    checksums were computed from the bytes it wrote, which the page cache would return.

    Raises:
        UsageError: the tokenizer cannot be trained, the chief's data are not visible on
            this worker or are damaged, or there are fewer shards than workers.
        ClusterFailure: a worker was lost, or the chief took longer than the wait.
    """
    directory = prepared_dir(config)
    if prepared is None and cluster.is_chief:
        report(f"preparing {scan.pairs:,} training pairs into {directory} (once) ...")
        try:
            data = config.data
            prepared = prepare_corpus(
                train_split, directory, vocab_size=data.vocab_size, max_length=data.max_length,
                tokenizer_sample=data.tokenizer_sample, shard_pairs=data.shard_pairs,
                min_shards=cluster.num_workers, seed=config.optimization.seed, scan=scan,
                subword_samples=data.subword_samples, subword_alpha=data.subword_alpha,
                validation=validation, validation_split=data.val_split,
                tokenizer=(None if initial is None
                           else SubwordTokenizer.load(initial.tokenizer_dir)),
                tokenizer_data=open_tokenizer_data(data))
        except (ValueError, PreparedError) as error:  # e.g. a vocabulary too large
            raise UsageError(f"preparing {directory}: {error}") from None
    if cluster.is_multi_worker:
        if prepared is None:
            report(f"waiting for the chief to prepare {directory} ...")
        wait_for_all("prepared data", PREPARE_WAIT_SECONDS, cluster)
    if prepared is None:
        try:
            prepared = PreparedCorpus.load(directory)
        except PreparedError as error:
            raise UsageError(f"{error}; the chief prepared it: is {directory} the same shared "
                             "path on every machine (or a copy of it)?") from None
        check_prepared(config, prepared, initial)
        try:
            prepared.verify()
        except PreparedError as error:
            raise UsageError(str(error)) from None
    if prepared.num_shards < cluster.num_workers:
        raise UsageError(f"{directory} has {prepared.num_shards} shard(s) for "
                         f"{cluster.num_workers} workers (each reads its own); prepare it with "
                         f"--shards {cluster.num_workers} or more")
    return prepared


def copy_tokenizer(prepared: PreparedCorpus, home: Path) -> None:
    """Puts the prepared tokenizer into the run directory (for translate/export), once.

    Raises:
        UsageError: the run directory already holds a different tokenizer.
    """
    tokenizer = prepared.tokenizer()
    run_tokenizer = home / run_directory.TOKENIZER_DIR
    if (run_tokenizer / "spm.model").is_file():
        if SubwordTokenizer.load(run_tokenizer).model_proto != tokenizer.model_proto:
            raise UsageError(f"{run_tokenizer} differs from {prepared.directory / 'tokenizer'}: "
                             "this run was trained with another vocabulary; use its original "
                             "--prepared")
    else:
        tokenizer.save(run_tokenizer)


