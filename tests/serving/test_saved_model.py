"""SavedModel export for TF Serving (keras_transformer.export).

Also provides the tiny tokenizer/model/run-directory helpers that the translate, evaluate and
plot tests import, and a small file system to fill (`small_filesystem`, `fill`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import run_directory
from keras_transformer.decoding.search import beam_search, encode_texts, greedy_search
from keras_transformer.decoding.translator import force_decode, translate_texts
from keras_transformer.model.transformer import build_transformer
from keras_transformer.serving.saved_model import (
    METADATA_FILE,
    TranslationModule,
    export_saved_model,
    latest_version,
    serving_model,
)
from pipelines.storage import StorageError
from pipelines.tokenizer import SubwordTokenizer, train_tokenizer
from tests.storage_faults import small_filesystem, snapshot

_GERMAN = ("ein eine der die das hund katze mann frau kind spielt läuft auf im park mit einem "
           "ball rot blau grün schnell wasser straße haus sitzt steht springt über zwei drei "
           "junge mädchen fahrrad").split()
_ENGLISH = ("a an the dog cat man woman child plays runs on in park with ball red blue green "
            "fast water street house sits stands jumps over two three young girl bicycle").split()


def make_sentences(count: int, words: list[str], seed: int = 0,
                   lengths: tuple[int, int] = (3, 10)) -> list[str]:
    """Random sentences of `lengths` words from `words`, capitalized, with a full stop."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(*lengths))).capitalize() + "."
            for _ in range(count)]


def make_tokenizer(directory: Path) -> SubwordTokenizer:
    """A 320-piece sentencepiece tokenizer trained on 120 made-up sentences (< 1 s)."""
    texts = make_sentences(60, _GERMAN) + make_sentences(60, _ENGLISH, seed=1)
    return train_tokenizer(texts, directory, vocab_size=320)


def make_model(vocab_size: int, seed: int = 0, dtype=None):
    """An untrained tiny Transformer, its initial weights drawn from `seed`.

    Seeds Python's and NumPy's generators only (Keras draws initializer seeds from them):
    `tf.random.set_seed` (and so `keras.utils.set_random_seed`) clears TensorFlow's eager
    kernel cache, which destroys the sentencepiece resource of any tokenizer built before.
    """
    random.seed(seed)
    np.random.seed(seed)
    return build_transformer("tiny", vocab_size=vocab_size, dtype=dtype)


