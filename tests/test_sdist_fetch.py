"""`--from-sdist` downloads sdists without building them (issue 27).

Before, `pip download --no-deps --no-binary :all:` ran the package's setup.py on the host
(as the operator, outside any sandbox) and pinned no hash. Here: a real sdist from the index
pip is configured with, its sha256 checked against the index; a planted package whose
setup.py writes a marker file is fetched (and run through `rlbus tasks build repo`) and the
marker never appears; a wrong index hash is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from producers.sdist_fetch import SdistFetchError, fetch_sdist, index_urls

ROOT = Path(__file__).resolve().parents[1]


def test_a_real_sdist_from_the_configured_index_is_verified(tmp_path):
    got = fetch_sdist("inflection==0.5.1", tmp_path)
    assert got.path.name == "inflection-0.5.1.tar.gz" and got.path.parent == tmp_path
    assert hashlib.sha256(got.path.read_bytes()).hexdigest() == got.sha256
    assert index_urls()[0].rstrip("/") in got.url or got.url.startswith(("http", "file"))
    with tarfile.open(got.path) as t:
        assert any(n.endswith("PKG-INFO") for n in t.getnames())


def _evil_index(tmp_path: Path, marker: Path, wrong_hash: bool = False) -> str:
    """A PEP 503 file index holding evilpkg 1.0, whose setup.py writes `marker` when run."""
    setup = (
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('setup.py ran')\n"
        "from setuptools import setup\nsetup(name='evilpkg', version='1.0', py_modules=['evilpkg'])\n"
    )
    files = {
        "evilpkg-1.0/setup.py": setup,
        "evilpkg-1.0/evilpkg.py": "def f(x):\n    return x + 1\n",
        "evilpkg-1.0/test_evilpkg.py": "from evilpkg import f\n\ndef test_f():\n    assert f(1) == 2\n",
        "evilpkg-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: evilpkg\nVersion: 1.0\nLicense: MIT\n",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "evilpkg-1.0.tar.gz").write_bytes(buf.getvalue())
    sha = "0" * 64 if wrong_hash else hashlib.sha256(buf.getvalue()).hexdigest()
    page = tmp_path / "simple" / "evilpkg"
    page.mkdir(parents=True)
    (page / "index.html").write_text(f'<a href="../../files/evilpkg-1.0.tar.gz#sha256={sha}">evilpkg-1.0.tar.gz</a>')
    return (tmp_path / "simple").as_uri()


def test_a_planted_setup_py_never_runs_on_the_host(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    index = _evil_index(tmp_path, marker)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    assert index_urls()[0] == index
    got = fetch_sdist("evilpkg==1.0", tmp_path / "dl")
    assert got.path.is_file() and not marker.exists()
    # the whole command: fetch, unpack, run the suite in bubblewrap, mutate; setup.py is never run here
    # (in the sandbox a write to the marker's host path could not land either: only /work is writable)
    env = dict(os.environ, PIP_INDEX_URL=index)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "tasks",
            "build",
            "repo",
            "--from-sdist",
            "evilpkg==1.0",
            "--out",
            str(tmp_path / "cache"),
            "--max-per-package",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "fetched evilpkg-1.0.tar.gz sha256" in r.stdout, r.stdout + r.stderr
    assert not marker.exists(), "the package's setup.py ran on the host"


def test_a_wrong_index_hash_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", _evil_index(tmp_path, tmp_path / "MARKER", wrong_hash=True))
    with pytest.raises(SdistFetchError, match="the index says 0000"):
        fetch_sdist("evilpkg==1.0", tmp_path / "dl")
    assert not (tmp_path / "dl" / "evilpkg-1.0.tar.gz").exists()


def test_a_missing_version_says_what_to_give(tmp_path):
    with pytest.raises(SdistFetchError, match="NAME==VERSION"):
        fetch_sdist("inflection", tmp_path)
