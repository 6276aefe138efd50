"""The `code` verifier's disk checks, in real process (bwrap) sandboxes: no mocks.

A candidate that puts a file at tests.py through a call the harness's audit hook never
sees is labelled tamper; a test file whose bytes change on disk while the candidate runs
(a write channel the hook cannot see, played here by the test process through a hard
link) is caught by the supervisor's re-hash and labelled tamper, with no proof; an honest
candidate in the same setup passes with both hashes equal. A harness whose supervisor is
not non-dumpable is an infrastructure failure, never a verdict.
"""

from __future__ import annotations

import ast
import hashlib
import marshal
import os
import secrets
import threading
import time
from pathlib import Path

import pytest
from test_code_verifier import ADD, GOOD_ADD, score

from sandbox_workers.base import Limits
from sandbox_workers.factory import open_sandbox
from verifier_workers.harness_programs import code_harness
from verifier_workers.verifiers.code import RESULT, SandboxInfraError, _judge, counted_tests

REWRITTEN = b"def check(candidate):\n    pass\n"
# the candidate returns only once the test file's bytes changed on disk (or after 5 s)
WAITS_FOR_THE_REWRITE = f"""
import time
_seen = []
def add(a, b):
    t0 = time.monotonic()
    while not _seen and time.monotonic() - t0 < 5:
        with open(".keep", "rb") as f:
            if f.read().startswith({REWRITTEN!r}):
                _seen.append(1)
        time.sleep(0.01)
    return a + b
"""


@pytest.mark.parametrize("how", ["mknod", "mkfifo"])
def test_a_file_put_at_tests_py_unseen_by_the_audit_hook_is_tamper(how):
    """os.mknod / os.mkfifo raise no audit event: only the check of the sandbox's files after the run sees them."""
    v = score(
        f"import os\ndef add(a, b):\n    if not os.path.exists('tests.py'):\n        os.{how}('tests.py')\n"
        "    return a + b\n"
    )
    assert (v.reward, v.status) == (0.0, "tamper"), v.details
    assert "backend=process/bwrap" in v.details and "wrote tests.py" in v.details, v.details


def _run_harness(program: str, rewrite: bool):
    """Run the harness as the verifier does, with a hard link `.keep` to the uploaded tests.py;
    with `rewrite`, the test process rewrites the file through it once the supervisor has read
    (and unlinked) tests.py. Returns (ExecResult, report, nonce, tests sha256, candidate sha256)."""
    nonce = secrets.token_hex(32)
    tests = counted_tests(ADD).encode()
    job = marshal.dumps({"nonce": nonce, "entry_point": "add", "prompt": "", "timeout_s": 10.0}, 4)
    sb = open_sandbox("process", limits=Limits(memory_mb=256, cpu_seconds=12, pids=32), timeout=15)
    try:
        assert sb.isolation == "bwrap"
        sb.write_files(
            [
                ("candidate.py", program.encode()),
                ("tests.py", tests),
                ("job.marshal", job),
                ("harness.py", code_harness()),
            ]
        )
        work = Path(sb.workdir)
        os.link(work / "tests.py", work / ".keep")

        def rewrite_once_read() -> None:
            t0 = time.monotonic()
            while (work / "tests.py").exists() and time.monotonic() - t0 < 5:
                time.sleep(0.005)
            with open(work / ".keep", "r+b") as f:  # same inode as the uploaded tests.py
                f.write(REWRITTEN)

        writer = threading.Thread(target=rewrite_once_read) if rewrite else None
        if writer:
            writer.start()
        res = sb.execute(["python3", "-I", "-S", "harness.py"], timeout=15)
        if writer:
            writer.join()
    finally:
        sb.close()
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(RESULT)]
    assert len(lines) == 1, res
    report = ast.literal_eval(lines[0][len(RESULT) :])
    return res, report, nonce, hashlib.sha256(tests).hexdigest(), hashlib.sha256(program.encode()).hexdigest()


def test_test_file_rewritten_on_disk_during_the_run_is_tamper():
    res, report, nonce, tests_sha, cand_sha = _run_harness(WAITS_FOR_THE_REWRITE, rewrite=True)
    assert report["tests_sha256_before"] == tests_sha, report
    assert (
        report["tests_sha256_after"]
        == hashlib.sha256(REWRITTEN + counted_tests(ADD).encode()[len(REWRITTEN) :]).hexdigest()
    ), report
    assert report["result"] == "tamper" and "changed on disk" in report["detail"], report
    assert "RLBUS-PASS " not in res.stdout  # every assertion passed, yet no proof
    v = _judge(res, nonce, tests_sha, cand_sha, False)
    assert (v.reward, v.status) == (0.0, "tamper"), v.details


def test_honest_candidate_in_the_same_setup_passes_with_equal_hashes():
    res, report, nonce, tests_sha, cand_sha = _run_harness(WAITS_FOR_THE_REWRITE.replace("< 5", "< 0"), rewrite=False)
    assert report["result"] == "pass" and report["passed"] == 3, report
    assert report["tests_sha256_before"] == report["tests_sha256_after"] == tests_sha, report
    v = _judge(res, nonce, tests_sha, cand_sha, False)
    assert (v.reward, v.status) == (1.0, "ok"), v.details


def test_honest_candidate_is_not_flagged_by_the_disk_checks():
    v = score(GOOD_ADD)
    assert (v.reward, v.status) == (1.0, "ok") and "backend=process/bwrap" in v.details, v.details


def test_a_dumpable_supervisor_is_an_infra_error_not_a_verdict():
    """The same honest run, its report saying the supervisor stayed dumpable (its memory, the nonce
    included, readable by the candidate's uid): the verifier refuses to judge it."""
    res, report, nonce, tests_sha, cand_sha = _run_harness(GOOD_ADD, rewrite=False)
    assert report["nondumpable"] is True and _judge(res, nonce, tests_sha, cand_sha, False).reward == 1.0
    res.stdout = res.stdout.replace("'nondumpable': True", "'nondumpable': False")
    with pytest.raises(SandboxInfraError, match="non-dumpable"):
        _judge(res, nonce, tests_sha, cand_sha, False)
