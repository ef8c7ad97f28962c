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
import {
  imagesOf, type ChatMessage, type ChatTemplate, type TextMessage, type ToolCall, type ToolSpec,
} from './chat-template';
import { deriveSeed } from './env-runner';
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
// The router plugs in here (session affinity; on failover it resubmits the accumulated ids). One that
// streams calls onToken with each sampled id as it arrives; true back ends the generation after that
// id (a client stop string is complete), with finish_reason "stop". One that does not stream may
// ignore onToken: the session cuts the finished reply at the same id. images: the processed image files of
// the prompt's placeholder runs, in order (vision-language models; empty otherwise).
export type GenerateFn = (sessionId: string, promptIds: number[], sampling: Sampling,
  onToken?: (id: number) => boolean, images?: string[]) => Promise<Generation>;

// Same meaning as the trajectory store: logprobs 0, versions -1, loss_mask 0 where not sampled; images: the
// processed image files of its placeholder runs, in order (the store's `images` metadata).
export interface Segment {
  tokens: number[]; logprobs: number[]; versions: number[]; loss_mask: number[]; images?: string[];
}
// An image the agent sent (base64 of the file), processed once by the engine and stored: its file and how many
// placeholder tokens it fills. A ValueError-like rejection (bad image) comes back as an Error with the reason.
export type ProcessImageFn = (data: string) => Promise<{ path: string; tokens: number }>;

export interface TurnRequest {
  messages: ChatMessage[];
  tools?: ToolSpec[];
  sampling: Partial<Sampling>; // request overrides of the session defaults (whose stop ids end every turn)
  stop: string[]; // client stop strings, found in the decoded text as it is sampled (may span tokens)
  n: number; // samples of this turn, each one a branch of its own
  parseTools: boolean; // false without tools or for tool_choice "none": the reply stays text
  key: string; // what the request is: API + body, or the client's idempotency key
  retry: boolean; // the client marked it a retry: an earlier request with the same key gets its reply again
}
export interface Choice {
  message: TextMessage; // the assistant turn, as the agent should send it back
  finishReason: FinishReason;
  stopText?: string; // the client stop string that ended the turn (not part of the content)
  completionTokens: number;
}
export interface TurnReply {
  id: string; // response id; a retry answered from the cache returns the same one
  created: number; // unix seconds
  choices: Choice[];
  promptTokens: number;
}
// Live text of sample `index` while it is generated: only what is sure to be content (never a stop
// string's start, an incomplete UTF-8 character or tool-call markup), so the deltas are a prefix of
// the reply's content.
export type OnText = (index: number, delta: string) => void;

export interface SessionOptions {
  template: ChatTemplate;
  generate: GenerateFn;
  defaults: Sampling; // the recipe's sampling; stop_token_ids must hold the end-of-turn ids
  maxContext: number;
  processImage?: ProcessImageFn; // vision-language models: how images reach the engine and the store
}

// Where a reply sits: its segment, the ids it was sampled after (tokens [0, promptEnd)) and its end.
// A later request that extends the reply appends to the segment, or forks a copy of it when the
// segment has grown past the reply (the agent went back to it); one that repeats the reply's request
// forks a copy at promptEnd. A fork's copied ids are context (loss_mask 0): each sampled token is
// trained in one segment only.
interface Branch {
  segment: Segment;
  promptEnd: number;
  end: number;
  request: ChatMessage[];
  conversation: ChatMessage[]; // the request's messages + the reply
  promptRender: string; // render (with generation prompt) the reply was sampled after
  sampledIds: number[];
  text: string; // the reply's text before a client stop string, tool calls not yet parsed out
  clientStop: boolean; // a client stop string ended it
}
interface Sample { gen: Generation; text: string; stopText?: string }

const MAX_BRANCHES = 64; // newest kept; an agent returning to an older reply starts a new segment

