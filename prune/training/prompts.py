"""Training prompts for distillation data (`prune.training.data`), kept apart from evaluation.

Prompts come from real text that no evaluation suite uses: functions, docstrings and code windows of the
CPython standard library on this machine (code completion, explanation, tests, review, continuation,
instruction-following on documentation), plus a small share of synthetic arithmetic word problems.
In these styles none come from HumanEval, MT-Bench or CHAMP; when those suites load, any prompt that
contains one of their prompts is dropped as well (the `train` and `champ` styles below take suite prompts
on purpose, from the suites' training parts, and drop any prompt of a held-out part). Selection is a pure
function of (stdlib contents, number, seed, style).

Five styles. `general` (above) teaches the drafter the target's voice on varied tasks. `suites` asks in
the exact wording of the suites' instructions, on material of our own: "Complete the following Python
function" around a standard-library function's signature and docstring (HumanEval's shape), and "Solve the
following problem..." around synthetic competition problems in CHAMP's plain-text style (counting,
number theory, sequences, polynomials, inequalities, probability). The suites' instruction wording is what
the target's answers follow: a drafter trained on general data alone accepted far less on the suites than
on held-out general data (first slot 0.44 on humaneval vs 0.75), and this data narrows that gap. Its
pool is small: two seeds share much of it (887 of 2048 prompts of seed 1 are in seed 0's 1536), so a
second seed adds fewer new sequences than its count.
`train` takes the prompts of the suites' training parts verbatim (HumanEval 82, CHAMP 135, MT-Bench 40
first turns: what a user distilling on their own traffic does); it never takes a prompt of a calibration
or evaluation part, so calibration and held-out tau stay unseen (decode/suites.py has the three-way split).
`champ` takes CHAMP's own prompt formats around its training-part problems (`decode.suites.
champ_prompt_variants`: with partial solutions, hints, relevant or misleading concepts, or asking to
explain a concept; 921 distinct prompts): more of the target's math answers in the suite's wording than
the 135 plain prompts give, with no evaluation problem in them (formats quoting other problems are left out).
`everyday` is neither code nor competition math: instructions, everyday questions, arithmetic word problems
and editing tasks from templates of our own (prune/training/everyday.py), for users whose traffic is general chat.
"""

import ast
import functools
import os
import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo",
             "pydoc_data", "encodings", "lib2to3", "ensurepip", "config-3", "tkinter"}
MAX_SNIPPET_LINES, MAX_SNIPPET_CHARS = 40, 1600

CODE_TASKS = {
    "complete": "Complete the following Python code:\n\n```python\n{head}\n```",
    "explain": "Explain what this Python code does, step by step:\n\n```python\n{code}\n```",
    "tests": "Write pytest unit tests for this function:\n\n```python\n{code}\n```",
    "review": "Review this Python code. Point out possible bugs and suggest improvements:\n\n```python\n{code}\n```",
    "annotate": "Add type hints and a clear docstring to this code:\n\n```python\n{code}\n```",
}
DOC_TASKS = {
    "implement": "Write a Python function `{name}{args}` that does the following:\n\n{doc}",
    "summarize": "Summarize the following documentation in two or three sentences:\n\n{doc}",
    "beginner": "Explain this to someone who is new to programming:\n\n{doc}",
    "keypoints": "Turn this description into a short numbered list of key points:\n\n{doc}",
    "email": "Write a short email to a colleague recommending `{module}.{name}`. Its documentation says:\n\n{doc}",
}
CONTINUE_TASK = "Continue this Python module from where it stops:\n\n```python\n{window}\n```"


def stdlib_files(stdlib_dir: str | os.PathLike | None = None) -> list[Path]:
    """Python source files of the standard library, sorted by relative path (tests and vendored code excluded)."""
    return list(_source_files(Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()))


@functools.lru_cache(maxsize=4)
def _source_files(root: Path) -> tuple[Path, ...]:
    files = [
        path for path in root.rglob("*.py")
        if not any(part in SKIP_DIRS or part.startswith("config-") for part in path.relative_to(root).parts[:-1])
        and not path.name.startswith("test_")
    ]
    return tuple(sorted(files, key=lambda path: str(path.relative_to(root))))


def _clip(lines: list[str]) -> str:
    text = "\n".join(lines[:MAX_SNIPPET_LINES]).rstrip()
    return text[:MAX_SNIPPET_CHARS]


