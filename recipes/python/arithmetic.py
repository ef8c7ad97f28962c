"""Arithmetic word problems, a calculator and a \\boxed{} verifier, in Python: what the Python recipes
(tool-calc-py, math-py) share. The TypeScript twin is recipes/math/problems.ts (same rules, its own
random streams). Exact: fractions.Fraction throughout, so 1.75 == 7/4 and 0.1 + 0.2 == 3/10."""
import ast
import random
import re
import zlib
from dataclasses import dataclass
from fractions import Fraction


class ToolInputError(ValueError):
    """What the model got wrong (a malformed expression, a division by zero): the agent sends it back
    as the tool's answer. Any other exception from a tool is a bug in the recipe."""


MAX_EXPRESSION = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def calculate(expression):
    """+ - * / and parentheses over decimal numbers, exactly (Python's own parser, nothing else allowed)."""
    if not isinstance(expression, str):
        raise ToolInputError("expression must be a string")
    if len(expression) > MAX_EXPRESSION:
        raise ToolInputError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolInputError(f"not an arithmetic expression: {expression!r}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))  # the literal as written: 0.1 is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ToolInputError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ToolInputError(f"only + - * / and parentheses are allowed, got {ast.unparse(node)!r}")

    return value(tree.body)


def show(x):
    """A fraction as the calculator and the demonstrations write it: 7/4, -3, 12."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def last_boxed(text):
    """The content of the last \\boxed{...} (braces balanced), or None."""
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    depth = 0
    for i in range(at + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[at + len("\\boxed{"):i]
    return None


_INT = r"\d{1,3}(?:[, ]\d{3})+(?!\d)|\d+"
_NUM = rf"(?:{_INT})(?:\.\d+)?"
_NUMBER = re.compile(rf"([+-]?)\s*(?:(\d+)\s+(?=\(?\d+\)?\s*/))?\(?({_NUM})\)?(?:\s*/\s*\(?([+-]?)\s*({_NUM})\)?)?")


def parse_number(text):
    """The first number in the text: signs, thousands separators (1,234 or 1 234), decimals, fractions
    (3/4, \\frac{3}{4}), mixed numbers (1 1/2); trailing text is ignored. None when there is none."""
    t = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    t = re.sub(r"[\u2212\u2013]", "-", t)
    t = re.sub(r"\\[,!; ]|\\\$|\$", " ", t)
    m = _NUMBER.search(t)
    if not m:
        return None
    clean = lambda s: Fraction(re.sub(r"[, ]", "", s))
    value = clean(m.group(3))
    if m.group(5) is not None:
        den = clean(m.group(5))
        if den == 0:
            return None
        value = value / den * (-1 if m.group(4) == "-" else 1)
    if m.group(2) is not None:
        value += int(m.group(2))
    return -value if m.group(1) == "-" else value


def boxed_answer(text):
    """The number in the text's last \\boxed{}, or None."""
    boxed = last_boxed(text or "")
    return None if boxed is None else parse_number(boxed)


@dataclass
class Problem:
    text: str
    answer: Fraction
    steps: list  # calculator expressions that solve it, in order


def _templates(r, name):
    a, b, c = r.randint(2, 999), r.randint(2, 99), r.randint(1, 99)
    return [
        (f"{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?", [f"{a}+{b}"]),
        (f"A box holds {b} pens. How many pens are in {c} boxes?", [f"{b}*{c}"]),
        (f"The temperature was {c - 40} degrees and fell by {b} degrees. What is the temperature now?", [f"{c - 40}-{b}"]),
        (f"{a} liters of juice are shared equally among {b % 11 + 2} bottles. How many liters go in each bottle?",
         [f"{a}/{b % 11 + 2}"]),
        (f"{name} sells {b} boxes of {c % 19 + 6} eggs and {a % 99 + 1} single eggs. How many eggs does {name} sell?",
         [f"{b}*{c % 19 + 6}", f"{b * (c % 19 + 6)}+{a % 99 + 1}"]),
        (f"{name} has {a + 1000} dollars, spends {c} and splits the rest equally among {b % 7 + 2} friends. "
         "How many dollars does each friend get?", [f"{a + 1000}-{c}", f"{a + 1000 - c}/{b % 7 + 2}"]),
    ]


def split_of(text, eval_fraction):
    """train or eval, from a hash of the problem's text: the same problem is never in both."""
    return "eval" if zlib.crc32(text.encode()) % 10_000 < eval_fraction * 10_000 else "train"


def problem_for(seed, split, eval_fraction=0.1):
    """The problem for a seed, drawn again until it falls in the wanted split."""
    r = random.Random(seed)
    while True:
        text, steps = r.choice(_templates(r, r.choice(["Mia", "Tom", "Ana", "Raj", "Lea", "Sam"])))
        if split_of(text, eval_fraction) == split:
            return Problem(text, calculate(steps[-1]), steps)


EVAL_GROUP_BASE = 1_000_000_000  # activities/evaluate.ts: held-out groups count up from here


def group_problem(task, settings):
    """The problem of a prompt group (task: groupIndex, seed); held-out groups get eval problems."""
    split = "eval" if task["groupIndex"] >= EVAL_GROUP_BASE else "train"
    return problem_for(task["seed"], split, float(settings.get("eval_fraction", 0.1)))


def demonstration_problem(index, settings):
    """Demonstration i (supervised warm-up): a train problem from a seed stream of its own."""
    return problem_for(f"demo-{index}", "train", float(settings.get("eval_fraction", 0.1)))
