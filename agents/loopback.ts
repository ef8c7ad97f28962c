// The loopback chat server inside the rollout worker: OpenAI chat completions and Anthropic messages
// over one token-exact ChatSession per episode (agents/chat-session.ts). Bound to 127.0.0.1 only; a
// session is reachable only through its unguessable id in the path (/s/<id>/v1/...) and its api key.
//
// Every request field is either honoured or refused with a 400 naming it: nothing that changes
// sampling is silently ignored.
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { ChatMessage, ToolSpec } from './chat-template';
import { ChatSession, type Sampling, type SessionOptions, type TurnReply, type TurnRequest } from './chat-session';

const LOOPBACK_HOSTS = new Set(['127.0.0.1', 'localhost', '::1']);
const MAX_BODY_BYTES = 16 * 1024 * 1024;
const MODEL_NAME = 'policy';

class BadRequest extends Error {}
const bad = (message: string): never => { throw new BadRequest(message); };

export class LoopbackServer {
  private readonly sessions = new Map<string, ChatSession>();

  private constructor(private readonly server: http.Server, readonly port: number) {}

  static async start(host = '127.0.0.1'): Promise<LoopbackServer> {
    // The server hands the policy to any caller: it must never be reachable from another machine.
    if (!LOOPBACK_HOSTS.has(host)) throw new Error(`loopback server: refusing to bind ${host}; only 127.0.0.1 is allowed`);
    const server = http.createServer();
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
    try {
      const match = /^\/s\/([0-9a-f]+)\/v1\/(models|chat\/completions|messages)$/.exec((req.url ?? '').split('?')[0]);
      const session = match && this.sessions.get(match[1]);
      if (!match || !session) return sendError(res, api, 404, `no such endpoint or session: ${req.method} ${req.url}`);
      const key = req.headers['x-api-key'] ?? (req.headers.authorization ?? '').replace(/^Bearer /, '');
      if (key !== session.apiKey) return sendError(res, api, 401, 'wrong or missing api key for this session');
      const route = `${req.method} ${match[2]}`;
      if (route === 'GET models') {
        return sendJson(res, 200, { object: 'list', data: [{ id: MODEL_NAME, object: 'model', created: 0, owned_by: 'molt' }] });
      }
      if (route !== 'POST chat/completions' && route !== 'POST messages') return sendError(res, api, 405, `${route} is not served`);
      const body = await readJson(req);
      if (api === 'openai') {
        const { turn, stream, includeUsage } = openaiTurn(body, session);
        const reply = await session.turn(turn);
        if (stream) sendSse(res, [...openaiChunks(reply, includeUsage).map((data) => ({ data })), { data: '[DONE]' }]);
        else sendJson(res, 200, openaiCompletion(reply));
      } else {
        const { turn, stream, stopSequences } = anthropicTurn(body, session);
        const reply = await session.turn(turn);
        const message = anthropicMessage(reply, stopSequences);
        if (stream) sendSse(res, anthropicEvents(message));
        else sendJson(res, 200, message);
      }
    } catch (e) {
      if (e instanceof BadRequest) return sendError(res, api, 400, e.message);
      sendError(res, api, 502, `generation failed: ${(e as Error).message}`);
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
  if (typeof value !== 'number' || !Number.isFinite(value) || !ok(value)) bad(`${name} must be ${rule}, got ${JSON.stringify(value)}`);
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

// Stop strings become engine stop ids. A string that is not exactly one token cannot stop the
// engine at a token boundary without cutting sampled ids, so it is refused.
function stopIds(stops: unknown, name: string, session: ChatSession): number[] {
  if (stops === undefined || stops === null) return [];
  const list = typeof stops === 'string' ? [stops] : stops;
  if (!Array.isArray(list) || !list.every((x) => typeof x === 'string')) return bad(`${name} must be a string or a list of strings`);
  return list.map((text) => {
    const ids = session.tokenizer.encode(text);
    if (ids.length !== 1) bad(`${name}: ${JSON.stringify(text)} is ${ids.length} tokens; only single-token stop strings are supported`);
    return ids[0];
  });
}

function textOf(content: unknown, where: string): string {
  if (typeof content === 'string') return content;
  if (content === null || content === undefined) return '';
  if (Array.isArray(content)) {
    return content.map((part) => {
      if (part?.type !== 'text' || typeof part.text !== 'string') bad(`${where}: only text content parts are supported, got ${JSON.stringify(part?.type)}`);
      return part.text as string;
    }).join('');
  }
  return bad(`${where}: content must be a string or a list of text parts`);
}

function parseArguments(args: unknown): unknown {
  if (typeof args !== 'string') return args ?? {};
  try { return JSON.parse(args); } catch { return args; } // the template renders a string as is
}

function checkTools(tools: unknown): ToolSpec[] | undefined {
  if (tools === undefined || tools === null) return undefined;
  if (!Array.isArray(tools)) return bad('tools must be a list');
  for (const t of tools) {
    if (t?.type !== 'function' || typeof t.function?.name !== 'string') bad(`tools: each tool must be {type: "function", function: {name, ...}}, got ${JSON.stringify(t)}`);
  }
  return tools as ToolSpec[];
}

// tool_choice: "auto" lets the model decide; "none" keeps the reply as text. Forcing a call cannot be
// honoured without constrained decoding, so it is refused. Calls are parsed only when the request
// declared tools: a model shown no tool that writes <tool_call> wrote text, and gets it back as text.
function parseToolsFor(choice: unknown, none: unknown, auto: unknown): boolean {
  if (choice === undefined || choice === null || JSON.stringify(choice) === JSON.stringify(auto)) return true;
  if (JSON.stringify(choice) === JSON.stringify(none)) return false;
  return bad(`tool_choice ${JSON.stringify(choice)} is not supported (only ${JSON.stringify(auto)} and ${JSON.stringify(none)})`);
}

const OPENAI_FIELDS = ['model', 'messages', 'tools', 'tool_choice', 'max_tokens', 'max_completion_tokens', 'temperature',
  'top_p', 'top_k', 'stop', 'seed', 'n', 'stream', 'stream_options', 'parallel_tool_calls', 'user', 'metadata'];

function openaiTurn(body: Record<string, unknown>, session: ChatSession) {
  allowOnly(body, OPENAI_FIELDS, 'chat.completions');
  if (body.n !== undefined && body.n !== 1) bad('n must be 1');
  if (body.parallel_tool_calls === false) bad('parallel_tool_calls false is not supported');
  if (body.max_tokens !== undefined && body.max_completion_tokens !== undefined) bad('give max_tokens or max_completion_tokens, not both');
  if (!Array.isArray(body.messages) || !body.messages.length) bad('messages must be a non-empty list');
  const messages: ChatMessage[] = (body.messages as Record<string, unknown>[]).map((m, i) => {
    const where = `messages[${i}]`;
    switch (m?.role) {
      case 'system': case 'developer': return { role: 'system', content: textOf(m.content, where) };
      case 'user': return { role: 'user', content: textOf(m.content, where) };
      case 'tool':
        if (typeof m.tool_call_id !== 'string') bad(`${where}: a tool message needs tool_call_id`);
        return { role: 'tool', content: textOf(m.content, where), tool_call_id: m.tool_call_id as string };
      case 'assistant': {
        const msg: ChatMessage = { role: 'assistant', content: textOf(m.content, where) };
        if (Array.isArray(m.tool_calls) && m.tool_calls.length) {
          msg.tool_calls = m.tool_calls.map((c: any) => {
            if (c?.type !== 'function' || typeof c.function?.name !== 'string') bad(`${where}: malformed tool call ${JSON.stringify(c)}`);
            return { id: String(c.id), type: 'function' as const, function: { name: c.function.name, arguments: parseArguments(c.function.arguments) } };
          });
        }
        return msg;
      }
      default: return bad(`${where}: role ${JSON.stringify(m?.role)} is not supported`);
    }
  });
  const streamOptions = body.stream_options as { include_usage?: boolean } | undefined;
  const tools = checkTools(body.tools);
  const turn: TurnRequest = {
    messages,
    tools,
    sampling: { ...samplingFrom(body, body.max_completion_tokens ?? body.max_tokens, 'max_tokens'), stop_token_ids: stopIds(body.stop, 'stop', session) },
    parseTools: parseToolsFor(body.tool_choice, 'none', 'auto') && !!tools?.length,
    retryKey: 'openai ' + JSON.stringify(body),
  };
  return { turn, stream: body.stream === true, includeUsage: streamOptions?.include_usage === true };
}

const ANTHROPIC_FIELDS = ['model', 'messages', 'max_tokens', 'system', 'tools', 'tool_choice', 'temperature', 'top_p',
  'top_k', 'stop_sequences', 'stream', 'metadata'];

function anthropicTurn(body: Record<string, unknown>, session: ChatSession) {
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
          (msg.tool_calls ??= []).push({ id: String(b.id), type: 'function', function: { name: b.name, arguments: b.input ?? {} } });
        } else bad(`${where}: assistant block type ${JSON.stringify(b?.type)} is not supported`);
      }
      messages.push(msg);
    } else if (m.role === 'user') {
      // Blocks keep their order: tool results become tool messages, runs of text one user message.
      let text: string | null = null;
      const flush = () => { if (text !== null) messages.push({ role: 'user', content: text }); text = null; };
      for (const b of blocks as any[]) {
        if (b?.type === 'text') text = (text ?? '') + b.text;
        else if (b?.type === 'tool_result') {
          flush();
          const content = textOf(b.content, `${where} tool_result`);
          const result: ChatMessage = { role: 'tool', content, tool_call_id: String(b.tool_use_id) };
          if (b.is_error !== undefined && typeof b.is_error !== 'boolean') bad(`${where} tool_result: is_error must be a boolean`);
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
  const stopSequences = (body.stop_sequences ?? []) as string[];
  const turn: TurnRequest = {
    messages,
    tools,
    sampling: { ...samplingFrom(body, body.max_tokens, 'max_tokens'), stop_token_ids: stopIds(body.stop_sequences, 'stop_sequences', session) },
    parseTools: parseToolsFor(body.tool_choice, { type: 'none' }, { type: 'auto' }) && !!tools?.length,
    retryKey: 'anthropic ' + JSON.stringify(body),
  };
  return { turn, stream: body.stream === true, stopSequences };
}

// ----------------------------------------------------------------------------- replies

function openaiFinish(reply: TurnReply): string {
  // "abort" (the engine dropped the request) is a cut-off reply, like "length".
  if (reply.finishReason !== 'stop') return 'length';
  return reply.message.tool_calls ? 'tool_calls' : 'stop';
}

function openaiToolCalls(reply: TurnReply) {
  return reply.message.tool_calls?.map((c) => ({
    id: c.id, type: 'function', function: { name: c.function.name, arguments: JSON.stringify(c.function.arguments) },
  }));
}

function usage(reply: TurnReply) {
  return { prompt_tokens: reply.promptTokens, completion_tokens: reply.completionTokens, total_tokens: reply.promptTokens + reply.completionTokens };
}

function openaiCompletion(reply: TurnReply) {
  const toolCalls = openaiToolCalls(reply);
  return {
    id: `chatcmpl-${reply.id}`, object: 'chat.completion', created: reply.created, model: MODEL_NAME,
    choices: [{
      index: 0, finish_reason: openaiFinish(reply), logprobs: null,
      message: { role: 'assistant', content: toolCalls && !reply.message.content ? null : reply.message.content, refusal: null, ...(toolCalls ? { tool_calls: toolCalls } : {}) },
    }],
    usage: usage(reply),
  };
}

function openaiChunks(reply: TurnReply, includeUsage: boolean): object[] {
  const chunk = (choices: object[], extra: object = {}) => ({
    id: `chatcmpl-${reply.id}`, object: 'chat.completion.chunk', created: reply.created, model: MODEL_NAME, choices, ...extra,
  });
  const delta = (d: object, finish: string | null = null) => chunk([{ index: 0, delta: d, finish_reason: finish, logprobs: null }]);
  const chunks = [delta({ role: 'assistant', content: '' })];
  if (reply.message.content) chunks.push(delta({ content: reply.message.content }));
  openaiToolCalls(reply)?.forEach((c, index) => chunks.push(delta({ tool_calls: [{ index, ...c }] })));
  chunks.push(delta({}, openaiFinish(reply)));
  if (includeUsage) chunks.push(chunk([], { usage: usage(reply) }));
  return chunks;
}

function anthropicMessage(reply: TurnReply, stopSequences: string[]) {
  const content: object[] = [];
  if (reply.message.content) content.push({ type: 'text', text: reply.message.content });
  for (const c of reply.message.tool_calls ?? []) content.push({ type: 'tool_use', id: c.id, name: c.function.name, input: c.function.arguments });
  // A client stop sequence that ended the turn is reported as such; the end-of-turn token is end_turn.
  const stopText = reply.stoppedOn === undefined ? undefined : stopSequences.find((s) => s === reply.stopText);
  const stopReason = reply.finishReason !== 'stop' ? 'max_tokens'
    : reply.message.tool_calls ? 'tool_use' : stopText !== undefined ? 'stop_sequence' : 'end_turn';
  return {
    id: `msg_${reply.id}`, type: 'message', role: 'assistant', model: MODEL_NAME, content,
    stop_reason: stopReason, stop_sequence: stopReason === 'stop_sequence' ? stopText : null,
    usage: { input_tokens: reply.promptTokens, output_tokens: reply.completionTokens },
  };
}

// The event sequence the @anthropic-ai/sdk stream reader expects.
function anthropicEvents(message: ReturnType<typeof anthropicMessage>): { event: string; data: object }[] {
  const ev = (type: string, data: object) => ({ event: type, data: { type, ...data } });
  const events = [ev('message_start', {
    message: { ...message, content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: message.usage.input_tokens, output_tokens: 0 } },
  })];
  message.content.forEach((block: any, index) => {
    if (block.type === 'text') {
      events.push(ev('content_block_start', { index, content_block: { type: 'text', text: '' } }));
      events.push(ev('content_block_delta', { index, delta: { type: 'text_delta', text: block.text } }));
    } else {
      events.push(ev('content_block_start', { index, content_block: { type: 'tool_use', id: block.id, name: block.name, input: {} } }));
      events.push(ev('content_block_delta', { index, delta: { type: 'input_json_delta', partial_json: JSON.stringify(block.input) } }));
    }
    events.push(ev('content_block_stop', { index }));
  });
  events.push(ev('message_delta', { delta: { stop_reason: message.stop_reason, stop_sequence: message.stop_sequence }, usage: { output_tokens: message.usage.output_tokens } }));
  events.push(ev('message_stop', {}));
  return events;
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
        if (typeof body !== 'object' || body === null || Array.isArray(body)) reject(new BadRequest('the body must be a JSON object'));
        else resolve(body);
      } catch (e) {
        reject(new BadRequest(`the body is not valid JSON: ${(e as Error).message}`));
      }
    });
  });
}

function sendJson(res: http.ServerResponse, status: number, body: object) {
  res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(body));
}

// Both SDKs read the error message from {error: {message, type}}.
function sendError(res: http.ServerResponse, api: string, status: number, message: string) {
  const type = status === 400 ? 'invalid_request_error' : status === 401 ? 'authentication_error' : status === 404 ? 'not_found_error' : 'api_error';
  sendJson(res, status, api === 'anthropic' ? { type: 'error', error: { type, message } } : { error: { type, message } });
}

function sendSse(res: http.ServerResponse, events: { event?: string; data: object | string }[]) {
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
  for (const e of events) {
    res.write(`${e.event ? `event: ${e.event}\n` : ''}data: ${typeof e.data === 'string' ? e.data : JSON.stringify(e.data)}\n\n`);
  }
  res.end();
}
