// The loopback chat server inside the rollout worker: OpenAI chat completions and Anthropic messages
// over one token-exact ChatSession per episode (agents/chat-session.ts). Bound to 127.0.0.1 only; a
// session is reachable only through its unguessable id in the path (/s/<id>/v1/...) and its api key.
//
// Every request field is either honoured or refused with a 400 naming it: nothing that changes
// sampling is silently ignored. Streamed replies are streamed as the engine samples them.
//
// Retries are told from deliberate repeats by what the client says: the openai and @anthropic-ai/sdk
// clients send x-stainless-retry-count (0, then 1, 2, ... on their own retries), and any client may
// send an Idempotency-Key (the same key and body: the same request). A retry gets the reply its
// request got; any other request, identical or not, is a new sample (best-of-n, self-consistency).
import { createHash, randomBytes } from 'node:crypto';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { ChatMessage, ContentPart, ImagePart, ToolSpec } from './chat-template';
import {
  ChatSession, type Choice, type Sampling, type SessionOptions, type TurnReply, type TurnRequest,
} from './chat-session';

const LOOPBACK_HOSTS = new Set(['127.0.0.1', 'localhost', '::1']);
const MAX_BODY_BYTES = 16 * 1024 * 1024;
const MODEL_NAME = 'policy';
const MAX_N = 64; // OpenAI n: samples of one request

class BadRequest extends Error {}
const bad = (message: string): never => { throw new BadRequest(message); };

export class LoopbackServer {
  private readonly sessions = new Map<string, ChatSession>();

  private constructor(private readonly server: http.Server, readonly port: number) {}

  static async start(host = '127.0.0.1'): Promise<LoopbackServer> {
    // The server hands the policy to any caller: it must never be reachable from another machine.
    if (!LOOPBACK_HOSTS.has(host)) {
      throw new Error(`loopback server: refusing to bind ${host}; only 127.0.0.1 is allowed`);
    }
    // Idle connections are closed by the clients, never by a server timer: the agent usually shares this
    // process, and after the event loop was blocked (a long synchronous call) both timers are overdue at
    // once; the server closing a socket the client has just taken for its next request failed it
    // ("Connection error", seen in test/unit/chat-rollout.test.ts after a 14 s execFileSync).
    const server = http.createServer();
    server.keepAliveTimeout = 0;
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(0, '127.0.0.1', () => resolve());
    });
    const self = new LoopbackServer(server, (server.address() as AddressInfo).port);
    server.on('request', (req, res) => void self.handle(req, res));
    return self;
  }

  openSession(opts: SessionOptions): ChatSession {
    const session = new ChatSession(opts);
    this.sessions.set(session.id, session);
    return session;
  }

  closeSession(session: ChatSession): void {
    this.sessions.delete(session.id);
  }

  // The OpenAI SDK appends /chat/completions to its base URL, the Anthropic SDK appends /v1/messages.
  urls(session: ChatSession): { openaiBaseURL: string; anthropicBaseURL: string } {
    const base = `http://127.0.0.1:${this.port}/s/${session.id}`;
    return { openaiBaseURL: `${base}/v1`, anthropicBaseURL: base };
  }

  close(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise((resolve) => this.server.close(() => resolve()));
  }

  private async handle(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const api = req.url?.includes('/v1/messages') ? 'anthropic' : 'openai';
    let stream: ReplyStream | undefined;
    try {
      const match = /^\/s\/([0-9a-f]+)\/v1\/(models|chat\/completions|messages)$/.exec((req.url ?? '').split('?')[0]);
      const session = match && this.sessions.get(match[1]);
      if (!match || !session) return sendError(res, api, 404, `no such endpoint or session: ${req.method} ${req.url}`);
      const key = req.headers['x-api-key'] ?? (req.headers.authorization ?? '').replace(/^Bearer /, '');
      if (key !== session.apiKey) return sendError(res, api, 401, 'wrong or missing api key for this session');
      const route = `${req.method} ${match[2]}`;
      if (route === 'GET models') {
        const model = { id: MODEL_NAME, object: 'model', created: 0, owned_by: 'molt' };
        return sendJson(res, 200, { object: 'list', data: [model] });
      }
      if (route !== 'POST chat/completions' && route !== 'POST messages') {
        return sendError(res, api, 405, `${route} is not served`);
      }
      const body = await readJson(req);
      const images: PendingImage[] = [];
      const parsed = api === 'openai' ? openaiTurn(body, images) : anthropicTurn(body, session, images);
      await resolveImages(images, session);
      const idempotencyKey = req.headers['idempotency-key'];
      const keyed = typeof idempotencyKey === 'string' && idempotencyKey !== '';
      const turn: TurnRequest = {
        ...parsed.turn,
        key: createHash('sha256').update(JSON.stringify([api, keyed ? idempotencyKey : null, body])).digest('hex'),
        retry: keyed || Number(req.headers['x-stainless-retry-count'] ?? 0) > 0,
      };
      if (!parsed.stream) {
        const reply = await session.turn(turn);
        return sendJson(res, 200, api === 'openai' ? openaiCompletion(reply) : anthropicMessage(reply));
      }
      stream = api === 'openai' ? openaiStream(res, parsed.includeUsage) : anthropicStream(res);
      stream.end(await session.turn(turn, stream.text));
    } catch (e) {
      const [status, message] = e instanceof BadRequest ? [400, e.message]
        : [502, `generation failed: ${(e as Error).message}`];
      if (stream?.started) return stream.fail(status, message); // the status line is gone: an error event
      sendError(res, api, status, message);
    }
  }
}

