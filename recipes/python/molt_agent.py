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

Wire formats (for another language, or to run one by hand). A ChatAgent program is started once
per worker with the argument `serve` and forks one child per call, so `import openai` (a second of
CPU) is paid once, not per episode. It reads one JSON request per line on stdin, {"id": n, "call":
"run" | "prompt" | "demonstration", "request": {...}}, and answers each (in any order) with one line
{"id": n, "result": ...} or {"id": n, "error": message, "traceback": text}. `run`'s request is the
episode's context (openaiBaseURL, anthropicBaseURL, apiKey, model, messages, tools, label,
sampling, maxContext), its result {"reward": r, "info": {...}}; `prompt`'s is {"task", "settings"},
`demonstration`'s {"index", "settings"}. Without `serve` it runs one episode the way
agents/chat-runner.ts commandAgent() runs any program: the context in MOLT_OPENAI_BASE_URL,
MOLT_ANTHROPIC_BASE_URL, MOLT_API_KEY, MOLT_MODEL and MOLT_PROMPT, {"reward": ...} printed last.
An Env program reads one JSON request per line on stdin and writes one JSON reply per line on
stdout: {"method": "reset", "settings", "task"} -> {"observation", "info"}; {"method": "step",
"text", "token_ids"} -> {"observation", "reward", "terminated", "truncated", "info"};
{"method": "close"} -> it exits. A failure is {"error": message, "traceback": text}.
In both forms print() goes to stderr: stdout carries the protocol only.
"""
import json
import os
import selectors
import sys
import traceback


class Context:
    """What one ChatAgent episode gets: the policy's endpoint and the group's prompt."""

    def __init__(self, fields):
        self.base_url = fields["openaiBaseURL"]  # .../s/<session>/v1
        self.anthropic_base_url = fields["anthropicBaseURL"]
        self.api_key = fields["apiKey"]
        self.model = fields.get("model", "policy")
        self.messages = fields["messages"]
        self.tools = fields.get("tools")
        self.label = fields.get("label")
        self.sampling = fields.get("sampling", {})
        self.max_context = fields.get("maxContext")

    @staticmethod
    def fields_from_env(env=os.environ):
        """The context as commandAgent() passes it: in environment variables."""
        urls = {"openaiBaseURL": env["MOLT_OPENAI_BASE_URL"], "anthropicBaseURL": env["MOLT_ANTHROPIC_BASE_URL"],
                "apiKey": env["MOLT_API_KEY"], "model": env.get("MOLT_MODEL", "policy")}
        return {**json.loads(env["MOLT_PROMPT"]), **urls}

    def openai(self, **kwargs):
        """The stock openai client for this episode. No client retries: Molt's router already moves a
        failed request to another engine."""
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})


def _reward(result):
    reward, info = result if isinstance(result, tuple) else (result, None)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
        raise TypeError(f"run() must return a finite number or (reward, info), got {result!r}")
    return {"reward": float(reward), "info": info}


def chat_agent(prompt, run, demonstration=None):
    """The main of a ChatAgent program: `prompt(task, settings)` once per prompt group, `run(ctx)` once
    per episode, `demonstration(index, settings)` (optional) for supervised warm-up."""
    def call(name, request):
        if name == "run":
            return _reward(run(Context(request)))
        if name == "prompt":
            return prompt(request["task"], request.get("settings", {}))
        if name == "demonstration":
            if demonstration is None:
                raise NotImplementedError(f"{sys.argv[0]} defines no demonstration(index, settings): pass one to chat_agent()")
            return demonstration(request["index"], request.get("settings", {}))
        raise ValueError(f"unknown call {name!r} (run, prompt or demonstration)")

    if sys.argv[1:] == ["serve"]:
        _fork_server(call)
    else:  # one episode, as commandAgent() runs a program
        with _stdout_to_stderr() as out:
            result = call("run", Context.fields_from_env())
        out.write(json.dumps(result) + "\n")


def _fork_server(call):
    """Answers the requests on stdin, each in a forked child: the children share what the parent
    imported, and one that crashes or exits takes only its own episode with it."""
    try:
        import openai  # noqa: F401  (imported once here, inherited by every child)
    except ImportError:
        pass
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # print() anywhere goes to stderr
    sys.stdout = sys.stderr
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, None)
    pending, children, stdin_open = b"", {}, True
    while stdin_open or children:
        for key, _ in selector.select():
            if key.data is None:  # a request line (or EOF: the worker went away; finish what runs)
                data = os.read(0, 1 << 16)
                if not data:
                    stdin_open = False
                    selector.unregister(0)
                    continue
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:  # the child: answer on the pipe, and never return into this loop
                        try:
                            os.close(r)
                            try:
                                text = json.dumps({"result": call(request["call"], request.get("request", {}))})
                            except BaseException as e:  # noqa: B036  (sys.exit in user code is an error too)
                                text = json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
                            with os.fdopen(w, "w") as pipe:
                                pipe.write(text)
                        finally:
                            os._exit(0)
                    os.close(w)
                    children[r] = (request["id"], pid, [])
                    selector.register(r, selectors.EVENT_READ, r)
            else:
                r = key.data
                data = os.read(r, 1 << 16)
                if data:
                    children[r][2].append(data)
                    continue
                selector.unregister(r)
                os.close(r)
                request_id, pid, parts = children.pop(r)
                _, status = os.waitpid(pid, 0)
                try:
                    reply = json.loads(b"".join(parts))
                except ValueError:
                    reply = {"error": f"the process of this call died ({_exit_reason(status)}) before answering"}
                out.write(json.dumps({"id": request_id, **reply}) + "\n")
                out.flush()


def _exit_reason(status):
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"


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
