#!/usr/bin/env python3
"""docs/design.md's component map against the code, and the workspace's room sizes.

Every size the map's table gives for a core file is that file's non-test lines (its
lines before its `#[cfg(test)]` module, all of them without one), and every file of
core/src/node/ is named. No file of the core, the server (shell-mio) or the binary (cli/) has over 700
non-test lines and no function of theirs over 80 (from its `fn` line to the `}` at its indentation, rustfmt's layout;
test files and modules excluded). The node's files and the event loop's import what they
use by name (no `use super::*;` outside tests), and the node has no `rmpv`: its replies
are typed. The rest of the workspace's code is held to the same
sizes with a ratchet: .ci/room-sizes.allowed lists the files and functions over them
today, each with its size; one that grows, a new one, or a listed one that is now
within the sizes (take its line out) fails. A size is written `path.rs` (N ...) or, for a folder,
`folder/` (name N ..., name N ...), where name is folder/name.rs or folder/name/mod.rs.

    python3 .ci/design-map.py ROOT [DESIGN_MD]     # exit 1 naming each difference
    python3 .ci/design-map.py --list ROOT          # the ratchet's lines as they are now
"""

import pathlib
import re
import sys

FILE = re.compile(r"`([\w/]+\.rs)` \((\d+)")
FOLDER = re.compile(r"`([\w/]+/)` \(([^)]*)\)")
ENTRY = re.compile(r"(?:^|[,;]\s*)([a-z_0-9]+) (\d+)\b")
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))? )?(?:const )?(?:unsafe )?fn (\w+)")
MAX_FILE_LINES = 700
MAX_FN_LINES = 80


def non_test_lines(path: pathlib.Path) -> int:
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if line.startswith("#[cfg(test)]"):
            return number
    return len(lines)


def long_functions(path: pathlib.Path):
    """(line, name, length) of each function over MAX_FN_LINES before the tests."""
    lines = path.read_text().splitlines()[: non_test_lines(path)]
    for number, line in enumerate(lines):
        found = FN.match(line)
        if not found:
            continue
        signature_end = number
        while signature_end + 1 < len(lines) and not lines[signature_end].rstrip().endswith(
            ("{", ";")
        ):
            signature_end += 1
        if lines[signature_end].rstrip().endswith(";"):
            continue  # a declaration (a trait's), no body
        end = f"{found.group(1)}}}"
        for last in range(number + 1, len(lines)):
            if lines[last] == end:
                if last - number + 1 > MAX_FN_LINES:
                    yield number + 1, found.group(2), last - number + 1
                break


CRATES = ["core/src", "client/src", "bench/src", "shell-mio/src", "shell-sim/src", "cli/src", "tests/src"]
ALLOWED = ".ci/room-sizes.allowed"
# Crates held to the sizes outright: their debt is paid, nothing is listed for them.
STRICT = ("core/", "shell-mio/", "cli/")


def rooms(root: pathlib.Path):
    """(key, size, limit) of every file and function of the workspace over its size,
    keyed `path` or `path:fn name` (a name twice in a file: the longer first)."""
    for crate in CRATES:
        for path in sorted((root / crate).rglob("*.rs")):
            if path.name == "tests.rs" or "tests" in path.relative_to(root / crate).parts:
                continue
            where = str(path.relative_to(root))
            if non_test_lines(path) > MAX_FILE_LINES:
                yield where, non_test_lines(path), MAX_FILE_LINES
            for _, name, length in sorted(long_functions(path), key=lambda f: -f[2]):
                yield f"{where}:fn {name}", length, MAX_FN_LINES


