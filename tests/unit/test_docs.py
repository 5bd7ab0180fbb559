"""The README and docs/ stay true to the code: the generated knob table is current, every relative link resolves,
every shell command parses against what it names (Makefile targets, modules and files, their flags), and the
glossary in docs/architecture.md is the package docstring's. Pure and fast: reads files and argparse parsers only.
"""

import dataclasses
import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

import sgl_dspark
from sgl_dspark import config
from sgl_dspark.tools import knobs_doc

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PYTHONS = {"python", "python3", ".venv/bin/python"}
OUR_PACKAGES = {"sgl_dspark", "benchmarks", "scheduler_patch", "attention_backends", "tests"}
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the knob table --------------------------------------------------------------------------------------------

def test_the_knob_table_in_serving_md_is_the_generated_one():
    text = (ROOT / "docs" / "serving.md").read_text()
    assert knobs_doc.spliced_table(text) == knobs_doc.render(), \
        "docs/serving.md's knob table is stale: python -m sgl_dspark.tools.knobs_doc --write docs/serving.md"


def test_every_knob_has_a_row_a_default_and_a_meaning():
    table = knobs_doc.render()
    assert list(knobs_doc.meanings()) == list(config.KNOBS)
    assert set(knobs_doc.defaults()) == set(config.KNOBS)
    for knob in config.KNOBS:
        assert f"| `{config.cli_flag(knob)}` |" in table


def test_a_knob_without_a_comment_has_no_meaning_and_is_named():
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        described: int  # what it does
        # under a comment line of its own
        bare: int

    with pytest.raises(ValueError, match="'bare'"):
        knobs_doc.meanings(Knobs)


def test_meanings_join_continued_comment_lines():
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        long: int  # first half
        # second half
        short: str  # one line

    assert knobs_doc.meanings(Knobs) == {"long": "first half second half", "short": "one line"}


def test_splice_replaces_only_between_the_markers():
    text = f"a\n{knobs_doc.START}\nold\n{knobs_doc.END}\nb\n"
    assert knobs_doc.splice(text, "| x |") == f"a\n{knobs_doc.START}\n| x |\n{knobs_doc.END}\nb\n"
    with pytest.raises(ValueError):
        knobs_doc.splice("no markers", "| x |")


# -- links -----------------------------------------------------------------------------------------------------

def without_code(text: str) -> str:
    return re.sub(FENCE, "", text)


def slug(heading: str) -> str:
    """A heading's GitHub anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", without_code(path.read_text()), re.M)}


def test_slug_matches_githubs_anchor_rule():
    assert slug('What "lossless" means, and what the tests show') == "what-lossless-means-and-what-the-tests-show"
    assert slug("A second architecture: Gemma-3-270M") == "a-second-architecture-gemma-3-270m"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(without_code(doc.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {rel(file)}")
    assert not broken, f"{rel(doc)}: " + "; ".join(broken)


# -- commands --------------------------------------------------------------------------------------------------

def code_lines(text: str) -> list[list[str]]:
    """Each ```bash / ```sh block's logical lines (continuations joined), comments and blank lines dropped."""
    blocks = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "sh", "shell"):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        blocks.append([ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")])
    return blocks


def commands(line: str) -> list[list[str]]:
    """A shell line -> its simple commands (words), `$(...)` substitutions included as commands of their own."""
    inner = SUBSTITUTION.findall(line)
    words = shlex.split(SUBSTITUTION.sub("SUBSTITUTED", line), comments=True)
    out, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            out.append(current)
            current = []
        else:
            current.append(word)
    out.append(current)
    return [c for c in out if c] + [c for text in inner for c in commands(text)]


@functools.cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_-]+)\s*:(?!=)", text, re.M)}


