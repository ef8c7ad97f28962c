// The loopback server with the REAL openai and @anthropic-ai/sdk clients, a real engine process
// (tiny random model) and the token-exact session behind them.
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { ChatTemplate, type ChatMessage, type ToolSpec } from '../../agents/chat-template';
import type { Generation, GenerateFn, Sampling, Segment } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';
import { commandAgent, runChatEpisode, type ChatAgent } from '../../agents/chat-runner';
import { EngineRouter } from '../../agents/router';
import { EpisodeJournal, readJournal, type JournalFile } from '../../activities/episode-journal';

const PYTHON = path.join(REPO_ROOT, '.venv', 'bin', 'python');
const MODEL = resolveModelDir('tiny');
const IM_END = 258;
const SAMPLING: Sampling = { max_tokens: 6, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };

let engine: ChildProcess;
let engineUrl: string;
let server: LoopbackServer;
let template: ChatTemplate;

function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, '127.0.0.1', () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

// The engine's POST /generate, recording every call so tests compare against what it returned.
interface Call { sessionId: string; prompt: number[]; sampling: Sampling; gen: Generation }
function recordingEngine(calls: Call[]): GenerateFn {
  return async (sessionId, prompt, sampling) => {
    const res = await fetch(`${engineUrl}/generate`, {
      method: 'POST', headers: { authorization: 'Bearer t', 'content-type': 'application/json' },
      body: JSON.stringify({ prompt_token_ids: prompt, sampling }),
    });
    if (!res.ok) throw new Error(`engine ${res.status}: ${await res.text()}`);
    const gen = (await res.json()) as Generation;
    calls.push({ sessionId, prompt, sampling, gen });
    return gen;
  };
}

beforeAll(async () => {
  if (!fs.existsSync(path.join(MODEL, 'model.safetensors'))) {
    execFileSync(PYTHON, ['gpu-services/make_tiny_model.py', '--out', MODEL], { cwd: REPO_ROOT });
  }
  const port = await freePort();
  engineUrl = `http://127.0.0.1:${port}`;
  engine = spawn(PYTHON, ['gpu-services/engine.py', '--model', MODEL, '--port', String(port), '--token', 't'], {
    cwd: REPO_ROOT, stdio: 'ignore', env: { ...process.env, OMP_NUM_THREADS: '1' },
  });
  for (let i = 0; ; i++) {
    const up = await fetch(`${engineUrl}/health`, { headers: { authorization: 'Bearer t' } }).then((r) => r.ok, () => false);
    if (up) break;
    if (i > 600 || engine.exitCode !== null) throw new Error('engine did not come up');
    await new Promise((r) => setTimeout(r, 100));
  }
  server = await LoopbackServer.start();
  template = ChatTemplate.load(MODEL);
});

afterAll(async () => {
  await server?.close();
  engine?.kill();
});

function open(calls: Call[], maxContext = 1024) {
  const session = server.openSession({
    template, generate: recordingEngine(calls), maxContext,
    defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() },
  });
  return { session, ...server.urls(session) };
}

// What follows a reply in the template: "\n" after a sampled <|im_end|>, the whole "<|im_end|>\n" otherwise.
const glue = (gen: Generation) => (gen.token_ids[gen.token_ids.length - 1] === IM_END ? '\n' : '<|im_end|>\n');

// A segment is exactly: first prompt, then per turn the sampled ids and the observation that follows.
function expectTokenExact(seg: Segment, calls: Call[], observations: string[]) {
  const tok = template.tokenizer;
  const expected: Segment = { tokens: [], logprobs: [], versions: [], loss_mask: [] };
  const add = (ids: number[], lp: number[] | null, v: number[] | null) => ids.forEach((id, i) => {
    expected.tokens.push(id); expected.logprobs.push(lp ? lp[i] : 0); expected.versions.push(v ? v[i] : -1); expected.loss_mask.push(lp ? 1 : 0);
  });
  calls.forEach((call, k) => {
    const obs = k === 0 ? call.prompt : tok.encode(observations[k - 1]);
    add(obs, null, null);
    expect(call.prompt).toEqual(expected.tokens); // the engine generated over the exact accumulated ids
    add(call.gen.token_ids, call.gen.logprobs, call.gen.versions);
  });
  expect(seg).toEqual(expected);
}