export class ChatSession {
  readonly id = randomBytes(16).toString('hex'); // unguessable: it is the capability in the URL
  readonly apiKey = randomBytes(16).toString('hex');
  private readonly all: Segment[] = [];
  private branches: Branch[] = [];
  private readonly replies = new Map<string, TurnReply>(); // request key -> its latest reply, for retries
  private queue: Promise<unknown> = Promise.resolve(); // one request at a time per session
  lastFinish: FinishReason | null = null;

  constructor(private readonly opts: SessionOptions) {}

  get template() {
    return this.opts.template;
  }

  get tokenizer() {
    return this.opts.template.tokenizer;
  }

  turn(req: TurnRequest, onText?: OnText): Promise<TurnReply> {
    const run = this.queue.then(() => this.turnLocked(req, onText));
    this.queue = run.catch(() => undefined);
    return run;
  }

  // Every segment with at least one sampled token, in the order they were opened.
  segments(): Segment[] {
    return this.all.filter((s) => s.loss_mask.includes(1)).map((s) => structuredClone(s));
  }

  private async turnLocked(req: TurnRequest, onText?: OnText): Promise<TurnReply> {
    // A retry (marked by the client) gets the reply its first attempt got; a deliberate repeat of
    // the same request is a new sample (best-of-n, self-consistency).
    const cached = req.retry ? this.replies.get(req.key) : undefined;
    if (cached) return cached;
    const { template, generate, defaults, maxContext } = this.opts;
    const render = template.render(req.messages, req.tools, true);
    const from = this.continued(req, render); // null: a new conversation
    const prompt = from ? [...from.branch.segment.tokens.slice(0, from.at), ...from.appended]
      : template.encode(render, imagesOf(req.messages));
    // The prompt's ids hold the images of every message in order: earlier ones in the prefix, new ones appended.
    const images = imagesOf(req.messages).map((im) => im.path);

    // max_tokens is clamped to what is left of the context; a full context ends with "length".
    const remaining = maxContext - prompt.length;
    const sampling: Sampling = {
      ...defaults, ...req.sampling, stop_token_ids: defaults.stop_token_ids,
      max_tokens: Math.min(req.sampling.max_tokens ?? defaults.max_tokens, remaining),
    };
    const samples: Sample[] = [];
    for (let i = 0; i < req.n; i++) {
      // An agent's seed gives n different samples, each reproducible.
      const seed = sampling.seed === undefined || i === 0 ? sampling.seed : deriveSeed(sampling.seed, i);
      const text = new SampleText(this, req.stop, req.parseTools, onText && ((delta) => onText(i, delta)));
      const params = { ...sampling, ...(seed === undefined ? {} : { seed }) };
      // The ids one at a time only where something reads them as they come (a stop string, a streaming client):
      // a generate that need not stream for them sends far fewer chunks (activities/episode-journal.ts).
      const gen: Generation = remaining > 0
        ? await generate(this.id, prompt, params, text.readsIds ? (id) => text.push(id) : undefined, images)
        : { token_ids: [], logprobs: [], versions: [], finish_reason: 'length' };
      samples.push(text.finish(gen));
    }

    // Only a successful request changes the session, so a failed one can simply be retried.
    const inPlace = from !== null && from.at === from.branch.segment.tokens.length;
    const choices = samples.map((sample, i): Choice => {
      const { gen } = sample;
      let seg: Segment;
      if (i === 0 && inPlace) {
        seg = from.branch.segment;
        for (const id of from.appended) push(seg, id, 0, -1, 0);
      } else {
        seg = { tokens: [], logprobs: [], versions: [], loss_mask: [] };
        this.all.push(seg);
        for (const id of prompt) push(seg, id, 0, -1, 0);
      }
      if (images.length) seg.images = images;
      const promptEnd = seg.tokens.length;
      gen.token_ids.forEach((id, k) => push(seg, id, gen.logprobs[k], gen.versions[k], 1));
      const parsed = req.parseTools ? parseToolCalls(sample.text, () => 'call_' + randomBytes(8).toString('hex'))
        : { content: sample.text, toolCalls: [] as ToolCall[] };
      const message: Choice['message'] = { role: 'assistant', content: parsed.content };
      if (parsed.toolCalls.length) message.tool_calls = parsed.toolCalls;
      this.branches.push({
        segment: seg, promptEnd, end: seg.tokens.length, request: req.messages,
        conversation: [...req.messages, message], promptRender: render, sampledIds: gen.token_ids,
        text: sample.text, clientStop: sample.stopText !== undefined,
      });
      this.lastFinish = gen.finish_reason;
      const completionTokens = gen.token_ids.length;
      return { message, finishReason: gen.finish_reason, stopText: sample.stopText, completionTokens };
    });
    this.branches = this.branches.slice(-MAX_BRANCHES);
    const reply: TurnReply = {
      id: randomBytes(12).toString('hex'), created: Math.floor(Date.now() / 1000), choices, promptTokens: prompt.length,
    };
    this.replies.set(req.key, reply);
    return reply;
  }