def _parse_module(path: Path, root: Path):
    """(syntax tree, source lines, dotted module name) of one source file, or None if it does not parse."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return tree, source.splitlines(), str(path.relative_to(root).with_suffix("")).replace(os.sep, ".")


def _file_prompts(path: Path, root: Path, rng: random.Random, limit: int) -> list[dict]:
    """Up to `limit` prompts drawn from one source file."""
    parsed = _parse_module(path, root)
    if parsed is None:
        return []
    tree, lines, module = parsed
    defs = [node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and 4 <= node.end_lineno - node.lineno + 1 <= 80]
    rng.shuffle(defs)
    prompts = []
    for node in defs:
        if len(prompts) >= limit:
            break
        body = lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno]
        indent = len(body[0]) - len(body[0].lstrip())
        body = [line[indent:] for line in body]
        doc = ast.get_docstring(node) or ""
        doc = doc.split("\n\n")[0].strip()
        if doc and len(doc) >= 40 and rng.random() < 0.5:
            kind = rng.choice(sorted(DOC_TASKS))
            args = "" if isinstance(node, ast.ClassDef) else "(" + ast.unparse(node.args) + ")"
            text = DOC_TASKS[kind].format(name=node.name, args=args, doc=doc[:MAX_SNIPPET_CHARS], module=module)
        else:
            kind = rng.choice(sorted(CODE_TASKS))
            cut = max(2, min(len(body) - 1, rng.randint(len(body) // 3, 2 * len(body) // 3)))
            text = CODE_TASKS[kind].format(head=_clip(body[:cut]), code=_clip(body))
        prompts.append({"id": f"{module}:{node.lineno}:{kind}", "source": f"stdlib/{kind}", "prompt": text})
    if len(prompts) < limit and len(lines) > 30:
        start = rng.randrange(0, len(lines) - 20)
        window = _clip(lines[start : start + rng.randint(15, MAX_SNIPPET_LINES)])
        if window.strip():
            prompts.append({"id": f"{module}:{start + 1}:continue", "source": "stdlib/continue",
                            "prompt": CONTINUE_TASK.format(window=window)})
    return prompts


def _math_prompt(rng: random.Random, index: int) -> dict:
    a, b, c, n = rng.randint(12, 999), rng.randint(3, 97), rng.randint(100, 5000), rng.randint(2, 40)
    texts = [
        f"What is {a} * {b}? Show your work.",
        f"Solve for x: {b}x + {a} = {c}. Explain each step.",
        f"A shop sells notebooks for ${b} each. How much do {n} notebooks cost, and how much change is left "
        f"from ${c}?",
        f"Is {2 * a + 1} a prime number? Explain how you check.",
        f"Find the greatest common divisor of {a * n} and {b * n}, and explain the method.",
        f"A train travels {c} km in {n} hours at a constant speed. What is its speed in km per hour?",
    ]
    kind = rng.randrange(len(texts))
    return {"id": f"math:{index}:{kind}", "source": "synthetic/math", "prompt": texts[kind]}


def _signature_prompts(path: Path, root: Path, rng: random.Random, limit: int) -> list[dict]:
    """Up to `limit` HumanEval-shaped prompts: a module-level function's signature and docstring."""
    from decode.suites import HUMANEVAL_INSTRUCTION

    parsed = _parse_module(path, root)
    if parsed is None:
        return []
    tree, lines, module = parsed
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
                 and len(ast.get_docstring(node) or "") >= 40 and node.end_lineno > node.body[0].end_lineno]
    rng.shuffle(functions)
    prompts = []
    for node in functions[:limit]:
        head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
        if len(head) <= MAX_SNIPPET_CHARS:
            prompts.append({"id": f"{module}:{node.lineno}:signature", "source": "stdlib/signature",
                            "prompt": HUMANEVAL_INSTRUCTION.format(prompt=head)})
    return prompts