test('OpenAI multi-turn: several tool results at once, a retry, streaming, then a compaction', async () => {
  const calls: Call[] = [];
  const { session, openaiBaseURL } = open(calls);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const tools: OpenAI.ChatCompletionTool[] = [{ type: 'function', function: { name: 'add', parameters: { type: 'object' } } }];

  expect((await client.models.list()).data.map((m) => m.id)).toEqual(['policy']);
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'system', content: 'Use tools.' }, { role: 'user', content: 'Add 2+3 and 4+5.' }];
  const r1 = await client.chat.completions.create({ model: 'policy', messages, tools, seed: 1 });
  expect(r1.usage).toEqual({ prompt_tokens: calls[0].prompt.length, completion_tokens: calls[0].gen.token_ids.length, total_tokens: calls[0].prompt.length + calls[0].gen.token_ids.length });

  // The agent sends two tool results at once: both are appended, not only the last.
  messages.push(r1.choices[0].message as OpenAI.ChatCompletionMessageParam,
    { role: 'tool', tool_call_id: 'a', content: '5' }, { role: 'tool', tool_call_id: 'b', content: '9' });
  const body = { model: 'policy', messages, tools, seed: 2 };
  const r2 = await client.chat.completions.create(body);
  // A retry (the SDK marks its own with x-stainless-retry-count > 0): cached, no new generation.
  const retry = await client.chat.completions.create(body, { headers: { 'x-stainless-retry-count': '1' } });
  expect(retry).toEqual(r2);
  expect(calls).toHaveLength(2);

  // A tool result plus a user message, streamed.
  messages.push(r2.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'tool', tool_call_id: 'c', content: 'ok' }, { role: 'user', content: 'Done?' });
  const stream = await client.chat.completions.create({ model: 'policy', messages, tools, seed: 3, stream: true, stream_options: { include_usage: true } });
  let streamed = '';
  let finish: string | null = null;
  let usage: OpenAI.CompletionUsage | undefined | null;
  for await (const chunk of stream) {
    streamed += chunk.choices[0]?.delta.content ?? '';
    finish = chunk.choices[0]?.finish_reason ?? finish;
    usage = chunk.usage ?? usage;
  }
  expect(calls).toHaveLength(3);
  expect(streamed).toBe(template.tokenizer.decode(calls[2].gen.token_ids.filter((id) => id !== IM_END && id !== 256)));
  expect(finish).toBe(calls[2].gen.finish_reason === 'stop' ? 'stop' : 'length');
  expect(usage?.completion_tokens).toBe(calls[2].gen.token_ids.length);

  const [g1, g2] = [calls[0].gen, calls[1].gen];
  const toolTurn = (s: string) => `<|im_start|>user\n<tool_response>\n${s}\n</tool_response><|im_end|>\n`;
  const observations = [
    glue(g1) + toolTurn('5') + toolTurn('9') + '<|im_start|>assistant\n',
    glue(g2) + toolTurn('ok') + '<|im_start|>user\nDone?<|im_end|>\n<|im_start|>assistant\n',
  ];
  expect(session.segments()).toHaveLength(1);
  expectTokenExact(session.segments()[0], calls, observations);

  // Counter-example: decoding the sampled ids and re-encoding the text would NOT give them back
  // (random bytes are rarely valid UTF-8), so the trajectory must keep the ids themselves.
  const sampled = calls.flatMap((c) => c.gen.token_ids);
  expect(template.tokenizer.encode(template.tokenizer.decode(sampled))).not.toEqual(sampled);

  // Compaction: the agent rewrites the history into a summary. The segment is sealed, a new one opens.
  const compacted: OpenAI.ChatCompletionMessageParam[] = [{ role: 'system', content: 'Use tools.' }, { role: 'user', content: 'Summary: 5 and 9. Continue.' }];
  await client.chat.completions.create({ model: 'policy', messages: compacted, tools, seed: 4 });
  const segments = session.segments();
  expect(segments).toHaveLength(2);
  expectTokenExact(segments[0], calls.slice(0, 3), observations);
  expectTokenExact(segments[1], calls.slice(3), []);
  expect(calls[3].prompt).toEqual(template.tokenizer.encode(template.render(compacted as ChatMessage[], tools as ToolSpec[], true)));
  server.closeSession(session);
});