// ----------------------------------------------------------------------------- requests

function allowOnly(body: Record<string, unknown>, allowed: string[], api: string) {
  for (const key of Object.keys(body)) {
    if (!allowed.includes(key)) bad(`${api}: field "${key}" is not supported by the Molt loopback server`);
  }
}

function checkNumber(value: unknown, name: string, ok: (v: number) => boolean, rule: string): number | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'number' || !Number.isFinite(value) || !ok(value)) {
    bad(`${name} must be ${rule}, got ${JSON.stringify(value)}`);
  }
  return value as number;
}

function samplingFrom(body: Record<string, unknown>, maxTokens: unknown, maxTokensName: string): Partial<Sampling> {
  const s: Partial<Sampling> = {};
  const set = <K extends keyof Sampling>(k: K, v: Sampling[K] | undefined) => { if (v !== undefined) s[k] = v; };
  set('max_tokens', checkNumber(maxTokens, maxTokensName, (v) => Number.isInteger(v) && v >= 1, 'an integer >= 1'));
  set('temperature', checkNumber(body.temperature, 'temperature', (v) => v >= 0, '>= 0'));
  set('top_p', checkNumber(body.top_p, 'top_p', (v) => v > 0 && v <= 1, 'in (0, 1]'));
  set('top_k', checkNumber(body.top_k, 'top_k', (v) => Number.isInteger(v) && v >= 0, 'an integer >= 0'));
  set('seed', checkNumber(body.seed, 'seed', Number.isInteger, 'an integer'));
  return s;
}

// Client stop strings of any length: the session finds them in the decoded text as it is sampled.
function stopStrings(stops: unknown, name: string): string[] {
  if (stops === undefined || stops === null) return [];
  const list = typeof stops === 'string' ? [stops] : stops;
  if (!Array.isArray(list) || !list.every((x) => typeof x === 'string' && x !== '')) {
    return bad(`${name} must be a non-empty string or a list of them`);
  }
  return list;
}

function textOf(content: unknown, where: string): string {
  if (typeof content === 'string') return content;
  if (content === null || content === undefined) return '';
  if (Array.isArray(content)) {
    return content.map((part) => {
      if (part?.type !== 'text' || typeof part.text !== 'string') {
        bad(`${where}: only text content parts are supported, got ${JSON.stringify(part?.type)}`);
      }
      return part.text as string;
    }).join('');
  }
  return bad(`${where}: content must be a string or a list of text parts`);
}

// An image part as sent (base64 of the file), processed by the engine before the turn (resolveImages).
type PendingImage = ImagePart & { data: string; where: string };

