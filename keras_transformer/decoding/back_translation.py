"""Back-translation (Sennrich et al. 2016): synthetic parallel data from monolingual target text.

To train a forward model src→tgt with more data than the parallel corpus holds, a *reverse*
model (tgt→src, trained on the same parallel data) translates monolingual text of the
*target* language into the source language; each (synthetic source, real target) pair then
trains the forward model beside the real pairs. The target side, which the forward model
learns to produce, is always genuine text; only its input is machine-made.

    back_translate("runs/multi30k-en-de", "mono.en.gz", "bt/mono-en",
                   src_lang="de", tgt_lang="en")        # a de→en model's extra data

`src_lang` and `tgt_lang` are always those of the FORWARD model to be trained: the
monolingual file is in `tgt_lang`, the reverse model translates tgt_lang→src_lang. The
output folder is a parallel corpus that `pipelines.corpora.open_corpus(out_dir, "train",
src_lang, tgt_lang)` reads: `train.{src_lang}` (the synthetic translations) and
`train.{tgt_lang}` (the monolingual lines), aligned line by line, plus `provenance.json`
(what made it: model fingerprint, input hash, every option, counts, speed, code version,
`complete`) and `progress.json` (where an interrupted run resumes).

References, and how to decode:
- Sennrich, Haddow & Birch 2016, "Improving Neural Machine Translation Models with
  Monolingual Data" (ACL), section 3.2 "Synthetic Source Sentences": the reverse model's
  translations of target-language text, mixed with the real pairs.
- Edunov, Ott, Auli & Grangier 2018, "Understanding Back-Translation at Scale" (EMNLP),
  section 5: sampling (unrestricted, or top-k 10) or noised beam outputs give the forward
  model a richer signal and beat beam/greedy back-translation with large monolingual data;
  with little parallel data (their 80k-pair setting, i.e. below ~100k pairs) beam and greedy
  are better, since the weak reverse model's samples are too noisy. Multi30k (29k pairs) is
  in that regime: the default here is greedy search (`beam_size=1`).
- Caswell, Chelba & Grangier 2019, "Tagged Back-Translation" (WMT): a tag on each synthetic
  source tells the forward model which pairs are synthetic; it works as well as noising or
  sampling. Tags and the mixing of real and synthetic pairs belong to training: this module
  only writes the synthetic pairs, untagged.

Lines are read with `pipelines.textfiles.iter_text_lines` (UTF-8, plain or gzip, each line
stripped) and translated with `decoding.translator.translate_batch`, `chunk_lines` lines at a
time (which sorts each chunk by length into batches and returns it in order); after each
chunk both files are appended, flushed and fsynced, then `progress.json` is replaced
atomically. Running the same call again resumes: the options must match those recorded, the
files are cut back to the sizes `progress.json` recorded (a kill between the append and the
record leaves extra bytes), and decoding goes on from the recorded line. Each line's output
depends only on the model, the options, the line and (sampling) the seed with the line's
number in the file, so an interrupted and resumed run writes the same bytes as one
uninterrupted run. A folder already complete is left alone. The folder's files and these
checks are `decoding.synthetic_corpus`'s.

Empty monolingual lines are skipped and lines whose translation is empty dropped, both
counted; no empty pair is ever written. `cleanup` handles monolingual text written unlike
the parallel targets (16% of Multi30k task 2's German captions start in lower case and 21%
end without punctuation, unlike task 1's German): "filter" drops such lines, "normalize"
upper-cases the first letter and adds a final "." (before translating; the written target
line is the normalized one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.decoding.batch_decoder import DecodingOptions
from keras_transformer.decoding.long_inputs import LONG_INPUT_MODES, InputTooLong
from keras_transformer.decoding.sampling import Sampling
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.decoding.synthetic_corpus import (
    FORMAT,
    PROGRESS_FILE,
    BackTranslationError,
    LineCounts,
    append_pairs,
    check_folder,
    code_version,
    cut_back,
    file_sha256,
    input_record,
    open_folder,
    read_provenance,
    utc_now,
    write_provenance,
    writing,
)
from keras_transformer.decoding.translator import DEFAULT_BATCH_TOKENS, translate_batch
from keras_transformer.errors import UsageError
from pipelines import storage
from pipelines.textfiles import CorpusError, iter_text_lines

__all__ = ["CLEANUPS", "BackTranslationError", "back_translate", "clean_monolingual_line"]

CLEANUPS = ("none", "filter", "normalize")
DEFAULT_CHUNK_LINES = 2000
# Greedy decoding of short lines ran faster in larger batches than translate's 64 (111-174
# against 85-91 lines/s, docs/back_translation.md); batch_tokens still bounds the memory.
DEFAULT_BATCH_SIZE = 256
# What a sentence may end with: . ! ? … and closing quotes or brackets.
FINAL_PUNCTUATION = frozenset('.!?…"\')”“»«’')
# The language codes `pipelines.textfiles.find_parallel_files` recognizes in file names.
_LANGUAGE = re.compile(r"^[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?$")

Progress = Callable[[int, int], None]


def clean_monolingual_line(line: str, cleanup: str) -> tuple[str | None, list[str]]:
    """`line` after `cleanup`, and what was wrong with it.

    Returns:
        (the line, or None when "filter" drops it; the problems found among
        "lowercase_start" (its first letter or digit is a lower-case letter) and
        "no_final_punctuation" (it does not end with . ! ? … or a closing quote/bracket)).
        "none" returns the line unchanged, its problems counted all the same (what the
        provenance's counts show before a cleanup is chosen).
    """
    if cleanup not in CLEANUPS:
        raise ValueError(f"cleanup must be one of {', '.join(CLEANUPS)}, got {cleanup!r}.")
    if not line:
        return line, []
    problems = []
    first = next((index for index, char in enumerate(line) if char.isalnum()), None)
    if first is not None and line[first].islower():
        problems.append("lowercase_start")
    if line[-1] not in FINAL_PUNCTUATION:
        problems.append("no_final_punctuation")
    if cleanup == "none":
        return line, problems
    if cleanup == "filter":
        return (None if problems else line), problems
    if "lowercase_start" in problems:
        line = line[:first] + line[first].upper() + line[first + 1:]
    if "no_final_punctuation" in problems:
        line += "."
    return line, problems


def back_translate(
    model,
    input_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    src_lang: str,
    tgt_lang: str,
    tokenizer=None,
    beam_size: int = 1,
    alpha: float = DEFAULT_ALPHA,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: int = 0,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    max_output_tokens: int | None = None,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    long_inputs: str = "split",
    cleanup: str = "none",
    max_lines: int | None = None,
    chunk_lines: int = DEFAULT_CHUNK_LINES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Back-translates a monolingual `tgt_lang` file into a synthetic `src_lang`→`tgt_lang`
    parallel corpus in `out_dir`, resumably (see the module docstring).

    Args:
        model: the REVERSE model (tgt_lang→src_lang): a run directory of
            `python -m keras_transformer.train` (loaded; its config.json's languages are
            checked, its model.keras file hashed into the record), or a loaded Keras
            `Transformer` with `tokenizer`. Either is fingerprinted by the sha256 of its
            weights and of its tokenizer, which a resume must match.
        input_path: monolingual text in `tgt_lang`, one sentence per line, UTF-8, plain or
            gzip.
        out_dir: the output folder (created; an existing one must be a back-translation
            folder made with the same options, which is resumed).
        src_lang: the source language of the FORWARD model to be trained (the reverse
            model's output language): the synthetic side, `train.{src_lang}`.
        tgt_lang: the target language of the forward model, the language of `input_path`
            (the reverse model's input): the genuine side, `train.{tgt_lang}`.
        tokenizer: the model's `SubwordTokenizer` (only with a loaded model).
        beam_size, alpha, sampling_topk, sampling_topp, sampling_temperature, seed,
        max_input_tokens, max_output_tokens, extra_length, long_inputs: decoding, as
            `translate_batch` takes them (default greedy search). Sampling seeds use each
            line's 0-based number in the input file, so a resumed run draws the same samples.
        cleanup: "none", "filter" or "normalize" the monolingual lines before translating
            (`clean_monolingual_line`).
        max_lines: stop after the first `max_lines` lines of the input (None: all); running
            again with a larger value (or None) continues the same folder.
        chunk_lines: lines translated and written between two progress records.
        batch_size, batch_tokens: `translate_batch`'s batch bounds (default 256 lines, and
            65,536 tokens); they do not change the output, so they may differ when resuming,
            and so may `chunk_lines` and `max_lines`.
        progress: called with (lines done, lines to do) after each decoded batch and after
            each written chunk; an exception it raises stops the run (what was written stays
            and is resumed).

    Returns:
        The provenance record (what `provenance.json` holds), with "session": what this
        call did ("started", "resumed" or "already complete", and the lines it translated).

    Raises:
        BackTranslationError: a model, input or folder that cannot be used, options other
            than the folder was made with (naming them), a damaged folder.
        ValueError: invalid options.
        StorageError: the disk is full or failing (what was written stays; run it again).
    """
    started = utc_now()
    options = _check_options(
        src_lang=src_lang, tgt_lang=tgt_lang, beam_size=beam_size, alpha=alpha,
        sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature, seed=seed,
        max_input_tokens=max_input_tokens, max_output_tokens=max_output_tokens,
        extra_length=extra_length, long_inputs=long_inputs, cleanup=cleanup)
    if chunk_lines < 1 or batch_size < 1 or batch_tokens < 1:
        raise ValueError("chunk_lines, batch_size and batch_tokens must be >= 1.")
    if max_lines is not None and max_lines < 0:
        raise ValueError(f"max_lines must be >= 0, got {max_lines}.")
    out = Path(out_dir)
    monolingual = input_record(Path(input_path))
    fixed = {"format": FORMAT, "src_lang": src_lang, "tgt_lang": tgt_lang,
             "direction": {
                 "forward_model": f"{src_lang}→{tgt_lang}",
                 "reverse_model": f"{tgt_lang}→{src_lang}",
                 f"train.{src_lang}": "synthetic: the reverse model's translations",
                 f"train.{tgt_lang}": "genuine: the monolingual lines (after cleanup)"},
             "model": None, "input": monolingual, "decoding": options,
             "seed": options["seed"], "cleanup": cleanup}
    check_folder(out, fixed)  # before loading the model: other options fail at once
    model, tokenizer, fixed["model"] = _reverse_model(model, tokenizer, src_lang, tgt_lang)
    with writing(out):  # read after the lock: another process may be writing it
        state = open_folder(out, fixed, started)
        files = {side: out / f"train.{lang}"
                 for side, lang in (("src", src_lang), ("tgt", tgt_lang))}
        cut_back(files, state["bytes"], out)
        counts = LineCounts(**state["counts"])
        total = monolingual["lines"] if max_lines is None else min(max_lines, monolingual["lines"])
        session = {"started": started, "from_line": state["lines_done"],
                   "code_version": code_version(), "chunk_lines": chunk_lines,
                   "batch_size": batch_size, "batch_tokens": batch_tokens, "max_lines": max_lines}
        if state["lines_done"] >= monolingual["lines"]:
            session["action"] = "already complete"
        elif state["lines_done"] >= total:
            session["action"] = f"nothing to do: {state['lines_done']} lines done (max_lines)"
        else:
            session["action"] = "resumed" if state["lines_done"] else "started"
        if session["action"] not in ("started", "resumed"):
            record = read_provenance(out)
            if state["sessions"] and record.get("lines_done") != state["lines_done"]:
                # progress.json is written before provenance.json: a stop (or a full disk)
                # between the two leaves the provenance one chunk behind; bring it up.
                record = write_provenance(out, state, fixed, counts)
            return {**record, "session": {**session, "lines_translated": 0}}
        state["sessions"].append(session)
        decode = {**options, "batch_size": batch_size, "batch_tokens": batch_tokens}
        _translate_lines(model, tokenizer, out, files, state, fixed, counts, decode, total,
                         chunk_lines, progress)
        record = write_provenance(out, state, fixed, counts)
        return {**record, "session": {**session, "lines_translated": (
            state["lines_done"] - session["from_line"])}}


def _translate_lines(model, tokenizer, out: Path, files: dict[str, Path], state: dict,
                     fixed: dict, counts: LineCounts, decode: dict, total: int,
                     chunk_lines: int, progress: Progress | None) -> None:
    """Translates the input from line `state["lines_done"]` to `total`, chunk by chunk: each
    chunk appended to `files` (fsynced), then recorded in progress.json (atomically)."""
    session = state["sessions"][-1]
    lines = iter_text_lines(fixed["input"]["path"])
    try:
        for _ in itertools.islice(lines, state["lines_done"]):
            pass
        while state["lines_done"] < total:
            first = state["lines_done"]
            chunk = list(itertools.islice(lines, min(chunk_lines, total - first)))
            if not chunk:  # the file shrank since it was hashed
                raise BackTranslationError(f"{fixed['input']['path']} ended at line {first}: "
                                           "it was changed while being read.")
            pairs = _translate_chunk(model, tokenizer, chunk, first, fixed["cleanup"], decode,
                                     counts, progress, total)
            append_pairs(files, pairs, state["bytes"])
            state["lines_done"] = first + len(chunk)
            session.update(to_line=state["lines_done"], finished=utc_now())
            state["counts"] = dataclasses.asdict(counts)
            storage.write_json(out / PROGRESS_FILE, state)
            write_provenance(out, state, fixed, counts)
            if progress is not None:
                progress(state["lines_done"], total)
    except CorpusError as error:  # the file was read whole at the start: it changed since
        raise BackTranslationError(str(error)) from None
    finally:
        lines.close()


def _check_options(*, src_lang, tgt_lang, cleanup, long_inputs, **decoding) -> dict:
    """The decoding options, checked: with the languages and `cleanup`, what fixes the
    output (recorded; a resume must match them). `translate_batch`'s keyword arguments."""
    for name, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if not isinstance(lang, str) or not _LANGUAGE.match(lang):
            raise ValueError(f"{name} must be a language code such as de or pt_br, got "
                             f"{lang!r}.")
    if src_lang == tgt_lang:
        raise ValueError(f"src_lang and tgt_lang are both {src_lang!r}.")
    if cleanup not in CLEANUPS:
        raise ValueError(f"cleanup must be one of {', '.join(CLEANUPS)}, got {cleanup!r}.")
    if long_inputs not in LONG_INPUT_MODES:
        raise ValueError(f"long_inputs must be one of {', '.join(LONG_INPUT_MODES)}, got "
                         f"{long_inputs!r}.")
    if not 0 <= decoding["seed"] < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {decoding['seed']}.")
    if decoding["max_input_tokens"] < 2:
        raise ValueError(f"max_input_tokens must be >= 2, got {decoding['max_input_tokens']}.")
    sampling = None
    if decoding["sampling_topk"] == 1:  # search, as translate_batch: the seed changes nothing
        if decoding["sampling_topp"] != 1.0 or decoding["sampling_temperature"] != 1.0:
            raise ValueError("sampling_topp and sampling_temperature apply to sampling: set "
                             "sampling_topk to 0 (the whole vocabulary) or to k > 1.")
        decoding["seed"] = 0
    else:
        sampling = Sampling(top_k=decoding["sampling_topk"], top_p=decoding["sampling_topp"],
                            temperature=decoding["sampling_temperature"],
                            seed=decoding["seed"])
    # translate_batch's own checks (a beam with sampling, ranges) before any work is done.
    DecodingOptions(beam_size=decoding["beam_size"], alpha=decoding["alpha"],
                    sampling=sampling, max_output_tokens=decoding["max_output_tokens"],
                    extra_length=decoding["extra_length"])
    return {**decoding, "long_inputs": long_inputs}


def _reverse_model(model, tokenizer, src_lang: str, tgt_lang: str):
    """(Keras model, tokenizer, record): the record names the run directory and its files,
    what its config.json says it translates, and the fingerprint a resume must match (the
    sha256 of the weights and of the tokenizer: the same for the model loaded or not, and
    for a copy of the run saved again)."""
    direction = f"{tgt_lang}→{src_lang}"
    record: dict[str, Any] = {"path": None, "kind": "loaded model", "translates": direction,
                              "trained_direction": None, "model_file": None}
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if tokenizer is not None:
            raise ValueError("tokenizer goes with a loaded model; a run directory has its own.")
        trained = _trained_direction(path)
        if trained is not None and trained != (tgt_lang, src_lang):
            raise BackTranslationError(
                f"{path} translates {trained[0]}→{trained[1]} (its config.json), but "
                f"back-translating {tgt_lang} text for a {src_lang}→{tgt_lang} model needs a "
                f"{direction} model: --src and --tgt name the forward model's languages (the "
                "monolingual text is in --tgt); pass a model trained the other way round.")
        try:
            model, tokenizer = run_directory.load_run(path)
        except FileNotFoundError as error:
            raise BackTranslationError(str(error)) from None
        except Exception as error:  # a damaged model.keras: Keras' own many exception types
            raise BackTranslationError(f"{path}: cannot be loaded ({type(error).__name__}: "
                                       f"{error})") from None
        model_file = path / run_directory.MODEL_FILE
        record.update(path=str(path.resolve()), kind="run directory",
                      trained_direction=None if trained is None else "→".join(trained),
                      model_file={"sha256": file_sha256(model_file),
                                  "bytes": model_file.stat().st_size})
    elif tokenizer is None:
        raise ValueError("a loaded model needs its tokenizer (tokenizer=...); or pass the run "
                         "directory.")
    digest = hashlib.sha256()
    for weight in model.weights:
        value = weight.numpy()
        digest.update(f"{weight.path}:{value.dtype}:{value.shape};".encode())
        digest.update(value.tobytes())
    record["fingerprint"] = {
        "weights_sha256": digest.hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest()}
    return model, tokenizer, record


def _trained_direction(path: Path) -> tuple[str, str] | None:
    """(src, tgt) a run directory's config.json records, or None when it records none."""
    try:
        identity = run_directory.read_json(path / run_directory.CONFIG_FILE).get("identity")
    except (OSError, UsageError):
        return None
    if not isinstance(identity, dict) or not {"src", "tgt"} <= set(identity):
        return None
    return str(identity["src"]), str(identity["tgt"])


def _translate_chunk(model, tokenizer, chunk: list[str], first: int, cleanup: str,
                     decode: dict, counts: LineCounts, progress: Progress | None,
                     total: int) -> list[tuple[str, str]]:
    """(synthetic source, monolingual line) pairs of one chunk, in order; `counts` updated."""
    texts, numbers = [], []
    for number, line in enumerate(chunk, start=first):
        counts.lines_read += 1
        if not line:
            counts.empty_lines += 1
            continue
        cleaned, problems = clean_monolingual_line(line, cleanup)
        for problem in problems:
            setattr(counts, problem, getattr(counts, problem) + 1)
        if cleaned is None:
            counts.cleanup_dropped += 1
            continue
        counts.cleanup_changed += int(cleaned != line)
        texts.append(cleaned)
        numbers.append(number)
    if not texts:
        return []
    report = None
    if progress is not None:
        def report(done: int) -> None:  # lines of the chunk, in proportion
            progress(first + done * len(chunk) // len(texts), total)
    start = time.perf_counter()
    try:
        results = translate_batch(model, tokenizer, texts, line_indices=numbers,
                                  progress=report, **decode)
    except InputTooLong as error:  # its line is the chunk's: name the file's
        raise BackTranslationError(
            f"input line {numbers[error.line] + 1} has {error.tokens} subword tokens (EOS "
            f"included), more than max_input_tokens={error.limit}; raise the limit, or have "
            "long inputs split into sentences or truncated (long_inputs / --long-inputs)."
        ) from None
    counts.decode_seconds += time.perf_counter() - start
    counts.lines_translated += len(texts)
    pairs = []
    for text, result in zip(texts, results, strict=True):
        for flag in result.flags:
            counts.flags[flag] = counts.flags.get(flag, 0) + 1
        counts.output_tokens += len(result.hypotheses[0].pieces) if result.hypotheses else 0
        translation = " ".join(result.text.splitlines()).strip()
        if not translation:
            counts.empty_translations += 1
            continue
        pairs.append((translation, text))
    counts.pairs_written += len(pairs)
    return pairs
