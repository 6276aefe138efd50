"""The `code` verifier: a candidate program against hidden unit tests, in a fresh sandbox.

`verify_code(traj, hidden)` scores `traj.final_text` against the task's hidden payload
`{"test": <check code>, "entry_point": <name>, "prompt": <the public prompt>}` (HumanEval
format: the test code defines `check(candidate)`).

Which code is the candidate (`candidate_program`):
1. From the final text, the last fenced code block (```python ... ```, an unclosed fence
   runs to the end) that defines the entry point, else the last fenced block, else the
   whole text.
2. If that code defines `def <entry_point>` at top level, it is the program, with the
   prompt's top-level import lines prepended (so `List[int]` annotations resolve when the
   model left out `from typing import List`).
3. Else, if the policy wrote only the body: prompt + code (or prompt + the code indented
   by four spaces when it starts at column 0), if that compiles and defines the entry point.
4. Else the code as written (it then fails to compile, or fails for lack of the function).

Order of verification (guaranteed): a FRESH sandbox is opened for every call (never the
policy's own); `candidate.py` is written first and holds only the candidate program;
then the tests, the job file (with a random per-call nonce) and the harness are
uploaded; then `python3 -I -S harness.py` runs. See `verifier_workers.harness` for the
two-process design and the threat model: the candidate runs in a process that never
holds the nonce or the tests, and only returns plain values to a supervisor that runs
the assertions and prints `RLBUS-PASS HMAC(nonce, tests sha256, candidate sha256)`
after every assertion passed.

Scoring:
- `correct` = 1.0 iff the harness reported a pass AND the proof line matches the HMAC
  computed here; the exit code counts for nothing. The scalar is `correct` (1.0 or 0.0)
  unless the task's `reward_weights` say otherwise.
- `compiles` = 1.0 iff the candidate program is non-empty and compiles.
- `pass_rate` = passed / executed assertions (every `assert` is counted, in loops each
  iteration; a failure does not stop later assertions).
- Status `ok` for a pass or an ordinary failure; `tamper` (reward 0) when the harness
  flags a tamper attempt, when a proof line is present but wrong, when either test hash
  the harness reports differs from the uploaded bytes' sha256 (`tests_sha256_before`: the
  bytes it ran, read before the candidate existed; `tests_sha256_after`: the uploaded file
  re-read by the supervisor, through the descriptor it opened before the candidate
  existed, once the candidate's process is dead), or when a file is at tests.py after the
  run (checked by the supervisor, and again once the harness has exited); `timeout` (reward 0,
  a verdict on the candidate: it is not retried) when the candidate exceeds
  `timeout_s` (task `verifier_params.timeout_s`, default 10 s, at most 60 s).
- `SandboxInfraError` is raised (never a reward of 0) when the sandbox cannot be opened
  (a process sandbox that refuses to run without bubblewrap included: `SandboxRefused`), written or run, or the harness never started / crashed / could not make its supervisor
  non-dumpable: the verifier worker retries it with backoff and dead-letters it in the end.
- Missing hidden tests or entry point: `VerifierInputError` (dead-lettered).

Backend: `backend=` argument, else env `RLBUS_CODE_SANDBOX` (`process`, `docker`,
`auto`; default `auto` = docker when `sandbox_workers.docker_oneshot` exists and an engine
answers, else process). `RLBUS_SANDBOX_IMAGE` names the docker image. Thread-safe.
With docker, a check is one request to the resident agent of a warm container
(`sandbox_workers.docker_agent`: the container is proven clean after every run, no
docker API call per check); `RLBUS_DOCKER_AGENT=0` falls back to the exec path
(`DockerSandbox`: write + run execs, then a clean-up exec).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import hmac
import importlib.util
import marshal
import os
import re
import secrets
import textwrap
import time
from typing import Any

from schemas import Trajectory
from verifier_workers.errors import VerifierInfraError
from verifier_workers.harness_programs import code_harness
from verifier_workers.verdict import Verdict, VerifierInputError

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 60.0
DEFAULT_MEMORY_MB = 256
MAX_SOURCE_BYTES = 256 * 1024
START, RESULT, PASS = "RLBUS-HARNESS-START", "RLBUS-RESULT ", "RLBUS-PASS "
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PASS_LIKE = re.compile(
    r"(?im)^[\s\W]*(?:all\s+tests?\s+passed|tests?\s+passed|passed|pass|ok|success)\b"
    r"|RLBUS-|\bPASSED\b"
)
"""Lines in the candidate's own output that imitate a test runner's success report."""


class SandboxInfraError(VerifierInfraError):
    """The sandbox (not the candidate) failed: the worker naks with backoff, then dead-letters; never a 0."""


# ---------------------------------------------------------------- candidate extraction
def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def compiles(code: str) -> bool:
    """True iff `code` is non-blank and compiles (compile only, nothing runs)."""
    if not code.strip() or len(code.encode()) > MAX_SOURCE_BYTES:
        return False
    try:
        compile(code, "candidate.py", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a model answer: the last fenced block defining entry_point, else the last block, else all."""
    blocks = [m.group(2) for m in FENCE.finditer(text or "")]
    if not blocks:
        return (text or "").strip("\n")
    if entry_point:
        for block in reversed(blocks):
            if _defines(block, entry_point):
                return block
    return blocks[-1]


