"""The whole suite (tests and doctests) runs in one temp dir of its own, removed at the end.

Publishers spool under the temp dir, and a test that checks an undeliverable spool leaves one.
"""

import os
import shutil
import tempfile

import pytest

_TMP = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="rankwatch-tests-")
tempfile.tempdir = None


@pytest.fixture(scope="session", autouse=True)
def _remove_temp_dir():
    yield
    shutil.rmtree(_TMP, ignore_errors=True)
