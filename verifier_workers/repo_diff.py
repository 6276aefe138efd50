"""A strict unified-diff applier for the `repo` verifier (pure: it works on a {path: text} dict).

`apply_diff(files, diff, protected)` applies a unified diff (plain `---/+++` or `git diff`
output: new, deleted and renamed files, `\\ No newline at end of file`) to an in-memory
repository. It never touches a file system, so an untrusted diff cannot reach the host.

Guarantees:
- Atomic: either every file patch that is kept applies and `PatchResult.errors` is empty,
  or `errors` says why and `PatchResult.files` is the input unchanged.
- Strict: every hunk's context and removed lines must match exactly (no fuzz, no
  whitespace folding); a hunk may sit at another line than it says (an offset, as
  `patch` and `git apply` allow) but never overlaps the previous hunk of its file. A
  hunk whose line counts disagree with its header, a new file that exists, a patched or
  deleted file that does not, binary patches and symlinks (mode 120000) are errors.
- Every path is a repository path (`schemas.repo_task.check_path`: relative, no `..`);
  anything else is an error. `a/`/`b/` prefixes are stripped when both sides carry them.
- A file patch whose old or new path is `protected(path)` is dropped, not applied, and
  listed in `PatchResult.dropped` (deduplicated, in order); dropping is never an error.
- A blank diff applies cleanly and changes nothing; a non-blank text without any file
  patch is an error ("no file patch in the diff").
- Lines split on `\\n` only (a `\\r` stays part of its line), so CRLF files round-trip.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.repo_task import check_path

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\"
GIT_META = ("index ", "old mode ", "new mode ", "similarity index ", "dissimilarity index ", "copy from ", "copy to ")


class DiffError(ValueError):
    """The diff is malformed or does not apply."""


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]] = field(default_factory=list)
    """(tag, text) with tag in ' ', '-', '+'; text keeps its '\\n' unless the file has none there."""

    def old(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "+"]

    def new(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "-"]


@dataclass
class FilePatch:
    old_path: str | None
    """None: the file is created (`/dev/null`)."""
    new_path: str | None
    """None: the file is deleted."""
    hunks: list[Hunk] = field(default_factory=list)
    problem: str = ""
    """Why this patch cannot apply (binary, symlink), found while parsing."""


@dataclass
class PatchResult:
    files: dict[str, str]
    dropped: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return not self.errors


def split_lines(text: str) -> list[str]:
    """`text` as lines that keep their '\\n' (split on '\\n' only)."""
    if not text:
        return []
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


def _strip_path(raw: str) -> str | None:
    path = raw.split("\t", 1)[0].rstrip("\r")
    if path.startswith('"') and path.endswith('"'):
        raise DiffError(f"quoted path {path!r} is not supported")
    return None if path == "/dev/null" else path


def _clean_prefixes(old: str | None, new: str | None, git: bool) -> tuple[str | None, str | None]:
    sides = [p for p in (old, new) if p is not None]
    if git or (sides and all(p.startswith(("a/", "b/")) for p in sides)):
        old = old[2:] if old and old.startswith("a/") else old
        new = new[2:] if new and new.startswith("b/") else new
    for p in (old, new):
        if p is not None:
            try:
                check_path(p)
            except ValueError as exc:
                raise DiffError(str(exc)) from None
    return old, new


def _parse_hunk(lines: list[str], i: int, m: re.Match) -> tuple[Hunk, int]:
    h = Hunk(int(m[1]), 1 if m[2] is None else int(m[2]), int(m[3]), 1 if m[4] is None else int(m[4]))
    need_old, need_new = h.old_len, h.new_len
    i += 1
    while need_old > 0 or need_new > 0:
        if i >= len(lines):
            raise DiffError(f"hunk @@ -{h.old_start} +{h.new_start} @@ ends early")
        ln = lines[i]
        tag, text = (ln[:1] or " "), ln[1:]
        if ln in ("\n", "\r\n"):  # an editor stripped the context line's space
            tag, text = " ", ln
        if tag == NO_NEWLINE:
            _no_newline(h)
            i += 1
            continue
        if tag not in " -+":
            raise DiffError(f"hunk @@ -{h.old_start} +{h.new_start} @@: unexpected line {ln[:60]!r}")
        need_old -= tag != "+"
        need_new -= tag != "-"
        if need_old < 0 or need_new < 0:
            raise DiffError(f"hunk @@ -{h.old_start} +{h.new_start} @@ is longer than its header says")
        h.lines.append((tag, text if text.endswith("\n") else text + "\n"))
        i += 1
    while i < len(lines) and lines[i].startswith(NO_NEWLINE):
        _no_newline(h)
        i += 1
    return h, i


def _no_newline(h: Hunk) -> None:
    if not h.lines:
        raise DiffError("'\\ No newline at end of file' before any line")
    tag, text = h.lines[-1]
    h.lines[-1] = (tag, text[:-1] if text.endswith("\n") else text)


def parse_diff(diff: str) -> list[FilePatch]:
    """The file patches of a unified diff (DiffError when malformed)."""
    lines = split_lines(diff)
    patches: list[FilePatch] = []
    i, git_pending, problem = 0, None, ""
    rename: dict[str, str] = {}
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("diff --git "):
            if git_pending is not None:
                patches.append(_header_only(git_pending, rename, problem))
            git_pending, problem, rename = ln, "", {}
            i += 1
            continue
        if git_pending is not None and (
            ln.startswith(("new file mode ", "deleted file mode ", "new mode ")) and ln.split()[-1].startswith("120")
        ):
            problem = "symlinks are not supported"
        if git_pending is not None and ln.startswith(("Binary files ", "GIT binary patch")):
            problem = "binary patches are not supported"
        if git_pending is not None and ln.startswith(("rename from ", "rename to ")):
            rename[ln.split(" ", 2)[1]] = ln.split(" ", 2)[2].rstrip("\n").rstrip("\r")
        if ln.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _clean_prefixes(
                _strip_path(ln[4:].rstrip("\n")), _strip_path(lines[i + 1][4:].rstrip("\n")), git_pending is not None
            )
            fp = FilePatch(old, new, problem=problem)
            i += 2
            while i < len(lines) and (m := HUNK.match(lines[i])):
                hunk, i = _parse_hunk(lines, i, m)
                fp.hunks.append(hunk)
            if not fp.hunks and not problem:
                raise DiffError(f"file patch {new or old} has no hunk")
            patches.append(fp)
            git_pending, problem, rename = None, "", {}
            continue
        i += 1
    if git_pending is not None:
        patches.append(_header_only(git_pending, rename, problem))
    if not patches and diff.strip():
        raise DiffError("no file patch in the diff")
    return patches


def _header_only(header: str, rename: dict[str, str], problem: str) -> FilePatch:
    """A `diff --git` section without hunks: a pure rename, a mode change, a binary or empty file."""
    if "from" in rename and "to" in rename:
        old, new = _clean_prefixes(rename["from"], rename["to"], False)
        return FilePatch(old, new, problem=problem)
    m = re.match(r"diff --git a/(\S+) b/(\S+)", header)
    if not m:
        raise DiffError(f"cannot read {header.strip()!r}")
    old, new = _clean_prefixes(m[1], m[2], False)
    return FilePatch(old, new, problem=problem or "a file patch without hunks (mode change or empty file)")


def _apply_hunks(text: str, hunks: list[Hunk], path: str) -> str:
    lines = split_lines(text)
    out: list[str] = []
    pos = 0  # first line of `lines` not yet copied
    for h in hunks:
        old = h.old()
        want = max(h.old_start - 1, 0) if h.old_len else h.old_start
        at = _find(lines, old, want, pos)  # `want` and `pos` index the original lines
        if at is None:
            raise DiffError(f"{path}: hunk @@ -{h.old_start},{h.old_len} @@ does not apply")
        out.extend(lines[pos:at])
        out.extend(h.new())
        pos = at + len(old)
    out.extend(lines[pos:])
    return "".join(out)


def _find(lines: list[str], old: list[str], want: int, lo: int) -> int | None:
    """The start index nearest `want` (not before `lo`) where `old` matches exactly."""
    n = len(old)
    for delta in range(0, len(lines) + 1):
        for at in (want,) if delta == 0 else (want - delta, want + delta):
            if lo <= at <= len(lines) - n and lines[at : at + n] == old:
                return at
        if want - delta < lo and want + delta > len(lines) - n:
            return None
    return None


def _apply_one(files: dict[str, str], fp: FilePatch) -> str:
    if fp.problem:
        raise DiffError(f"{fp.new_path or fp.old_path}: {fp.problem}")
    if fp.old_path is None:
        if fp.new_path in files:
            raise DiffError(f"{fp.new_path}: created by the diff but already exists")
        files[fp.new_path] = _apply_hunks("", fp.hunks, fp.new_path)
        return fp.new_path
    if fp.old_path not in files:
        raise DiffError(f"{fp.old_path}: patched by the diff but not in the repository")
    result = _apply_hunks(files[fp.old_path], fp.hunks, fp.old_path)
    if fp.new_path is None:
        if result:
            raise DiffError(f"{fp.old_path}: deleted by the diff but its hunks leave content")
        del files[fp.old_path]
        return fp.old_path
    if fp.new_path != fp.old_path:
        if fp.new_path in files:
            raise DiffError(f"{fp.new_path}: renamed onto an existing file")
        del files[fp.old_path]
    files[fp.new_path] = result
    return fp.new_path


def apply_diff(files: dict[str, str], diff: str, protected: Callable[[str], bool]) -> PatchResult:
    """Apply `diff` to a copy of `files`, dropping protected file patches (see the module guarantees)."""
    result = PatchResult(files=dict(files))
    try:
        patches = parse_diff(diff or "")
    except DiffError as exc:
        return PatchResult(files=dict(files), errors=[str(exc)])
    work = dict(files)
    for fp in patches:
        paths = [p for p in (fp.old_path, fp.new_path) if p is not None]
        if any(protected(p) for p in paths):
            result.dropped.extend(p for p in paths if p not in result.dropped)
            continue
        try:
            result.changed.append(_apply_one(work, fp))
        except DiffError as exc:
            result.errors.append(str(exc))
    if not result.errors:
        result.files = work
    return result