COMPETITION_PROBLEMS = (
    "How many positive integers less than {N} are divisible by {a} or {b}?",
    "Find the remainder when {a}^{n} is divided by {m}.",
    "Find the last two digits of {a}^{n}.",
    "How many positive divisors does {N} have?",
    "Find the smallest positive integer x such that {a}x leaves a remainder of {r} when divided by {p}.",
    "In how many ways can {n} people sit around a round table, if two seatings are the same when one is a "
    "rotation of the other?",
    "In how many ways can we choose {k} objects from {n} distinct objects so that two given objects are not "
    "both chosen?",
    "How many strings of length {n} made of the letters A and B contain no two consecutive A's?",
    "A bag holds {a} red balls and {b} blue balls. Two balls are drawn without replacement. What is the "
    "probability that they have the same color?",
    "How many ways are there to walk from (0, 0) to ({a}, {k}) using unit steps right or up?",
    "A fair die is rolled {k} times. What is the probability that the sum is even?",
    "The sequence a_1, a_2, ... satisfies a_1 = {a} and a_(n+1) = {k} a_n - {r}. Find a_{n}.",
    "The sequence a_n satisfies a_1 = 1, a_2 = {k}, and a_(n+2) = a_(n+1) + a_n. Find a_{n}.",
    "Find the sum of all positive integers n less than {N} such that n^2 + {a} is divisible by {p}.",
    "Let P(x) be a polynomial with P({a}) = {b} and P({k}) = {c}. What is the remainder when P(x) is divided "
    "by (x - {a})(x - {k})?",
    "Find all real numbers x such that x^2 - {s}x + {q} = 0, and the sum of their cubes.",
    "The roots of x^3 - {s}x^2 + {q}x - {r} = 0 are u, v and w. Find u^2 + v^2 + w^2.",
    "For positive reals x and y with x + y = {s}, what is the maximum of xy^{k}?",
    "For positive reals a, b, c with a + b + c = {s}, find the minimum of 1/a + 1/b + 1/c.",
    "Prove that for every positive integer n, n^{p} - n is divisible by {p}.",
    "Prove that the product of any {k} consecutive integers is divisible by {k}!.",
    "Prove that among any {n} integers there are two whose difference is divisible by {m}.",
    "Prove that for all positive reals x and y, x^{k} + y^{k} >= x^{j} y + x y^{j}.",
    "Find all integer solutions (x, y) of x^2 - y^2 = {N}.",
    "How many {k}-digit positive integers have digits that sum to {r}?",
    "A {a} x {b} grid of unit squares is given. How many rectangles are formed by its lines?",
    "What is the coefficient of x^{k} in the expansion of (1 + {a}x)^{n}?",
    "Find the greatest common divisor of {a}n + {b} and {k}n + {r} over all positive integers n, and the n "
    "where it is largest.",
)
SMALL_PRIMES = (3, 5, 7, 11, 13)


def _competition_prompt(rng: random.Random, index: int) -> dict:
    """A CHAMP-shaped prompt: a synthetic competition problem under the suite's instruction."""
    from decode.suites import CHAMP_INSTRUCTION

    kind = rng.randrange(len(COMPETITION_PROBLEMS))
    k = rng.randint(2, 6)
    values = dict(N=rng.randint(50, 2000), a=rng.randint(2, 19), b=rng.randint(2, 23), c=rng.randint(1, 99),
                  n=rng.randint(5, 30), m=rng.randint(3, 12), r=rng.randint(1, 9), p=rng.choice(SMALL_PRIMES),
                  k=k, j=k - 1, s=rng.randint(3, 20), q=rng.randint(1, 30))
    text = COMPETITION_PROBLEMS[kind].format(**values)
    return {"id": f"competition:{index}:{kind}", "source": "synthetic/competition",
            "prompt": CHAMP_INSTRUCTION.format(text=text)}


STYLES = ("general", "suites", "train", "champ", "everyday")  # the first is the default
# Styles made of suite material: checked against the held-out parts only, and strictly (no suites, no data).
SUITE_STYLES = ("train", "champ")


def training_part_prompts(num_prompts: int, seed: int = 0) -> list[dict]:
    """`num_prompts` prompt records of the suites' training parts, in a seeded order (style `train`)."""
    from decode.suites import SUITES, load_suite

    records = [{"id": record["id"], "source": f"suite/{name}:train", "prompt": record["prompt"]}
               for name in SUITES for record in load_suite(f"{name}:train")]
    return _seeded_draw(records, num_prompts, seed, "train", "the suites' training parts")


def champ_variant_prompts(num_prompts: int, seed: int = 0) -> list[dict]:
    """`num_prompts` of CHAMP's own prompt formats around its training-part problems (style `champ`)."""
    from decode.suites import champ_prompt_variants

    records = [{**record, "source": "suite/champ:train-variants"} for record in champ_prompt_variants("train")]
    return _seeded_draw(records, num_prompts, seed, "champ", "CHAMP's prompt formats on its training-part problems")


def _seeded_draw(records: list[dict], num_prompts: int, seed: int, style: str, what: str) -> list[dict]:
    from models.errors import ConfigError

    if num_prompts > len(records):
        raise ConfigError(f"--style {style} has {len(records)} prompts ({what}); "
                          f"ask for --num-prompts {len(records)} or fewer")
    records = list(records)
    random.Random(seed).shuffle(records)
    return records[:num_prompts]


