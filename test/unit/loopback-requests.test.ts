// The loopback server's request handling with the real SDK clients: structured tool calls, bad
// requests, binding. The policy here is a scripted generate function that returns fixed ids (a
// policy that calls tools, which the random tiny model cannot do); the engine-backed tests are in
// loopback.test.ts.
import * as path from 'node:path';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { resolveModelDir } from '../../agents/recipe';
import { ChatTemplate } from '../../agents/chat-template';
import type { GenerateFn, Sampling } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';

const MODEL = resolveModelDir('tiny');
const SAMPLING: Sampling = { max_tokens: 64, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
const IM_END = 258;
let server: LoopbackServer;
let template: ChatTemplate;

beforeAll(async () => {
  server = await LoopbackServer.start();
  template = ChatTemplate.load(MODEL);
});
afterAll(() => server.close());

// Replies with the given id lists in turn; logprob -0.5 and version 7 on every sampled token.
function scripted(replies: number[][], prompts: number[][] = []): GenerateFn {
  return async (_id, prompt) => {
    prompts.push(prompt);
    const ids = replies[prompts.length - 1];
    return { token_ids: ids, logprobs: ids.map(() => -0.5), versions: ids.map(() => 7), finish_reason: ids[ids.length - 1] === IM_END ? 'stop' : 'length' };
  };
}
const open = (generate: GenerateFn) => {
  const session = server.openSession({ template, generate, maxContext: 1024, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() } });
  return { session, ...server.urls(session) };
};
const bytes = (s: string) => [...Buffer.from(s, 'utf8')];

// The model writes the call JSON without spaces; the template re-renders it with spaces. The sampled
// ids are kept as they are and only the glue after <|im_end|> is appended.
const CALLS = 'Checking.<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><tool_call>{"name":"add","arguments":{"a":4,"b":5}}</tool_call>';

test('OpenAI: Hermes tool calls come back as tool_calls; results are appended token-exactly', async () => {
  const prompts: number[][] = [];
  const reply1 = [...bytes(CALLS), IM_END];
  const reply2 = [...bytes('5 and 9'), IM_END];
  const { session, openaiBaseURL } = open(scripted([reply1, reply2, reply1], prompts));
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const tools: OpenAI.ChatCompletionTool[] = [{ type: 'function', function: { name: 'add', parameters: { type: 'object' } } }];
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'Add 2+3 and 4+5.' }];

  const r1 = await client.chat.completions.create({ model: 'policy', messages, tools });
  const msg = r1.choices[0].message;
  expect(r1.choices[0].finish_reason).toBe('tool_calls');
  expect(msg.content).toBe('Checking.');
  const calls = msg.tool_calls!.map((c) => (c.type === 'function' ? [c.function.name, JSON.parse(c.function.arguments)] : null));
  expect(calls).toEqual([['add', { a: 2, b: 3 }], ['add', { a: 4, b: 5 }]]);

  messages.push(msg as OpenAI.ChatCompletionMessageParam,
    ...msg.tool_calls!.map((c, i) => ({ role: 'tool' as const, tool_call_id: c.id, content: ['5', '9'][i] })));
  const r2 = await client.chat.completions.create({ model: 'policy', messages, tools });
  expect(r2.choices[0].message.content).toBe('5 and 9');

  const obs = template.tokenizer.encode('\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n'
    + '<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n');
  const [seg] = session.segments();
  expect(seg.tokens).toEqual([...prompts[0], ...reply1, ...obs, ...reply2]);
  expect(prompts[1]).toEqual([...prompts[0], ...reply1, ...obs]);
  expect(seg.loss_mask).toEqual([...prompts[0].map(() => 0), ...reply1.map(() => 1), ...obs.map(() => 0), ...reply2.map(() => 1)]);
  expect(seg.logprobs.filter((_, i) => seg.loss_mask[i])).toEqual([...reply1, ...reply2].map(() => -0.5));
  expect(seg.versions).toEqual(seg.loss_mask.map((m) => (m ? 7 : -1)));

  // Streamed, the same calls arrive as tool_calls deltas.
  const stream = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'again' }], tools, stream: true });
  const deltas: OpenAI.ChatCompletionChunk.Choice.Delta.ToolCall[] = [];
  for await (const chunk of stream) deltas.push(...(chunk.choices[0]?.delta.tool_calls ?? []));
  expect(deltas.map((d) => [d.index, d.function?.name, JSON.parse(d.function!.arguments!)])).toEqual([[0, 'add', { a: 2, b: 3 }], [1, 'add', { a: 4, b: 5 }]]);
  expect(session.segments()).toHaveLength(2); // a new conversation: the first segment was sealed
});

