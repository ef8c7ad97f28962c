"""Molt's helper for agents written in Python: import it, write plain functions, call one of
`chat_agent(...)` or `serve_env(...)` at the bottom of your file. The TypeScript side is
recipes/python/adapter.ts (a recipe's agent.ts is two lines); README.md, "Agents in Python".

ChatAgent form (you own the loop; Molt records every token the policy samples):

    from molt_agent import chat_agent

    def prompt(task, settings):          # once per prompt group; task: {"groupIndex", "seed"}
        return {"messages": [{"role": "user", "content": "..."}], "label": "..."}

    def run(ctx):                        # once per episode
        client = ctx.openai()            # the stock openai client, pointed at this episode's session
        reply = client.chat.completions.create(model=ctx.model, messages=ctx.messages)
        return score(reply.choices[0].message.content, ctx.label)   # a number, or (reward, info)

    if __name__ == "__main__":
        chat_agent(prompt, run)

Env form (Molt owns the LLM loop; Gymnasium-style):

    from molt_agent import serve_env

    class MyEnv:
        def __init__(self, settings): ...
        def reset(self, task): return "observation", {}                      # task: groupIndex, episode, seed
        def step(self, text, token_ids): return None, reward, True, False, {}  # obs, reward, terminated, truncated, info

    if __name__ == "__main__":
        serve_env(MyEnv)

Wire formats (for another language): a ChatAgent program gets the session in MOLT_OPENAI_BASE_URL,
MOLT_ANTHROPIC_BASE_URL, MOLT_API_KEY, MOLT_MODEL and MOLT_PROMPT (JSON: messages, tools, label,
sampling, maxContext) and prints {"reward": r, "info": {...}} as its last stdout line; called with
the argument `prompt` (or `demonstration`) it reads {"task"|"index", "settings"} on stdin and prints
the result as JSON. An Env program reads one JSON request per line on stdin and writes one JSON
reply per line on stdout: {"method": "reset", "settings", "task"} -> {"observation", "info"};
{"method": "step", "text", "token_ids"} -> {"observation", "reward", "terminated", "truncated",
"info"}; {"method": "close"} -> it exits. A failure is {"error": message, "traceback": text}.
"""
import json
import os
import sys
import traceback


class Context:
    """What one ChatAgent episode gets: the policy's endpoint and the group's prompt."""

    def __init__(self, env=os.environ):
        prompt = json.loads(env["MOLT_PROMPT"])
        self.base_url = env["MOLT_OPENAI_BASE_URL"]  # .../s/<session>/v1
        self.anthropic_base_url = env["MOLT_ANTHROPIC_BASE_URL"]
        self.api_key = env["MOLT_API_KEY"]
        self.model = env.get("MOLT_MODEL", "policy")
        self.messages = prompt["messages"]
        self.tools = prompt.get("tools")
        self.label = prompt.get("label")
        self.sampling = prompt.get("sampling", {})
        self.max_context = prompt.get("maxContext")

    def openai(self, **kwargs):
        """The stock openai client for this episode. No client retries: Molt's router already moves a
        failed request to another engine, and a retry is told apart from a new sample by the SDK's
        own retry header anyway."""
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})


def _reward_json(result):
    reward, info = result if isinstance(result, tuple) else (result, None)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
        raise TypeError(f"run() must return a finite number or (reward, info), got {result!r}")
    return json.dumps({"reward": float(reward), "info": info})


def chat_agent(prompt, run, demonstration=None):
    """The main of a ChatAgent program: `prompt` and `demonstration` answer the framework's questions
    (argument `prompt` / `demonstration`, a JSON request on stdin), `run` runs one episode."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "run"
    if mode == "run":
        with _stdout_to_stderr() as out:
            line = _reward_json(run(Context()))
        out.write(line + "\n")
    elif mode in ("prompt", "demonstration"):
        request = json.loads(sys.stdin.read())
        if mode == "demonstration" and demonstration is None:
            sys.exit(f"{sys.argv[0]} defines no demonstration(index, settings): pass one to chat_agent()")
        with _stdout_to_stderr() as out:
            if mode == "prompt":
                result = prompt(request["task"], request.get("settings", {}))
            else:
                result = demonstration(request["index"], request.get("settings", {}))
        out.write(json.dumps(result) + "\n")
    else:
        sys.exit(f"{sys.argv[0]}: unknown mode {mode!r} (run, prompt or demonstration)")
    out.flush()


class _stdout_to_stderr:
    """While user code runs, print() goes to stderr: stdout carries only the protocol's JSON."""

    def __enter__(self):
        self.out = sys.stdout
        sys.stdout = sys.stderr
        return self.out

    def __exit__(self, *exc):
        sys.stdout = self.out


def _step_reply(result):
    if isinstance(result, dict):
        return result
    observation, reward, terminated, truncated, info = result  # Gymnasium's step()
    return {"observation": observation, "reward": reward, "terminated": terminated, "truncated": truncated, "info": info}


def _reset_reply(result):
    if isinstance(result, dict):
        return result
    observation, info = result if isinstance(result, tuple) else (result, None)  # Gymnasium's reset()
    return {"observation": observation, "info": info}


def serve_env(create_env, stdin=None, stdout=None):
    """The main of an Env program: one env per process (one episode), driven by JSON lines."""
    stdin = stdin or sys.stdin
    with _stdout_to_stderr() as out:
        stdout = stdout or out
        env = None
        for line in stdin:
            request = json.loads(line)
            method = request.get("method")
            try:
                if method == "reset":
                    env = create_env(request.get("settings", {}))
                    reply = _reset_reply(env.reset(request["task"]))
                elif method == "step":
                    if env is None:
                        raise RuntimeError("step before reset")
                    reply = _step_reply(env.step(request["text"], request["token_ids"]))
                elif method == "close":
                    getattr(env, "close", lambda: None)()
                    return
                else:
                    raise ValueError(f"unknown method {method!r}")
                text = json.dumps(reply)
            except Exception as e:  # reported to the framework, which fails the episode with it
                text = json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            stdout.write(text + "\n")
            stdout.flush()