  // Text for the agent and for aligning with the template; never used to rebuild ids.
  decode(ids: number[]): string {
    return ids.length ? this.opts.template.tokenizer.decode(ids) : '';
  }

  // An image of a request, processed and stored once (the same image again: the same file).
  async processImage(data: string): Promise<{ path: string; tokens: number }> {
    if (this.opts.template.imageToken === undefined) {
      throw new Error('the policy is not a vision-language model: it takes no images');
    }
    if (!this.opts.processImage) throw new Error('images are not taken here (no image store)');
    return this.opts.processImage(data);
  }

  isEndOfTurn(id: number): boolean {
    return this.opts.defaults.stop_token_ids.includes(id);
  }

  // The branch `req` continues (newest first) and the ids to append after `at` in its segment, or
  // null when it continues none (a new conversation, a compaction, other tools).
  private continued(req: TurnRequest, render: string): { branch: Branch; at: number; appended: number[] } | null {
    for (let b = this.branches.length - 1; b >= 0; b--) {
      const appended = this.extension(this.branches[b], req, render);
      if (appended) return { branch: this.branches[b], at: this.branches[b].end, appended };
    }
    for (let b = this.branches.length - 1; b >= 0; b--) {
      const { request, promptRender } = this.branches[b];
      const same = request.length === req.messages.length && request.every((m, i) => sameMessage(m, req.messages[i]));
      if (same && render === promptRender) {
        return { branch: this.branches[b], at: this.branches[b].promptEnd, appended: [] };
      }
    }
    return null;
  }

  // The ids to append when `req` extends the branch's conversation, or null when it does not.
  private extension(branch: Branch, req: TurnRequest, render: string): number[] | null {
    const prev = branch.conversation;
    if (req.messages.length <= prev.length) return null;
    if (!prev.every((m, i) => sameMessage(m, req.messages[i]))) return null;
    const prevRender = this.opts.template.render(prev, req.tools, false);
    if (!render.startsWith(prevRender) || !prevRender.startsWith(branch.promptRender)) return null;
    const glue = this.glueAfterReply(branch, prevRender.slice(branch.promptRender.length));
    if (glue === null) return null;
    return this.opts.template.encode(glue + render.slice(prevRender.length), imagesOf(req.messages.slice(prev.length)));
  }