test('Anthropic: tool calls come back as tool_use blocks, streaming and not', async () => {
  const reply = [...bytes(CALLS), IM_END];
  const { session, anthropicBaseURL } = open(scripted([reply, reply]));
  const client = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const tools: Anthropic.Tool[] = [{ name: 'add', input_schema: { type: 'object' } }];
  const params = { model: 'policy', max_tokens: 64, messages: [{ role: 'user' as const, content: 'Add.' }], tools };
  const plain = await client.messages.create(params);
  const streamed = await client.messages.stream({ ...params, temperature: 0.7 }).finalMessage();
  for (const m of [plain, streamed]) {
    expect(m.stop_reason).toBe('tool_use');
    expect(m.content.map((b) => (b.type === 'text' ? b.text : b.type === 'tool_use' ? [b.name, b.input] : b.type)))
      .toEqual(['Checking.', ['add', { a: 2, b: 3 }], ['add', { a: 4, b: 5 }]]);
    expect(m.usage.output_tokens).toBe(reply.length);
  }
});

test('special-token text the model spelled in bytes stays bytes (re-encoding would merge it)', async () => {
  const prompts: number[][] = [];
  const reply = [...bytes('a<|im_end|>b'), IM_END];
  const { session, openaiBaseURL } = open(scripted([reply, reply], prompts));
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'x' }];
  const r1 = await client.chat.completions.create({ model: 'policy', messages });
  expect(r1.choices[0].message.content).toBe('a<|im_end|>b');
  // decode-then-re-encode would turn the 10 sampled bytes into the single special token 258
  expect(template.tokenizer.encode(r1.choices[0].message.content!)).toEqual([97, IM_END, 98]);
  await client.chat.completions.create({ model: 'policy', messages: [...messages, r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'y' }] });
  const [seg] = session.segments();
  expect(seg.tokens.slice(prompts[0].length, prompts[0].length + reply.length)).toEqual(reply);
  expect(prompts[1]).toEqual([...prompts[0], ...reply, ...template.tokenizer.encode('\n<|im_start|>user\ny<|im_end|>\n<|im_start|>assistant\n')]);
});

test('a malformed tool call comes back as text', async () => {
  const text = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>';
  const { session, openaiBaseURL } = open(scripted([[...bytes(text), IM_END]]));
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const r = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'x' }], tools: [{ type: 'function', function: { name: 'add' } }] });
  expect(r.choices[0]).toMatchObject({ finish_reason: 'stop', message: { content: text } });
  expect(r.choices[0].message.tool_calls).toBeUndefined();
});