test('Anthropic messages: system, tool_result blocks appended at once, streaming and not', async () => {
  const calls: Call[] = [];
  const { session, anthropicBaseURL } = open(calls);
  const client = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const tools: Anthropic.Tool[] = [{ name: 'add', description: 'adds', input_schema: { type: 'object', properties: {} } }];
  const messages: Anthropic.MessageParam[] = [{ role: 'user', content: 'Add things.' }];
  const m1 = await client.messages.create({ model: 'policy', system: 'Be brief.', max_tokens: 5, messages, tools });
  expect(m1.usage).toMatchObject({ input_tokens: calls[0].prompt.length, output_tokens: calls[0].gen.token_ids.length });
  expect(calls[0].sampling.max_tokens).toBe(5);
  expect(m1.stop_reason).toBe(calls[0].gen.finish_reason === 'stop' ? 'end_turn' : 'max_tokens');

  messages.push({ role: 'assistant', content: m1.content as Anthropic.ContentBlockParam[] }, {
    role: 'user', content: [
      { type: 'tool_result', tool_use_id: 'x', content: '5' },
      { type: 'tool_result', tool_use_id: 'y', content: [{ type: 'text', text: '9' }] },
      { type: 'text', text: 'Sum them.' },
    ],
  });
  const m2 = await client.messages.stream({ model: 'policy', system: 'Be brief.', max_tokens: 5, messages, tools }).finalMessage();
  expect(calls).toHaveLength(2);
  const text = m2.content.map((b) => (b.type === 'text' ? b.text : '')).join('');
  expect(text).toBe(template.tokenizer.decode(calls[1].gen.token_ids.filter((id) => id !== IM_END && id !== 256)));
  expect(m2.usage.output_tokens).toBe(calls[1].gen.token_ids.length);

  const toolTurn = (s: string) => `<|im_start|>user\n<tool_response>\n${s}\n</tool_response><|im_end|>\n`;
  expectTokenExact(session.segments()[0], calls, [
    glue(calls[0].gen) + toolTurn('5') + toolTurn('9') + '<|im_start|>user\nSum them.<|im_end|>\n<|im_start|>assistant\n',
  ]);
  server.closeSession(session);
});

test('max_tokens is clamped to the remaining context; a full context finishes with length', async () => {
  const calls: Call[] = [];
  const prompt = template.tokenizer.encode(template.render([{ role: 'user', content: 'hi' }], undefined, true));
  const { session, openaiBaseURL } = open(calls, prompt.length + 3);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const r1 = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'hi' }], max_tokens: 50, temperature: 0.5, top_p: 0.9 });
  expect(calls[0].sampling).toMatchObject({ max_tokens: 3, temperature: 0.5, top_p: 0.9 });
  const r2 = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'hi' }, r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'more' }] });
  expect(calls).toHaveLength(1); // nothing left to generate: the engine is not called
  expect(r2.choices[0].finish_reason).toBe('length');
  expect(r2.usage?.completion_tokens).toBe(0);
  server.closeSession(session);
});