def _prompt_imports(prompt: str) -> str:
    lines = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
    return "\n".join(lines) + "\n" if lines else ""


def candidate_program(text: str, entry_point: str, prompt: str = "") -> tuple[str, str]:
    """(program, how) per the rule in the module docstring; how is `full`, `body` or `as_is`."""
    code = extract_code(text, entry_point)
    if _defines(code, entry_point):
        imports = _prompt_imports(prompt)
        return (imports + code if imports and compiles(imports + code) else code), "full"
    if prompt and code.strip():
        base = prompt if prompt.endswith("\n") else prompt + "\n"
        first = next((ln for ln in code.splitlines() if ln.strip()), "")
        tries = [code] if first[:1] in (" ", "\t") else [textwrap.indent(code, "    "), code]
        for body in tries:
            if compiles(base + body) and _defines(base + body, entry_point):
                return base + body, "body"
    return code, "as_is"


class _CountAsserts(ast.NodeTransformer):
    """`assert X, M` -> `__rlbus_assert__(lambda: X, line)` (the harness counts; a failure does not abort)."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        no_args = ast.arguments(
            posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
        )
        call = ast.Call(
            func=ast.Name("__rlbus_assert__", ast.Load()),
            args=[ast.Lambda(no_args, node.test), ast.Constant(node.lineno)],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), node)


@functools.lru_cache(maxsize=1024)
def counted_tests(tests: str) -> str:
    """The test code with every assertion counted (unchanged if it does not parse here)."""
    try:
        return ast.unparse(ast.fix_missing_locations(_CountAsserts().visit(ast.parse(tests))))
    except (SyntaxError, ValueError, RecursionError):
        return tests


# ---------------------------------------------------------------- sandbox
@functools.lru_cache(maxsize=1)
def _docker_ready() -> bool:
    if importlib.util.find_spec("sandbox_workers.docker_oneshot") is None:
        return False
    from sandbox_workers.factory import docker_available

    return docker_available()


def resolve_backend(backend: str | None = None) -> str:
    """`process` or `docker` (see the module docstring)."""
    name = backend or os.environ.get("RLBUS_CODE_SANDBOX", "auto")
    if name == "auto":
        return "docker" if _docker_ready() else "process"
    if name not in ("process", "docker"):
        raise ValueError(f"unknown sandbox backend {name!r}; use process, docker or auto")
    return name


REAPPEARED = "RLBUS-TESTS-REAPPEARED"


def _run_in_sandbox(backend: str, files: list[tuple[str, bytes]], timeout_s: float, memory_mb: int):
    """Run the harness after `files` (written in order) in a fresh sandbox; (ExecResult, test file there after?)."""
    from sandbox_workers.base import Limits

    limits = Limits(memory_mb=memory_mb, cpu_seconds=int(timeout_s) + 2, pids=32)
    image = os.environ.get("RLBUS_SANDBOX_IMAGE") or None
    if backend == "docker" and os.environ.get("RLBUS_DOCKER_AGENT", "1") != "0":
        return _run_in_agent(files, timeout_s, limits, image)
    from sandbox_workers.factory import open_sandbox

    try:
        sb = open_sandbox(backend, image=image, limits=limits, timeout=timeout_s + 5)
    except Exception as exc:
        raise SandboxInfraError(f"cannot open a {backend} sandbox: {type(exc).__name__}: {exc}") from exc
    try:
        try:
            sb.write_files(files)  # in order, one round trip where the backend can
            # the harness, then (same exec) whether a test file exists again afterwards
            res = sb.execute(
                [
                    "/bin/sh",
                    "-c",
                    f"python3 -I -S harness.py; rc=$?; [ -e tests.py ] && echo {REAPPEARED} >&2; exit $rc",
                ],
                timeout=timeout_s + 5,
            )
        except Exception as exc:
            raise SandboxInfraError(f"{backend} sandbox failed: {type(exc).__name__}: {exc}") from exc
        return res, REAPPEARED in (res.stderr or "")
    finally:
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - the verdict is already known
            pass


def _run_in_agent(files: list[tuple[str, bytes]], timeout_s: float, limits, image: str | None):
    """docker: one request to the resident agent of a clean warm container (no docker API call):
    `python3 -I -S harness.py` in its pre-imported interpreter, then whether tests.py exists
    once every process of the run is dead (see `sandbox_workers.docker_agent`)."""
    from sandbox_workers.docker_oneshot import run_isolated

    try:
        run = run_isolated(
            files, python="harness.py", timeout=timeout_s + 5, limits=limits, image=image, report=("tests.py",)
        )
    except Exception as exc:
        raise SandboxInfraError(f"docker sandbox failed: {type(exc).__name__}: {exc}") from exc
    return run.result, "tests.py" in run.exists


# ---------------------------------------------------------------- verification
def _params(traj: Trajectory, hidden: dict | None) -> tuple[str, str, str, float, int]:
    if not hidden or not isinstance(hidden.get("test"), str):
        raise VerifierInputError("code task without hidden tests (hidden payload needs 'test')")
    entry = hidden.get("entry_point") or traj.verifier_params.get("entry_point")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise VerifierInputError(f"code task without a valid entry_point: {entry!r}")
    vp = traj.verifier_params
    try:
        timeout_s = min(float(vp.get("timeout_s", DEFAULT_TIMEOUT_S)), MAX_TIMEOUT_S)
        memory_mb = int(vp.get("memory_mb", DEFAULT_MEMORY_MB))
    except (TypeError, ValueError) as exc:
        raise VerifierInputError(f"bad timeout_s/memory_mb: {exc}") from None
    return hidden["test"], entry, str(hidden.get("prompt") or ""), timeout_s, memory_mb


def verify_code(traj: Trajectory, hidden: dict | None = None, *, backend: str | None = None) -> Verdict:
    """Score the trajectory's final code against the hidden tests (see the module docstring)."""
    tests, entry, prompt, timeout_s, memory_mb = _params(traj, hidden)
    program, how = candidate_program(traj.final_text, entry, prompt)
    weights = dict(traj.reward_weights) or {"correct": 1.0}
    return check_program(
        program,
        tests,
        entry,
        prompt=prompt,
        backend=backend,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        how=how,
        weights=weights,
    )


