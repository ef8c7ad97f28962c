"""The Python recipes' pure parts (recipes/python/arithmetic.py, recipes/tool-calc-py/agent.py) and the
Env line protocol of the helper module (recipes/python/molt_agent.py), without a policy. The same
programs against a real engine and the real loopback server: test/unit/python-agents.test.ts."""
import io
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "recipes" / "python"), str(ROOT / "recipes" / "tool-calc-py")]

from arithmetic import (  # noqa: E402
    EVAL_GROUP_BASE, ToolInputError, boxed_answer, calculate, demonstration_problem, group_problem, parse_number,
    problem_for, split_of,
)
import agent as tool_calc  # noqa: E402  (recipes/tool-calc-py/agent.py)
from molt_agent import serve_env  # noqa: E402


@pytest.mark.parametrize("text,want", [
    ("42", 42), (" 42 apples", 42), ("x = -5", -5), ("+5", 5), ("\u22125", -5), ("1,234", 1234), ("1 234", 1234),
    ("1,234.5", Fraction(2469, 2)), ("3/4", Fraction(3, 4)), ("- 3 / 4", Fraction(-3, 4)), ("3/-4", Fraction(-3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{-3}{4}", Fraction(-3, 4)), ("1 1/2", Fraction(3, 2)),
    ("-1 1/2", Fraction(-3, 2)), ("0.75", Fraction(3, 4)), ("\\$12.50", Fraction(25, 2)), ("none", None), ("7/0", None),
])
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_boxed_answer_is_the_last_box():
    assert boxed_answer("\\boxed{1} then \\boxed{\\frac{7}{4}} liters") == Fraction(7, 4)
    assert boxed_answer("\\boxed{ -1,204 dollars }") == -1204
    assert boxed_answer("12") is None and boxed_answer("\\boxed{12") is None and boxed_answer(None) is None


def test_calculator_is_exact_and_refuses_anything_else():
    assert calculate("1+2*3") == 7 and calculate("(1+2)*3") == 9 and calculate("0.1+0.2") == Fraction(3, 10)
    assert calculate("-(2+3)/-5") == 1 and calculate("7/4") == Fraction(7, 4)
    for bad, message in [("1/0", "division by zero"), ("2**3", "only"), ("__import__('os')", "only"),
                         ("2*(3", "not an arithmetic expression"), ("1+" * 150 + "1", "longer than 200")]:
        with pytest.raises(ToolInputError, match=message.replace("(", r"\(").replace("*", r"\*")):
            calculate(bad)


def test_problems_are_seeded_and_the_eval_split_is_held_out():
    assert problem_for(5, "train") == problem_for(5, "train")
    train = {problem_for(s, "train", 0.2).text for s in range(1500)}
    held = [group_problem({"groupIndex": EVAL_GROUP_BASE + i, "seed": 9000 + i}, {"eval_fraction": 0.2}) for i in range(200)]
    assert all(split_of(p.text, 0.2) == "eval" and p.text not in train for p in held)
    assert all(split_of(t, 0.2) == "train" for t in train)
    for i in range(50):
        p = demonstration_problem(i, {})
        assert split_of(p.text, 0.1) == "train" and calculate(p.steps[-1]) == p.answer


def test_tool_reply_and_score():
    assert tool_calc.tool_reply("calculator", '{"expression": "48*6"}') == "288"
    assert tool_calc.tool_reply("calculator", '{"expression": "1/0"}') == "error: division by zero"
    assert tool_calc.tool_reply("calculator", '{"expression": ') == 'error: the arguments are not JSON: {"expression": '
    assert tool_calc.tool_reply("calculator", "[1]") == 'error: the arguments must be {"expression": "<arithmetic>"}'
    assert tool_calc.tool_reply("search", "{}") == 'error: unknown tool "search"; the only tool is calculator'
    label = {"answer": "7/4", "max_turns": 4, "format_penalty": 0.1}
    assert [tool_calc.score(t, label) for t in ["\\boxed{1.75}", "\\boxed{2}", "7/4", None]] == [1.0, 0.0, -0.1, -0.1]


def test_demonstration_replays_through_the_tool_and_scores_one():
    demo = tool_calc.demonstration(3, {})
    assert demo == tool_calc.demonstration(3, {})
    calls = [(m["tool_calls"][0], r) for m, r in zip(demo["messages"][1::2], demo["messages"][2::2]) if m.get("tool_calls")]
    assert calls and all(r["content"] == tool_calc.tool_reply("calculator", json.dumps(c["function"]["arguments"])) for c, r in calls)
    answer = tool_calc.show(demonstration_problem(3, {}).answer)
    assert tool_calc.score(demo["messages"][-1]["content"], {"answer": answer, "format_penalty": 0.1}) == 1.0


class Echo:
    """An env for the protocol: prints (which must not reach the protocol's stdout), fails on request."""

    def __init__(self, settings):
        self.settings = settings

    def reset(self, task):
        print("hello from reset")
        return f"obs {task['seed']}", {"k": 1}

    def step(self, text, token_ids):
        if text == "boom":
            raise KeyError("boom")
        return {"observation": "more", "reward": len(token_ids), "terminated": False, "truncated": text == "stop"}


def test_serve_env_line_protocol():
    lines = [{"method": "reset", "settings": {}, "task": {"groupIndex": 0, "episode": 0, "seed": 7}},
             {"method": "step", "text": "ab", "token_ids": [1, 2]}, {"method": "step", "text": "boom", "token_ids": []},
             {"method": "nope"}, {"method": "close"}, {"method": "step", "text": "never read", "token_ids": []}]
    out = io.StringIO()
    serve_env(Echo, stdin=io.StringIO("".join(json.dumps(x) + "\n" for x in lines)), stdout=out)
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    assert replies[0] == {"observation": "obs 7", "info": {"k": 1}}
    assert replies[1] == {"observation": "more", "reward": 2, "terminated": False, "truncated": False}
    assert replies[2]["error"] == "KeyError: 'boom'" and 'test_python_recipes.py", line' in replies[2]["traceback"]
    assert replies[3]["error"] == "ValueError: unknown method 'nope'"
    assert len(replies) == 4  # close ended it
