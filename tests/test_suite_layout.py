"""How the suite is spread over pytest-xdist's workers (tests/conftest.py): every module that
uses `shared_artifacts` (a run directory and its SavedModel export, made once per process)
runs on the worker that holds them, or it would make its own export (~30 s of tracing); the
longest groups start first."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _ARTIFACT_FILES

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_using_the_shared_export_is_in_its_group():
    users = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
             if path != Path(__file__).resolve()
             and "shared_artifacts(" in path.read_text(encoding="utf-8")}
    assert "tests/serving/test_saved_model.py" in users
    assert users <= set(_ARTIFACT_FILES), sorted(users - set(_ARTIFACT_FILES))


def test_every_group_started_first_still_exists():
    """A renamed test file would silently fall back to xdist's order (and the suite's tail)."""
    from tests.conftest import _LONGEST_GROUPS

    named = {"cluster", "shared_artifacts"}
    missing = [group for group in _LONGEST_GROUPS
               if group not in named and not (ROOT / group).is_file()]
    assert not missing, missing