  // `replyRender` is how the template renders our reply turn, e.g. "hi<|im_end|>\n". The sampled ids
  // stand for its start; what the template adds beyond them (here "\n") is the glue to tokenize.
  private glueAfterReply(branch: Branch, replyRender: string): string | null {
    // A client stop string ended the turn: as after a stop token, the sampled ids (the stop string
    // included) stand for the reply's text and the template's own close of the turn follows them.
    if (branch.clientStop) return replyRender.startsWith(branch.text) ? replyRender.slice(branch.text.length) : null;
    const sampledText = this.decode(branch.sampledIds);
    if (replyRender.startsWith(sampledText)) return replyRender.slice(sampledText.length);
    // The turn ended on a stop token the template does not write there (e.g. <|endoftext|> where the
    // template closes with <|im_end|>): keep the model's ids, stop token included, and append the
    // template's own close of the turn.
    const last = branch.sampledIds[branch.sampledIds.length - 1];
    const stopped = last !== undefined && this.isEndOfTurn(last);
    const body = this.decode(branch.sampledIds.slice(0, -1));
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

const TOOL_CALL = '<tool_call>';

// One sample as its ids arrive: finds the client stop strings in the decoded text (a string may span
// tokens, or end inside one: the ids are kept as sampled up to the one that completes it), and hands
// the text that is sure to be content to `onText` as it grows.
class SampleText {
  private readonly ids: number[] = [];
  private stopAt = -1; // where the stop string starts in the text
  private stopText: string | undefined;
  private sent = '';

  constructor(private readonly session: ChatSession, private readonly stops: string[], private readonly tools: boolean,
    private readonly onText?: (delta: string) => void) {}

  // Whether a sampled id is read at once (for a stop string, or for the client's stream); else finish() takes them.
  get readsIds(): boolean {
    return this.stops.length > 0 || this.onText !== undefined;
  }

  // One sampled id; true when it completes a stop string (the generation ends with it).
  push(id: number): boolean {
    if (this.stopText !== undefined) return true;
    this.ids.push(id);
    if (!this.stops.length && !this.onText) return false;
    const text = this.text();
    let first: { at: number; stop: string } | undefined; // the stop string completed first
    for (const stop of this.stops) {
      const at = text.indexOf(stop);
      if (at >= 0 && (!first || at + stop.length < first.at + first.stop.length)) first = { at, stop };
    }
    if (first) {
      [this.stopAt, this.stopText] = [first.at, first.stop];
      return true;
    }
    if (this.onText) this.send(this.surelyContent(text));
    return false;
  }

  // The reply once generated. A generate that did not stream (or did not stop at our word) is cut
  // here at the same id.
  finish(gen: Generation): Sample {
    for (let i = this.ids.length; i < gen.token_ids.length && this.stopText === undefined; i++) {
      this.push(gen.token_ids[i]);
    }
    const n = this.ids.length;
    const cut: Generation = this.stopText === undefined ? gen : {
      token_ids: gen.token_ids.slice(0, n), logprobs: gen.logprobs.slice(0, n), versions: gen.versions.slice(0, n),
      finish_reason: 'stop',
    };
    const text = this.stopText === undefined ? this.text() : this.text().slice(0, this.stopAt);
    return { gen: cut, text, stopText: this.stopText };
  }

  // The decoded ids, without the end-of-turn token that ended them.
  private text(): string {
    const last = this.ids[this.ids.length - 1];
    return this.session.decode(last !== undefined && this.session.isEndOfTurn(last) ? this.ids.slice(0, -1) : this.ids);
  }

  private surelyContent(text: string): string {
    let safe = text.replace(/\uFFFD{1,3}$/, ''); // an incomplete UTF-8 character
    const held = (s: string, word: string) => { // the longest end of s that begins word
      for (let k = Math.min(word.length - 1, s.length); k > 0; k--) if (s.endsWith(word.slice(0, k))) return k;
      return 0;
    };
    for (const stop of this.stops) safe = safe.slice(0, safe.length - held(safe, stop));
    if (this.tools) { // tool-call markup comes back structured, and trailing space is trimmed from the content
      const at = safe.indexOf(TOOL_CALL);
      safe = (at >= 0 ? safe.slice(0, at) : safe.slice(0, safe.length - held(safe, TOOL_CALL))).trimEnd();
    }
    return safe;
  }

  private send(safe: string) {
    if (safe.length > this.sent.length && safe.startsWith(this.sent)) {
      this.onText!(safe.slice(this.sent.length));
      this.sent = safe;
    }
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
