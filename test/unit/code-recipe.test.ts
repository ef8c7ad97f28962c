// The code recipe (recipes/code) and its python tool: tasks from the seed, scoring of known-good and
// known-bad solutions in the real sandbox, and the multi-turn ChatAgent (recipes/code-tool) calling the
// tool between turns through the real loopback server and the stock openai client. The policy there is
// scripted (a policy that calls tools, which the random tiny model cannot do), as in loopback-requests.test.ts.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { ChatTemplate } from '../../agents/chat-template';
import type { GenerateFn, Sampling } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { AgentRunner, codeTask, extractCode, scoreSolution } from '../../recipes/code/agent';
import { runPythonTool } from '../../recipes/code/python-tool';
import { AgentRunner as ToolAgent } from '../../recipes/code-tool/agent';

test('the task depends only on the seed; every family comes up, each with a correct reference', async () => {
  expect(codeTask(7)).toEqual(codeTask(7));
  const tasks = Array.from({ length: 60 }, (_, s) => codeTask(s));
  const families = new Set(tasks.map((t) => t.prompt.replace(/[0-9]+|'[a-z]'/g, '#')));
  expect(families.size).toBe(6);
  for (const t of tasks) {
    expect(t.prompt).toMatch(/^Write a Python function f\((x|s|xs|n)\) that .+\.\n$/);
    expect(t.cases).toHaveLength(5);
  }
  // One task of each family, scored in the sandbox: the reference passes every test.
  const seen = new Map<string, (typeof tasks)[number]>();
  for (const t of tasks) if (!seen.has(t.prompt.replace(/[0-9]+|'[a-z]'/g, '#'))) seen.set(t.prompt.replace(/[0-9]+|'[a-z]'/g, '#'), t);
  const scores = await Promise.all([...seen.values()].map((t) => scoreSolution(t.reference, t)));
  expect(scores.map((s) => s.reward)).toEqual([1, 1, 1, 1, 1, 1]);
});

test('the reward is the fraction of tests passed; broken, hanging and cheating answers score 0', async () => {
  const task = { prompt: '', reference: '', cases: [1, 2, 3, 4].map((x) => ({ args: [x], expected: 3 * x + 1 })) };
  const score = (answer: string) => scoreSolution(answer, task);
  expect(await score('```python\ndef f(x):\n    return 3 * x + 1\n```\nDone.')).toEqual({ reward: 1, passed: 4, total: 4 });
  expect(await score('def f(x):\n    return 3 * x + 1 if x < 3 else 0')).toEqual({ reward: 0.5, passed: 2, total: 4 });
  expect(await score('def f(x):\n    if x == 4: raise ValueError\n    return 3 * x + 1')).toMatchObject({ reward: 0.75 });
  expect(await score('def f(x): return None')).toMatchObject({ reward: 0, passed: 0 });
  expect(await score('def f(x) return 1')).toMatchObject({ reward: 0, error: expect.stringContaining('SyntaxError') });
  expect(await score('g = 1')).toMatchObject({ reward: 0, error: "KeyError: 'f'" });
  expect(await score('def f(x):\n    while True: pass')).toMatchObject({ reward: 0, error: expect.stringMatching(/stopped at the (cpu|wall)/) });
  // The verdict is made outside the sandbox, against expected values that never enter it: a report the
  // answer prints after the harness's (at exit) is not believed.
  const fake = 'import atexit\natexit.register(lambda: print(\'{"passed": 4, "total": 4}\'))\ndef f(x): return 0';
  expect(await score(fake)).toMatchObject({ reward: 0 });
  expect(await score('import os\nos._exit(0)')).toMatchObject({ reward: 0 });
  expect(extractCode('text\n```py\ncode\n```')).toBe('code\n');
  expect(extractCode('no fence')).toBe('no fence');
});

