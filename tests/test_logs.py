"""The command-line tools' output: TensorFlow's C++ log lines filtered out, everything else
in; the project's own lines on stdout, or on stderr for a command whose stdout is its result."""

from __future__ import annotations

import pytest

from keras_transformer.logs import LOGGERS, filter_native_logs, show_project_logs


@pytest.mark.parametrize("line", [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795494401.635904   14486 cudart_stub.cc:31] Could not find cuda drivers on "
    b"your machine, GPU will not be used.",
    b"E0000 00:00:1795494404.023592   14486 cuda_platform.cc:52] failed call to cuInit: "
    b"INTERNAL: CUDA error",
    b"W0000 00:00:1795494405.056163   14486 util.cc:131] oneDNN supports DT_INT64 only on "
    b"platforms with AVX-512.",
    b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    b"TensorFlow with the appropriate compiler flags.",
    b"normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity normalization.",
])
def test_cpp_log_lines_are_dropped(line):
    assert filter_native_logs(line) is None


@pytest.mark.parametrize("line", [
    b"Traceback (most recent call last):",
    b"error: --tokens-per-batch 64 is below --max-length 128",
    b"F0000 00:00:1795494405.056163   14486 x.cc:1] Check failed: a fatal error stays visible",
    b"/x/keras/src/trainers/epoch_iterator.py:74: UserWarning: a Python warning stays visible",
    b"step 1,200 / 4,200 \xc2\xb7 15.2 min",
])
def test_everything_else_passes(line):
    assert filter_native_logs(line) == line


def test_a_cpp_line_glued_to_a_progress_bar_is_cut_off():
    line = (b"Generating splits...: 100%|##########| 3/3 [00:04<00:00]   I0000 00:00:1795495119."
            b"199474   20406 tf_record_dataset_op.cc:396] The default buffer size is 262144")
    assert filter_native_logs(line) == b"Generating splits...: 100%|##########| 3/3 [00:04<00:00]"


def test_project_lines_go_to_stdout_or_to_stderr_through_one_handler(capsys):
    import logging

    logger = logging.getLogger("pipelines.corpora")
    for to_stderr, stream in ((True, "err"), (False, "out"), (True, "err")):
        show_project_logs(to_stderr=to_stderr)
        logger.info("loaded 5 de-en pairs")
        captured = capsys.readouterr()
        assert getattr(captured, stream) == "loaded 5 de-en pairs\n"
        assert getattr(captured, "out" if stream == "err" else "err") == ""
    for name in LOGGERS:
        assert len(logging.getLogger(name).handlers) == 1
