// Agents written in Python (recipes/python: the molt_agent helper module and the TS adapter): real
// Python processes, the real `openai` Python package against the real loopback server, a real engine.
//   the tool-calc agent in Python (recipes/tool-calc-py): its loop with a scripted policy (a random
//     tiny model never writes a tool call), its demonstrations, its episodes through rolloutGroup
//   an Env in Python over JSON lines (recipes/math-py, fixtures/py-env.py): episodes through
//     rolloutGroup, print() in the env, an env that raises or exits mid-episode
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult } from '../../activities/types';
import { runChatEpisode } from '../../agents/chat-runner';
import type { GenerateFn, Sampling } from '../../agents/chat-session';
import { ChatTemplate, contentText, type ChatMessage } from '../../agents/chat-template';
import { deriveSeed } from '../../agents/env-runner';
import { LoopbackServer } from '../../agents/loopback';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import { tokenizerFor } from '../../agents/tokenizer';
import { reward as mathReward } from '../../recipes/math/agent';
import { parseNumber } from '../../recipes/math/problems';
import { PYTHON } from '../../recipes/python/adapter';
import { CALCULATOR } from '../../recipes/tool-calc/agent';
import { AgentRunner as ToolCalcPy } from '../../recipes/tool-calc-py/agent';
import { RecordingRouter, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const IM_END = 258;
const SAMPLING: Sampling = { max_tokens: 96, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
const bytes = (s: string) => [...Buffer.from(s, 'utf8')];
const LABEL = { answer: '8589', max_turns: 4, format_penalty: 0.1 };
const call = (expression: string) => `<tool_call>{"name":"calculator","arguments":{"expression":"${expression}"}}</tool_call>`;
const FIXTURES = path.join(__dirname, 'fixtures');

describe('the Python tool-calc agent against the loopback server, the policy scripted', () => {
  let server: LoopbackServer;
  let template: ChatTemplate;
  beforeAll(async () => {
    server = await LoopbackServer.start();
    template = ChatTemplate.load(tinyModel());
  });
  afterAll(() => server.close());

  // One episode of the Python agent (a real python process, the openai package) against a policy
  // that writes the given texts in turn, each ended by <|im_end|>.
  async function episode(replies: string[], label: unknown, messages: ChatMessage[] = [{ role: 'user', content: 'problem' }]) {
    const prompts: number[][] = [];
    const generate: GenerateFn = async (_id, prompt) => {
      prompts.push(prompt);
      const ids = [...bytes(replies[prompts.length - 1]), IM_END];
      return { token_ids: ids, logprobs: ids.map(() => -0.5), versions: ids.map(() => 3), finish_reason: 'stop' };
    };
    const result = await runChatEpisode({
      server, agent: ToolCalcPy, template, generate, sampling: SAMPLING, maxContext: 4096,
      prompt: { messages, tools: [CALCULATOR], label },
    });
    return { ...result, prompts };
  }

  test('several calls in one turn, a malformed call, an unknown tool, then the answer; one token-exact segment', async () => {
    const replies = [
      `Two at once.${call('48*6')}${call('1/0')}`,
      '<tool_call>{"name":"calculator","arguments":{"expression":"8877-288"}</tool_call>', // one brace short
      '<tool_call>{"name":"search","arguments":{}}</tool_call>',
      'The answer is \\boxed{8,589}.',
    ];
    const r = await episode(replies, LABEL);
    expect(r.reward).toBe(1);
    expect(r.info).toEqual({ turns: 4, tool_calls: 4, tool_errors: 3, final: 'The answer is \\boxed{8,589}.' });
    const said = template.tokenizer.decode(r.prompts[3]);
    for (const tool of ['288', 'error: division by zero', 'error: malformed tool call (not JSON)',
      'error: unknown tool "search"; the only tool is calculator']) {
      expect(said).toContain(`<tool_response>\n${tool}\n</tool_response>`);
    }
    expect(r.prompts[0]).toEqual(template.tokenizer.encode(template.render([{ role: 'user', content: 'problem' }], [CALCULATOR], true)));
    for (let k = 1; k < 4; k++) {
      const sampled = [...bytes(replies[k - 1]), IM_END];
      expect(r.prompts[k].slice(0, r.prompts[k - 1].length + sampled.length)).toEqual([...r.prompts[k - 1], ...sampled]);
    }
    expect(r.segments).toHaveLength(1);
    expect(r.segments[0].tokens).toEqual([...r.prompts[3], ...bytes(replies[3]), IM_END]);
  });

  test('the turn limit, and answers without a box', async () => {
    const limited = await episode([call('1+1'), call('2+2'), call('3+3')], { ...LABEL, max_turns: 2 });
    expect([limited.prompts.length, limited.reward, limited.info]).toEqual([2, -0.1, { turns: 2, tool_calls: 2, tool_errors: 0, final: null }]);
    expect((await episode(['8589'], LABEL)).reward).toBe(-0.1);
    expect((await episode(['\\boxed{12}'], LABEL)).reward).toBe(0);
  });

  test('a demonstration from Python is what the loop records when the policy writes it, and scores 1', async () => {
    const demo = await ToolCalcPy.demonstration(2, {});
    expect(await ToolCalcPy.demonstration(2, {})).toEqual(demo);
    const assistant = demo.messages.filter((m) => m.role === 'assistant');
    expect(assistant.length).toBeGreaterThanOrEqual(2);
    const replies = assistant.map((m) => {
      const render = template.render([m], undefined, false);
      return render.slice('<|im_start|>assistant\n'.length, render.lastIndexOf('<|im_end|>'));
    });
    const answer = parseNumber(/\\boxed\{(.+)\}/.exec(contentText(assistant[assistant.length - 1].content))![1])!.toString();
    const r = await episode(replies, { ...LABEL, answer }, demo.messages.slice(0, 1));
    expect(r.reward).toBe(1);
    const full = template.tokenizer.encode(template.render(demo.messages, demo.tools, false));
    expect(r.segments[0].tokens).toEqual(full.slice(0, r.segments[0].tokens.length));
    expect(full.length).toBeLessThan(1024);
  });
});

describe('Python agents through rolloutGroup, a real engine process', () => {
  let engine: Service;
  let storeRoot: string;
  beforeAll(async () => {
    engine = await startEngine(tinyModel());
    storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-python-agents-'));
  });
  afterAll(async () => {
    await engine.stop();
    fs.rmSync(storeRoot, { recursive: true, force: true });
  });

  async function run(runId: string, recipe: string, overrides: Record<string, string> = {}, agentDir?: string) {
    const recipeDir = path.join(REPO_ROOT, 'recipes', recipe);
    const config = loadRecipe(recipeDir, { group_size: '3', seed: '4', ...overrides });
    const router = new RecordingRouter([engine.url], TOKEN);
    const env = new MockActivityEnvironment();
    const beats: RolloutManifest[] = [];
    env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
    const endpoints = { engines: router.engines, actor: 'unused', token: TOKEN, storeRoot };
    const started = Date.now();
    const result = await (env.run(rolloutGroup, endpoints, router,
      { runId, groupIndex: 1, recipeDir: agentDir ?? recipeDir, config }) as Promise<GroupResult>);
    return { result, refs: groupRefs(runId, result), router, config, failed: beats[beats.length - 1].failed, seconds: (Date.now() - started) / 1000 };
  }

  test('tool-calc-py: the Python prompt rendered with the tool, then every turn, stored token-exact', async () => {
    const { result, refs, router, config, seconds } = await run('tcpy', 'tool-calc-py');
    expect(result.failed).toBe(0);
    expect(refs).toHaveLength(3);
    const prompt = await ToolCalcPy.prompt({ groupIndex: 1, seed: deriveSeed(4, 1) }, config.env);
    expect(prompt.messages[0].content).toMatch(/ Use the calculator\. Put the final answer in \\boxed\{\}\.$/);
    const template = ChatTemplate.load(tinyModel());
    const first = template.tokenizer.encode(template.render(prompt.messages, prompt.tools, true));
    refs.forEach((ref, e) => {
      const calls = router.calls.filter((c) => c.session === `tcpy/g1/e${e}`);
      expect(calls[0].body.prompt_token_ids).toEqual(first);
      const last = calls[calls.length - 1];
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      expect(trajectory.tokens).toEqual([...last.body.prompt_token_ids, ...last.res.token_ids]);
      expect([-0.1, 0, 1]).toContain(meta.reward);
    });
    console.log(`tool-calc-py: 3 episodes in ${seconds.toFixed(1)} s, ${result.tokens} sampled tokens`);
  });

  test('math-py: the Python env\'s observation and the sampled ids, rewarded by the Python verifier', async () => {
    const { result, refs, router, seconds } = await run('mpy', 'math-py');
    expect(result.failed).toBe(0);
    const script = 'import json, sys; from arithmetic import group_problem; ' +
      'p = group_problem({"groupIndex": 1, "seed": int(sys.argv[1])}, {}); print(json.dumps([p.text, str(p.answer)]))';
    const [text, answer] = JSON.parse(execFileSync(PYTHON, ['-c', script, String(deriveSeed(4, 1))],
      { env: { ...process.env, PYTHONPATH: path.join(REPO_ROOT, 'recipes', 'python') } }).toString());
    const tokenizer = tokenizerFor(tinyModel());
    const prompt = tokenizer.encode(`Q: ${text} Put the answer in \\boxed{}.\nA:`);
    refs.forEach((ref, e) => {
      const c = router.calls.find((x) => x.session === `mpy/g1/e${e}`)!;
      expect(c.body.prompt_token_ids).toEqual(prompt);
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      expect(trajectory.tokens).toEqual([...prompt, ...c.res.token_ids]);
      expect(meta.reward).toBe(mathReward(tokenizer.decode(c.res.token_ids), parseNumber(answer)!));
    });
    console.log(`math-py: 3 episodes in ${seconds.toFixed(1)} s, ${result.tokens} sampled tokens`);
  });

  test('a Python env may print: the protocol stays intact over several turns', async () => {
    const { result, refs, router } = await run('pyprint', 'math-py', { agent: 'py-env-agent.ts', 'env.mode': 'print' }, FIXTURES);
    expect(result.failed).toBe(0);
    expect(result.rewards).toEqual([2, 2, 2]);
    const tokenizer = tokenizerFor(tinyModel());
    const calls = router.calls.filter((c) => c.session === 'pyprint/g1/e0');
    expect(calls).toHaveLength(2);
    expect(tokenizer.decode(calls[1].body.prompt_token_ids)).toMatch(/^task \d+>.* got 16>$/s);
  });

  test('a Python env that raises or exits mid-episode fails that episode, with the Python error', async () => {
    const raised = await run('pyraise', 'math-py', { agent: 'py-env-agent.ts', 'env.mode': 'raise', 'rollout.max_failed_fraction': '1' }, FIXTURES);
    expect([raised.result.failed, raised.result.rewards]).toEqual([1, [2, 2]]);
    expect(raised.failed[1].split('\n')[0]).toBe('recipe math-py (test/unit/fixtures/py-env-agent.ts), group 1 episode 1: env step threw: ' +
      `python env test/unit/fixtures/py-env.py: step(): ValueError: episode 1 fails on purpose (test/unit/fixtures/py-env.py:21, in step)`);
    const exited = await run('pyexit', 'math-py', { agent: 'py-env-agent.ts', 'env.mode': 'exit', 'rollout.max_failed_fraction': '1' }, FIXTURES);
    expect([exited.result.failed, exited.result.rewards]).toEqual([1, [2, 2]]);
    expect(exited.failed[1]).toMatch(/^recipe math-py \(test\/unit\/fixtures\/py-env-agent\.ts\), group 1 episode 1: env step threw: python env test\/unit\/fixtures\/py-env\.py exited with 3: /);
  });
});
