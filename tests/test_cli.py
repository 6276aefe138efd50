"""`rlbus.cli`: every command module registers its command, and `rlbus --help` lists them all."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from bus.roles import ROLES
from rlbus import cli
from tests.conftest import ROOT


def _registered(module) -> dict[str, argparse.ArgumentParser]:
    """The commands one module adds, by name."""
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    module.register(sub)
    return dict(sub.choices)


def _without_handler(parser: argparse.ArgumentParser, name: str) -> list[str]:
    """The (sub)commands under `parser` that set no `func` (a command with subcommands: each of them)."""
    if callable(parser.get_default("func")):
        return []
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [name]
    return [bad for a in subs for sub, p in a.choices.items() for bad in _without_handler(p, f"{name} {sub}")]


def test_every_command_module_registers_a_command_with_a_handler():
    names = []
    for module in cli.COMMANDS:
        added = _registered(module)
        assert added, f"{module.__name__}.register added no command"
        for name, parser in added.items():
            assert not _without_handler(parser, name), (
                f"{module.__name__}: no func for {_without_handler(parser, name)}"
            )
        names += added
    assert len(names) == len(set(names)), f"a command is registered twice: {sorted(names)}"
    parsed = cli._parser()._subparsers._group_actions[0].choices
    assert sorted(parsed) == sorted(names)


def test_every_module_in_commands_is_listed():
    """A command module (one with `register(sub)`) left out of `COMMANDS` would be a silently
    absent command; helper modules of a command (no `register`) are not commands."""
    files = {
        p.stem
        for p in (ROOT / "rlbus" / "commands").glob("*.py")
        if p.stem != "__init__" and "\ndef register(" in p.read_text()
    }
    listed = {m.__name__.rsplit(".", 1)[1] for m in cli.COMMANDS if m.__name__.startswith("rlbus.commands.")}
    assert files == listed
    assert "sandbox_workers.cli" in {m.__name__ for m in cli.COMMANDS}


def test_help_lists_every_command():
    """Both entry points: `python -m rlbus.cli` and the `rlbus` console script (pyproject's
    `rlbus = "rlbus.cli:main"`), when it is installed next to this Python."""
    names = [n for m in cli.COMMANDS for n in _registered(m)]
    script = Path(sys.executable).with_name("rlbus")
    for argv in [[sys.executable, "-m", "rlbus.cli", "--help"]] + (
        [[str(script), "--help"]] if script.exists() else []
    ):
        res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        listed = {line.split()[0] for line in res.stdout.splitlines() if line.startswith("    ") and line.split()}
        assert set(names) <= listed, f"{argv[0]} --help misses {sorted(set(names) - listed)}"


def test_every_role_has_a_module():
    for role in ROLES:  # the role table (bus/roles.py) names each role's module; tests/test_roles.py imports them
        assert importlib.util.find_spec(role.module) is not None, f"role {role.name}: no module {role.module}"
