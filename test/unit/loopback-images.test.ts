// Images through the loopback server (issue 18): the REAL openai and @anthropic-ai/sdk clients send OpenAI
// image_url data URLs and Anthropic base64 image blocks (also inside a tool result) to a session over a real
// engine process with a tiny random-init Qwen3-VL. Each image is processed once by the engine and stored
// content-addressed; the template's placeholder is expanded to the processor's count; the engine generates
// over those ids with those images; a multi-turn conversation stays one segment. Bad images are 400s naming
// the message and part.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { REPO_ROOT } from '../../agents/recipe';
import { ChatTemplate } from '../../agents/chat-template';
import type { Generation, GenerateFn, Sampling } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';
import { PYTHON, startEngine, TOKEN, type Service } from './gpu-services';

const [V_START, V_END, IMAGE_PAD] = [259, 260, 261];
const SAMPLING: Sampling = { max_tokens: 5, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
// Two PNGs drawn by Pillow (64x48: a 6x8 grid of 8-pixel patches, merged 2x2: 12 placeholders each).
const PNG_SCRIPT = `
import base64, io, json
from PIL import Image, ImageDraw
out = []
for colour in ("red", "blue"):
    img = Image.new("RGB", (64, 48), "white")
    ImageDraw.Draw(img).polygon([(5, 40), (58, 8), (30, 44)], fill=colour)
    buf = io.BytesIO(); img.save(buf, format="PNG"); out.append(base64.b64encode(buf.getvalue()).decode())
print(json.dumps(out))`;

let dir: string;
let engine: Service;
let server: LoopbackServer;
let template: ChatTemplate;
let pngs: string[];

beforeAll(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-vlm-'));
  execFileSync(PYTHON, ['recipes/geo/make_tiny_vlm.py', '--out', path.join(dir, 'model')], { cwd: REPO_ROOT });
  pngs = JSON.parse(execFileSync(PYTHON, ['-c', PNG_SCRIPT]).toString());
  engine = await startEngine(path.join(dir, 'model'));
  server = await LoopbackServer.start();
  template = ChatTemplate.load(path.join(dir, 'model'));
}, 900_000);

afterAll(async () => {
  await server?.close();
  await engine?.stop();
  fs.rmSync(dir, { recursive: true, force: true });
});

