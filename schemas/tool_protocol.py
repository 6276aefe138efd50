"""How a policy calls a tool in its text, shared by rollout (parsing), SFT demos and verifiers.

Two formats, chosen per domain (`DomainConfig.tool_format`, carried as `Task.tool_format`):

`tags` (compact, for tiny models):

    <py>PROGRAM</py>     generation stops at </py>; what runs depends on the task's tool:
                         `python`: PROGRAM itself, with the sandbox's python3, REPL style:
                         the value of a final bare expression is printed (`<py>6*7</py>` -> 42);
                         `run_tests`: PROGRAM saved as candidate.py, then its docstring
                         examples (`python3 -m doctest -v candidate.py`): public tests only,
                         never the hidden ones the verifier runs later in a fresh sandbox.

After a call the environment appends a tool turn: a newline, the sandbox's observation
block (`sandbox_workers.integrity.render_observation`: `<obs exit=N ...>...</obs>`), and
a newline. An assistant turn without a call is the final answer.

`json` (as instruct models are trained to call tools):

    <tool_call>{"name": "python", "arguments": {"code": "6*7"}}</tool_call>

The task's tools are declared in the system turn by the chat template (`tool_specs`:
OpenAI-style function specs with JSON-schema parameters, the ONLY copy, usable as
`apply_chat_template(tools=...)`); generation stops at `</tool_call>`; the `code`
argument runs as the tags program would; the result comes back as a tool message whose
content is the same signed observation block, `tool_turn_text(obs)` rendered as a tool
message (`schemas.chat.tool_turn`: `<tool_response>` framing with the BPE template; the
plain text itself for a tokenizer without a template), so the integrity check is the same
in both formats.

Repository tools (the `repo` domain; `REPO_TOOLS`), in both formats. Under `json` they are
ordinary calls (`{"name": "read_file", "arguments": {"path": "pkg/a.py", "start": 1}}`);
under `tags` each tool is its own tag, the main argument its body, the others attributes:

    <list_files>PATH</list_files>
    <read_file start="N" end="M">PATH</read_file>          (start/end optional, 1-based, inclusive)
    <read_file offset="N" limit="K">PATH</read_file>       (K lines from line N; overrides start/end)
    <grep path="PATH" ignore_case="true">REGEX</grep>      (matching lines with numbers; path '.' default)
    <write_file path="PATH">CONTENT</write_file>
    <apply_patch>UNIFIED DIFF</apply_patch>
    <run>SHELL COMMAND</run>                                 (cwd /work, the repository)
    <submit></submit>                                        (or <submit/>: the episode ends)

Harbor task tools (`HARBOR_TOOLS`): `<bash timeout="N" cwd="DIR">COMMAND</bash>` runs in the
task's own container, plus `read_file`, `write_file` and `submit` as above (paths absolute or
relative to the container's working directory).

A body's one leading newline is dropped (CONTENT and DIFF keep the rest byte for byte; PATH
and COMMAND are stripped). Tags arguments are checked against the same JSON schemas as
json ones (`start`/`end`/`offset`/`limit` must be integers), so a bad call is the same structured
error. `grep` is a repository tool that `REPO_TOOLS` does not offer (a domain names it: the agentic
`findoc`).

Guarantees (`parse_call`, pure):
- It finds the FIRST complete call of a model turn in the task's format (None: no call,
  the turn is the final answer); `end` is the offset just past its closing tag.
- A json call that is malformed JSON (or not an object with a string `name`), names a
  tool the task does not offer, or has arguments failing that tool's schema
  (`jsonschema`) comes back as a `Call` with `error` set (`ERROR_KINDS`) and `detail`
  saying what was wrong, never an exception. Nothing runs for it: the episode gets the
  structured error observation `error_observation(call)`, a JSON object with no `<`,
  `>` or `&` in it, so it can never look like (or close) an observation block.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache

CALL_OPEN, CALL_CLOSE = "<py>", "</py>"
JSON_CALL_OPEN, JSON_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_FORMATS = ("tags", "json")
STOP_STRINGS_BASE = (CALL_CLOSE, JSON_CALL_CLOSE)
ERROR_KINDS = ("malformed_json", "unknown_tool", "bad_arguments")
"""What can be wrong with a json call (counted per domain as `tool_errors`)."""

_CODE = {"type": "string", "minLength": 1}
TOOL_SPECS: dict[str, dict] = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program in a fresh sandbox; its output is returned. The value of a final "
            "bare expression is printed, as in a REPL.",
            "parameters": {
                "type": "object",
                "properties": {"code": {**_CODE, "description": "The Python program."}},
                "required": ["code"],
                "additionalProperties": False,
            },
        },
    },
    "run_tests": {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Save the program as candidate.py and run its docstring examples (the public tests) "
            "with doctest; the report is returned.",
            "parameters": {
                "type": "object",
                "properties": {"code": {**_CODE, "description": "The whole candidate module."}},
                "required": ["code"],
                "additionalProperties": False,
            },
        },
    },
}
"""Tool name -> its spec (name, description, JSON-schema parameters): the only copy."""


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required, "additionalProperties": False},
        },
    }


_PATH = {"type": "string", "minLength": 1, "maxLength": 4096, "description": "Path relative to the repository root."}
TOOL_SPECS.update(
    {
        "list_files": _fn(
            "list_files",
            "List the files under a directory of the repository (recursively).",
            {"path": {**_PATH, "description": "Directory relative to the repository root ('.': all)."}},
            ["path"],
        ),
        "read_file": _fn(
            "read_file",
            "Show a file of the repository with line numbers: all of it, `limit` lines from line "
            "`offset`, or lines start..end (1-based, inclusive).",
            {
                "path": _PATH,
                "offset": {"type": "integer", "minimum": 1, "description": "First line to show (1-based)."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "How many lines."},
                "start": {"type": "integer", "minimum": 1},
                "end": {"type": "integer", "minimum": 1},
            },
            ["path"],
        ),
        "grep": _fn(
            "grep",
            "Search a file (or every file under a directory) of the repository for a regular "
            "expression; the matching lines come back with their line numbers.",
            {
                "pattern": {"type": "string", "minLength": 1, "maxLength": 1024, "description": "Python regex."},
                "path": {**_PATH, "description": "File or directory relative to the repository root ('.': all)."},
                "ignore_case": {"type": "boolean"},
                "max_matches": {"type": "integer", "minimum": 1, "maximum": 500, "description": "Lines shown (50)."},
            },
            ["pattern"],
        ),
        "write_file": _fn(
            "write_file",
            "Create or replace a file of the repository with the given content.",
            {"path": _PATH, "content": {"type": "string", "description": "The whole new file."}},
            ["path", "content"],
        ),
        "apply_patch": _fn(
            "apply_patch",
            "Apply a unified diff (paths a/FILE b/FILE, relative to the repository "
            "root) to the repository; all of it applies or nothing does.",
            {"unified_diff": {**_CODE, "description": "The unified diff."}},
            ["unified_diff"],
        ),
        "run": _fn(
            "run",
            "Run a shell command in the repository root (e.g. python -m pytest -x -q tests); its "
            "exit code and output are returned.",
            {"command": {**_CODE, "maxLength": 8192, "description": "The shell command."}},
            ["command"],
        ),
        "submit": _fn("submit", "Submit the repository as it is now; the episode ends.", {}, []),
        "bash": _fn(
            "bash",
            "Run a bash command in the task's container (cwd: the task's working directory unless "
            "`cwd` is given); its exit code and output are returned.",
            {
                "command": {**_CODE, "maxLength": 65536, "description": "The bash command."},
                "timeout": {"type": "integer", "minimum": 1, "maximum": 3600, "description": "Seconds (capped)."},
                "cwd": {"type": "string", "minLength": 1, "maxLength": 4096, "description": "Working directory."},
            },
            ["command"],
        ),
    }
)
TOOL_NAMES = set(TOOL_SPECS)
REPO_TOOLS = ("list_files", "read_file", "write_file", "apply_patch", "run", "submit")
"""The repository tools, in the order a repo task offers them."""
HARBOR_TOOLS = ("bash", "read_file", "write_file", "submit")
"""The tools of a Harbor task's container (paths absolute, or relative to its working directory)."""
_REPO_BODY = {
    "list_files": "path",
    "read_file": "path",
    "grep": "pattern",
    "write_file": "content",
    "apply_patch": "unified_diff",
    "run": "command",
    "bash": "command",
    "submit": None,
}
"""Tags format: the argument a repository tool's tag body holds (None: no body)."""
_VERBATIM = frozenset({"content", "unified_diff"})
REPO_STOP_STRINGS = tuple(f"</{t}>" for t in (*REPO_TOOLS, "grep", "bash")) + ("<submit/>",)