test('runChatEpisode: an in-process agent with the openai client, and an external command', async () => {
  const calls: Call[] = [];
  const agent: ChatAgent = {
    kind: 'chat',
    async run(ctx) {
      const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
      const r = await client.chat.completions.create({ model: ctx.model, messages: ctx.messages as OpenAI.ChatCompletionMessageParam[] });
      return { reward: r.choices[0].message.content === ctx.label ? 1 : 0.25, info: { turns: 1 } };
    },
  };
  const prompt = { messages: [{ role: 'user' as const, content: 'copy abc>' }], label: 'abc' };
  const episode = await runChatEpisode({ server, agent, template, generate: recordingEngine(calls), prompt, sampling: SAMPLING, maxContext: 1024 });
  expect(episode.reward).toBe(0.25);
  expect(episode.info).toEqual({ turns: 1 });
  expect(episode.finish).toBe(calls[0].gen.finish_reason);
  expectTokenExact(episode.segments[0], calls, []);
  expect(calls[0].sampling.stop_token_ids.sort()).toEqual([256, 258]);

  // Any language: a Python program with plain urllib, given the session in environment variables.
  const script = `
import json, os, urllib.request
prompt = json.loads(os.environ["MOLT_PROMPT"])
req = urllib.request.Request(os.environ["MOLT_OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["MOLT_MODEL"], "messages": prompt["messages"]}).encode(),
    headers={"authorization": "Bearer " + os.environ["MOLT_API_KEY"], "content-type": "application/json"})
reply = json.load(urllib.request.urlopen(req))
print("some log line")
print(json.dumps({"reward": 0.5, "info": {"label": prompt["label"], "tokens": reply["usage"]["completion_tokens"]}}))`;
  const external = await runChatEpisode({ server, agent: commandAgent(PYTHON, ['-c', script]), template, generate: recordingEngine(calls), prompt, sampling: SAMPLING, maxContext: 1024 });
  expect(external.reward).toBe(0.5);
  expect(external.info).toEqual({ label: 'abc', tokens: calls[1].gen.token_ids.length });
  expectTokenExact(external.segments[0], calls.slice(1), []);

  const failing = commandAgent(PYTHON, ['-c', 'print("no json")']);
  await expect(runChatEpisode({ server, agent: failing, template, generate: recordingEngine(calls), prompt, sampling: SAMPLING, maxContext: 1024 }))
    .rejects.toThrow(/last stdout line must be JSON/);
});

// ---------------------------------------------------------------- the rollout worker's path: journal + router, streamed

// generate as the rollout worker wires it: every call through an episode journal and the router,
// the engine streaming its tokens.
function journaled(journal: EpisodeJournal, calls: Call[] = []): GenerateFn {
  const router = new EngineRouter([engineUrl], 't');
  return async (sessionId, prompt, sampling, onToken) => {
    const gen = await journal.generate({ prompt_token_ids: prompt, sampling },
      (part, onChunk) => router.generate(sessionId, part, undefined, onChunk), onToken);
    calls.push({ sessionId, prompt, sampling, gen });
    return gen;
  };
}
const storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-loopback-'));
afterAll(() => fs.rmSync(storeRoot, { recursive: true, force: true }));