// A user or tool message's content: text (a string, or text parts joined), or parts when it holds images:
// OpenAI image_url parts with a data URL, Anthropic image blocks with a base64 source.
function contentOf(content: unknown, where: string, images: PendingImage[],
  indices?: number[]): string | ContentPart[] {
  if (!Array.isArray(content)) return textOf(content, where);
  const parts: ContentPart[] = [];
  content.forEach((part, k) => {
    const at = `${where}.content[${indices?.[k] ?? k}]`;
    let data: string | undefined;
    if (part?.type === 'text' && typeof part.text === 'string') {
      const last = parts[parts.length - 1];
      if (last?.type === 'text') last.text += part.text;
      else parts.push({ type: 'text', text: part.text });
      return;
    } else if (part?.type === 'image_url') {
      const url = typeof part.image_url?.url === 'string' ? part.image_url.url : '';
      data = /^data:image\/[\w.+-]+;base64,/.test(url) ? url.slice(url.indexOf(',') + 1)
        : bad(`${at}: image_url must be a data URL (data:image/<type>;base64,...): the loopback server fetches nothing`);
    } else if (part?.type === 'image') {
      data = part.source?.type === 'base64' && typeof part.source.data === 'string' ? part.source.data
        : bad(`${at}: an image block needs a base64 source (the loopback server fetches nothing)`);
    } else {
      bad(`${at}: content part type ${JSON.stringify(part?.type)} is not supported (text and images only)`);
    }
    const image: PendingImage = { type: 'image', path: '', tokens: 0, data: data!, where: at };
    images.push(image);
    parts.push(image);
  });
  return parts.some((p) => p.type === 'image') ? parts : parts.map((p) => (p as { text: string }).text).join('');
}

// Each image goes to the engine once (a 400 there names the message and part), then holds its stored file.
async function resolveImages(images: PendingImage[], session: ChatSession): Promise<void> {
  for (const image of images) {
    const stored = await session.processImage(image.data).catch((e) => bad(`${image.where}: ${(e as Error).message}`));
    Object.assign(image, stored);
    delete (image as Partial<PendingImage>).data;
    delete (image as Partial<PendingImage>).where;
  }
}

function parseArguments(args: unknown): unknown {
  if (typeof args !== 'string') return args ?? {};
  try { return JSON.parse(args); } catch { return args; } // the template renders a string as is
}

function checkTools(tools: unknown): ToolSpec[] | undefined {
  if (tools === undefined || tools === null) return undefined;
  if (!Array.isArray(tools)) return bad('tools must be a list');
  for (const t of tools) {
    if (t?.type !== 'function' || typeof t.function?.name !== 'string') {
      bad(`tools: each tool must be {type: "function", function: {name, ...}}, got ${JSON.stringify(t)}`);
    }
  }
  return tools as ToolSpec[];
}

// tool_choice: "auto" lets the model decide; "none" keeps the reply as text. Forcing a call cannot be
// honoured without constrained decoding, so it is refused. Calls are parsed only when the request
// declared tools: a model shown no tool that writes <tool_call> wrote text, and gets it back as text.
function parseToolsFor(choice: unknown, none: unknown, auto: unknown): boolean {
  if (choice === undefined || choice === null || JSON.stringify(choice) === JSON.stringify(auto)) return true;
  if (JSON.stringify(choice) === JSON.stringify(none)) return false;
  const [c, a, n] = [choice, auto, none].map((x) => JSON.stringify(x));
  return bad(`tool_choice ${c} is not supported (only ${a} and ${n})`);
}

const OPENAI_FIELDS = ['model', 'messages', 'tools', 'tool_choice', 'max_tokens', 'max_completion_tokens', 'temperature',
  'top_p', 'top_k', 'stop', 'seed', 'n', 'stream', 'stream_options', 'parallel_tool_calls', 'user', 'metadata'];

type ParsedTurn = Omit<TurnRequest, 'key' | 'retry'>;

