// One episode's token-exact accumulation behind the loopback chat server (DESIGN.md "The agent
// boundary", invariant 1). The trajectory is the ids the engine sampled plus the tokenization of
// what the agent added; sampled ids are never decoded and re-encoded to rebuild it.
//
// Each request either
//   extends the previous conversation: the previous messages plus our reply are a list-prefix of the
//   new messages AND the render of that conversation is a string-prefix of the new render. Then the
//   template glue after our reply (e.g. "\n" after <|im_end|>) and ALL new messages are tokenized
//   together and appended (loss_mask 0), and the engine generates over the exact accumulated ids; or
//   rewrites the prefix (compaction, a template that drops earlier reasoning, other tools): the
//   current segment is sealed and a new one starts from the tokenized render.
import { randomBytes } from 'node:crypto';
import type { ChatMessage, ChatTemplate, ToolCall, ToolSpec } from './chat-template';
import { parseToolCalls } from './tool-calls';

export interface Sampling {
  max_tokens: number;
  temperature: number;
  top_p: number;
  top_k: number;
  stop_token_ids: number[];
  seed?: number;
}
export type FinishReason = 'stop' | 'length' | 'abort';
export interface Generation { token_ids: number[]; logprobs: number[]; versions: number[]; finish_reason: FinishReason }
// The router plugs in here (session affinity; on failover it resubmits the accumulated ids).
export type GenerateFn = (sessionId: string, promptIds: number[], sampling: Sampling) => Promise<Generation>;

// Same meaning as the trajectory store: logprobs 0, versions -1, loss_mask 0 where not sampled.
export interface Segment { tokens: number[]; logprobs: number[]; versions: number[]; loss_mask: number[] }

export interface TurnRequest {
  messages: ChatMessage[];
  tools?: ToolSpec[];
  sampling: Partial<Sampling>; // request overrides of the session defaults; stop_token_ids are added to the session's
  parseTools: boolean; // false for tool_choice "none": the reply stays text
  retryKey: string; // an identical request (same API, same body) returns the cached reply
}
export interface TurnReply {
  id: string; // response id; a cached retry returns the same one
  created: number; // unix seconds
  message: ChatMessage; // the assistant turn, as the agent should send it back
  finishReason: FinishReason;
  stoppedOn?: number; // the stop id that ended generation (not part of the content)
  stopText?: string; // its text
  promptTokens: number;
  completionTokens: number;
}

export interface SessionOptions {
  template: ChatTemplate;
  generate: GenerateFn;
  defaults: Sampling; // the recipe's sampling; stop_token_ids must hold the end-of-turn ids
  maxContext: number;
}

export class ChatSession {
  readonly id = randomBytes(16).toString('hex'); // unguessable: it is the capability in the URL
  readonly apiKey = randomBytes(16).toString('hex');
  private readonly sealed: Segment[] = [];
  private current: Segment | null = null;
  private conversation: ChatMessage[] = []; // previous request's messages + our reply
  private promptRender = ''; // render (with generation prompt) the last reply was sampled after
  private sampledIds: number[] = [];
  private lastKey: string | null = null;
  private lastReply: TurnReply | null = null;
  private queue: Promise<unknown> = Promise.resolve(); // one request at a time per session
  lastFinish: FinishReason | null = null;

  constructor(private readonly opts: SessionOptions) {}

  get template() {
    return this.opts.template;
  }

  get tokenizer() {
    return this.opts.template.tokenizer;
  }

  turn(req: TurnRequest): Promise<TurnReply> {
    const run = this.queue.then(() => this.turnLocked(req));
    this.queue = run.catch(() => undefined);
    return run;
  }

  // Every segment with at least one sampled token (sealed ones first).
  segments(): Segment[] {
    const all = this.current ? [...this.sealed, this.current] : [...this.sealed];
    return all.filter((s) => s.loss_mask.includes(1)).map((s) => structuredClone(s));
  }

