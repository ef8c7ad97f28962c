// The tool-calc recipe (recipes/tool-calc): its tool and reward as pure functions; its agent loop
// with the stock `openai` client against the real loopback server, the policy scripted (a random
// tiny model never writes a tool call) so that every path runs: several calls in one turn, a
// malformed call, the turn limit; its demonstrations; and episodes through rolloutGroup with a real
// engine process, stored token-exact.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import OpenAI from 'openai';
import { MockActivityEnvironment } from '@temporalio/testing';
import { rolloutGroup } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult } from '../../activities/types';
import type { GenerateFn, Sampling } from '../../agents/chat-session';
import { ChatTemplate, contentText, type ChatMessage } from '../../agents/chat-template';
import { deriveSeed } from '../../agents/env-runner';
import { LoopbackServer } from '../../agents/loopback';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import { parseToolCalls } from '../../agents/tool-calls';
import { groupProblem, problemSettings } from '../../recipes/math/problems';
import { AgentRunner, CALCULATOR, demonstration, score, solve, toolReply, type Label } from '../../recipes/tool-calc/agent';
import { RecordingRouter, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const IM_END = 258;
const SAMPLING: Sampling = { max_tokens: 96, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
const bytes = (s: string) => [...Buffer.from(s, 'utf8')];
const LABEL: Label = { answer: '8589', max_turns: 4, format_penalty: 0.1 };
const call = (expression: string) => `<tool_call>{"name":"calculator","arguments":{"expression":"${expression}"}}</tool_call>`;

test('the tool: a value, or an error message for what the model got wrong', () => {
  expect(toolReply('calculator', '{"expression": "48*6"}')).toBe('288');
  expect(toolReply('calculator', '{"expression": "133/4"}')).toBe('133/4');
  expect(toolReply('calculator', '{"expression": "1/0"}')).toBe('error: division by zero');
  expect(toolReply('calculator', '{"expression": "2*(3"}')).toBe('error: missing ) in "2*(3"');
  expect(toolReply('calculator', '{"expr": "1"}')).toBe('error: the arguments must be {"expression": "<arithmetic>"}');
  expect(toolReply('calculator', '{"expression": ')).toBe('error: the arguments are not JSON: {"expression": ');
  expect(toolReply('search', '{}')).toBe('error: unknown tool "search"; the only tool is calculator');
});

test('the reward: 1 right, 0 wrong, minus the format penalty without a boxed number', () => {
  expect(score('So \\boxed{8,589}.', LABEL)).toBe(1);
  expect(score('\\boxed{8588}', LABEL)).toBe(0);
  expect(score('8589', LABEL)).toBe(-0.1);
  expect(score('\\boxed{eight}', LABEL)).toBe(-0.1);
  expect(score(null, LABEL)).toBe(-0.1); // the turn limit, no final answer
});

describe('the agent loop with the openai client against the loopback server', () => {
  let server: LoopbackServer;
  let template: ChatTemplate;
  beforeAll(async () => {
    server = await LoopbackServer.start();
    template = ChatTemplate.load(tinyModel());
  });
  afterAll(() => server.close());

  // A policy that writes the given texts in turn (each ended by <|im_end|>), recording its prompts. The
  // context is larger than the recipe's: byte tokens make four turns long.
  function episode(replies: string[], label: Label, messages: ChatMessage[] = [{ role: 'user', content: 'problem' }], maxContext = 4096) {
    const prompts: number[][] = [];
    const generate: GenerateFn = async (_id, prompt) => {
      prompts.push(prompt);
      const ids = [...bytes(replies[prompts.length - 1]), IM_END];
      return { token_ids: ids, logprobs: ids.map(() => -0.5), versions: ids.map(() => 3), finish_reason: 'stop' };
    };
    const session = server.openSession({ template, generate, maxContext, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() } });
    const client = new OpenAI({ baseURL: server.urls(session).openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
    return solve(client, { model: 'policy', messages, tools: [CALCULATOR] }, label)
      .then((r) => ({ ...r, prompts, segments: session.segments() }))
      .finally(() => server.closeSession(session));
  }

  test('several calls in one turn, a malformed call, an unknown tool, then the answer: each gets its tool message', async () => {
    const replies = [
      `Two at once.${call('48*6')}${call('1/0')}`,
      '<tool_call>{"name":"calculator","arguments":{"expression":"8877-288"}</tool_call>', // one brace short
      '<tool_call>{"name":"search","arguments":{}}</tool_call>',
      'The answer is \\boxed{8,589}.',
    ];
    const r = await episode(replies, LABEL);
    expect(r.reward).toBe(1);
    expect(r.info).toEqual({ turns: 4, tool_calls: 4, tool_errors: 3, final: 'The answer is \\boxed{8,589}.' });
    const tools = r.messages.filter((m) => m.role === 'tool').map((m) => m.content);
    expect(tools).toEqual([
      '288', 'error: division by zero',
      'error: malformed tool call (not JSON)',
      'error: unknown tool "search"; the only tool is calculator',
    ]);
    // The first reply came back as two structured calls; the malformed one as text.
    const first = r.messages[1] as OpenAI.ChatCompletionAssistantMessageParam;
    expect(first.content).toBe('Two at once.');
    expect(first.tool_calls!.map((c) => c.type === 'function' && JSON.parse(c.function.arguments))).toEqual([{ expression: '48*6' }, { expression: '1/0' }]);
    expect(r.messages[4]).toMatchObject({ role: 'assistant', content: replies[1] });

    // One token-exact segment: each turn's prompt is the previous prompt, the sampled ids, and the
    // tokenization of the tool messages after them; nothing was re-encoded.
    expect(r.segments).toHaveLength(1);
    const seg = r.segments[0];
    expect(r.prompts[0]).toEqual(template.tokenizer.encode(template.render([{ role: 'user', content: 'problem' }], [CALCULATOR], true)));
    for (let k = 1; k < 4; k++) {
      const sampled = [...bytes(replies[k - 1]), IM_END];
      expect(r.prompts[k].slice(0, r.prompts[k - 1].length + sampled.length)).toEqual([...r.prompts[k - 1], ...sampled]);
    }
    const text = template.tokenizer.decode(r.prompts[1]);
    expect(text).toContain('<tool_response>\n288\n</tool_response>');
    expect(text).toContain('<tool_response>\nerror: division by zero\n</tool_response>');
    expect(seg.tokens).toEqual([...r.prompts[3], ...bytes(replies[3]), IM_END]);
    const sampledCount = replies.reduce((n, t) => n + bytes(t).length + 1, 0);
    expect(seg.loss_mask.filter((m) => m === 1)).toHaveLength(sampledCount);
    expect(seg.logprobs.filter((_, i) => seg.loss_mask[i] === 1).every((l) => l === -0.5)).toBe(true);
  });

  test('the turn limit ends an episode that keeps calling the tool, with the format penalty', async () => {
    const r = await episode([call('1+1'), call('2+2'), call('3+3')], { ...LABEL, max_turns: 2 });
    expect(r.prompts).toHaveLength(2);
    expect(r.reward).toBe(-0.1);
    expect(r.info).toEqual({ turns: 2, tool_calls: 2, tool_errors: 0, final: null });
  });

  test('a full context ends the episode: the loopback answers empty, which is no answer', async () => {
    const prompt = template.tokenizer.encode(template.render([{ role: 'user', content: 'problem' }], [CALCULATOR], true));
    const r = await episode([call('1+1')], LABEL, undefined, prompt.length + 60);
    expect(r.prompts).toHaveLength(1); // the second turn had no room: nothing generated
    expect(r.reward).toBe(-0.1);
    expect(r.info).toEqual({ turns: 2, tool_calls: 1, tool_errors: 0, final: '' });
  });

  test('a final answer without a box, or a wrong one', async () => {
    expect((await episode(['8589'], LABEL)).reward).toBe(-0.1);
    expect((await episode(['\\boxed{12}'], LABEL)).reward).toBe(0);
  });

  test('a demonstration is exactly what the loop records when the policy writes it, and it scores 1', async () => {
    const demo = demonstration(3, {});
    expect(demonstration(3, {})).toEqual(demo); // deterministic per index
    expect(demonstration(4, {})).not.toEqual(demo);
    const assistant = demo.messages.filter((m) => m.role === 'assistant');
    // What the policy would write for each assistant turn: the template's render of it.
    const replies = assistant.map((m) => {
      const render = template.render([m], undefined, false);
      return render.slice('<|im_start|>assistant\n'.length, render.lastIndexOf('<|im_end|>'));
    });
    expect(replies[0]).toMatch(/^<tool_call>\{"name": "calculator", "arguments": \{"expression": ".+"\}\}<\/tool_call>$/);
    // The loopback parses each call back to the demonstration's.
    assistant.slice(0, -1).forEach((m, i) => {
      expect(parseToolCalls(replies[i], () => 'x').toolCalls.map((c) => c.function)).toEqual(m.tool_calls!.map((c) => c.function));
    });
    const label = { ...LABEL, answer: String(/\\boxed\{(.+)\}/.exec(contentText(assistant[assistant.length - 1].content))![1]) };
    const r = await episode(replies, label, demo.messages.slice(0, 1));
    expect(r.reward).toBe(1);
    expect(r.messages.filter((m) => m.role === 'tool').map((m) => m.content))
      .toEqual(demo.messages.filter((m) => m.role === 'tool').map((m) => m.content));
    // The recorded tokens are the demonstration rendered in full (up to the last <|im_end|>).
    const full = template.tokenizer.encode(template.render(demo.messages, demo.tools, false));
    expect(r.segments[0].tokens).toEqual(full.slice(0, r.segments[0].tokens.length));
    expect(template.tokenizer.decode(full.slice(r.segments[0].tokens.length))).toBe('\n');
    expect(full.length).toBeLessThan(1024); // fits the recipe's max_context
  });
});

describe('tool-calc episodes through rolloutGroup, a real engine process', () => {
  let engine: Service;
  let storeRoot: string;
  beforeAll(async () => {
    engine = await startEngine(tinyModel());
    storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-tool-calc-'));
  });
  afterAll(async () => {
    await engine.stop();
    fs.rmSync(storeRoot, { recursive: true, force: true });
  });

  test('each episode is stored token-exact: the rendered problem with the tool, then what the engine sampled', async () => {
    const recipeDir = path.join(REPO_ROOT, 'recipes', 'tool-calc');
    const config = loadRecipe(recipeDir, { group_size: '3', seed: '5' });
    const router = new RecordingRouter([engine.url], TOKEN);
    const endpoints = { engines: router.engines, actor: 'unused', token: TOKEN, storeRoot };
    const started = Date.now();
    const result = await (new MockActivityEnvironment().run(rolloutGroup, endpoints, router,
      { runId: 'tc', groupIndex: 2, recipeDir, config }) as Promise<GroupResult>);
    const seconds = (Date.now() - started) / 1000;
    expect(result.failed).toBe(0);
    const refs = groupRefs('tc', result);
    expect(refs.map((r) => path.basename(r))).toEqual(['e0-s0', 'e1-s0', 'e2-s0'].map((k) => `${k}.safetensors`));

    const task = { groupIndex: 2, seed: deriveSeed(5, 2) };
    const prompt = await AgentRunner.prompt(task, config.env);
    expect(prompt.messages[0].content).toContain(groupProblem(task, problemSettings(config.env)).text);
    const template = ChatTemplate.load(tinyModel());
    const first = template.tokenizer.encode(template.render(prompt.messages, [CALCULATOR], true));
    refs.forEach((ref, e) => {
      const calls = router.calls.filter((c) => c.session === `tc/g2/e${e}`);
      expect(calls.length).toBeGreaterThanOrEqual(1);
      expect(calls[0].body.prompt_token_ids).toEqual(first);
      expect(calls[0].body.sampling).toMatchObject({ max_tokens: 96, stop_token_ids: template.endOfTurnIds() });
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      const last = calls[calls.length - 1];
      // The last call's prompt holds every earlier turn; the trajectory is it plus what it sampled.
      expect(trajectory.tokens).toEqual([...last.body.prompt_token_ids, ...last.res.token_ids]);
      expect(trajectory.lossMask.filter((m) => m === 1)).toHaveLength(calls.reduce((n, c) => n + c.res.token_ids.length, 0));
      expect([-0.1, 0, 1]).toContain(meta.reward);
      expect(meta.reward).toBe(result.rewards[e]);
    });
    console.log(`tool-calc: 3 episodes in ${seconds.toFixed(1)} s, ${result.tokens} sampled tokens, ` +
      `${Math.round(refs.reduce((n, r) => n + readTrajectory(storeRoot, r).trajectory.tokens.length, 0) / 3)} tokens per episode`);
  });
});