function openaiTurn(body: Record<string, unknown>, images: PendingImage[]) {
  allowOnly(body, OPENAI_FIELDS, 'chat.completions');
  if (body.parallel_tool_calls === false) bad('parallel_tool_calls false is not supported');
  if (body.max_tokens !== undefined && body.max_completion_tokens !== undefined) {
    bad('give max_tokens or max_completion_tokens, not both');
  }
  if (!Array.isArray(body.messages) || !body.messages.length) bad('messages must be a non-empty list');
  const messages: ChatMessage[] = (body.messages as Record<string, unknown>[]).map((m, i) => {
    const where = `messages[${i}]`;
    switch (m?.role) {
      case 'system': case 'developer': return { role: 'system', content: textOf(m.content, where) };
      case 'user': return { role: 'user', content: contentOf(m.content, where, images) };
      case 'tool':
        if (typeof m.tool_call_id !== 'string') bad(`${where}: a tool message needs tool_call_id`);
        return { role: 'tool', content: textOf(m.content, where), tool_call_id: m.tool_call_id as string };
      case 'assistant': {
        const msg: ChatMessage = { role: 'assistant', content: textOf(m.content, where) };
        if (Array.isArray(m.tool_calls) && m.tool_calls.length) {
          msg.tool_calls = m.tool_calls.map((c: any) => {
            if (c?.type !== 'function' || typeof c.function?.name !== 'string') {
              bad(`${where}: malformed tool call ${JSON.stringify(c)}`);
            }
            const fn = { name: c.function.name, arguments: parseArguments(c.function.arguments) };
            return { id: String(c.id), type: 'function' as const, function: fn };
          });
        }
        return msg;
      }
      default: return bad(`${where}: role ${JSON.stringify(m?.role)} is not supported`);
    }
  });
  const streamOptions = body.stream_options as { include_usage?: boolean } | undefined;
  const tools = checkTools(body.tools);
  const turn: ParsedTurn = {
    messages,
    tools,
    sampling: samplingFrom(body, body.max_completion_tokens ?? body.max_tokens, 'max_tokens'),
    stop: stopStrings(body.stop, 'stop'),
    n: checkNumber(body.n, 'n', (v) => Number.isInteger(v) && v >= 1 && v <= MAX_N, `an integer in [1, ${MAX_N}]`) ?? 1,
    parseTools: parseToolsFor(body.tool_choice, 'none', 'auto') && !!tools?.length,
  };
  return { turn, stream: body.stream === true, includeUsage: streamOptions?.include_usage === true };
}

const ANTHROPIC_FIELDS = ['model', 'messages', 'max_tokens', 'system', 'tools', 'tool_choice', 'temperature', 'top_p',
  'top_k', 'stop_sequences', 'stream', 'metadata'];

function anthropicTurn(body: Record<string, unknown>, session: ChatSession, images: PendingImage[]) {
  allowOnly(body, ANTHROPIC_FIELDS, 'messages');
  if (!Array.isArray(body.messages) || !body.messages.length) bad('messages must be a non-empty list');
  const messages: ChatMessage[] = [];
  if (body.system !== undefined) messages.push({ role: 'system', content: textOf(body.system, 'system') });
  (body.messages as Record<string, unknown>[]).forEach((m, i) => {
    const where = `messages[${i}]`;
    const blocks = typeof m?.content === 'string' ? [{ type: 'text', text: m.content }] : m?.content;
    if (!Array.isArray(blocks)) bad(`${where}: content must be a string or a list of blocks`);
    if (m.role === 'assistant') {
      const msg: ChatMessage = { role: 'assistant', content: '' };
      for (const b of blocks as any[]) {
        if (b?.type === 'text') msg.content += b.text;
        else if (b?.type === 'tool_use') {
          const fn = { name: b.name, arguments: b.input ?? {} };
          (msg.tool_calls ??= []).push({ id: String(b.id), type: 'function', function: fn });
        } else bad(`${where}: assistant block type ${JSON.stringify(b?.type)} is not supported`);
      }
      messages.push(msg);
    } else if (m.role === 'user') {
      // Blocks keep their order: tool results become tool messages, runs of text and images one user message.
      let run: [number, unknown][] = [];
      const flush = () => {
        const content = () => contentOf(run.map((r) => r[1]), where, images, run.map((r) => r[0]));
        if (run.length) messages.push({ role: 'user', content: content() });
        run = [];
      };
      for (const [k, b] of (blocks as any[]).entries()) {
        if (b?.type === 'text' || b?.type === 'image') run.push([k, b]);
        else if (b?.type === 'tool_result') {
          flush();
          const content = contentOf(b.content, `${where}.content[${k}]`, images);
          const result: ChatMessage = { role: 'tool', content, tool_call_id: String(b.tool_use_id) };
          if (b.is_error !== undefined && typeof b.is_error !== 'boolean') {
            bad(`${where} tool_result: is_error must be a boolean`);
          }
          if (b.is_error === true) {
            if (!session.template.rendersToolErrors) {
              bad(`${where} tool_result: is_error is not supported: the model's chat template does not render it ` +
                '(say so in the content instead)');
            }
            result.is_error = true;
          }
          messages.push(result);
        } else bad(`${where}: user block type ${JSON.stringify(b?.type)} is not supported`);
      }
      flush();
    } else bad(`${where}: role ${JSON.stringify(m?.role)} is not supported`);
  });
  let tools: ToolSpec[] | undefined;
  if (body.tools !== undefined) {
    if (!Array.isArray(body.tools)) bad('tools must be a list');
    tools = (body.tools as any[]).map((t) => {
      if (typeof t?.name !== 'string') bad(`tools: each tool needs a name, got ${JSON.stringify(t)}`);
      const fn: ToolSpec['function'] = { name: t.name };
      if (t.description !== undefined) fn.description = t.description;
      if (t.input_schema !== undefined) fn.parameters = t.input_schema;
      return { type: 'function' as const, function: fn };
    });
  }
  const turn: ParsedTurn = {
    messages,
    tools,
    sampling: samplingFrom(body, body.max_tokens, 'max_tokens'),
    stop: stopStrings(body.stop_sequences, 'stop_sequences'),
    n: 1,
    parseTools: parseToolsFor(body.tool_choice, { type: 'none' }, { type: 'auto' }) && !!tools?.length,
  };
  return { turn, stream: body.stream === true, includeUsage: false };
}