def check_program(
    program: str,
    tests: str,
    entry_point: str,
    *,
    prompt: str = "",
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    how: str = "full",
    weights: dict[str, float] | None = None,
) -> Verdict:
    """Run `program` against `tests` in a fresh sandbox; raises SandboxInfraError on sandbox failure."""
    weights = weights or {"correct": 1.0}
    if not compiles(program):
        why = "empty candidate" if not program.strip() else "candidate does not compile"
        return Verdict({"correct": 0.0, "compiles": 0.0, "pass_rate": 0.0}, details=f"{why} ({how})", weights=weights)
    name = resolve_backend(backend)
    nonce = secrets.token_hex(32)
    cand, test_bytes = program.encode(), counted_tests(tests).encode()
    tests_sha, cand_sha = hashlib.sha256(test_bytes).hexdigest(), hashlib.sha256(cand).hexdigest()
    job = marshal.dumps(
        {"nonce": nonce, "entry_point": entry_point, "prompt": prompt, "timeout_s": float(timeout_s)}, 4
    )
    files = [("candidate.py", cand), ("tests.py", test_bytes), ("job.marshal", job), ("harness.py", code_harness())]
    t0 = time.perf_counter()
    res, reappeared = _run_in_sandbox(name, files, timeout_s, memory_mb)
    took = time.perf_counter() - t0
    verdict = _judge(res, nonce, tests_sha, cand_sha, reappeared)
    verdict.weights, verdict.sandbox_s = weights, took
    verdict.details = (
        f"{verdict.details} [{how}; backend={name}/{res.isolation}; {took * 1000:.0f} ms]{_tail(res.stderr)}"
    )
    return verdict


