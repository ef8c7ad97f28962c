// A `python` tool for multi-turn agents (as the original's geo3k agent calls a Python executor between
// turns): the spec to offer the policy, a handler that runs the call's code in the sandbox and returns
// the text of the tool message, and the agent's loop around them (recipes/code-tool, recipes/geo). A
// malformed call or a crashing program is an answer to the model, never an error of the episode.
import type OpenAI from 'openai';
import type { ToolSpec } from '../../agents/chat-template';
import { runInSandbox, type SandboxLimits } from '../../agents/sandbox';

export const PYTHON_TOOL: ToolSpec = {
  type: 'function',
  function: {
    name: 'python',
    description: 'Runs Python 3 code in a sandbox (no network, a few seconds) and returns what it printed.',
    parameters: { type: 'object', properties: { code: { type: 'string', description: 'the program' } }, required: ['code'] },
  },
};

export const TOOL_LIMITS: Partial<SandboxLimits> = {
  wallMs: 5000, cpuSeconds: 2, memoryMb: 128, processes: 8, outputBytes: 2000,
};

// args: the call's arguments, as the openai SDK gives them (a JSON string) or already parsed.
export async function runPythonTool(args: unknown): Promise<string> {
  let parsed = args;
  if (typeof args === 'string') {
    try { parsed = JSON.parse(args); } catch { parsed = undefined; }
  }
  const code = (parsed as { code?: unknown } | undefined)?.code;
  if (typeof code !== 'string') return 'python: the arguments must be {"code": "<program>"}';
  const r = await runInSandbox(code, { limits: TOOL_LIMITS });
  const parts = [r.stdout.trimEnd(), r.stderr && `stderr:\n${r.stderr.trimEnd()}`];
  if (r.limitsHit.length) parts.push(`[stopped at the ${r.limitsHit.join(', ')} limit]`);
  else if (r.exitCode !== 0) parts.push(`[exit ${r.exitCode ?? r.signal}]`);
  return parts.filter(Boolean).join('\n').trimEnd() || '[no output]';
}

// Asks the policy; each python call of its reply runs in the sandbox and its output is appended as the tool
// message, then the policy is asked again, until a reply without calls or maxTurns replies. messages grows
// with the conversation; answer is the last reply's text.
export async function chatWithPythonTool(client: OpenAI, model: string, messages: OpenAI.ChatCompletionMessageParam[],
  maxTurns: number): Promise<{ answer: string; toolCalls: number }> {
  let answer = '';
  let toolCalls = 0;
  for (let turn = 0; turn < maxTurns; turn++) {
    const reply = await client.chat.completions.create({ model, messages, tools: [PYTHON_TOOL] as OpenAI.ChatCompletionTool[] });
    const message = reply.choices[0].message;
    messages.push(message as OpenAI.ChatCompletionMessageParam);
    answer = message.content ?? '';
    if (!message.tool_calls?.length) break;
    for (const call of message.tool_calls) {
      toolCalls++;
      const content = call.type === 'function' && call.function.name === 'python'
        ? await runPythonTool(call.function.arguments) : 'unknown tool: only python is available';
      messages.push({ role: 'tool', tool_call_id: call.id, content });
    }
  }
  return { answer, toolCalls };
}