  private async turnLocked(req: TurnRequest): Promise<TurnReply> {
    if (req.retryKey === this.lastKey && this.lastReply) return this.lastReply;
    const { template, generate, defaults, maxContext } = this.opts;
    const tok = template.tokenizer;
    const render = template.render(req.messages, req.tools, true);

    const appended = this.extension(req, render); // null: the request rewrites the conversation
    const observation = appended ?? tok.encode(render);
    const prompt = appended && this.current ? [...this.current.tokens, ...appended] : observation;

    // max_tokens is clamped to what is left of the context; a full context ends with "length".
    const remaining = maxContext - prompt.length;
    const stopIds = [...new Set([...defaults.stop_token_ids, ...(req.sampling.stop_token_ids ?? [])])];
    const sampling: Sampling = {
      ...defaults, ...req.sampling, stop_token_ids: stopIds,
      max_tokens: Math.min(req.sampling.max_tokens ?? defaults.max_tokens, remaining),
    };
    const gen: Generation = remaining > 0
      ? await generate(this.id, prompt, sampling)
      : { token_ids: [], logprobs: [], versions: [], finish_reason: 'length' };

    // Only a successful generation changes the session, so a failed request can simply be retried.
    if (!appended || !this.current) {
      if (this.current) this.sealed.push(this.current);
      this.current = { tokens: [], logprobs: [], versions: [], loss_mask: [] };
    }
    const seg = this.current;
    for (const id of observation) push(seg, id, 0, -1, 0);
    gen.token_ids.forEach((id, i) => push(seg, id, gen.logprobs[i], gen.versions[i], 1));
    const promptTokens = prompt.length;

    // The reply text (for the agent only) leaves out the stop token that ended the turn.
    const last = gen.token_ids[gen.token_ids.length - 1];
    const stoppedOn = gen.finish_reason === 'stop' && stopIds.includes(last) ? last : undefined;
    const text = this.decode(stoppedOn === undefined ? gen.token_ids : gen.token_ids.slice(0, -1));
    const parsed = req.parseTools ? parseToolCalls(text, () => 'call_' + randomBytes(8).toString('hex'))
      : { content: text, toolCalls: [] as ToolCall[] };
    const message: ChatMessage = { role: 'assistant', content: parsed.content };
    if (parsed.toolCalls.length) message.tool_calls = parsed.toolCalls;

    this.conversation = [...req.messages, message];
    this.promptRender = render;
    this.sampledIds = gen.token_ids;
    this.lastFinish = gen.finish_reason;
    this.lastKey = req.retryKey;
    this.lastReply = {
      id: randomBytes(12).toString('hex'), created: Math.floor(Date.now() / 1000), message,
      finishReason: gen.finish_reason, stoppedOn, stopText: stoppedOn === undefined ? undefined : tok.decode([stoppedOn]),
      promptTokens, completionTokens: gen.token_ids.length,
    };
    return this.lastReply;
  }

  // Text for the agent and for aligning with the template; never used to rebuild ids.
  private decode(ids: number[]): string {
    return ids.length ? this.opts.template.tokenizer.decode(ids) : '';
  }

  // The ids to append when `req` extends the previous conversation, or null when it rewrites it.
  private extension(req: TurnRequest, render: string): number[] | null {
    const prev = this.conversation;
    if (!prev.length || req.messages.length <= prev.length) return null;
    if (!prev.every((m, i) => sameMessage(m, req.messages[i]))) return null;
    const prevRender = this.opts.template.render(prev, req.tools, false);
    if (!render.startsWith(prevRender) || !prevRender.startsWith(this.promptRender)) return null;
    const glue = this.glueAfterReply(prevRender.slice(this.promptRender.length));
    if (glue === null) return null;
    return this.opts.template.tokenizer.encode(glue + render.slice(prevRender.length));
  }

  // `replyRender` is how the template renders our reply turn, e.g. "hi<|im_end|>\n". The sampled ids
  // stand for its start; what the template adds beyond them (here "\n") is the glue to tokenize.
  private glueAfterReply(replyRender: string): string | null {
    const sampledText = this.decode(this.sampledIds);
    if (replyRender.startsWith(sampledText)) return replyRender.slice(sampledText.length);
    // The turn ended on a stop token the template does not write there (e.g. <|endoftext|> where the
    // template closes with <|im_end|>): keep the model's ids, stop token included, and append the
    // template's own close of the turn.
    const last = this.sampledIds[this.sampledIds.length - 1];
    const stopped = last !== undefined && this.opts.defaults.stop_token_ids.includes(last);
    const body = this.decode(this.sampledIds.slice(0, -1));
    if (stopped && replyRender.startsWith(body) && !replyRender.slice(body.length).startsWith(this.decode([last]))) {
      return replyRender.slice(body.length);
    }
    // The template re-formats the reply (e.g. tool-call JSON spacing): the model's own ids stand for
    // the whole turn up to its end-of-turn token, and the glue is what follows that token.
    if (!stopped) return null;
    const endOfTurn = this.decode([last]);
    const at = replyRender.lastIndexOf(endOfTurn);
    return at < 0 ? null : replyRender.slice(at + endOfTurn.length);
  }
}

function push(seg: Segment, id: number, logprob: number, version: number, mask: number) {
  seg.tokens.push(id);
  seg.logprobs.push(logprob);
  seg.versions.push(version);
  seg.loss_mask.push(mask);
}

// Messages compare by what the template can see: role, text, tool-call names and arguments, tool ids.
function sameMessage(a: ChatMessage, b: ChatMessage): boolean {
  const key = (m: ChatMessage) => JSON.stringify([m.role, m.content ?? '', m.tool_call_id ?? null, m.is_error ?? false,
    (m.tool_calls ?? []).map((c) => [c.function.name, c.function.arguments])]);
  return key(a) === key(b);
}
