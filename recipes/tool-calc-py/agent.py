"""The tool-calc agent (recipes/tool-calc) written in Python with the stock `openai` package: the
policy solves an arithmetic word problem with a calculator tool; a turn may call the tool several
times; the episode ends on a reply without a tool call (the final answer) or at env.max_turns.
Reward: 1 for the right number in the final answer's \\boxed{}, 0 for another, -env.format_penalty
for no boxed number (or no final answer). Run by Molt as a command (agent.ts beside this file)."""
import json

from arithmetic import ToolInputError, boxed_answer, calculate, demonstration_problem, group_problem, show
from molt_agent import chat_agent

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate + - * / with parentheses exactly",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def user_message(problem):
    return {"role": "user", "content": f"{problem.text} Use the calculator. Put the final answer in \\boxed{{}}."}


def prompt(task, settings):
    """Once per prompt group: the problem, the tool, and what run() needs (it sees no settings)."""
    p = group_problem(task, settings)
    label = {"answer": show(p.answer), "max_turns": int(settings.get("max_turns", 4)),
             "format_penalty": float(settings.get("format_penalty", 0.1))}
    return {"messages": [user_message(p)], "tools": [CALCULATOR], "label": label}


def tool_reply(name, arguments):
    """The tool's answer to one call; what the model got wrong comes back as an error message."""
    if name != "calculator":
        return f"error: unknown tool {json.dumps(name)}; the only tool is calculator"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return f"error: the arguments are not JSON: {arguments[:100]}"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: the arguments must be {"expression": "<arithmetic>"}'
    try:
        return show(calculate(args["expression"]))
    except ToolInputError as e:
        return f"error: {e}"


def score(final, label):
    got = None if final is None else boxed_answer(final)
    if got is None:
        return -label["format_penalty"]
    return 1.0 if show(got) == label["answer"] else 0.0


def solve(client, model, messages, tools, label):
    """The agent loop: returns (reward, info)."""
    messages = list(messages)
    final, turns, tool_calls, tool_errors = None, 0, 0, 0
    while final is None and turns < label["max_turns"]:
        turns += 1
        message = client.chat.completions.create(model=model, messages=messages, tools=tools).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        if message.tool_calls:
            for call in message.tool_calls:
                result = tool_reply(call.function.name, call.function.arguments)
                tool_calls += 1
                tool_errors += result.startswith("error:")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        elif "<tool_call>" in content:
            # The loopback returns a call it cannot parse (bad JSON, cut off by max_tokens) as text.
            tool_calls += 1
            tool_errors += 1
            messages.append({"role": "tool", "tool_call_id": f"malformed-{turns}", "content": "error: malformed tool call (not JSON)"})
        else:
            final = content
    info = {"turns": turns, "tool_calls": tool_calls, "tool_errors": tool_errors, "final": final, "messages": messages}
    return score(final, label), info


def run(ctx):
    reward, info = solve(ctx.openai(), ctx.model, ctx.messages, ctx.tools, ctx.label)
    info.pop("messages")
    return reward, info


def demonstration(index, settings):
    """A correct episode for supervised warm-up: one calculator call per step, then the boxed answer."""
    p = demonstration_problem(index, settings)
    messages = [user_message(p)]
    for i, expression in enumerate(p.steps):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": show(calculate(expression))}]
    messages.append({"role": "assistant", "content": f"The answer is \\boxed{{{show(p.answer)}}}."})
    return {"messages": messages, "tools": [CALCULATOR]}


if __name__ == "__main__":
    chat_agent(prompt, run, demonstration)
