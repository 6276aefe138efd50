"""The document tools of agentic long-context episodes (issue 33 item 4): `read_file` with
`offset`/`limit` lines and `grep` (a regex: matching lines with their numbers, capped), declared
in the tool schema, parsed in both tool formats, and run as one recorded execution in a real
bwrap sandbox like the other repository tools."""

from __future__ import annotations

import asyncio

import pytest

from rollout_workers.repo_tools import GREP_MAX_MATCHES, read_range, run_repo_tool, setup_workspace
from sandbox_workers.async_sandbox import LocalAsyncSandbox
from sandbox_workers.process import bwrap_path
from schemas.tool_protocol import TOOL_SPECS, declared_tools, parse_call, repo_call_text

TOOLS = ["read_file", "grep", "run"]


@pytest.mark.parametrize("fmt", ["tags", "json"])
def test_doc_tool_calls_round_trip_and_bad_ones_are_structured_errors(fmt):
    for tool, args in (
        ("read_file", {"path": "filing.md", "offset": 120, "limit": 40}),
        ("grep", {"pattern": r"Revenue\s+\d", "path": "filing.md", "ignore_case": True, "max_matches": 5}),
        ("grep", {"pattern": "net income"}),
    ):
        text = "let me look " + repo_call_text(tool, args, fmt) + " after"
        call = parse_call(text, fmt, TOOLS)
        assert call is not None and not call.error and call.tool == tool and call.args == args, (tool, call)
    for bad in (
        repo_call_text("read_file", {"path": "filing.md", "limit": 0}, fmt),
        repo_call_text("grep", {"pattern": "x", "max_matches": 9999}, fmt),
    ):
        call = parse_call(bad, fmt, TOOLS)
        assert call is not None and call.error == "bad_arguments", (bad, call)
    names = [spec["function"]["name"] for spec in declared_tools("json", TOOLS) or []]
    assert names == TOOLS
    assert {"offset", "limit"} <= set(TOOL_SPECS["read_file"]["function"]["parameters"]["properties"])


def test_read_range_prefers_offset_and_limit():
    assert read_range({"path": "f"}) == ("1", "0")
    assert read_range({"path": "f", "start": 3, "end": 9}) == ("3", "9")
    assert read_range({"path": "f", "offset": 10, "limit": 5}) == ("10", "14")
    assert read_range({"path": "f", "limit": 2}) == ("1", "2")
    assert read_range({"path": "f", "start": 3, "end": 9, "offset": 20}) == ("20", "9")


@pytest.mark.skipif(bwrap_path() is None, reason="bwrap not installed (apt-get install -y bubblewrap)")
def test_grep_and_read_file_run_in_the_sandbox():
    lines = [f"line {i}: filler text" for i in range(1, 201)]
    lines[49] = "Revenue 2023: 1,234 (thousands)"
    lines[149] = "revenue 2024: 2,345 (thousands)"
    body = "\n".join(lines) + "\n"

    def call(tool: str, args: dict):
        return parse_call(repo_call_text(tool, args, "tags"), "tags", TOOLS)

    async def scenario():
        box = await LocalAsyncSandbox.open("process", timeout=10)
        try:
            await setup_workspace(box, {"filing.md": body, "notes/a.md": "x\nRevenue note\n"})
            run = [
                ("grep", {"pattern": "revenue", "path": "filing.md", "ignore_case": True}),
                ("grep", {"pattern": "^Revenue", "path": "."}),
                ("grep", {"pattern": "filler", "path": "filing.md", "max_matches": 3}),
                ("grep", {"pattern": "filler"}),
                ("grep", {"pattern": "nothing like this"}),
                ("grep", {"pattern": "(unclosed"}),
                ("read_file", {"path": "filing.md", "offset": 49, "limit": 3}),
                ("grep", {"pattern": "x", "path": "../etc"}),
            ]
            return [(await run_repo_tool(box, call(t, a), 10, (20000, 2000))).result for t, a in run]
        finally:
            await box.close()

    ci, anchored, capped, default_cap, none, bad, read, outside = asyncio.run(scenario())
    assert ci.exit_code == 0 and ci.stdout.splitlines() == ["50:Revenue 2023: 1,234 (thousands)", "150:" + lines[149]]
    assert anchored.stdout.splitlines() == ["filing.md:50:Revenue 2023: 1,234 (thousands)", "notes/a.md:2:Revenue note"]
    assert capped.stdout.splitlines() == [
        "1:line 1: filler text",
        "2:line 2: filler text",
        "3:line 3: filler text",
        "(195 more matching lines not shown: narrow the pattern or read a line range)",
    ]
    assert len(default_cap.stdout.splitlines()) == GREP_MAX_MATCHES + 1
    assert none.exit_code == 0 and none.stdout.strip() == "(no matching lines)"
    assert bad.exit_code == 2 and "does not compile" in bad.stderr
    assert read.exit_code == 0 and read.stdout.splitlines() == [
        "filing.md: lines 49-51 of 200",
        "    49  line 49: filler text",
        "    50  Revenue 2023: 1,234 (thousands)",
        "    51  line 51: filler text",
    ]
    assert outside.exit_code == 2 and "relative to the repository root" in outside.stderr