# Runs main.py like a REPL cell: every statement, then prints repr() of a final bare
# expression (None is not printed). Passed with -c, so nothing extra is written.
REPL_RUNNER = (
    "import ast,sys\n"
    "src=open(sys.argv[1]).read()\n"
    "tree=ast.parse(src,sys.argv[1])\n"
    "last=tree.body.pop() if tree.body and isinstance(tree.body[-1],ast.Expr) else None\n"
    "g={'__name__':'__main__'}\n"
    "exec(compile(tree,sys.argv[1],'exec'),g)\n"
    "if last is not None:\n"
    "    v=eval(compile(ast.Expression(last.value),sys.argv[1],'eval'),g)\n"
    "    if v is not None: print(repr(v))\n"
)


def tool_command(tools: list[str]) -> tuple[str, str, list[str]]:
    """(tool name, file to write the program to, argv to run) for a task's tools."""
    if "python" in tools:
        return "python", "main.py", ["python3", "-c", REPL_RUNNER, "main.py"]
    return "run_tests", "candidate.py", ["python3", "-m", "doctest", "-v", "candidate.py"]


def _between(text: str, open_tag: str, close_tag: str) -> tuple[str, int] | None:
    """(the text inside the first complete `open_tag ... close_tag`, end offset just past it), else None."""
    start = text.find(open_tag)
    if start < 0:
        return None
    end = text.find(close_tag, start + len(open_tag))
    if end < 0:
        return None
    return text[start + len(open_tag) : end], end + len(close_tag)