test('streaming: the reply arrives token by token as the engine samples it; the journal saves partials by time', async () => {
  const saved: JournalFile[] = [];
  // Token-count saves never come due here (10,000 tokens): only the 20 ms clock saves the call in progress.
  const journal = new EpisodeJournal(storeRoot, 'stream/e0.json', null, { tokens: 10_000, seconds: 0.02 },
    () => saved.push(structuredClone(readJournal(storeRoot, 'stream/e0.json')!)));
  const calls: Call[] = [];
  const session = server.openSession({
    template, generate: journaled(journal, calls), maxContext: 1024,
    defaults: { ...SAMPLING, max_tokens: 300, stop_token_ids: template.endOfTurnIds() },
  });
  const { openaiBaseURL, anthropicBaseURL } = server.urls(session);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  // A seed whose reply is long (the random model may end its turn early).
  let seed = 1;
  for (;; seed++) {
    const r = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: `probe ${seed}` }], seed });
    if (calls[calls.length - 1].gen.token_ids.length >= 100) break;
    expect(r.choices[0].finish_reason).toBe('stop');
  }
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: `probe ${seed}` }];
  const streamCall = journal.recorded.calls.length;
  const stream = await client.chat.completions.create({ model: 'policy', messages, seed, stream: true });
  const deltas: string[] = [];
  for await (const chunk of stream) if (chunk.choices[0]?.delta.content) deltas.push(chunk.choices[0].delta.content);
  const gen = calls[calls.length - 1].gen;
  const content = template.tokenizer.decode(gen.token_ids.filter((id) => !template.endOfTurnIds().includes(id)));
  expect(deltas.join('')).toBe(content);
  expect(deltas.length).toBeGreaterThan(10); // not one delta at the end

  // The clock saved the call in progress while it ran.
  const partials = saved.filter((j) => j.calls.length === streamCall && j.current && j.current.token_ids.length > 0
    && j.current.token_ids.length < gen.token_ids.length);
  expect(partials.length).toBeGreaterThan(0);
  for (const j of partials) expect(gen.token_ids.slice(0, j.current!.token_ids.length)).toEqual(j.current!.token_ids);
  console.log(`streaming: ${gen.token_ids.length} tokens arrived as ${deltas.length} deltas; ` +
    `${partials.length} partials saved by the clock during the call`);

  // Anthropic, streamed: several text deltas too.
  const anthropic = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const texts: string[] = [];
  const m = await anthropic.messages.stream({ model: 'policy', max_tokens: 300, messages: [{ role: 'user', content: `probe ${seed}` }] })
    .on('text', (d) => { texts.push(d); }).finalMessage();
  expect(texts.join('')).toBe(m.content.map((b) => (b.type === 'text' ? b.text : '')).join(''));
  expect(m.usage.input_tokens).toBe(calls[calls.length - 1].prompt.length);
  server.closeSession(session);
});

// A stop string of several tokens, found in the text as the engine streams: the engine request is
// ended there, the ids are kept as sampled, and the next turn appends the template's close.
test('a multi-token stop string ends the engine request mid-stream; the next turn stays in the segment', async () => {
  const journal = new EpisodeJournal(storeRoot, 'stop/e0.json', null, { tokens: 8, seconds: 60 }, () => undefined);
  const calls: Call[] = [];
  const open2 = () => server.openSession({
    template, generate: journaled(journal, calls), maxContext: 1024,
    defaults: { ...SAMPLING, max_tokens: 40, stop_token_ids: template.endOfTurnIds() },
  });
  const printable = (id: number) => id >= 97 && id <= 122; // a-z
  // Find a seed whose reply has two letters in a row, not earlier in its text (the random model
  // writes mostly other bytes).
  const decode = (ids: number[]) => template.tokenizer.decode(ids);
  let found: { seed: number; at: number; ids: number[] } | undefined;
  for (let seed = 1; !found; seed++) {
    expect(seed).toBeLessThan(200);
    const s = open2();
    const client = new OpenAI({ baseURL: server.urls(s).openaiBaseURL, apiKey: s.apiKey, maxRetries: 0 });
    await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'go' }], seed, temperature: 0.7 });
    const ids = calls[calls.length - 1].gen.token_ids;
    const at = ids.findIndex((id, i) => i > 0 && printable(id) && printable(ids[i + 1])
      && !decode(ids.slice(0, i + 1)).includes(decode(ids.slice(i, i + 2))));
    if (at > 0 && ids.length > at + 3) found = { seed, at, ids };
    server.closeSession(s);
  }
  const { seed, at, ids } = found;
  const [stop, before] = [decode(ids.slice(at, at + 2)), decode(ids.slice(0, at))];
  const session = open2();
  const client = new OpenAI({ baseURL: server.urls(session).openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'go' }];
  const r = await client.chat.completions.create({ model: 'policy', messages, seed, temperature: 0.7, stop: [stop] });
  const cut = calls[calls.length - 1];
  expect(cut.gen.token_ids).toEqual(ids.slice(0, at + 2)); // the same samples, ended with the stop string's last id
  expect(cut.gen.finish_reason).toBe('stop');
  expect(journal.recorded.calls[journal.recorded.calls.length - 1].token_ids).toEqual(ids.slice(0, at + 2));
  expect(r.choices[0]).toMatchObject({ finish_reason: 'stop', message: { content: before } });

  messages.push(r.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'on' });
  await client.chat.completions.create({ model: 'policy', messages, seed: 1 });
  const obs = template.tokenizer.encode('<|im_end|>\n<|im_start|>user\non<|im_end|>\n<|im_start|>assistant\n');
  expect(calls[calls.length - 1].prompt).toEqual([...cut.prompt, ...ids.slice(0, at + 2), ...obs]);
  expect(session.segments()).toHaveLength(1);
  console.log(`stop string ${JSON.stringify(stop)}: engine request ended after ${at + 2} of ${ids.length} tokens`);
  server.closeSession(session);
});