def collect_training_prompts(
    num_prompts: int, seed: int = 0, stdlib_dir: str | os.PathLike | None = None, math_share: float = 0.1,
    style: str = STYLES[0],
) -> list[dict]:
    """`num_prompts` distinct prompt records `{id, source, prompt}`, deterministic for (stdlib, seed, style).

    Reads only as many files as needed: files are visited in a seeded order, a few prompts each, and the
    pass repeats with more prompts per file when the library is exhausted. `style="suites"` draws half
    competition problems and half function signatures (see the module docstring); `math_share` is then unused.
    `style="train"`, `"champ"` and `"everyday"` read no library: see `training_part_prompts`,
    `champ_variant_prompts`, `prune.training.everyday.everyday_prompts`.
    """
    from models.errors import ConfigError, DataError

    if style not in STYLES:
        raise ConfigError(f"unknown prompt style {style!r}; choose one of {', '.join(STYLES)} (--style)")
    if style == "train":
        return training_part_prompts(num_prompts, seed)
    if style == "champ":
        return champ_variant_prompts(num_prompts, seed)
    if style == "everyday":
        from prune.training.everyday import everyday_prompts

        return everyday_prompts(num_prompts, seed)
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()
    files = stdlib_files(root)
    if not files:
        raise DataError(f"no Python source files under {root}; pass the standard library folder")
    rng = random.Random(seed)
    rng.shuffle(files)
    num_math = int(round(num_prompts * (0.5 if style == "suites" else math_share)))
    make_math, from_file = ((_competition_prompt, _signature_prompts) if style == "suites"
                            else (_math_prompt, _file_prompts))
    prompts, seen = [], set()
    # Templated problems repeat now and then; "suites" draws until enough are distinct ("general" keeps its
    # original fixed number of draws, so data folders made before the styles existed stay valid).
    for index in range(num_math * (4 if style == "suites" else 1)):
        record = make_math(rng, index)
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            prompts.append(record)
        if len(prompts) == num_math:
            break
    per_file, visited = 2, 0
    while len(prompts) < num_prompts:
        for path in files:
            file_rng = random.Random(f"{seed}:{per_file}:{path.relative_to(root)}")
            for record in from_file(path, root, file_rng, per_file):
                if record["prompt"] not in seen and len(prompts) < num_prompts:
                    seen.add(record["prompt"])
                    prompts.append(record)
            if len(prompts) >= num_prompts:
                break
        visited += 1
        if visited > 6:
            raise DataError(f"the standard library at {root} yields only {len(prompts)} distinct prompts; "
                            f"ask for fewer than {num_prompts}")
        per_file *= 2
    random.Random(seed + 1).shuffle(prompts)
    return prompts


def evaluation_prompts(strict: bool = False, parts: tuple[str, ...] | None = None) -> list[str] | None:
    """Every prompt text of the built-in suites (all turns); with `parts` (e.g. ("calib", "eval")), of
    those parts only.

    When the suites cannot be loaded (offline, first use), returns None after a warning on stderr, or
    raises with `strict`: the training prompts are disjoint by construction, the filter is a safeguard.
    """
    import sys

    from models.errors import D3DError

    try:
        from decode.suites import SUITES, load_suite
    except ImportError:
        if strict:
            raise
        return None
    texts = []
    for name in SUITES:
        try:
            specs = [name] if parts is None else [f"{name}:{part}" for part in parts]
            records = [record for spec in specs for record in load_suite(spec)]
        except D3DError as exc:
            if strict:
                raise
            print(f"Warning: not checking training prompts against the {name} suite ({exc})", file=sys.stderr)
            return None
        for record in records:
            texts.append(record.get("prompt") or "")
            texts.extend(record.get("turns") or [])
            texts.extend(m.get("content", "") for m in record.get("messages") or [])
    return [t.strip() for t in texts if t and t.strip()]


def drop_evaluation_overlap(prompts: list[dict], eval_texts: list[str]) -> list[dict]:
    """Prompts that contain no evaluation prompt (and equal none)."""
    return [p for p in prompts if not any(text in p["prompt"] for text in eval_texts)]


def select_training_prompts(num_prompts: int, seed: int, stdlib_dir, style: str) -> tuple[list[dict], list[str] | None]:
    """(`num_prompts` training prompt records with no evaluation prompt in them, the evaluation texts checked
    against or None when the suites could not be loaded); what `generate_distillation_data` answers."""
    from decode.suites import HELD_OUT_PARTS

    # The train and champ styles consist of suite material: checked against the held-out parts only.
    suite_style = style in SUITE_STYLES
    eval_texts = evaluation_prompts(strict=suite_style, parts=HELD_OUT_PARTS if suite_style else None)
    asked = num_prompts
    while True:  # ask for more when the evaluation filter dropped some (it almost never does)
        prompts = collect_training_prompts(asked, seed, stdlib_dir, style=style)
        kept = drop_evaluation_overlap(prompts, eval_texts) if eval_texts is not None else prompts
        if len(kept) >= num_prompts:
            return kept[:num_prompts], eval_texts
        asked += 2 * (num_prompts - len(kept))