@functools.cache
def server_flags() -> frozenset[str]:
    """`python -m sglang.launch_server` flags: SGLang's parser's, its builtin DSPARK's own knobs replaced by the
    plugin's (`--speculative-dspark-preset` and one per knob)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    prefix = config.cli_flag("")
    sglang = {s for a in parser._actions for s in a.option_strings if not s.startswith(prefix)}
    return frozenset(sglang | {config.cli_flag(k) for k in (config.PRESET_KNOB, *config.KNOBS)})


def module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


def flag_problems(program: str, source: Path | None, args: list[str]) -> list[str]:
    # A quoted value with a space (`--server-args '--tp-size 2'`) is an argument, not a flag.
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2 and " " not in a]
    if program == "sglang.launch_server":
        return [f"{program}: unknown flag {f}" for f in flags if f not in server_flags()]
    text = source.read_text() if source is not None else ""
    return [f"{program}: {f} is not in its argument parser" for f in flags
            if f'"{f}"' not in text and f"'{f}'" not in text]


def command_problems(words: list[str]) -> list[str]:
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]  # VAR=value prefixes (or a line that only assigns)
    if not words:
        return []
    program, args = words[0], words[1:]
    if program == "make":
        targets = [a for a in args if not ASSIGNMENT.match(a) and not a.startswith("-")]
        return [f"make {t}: no such target in the Makefile" for t in targets if t not in make_targets()]
    if program == "pip":
        return []
    if program not in PYTHONS:
        return [f"{program}: a program this test does not know; add a rule for it"]
    if args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if module.split(".")[0] in OUR_PACKAGES:
            source = module_file(module)
            if source is None:
                return [f"python -m {module}: no such module in the repository"]
            return flag_problems(module, source, rest)
        if importlib.util.find_spec(module) is None:
            return [f"python -m {module}: no such module installed"]
        return flag_problems(module, None, rest) if module == "sglang.launch_server" else []
    if args and args[0].endswith(".py"):
        path = ROOT / args[0]
        return [f"python {args[0]}: no such file"] if not path.is_file() else flag_problems(args[0], path, args[1:])
    return [f"python {' '.join(args)}: neither -m MODULE nor a script"]


def undefined_variables(block: list[str]) -> list[str]:
    """Shell variables a block uses before assigning them (commands must run as written)."""
    known, problems = set(), []
    for line in block:
        for name in VARIABLE.findall(line):
            if name not in known:
                problems.append(f"${name} used before it is set in its block: {line}")
        known |= set(re.findall(r"(?:^|\s)([A-Za-z_]\w*)=", line))
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_in_a_shell_block_names_what_exists(doc):
    problems = []
    for block in code_lines(doc.read_text()):
        problems += undefined_variables(block)
        for line in block:
            for words in commands(line):
                problems += command_problems(words)
    assert not problems, f"{rel(doc)}:\n" + "\n".join(problems)


def test_the_command_checker_catches_what_it_should():
    assert command_problems(["make", "no-such-target"])
    assert command_problems(["python", "-m", "sgl_dspark.tools.no_such_tool"])
    assert command_problems(["python", "-m", "sgl_dspark.tools.knobs_doc", "--no-such-flag"])
    assert command_problems(["python", "benchmarks/no_such.py"])
    assert command_problems(["python", "-m", "sglang.launch_server", "--speculative-dspark-no-such-knob", "1"])
    assert command_problems(["python", "-m", "sglang.launch_server", "--speculative-dspark-block-size", "4"])
    assert not command_problems(["OMP_NUM_THREADS=1", "python", "-m", "sglang.launch_server", "--device", "cpu",
                                 "--speculative-dspark-max-window", "3"])
    assert not command_problems(["make", "demo", "DEMO_ARGS=--speculative-algorithm NONE"])
    assert commands("A=$(python -m x y) && make test") == [["A=SUBSTITUTED"], ["make", "test"],
                                                           ["python", "-m", "x", "y"]]
    assert undefined_variables(["python -m x --out $OUT"]) and not undefined_variables(["OUT=o", "ls $OUT"])


# -- the glossary ----------------------------------------------------------------------------------------------

def glossary(text: str, start: str) -> dict[str, str]:
    """The `- term: meaning` list after the line starting with `start` (markdown bold dropped)."""
    paragraphs = text.split(start, 1)[1].split("\n\n")
    listed = next(p for p in paragraphs if p.strip().startswith("- ") or "\n- " in p)
    items = re.split(r"\n- ", "\n" + listed[listed.index("- "):])
    out = {}
    for item in filter(None, (i.strip() for i in items)):
        term, meaning = item.replace("**", "").split(":", 1)
        out[term.strip()] = " ".join(meaning.split())
    return out


def test_the_architecture_glossary_is_the_package_docstrings():
    docstring = glossary(sgl_dspark.__doc__, "Glossary")
    page = glossary((ROOT / "docs" / "architecture.md").read_text(), "## Glossary")
    assert docstring and page == docstring
    for term in ("width", "stride", "verify rows", "slot"):
        assert term in docstring
