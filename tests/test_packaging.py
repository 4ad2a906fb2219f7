"""The wheel installs one top-level package, ``rankwatch``, with every stage inside it."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_source_package_is_listed():
    setuptools = _pyproject()["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    on_disk = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            on_disk.add(".".join((name, *parts)))
    assert set(setuptools["packages"]) == on_disk


def test_wheel_holds_only_rankwatch(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("rankwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"rankwatch", wheel.name.split("-")[0] + "-"
                                                      + wheel.name.split("-")[1] + ".dist-info"}
    for expected in ("rankwatch/producers/publisher.py", "rankwatch/stream_processors/rules.default.toml",
                     "rankwatch/sinks/webhook.py", "rankwatch/contract/telemetry.py"):
        assert expected in names
