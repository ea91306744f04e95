"""Shared pytest setup."""

import gc
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any test imports TensorFlow
# XLA's CPU code generator at optimization level 0, in every test process and (inherited) in
# the processes the tests start: the same programs, compiled in far less time. The tests
# check what compiled code computes, not how fast it runs; over the XLA-heavy tests (the XLA
# export, the float16 XLA run, the JAX checks) it saved 8% of their CPU time. XLA reads its
# flags once, when it starts: so here, before any test imports TensorFlow or JAX.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()


def pytest_unconfigure(config):
    """One garbage collection, then the survivors frozen out of pytest's collections.

    At its end pytest collects garbage five times (`_pytest.unraisableexception`: to report
    errors raised in finalizers). A worker that ran the TensorFlow and JAX tests holds
    millions of live objects (6.4 million on the AVX2 machine), and each collection walks
    them all: ~2 s each there, so the suite's last worker took over 5 s to end, and
    pytest-xdist's gateway then interrupted it (the "Exception ignored in
    `_xla_gc_callback`: KeyboardInterrupt" at the end of some logs). One collection here
    still finds the session's garbage and its finalizers' errors; after `gc.freeze()`
    pytest's collections skip what is left, which is alive. This hook runs before pytest's
    cleanup."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    """The raw Multi30k task-1 release (never copied into the repo); MULTI30K_DIR overrides."""
    default = Path(__file__).resolve().parents[1].parent / "shared/data/multi30k"
    path = Path(os.environ.get("MULTI30K_DIR", default))
    if not (path / "train.de.gz").is_file():
        pytest.fail(f"Multi30k not found at {path}: set MULTI30K_DIR to the folder of *.gz files")
    return path


@pytest.fixture(scope="session")
def small_corpus():
    """600 synthetic sentence pairs ("de"-"en"), 1 to 30 words, accented letters included."""
    from pipelines.corpora import ParallelCorpus

    rng = random.Random(0)
    syllables = "ka lo mi ne su ta ri po ve da gu zo fe hi ju mä bé rø".split()
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)})
    translation = {word: word[::-1] + rng.choice(["", "s", "en"]) for word in words}
    sources, targets = [], []
    for _ in range(600):
        sentence = rng.choices(words, k=rng.randint(1, 30))
        sources.append(" ".join(sentence).capitalize() + rng.choice([".", "!", "?"]))
        target = [translation[word] for word in sentence] + rng.choices(words, k=rng.randint(0, 2))
        targets.append(" ".join(target).capitalize() + ".")
    return ParallelCorpus(sources, targets, "de", "en", "train", "synthetic")


@pytest.fixture(scope="session")
def small_tokenizer(small_corpus, tmp_path_factory):
    """A 400-piece BPE tokenizer trained on both sides of `small_corpus`."""
    from pipelines.tokenizer import train_tokenizer

    directory = tmp_path_factory.mktemp("small_tokenizer") / "tokenizer"
    return train_tokenizer(small_corpus.sources + small_corpus.targets, directory, vocab_size=400)


@pytest.fixture(autouse=True)
def project_loggers_as_found():
    """Puts the project's loggers back after each test: a command line run in-process
    (`main([...])`) sends them to stdout or stderr and stops their propagation
    (`show_project_logs`), which would hide their records from a later test's `caplog`."""
    import logging

    from keras_transformer.logs import LOGGERS

    saved = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in LOGGERS}
    streams = {handler: handler.to_stderr for handlers, _, _ in saved.values()
               for handler in handlers if hasattr(handler, "to_stderr")}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
    for handler, to_stderr in streams.items():
        handler.to_stderr = to_stderr


# Tests that start several training processes on local ports (TF_CONFIG clusters) or assert a
# bound in seconds: pytest-xdist runs each group on one worker, one test at a time, so they
# never share ports or compete with each other (`--dist loadgroup` in pyproject.toml).
# The modules sharing `tests.serving.test_saved_model.shared_artifacts` (a run directory and
# its export, made once per process) go to one worker too, so that it is made once, and so do
# the tests of every other module, so that its module-scoped fixtures are made once.
_CLUSTER_FILES = ("tests/cluster/test_workers.py",)
_CLUSTER_TESTS = ("two_workers", "workers_skip")
_ARTIFACT_FILES = ("tests/serving/test_saved_model.py", "tests/cli/test_translate.py",
                   "tests/cli/test_evaluate.py", "tests/decoding/test_attention_plots.py",
                   "tests/serving/test_saved_model_translation.py",
                   "tests/serving/test_detailed_signatures.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the marks into nodeids
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        if path in _CLUSTER_FILES or any(part in item.name for part in _CLUSTER_TESTS):
            item.add_marker(pytest.mark.xdist_group("cluster"))
        elif path in _ARTIFACT_FILES:
            item.add_marker(pytest.mark.xdist_group("shared_artifacts"))
        else:  # a module's tests together: its module-scoped fixtures are made once
            item.add_marker(pytest.mark.xdist_group(path))
    items[:] = sorted(items, key=_start_order(items))


# The groups that take a minute or more on the AVX-512 machine, longest first (the suite's
# durations: pytest --durations=40). pytest-xdist would start the groups with the most tests
# first (`--no-loadscope-reorder` in pyproject.toml turns that off), which left single-test
# groups of two or three minutes to the end while the other worker idled: longest first,
# each worker ends within about one short group of the other.
_LONGEST_GROUPS = ("cluster", "shared_artifacts", "tests/training/test_gpu_path.py",
                   "tests/training/test_killed_writes.py", "tests/cli/test_train_jax.py",
                   "tests/training/test_damaged_runs.py", "tests/training/test_accumulation.py",
                   "tests/training/test_resume.py", "tests/test_notebooks.py",
                   "tests/cli/test_train.py", "tests/test_jax_backend.py")


def _group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


def _start_order(items):
    """Sort key: the longest groups in `_LONGEST_GROUPS`' order, then the others by their
    number of tests, most first (pytest-xdist's own order); a group's tests keep theirs."""
    sizes = {}
    for item in items:
        sizes[_group(item)] = sizes.get(_group(item), 0) + 1

    def key(item) -> tuple[int, int]:
        group = _group(item)
        if group in _LONGEST_GROUPS:
            return (_LONGEST_GROUPS.index(group), 0)
        return (len(_LONGEST_GROUPS), -sizes[group])

    return key