async function post(route: string, body: object): Promise<any> {
  const res = await fetch(`${engine.url}${route}`, {
    method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  const json = (await res.json()) as any;
  if (!res.ok) throw new Error(json.error);
  return json;
}

interface Call { prompt: number[]; images: string[]; gen: Generation }
function open(calls: Call[]) {
  const generate: GenerateFn = async (_id, prompt, sampling, _onToken, images = []) => {
    const gen = await post('/generate', { prompt_token_ids: prompt, sampling, images });
    calls.push({ prompt, images, gen });
    return gen;
  };
  const session = server.openSession({
    template, generate, maxContext: 1024, defaults: { ...SAMPLING, stop_token_ids: template.endOfTurnIds() },
    processImage: (data) => post('/images', { data, dir: path.join(dir, 'store', 'images') }),
  });
  return { session, ...server.urls(session) };
}

// The placeholder runs of a prompt: how many image tokens each vision block holds.
const runs = (ids: number[]) => ids.flatMap((id, i) => (id === V_START ? [ids.indexOf(V_END, i) - i - 1] : []));

test('OpenAI image_url data URLs, streamed, then a second turn with another image: one segment', async () => {
  const calls: Call[] = [];
  const { session, openaiBaseURL } = open(calls);
  const client = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const url = (png: string) => ({ type: 'image_url' as const, image_url: { url: `data:image/png;base64,${png}` } });
  const messages: OpenAI.ChatCompletionMessageParam[] = [
    { role: 'user', content: [{ type: 'text', text: 'Angle at A? ' }, url(pngs[0])] }];
  let text = '';
  for await (const chunk of await client.chat.completions.create({ model: 'policy', messages, seed: 1, stream: true })) {
    text += chunk.choices[0]?.delta?.content ?? '';
  }
  messages.push({ role: 'assistant', content: text }, { role: 'user', content: [url(pngs[1]), url(pngs[0])] });
  await client.chat.completions.create({ model: 'policy', messages, seed: 2 });

  expect(calls).toHaveLength(2);
  // the processor's expansion: 12 placeholders per image, in vision blocks, and the engine got their files
  expect(runs(calls[0].prompt)).toEqual([12]);
  expect(runs(calls[1].prompt)).toEqual([12, 12, 12]);
  expect(calls[1].prompt.filter((id) => id === IMAGE_PAD)).toHaveLength(36);
  expect(calls[0].prompt).toEqual(template.encode(template.render(
    [{ role: 'user', content: [{ type: 'text', text: 'Angle at A? ' }, { type: 'image', path: '', tokens: 12 }] }],
    undefined, true), [{ type: 'image', path: '', tokens: 12 }]));
  const [red, blue] = [calls[0].images[0], calls[1].images[1]];
  expect(calls[1].images).toEqual([red, blue, red]);
  expect(fs.readdirSync(path.dirname(red)).sort()).toEqual([path.basename(blue), path.basename(red)].sort()); // stored once
  // one segment: the second prompt extends the first turn's ids (sampled reply kept), images listed in order
  const [seg] = session.segments();
  expect(session.segments()).toHaveLength(1);
  expect(seg.tokens.slice(0, calls[0].prompt.length + calls[0].gen.token_ids.length))
    .toEqual([...calls[0].prompt, ...calls[0].gen.token_ids]);
  expect(seg.tokens).toEqual([...calls[1].prompt, ...calls[1].gen.token_ids]);
  expect(seg.images).toEqual([red, blue, red]);
}, 120_000);

test('Anthropic base64 image blocks, also inside a tool result, streamed', async () => {
  const calls: Call[] = [];
  const { session, anthropicBaseURL } = open(calls);
  const client = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const image = (png: string) => ({ type: 'image' as const, source: { type: 'base64' as const, media_type: 'image/png' as const, data: png } });
  const tools = [{ name: 'draw', input_schema: { type: 'object' as const } }];
  const messages: Anthropic.MessageParam[] = [{ role: 'user', content: [image(pngs[0]), { type: 'text', text: 'Side c?' }] }];
  const r1 = await client.messages.create({ model: 'policy', max_tokens: 5, messages, tools });
  messages.push({ role: 'assistant', content: [...r1.content, { type: 'tool_use', id: 't1', name: 'draw', input: {} }] as any },
    { role: 'user', content: [{ type: 'tool_result', tool_use_id: 't1', content: [image(pngs[1])] }] });
  let streamed = ''; // the second turn streamed
  for await (const ev of await client.messages.create({ model: 'policy', max_tokens: 5, messages, tools, stream: true })) {
    if (ev.type === 'content_block_delta' && ev.delta.type === 'text_delta') streamed += ev.delta.text;
  }
  expect(calls).toHaveLength(2); // (the tool_use the model never sampled rewrites the prefix: a new segment)
  expect(runs(calls[1].prompt)).toEqual([12, 12]);
  expect(calls[1].images).toHaveLength(2);
  // the tool result's image sits inside the tool response the template renders
  const tail = template.tokenizer.decode(calls[1].prompt.slice(calls[0].prompt.length));
  expect(tail).toMatch(/<tool_response>\n<\|vision_start\|>(<\|image_pad\|>){12}<\|vision_end\|><\/tool_response>/);
}, 120_000);

test('a bad image is a 400 naming the message and part; a text-only model takes no images', async () => {
  const { session, openaiBaseURL, anthropicBaseURL } = open([]);
  const openai = new OpenAI({ baseURL: openaiBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  const ask = (url: string) => openai.chat.completions.create({ model: 'policy', messages: [
    { role: 'user', content: 'hi' },
    { role: 'user', content: [{ type: 'text', text: 'x' }, { type: 'image_url', image_url: { url } }] }] }).catch((e) => e);
  let err = await ask('data:image/png;base64,bm90IGFuIGltYWdl');
  expect(err).toBeInstanceOf(OpenAI.BadRequestError);
  expect(err.message).toMatch(/messages\[1\]\.content\[1\]: image does not decode/);
  err = await ask('https://example.com/cat.png');
  expect(err.message).toMatch(/messages\[1\]\.content\[1\]: image_url must be a data URL/);
  const anthropic = new Anthropic({ baseURL: anthropicBaseURL, apiKey: session.apiKey, maxRetries: 0 });
  err = await anthropic.messages.create({ model: 'policy', max_tokens: 5, messages: [{ role: 'user', content: [
    { type: 'text', text: 'x' }, { type: 'image', source: { type: 'base64', media_type: 'image/gif', data: 'R0lG' } }] }] })
    .catch((e) => e);
  expect(err).toBeInstanceOf(Anthropic.BadRequestError);
  expect(err.message).toMatch(/messages\[0\]\.content\[1\]: image does not decode/);
  expect(session.segments()).toEqual([]);

  const textOnly = server.openSession({
    template: ChatTemplate.load(path.join(REPO_ROOT, '.molt', 'models', 'tiny')), generate: async () => { throw new Error('unused'); },
    maxContext: 1024, defaults: SAMPLING,
  });
  const client = new OpenAI({ baseURL: server.urls(textOnly).openaiBaseURL, apiKey: textOnly.apiKey, maxRetries: 0 });
  err = await client.chat.completions.create({ model: 'policy', messages: [
    { role: 'user', content: [{ type: 'image_url', image_url: { url: `data:image/png;base64,${pngs[0]}` } }] }] }).catch((e) => e);
  expect(err.message).toMatch(/messages\[0\]\.content\[0\]: the policy is not a vision-language model/);
}, 120_000);