def make_run_dir(directory: Path) -> Path:
    """A run directory as training writes it (model.keras + tokenizer/), untrained."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory / run_directory.TOKENIZER_DIR)
    make_model(tokenizer.vocab_size).save(directory / run_directory.MODEL_FILE)
    return directory


HOSTILE = {
    "empty": b"",
    "whitespace": b" \t  \t ",
    "long": b"Ein Hund " * 1111 + b"x",  # 10,000 characters
    "invalid_utf8": b"\xff\xfe Ein \xc3\x28 Hund \xed\xa0\x80",
    "control": "Ein\x00 Hund\x07\x1b[31m läuft\r\n\x0b.".encode(),
    "emoji": "🙂🚀 👩‍👩‍👧 Hund 🐕".encode(),
    "unseen_scripts": "漢字 かな 한국어 עברית العربية ᚠᛇᚻ Ελληνικά".encode(),
}
MAX_INPUT_TOKENS, MAX_EXTRA = 64, 6
CHUNK = 256  # sentences per decoding chunk: 4 chunks for the 1,000-sentence request


_SHARED: dict[str, Path] = {}


def shared_artifacts(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, exported SavedModel version folder), made once per test session.

    Only paths are shared: each test module loads its own model and tokenizer, because
    another module's `tf.random.set_seed` would break a tokenizer built before it.
    """
    if not _SHARED:
        root = tmp_path_factory.mktemp("artifacts")
        run = make_run_dir(root / "run")
        model, tokenizer = run_directory.load_run(run)
        _SHARED["run"] = run
        _SHARED["export"] = export_saved_model(
            model, tokenizer, root / "saved_models" / "demo", max_input_tokens=MAX_INPUT_TOKENS,
            max_extra_length=MAX_EXTRA, chunk_size=CHUNK)
    return _SHARED["run"], _SHARED["export"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(tokenizer, model, version folder, loaded SavedModel)."""
    run, path = shared_artifacts(tmp_path_factory)
    model, tokenizer = run_directory.load_run(run)
    return tokenizer, model, path, tf.saved_model.load(str(path))


def _texts(tensor) -> list[str]:
    """Decodes the byte strings strictly: every output must be valid UTF-8."""
    return [value.decode("utf-8") for value in np.asarray(tensor).reshape(-1)]


def test_layout_is_what_tf_serving_watches(exported):
    _, _, path, _ = exported
    assert path.name == "1" and path.parent.name == "demo"
    assert (path / "saved_model.pb").is_file() and (path / "variables").is_dir()
    assert [p.name for p in path.parent.iterdir()] == ["1"]  # no temporary folder left
    metadata = json.loads((path / METADATA_FILE).read_text())
    assert metadata["max_input_tokens"] == MAX_INPUT_TOKENS
    assert metadata["max_output_tokens"] == MAX_INPUT_TOKENS + MAX_EXTRA
    assert latest_version(path.parent) == 1


def test_serving_default_matches_python_decoding(exported):
    tokenizer, model, _, loaded = exported
    sentences = ["Ein Hund läuft im Park.", "Zwei Kinder.", "Eine Frau sitzt auf einem Ball."]
    outputs = loaded.signatures["serving_default"](inputs=tf.constant(sentences))
    assert list(outputs) == ["outputs"]
    sources = encode_texts(tokenizer, sentences, MAX_INPUT_TOKENS).to_tensor()
    ids, _ = beam_search(model, sources, beam_size=4, alpha=0.6, extra_length=MAX_EXTRA)
    expected = [t.decode() for t in tokenizer.detokenize(ids).numpy()]
    assert _texts(outputs["outputs"]) == expected


def test_translate_and_nbest_signatures(exported):
    _, _, _, loaded = exported
    inputs = tf.constant(["Ein Hund.", "Eine Katze springt über das Wasser."])
    best = loaded.signatures["translate"](inputs=inputs, beam_size=tf.constant(3),
                                          alpha=tf.constant(0.6))
    nbest = loaded.signatures["translate_nbest"](inputs=inputs, beam_size=tf.constant(3),
                                                 alpha=tf.constant(0.6))
    assert best["outputs"].shape == (2,) and best["scores"].shape == (2,)
    assert nbest["outputs"].shape == (2, 3) and nbest["scores"].shape == (2, 3)
    assert _texts(nbest["outputs"][:, 0]) == _texts(best["outputs"])
    np.testing.assert_allclose(nbest["scores"][:, 0], best["scores"], rtol=1e-5)
    assert (np.diff(nbest["scores"].numpy(), axis=1) <= 0).all()
    # Out-of-range knobs are clipped, never an error.
    clipped = loaded.signatures["translate"](inputs=inputs, beam_size=tf.constant(10_000),
                                             alpha=tf.constant(float("nan")))
    assert clipped["outputs"].shape == (2,)
    zero = loaded.signatures["translate"](inputs=inputs, beam_size=tf.constant(0),
                                          alpha=tf.constant(-3.0))
    assert zero["outputs"].shape == (2,)


def test_beam_size_one_is_greedy_decoding(exported):
    tokenizer, model, _, loaded = exported
    sentences = ["Ein Hund läuft im Park.", "Zwei Kinder.", "Eine Frau sitzt auf einem Ball."]
    for name in ("translate", "translate_nbest"):
        outputs = loaded.signatures[name](inputs=tf.constant(sentences),
                                          beam_size=tf.constant(1), alpha=tf.constant(0.6))
        assert _texts(outputs["outputs"]) == translate_texts(
            model, tokenizer, sentences, beam_size=1, max_input_tokens=MAX_INPUT_TOKENS,
            extra_length=MAX_EXTRA)
    sources = encode_texts(tokenizer, sentences, MAX_INPUT_TOKENS).to_tensor()
    ids, log_probs = greedy_search(model, sources, extra_length=MAX_EXTRA)
    # Scored as beam search scores: summed log-probability over the GNMT length penalty.
    lengths = (ids.numpy() != 0).sum(axis=1)
    np.testing.assert_allclose(outputs["scores"].numpy()[:, 0],
                               log_probs.numpy() / ((5 + lengths) / 6) ** 0.6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_gets_a_string_back(exported, name):
    _, _, _, loaded = exported
    started = time.perf_counter()
    outputs = loaded.signatures["serving_default"](inputs=tf.constant([HOSTILE[name]]))
    assert len(_texts(outputs["outputs"])) == 1
    assert time.perf_counter() - started < 60


def test_mixed_hostile_batch_keeps_order(exported):
    _, _, _, loaded = exported
    serve = loaded.signatures["serving_default"]
    batch = list(HOSTILE.values()) + ["Ein Hund läuft.".encode()]
    together = _texts(serve(inputs=tf.constant(batch))["outputs"])
    one_by_one = [_texts(serve(inputs=tf.constant([text]))["outputs"])[0] for text in batch]
    assert together == one_by_one
    empty = serve(inputs=tf.constant([], tf.string))["outputs"]
    assert empty.shape == (0,)


def test_a_thousand_sentences_in_one_request(exported):
    _, _, _, loaded = exported
    sentences = make_sentences(1000, _GERMAN, seed=5, lengths=(1, 4))  # short: a fast test
    started = time.perf_counter()
    outputs = _texts(loaded.signatures["serving_default"](inputs=tf.constant(sentences))["outputs"])
    assert len(outputs) == 1000
    assert time.perf_counter() - started < 120
    # Sorting into chunks must not mix sentences up.
    first = _texts(loaded.signatures["serving_default"](inputs=tf.constant(sentences[:3]))[
        "outputs"])
    assert outputs[:3] == first


_FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)
    loaded = tf.saved_model.load(sys.argv[1])
    serve = loaded.signatures["serving_default"]
    out = serve(inputs=tf.constant([b"Ein Hund.", b"", b"\\xff\\xfe", "🙂".encode()]))
    nbest = loaded.signatures["translate_nbest"](
        inputs=tf.constant(["Ein Hund."]), beam_size=tf.constant(2), alpha=tf.constant(0.6))
    score = loaded.signatures["score"](inputs=tf.constant(["Ein Hund."]),
                                       targets=tf.constant(["A dog."]), alpha=tf.constant(0.6))
    project = sorted(m for m in sys.modules if m.split(".")[0] in ("keras_transformer",
                                                                    "pipelines"))
    print(json.dumps({
        "outputs": [t.decode("utf-8") for t in out["outputs"].numpy()],
        "nbest_shape": list(nbest["outputs"].shape),
        "names": sorted(loaded.signatures),
        "log_prob": float(score["log_probs"][0]),
        "project_modules": project,
    }))
""")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def test_loads_in_a_fresh_process_with_only_tensorflow_and_text(exported, tmp_path):
    """The SavedModel loads and decodes without the project: every signature is listed,
    and three of them (greedy, n-best and a forced pass) run (one process for all of it:
    its start and the load are most of this test's time)."""
    tokenizer, model, path, loaded = exported
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(path)], cwd=tmp_path, env=_clean_env(),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["project_modules"] == []
    assert len(report["outputs"]) == 4
    assert report["nbest_shape"] == [1, 2]
    assert report["names"] == ["sample", "score", "serving_default", "translate",
                               "translate_details", "translate_nbest", "translate_prefix"]
    expected_score = force_decode(model, tokenizer, ["Ein Hund."], ["A dog."])[0]
    assert report["log_prob"] == pytest.approx(expected_score.hypotheses[0].log_prob, abs=1e-4)
    expected = _texts(loaded.signatures["serving_default"](inputs=tf.constant(["Ein Hund."]))[
        "outputs"])
    assert report["outputs"][0] == expected[0]