// ----------------------------------------------------------------------------- replies

function openaiFinish(choice: Choice): string {
  // "abort" (the engine dropped the request) is a cut-off reply, like "length".
  if (choice.finishReason !== 'stop') return 'length';
  return choice.message.tool_calls ? 'tool_calls' : 'stop';
}

function openaiToolCalls(choice: Choice) {
  return choice.message.tool_calls?.map((c) => ({
    id: c.id, type: 'function', function: { name: c.function.name, arguments: JSON.stringify(c.function.arguments) },
  }));
}

function usage(reply: TurnReply) {
  const completion = reply.choices.reduce((n, c) => n + c.completionTokens, 0);
  const prompt = reply.promptTokens;
  return { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
}

function openaiCompletion(reply: TurnReply) {
  return {
    id: `chatcmpl-${reply.id}`, object: 'chat.completion', created: reply.created, model: MODEL_NAME,
    choices: reply.choices.map((choice, index) => {
      const toolCalls = openaiToolCalls(choice);
      const content = toolCalls && !choice.message.content ? null : choice.message.content;
      return {
        index, finish_reason: openaiFinish(choice), logprobs: null,
        message: { role: 'assistant', content, refusal: null, ...(toolCalls ? { tool_calls: toolCalls } : {}) },
      };
    }),
    usage: usage(reply),
  };
}

function anthropicMessage(reply: TurnReply) {
  const [choice] = reply.choices;
  const content: object[] = [];
  if (choice.message.content) content.push({ type: 'text', text: choice.message.content });
  for (const c of choice.message.tool_calls ?? []) {
    content.push({ type: 'tool_use', id: c.id, name: c.function.name, input: c.function.arguments });
  }
  // A client stop sequence that ended the turn is reported as such; the end-of-turn token is end_turn.
  const stopReason = choice.finishReason !== 'stop' ? 'max_tokens'
    : choice.message.tool_calls ? 'tool_use' : choice.stopText !== undefined ? 'stop_sequence' : 'end_turn';
  return {
    id: `msg_${reply.id}`, type: 'message', role: 'assistant', model: MODEL_NAME, content,
    stop_reason: stopReason, stop_sequence: stopReason === 'stop_sequence' ? choice.stopText : null,
    usage: { input_tokens: reply.promptTokens, output_tokens: choice.completionTokens },
  };
}

// A streamed reply: `text` takes each sample's content as it is generated, `end` the finished reply
// (the content not yet sent, tool calls, finish reasons, usage), `fail` an error once the stream is open.
interface ReplyStream {
  readonly started: boolean;
  text: (index: number, delta: string) => void;
  end: (reply: TurnReply) => void;
  fail: (status: number, message: string) => void;
}

function sse(res: http.ServerResponse) {
  let started = false;
  const send = (data: object | string, event?: string) => {
    if (!started) res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
    started = true;
    res.write(`${event ? `event: ${event}\n` : ''}data: ${typeof data === 'string' ? data : JSON.stringify(data)}\n\n`);
  };
  return { send, get started() { return started; } };
}

// What of a choice's content is left to send after the deltas already sent.
const rest = (content: string, sent: string) => (content.startsWith(sent) ? content.slice(sent.length) : '');

function openaiStream(res: http.ServerResponse, includeUsage: boolean): ReplyStream {
  const out = sse(res);
  const [id, created] = [`chatcmpl-${randomBytes(12).toString('hex')}`, Math.floor(Date.now() / 1000)];
  const chunk = (choices: object[], extra: object = {}) =>
    out.send({ id, object: 'chat.completion.chunk', created, model: MODEL_NAME, choices, ...extra });
  const sent: string[] = [];
  const delta = (index: number, d: object, finish: string | null = null) => {
    if (sent[index] === undefined) {
      sent[index] = '';
      chunk([{ index, delta: { role: 'assistant', content: '' }, finish_reason: null, logprobs: null }]);
    }
    if (Object.keys(d).length || finish) chunk([{ index, delta: d, finish_reason: finish, logprobs: null }]);
  };
  delta(0, {}); // the stream opens at once
  return {
    get started() { return out.started; },
    text: (index, text) => { delta(index, { content: text }); sent[index] += text; },
    end: (reply) => {
      reply.choices.forEach((choice, index) => {
        delta(index, {});
        const text = rest(choice.message.content, sent[index]);
        if (text) delta(index, { content: text });
        openaiToolCalls(choice)?.forEach((c, i) => delta(index, { tool_calls: [{ index: i, ...c }] }));
        delta(index, {}, openaiFinish(choice));
      });
      if (includeUsage) chunk([], { usage: usage(reply) });
      out.send('[DONE]');
      res.end();
    },
    fail: (status, message) => { out.send({ error: { type: errorType(status), message } }); res.end(); },
  };
}

// The event sequence the @anthropic-ai/sdk stream reader expects.
function anthropicStream(res: http.ServerResponse): ReplyStream {
  const out = sse(res);
  const ev = (type: string, data: object) => out.send({ type, ...data }, type);
  let sent: string | undefined; // the text block's content so far; undefined: no text block opened
  const id = `msg_${randomBytes(12).toString('hex')}`;
  const message = {
    id, type: 'message', role: 'assistant', model: MODEL_NAME, content: [], stop_reason: null, stop_sequence: null,
  };
  ev('message_start', { message: { ...message, usage: { input_tokens: 0, output_tokens: 0 } } });
  const text = (delta: string) => {
    if (sent === undefined) ev('content_block_start', { index: 0, content_block: { type: 'text', text: '' } });
    ev('content_block_delta', { index: 0, delta: { type: 'text_delta', text: delta } });
    sent = (sent ?? '') + delta;
  };
  return {
    get started() { return out.started; },
    text: (_index, delta) => text(delta),
    end: (reply) => {
      const final = anthropicMessage(reply);
      const content = reply.choices[0].message.content;
      const left = rest(content, sent ?? '');
      if (left) text(left);
      if (sent !== undefined) ev('content_block_stop', { index: 0 });
      let index = sent === undefined ? 0 : 1;
      for (const block of final.content as any[]) {
        if (block.type !== 'tool_use') continue;
        const start = { type: 'tool_use', id: block.id, name: block.name, input: {} };
        ev('content_block_start', { index, content_block: start });
        const json = JSON.stringify(block.input);
        ev('content_block_delta', { index, delta: { type: 'input_json_delta', partial_json: json } });
        ev('content_block_stop', { index: index++ });
      }
      ev('message_delta', {
        delta: { stop_reason: final.stop_reason, stop_sequence: final.stop_sequence },
        usage: { input_tokens: final.usage.input_tokens, output_tokens: final.usage.output_tokens },
      });
      ev('message_stop', {});
      res.end();
    },
    fail: (status, message) => { ev('error', { error: { type: errorType(status), message } }); res.end(); },
  };
}

// ----------------------------------------------------------------------------- http

function readJson(req: http.IncomingMessage): Promise<Record<string, unknown>> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    req.on('data', (c: Buffer) => {
      size += c.length;
      if (size > MAX_BODY_BYTES) reject(new BadRequest(`request body over ${MAX_BODY_BYTES} bytes`));
      else chunks.push(c);
    });
    req.on('error', reject);
    req.on('end', () => {
      try {
        const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
        const isObject = typeof body === 'object' && body !== null && !Array.isArray(body);
        if (isObject) resolve(body);
        else reject(new BadRequest('the body must be a JSON object'));
      } catch (e) {
        reject(new BadRequest(`the body is not valid JSON: ${(e as Error).message}`));
      }
    });
  });
}

function sendJson(res: http.ServerResponse, status: number, body: object) {
  res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(body));
}

const errorType = (status: number) => (status === 400 ? 'invalid_request_error' : status === 401 ? 'authentication_error'
  : status === 404 ? 'not_found_error' : 'api_error');

// Both SDKs read the error message from {error: {message, type}}.
function sendError(res: http.ServerResponse, api: string, status: number, message: string) {
  const error = { type: errorType(status), message };
  sendJson(res, status, api === 'anthropic' ? { type: 'error', error } : { error });
}
