"""get_platform / set_platform choose a backend by environment variable, name or what is installed."""

import logging

import pytest

import hyper_parallel.platform as hp_platform
from hyper_parallel.platform import get_platform, set_platform
from hyper_parallel.platform.local import LocalCluster


@pytest.fixture(autouse=True)
def _forget_choice():
    set_platform(None)
    yield
    set_platform(None)


@pytest.mark.parametrize("name", ["torch", "mindspore"])
def test_environment_variable_chooses_and_is_logged(monkeypatch, caplog, name):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", name)
    with caplog.at_level(logging.INFO, logger="hyper_parallel"):
        p = get_platform()
    assert p.name == name and get_platform() is p
    assert f"using the {name} platform (chosen by HYPER_PARALLEL_PLATFORM)" in caplog.text


def test_unknown_name_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "jax")
    with pytest.raises(ValueError, match="'jax' is not a platform; valid platforms: torch, mindspore"):
        get_platform()
    with pytest.raises(ValueError, match="unknown platform 'tensorflow'; valid platforms: torch, mindspore"):
        set_platform("tensorflow")
    with pytest.raises(TypeError, match="set_platform expects a name or a Platform"):
        set_platform(3)


def test_installed_backend_is_chosen_without_the_variable(monkeypatch, caplog):
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM", raising=False)
    with caplog.at_level(logging.INFO, logger="hyper_parallel"):
        assert get_platform().name == "torch"  # both are installed here; torch comes first
    assert "chosen by installed" in caplog.text


def test_set_platform_by_name_and_local_ranks_override_it():
    p = set_platform("mindspore")
    assert get_platform() is p and p.name == "mindspore"
    ranks = LocalCluster(2, platform="torch").run(lambda: (get_platform().name, get_platform().rank))
    assert ranks == [("torch", 0), ("torch", 1)]
    assert get_platform() is p
    assert hp_platform.PLATFORM_NAMES == ("torch", "mindspore")
