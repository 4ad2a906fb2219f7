"""The wheel installs one top-level package, ``rankwatch``, with every stage inside it."""

import os
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
    # setuptools builds under ./build by default: keep the checkout clean.
    config = tmp_path / "setup.cfg"
    config.write_text(f"[build]\nbuild_base = {tmp_path / 'build'}\n[egg_info]\negg_base = {tmp_path}\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path,
                   env={**os.environ, "DIST_EXTRA_CONFIG": str(config)})
    (wheel,) = tmp_path.glob("rankwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"rankwatch"}
    for expected in ("rankwatch/producers/publisher.py", "rankwatch/stream_processors/rules.default.toml",
                     "rankwatch/sinks/webhook.py", "rankwatch/contract/telemetry.py"):
        assert expected in names
