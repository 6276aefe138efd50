"""`rlbus tasks build repo`: repository tasks made by mutating real packages' sources.

    rlbus tasks build repo --from-sdist inflection==0.5.1 toolz==1.0.0 [--out DIR] [--max-per-package N]

Per package (`NAME==VERSION`, or a local sdist / unpacked directory for offline builds):
1. fetch the sdist with `pip download --no-deps --no-binary :all:` (build time only: the
   network goes to the package index pip is configured with; nothing is fetched at run
   time), unpack it (tar `data` filter), keep its Python sources, tests, packaging
   metadata and licence files;
2. check the licence is permissive (MIT / BSD / Apache / ISC / PSF), else skip it;
3. run its suite once in the bubblewrap process sandbox (`producers.repo_pytest`): it
   must pass (no failure, no error), else the package is skipped with the failing ids;
4. mutate one source site at a time (`producers.repo_mutate`: flip a comparison,
   off-by-one, drop a branch, swap arguments), run the suite, keep the mutant only if
   between 1 and `max_targets` tests fail, none errors at collection, it does not time
   out, and its failing set is new for the package.

A kept mutant becomes a `RepoTask`:
- `target_tests`: the failing node ids; `regression_tests`: every other passing one;
- `hidden_files`: the test files holding a target test (the verifier copies them in);
  `files`: the mutated repository *without* those files, so the public tests the agent
  can run are the remaining test files (a single-test-file package has none);
- `issue`: the symptom, from the sandboxed pytest result: the failing call (the test's
  line) and its error message, never the edit;
- `gold_patch`: the unified diff mutant → original (a/ b/ prefixes), checked to apply;
- `source`: `sdist:NAME==VERSION`; the licence goes into the cache index (`packages`).

Guarantees: deterministic for a given sdist, seed and limits (site order is a seeded
shuffle); every run is time-capped (`--timeout` per suite run; mutants get the smaller
of that and 5x the baseline + 10 s); tests never run outside the sandbox unless
`--allow-degraded-sandbox` is given (then they run with rlimits only, loudly logged).
"""

from __future__ import annotations

import email.parser
import hashlib
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from producers import repo_cache
from producers.repo_mutate import Site, apply_site, apply_unified_diff, find_sites, unified_diff
from producers.repo_pytest import SandboxedSuite
from schemas.repo_task import RepoTask

PERMISSIVE = (
    (r"\bmit\b", "MIT"),
    (r"\bbsd\b", "BSD"),
    (r"\bapache\b", "Apache-2.0"),
    (r"\bisc\b", "ISC"),
    (r"python software foundation", "PSF"),
)
KEEP_NAMES = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|AUTHORS|README)", re.I)
KEEP_SUFFIXES = (".py", ".cfg", ".toml", ".ini")
SKIP_PARTS = {"docs", "doc", "examples", "benchmarks", "__pycache__", ".github"}
NOT_MUTATED = {"setup.py", "conftest.py", "versioneer.py", "_version.py", "__main__.py"}
MAX_FILE_BYTES = 300_000


class PackageSkipped(Exception):
    """The package cannot give tasks; the message says why."""


@dataclass
class BuildLimits:
    """How much work one package may take."""

    max_per_package: int = 10
    max_tries: int = 80
    max_targets: int = 20
    timeout: float = 120.0
    seed: int = 0
    allow_degraded: bool = False


@dataclass
class PackageReport:
    """What building one package did."""

    spec: str
    licence: str = ""
    tasks: list[str] = field(default_factory=list)
    tried: int = 0
    survived: int = 0
    rejected: int = 0
    skipped: str = ""
    seconds: float = 0.0
    sdist_sha256: str = ""


def fetch(spec: str, dest: Path) -> Path:
    """A local sdist/dir as is, else `pip download --no-deps --no-binary :all: spec` into `dest`."""
    if Path(spec).exists():
        return Path(spec)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise PackageSkipped(f"pip download failed: {proc.stderr.strip()[-500:]}")
    found = sorted(p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".zip", ".tgz")))
    if not found:
        raise PackageSkipped("pip download gave no sdist")
    return found[-1]


def unpack(archive: Path, dest: Path) -> Path:
    """The root directory of the unpacked sdist (a directory is returned as is)."""
    if archive.is_dir():
        return archive
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else dest


def select_files(root: Path) -> dict[str, str]:
    """The repository a task carries: sources, tests, packaging metadata, licence and readme."""
    files: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if not path.is_file() or any(
            p in SKIP_PARTS or p.startswith(".") or p.endswith(".egg-info") for p in rel.parts[:-1]
        ):
            continue
        if not (rel.suffix in KEEP_SUFFIXES or KEEP_NAMES.match(rel.name)) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            files[str(rel)] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return files


