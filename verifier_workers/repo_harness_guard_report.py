"""The repo guard's report channel: MAC'd lines, written only from pytest's genuine call stack.

Part 3 of the guard program (`verifier_workers.repo_harness_guard`, installed in the sandbox
as ONE module `_rlbus_guard`; stdlib only, joined with the other parts before it is shipped).

Guarantees: `sender(fd)` is a generator holding the per-run report key in its own frame
(read from the key pipe inside it; never a global, a closure cell or an argument). A line
is only written when the call stack is pytest's genuine one: a test report's stack must run
from the runner's own frame through `runtestprotocol(item)` -> `call_and_report(item, when)`
(whose local `report` is the report given) to the harness plugin, every frame in trusted
code, and the item must be the one collected (its instance dict unchanged). Anything else
is reported as tamper.
"""

import hashlib
import hmac
import json
import os
import sys
import types

from verifier_workers.repo_harness_guard_audit import code_of, make_is_trusted
from verifier_workers.repo_harness_guard_data import MRO

REPORT_FD = 3


def sender(key_fd, runner_code, trusted):
    """The report generator (see the module docstring): prime with next() -> the job; then
    `.send((msg, extra))` writes `msg` as one MAC'd line on REPORT_FD, or a tamper line."""
    import _pytest.main
    import _pytest.runner

    chunks = []
    while True:
        b = os.read(key_fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(key_fd)
    key_hex, _, job_text = b"".join(chunks).partition(b"\n")
    key = bytes.fromhex(key_hex.decode())
    del key_hex, chunks
    getframe, mac, dumps, write = sys._getframe, hmac.new, json.dumps, os.write
    car, rtp, collect = (
        code_of(_pytest.runner.call_and_report),
        code_of(_pytest.runner.runtestprotocol),
        code_of(_pytest.main.Session.perform_collect),
    )
    items, seq, done = {}, 0, set()
    volatile = frozenset(("funcargs", "_request", "_report_sections", "user_properties"))
    job = json.loads(job_text)
    expected = frozenset(job["expected"])
    is_trusted = make_is_trusted(trusted, frozenset(job.get("trusted_files") or ()))
    got = yield job
    while True:
        msg, extra = got if type(got) is tuple and len(got) == 2 else ({"k": "tamper", "why": "bad send"}, None)
        why = ""
        caller = getframe(1)
        chain, f = [], caller
        while f is not None:
            chain.append(f)
            f = f.f_back
        codes = [c.f_code for c in chain]
        if type(msg) is not dict:
            why = "a report that is not a dict"
        elif msg.get("k") == "tamper":
            pass
        elif not all(is_trusted(c.co_filename) for c in codes) or runner_code not in codes:
            why = "a report sent from outside the harness's own call stack"
        elif msg.get("k") == "items":
            if items or collect not in codes:
                why = "the collected items were reported twice or outside the collection"
            else:
                for it in extra:
                    if it.nodeid in expected:
                        items[it.nodeid] = (it, dict(vars(it)))
        elif msg.get("k") == "report":
            why = _check_report(msg, extra, chain, codes, car, rtp, items, volatile, done)
        elif msg.get("k") == "fin":
            if codes[0] is not runner_code:
                why = "fin sent from outside the runner"
        if why:
            msg = {"k": "tamper", "why": why}
        body = dumps(msg).encode()
        data = body + b"\t" + mac(key, b"%d:" % seq + body, hashlib.sha256).hexdigest().encode() + b"\n"
        seq += 1
        while data:
            data = data[write(REPORT_FD, data) :]
        got = yield bool(why)


def _class_attr(cls, name):
    for k in MRO(cls):
        if name in k.__dict__:
            return k.__dict__[name]
    return None


def _check_report(msg, report, chain, codes, car, rtp, items, volatile, done):
    """'' when `report` comes from pytest's own runtestprotocol -> call_and_report of a collected item."""
    if car not in codes:
        return "a test report outside call_and_report"
    i = codes.index(car)
    f = chain[i]
    nxt = chain[i + 1] if i + 1 < len(chain) else None
    loc = f.f_locals
    if nxt is None or nxt.f_code is not rtp or nxt.f_locals.get("item") is not loc.get("item"):
        return "a test report outside runtestprotocol"
    if loc.get("report") is not report or loc.get("when") != msg.get("when") or report.nodeid != msg.get("id"):
        return "a test report that is not pytest's own"
    rec = items.get(msg.get("id"))
    if rec is None or rec[0] is not loc.get("item"):
        return "a test report for an item that was not collected"
    key = (msg.get("id"), msg.get("when"))
    if key in done:
        return "a second report for %s %s" % key
    done.add(key)
    item, then = rec
    now = vars(item)
    for k in set(now) | set(then):
        a, b = now.get(k, done), then.get(k, done)
        if a is b or k in volatile:
            continue
        attr = _class_attr(type(item), k)
        if k in ("_obj", "obj") or callable(b) or callable(a) or isinstance(attr, (types.FunctionType, property)):
            return "the test item %s was changed (%s)" % (msg.get("id"), k)
    return ""