def test_saved_model_cli_shows_the_signatures(exported, tmp_path):
    _, _, path, _ = exported
    cli = shutil.which("saved_model_cli") or str(Path(sys.executable).with_name("saved_model_cli"))
    result = subprocess.run(
        [cli, "show", "--dir", str(path), "--all"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("serving_default", "translate", "translate_nbest", "inputs['beam_size']",
                 "outputs['outputs']"):
        assert name in result.stdout


def test_mixed_bfloat16_model_is_served_in_float32(exported):
    tokenizer, model, _, loaded = exported
    bf16 = make_model(tokenizer.vocab_size, dtype="mixed_bfloat16")
    bf16.set_weights(model.get_weights())
    copy = serving_model(bf16)
    assert copy.compute_dtype == "float32" and copy is not bf16
    for a, b in zip(copy.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # What export_saved_model saves for a mixed-precision model (saving itself is tested above).
    module = TranslationModule(copy, tokenizer, max_input_tokens=MAX_INPUT_TOKENS,
                               max_extra_length=MAX_EXTRA)
    inputs = tf.constant(["Ein Hund läuft.", "Zwei Mädchen."])
    assert _texts(module.serve(inputs)["outputs"]) == _texts(
        loaded.signatures["serving_default"](inputs=inputs)["outputs"])


def test_xla_compiled_export_gives_the_same_translations(exported, export_after_a_full_disk):
    _, _, _, loaded = exported
    path = export_after_a_full_disk.made
    assert json.loads((path / METADATA_FILE).read_text())["jit_compile"] is True
    compiled = tf.saved_model.load(str(path))
    # Sentences of different lengths, more than a chunk: the batch shrinks as they finish.
    inputs = tf.constant(make_sentences(6, _GERMAN, seed=5, lengths=(1, 12)))
    # Beam 4 (greedy under XLA: tests/decoding/test_search.py).
    arguments = {"inputs": inputs, "beam_size": tf.constant(4), "alpha": tf.constant(0.6)}
    expected = loaded.signatures["translate"](**arguments)
    outputs = compiled.signatures["translate"](**arguments)
    assert _texts(outputs["outputs"]) == _texts(expected["outputs"])
    np.testing.assert_allclose(outputs["scores"], expected["scores"], atol=1e-4)
    # Sampling compiles every branch of the sampler, whichever the options take.
    for top_k, top_p in ((0, 1.0), (0, 0.9), (3, 1.0), (3, 0.5)):
        arguments = {"inputs": inputs, "line_indices": tf.range(6, dtype=tf.int64),
                     "seed": tf.constant(7, tf.int64), "top_k": tf.constant(top_k),
                     "top_p": tf.constant(top_p), "temperature": tf.constant(1.0),
                     "alpha": tf.constant(0.6)}
        expected = loaded.signatures["sample"](**arguments)
        outputs = compiled.signatures["sample"](**arguments)
        assert _texts(outputs["outputs"]) == _texts(expected["outputs"])


class _Interrupted(Exception):
    pass


def test_versions_increment_and_a_failed_export_leaves_nothing(exported, tmp_path, monkeypatch):
    tokenizer, model, _, _ = exported
    base = tmp_path / "saved_models" / "demo"

    def fake_save(module, directory, signatures=None, options=None):
        Path(directory, "saved_model.pb").write_bytes(b"stub")

    monkeypatch.setattr(tf.saved_model, "save", fake_save)
    assert export_saved_model(model, tokenizer, base).name == "1"
    assert export_saved_model(model, tokenizer, base).name == "2"
    assert export_saved_model(model, tokenizer, base, version=10).name == "10"
    assert export_saved_model(model, tokenizer, base).name == "11"
    with pytest.raises(FileExistsError):
        export_saved_model(model, tokenizer, base, version=2)
    # A version folder without a saved_model.pb (copied in part, made by hand) is skipped,
    # not taken: an export without --version never fails on an existing folder.
    (base / "12").mkdir()
    assert export_saved_model(model, tokenizer, base).name == "13"
    (base / "12").rmdir()
    shutil.rmtree(base / "13")

    def killed_save(module, directory, signatures=None, options=None):
        Path(directory, "variables").mkdir()
        raise _Interrupted

    monkeypatch.setattr(tf.saved_model, "save", killed_save)
    with pytest.raises(_Interrupted):
        export_saved_model(model, tokenizer, base)
    assert sorted(p.name for p in base.iterdir()) == ["1", "10", "11", "2"]
    # A SIGKILLed export leaves its temporary folder; the next export removes it once its
    # process is gone (TF Serving ignores it meanwhile: not an integer name).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (base / f".tmp-export-{dead}-abc").mkdir()
    monkeypatch.setattr(tf.saved_model, "save", fake_save)
    assert export_saved_model(model, tokenizer, base).name == "12"
    assert not [p for p in base.iterdir() if p.name.startswith(".")]


def _graph_defs(path) -> list:
    """The GraphDefs of the SavedModel in the version folder `path`."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((Path(path) / "saved_model.pb").read_bytes())
    return [meta_graph.graph_def for meta_graph in saved_model.meta_graphs]


def _library_functions(graphs) -> list:
    """The FunctionDefs of the graphs' libraries (the signatures' bodies and what they call)."""
    return [function for graph in graphs for function in graph.library.function]


def _function_nodes(graphs) -> list:
    """The NodeDefs of every function in the graphs' libraries."""
    return [node for function in _library_functions(graphs) for node in function.node_def]


def test_export_contains_only_standard_ops(exported):
    """The fused training kernels (custom ops, `Kt*`) never reach a SavedModel: TF Serving
    could not run them."""
    _, _, path, _ = exported
    graphs = _graph_defs(path)
    op_types = {node.op for graph in graphs for node in graph.node}
    op_types |= {node.op for node in _function_nodes(graphs)}
    assert "MatMul" in op_types or "BatchMatMulV2" in op_types
    assert not {op for op in op_types if op.startswith("Kt")}


def test_every_signature_decodes_with_one_shared_search_of_each_kind(exported):
    """The seven signatures decode through one greedy search (which samples too: greedy is
    sampling with top_k 1), one beam search (1-best or n-best, with or without a prefix) and
    one forced pass (`DetailedSignatures`' shared functions), each traced and stored once:
    the model's log-softmax, computed once in each, appears three times in the whole graph.
    A signature tracing a search of its own (the export then ~40% larger, and as much slower
    to write) would add one."""
    _, _, path, _ = exported
    graphs = _graph_defs(path)
    assert sum(node.op == "LogSoftmax" for node in _function_nodes(graphs)) == 3
    # Each stays a function of its own after a load (not inlined into the signatures that
    # call it), so that a process optimizes it once, not once per signature it calls.
    shared = {}
    for function in _library_functions(graphs):
        name = re.fullmatch(r"__inference_(_greedy_search|_beam_search|_forced_pass)_\d+",
                            function.signature.name)
        if name:
            shared.setdefault(name[1], []).append(function.attr["_noinline"].b)
    assert shared == {"_greedy_search": [True], "_beam_search": [True], "_forced_pass": [True]}


def test_export_holds_no_gradient_functions_and_a_load_leaves_nothing(exported):
    """An inference export computes no custom gradients, so it saves none: each
    `tf.saved_model.load` of a SavedModel that holds some registers them in TensorFlow's
    gradient registry for the life of the process, with the loaded graphs they hold."""
    from tensorflow.python.framework import ops

    from tests.kernels.test_custom_gradient import live_graphs

    _, _, path, _ = exported
    graphs = _graph_defs(path)
    assert not [gradient for graph in graphs for gradient in graph.library.registered_gradients]
    nodes = _function_nodes(graphs)
    assert len(nodes) > 1000
    assert not [node.name for node in nodes if "_gradient_op_type" in node.attr]

    before = live_graphs()  # held, so that no new graph can take a collected one's id
    registered = len(ops._gradient_registry._registry)
    loaded = tf.saved_model.load(str(path))
    assert _texts(loaded.signatures["serving_default"](tf.constant(["ein hund läuft ."]))["outputs"])
    assert len(live_graphs()) > len(before)
    del loaded
    assert len(ops._gradient_registry._registry) <= registered
    known = {id(graph) for graph in before}
    assert [graph.name for graph in live_graphs() if id(graph) not in known] == []


def _save_on_a_full_disk(module, directory, signatures=None, options=None):
    """`tf.saved_model.save` on a full disk, as it fails on a tmpfs: part of the variables
    written, then a ResourceExhaustedError with the errno text."""
    temporary = Path(directory, "variables", "variables_temp")
    temporary.mkdir(parents=True)
    part = temporary / "part-00000-of-00001.data-00000-of-00001.tempstate1"
    part.write_bytes(bytes(4096))
    raise tf.errors.ResourceExhaustedError(None, None, f"{part}; No space left on device "
                                           "[Op:SaveV2]")


@dataclasses.dataclass
class _FullDisk:
    """What `export_after_a_full_disk` saw: the export base, the earlier version's files
    before the failed export and after it, the entries of the base after it, the error it
    raised (None if none) and the version made once space was freed."""

    base: Path
    before: dict[str, str]
    after: dict[str, str]
    entries: list[str]
    failure: BaseException | None
    made: Path


@pytest.fixture(scope="module")
def export_after_a_full_disk(exported, tmp_path_factory):
    """An XLA-compiled export (chunks of 4) tried on a disk with room for a copy of the
    earlier version but not for the new one's variables (250 KB), then, with space freed,
    the same export again. The full-disk test checks the first, the XLA test runs the
    second: each export traces its signatures for ~20 s, so they share this one."""
    tokenizer, model, path, _ = exported
    earlier = sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
    disk = tmp_path_factory.mktemp("full_disk")

    def export(base):
        return export_saved_model(model, tokenizer, base, max_input_tokens=MAX_INPUT_TOKENS,
                                  max_extra_length=MAX_EXTRA, chunk_size=4, jit_compile=True)

    with (small_filesystem(disk, earlier + 160_000) as mounted,
          pytest.MonkeyPatch.context() as monkeypatch):
        base = disk / "demo"
        shutil.copytree(path, base / "1")
        before = snapshot(base / "1")
        if not mounted:
            monkeypatch.setattr(tf.saved_model, "save", _save_on_a_full_disk)
        failure = None
        try:
            export(base)
        except Exception as error:  # kept for the test, which asserts what it is
            failure = error
        entries, after = [p.name for p in base.iterdir()], snapshot(base / "1")
        # Free space (or no failure any more), run the same export again.
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        monkeypatch.undo()
        yield _FullDisk(base, before, after, entries, failure, export(base))


def test_a_full_disk_stops_the_export_and_leaves_the_earlier_version(exported,
                                                                      export_after_a_full_disk):
    _, model, _, _ = exported
    disk = export_after_a_full_disk
    base = disk.base
    error = disk.failure
    assert isinstance(error, StorageError), repr(error)
    assert error.errno == errno.ENOSPC and error.path == base / "2"
    # The weights are what it needed at least (the export failed while writing them).
    assert error.needed >= 4 * model.count_params()
    message = str(error)
    assert str(base / "2") in message and "needed" in message and "\n" not in message
    assert disk.entries == ["1"]  # no temporary folder, no version 2
    assert disk.after == disk.before
    # The same export again, with space freed: version 2.
    again = disk.made
    assert again == base / "2" and latest_version(base) == 2
    assert snapshot(again).keys() == disk.before.keys()
    assert not [p for p in base.iterdir() if p.name.startswith(".")]