def licence_of(root: Path) -> str:
    """The package's permissive licence ("MIT", "BSD", ...) from PKG-INFO, else from its licence
    file's first lines; PackageSkipped when none is found."""
    info = root / "PKG-INFO"
    fields: list[str] = []
    if info.exists():
        meta = email.parser.Parser().parsestr(info.read_text(errors="replace"))
        fields = [meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
        fields += [c for c in (meta.get_all("Classifier") or []) if c.startswith("License")]
    lic_files = [p for p in sorted(root.iterdir()) if p.is_file() and p.name.upper().startswith(("LICEN", "COPYING"))]
    texts = [" ".join(fields).lower(), *(p.read_text(errors="replace")[:600].lower() for p in lic_files)]
    for text in texts:
        for pattern, name in PERMISSIVE:
            if re.search(pattern, text):
                return name
    raise PackageSkipped(f"no permissive licence found (PKG-INFO: {fields[:2]!r})")


def is_test_file(path: str) -> bool:
    """A pytest test module by name (`test_*.py`, `*_test.py`)."""
    name = PurePosixPath(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def mutable_sources(files: dict[str, str]) -> list[str]:
    """Source modules mutants are made in: not tests, not packaging or test-config code."""
    return sorted(
        p
        for p in files
        if p.endswith(".py")
        and not is_test_file(p)
        and PurePosixPath(p).name not in NOT_MUTATED
        and not any(part in ("tests", "test", "testing") for part in PurePosixPath(p).parts[:-1])
    )


def ordered_sites(files: dict[str, str], sources: list[str], seed: int, spec: str) -> list[tuple[str, Site]]:
    """Every (path, site), shuffled by seed, then interleaved by operator for variety."""
    rng = random.Random(f"{spec}/{seed}")
    by_op: dict[str, list[tuple[str, Site]]] = {}
    for path in sources:
        for site in find_sites(files[path]):
            by_op.setdefault(site.op, []).append((path, site))
    for sites in by_op.values():
        rng.shuffle(sites)
    ops = sorted(by_op)
    out: list[tuple[str, Site]] = []
    while any(by_op.values()):
        for op in ops:
            if by_op[op]:
                out.append(by_op[op].pop())
    return out


def _params(nodeid: str) -> str:
    m = re.search(r"\[(.*)\]$", nodeid)
    return m.group(1) if m else ""


def _message(result: dict, max_lines: int = 8) -> list[str]:
    text = re.sub(r"\b0x[0-9a-f]{6,}\b", "0x...", result.get("message") or "")  # reproducible text
    lines = [ln if len(ln) <= 300 else ln[:300] + " ..." for ln in text.splitlines()]
    return [ln for ln in lines if "Use -v to get" not in ln][:max_lines]


def issue_text(name: str, version: str, failing: dict[str, dict]) -> str:
    """The issue a user would file: the failing call(s) and their error, never the edit."""
    ids = sorted(failing)
    first = failing[ids[0]]
    context = first.get("context") or first.get("call") or ids[0].split("::")[-1]
    context_lines = [ln for ln in context.splitlines() if ln.strip(" ^~")]  # no 3.11 caret lines
    lines = [
        f"Regression in {name} {version}",
        "",
        "This check, which used to pass, now fails:",
        "",
        *[f"    {ln}" for ln in context_lines],
        "",
    ]
    if _params(ids[0]):
        lines += [f"(with the test parameters `{_params(ids[0])}`)", ""]
    lines += ["It fails with:", "", *[f"    {ln}" for ln in _message(first)], ""]
    others: dict[str, dict] = {}
    for i in ids[1:]:
        call = failing[i].get("call")
        if call and call != first.get("call") and call not in others and len(others) < 2:
            others[call] = failing[i]
    for other in others.values():
        lines += ["Also failing:", "", f"    {other['call']}", f"    -> {(_message(other, 1) or [''])[0][:300]}", ""]
    if len(ids) > 1:
        lines.append(f"{len(ids)} checks fail in total.")
    lines.append("Please fix the library so these calls behave as documented again.")
    return "\n".join(lines) + "\n"


def make_task(
    spec: str,
    files: dict[str, str],
    path: str,
    site: Site,
    mutant: str,
    baseline_pass: list[str],
    failing: dict[str, dict],
) -> RepoTask:
    """The `RepoTask` of one kept mutant (see the module docstring)."""
    name, _, version = spec.partition("==")
    targets = sorted(failing)
    hidden_paths = sorted({t.split("::", 1)[0] for t in targets})
    public = {p: t for p, t in files.items() if p not in hidden_paths}
    public[path] = mutant
    gold = unified_diff({path: mutant}, {path: files[path]})
    if apply_unified_diff(public, gold)[path] != files[path]:
        raise AssertionError(f"gold patch does not restore {path}")
    key = f"{spec}|{path}|{site.op}|{site.lineno}:{site.col}-{site.end_lineno}:{site.end_col}|{site.extra}"
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower())
    return RepoTask(
        task_id=f"{slug}-{version or 'local'}-m{hashlib.sha256(key.encode()).hexdigest()[:8]}",
        source=f"sdist:{spec}",
        issue=issue_text(name, version, failing),
        files=public,
        hidden_files={p: files[p] for p in hidden_paths},
        target_tests=targets,
        regression_tests=[t for t in baseline_pass if t not in failing],
        deps=[],
        gold_patch=gold,
    )


def _baseline(suite: SandboxedSuite, tests: list[str], limits: BuildLimits) -> list[str]:
    run = suite.run(tests, timeout=limits.timeout)
    if run.timed_out:
        raise PackageSkipped(f"its test suite timed out after {limits.timeout:.0f} s")
    if run.failing() or not run.passing():
        raise PackageSkipped(
            f"its test suite does not pass here: {run.failing()[:5] or 'no test passed'} {run.log_tail[-300:]!r}"
        )
    return run.passing()


def _try_mutants(spec, files, suite, tests, passing, limits, report, per_run) -> list[RepoTask]:
    tasks: list[RepoTask] = []
    seen: set[tuple[str, ...]] = set()
    for path, site in ordered_sites(files, mutable_sources(files), limits.seed, spec):
        if len(tasks) >= limits.max_per_package or report.tried >= limits.max_tries:
            break
        try:
            mutant = apply_site(files[path], site)
        except ValueError:
            continue
        report.tried += 1
        suite.write({path: mutant})
        try:
            run = suite.run(tests, timeout=per_run)
        finally:
            suite.write({path: files[path]})
        failing = {n: r for n, r in run.results.items() if r["outcome"] in ("failed", "error")}
        if not failing and not run.timed_out:
            report.survived += 1
            continue
        key = tuple(sorted(failing))
        if (
            run.timed_out
            or len(failing) > limits.max_targets
            or key in seen
            or any("::" not in n or n not in passing for n in failing)
        ):
            report.rejected += 1
            continue
        seen.add(key)
        tasks.append(make_task(spec, files, path, site, mutant, passing, failing))
    return tasks


def build_package(spec: str, work: Path, limits: BuildLimits) -> tuple[PackageReport, list[RepoTask]]:
    """Build the tasks of one package (see the module docstring); never raises PackageSkipped."""
    report = PackageReport(spec=spec)
    t0 = time.monotonic()
    try:
        archive = fetch(spec, work / "dl")
        if archive.is_file():
            report.sdist_sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
        root = unpack(archive, work / "src")
        report.licence = licence_of(root)
        if Path(spec).exists():
            spec = _local_spec(root)
            report.spec = spec
        files = select_files(root)
        tests = sorted(p for p in files if is_test_file(p))
        if not tests or not mutable_sources(files):
            raise PackageSkipped("the sdist has no test files or no source modules")
        with SandboxedSuite(files, timeout=limits.timeout, allow_degraded=limits.allow_degraded) as suite:
            if suite.isolation != "bwrap":
                print(f"WARNING: {spec}: tests run WITHOUT bubblewrap isolation ({suite.isolation})", file=sys.stderr)
            tb = time.monotonic()
            passing = _baseline(suite, tests, limits)
            per_run = min(limits.timeout, 5 * (time.monotonic() - tb) + 10)
            tasks = _try_mutants(spec, files, suite, tests, passing, limits, report, per_run)
    except PackageSkipped as exc:
        report.skipped = str(exc)
        tasks = []
    report.tasks = [t.task_id for t in tasks]
    report.seconds = round(time.monotonic() - t0, 1)
    return report, tasks


def _local_spec(root: Path) -> str:
    info = root / "PKG-INFO"
    if info.exists():
        meta = email.parser.Parser().parsestr(info.read_text(errors="replace"))
        if meta.get("Name") and meta.get("Version"):
            return f"{meta['Name']}=={meta['Version']}"
    return f"{root.name}==local"


def build(
    specs: list[str], out: Path | None, limits: BuildLimits, progress: Callable[[PackageReport], None] | None = None
) -> list[PackageReport]:
    """Build every package's tasks into the cache `out` (default: the default cache);
    `progress` is called with each package's report as soon as it is done."""
    reports = []
    for spec in specs:
        with tempfile.TemporaryDirectory(prefix="rlbus-repo-build-") as tmp:
            report, tasks = build_package(spec, Path(tmp), limits)
        for task in tasks:
            repo_cache.save_task(task, out)
        if tasks:
            repo_cache.record_package(
                report.spec,
                {
                    "licence": report.licence,
                    "tasks": len(tasks),
                    "sdist_sha256": report.sdist_sha256,
                    "tried": report.tried,
                },
                out,
            )
        reports.append(report)
        if progress is not None:
            progress(report)
    return reports
