// The model's own chat template (tokenizer_config.json `chat_template`), rendered with
// @huggingface/jinja exactly as Python transformers' apply_chat_template renders it
// (test/unit/chat-template.test.ts checks this against a fixture made by transformers).
import { Template } from '@huggingface/jinja';
import { tokenizerFor, TextTokenizer } from './tokenizer';

// A message in the template's (OpenAI / Hugging Face) shape; both APIs are converted to this.
export interface ToolCall { id: string; type: 'function'; function: { name: string; arguments: unknown } }
// An image, processed once by the engine (POST /images) and stored content-addressed: the template renders
// one placeholder for it, which encode() expands to `tokens` placeholders, as the model's processor does.
export interface ImagePart { type: 'image'; path: string; tokens: number }
export type ContentPart = { type: 'text'; text: string } | ImagePart;
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string | ContentPart[]; // parts only in user and tool messages, and only for vision-language models
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  is_error?: boolean; // a tool result that reports a failure (Anthropic tool_result is_error)
}
export type TextMessage = ChatMessage & { content: string };
// The text of a message's content (image parts dropped), for code that reads text: rewards, SFT data.
export const contentText = (content: ChatMessage['content']): string =>
  typeof content === 'string' ? content : content.map((p) => (p.type === 'text' ? p.text : '')).join('');
export interface ToolSpec { type: 'function'; function: { name: string; description?: string; parameters?: unknown } }

export class ChatTemplate {
  private readonly template: Template;
  private readonly specialTokens: Record<string, string>;
  // Whether the template shows a tool result's is_error; when it does not, the flag cannot reach the
  // model and the loopback server refuses it rather than drop it.
  readonly rendersToolErrors: boolean;

  constructor(source: string, readonly tokenizer: TextTokenizer) {
    this.template = new Template(source);
    this.rendersToolErrors = /\bis_error\b/.test(source);
    // transformers passes the special tokens (bos_token, eos_token, ...) to the template as strings.
    const tokenText = (v: unknown) => (typeof v === 'string' ? v : (v as { content?: string } | null)?.content);
    this.specialTokens = {};
    for (const key of ['bos_token', 'eos_token', 'pad_token', 'unk_token']) {
      const text = tokenText(tokenizer.config[key]);
      if (text !== undefined) this.specialTokens[key] = text;
    }
  }

  static load(modelDir: string): ChatTemplate {
    const tokenizer = tokenizerFor(modelDir);
    const source = tokenizer.config.chat_template;
    if (typeof source !== 'string') throw new Error(`chat template: ${modelDir}/tokenizer_config.json has no string chat_template`);
    return new ChatTemplate(source, tokenizer);
  }

  // Ids that end an assistant turn: the eos token, and the ChatML end-of-turn / end-of-text tokens
  // where the vocabulary has them. The engine stops on these.
  endOfTurnIds(): number[] {
    const names = [this.specialTokens.eos_token, '<|im_end|>', '<|endoftext|>'];
    const ids = names.map((n) => (n === undefined ? undefined : this.tokenizer.tokenId(n)));
    return [...new Set(ids.filter((id): id is number => id !== undefined))];
  }

  // The image placeholder id of a vision-language model's tokenizer (Qwen-VL), undefined for a text-only one.
  get imageToken(): number | undefined {
    return imageTokenOf(this.tokenizer);
  }

  // Token ids of rendered text holding one placeholder per image of `images` (in order).
  encode(text: string, images: ImagePart[]): number[] {
    return encodeWithImages(this.tokenizer, text, images.map((im) => im.tokens), 'chat template: the render');
  }

  render(messages: ChatMessage[], tools: ToolSpec[] | undefined, addGenerationPrompt: boolean): string {
    return this.template.render({
      ...this.specialTokens,
      messages,
      tools: tools && tools.length ? tools : undefined,
      add_generation_prompt: addGenerationPrompt,
    });
  }
}

export const imageTokenOf = (tokenizer: TextTokenizer): number | undefined => tokenizer.tokenId('<|image_pad|>');

// Token ids of text holding one placeholder per image, each expanded to that image's placeholder count (`counts`,
// in order), as the model's processor expands the text before tokenizing.
export function encodeWithImages(tokenizer: TextTokenizer, text: string, counts: number[], what: string): number[] {
  const ids = tokenizer.encode(text);
  const pad = imageTokenOf(tokenizer);
  const at = ids.flatMap((id, i) => (id === pad ? [i] : []));
  if (at.length !== counts.length) {
    throw new Error(`${what} holds ${at.length} image placeholders for ${counts.length} images`);
  }
  return ids.flatMap((id, i) => (id === pad ? Array(counts[at.indexOf(i)]).fill(id) : [id]));
}

export const imagesOf = (messages: ChatMessage[]): ImagePart[] =>
  messages.flatMap((m) => (Array.isArray(m.content) ? m.content.filter((p): p is ImagePart => p.type === 'image') : []));
