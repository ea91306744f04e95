"""The warmers of the accelerator check of issue 36 (`benchmarks/accelerator_check.py`): what
the parts will compile, cut into pieces (`warm_tasks`: the agreement's batch shapes, each step
preset, torch.compile's presets), and the worker that compiles one piece into the persistent
caches (`warm_worker`). The check runs the pieces in parallel processes first (`warm_caches`),
so that the parts load their programs instead of compiling them one after another.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.accelerator_agreement import (
    _shape_key,
    agreement_shapes,
    recipe_batches,
    recipe_model,
    set_initial_weights,
)
from benchmarks.accelerator_common import REFERENCE_FILE, Results, seconds_left
from benchmarks.accelerator_step import keras_step
from benchmarks.accelerator_torch import torch_step


def warm_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    """Compiles one piece of a later part, so that part finds it in the persistent caches
    (JAX's compilation cache; Inductor's FX-graph and Triton caches): the parts' own first
    steps then load programs instead of compiling them one after another."""
    task = settings["warm_task"]
    results.data["task"] = task
    start = time.perf_counter()
    if task["kind"] == "agreement":
        bundle = Path(settings["bundle"])
        reference = json.loads((bundle / REFERENCE_FILE).read_text())
        model = recipe_model(reference["recipe_settings"], task["precision"])
        set_initial_weights(model, int(reference["initial_weights"]["seed"]))
        wanted = set(task["shapes"])
        batches = recipe_batches(bundle / reference["prepared"]["folder"],
                                 reference["batches"])
        for _ in range(min(settings["agreement_steps"], len(reference["steps"]))):
            if not wanted or seconds_left(deadline) < 1:
                break
            features, labels = next(batches)
            if _shape_key(features) in wanted:
                wanted.discard(_shape_key(features))
                model.train_on_batch(features, labels)
    elif task["kind"] == "keras":
        keras_step(task["preset"], dict(settings, steps=1, window=1, profile=[]))
    elif task["kind"] == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_step(torch, device, task["preset"], True, dict(settings, steps=1, window=1))
    results.data["seconds"] = round(time.perf_counter() - start, 1)
    results.save()


def warm_tasks(settings: dict[str, Any], parts: list[str]) -> list[dict[str, Any]]:
    """What the parts will compile, cut into pieces for parallel warmers."""
    tasks: list[dict[str, Any]] = []
    if "agreement" in parts:
        shapes = agreement_shapes(settings)
        count = max(1, min(len(shapes), settings["agreement_warmers"]))
        for precision in settings["agreement_precisions"]:
            tasks += [{"kind": "agreement", "precision": precision,
                       "shapes": shapes[index::count]} for index in range(count)]
    if "step" in parts:
        tasks += [{"kind": "keras", "preset": preset} for preset in settings["presets"]]
    if "torch" in parts and "compile" in settings["torch_modes"]:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            tasks += [{"kind": "torch", "preset": preset}
                      for preset in settings["torch_compile_presets"]]
    return tasks