def _tail(stderr: str, n: int = 600) -> str:
    s = stderr.strip()
    return f"\ncandidate output: {s[-n:]}" if s else ""


def _judge(res, nonce: str, tests_sha: str, cand_sha: str, reappeared: bool) -> Verdict:
    lines = res.stdout.splitlines()
    if START not in lines:
        raise SandboxInfraError(
            f"harness did not start (exit {res.exit_code}, timed_out={res.timed_out}): {res.stderr.strip()[-400:]}"
        )
    report: dict[str, Any] | None = None
    for ln in lines:
        if ln.startswith(RESULT):
            try:
                report = ast.literal_eval(ln[len(RESULT) :])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                report = None
            report = report if isinstance(report, dict) else None
    proofs = [ln[len(PASS) :].strip() for ln in lines if ln.startswith(PASS)]
    zero = {"correct": 0.0, "compiles": 1.0, "pass_rate": 0.0}
    if report is None:
        if res.timed_out:
            return Verdict(zero, status="timeout", details="the harness ran past the sandbox deadline")
        if res.oom or res.exit_code in (137, 9):
            return Verdict(zero, details=f"harness killed (oom={res.oom}, exit {res.exit_code})")
        raise SandboxInfraError(f"harness crashed (exit {res.exit_code}): {res.stderr.strip()[-400:]}")
    if report.get("nondumpable") is not True:  # else /proc/<pid>/mem would hold the nonce for the taking
        raise SandboxInfraError("the harness could not make its supervisor non-dumpable (no prctl via ctypes?)")
    total = int(report.get("passed", 0)) + int(report.get("failed", 0))
    pass_rate = int(report.get("passed", 0)) / total if total else 0.0
    comps = {"correct": 0.0, "compiles": 1.0, "pass_rate": pass_rate}
    summary = f"{report.get('result')}: {report.get('passed', 0)}/{total} assertions; {report.get('detail', '')}"
    expected = hmac.new(nonce.encode(), f"pass:{tests_sha}:{cand_sha}".encode(), hashlib.sha256).hexdigest()
    hashes = (report.get("tests_sha256_before"), report.get("tests_sha256_after"))
    if report.get("result") == "tamper":
        return Verdict(comps, status="tamper", details=summary)
    if hashes != (tests_sha, tests_sha):
        return Verdict(comps, status="tamper", details=f"test file hash changed: {hashes} != {tests_sha}")
    if reappeared:
        return Verdict(comps, status="tamper", details="the candidate wrote tests.py")
    if any(not hmac.compare_digest(p, expected) for p in proofs):
        return Verdict(comps, status="tamper", details="a pass line with a wrong proof")
    marker = PASS_LIKE.search(res.stderr)
    if marker:
        return Verdict(
            comps, status="tamper", details=f"the candidate printed a pass-like line: {marker.group(0)[:80]!r}"
        )
    if report.get("result") == "timeout":
        return Verdict(comps, status="timeout", details=summary)
    if report.get("result") == "pass":
        if proofs:
            return Verdict({**comps, "correct": 1.0}, details=summary)
        return Verdict(comps, status="tamper", details="reported a pass without the proof")
    return Verdict(comps, details=summary)
