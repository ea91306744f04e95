"""The averaging command: `python -m keras_transformer.averaging` writes model.keras from the
last N checkpoints."""

from __future__ import annotations

import numpy as np

from keras_transformer import run_directory
from keras_transformer.averaging import main as averaging_main
from keras_transformer.training.callbacks import save_model_weights
from keras_transformer.training.checkpoints import checkpoint_path
from tests.training.test_checkpoints import _model_with_constant_weights


def test_averaging_command_writes_model_keras_from_the_last_n(tmp_path):
    config = {"model": {"preset": "tiny", "vocab_size": 20}}
    run_directory.write_json_atomic(tmp_path / run_directory.CONFIG_FILE, config)
    checkpoints = tmp_path / run_directory.CHECKPOINT_DIR
    checkpoints.mkdir()
    for step, value in ((100, 50.0), (200, 1.0), (300, 2.0), (400, 6.0)):
        save_model_weights(_model_with_constant_weights(value), checkpoint_path(checkpoints, step))
    assert averaging_main(["--run", str(tmp_path), "--last", "3"]) == 0
    import keras

    model = keras.models.load_model(tmp_path / run_directory.MODEL_FILE, compile=False)
    for weights in model.get_weights():
        np.testing.assert_allclose(weights, 3.0)  # mean of 1, 2, 6 (not the step-100 one)
