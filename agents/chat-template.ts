// The model's own chat template (tokenizer_config.json `chat_template`), rendered with
// @huggingface/jinja exactly as Python transformers' apply_chat_template renders it
// (test/unit/chat-template.test.ts checks this against a fixture made by transformers).
import { Template } from '@huggingface/jinja';
import { tokenizerFor, TextTokenizer } from './tokenizer';

// A message in the template's (OpenAI / Hugging Face) shape; both APIs are converted to this.
export interface ToolCall { id: string; type: 'function'; function: { name: string; arguments: unknown } }
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  is_error?: boolean; // a tool result that reports a failure (Anthropic tool_result is_error)
}
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

  render(messages: ChatMessage[], tools: ToolSpec[] | undefined, addGenerationPrompt: boolean): string {
    return this.template.render({
      ...this.specialTokens,
      messages,
      tools: tools && tools.length ? tools : undefined,
      add_generation_prompt: addGenerationPrompt,
    });
  }
}
