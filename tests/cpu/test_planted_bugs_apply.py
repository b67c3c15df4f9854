"""tools/planted_bugs.py plants each bug by replacing a text that must occur exactly once; a refactor that
moves that text would leave the plant (and the proof that its tests catch the bug) silently dead. This
checks every plant still applies, and that the planted text differs from the original."""
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import planted_bugs  # noqa: E402


@pytest.mark.parametrize("plant", planted_bugs.PLANTS, ids=lambda p: p.name[:50])
def test_each_plant_replaces_one_occurrence_of_its_text(plant):
    text = (ROOT / plant.path).read_text()
    assert text.count(plant.old) == 1, f"{plant.path}: update the plant '{plant.name}'"
    assert plant.new != plant.old
    for test in plant.tests + plant.contrast:
        assert (ROOT / test.partition("::")[0]).is_file(), test
