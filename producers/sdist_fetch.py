"""Fetch a package's sdist from the package index WITHOUT building it (issue 27).

`pip download --no-binary :all:` runs the package's build backend (setup.py egg_info,
`prepare_metadata_for_build_wheel`) on the host, as the operator, outside any sandbox:
arbitrary code from the index. `rlbus tasks build repo --from-sdist` needs none of it:
`producers.repo_build` only unpacks the archive (tar `data` filter) and reads its files;
the package's test suite then runs inside bubblewrap (`SandboxedSuite`). So no build step
runs at all: this module only downloads the file.

Guarantees of `fetch_sdist(spec, dest)`:
- The index is pip's own configuration: `index-url` and `extra-index-url` from
  `pip config list` (files and PIP_* environment variables), else pip's built-in default
  index; tried in that order. No index host is named here.
- The project page is read through the simple API (PEP 691 JSON, else PEP 503 HTML with
  `#sha256=` fragments); the file is the sdist (`.tar.gz` / `.zip`) of exactly NAME and
  VERSION. A file the index gives no sha256 for is refused (fail closed).
- The downloaded bytes' sha256 must equal the index's; otherwise nothing is written and
  `SdistFetchError` names both digests. The result records the verified digest and URL.
- Nothing of the package is imported, executed or unpacked here.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
SDIST_EXT = (".tar.gz", ".zip")
TIMEOUT_S = 60.0


class SdistFetchError(RuntimeError):
    """The sdist could not be found, fetched or verified; the message says which and why."""


@dataclass(frozen=True)
class FetchedSdist:
    """A downloaded sdist whose sha256 matched the index's."""

    path: Path
    sha256: str
    url: str


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def index_urls() -> list[str]:
    """pip's index URLs: `index-url` (else pip's default), then every `extra-index-url`."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    main, extra = None, []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url") and value:
            main = value.split()[0] if key.startswith(":env:") or main is None else main
        elif key.endswith(".extra-index-url"):
            extra += [v for v in value.split() if v not in extra]
    if main is None:
        from pip._internal.models.index import PyPI  # pip's built-in default index

        main = PyPI.simple_url
    return [main] + [u for u in extra if u != main]


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _get(url: str, accept: str) -> tuple[bytes, str, str]:
    """(body, content type, final URL); a file:// directory reads its index.html."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = Path(unquote(parts.path))
        if path.is_dir():
            path = path / "index.html"
        try:
            return path.read_bytes(), "text/html", path.as_uri()
        except OSError as exc:
            raise FileNotFoundError(str(exc)) from exc
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:  # the operator's own pip index
        return r.read(), r.headers.get("Content-Type", ""), r.geturl()


def project_files(index: str, name: str) -> list[tuple[str, str, str | None]]:
    """(filename, absolute URL, sha256 or None) of every file on the project's page."""
    page = index.rstrip("/") + f"/{normalize(name)}/"
    body, ctype, base = _get(page, f"{JSON_TYPE}, text/html;q=0.1")
    if JSON_TYPE in ctype:
        data = json.loads(body)
        return [
            (f["filename"], urljoin(base, f["url"]), (f.get("hashes") or {}).get("sha256"))
            for f in data.get("files", [])
        ]
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    out = []
    for href in parser.links:
        url, _, frag = href.partition("#")
        sha = frag[len("sha256=") :] if frag.startswith("sha256=") else None
        out.append((unquote(url.rsplit("/", 1)[-1]), urljoin(base, url), sha))
    return out


def _is_sdist_of(filename: str, name: str, version: str) -> bool:
    for ext in SDIST_EXT:
        if filename.endswith(ext):
            stem_name, _, stem_version = filename[: -len(ext)].rpartition("-")
            return normalize(stem_name) == normalize(name) and stem_version == version
    return False


def find_sdist(spec: str) -> tuple[str, str, str]:
    """(filename, URL, sha256) of `NAME==VERSION`'s sdist on the first index that has it."""
    name, sep, version = spec.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise SdistFetchError(f"{spec!r}: give NAME==VERSION (an exact version), or a local sdist / directory")
    name, version = name.strip(), version.strip()
    tried = []
    for index in index_urls():
        try:
            files = project_files(index, name)
        except (OSError, ValueError) as exc:  # 404, unreachable, bad JSON: the next index
            tried.append(f"{urlsplit(index).scheme}://{urlsplit(index).netloc}{urlsplit(index).path}: {exc}")
            continue
        for filename, url, sha in files:
            if _is_sdist_of(filename, name, version):
                if not sha:
                    raise SdistFetchError(
                        f"{spec}: the index lists {filename} without a sha256; refusing an unverifiable download"
                    )
                return filename, url, sha.lower()
        tried.append(f"{index}: no sdist of {name} {version}")
    raise SdistFetchError(f"{spec}: no sdist found ({'; '.join(tried)[:800]})")


def fetch_sdist(spec: str, dest: Path) -> FetchedSdist:
    """Download `NAME==VERSION`'s sdist into `dest` and verify the index's sha256 (see module docstring)."""
    filename, url, want = find_sdist(spec)
    if "/" in filename or filename in ("", ".", ".."):
        raise SdistFetchError(f"{spec}: the index gave an unsafe file name {filename!r}")
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / filename
    body = _get(url, "*/*")[0]
    got = hashlib.sha256(body).hexdigest()
    if got != want:
        raise SdistFetchError(f"{spec}: {filename} has sha256 {got}, the index says {want}; not used")
    path.write_bytes(body)
    return FetchedSdist(path, got, url.split("#", 1)[0])
