"""Programs shipped into a sandbox as ONE source text, kept in the repository as several modules.

A sandbox image carries no project code, so a program that runs inside one (the docker
agent, the verifiers' harnesses and guard) travels as one text. To keep each module small
it is written as parts: modules of one package, stdlib only, each importing names of
EARLIER parts with top-level `from <package>.<part> import name, ...` statements (which
also makes every part importable, and linted, on the host).

Guarantees of `join_parts(sources, package)`:
- The program is every part's text in order, joined by one newline, with exactly the
  lines of each part's top-level `from <package>.<earlier part> import ...` statements
  removed (those names are already globals of the one program); nothing else changes.
- ValueError (so nothing is shipped) when a part imports any other module of `package`
  (at any depth, with `import` or `from`), a later part or itself, renames an imported
  name (`as`), uses a relative import, or when the joined program does not compile.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _part_imports_dropped(name: str, source: str, earlier: set[str], package: str) -> str:
    """`source` without its top-level imports of `earlier` parts; ValueError for any other import of `package`."""
    tree = ast.parse(source, name)
    drop: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and not node.level and _in_package(node.module or "", package):
            if node.module.removeprefix(package + ".") not in earlier or any(a.asname for a in node.names):
                raise ValueError(f"program part {name}: `from {node.module} import` is not an earlier part's names")
            drop.update(range(node.lineno - 1, node.end_lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.lineno - 1 in drop:
            continue
        modules = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if (isinstance(node, ast.ImportFrom) and node.level) or any(_in_package(m, package) for m in modules):
            raise ValueError(f"program part {name} imports project code at line {node.lineno}")
    return "".join(line for i, line in enumerate(source.splitlines(keepends=True)) if i not in drop)


def join_parts(sources: Sequence[tuple[str, str]], package: str) -> str:
    """One program from (path, source) parts of `package`, in order (see the module guarantees)."""
    earlier: set[str] = set()
    out = []
    for path, source in sources:
        out.append(_part_imports_dropped(path, source, earlier, package))
        earlier.add(os.path.basename(path).removesuffix(".py"))
    program = "\n".join(out)
    try:
        compile(program, f"<{package} program>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ValueError(f"the joined program of {', '.join(p for p, _ in sources)} does not compile: {exc}") from exc
    return program


def join_files(paths: Sequence[str], package: str) -> str:
    """`join_parts` of the files at `paths` (read as UTF-8), in order."""
    sources = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            sources.append((path, f.read()))
    return join_parts(sources, package)
