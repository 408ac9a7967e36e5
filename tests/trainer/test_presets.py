"""The model-preset registry: the toy is found by name, files are not presets, names are unique."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainer.presets import get_preset, preset_data_sources, register_preset
from trainer.toy.model import WEIGHTS_FILE


def test_the_toy_is_a_registered_preset_with_its_own_data():
    preset = get_preset("toy")
    assert preset is not None and preset.name == "toy" and preset.data_source == "toy"
    assert preset.weight_files() == {WEIGHTS_FILE.name: WEIGHTS_FILE}
    assert "toy" in preset_data_sources()


@pytest.mark.parametrize("base", ["/models/sd3.5_medium.safetensors", "stabilityai/stable-diffusion-3.5-medium"])
def test_files_folders_and_repo_ids_are_not_presets(base):
    assert get_preset(base) is None


def test_a_name_can_be_registered_once():
    toy = get_preset("toy")
    assert register_preset(toy) is toy  # the same object again is a no-op
    with pytest.raises(ValueError, match="a model preset named 'toy' is already registered"):
        register_preset(replace(toy, description="another toy"))
    assert get_preset("toy") is toy
