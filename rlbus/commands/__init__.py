"""The `rlbus` commands, one module each: `register(subparsers)` adds the command's parser and
sets `func=callable(args) -> int` as its default. `rlbus.cli.COMMANDS` lists them all."""