def room_sizes(root: pathlib.Path):
    """The core and the server over their sizes, the rest against the ratchet."""
    allowed = {}
    listed = root / ALLOWED
    if listed.exists():
        for line in listed.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                key, size = line.rsplit(" ", 1)
                allowed.setdefault(key, []).append(int(size))
    seen = {}
    for key, size, limit in rooms(root):
        if key.startswith(STRICT):
            what = "non-test lines" if ":fn " not in key else "lines"
            yield f"{key}: {size} {what}, over {limit}; split it by owner or by phase"
            continue
        index = seen.get(key, 0)
        seen[key] = index + 1
        sizes = allowed.get(key, [])
        if index >= len(sizes):
            yield (
                f"{key}: {size} lines, over {limit}, and not in {ALLOWED}; split it (the "
                "list only shrinks)"
            )
        elif size > sizes[index]:
            yield f"{key}: {size} lines, more than the {sizes[index]} {ALLOWED} allows; split it"
    for key, sizes in allowed.items():
        if seen.get(key, 0) < len(sizes):
            yield f"{key}: within its size now, or gone; take its line out of {ALLOWED}"


# Components whose files name what they take from their parent (no `use super::*;`
# outside their tests), and the node, whose replies are typed (no `rmpv`).
DOORS = ("core/src/node", "shell-mio/src/server/event_loop")
UNTYPED = ("core/src/node",)


def doors(root: pathlib.Path):
    """A problem for each glob import of a parent and each `rmpv` of the node."""
    for folder in DOORS:
        for path in sorted((root / folder).rglob("*.rs")):
            code = [
                line
                for line in path.read_text().splitlines()[: non_test_lines(path)]
                if not line.lstrip().startswith("//")
            ]
            where = path.relative_to(root)
            if any(line.strip() == "use super::*;" for line in code):
                yield f"{where}: `use super::*;` outside its tests; import what it uses by name"
            if folder in UNTYPED and any(re.search(r"\brmpv\b", line) for line in code):
                yield f"{where}: `rmpv` in the node; its replies are typed (protocol::Answer)"


def sizes(table: str, core: pathlib.Path):
    """(the file, the size the map gives) for each size in the table."""
    for row in table.splitlines():
        if not row.startswith("| "):
            continue
        columns = row.split(" | ")
        code = columns[1] if len(columns) > 1 else ""
        for path, size in FILE.findall(code):
            yield core / path, int(size)
        for folder, inside in FOLDER.findall(code):
            for name, size in ENTRY.findall(inside):
                flat = core / folder / f"{name}.rs"
                yield (flat if flat.exists() else core / folder / name / "mod.rs"), int(size)


def main() -> int:
    if sys.argv[1] == "--list":
        root = pathlib.Path(sys.argv[2])
        for key, size, _ in rooms(root):
            if not key.startswith(STRICT):
                print(f"{key} {size}")
        return 0
    root = pathlib.Path(sys.argv[1])
    design = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else root / "docs/design.md"
    core = root / "core/src"
    text = design.read_text()
    start = text.index("## The component map")
    end = text.find("\n## ", start + 1)
    table = text[start : end if end >= 0 else len(text)]
    problems = []
    named = set()
    for path, size in sizes(table, core):
        named.add(path)
        if not path.exists():
            problems.append(f"{path.relative_to(root)}: named in the map, but there is no such file")
        elif non_test_lines(path) != size:
            problems.append(
                f"{path.relative_to(root)}: the map says {size} non-test lines, the file has "
                f"{non_test_lines(path)}; update docs/design.md's component map"
            )
    for path in sorted((core / "node").rglob("*.rs")):
        if path not in named:
            problems.append(
                f"{path.relative_to(root)}: a file of the node the component map does not "
                "name; give it a row, or name it in its owner's row with its size"
            )
    problems.extend(room_sizes(root))
    problems.extend(doors(root))
    for problem in problems:
        print(f"design-map: {problem}", file=sys.stderr)
    if not problems:
        print(
            f"design-map: {len(named)} sizes in docs/design.md's component map, each the "
            f"file's; no file of the core, the server or cli/ over {MAX_FILE_LINES} non-test lines, "
            f"no function over {MAX_FN_LINES}; the rest of the workspace within {ALLOWED}; "
            f"no `use super::*` in {' or '.join(DOORS)}, no `rmpv` in the node"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