def find_call(text: str) -> tuple[str, int] | None:
    """(program, end offset just past `</py>`) of the first complete call in `text`, else None."""
    return _between(text, CALL_OPEN, CALL_CLOSE)


def tool_turn_text(observation: str) -> str:
    """The context appended after a tool call."""
    return f"\n{observation}\n"


def call_close(tool_format: str) -> str:
    """The closing tag of a call in `tool_format` (generation stops there)."""
    return JSON_CALL_CLOSE if tool_format == "json" else CALL_CLOSE


def tool_specs(tools: list[str]) -> list[dict]:
    """The specs of a task's tools, in order, for `apply_chat_template(tools=...)`; unknown names: ValueError."""
    unknown = [t for t in tools if t not in TOOL_SPECS]
    if unknown:
        raise ValueError(f"no tool spec for {unknown}; known tools: {sorted(TOOL_SPECS)}")
    return [TOOL_SPECS[t] for t in tools]


def declared_tools(tool_format: str, tools: list[str]) -> list[dict] | None:
    """What a task's prompt declares to the chat template: the specs of `tools` under `json`, else None."""
    return tool_specs(tools) if tool_format == "json" and tools else None


@dataclass(frozen=True)
class Call:
    """One tool call found in a model turn."""

    tool: str
    """The tool to run (json: the name the model wrote, "" when unreadable)."""
    code: str
    """The program to run ("" when `error`)."""
    raw: str
    """The text between the call's tags, as the model wrote it."""
    end: int
    """Offset in the turn just past the closing tag."""
    error: str = ""
    """"" for a runnable call, else one of `ERROR_KINDS`."""
    detail: str = ""
    """What was wrong (for the error observation)."""
    args: dict = field(default_factory=dict, compare=False)
    """The call's arguments as parsed (json: `arguments`; tags: body and attributes)."""