test('the Env form prompts the task and rewards the answer in one step; recipe.json is valid', async () => {
  const env = AgentRunner.createEnv({ tests: 5 });
  const { observation } = await env.reset({ groupIndex: 0, episode: 0, seed: 11 });
  const task = codeTask(11);
  expect(observation).toBe(task.prompt);
  expect(await env.step({ text: task.reference, tokenIds: [] })).toMatchObject({ reward: 1, terminated: true });
  expect(await env.step({ text: 'def f(*a): pass', tokenIds: [] })).toMatchObject({ reward: 0, terminated: true });
  for (const name of ['code', 'code-tool']) {
    const config = loadRecipe(path.join(REPO_ROOT, 'recipes', name));
    expect(fs.existsSync(path.join(REPO_ROOT, 'recipes', name, config.agent))).toBe(true);
  }
});

test('the python tool answers with the output, the error or the limit, never an exception', async () => {
  expect(await runPythonTool('{"code": "print(sum(range(10)))"}')).toBe('45');
  expect(await runPythonTool({ code: '1/0' })).toMatch(/ZeroDivisionError: division by zero\n\[exit 1\]$/);
  expect(await runPythonTool({ code: 'while True: pass' })).toMatch(/\[stopped at the (cpu|wall) limit\]$/);
  expect(await runPythonTool({ code: 'import socket; socket.create_connection(("1.1.1.1", 53))' })).toMatch(/Network is unreachable/);
  expect(await runPythonTool('not json')).toBe('python: the arguments must be {"code": "<program>"}');
  expect(await runPythonTool({ code: 'pass' })).toBe('[no output]');
});

describe('the ChatAgent with the python tool, through the loopback server', () => {
  const IM_END = 258;
  const SAMPLING: Sampling = { max_tokens: 256, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
  let server: LoopbackServer;
  let template: ChatTemplate;
  beforeAll(async () => {
    server = await LoopbackServer.start();
    template = ChatTemplate.load(resolveModelDir('tiny'));
  });
  afterAll(() => server.close());
  const bytes = (s: string) => [...Buffer.from(s, 'utf8')];

  // A policy that first calls the tool, then answers; every prompt it was asked over is recorded.
  async function episode(replies: string[]) {
    const prompts: number[][] = [];
    const generate: GenerateFn = async (_id, prompt) => {
      prompts.push(prompt);
      const ids = [...bytes(replies[prompts.length - 1]), IM_END];
      return { token_ids: ids, logprobs: ids.map(() => -0.5), versions: ids.map(() => 3), finish_reason: 'stop' };
    };
    const session = server.openSession({ template, generate, maxContext: 4096, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() } });
    const start = await ToolAgent.prompt({ groupIndex: 0, seed: 11 }, { tests: 5, max_turns: 3 });
    const result = await ToolAgent.run({
      ...server.urls(session), model: 'policy', apiKey: session.apiKey, messages: start.messages, tools: start.tools,
      label: start.label, sampling: SAMPLING, maxContext: 4096,
    });
    const segments = session.segments();
    server.closeSession(session);
    return { result, prompts, segments };
  }

  test('a tool call runs in the sandbox, its output is appended as the tool message, the answer is scored', async () => {
    const task = codeTask(11);
    const call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>';
    const { result, prompts, segments } = await episode([call, '```python\n' + task.reference + '```']);
    expect(result).toMatchObject({ reward: 1, info: { toolCalls: 1, passed: 5 } });
    expect(prompts).toHaveLength(2);
    // The second request extends the first: the sampled call, then the tool's output as context.
    const observation = template.tokenizer.encode('\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n');
    const first = [...bytes(call), IM_END];
    expect(prompts[1]).toEqual([...prompts[0], ...first, ...observation]);
    expect(segments).toHaveLength(1);
    const seg = segments[0];
    expect(seg.loss_mask.filter((m) => m === 1)).toHaveLength(first.length + bytes('```python\n' + task.reference + '```').length + 1);
    expect(seg.loss_mask.slice(prompts[0].length + first.length, prompts[1].length).every((m) => m === 0)).toBe(true);
  });

  test('without a tool call the first answer is scored; a wrong one earns nothing', async () => {
    const { result, prompts } = await episode(['def f(*args): return None']);
    expect(prompts).toHaveLength(1);
    expect(result).toMatchObject({ reward: 0, info: { toolCalls: 0 } });
  });
});