// n samples on the real engine, and the crash-replay journal: a retried episode asks the same
// requests again and gets its recorded samples back in order, identical prompts included.
test('n > 1 on the engine; a replayed journal gives identical requests their own samples, in order', async () => {
  const first = new EpisodeJournal(storeRoot, 'repeat/e0.json', null, { tokens: 8, seconds: 60 }, () => undefined);
  const calls: Call[] = [];
  const run = async (journal: EpisodeJournal) => {
    const session = server.openSession({
      template, generate: journaled(journal, calls), maxContext: 1024,
      defaults: { ...SAMPLING, max_tokens: 8, stop_token_ids: template.endOfTurnIds() },
    });
    const client = new OpenAI({ baseURL: server.urls(session).openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
    const body = { model: 'policy', messages: [{ role: 'user' as const, content: 'sample' }] };
    const many = await client.chat.completions.create({ ...body, n: 3 });
    const again = await client.chat.completions.create(body); // a deliberate repeat
    server.closeSession(session);
    return { texts: [...many.choices, ...again.choices].map((c) => c.message.content), segments: session.segments() };
  };
  const a = await run(first);
  expect(calls).toHaveLength(4);
  expect(new Set(calls.map((c) => JSON.stringify(c.gen.token_ids))).size).toBe(4); // four different samples
  expect(a.segments.map((s) => s.tokens)).toEqual(calls.map((c) => [...c.prompt, ...c.gen.token_ids]));

  await first.save(); // what its deferred save writes (short calls are saved a save interval later)
  const replayed = new EpisodeJournal(storeRoot, 'repeat/e0.json', readJournal(storeRoot, 'repeat/e0.json'), { tokens: 8, seconds: 60 }, () => undefined);
  const b = await run(replayed);
  expect(replayed.stats).toMatchObject({ replayedCalls: 4, generatedTokens: 0 });
  expect(b).toEqual(a);
});

test('the session asks for ids one at a time only when something reads them as they come', async () => {
  // A generate given onToken streams from the engine, a chunk per token; without a stop string or a streaming
  // client nothing reads them before the reply ends, so it is not given one.
  const calls: Call[] = [];
  const readers: boolean[] = [];
  const engine = recordingEngine(calls);
  const session = server.openSession({
    template, maxContext: 1024, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() },
    generate: (id, prompt, sampling, onToken, images) => {
      readers.push(onToken !== undefined);
      return engine(id, prompt, sampling, onToken, images);
    },
  });
  const { openaiBaseURL } = server.urls(session);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'Hi.' }];
  await client.chat.completions.create({ model: 'policy', messages, seed: 1 });
  await client.chat.completions.create({ model: 'policy', messages, seed: 2, stop: ['a'] });
  for await (const _ of await client.chat.completions.create({ model: 'policy', messages, seed: 3, stream: true })) { /* read it all */ }
  expect(readers).toEqual([false, true, true]);
});
