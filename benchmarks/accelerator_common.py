"""What the accelerator check of issue 36 (`benchmarks/accelerator_check.py`) and its parts
share: the bundle's layout, the presets' step shapes, the device's record, and a worker's
results file and log lines.

Imports no other part of the check, and no Keras, JAX or torch at import time, so that every
part's module and `benchmarks/accelerator_bundle.py` (under TensorFlow) can import it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# (On sys.path already: the scripts that import this module put it there first.)
REPO = Path(__file__).resolve().parents[1]

DEFAULT_BUNDLE = REPO / "build" / "accelerator_bundle"
REFERENCE_FILE = "reference.json"
PREPARED_DIR = "multi30k-de-en"
WHEELS_DIR = "wheels"

# Synthetic step shapes: (pairs, source tokens, target tokens, vocabulary), per preset.
STEP_SHAPES = {"small": (256, 32, 32, 8000), "base": (400, 64, 64, 37000),
               "big": (400, 64, 64, 37000), "tiny": (8, 8, 8, 100)}


@dataclasses.dataclass
class Results:
    """A worker's results, written whole to `path` after each item (a killed worker leaves
    what it finished)."""

    path: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=jsonable))
        temporary.replace(self.path)


def jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def say(message: str) -> None:
    print(f"[check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def seconds_left(deadline: float) -> float:
    return deadline - time.time()


def running_record() -> dict[str, Any]:
    """What an item's record says while it runs (and after, if its process was killed)."""
    return {"incomplete": "the part's process was stopped while this ran",
            "started": time.time()}


def brief(record: dict[str, Any]) -> str:
    if "step_seconds" not in record:
        return json.dumps(record)[:400]
    return (f"{record['step_seconds'] * 1e3:.2f} ms/step, "
            f"{record['target_tokens_per_second']:,.0f} target tok/s, "
            f"{record['tflops_per_second']:.2f} TFLOP/s, first step "
            f"{record.get('first_step_seconds', float('nan')):.1f} s")


def jax_device() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": len(jax.devices()), "jax": jax.__version__,
            "default_matmul_precision": str(jax.config.jax_default_matmul_precision)}