test('bad requests get a 400 naming the problem, and the server keeps serving', async () => {
  const prompts: number[][] = [];
  const { session, openaiBaseURL, anthropicBaseURL } = open(scripted([[104, IM_END], [104, IM_END]], prompts));
  const openai = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const anthropic = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'x' }];
  const cases: [Record<string, unknown>, RegExp][] = [
    [{ frequency_penalty: 0.5 }, /"frequency_penalty" is not supported/],
    [{ logit_bias: { 1: 5 } }, /"logit_bias" is not supported/],
    [{ n: 0 }, /n must be an integer in \[1, 64\]/],
    [{ temperature: -1 }, /temperature must be >= 0/],
    [{ top_p: 0 }, /top_p must be in \(0, 1\]/],
    [{ max_tokens: 0 }, /max_tokens must be an integer >= 1/],
    [{ stop: ['ok', ''] }, /stop must be a non-empty string or a list of them/],
    [{ tool_choice: 'required' }, /tool_choice "required" is not supported/],
    [{ response_format: { type: 'json_object' } }, /"response_format" is not supported/],
  ];
  for (const [extra, message] of cases) {
    const err = await openai.chat.completions.create({ model: 'policy', messages, ...extra } as any).catch((e) => e);
    expect(err).toBeInstanceOf(OpenAI.BadRequestError);
    expect(err.message).toMatch(message);
  }
  const bad = await openai.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }).catch((e) => e);
  expect(bad.status).toBe(400);
  expect(bad.message).toMatch(/messages\[0\]\.content\[0\]: image_url must be a data URL/);
  const thinking = await anthropic.messages.create({ model: 'policy', max_tokens: 5, messages: [{ role: 'user', content: 'x' }], thinking: { type: 'enabled', budget_tokens: 1024 } }).catch((e) => e);
  expect(thinking).toBeInstanceOf(Anthropic.BadRequestError);
  expect(thinking.message).toMatch(/field .{0,2}"thinking.{0,2}" is not supported/);
  const forced = await anthropic.messages.create({ model: 'policy', max_tokens: 5, messages: [{ role: 'user', content: 'x' }], tool_choice: { type: 'any' } }).catch((e) => e);
  expect(forced.message).toMatch(/tool_choice .* is not supported/);

  const url = `${openaiBaseURL}/chat/completions`;
  const raw = (init: RequestInit) => fetch(url, { method: 'POST', ...init }).then(async (r) => [r.status, await r.json()]);
  expect(await raw({ headers: { authorization: `Bearer ${session.apiKey}` }, body: '{not json' })).toEqual([400, { error: expect.objectContaining({ message: expect.stringMatching(/not valid JSON/) }) }]);
  expect((await raw({ headers: { authorization: 'Bearer wrong' }, body: '{}' }))[0]).toBe(401);
  expect((await raw({ headers: { authorization: `Bearer ${session.apiKey}` }, body: '{}' }).then(() => fetch(url.replace(session.id, 'f'.repeat(32)), { method: 'POST', body: '{}' })))
    .status).toBe(404);
  expect(prompts).toHaveLength(0); // nothing reached the policy

  // Still serving, and stop strings are honoured.
  const ok = await openai.chat.completions.create({ model: 'policy', messages, stop: ['\n'] });
  expect(ok.choices[0].message.content).toBe('h');
  server.closeSession(session);
  const gone = await openai.chat.completions.create({ model: 'policy', messages }).catch((e) => e);
  expect(gone.status).toBe(404);
});

test('the server refuses to bind anything but loopback', async () => {
  await expect(LoopbackServer.start('0.0.0.0')).rejects.toThrow(/refusing to bind 0.0.0.0/);
  await expect(LoopbackServer.start('192.168.1.5')).rejects.toThrow(/only 127.0.0.1/);
  expect(server.urls(server.openSession({ template, generate: scripted([]), maxContext: 8, defaults: SAMPLING })).openaiBaseURL)
    .toMatch(/^http:\/\/127\.0\.0\.1:\d+\/s\/[0-9a-f]{32}\/v1$/);
});

test('a failed generation leaves the session unchanged, so the retry appends the observation once', async () => {
  const prompts: number[][] = [];
  const ok = scripted([[104, IM_END], [105, IM_END]], prompts);
  let failNext = false;
  const { session, openaiBaseURL } = open(async (id, prompt, sampling) => {
    if (failNext) { failNext = false; throw new Error('engine went away'); }
    return ok(id, prompt, sampling);
  });
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const r1 = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'x' }] });
  const next = { model: 'policy', messages: [{ role: 'user' as const, content: 'x' }, r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user' as const, content: 'y' }] };
  failNext = true;
  const err = await client.chat.completions.create(next).catch((e) => e);
  expect(err.status).toBe(502);
  expect(err.message).toMatch(/engine went away/);
  await client.chat.completions.create(next);
  const obs = template.tokenizer.encode('\n<|im_start|>user\ny<|im_end|>\n<|im_start|>assistant\n');
  expect(session.segments()).toEqual([expect.objectContaining({ tokens: [...prompts[0], 104, IM_END, ...obs, 105, IM_END] })]);
});

