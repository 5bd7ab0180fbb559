"""The knob table of docs/serving.md, generated from the config so it cannot drift from the code.

Owns rendering (pure: one row per knob, with its flag, its default from configs/default.json, its rule from
`sgl_dspark.config.RULES` and its meaning from the comment on its field in the knob dataclass, the one place a knob
is described) and splicing the table between the knob-table markers. Reads the config module by attribute, so
renames there need no change here. Must not change the config.

    python -m sgl_dspark.tools.knobs_doc --write docs/serving.md   # regenerate; --check: exit 1 if it is stale
"""

import argparse
import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

from sgl_dspark import config

START, END = "<!-- knob-table:start -->", "<!-- knob-table:end -->"
FIELD = re.compile(r"^\s+(\w+):[^#]*#\s*(.*)$")  # `name: type  # meaning`
CONTINUED = re.compile(r"^\s+#\s*(.*)$")  # a comment line under a field goes on with its meaning


def knob_class() -> type:
    """The frozen knob dataclass, whatever its name: the type `load_config` returns."""
    return type(config.load_config())


def meanings(cls: type | None = None) -> dict[str, str]:
    """knob -> its one-line meaning: the comment on its field (continued on the comment lines below it).
    ValueError naming the first knob without one."""
    cls = cls or knob_class()
    out: dict[str, str] = {}
    last = None
    for line in inspect.getsource(cls).splitlines():
        if (m := FIELD.match(line)) and not line.lstrip().startswith("#"):
            last = m.group(1)
            out[last] = m.group(2).strip()
        elif last is not None and (m := CONTINUED.match(line)):
            out[last] += " " + m.group(1).strip()
        else:
            last = None
    knobs = [f.name for f in dataclasses.fields(cls)]
    missing = [k for k in knobs if not out.get(k)]
    if missing:
        raise ValueError(f"knob {missing[0]!r} has no meaning: give its field in {cls.__name__} a '# ...' comment")
    return {k: out[k] for k in knobs}


def defaults() -> dict:
    """configs/default.json's knobs (the only place defaults live)."""
    return config.read_preset(config.preset_path(config.DEFAULT_PRESET))


def presets() -> list[tuple[str, str, dict]]:
    """(name, description, knobs it sets) of every preset in configs/, default first."""
    out = []
    for path in sorted(config.PRESET_DIR.glob("*.json"), key=lambda p: (p.stem != config.DEFAULT_PRESET, p.stem)):
        doc = json.loads(path.read_text())
        out.append((path.stem, doc.get("description", ""), config.read_preset(path)))
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def value(v) -> str:
    return f"`{json.dumps(v)}`" if not isinstance(v, str) else f"`{v}`"


def render() -> str:
    """The markdown between the markers: the preset flag, one row per knob, then the presets."""
    means, default = meanings(), defaults()
    names = [p[0] for p in presets()]
    rows = ["| flag | default | allowed | meaning |", "|---|---|---|---|",
            f"| `{config.cli_flag(config.PRESET_KNOB)}` | `{config.DEFAULT_PRESET}` | {cell(' | '.join(names))} | "
            "a preset of configs/ merged over the defaults (after the drafter's recommended.json; flags win) |"]
    for knob, meaning in means.items():
        rows.append(f"| `{config.cli_flag(knob)}` | {value(default[knob])} | {cell(config.RULES[knob][1])} | "
                    f"{cell(meaning)} |")
    rows += ["", "| preset | what it is | knobs it sets |", "|---|---|---|"]
    for name, description, knobs in presets():
        sets = "all (the defaults)" if name == config.DEFAULT_PRESET else \
            ", ".join(f"{k}={json.dumps(v)}" for k, v in knobs.items())
        rows.append(f"| `{name}` | {cell(description)} | {cell(sets)} |")
    return "\n".join(rows)


def splice(text: str, table: str) -> str:
    """`text` with `table` between the knob-table markers; ValueError if they are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} markers")
    return text[:start + len(START)] + "\n" + table + "\n" + text[end:]


def spliced_table(text: str) -> str:
    """The table currently between the markers of `text`."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} markers")
    return text[start + len(START):end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sgl_dspark.tools.knobs_doc", description=__doc__.splitlines()[0])
    p.add_argument("--write", type=Path, help="splice the table between the knob-table markers of this file")
    p.add_argument("--check", type=Path, help="exit 1 if this file's table differs from the generated one")
    args = p.parse_args(argv)
    try:
        table = render()
        if args.check is not None and spliced_table(args.check.read_text()) != table:
            print(f"{args.check}: the knob table is stale; run python -m sgl_dspark.tools.knobs_doc --write "
                  f"{args.check}", file=sys.stderr)
            return 1
        if args.write is not None:
            args.write.write_text(splice(args.write.read_text(), table))
            print(f"updated the knob table in {args.write}")
        if args.write is None and args.check is None:
            print(table)
    except (OSError, ValueError) as exc:
        print(f"sgl_dspark.tools.knobs_doc: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
