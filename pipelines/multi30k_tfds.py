"""A tensorflow-datasets builder for Multi30k task 1 (raw), all four languages.

Importing this module registers the builder under the name ``multi30k``, so
``tfds.builder("multi30k")`` and the ``"tfds:multi30k"`` source of
:func:`pipelines.corpora.load_corpus` work. Examples are dicts keyed by language code
(``{"cs": ..., "de": ..., "en": ..., "fr": ...}``, tf.string scalars).

The release files ``{split}.{lang}.gz`` are downloaded from the official GitHub
repository, unless a manual folder holding them (plain or gzipped) is given::

    builder = tfds.builder("multi30k", data_dir=tmp)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir="/data/multi30k"))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import tensorflow_datasets as tfds

from pipelines.textfiles import CorpusError, find_parallel_files, iter_aligned, iter_text_lines

LANGUAGES = ("cs", "de", "en", "fr")
# tfds split name -> release file split name
RELEASE_SPLITS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
URL_TEMPLATE = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{split}.{lang}.gz"

_CITATION = """@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30K: Multilingual English-German Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016},
  pages = {70--74}
}"""


class Multi30k(tfds.core.GeneratorBasedBuilder):
    """Multi30k task 1: 31k image descriptions aligned across cs, de, en and fr."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Task 1 raw release: train, val, test_2016_flickr."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Optional: put the Multi30k task-1 raw files {train,val,test_2016_flickr}.{cs,de,en,fr}"
        "[.gz] in the manual folder to build without network access; otherwise they are "
        "downloaded from github.com/multi30k/dataset."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="Multi30k task 1 (raw): multilingual Flickr30k image descriptions.",
            features=tfds.features.Translation(languages=LANGUAGES),
            homepage="https://github.com/multi30k/dataset",
            citation=_CITATION,
            # Keep the release order, so outputs line up with reference files (e.g. for BLEU).
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        try:
            manual = Path(dl_manager.manual_dir)
        except AssertionError:  # tfds signals "no (or an empty) manual folder" this way
            manual = None
        if manual is not None:
            files = _manual_files(manual)
        else:
            urls = {
                f"{split}.{lang}": URL_TEMPLATE.format(split=split, lang=lang)
                for split in RELEASE_SPLITS.values()
                for lang in LANGUAGES
            }
            downloaded = dl_manager.download(urls)
            files = {
                split: {lang: Path(downloaded[f"{split}.{lang}"]) for lang in LANGUAGES}
                for split in RELEASE_SPLITS.values()
            }
        return {
            name: self._generate_examples(files[release])
            for name, release in RELEASE_SPLITS.items()
        }

    def _generate_examples(self, paths: Mapping[str, Path]) -> Iterator[tuple[int, dict]]:
        rows = iter_aligned({lang: iter_text_lines(paths[lang]) for lang in LANGUAGES},
                            {lang: str(paths[lang]) for lang in LANGUAGES})
        for index, row in enumerate(rows):
            yield index, dict(zip(LANGUAGES, row, strict=True))


def _manual_files(folder: Path) -> dict[str, dict[str, Path]]:
    index = find_parallel_files(folder)
    for split in RELEASE_SPLITS.values():
        found = index.get(split, {})
        missing = [lang for lang in LANGUAGES if lang not in found]
        if missing:
            names = ", ".join(f"{split}.{lang}[.gz]" for lang in missing)
            raise CorpusError(
                f"{folder}: Multi30k manual folder lacks {names}; put all of "
                f"{{train,val,test_2016_flickr}}.{{{','.join(LANGUAGES)}}}[.gz] there"
            )
    return {split: index[split] for split in RELEASE_SPLITS.values()}