// A turn that ends on <|endoftext|> (also a stop id) with bytes that are not valid UTF-8: the template
// closes the turn with <|im_end|>, which the model never wrote. The sampled ids stay exactly as they
// are (stop token included) and only the template's close plus the new message is appended, in the
// same segment — decoding the reply and re-encoding it would have turned the bytes into U+FFFD.
test('a turn ending on another stop token keeps its ids; the template close is appended', async () => {
  const ENDOFTEXT = 256;
  const prompts: number[][] = [];
  const reply1 = [19, 140, 252, ENDOFTEXT];
  const generate: GenerateFn = async (_id, prompt) => {
    prompts.push(prompt);
    const ids = prompts.length === 1 ? reply1 : [...bytes('ok'), IM_END];
    return { token_ids: ids, logprobs: ids.map(() => -0.5), versions: ids.map(() => 7), finish_reason: 'stop' };
  };
  const { session, openaiBaseURL } = open(generate);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'hi' }];
  const r1 = await client.chat.completions.create({ model: 'policy', messages });
  messages.push(r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'go on' });
  await client.chat.completions.create({ model: 'policy', messages });

  const close = template.tokenizer.encode('<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n');
  expect(prompts[1]).toEqual([...prompts[0], ...reply1, ...close]);
  expect(session.segments()).toHaveLength(1);
  expect(template.tokenizer.encode(template.tokenizer.decode(reply1.slice(0, -1)))).not.toEqual(reply1.slice(0, -1));
});

test('tool-call text is parsed only when the request declared tools', async () => {
  const reply = [...bytes(CALLS), IM_END];
  const { session, openaiBaseURL, anthropicBaseURL } = open(scripted([reply, reply]));
  const openai = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const anthropic = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const r = await openai.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'x' }] });
  expect(r.choices[0]).toMatchObject({ finish_reason: 'stop', message: { content: CALLS } });
  expect(r.choices[0].message.tool_calls).toBeUndefined();
  const m = await anthropic.messages.create({ model: 'policy', max_tokens: 64, messages: [{ role: 'user', content: 'y' }] });
  expect(m.stop_reason).toBe('end_turn');
  expect(m.content).toEqual([{ type: 'text', text: CALLS }]);
});