@lru_cache(maxsize=None)
def _validator(tool: str):
    import jsonschema

    schema = TOOL_SPECS[tool]["function"]["parameters"]
    return jsonschema.Draft202012Validator(schema)


def _json_call(raw: str, end: int, tools: list[str], declared: dict[str, dict] | None = None) -> Call:
    """One json call's Call; `declared` (name -> JSON-schema parameters) replaces the project's
    own TOOL_SPECS for a caller's tools (the OpenAI endpoint's `tools=`)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return Call("", "", raw, end, "malformed_json", f"not valid JSON: {exc}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(
            "", "", raw, end, "malformed_json", 'expected a JSON object {"name": <tool name>, "arguments": {...}}'
        )
    name, args = obj["name"], obj.get("arguments")
    if name not in tools or name not in (TOOL_SPECS if declared is None else declared):
        return Call(name, "", raw, end, "unknown_tool", f"no tool named {name!r}; available: {sorted(tools)}")
    if args is None:
        return Call(name, "", raw, end, "bad_arguments", 'missing "arguments" (an object)')
    schema = None if declared is None else json.dumps(declared[name], sort_keys=True)
    return _checked(name, args, raw, end, schema)


@lru_cache(maxsize=256)
def _declared_validator(schema: str):
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(schema))


def parse_declared_calls(text: str, declared: dict[str, dict]) -> list[Call]:
    """Every complete json call (`<tool_call>{...}</tool_call>`) of `text`, in order, for
    caller-declared tools (name -> JSON-schema `parameters`), by the same code as
    `tool_format = "json"`: a malformed, unknown or schema-failing call has `error` set."""
    calls, offset = [], 0
    while (found := _between(text[offset:], JSON_CALL_OPEN, JSON_CALL_CLOSE)) is not None:
        calls.append(_json_call(found[0].strip(), offset + found[1], list(declared), declared))
        offset += found[1]
    return calls


def parse_call(text: str, tool_format: str, tools: list[str]) -> Call | None:
    """The first complete call of `text` in `tool_format` for a task offering `tools` (module guarantees)."""
    if tool_format == "tags":
        if any(t in _REPO_BODY for t in tools):
            return _repo_tag_call(text, tools)
        found = find_call(text)
        if found is None:
            return None
        return Call(tool_command(tools)[0], found[0], found[0], found[1])
    if tool_format != "json":
        raise ValueError(f"unknown tool_format {tool_format!r}; use one of {TOOL_FORMATS}")
    found = _between(text, JSON_CALL_OPEN, JSON_CALL_CLOSE)
    if found is None:
        return None
    return _json_call(found[0].strip(), found[1], tools)


def _html_safe(text: str) -> str:
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def error_observation(call: Call) -> str:
    """The structured error observation of a refused call: one JSON object, no `<`, `>`, `&`.

    e.g. `{"error": "unknown_tool", "tool": "calc", "message": "no tool named 'calc'; available: ['python']"}`
    """
    return _html_safe(json.dumps({"error": call.error, "tool": call.tool, "message": call.detail}))


def json_call_text(tool: str, code: str) -> str:
    """A well-formed json call of `tool` with program `code` (what SFT demos teach)."""
    return f"{JSON_CALL_OPEN}{json.dumps({'name': tool, 'arguments': {'code': code}})}{JSON_CALL_CLOSE}"


STOP_STRINGS = STOP_STRINGS_BASE + REPO_STOP_STRINGS
"""Every format's closing tags (the repository tools' included): where an engine may stop a turn."""


def is_repo_call(call: Call | None) -> bool:
    """Whether `call` is one of the repository tools (`REPO_TOOLS`)."""
    return call is not None and call.tool in _REPO_BODY


_ATTR = re.compile(r'([A-Za-z_]+)\s*=\s*"([^"]*)"')


def _repo_tag_call(text: str, tools: list[str]) -> Call | None:
    """The first complete repository-tool tag of `text` among `tools` (tags format), else None."""
    best = None
    for tool in tools:
        if tool not in _REPO_BODY:
            continue
        m = re.search(rf"<{tool}(\s[^<>]*?)?(/?)>", text)
        if m is None or (best is not None and m.start() >= best[0].start()):
            continue
        if m.group(2) == "/":
            body, end = "", m.end()
        else:
            close = text.find(f"</{tool}>", m.end())
            if close < 0:
                continue
            body, end = text[m.end() : close], close + len(f"</{tool}>")
        best = (m, tool, body, end)
    if best is None:
        return None
    m, tool, body, end = best
    args: dict = {k: html.unescape(v) for k, v in _ATTR.findall(m.group(1) or "")}
    for key in ("start", "end", "offset", "limit", "max_matches", "timeout"):
        if key in args and re.fullmatch(r"\s*\d+\s*", args[key]):
            args[key] = int(args[key])
    if args.get("ignore_case") in ("true", "1", "false", "0"):
        args["ignore_case"] = args["ignore_case"] in ("true", "1")
    field_name = _REPO_BODY[tool]
    if field_name is not None:
        args[field_name] = body[1:] if body.startswith("\n") and field_name in _VERBATIM else body
        if field_name not in _VERBATIM:
            args[field_name] = args[field_name].strip()
    return _checked(tool, args, text[m.start() : end], end)


def _checked(name: str, args: dict, raw: str, end: int, schema: str | None = None) -> Call:
    """A Call of tool `name` with `args`, or one with `bad_arguments` when they fail its schema
    (the project's spec of `name`, or `schema`: a caller's parameters as sorted JSON)."""
    validator = _validator(name) if schema is None else _declared_validator(schema)
    problems = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    if problems:
        first = problems[0]
        where = "arguments" + "".join(f"[{p!r}]" for p in first.absolute_path)
        return Call(name, "", raw, end, "bad_arguments", f"{where}: {first.message}")
    code: str = args["code"] if "code" in args else json.dumps(args, sort_keys=True, ensure_ascii=False)
    return Call(name, code, raw, end, args=dict(args))


def repo_call_text(tool: str, args: dict, tool_format: str) -> str:
    """A well-formed call of repository tool `tool` with `args` in `tool_format` (the inverse of
    `parse_call`: what the scripted engine writes and SFT demos would teach)."""
    if tool not in _REPO_BODY:
        raise ValueError(f"{tool!r} is not a repository tool ({REPO_TOOLS})")
    if tool_format == "json":
        return f"{JSON_CALL_OPEN}{json.dumps({'name': tool, 'arguments': args}, ensure_ascii=False)}{JSON_CALL_CLOSE}"
    body_key = _REPO_BODY[tool]
    attrs = "".join(
        f' {k}="{html.escape(str(v).lower() if isinstance(v, bool) else str(v), quote=True)}"'
        for k, v in args.items()
        if k != body_key
    )
    body = "" if body_key is None else str(args.get(body_key, ""))
    if body_key in _VERBATIM:
        body = "\n" + body
    return f"<{tool}{attrs}>{body}</{tool}>"


class ToolDemo(list):
    """SFT segments `(text, trainable)` of a json-format episode; `tools` are the specs its
    prompt declares (the learner renders them into the system turn through the chat template)."""

    def __init__(self, segments, tools: list[dict]):
        super().__init__(segments)
        self.tools = tools
