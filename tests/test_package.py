"""The installed distribution says what it is: its version, its licence, that it is typed, what it needs."""
import importlib.metadata
import importlib.resources
import os

import mooncake_ep_switch
from mooncake_ep_switch.version import MIRRORS, VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _metadata():
    return importlib.metadata.metadata("mooncake_ep_switch")


def test_version_is_one_value_everywhere():
    assert mooncake_ep_switch.__version__ == VERSION == _metadata()["Version"]
    assert len(MIRRORS) == 3
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as handle:
        assert f"## {VERSION}" in handle.read()


def test_metadata_carries_the_licence():
    metadata = _metadata()
    licence = metadata.get("License-Expression") or metadata.get("License")
    assert licence == "Apache-2.0", dict(metadata)
    assert "LICENSE" in (metadata.get_all("License-File") or []), metadata.get_all("License-File")
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as handle:
        text = handle.read()
    assert "Apache License" in text and "Version 2.0" in text and "END OF TERMS AND CONDITIONS" in text


def test_package_is_typed():
    assert importlib.resources.files("mooncake_ep_switch").joinpath("py.typed").is_file()


def test_requirements_match_what_is_tested():
    requires = _metadata().get_all("Requires-Dist")
    plain = sorted(r for r in requires if "extra ==" not in r)
    assert plain == ["numpy>=2.0", "torch>=2.11"], plain
    extras = set(_metadata().get_all("Provides-Extra"))
    assert extras == {"test", "mooncake", "mooncake-cuda", "nccl", "plot", "models", "etcd"}
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    extras_paragraph = readme[readme.index("Extras ("):][:1500]
    for extra in extras:  # every extra is described where a user reads how to install
        assert f"`{extra}`" in extras_paragraph, extra