// A tool_result's is_error reaches the model when the chat template shows it; with one that cannot
// (the tiny model's), it is refused with a 400 instead of silently dropped.
test('Anthropic tool_result is_error: rendered by a template that shows it, refused by one that cannot', async () => {
  const reply = [...bytes('<tool_call>{"name":"add","arguments":{}}</tool_call>'), IM_END];
  const tools: Anthropic.Tool[] = [{ name: 'add', input_schema: { type: 'object' } }];
  const failed = (id: string): Anthropic.MessageParam => ({ role: 'user', content: [{ type: 'tool_result', tool_use_id: id, content: 'division by zero', is_error: true }] });

  const plain = open(scripted([reply, reply]));
  const client = new Anthropic({ baseURL: plain.anthropicBaseURL, apiKey: plain.session.apiKey, maxRetries: 0 });
  const messages: Anthropic.MessageParam[] = [{ role: 'user', content: 'Add.' }];
  const m1 = await client.messages.create({ model: 'policy', max_tokens: 64, messages, tools });
  const toolUse = m1.content.find((b) => b.type === 'tool_use')!;
  const err = await client.messages.create({ model: 'policy', max_tokens: 64, messages: [...messages, { role: 'assistant', content: m1.content as Anthropic.ContentBlockParam[] }, failed(toolUse.id)], tools }).catch((e) => e);
  expect(err).toBeInstanceOf(Anthropic.BadRequestError);
  expect(err.message).toMatch(/messages\[2\] tool_result: is_error is not supported: the model's chat template does not render it/);

  const source = String(template.tokenizer.config.chat_template).replace('<tool_response>\n', '<tool_response>\n{% if message.is_error %}ERROR: {% endif %}');
  const prompts: number[][] = [];
  const showing = new ChatTemplate(source, template.tokenizer);
  const session = server.openSession({ template: showing, generate: scripted([reply, reply], prompts), maxContext: 1024, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() } });
  const shows = new Anthropic({ baseURL: server.urls(session).anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const s1 = await shows.messages.create({ model: 'policy', max_tokens: 64, messages, tools });
  const id = (s1.content.find((b) => b.type === 'tool_use') as Anthropic.ToolUseBlock).id;
  await shows.messages.create({ model: 'policy', max_tokens: 64, messages: [...messages, { role: 'assistant', content: s1.content as Anthropic.ContentBlockParam[] }, failed(id)], tools });
  const obs = template.tokenizer.encode('\n<|im_start|>user\n<tool_response>\nERROR: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n');
  expect(prompts[1]).toEqual([...prompts[0], ...reply, ...obs]); // appended in the same segment
});

// ---------------------------------------------------------------- retries, repeats, n, stop strings

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test('a deliberate repeat is a new sample; a retry (the SDK\'s own, or an Idempotency-Key) gets the first reply', async () => {
  const prompts: number[][] = [];
  const replies = ['one', 'two', 'three', 'four'].map((w) => [...bytes(w), IM_END]);
  const policy = scripted(replies, prompts);
  let release!: () => void;
  const held = new Promise<void>((r) => (release = r));
  const { session, openaiBaseURL } = open(async (id, prompt, sampling) => {
    if (!prompts.length) await held; // the first reply waits until the client has retried
    return policy(id, prompt, sampling);
  });
  // The real SDK times out and retries; its fetch is watched only to see the retry's header.
  const retryCounts: (string | null)[] = [];
  const watched: typeof fetch = async (url, init) => {
    const count = new Headers(init?.headers).get('x-stainless-retry-count');
    retryCounts.push(count);
    if (count === '1') setTimeout(release, 50);
    return fetch(url, init);
  };
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 1, timeout: 300, fetch: watched });
  const body = { model: 'policy', messages: [{ role: 'user' as const, content: 'x' }] };
  const r1 = await client.chat.completions.create(body);
  expect(retryCounts).toEqual(['0', '1']);
  expect(r1.choices[0].message.content).toBe('one');
  expect(prompts).toHaveLength(1); // the retry was answered with the first attempt's reply

  // The same request again, on purpose: a new sample.
  const r2 = await client.chat.completions.create(body);
  expect(r2.choices[0].message.content).toBe('two');
  // An explicit Idempotency-Key: the same key (and body) is the same request; another key is not.
  const r3 = await client.chat.completions.create(body, { headers: { 'Idempotency-Key': 'k1' } });
  expect(await client.chat.completions.create(body, { headers: { 'Idempotency-Key': 'k1' } })).toEqual(r3);
  const r4 = await client.chat.completions.create(body, { headers: { 'Idempotency-Key': 'k2' } });
  expect([r3, r4].map((r) => r.choices[0].message.content)).toEqual(['three', 'four']);
  expect(prompts).toHaveLength(4);
  // Each sample is a segment of its own, over the same prompt ids.
  expect(session.segments().map((s) => s.tokens)).toEqual(replies.map((r) => [...prompts[0], ...r]));
});

