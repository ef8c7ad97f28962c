// Hermes / Qwen tool calls in the model's text: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
// All-or-nothing: if any block is malformed, the whole reply stays text, so the agent sees exactly
// what the model wrote and nothing is silently dropped.
import type { ToolCall } from './chat-template';

const BLOCK = /<tool_call>([\s\S]*?)<\/tool_call>/g;

export interface ParsedReply { content: string; toolCalls: ToolCall[] }

export function parseToolCalls(text: string, newId: () => string): ParsedReply {
  const toolCalls: ToolCall[] = [];
  for (const match of text.matchAll(BLOCK)) {
    let call: unknown;
    try {
      call = JSON.parse(match[1]);
    } catch {
      return { content: text, toolCalls: [] };
    }
    const { name, arguments: args } = (call ?? {}) as { name?: unknown; arguments?: unknown };
    const argsOk = args === undefined || (typeof args === 'object' && args !== null && !Array.isArray(args));
    if (typeof name !== 'string' || !name || !argsOk) return { content: text, toolCalls: [] };
    toolCalls.push({ id: newId(), type: 'function', function: { name, arguments: args ?? {} } });
  }
  if (!toolCalls.length) return { content: text, toolCalls };
  // An opened but unclosed block is a malformed call too.
  const rest = text.replace(BLOCK, '');
  if (rest.includes('<tool_call>')) return { content: text, toolCalls: [] };
  // Only trailing space goes: the text before the first call can then be streamed as it is sampled.
  return { content: rest.trimEnd(), toolCalls };
}
