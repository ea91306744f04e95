"""`DataConfig`: the corpus and its one-time preparation (5.1: a shared subword vocabulary and
token shards); `PREPARE_FIELDS`, the part `python -m keras_transformer.prepare` takes."""

from __future__ import annotations

import dataclasses

from keras_transformer.errors import UsageError
from keras_transformer.training.config.fields import fraction, non_negative, positive, setting
from pipelines import DEFAULT_CARVE_PAIRS, DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE
from pipelines.pair_selection import MAX_LENGTH_RATIO, RATIO_MIN_CHARS


@dataclasses.dataclass
class DataConfig:
    """The corpus and its one-time preparation (shared vocabulary and token shards, 5.1)."""

    data: str = setting(help="folder of {split}.{lang}[.gz] files, or tfds:NAME[/CONFIG]")
    src: str = setting(help="source language code, e.g. de; several, comma-separated (de,fr,cs), "
                        "train one many-to-one model on all of them with the same target "
                        "(the first is validated on and gives the headline test score)")
    tgt: str = setting(help="target language code, e.g. en")
    data_dir: str | None = setting(None, "tensorflow-datasets data_dir (tfds: data only)")
    manual_dir: str | None = setting(
        None, "tfds: data only: a folder of manually downloaded files, built without the "
        "network (e.g. Multi30k's {split}.{lang}.gz release files for --data tfds:multi30k)")
    train_split: str = setting("train", "the training split")
    vocab_size: int = setting(8000, "shared source/target subword vocabulary size (paper: "
                               "~37000)", positive)
    max_length: int = setting(128, "longest pair kept, in subwords + EOS; longer pairs are "
                               "dropped from training", positive)
    tokenizer_sample: int = setting(DEFAULT_TOKENIZER_SAMPLE, "pairs sampled (seeded) from "
                                     "the training split to train SentencePiece on", positive)
    shard_pairs: int = setting(DEFAULT_SHARD_PAIRS, "pairs per prepared shard", positive)
    subword_samples: int = setting(
        0, "subword regularization (Kudo 2018; BPE-dropout, Provilkov et al. 2020): prepare "
        "this many copies of the training split, each pair tokenized with a different seeded "
        "sampled segmentation in each copy, and train on them in turn (0: the one "
        "deterministic segmentation, the paper's). Val, test and translation always use the "
        "deterministic one", non_negative)
    subword_alpha: float = setting(
        0.1, "with --subword-samples: for a BPE vocabulary the probability of dropping each "
        "merge (BPE-dropout; 0.1 in its paper), for a unigram one the smoothing of the "
        "sampling distribution (SentencePiece's alpha)", fraction)
    add_data: str = setting(
        "", "more real parallel corpora trained on with --data's train split: folders of "
        "train.{src}/train.{tgt}[.gz], comma-separated (e.g. some of the old domain's pairs "
        "when fine-tuning with --init-from, against forgetting)")
    synthetic: str = setting(
        "", "synthetic parallel corpora trained on with the real pairs: folders made by `python "
        "-m keras_transformer.back_translate` (back-translation, Sennrich et al. 2016), "
        "comma-separated")
    synthetic_tag: str = setting(
        "<BT>", "token put before each synthetic source (tagged back-translation, Caswell et "
        "al. 2019), one piece of the vocabulary; '' for none")
    tokenizer_data: str = setting(
        "", "more parallel corpora (folders; their train split) whose text trains the shared "
        "vocabulary too, not the model: one tokenizer for both domains from the start, when a "
        "model trained now will be fine-tuned on the other domain later (--init-from)")
    upsample_real: int = setting(
        1, "repeat --data's training pairs this many times in the mix with --synthetic and "
        "--add-data (fairseq's --upsample-primary): sets the real:synthetic ratio", positive)
    prepared: str | None = setting(
        None, "prepared training data (tokenizer and token shards, from `python -m "
        "keras_transformer.prepare`, reusable by several runs); prepared there by the first "
        "run if absent. Default: RUN/prepared. Workers of a multi-machine run read it from "
        "this path (shared), waiting for the chief to prepare it")
    val_split: str = setting("val", "split for validation loss, best checkpoint and early "
                              "stopping")
    carve_pairs: int = setting(
        DEFAULT_CARVE_PAIRS, "when a --data folder has no val (or test) split: carve this many pairs "
        "for each out of train (at most 5%% of a small corpus, at least 100 where it can), "
        "chosen by a seeded hash of each pair's text, so every copy of a carved pair leaves "
        "train; 0: refuse a folder without them", non_negative)
    clean_train: bool = setting(
        False, "drop training pairs empty on one side, length-mismatched (one side over "
        f"{MAX_LENGTH_RATIO:g} times the characters of the other, past {RATIO_MIN_CHARS} "
        "characters) or exact duplicates of an earlier pair; counted in the log and "
        "results.json")
    test_split: str = setting("test", "split scored with BLEU at the end; 'none' to skip")
    test_limit: int = setting(0, "score only the first N test pairs (0 = all)", non_negative)

    def check(self) -> None:
        """The checks shared by `train` and `prepare`: languages, vocabulary, length.

        Raises:
            UsageError: with a message saying what to change.
        """
        languages = [language.strip() for language in self.src.split(",")]
        if self.src == self.tgt:
            raise UsageError(f"--src and --tgt are both {self.src!r}")
        if self.tgt in languages:
            raise UsageError(f"--src {self.src} includes the target language {self.tgt!r}")
        if "" in languages or len(set(languages)) < len(languages):
            raise UsageError(f"--src {self.src!r}: give each source language once, "
                             "comma-separated, e.g. de,fr,cs")
        if self.vocab_size < 300:
            raise UsageError("--vocab-size must be >= 300 (4 special ids + 256 byte pieces + "
                             "words)")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be >= 2 (a subword and EOS), got "
                             f"{self.max_length}")


# The part of `DataConfig` that `python -m keras_transformer.prepare` takes.
PREPARE_FIELDS = ("data", "src", "tgt", "data_dir", "manual_dir", "train_split", "vocab_size",
                  "max_length", "tokenizer_sample", "shard_pairs", "subword_samples",
                  "subword_alpha", "add_data", "synthetic", "synthetic_tag", "upsample_real",
                  "tokenizer_data", "carve_pairs", "clean_train")