test('OpenAI n > 1: n samples with their own seeds, each a segment; the agent goes on with any of them token-exactly', async () => {
  const prompts: number[][] = [];
  const seeds: (number | undefined)[] = [];
  const replies = ['a1', 'b22', 'c333', 'next', 's1', 's2'].map((w) => [...bytes(w), IM_END]);
  const policy = scripted(replies, prompts);
  const { session, openaiBaseURL } = open(async (id, prompt, sampling) => { seeds.push(sampling.seed); return policy(id, prompt, sampling); });
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'Pick one.' }];
  const r = await client.chat.completions.create({ model: 'policy', messages, n: 3, seed: 5 });
  expect(r.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([[0, 'a1', 'stop'], [1, 'b22', 'stop'], [2, 'c333', 'stop']]);
  expect(r.usage).toMatchObject({ prompt_tokens: prompts[0].length, completion_tokens: 3 + 4 + 5 });
  expect(new Set(seeds).size).toBe(3);
  expect(seeds[0]).toBe(5);
  expect(prompts.slice(0, 3).every((p) => JSON.stringify(p) === JSON.stringify(prompts[0]))).toBe(true);

  // The agent keeps the second sample and goes on: its segment grows, token-exactly.
  messages.push(r.choices[1].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'more' });
  await client.chat.completions.create({ model: 'policy', messages });
  const obs = template.tokenizer.encode('\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n');
  expect(prompts[3]).toEqual([...prompts[0], ...replies[1], ...obs]);
  const segs = session.segments();
  expect(segs.map((s) => s.tokens)).toEqual([
    [...prompts[0], ...replies[0]], [...prompts[0], ...replies[1], ...obs, ...replies[3]], [...prompts[0], ...replies[2]],
  ]);
  expect(segs[1].loss_mask).toEqual([...prompts[0].map(() => 0), ...replies[1].map(() => 1), ...obs.map(() => 0), ...replies[3].map(() => 1)]);

  // Streamed, each choice's text arrives under its own index.
  const stream = await client.chat.completions.create({ model: 'policy', messages: [{ role: 'user', content: 'two' }], n: 2, stream: true });
  const texts = ['', ''];
  const finishes: (string | null)[] = [null, null];
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      texts[c.index] += c.delta.content ?? '';
      finishes[c.index] = c.finish_reason ?? finishes[c.index];
    }
  }
  expect([texts, finishes]).toEqual([['s1', 's2'], ['stop', 'stop']]);
});

// A client stop string ends the turn like a stop token: the sampled ids are kept as sampled (the stop
// string too), the template's close of the turn is appended, and the conversation stays one segment.
test('client stop strings of any length end the turn like a stop token, in the same segment', async () => {
  const prompts: number[][] = [];
  const reply1 = bytes('Answer: 42\nEND and more'); // the scripted policy does not stop: the session cuts
  const reply2 = bytes('ok.\nthen');
  const { session, openaiBaseURL, anthropicBaseURL } = open(scripted([reply1, reply2, reply1, reply1], prompts));
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'x' }];
  const r1 = await client.chat.completions.create({ model: 'policy', messages, stop: ['\nEND', 'never'] });
  expect(r1.choices[0]).toMatchObject({ finish_reason: 'stop', message: { content: 'Answer: 42' } });
  expect(r1.usage?.completion_tokens).toBe(bytes('Answer: 42\nEND').length);
  messages.push(r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'again' });
  const r2 = await client.chat.completions.create({ model: 'policy', messages, stop: '\n' }); // one token
  expect(r2.choices[0].message.content).toBe('ok.');

  const close = (next: string) => template.tokenizer.encode(`<|im_end|>\n<|im_start|>user\n${next}<|im_end|>\n<|im_start|>assistant\n`);
  expect(prompts[1]).toEqual([...prompts[0], ...bytes('Answer: 42\nEND'), ...close('again')]);
  const segs = session.segments();
  expect(segs).toHaveLength(1);
  expect(segs[0].tokens).toEqual([...prompts[1], ...bytes('ok.\n')]);
  expect(segs[0].tokens.filter((_, i) => segs[0].loss_mask[i])).toEqual([...bytes('Answer: 42\nEND'), ...bytes('ok.\n')]);

  // Anthropic: stop_sequence names it; streamed, no part of it is ever sent as text.
  const anthropic = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const params = { model: 'policy', max_tokens: 64, messages: [{ role: 'user' as const, content: 'y' }], stop_sequences: ['\nEND'] };
  const m = await anthropic.messages.create(params);
  expect(m).toMatchObject({ stop_reason: 'stop_sequence', stop_sequence: '\nEND', content: [{ type: 'text', text: 'Answer: 42' }] });
  const deltas: string[] = [];
  const streamed = await anthropic.messages.stream(params).on('text', (d) => { deltas.push(d); }).finalMessage();
  expect(streamed).toMatchObject({ stop_reason: 'stop_sequence', stop_sequence: '\nEND', content: [{ type: 'text', text: 'Answer: 42' }] });
  expect(deltas.join('')).toBe('Answer: 42');
});
