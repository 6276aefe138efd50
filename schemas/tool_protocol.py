"""How a policy calls a tool in its text, shared by rollout (parsing), SFT demos and verifiers.

    <py>PROGRAM</py>     generation stops at </py>; what runs depends on the task's tool:
                         `python`: PROGRAM itself, with the sandbox's python3, REPL style:
                         the value of a final bare expression is printed (`<py>6*7</py>` -> 42);
                         `run_tests`: PROGRAM saved as candidate.py, then its docstring
                         examples (`python3 -m doctest -v candidate.py`): public tests only,
                         never the hidden ones the verifier runs later in a fresh sandbox.

After a call the environment appends a tool turn: a newline, the sandbox's observation
block (`sandbox_workers.integrity.render_observation`: `<obs exit=N ...>...</obs>`), and
a newline. An assistant turn without a call is the final answer.
"""

from __future__ import annotations

CALL_OPEN, CALL_CLOSE = "<py>", "</py>"
TOOL_NAMES = {"python", "run_tests"}


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


def find_call(text: str) -> tuple[str, int] | None:
    """(program, end offset just past `</py>`) of the first complete call in `text`, else None."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
    if end < 0:
        return None
    return text[start + len(CALL_OPEN):end], end + len(CALL_CLOSE)


def tool_turn_text(observation: str) -> str:
    """The context appended after a tool call."""
    return f"\n{observation}\n"
