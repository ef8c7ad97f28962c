// Demonstrations -> token ids and a loss mask for the SFT warm start, by the rollouts' own tokenization
// path, so that SFT trains the very ids RL later samples and scores (invariant 1):
//   chat form: the loopback's (agents/chat-session.ts). The prompt before assistant turn i is the render
//     of messages[:i] with the generation prompt; the turn is what the full render of messages[:i+1] adds
//     to it, up to and including its end-of-turn token (what the engine samples, loss mask 1); what the
//     template writes after that token (e.g. "\n") is glue, tokenized with the messages that follow.
//     Each render must be a string-prefix of the next (the loopback's extension test), else it is an error.
//   env form: the env loop's (agents/env-runner.ts): BOS if the tokenizer adds one, then each message's
//     content tokenized alone; assistant contents are the actions (mask 1), the rest observations.
import { readFileSync } from 'node:fs';
import * as path from 'node:path';
import type { SftExample } from '../activities/gpu-client';
import { ChatTemplate, contentText, type ChatMessage } from './chat-template';
import { loadAgentRunner, type AgentRunner, type Demonstration } from './contract';
import { resolveModelDir, type RecipeConfig } from './recipe';
import { tokenizerFor, type TextTokenizer } from './tokenizer';

export function chatExample(template: ChatTemplate, demo: Demonstration): SftExample {
  const out: SftExample = { tokens: [], mask: [] };
  const add = (text: string, m: number) => {
    for (const id of template.tokenizer.encode(text)) { out.tokens.push(id); out.mask.push(m); }
  };
  const endOfTurn = template.endOfTurnIds().map((id) => template.tokenizer.decode([id]));
  let done = ''; // the text tokenized so far
  demo.messages.forEach((message, i) => {
    if (message.role !== 'assistant') return;
    const prompt = template.render(demo.messages.slice(0, i), demo.tools, true);
    const full = template.render(demo.messages.slice(0, i + 1), demo.tools, false);
    if (!prompt.startsWith(done) || !full.startsWith(prompt)) {
      throw new Error(`messages[${i}]: the chat template does not render the conversation up to this turn as an `
        + 'extension of the one before it, so no rollout could hold these ids in one sequence');
    }
    const turn = full.slice(prompt.length);
    const end = Math.max(...endOfTurn.map((t) => (turn.includes(t) ? turn.lastIndexOf(t) + t.length : -1)));
    if (end < 0) throw new Error(`messages[${i}]: the assistant turn renders without an end-of-turn token`);
    add(prompt.slice(done.length), 0);
    add(turn.slice(0, end), 1);
    done = prompt + turn.slice(0, end);
  });
  return out;
}

export function envExample(tokenizer: TextTokenizer, demo: Demonstration): SftExample {
  const bos = tokenizer.config.add_bos_token ? tokenizer.tokenId(String(tokenizer.config.bos_token)) : undefined;
  const out: SftExample = { tokens: bos === undefined ? [] : [bos], mask: bos === undefined ? [] : [0] };
  for (const m of demo.messages) {
    for (const id of tokenizer.encode(contentText(m.content))) {
      out.tokens.push(id); out.mask.push(m.role === 'assistant' ? 1 : 0);
    }
  }
  return out;
}

// A demonstration as it came from a file or an agent module: checked so that a bad one names itself.
function checkDemonstration(demo: unknown, where: string): Demonstration {
  const d = demo as Demonstration;
  if (typeof d !== 'object' || d === null || !Array.isArray(d.messages)) {
    throw new Error(`${where}: expected {messages: [...], tools?: [...]}`);
  }
  d.messages.forEach((m, i) => {
    if (!['system', 'user', 'assistant', 'tool'].includes(m?.role) || typeof m.content !== 'string') {
      throw new Error(`${where}: messages[${i}] needs role system|user|assistant|tool and a string content`);
    }
  });
  if (!d.messages.some((m) => m.role === 'assistant')) throw new Error(`${where}: no assistant message to train on`);
  if (d.tools !== undefined && !Array.isArray(d.tools)) throw new Error(`${where}: tools must be an array`);
  return d;
}

// Demonstrations [from, from + count) of a recipe, tokenized. The file's lines (or the agent's stream) are
// used in order and cycled, so a step's examples depend only on its number.
export async function sftExamples(recipeDir: string, config: RecipeConfig, from: number, count: number,
): Promise<SftExample[]> {
  const sft = config.sft;
  if (!sft) throw new Error(`recipe ${config.name} has no sft section`);
  const agentPath = path.resolve(recipeDir, config.agent);
  const runner: AgentRunner = await loadAgentRunner(agentPath);
  let demo: (index: number) => Promise<Demonstration>;
  if (sft.data !== undefined) {
    const file = sft.data;
    const lines = readFileSync(file, 'utf8').split('\n').map((l, i) => ({ l, i })).filter(({ l }) => l.trim() !== '');
    if (!lines.length) throw new Error(`sft.data: ${file} has no demonstrations`);
    demo = async (index) => {
      const { l, i } = lines[index % lines.length];
      let parsed: unknown;
      try {
        parsed = JSON.parse(l);
      } catch (e) {
        throw new Error(`sft.data: ${file}:${i + 1}: ${(e as Error).message}`);
      }
      return checkDemonstration(parsed, `sft.data: ${file}:${i + 1}`);
    };
  } else {
    const fn = runner.demonstration;
    if (typeof fn !== 'function') {
      throw new Error(`recipe ${config.name}: no sft.data file, and agent module ${agentPath} `
        + 'has no demonstration(index, settings)');
    }
    demo = async (index) => checkDemonstration(await fn(index, config.env), `${agentPath}: demonstration(${index})`);
  }
  const modelDir = resolveModelDir(config.model);
  const template = runner.kind === 'chat' ? ChatTemplate.load(modelDir) : null;
  const examples: SftExample[] = [];
  for (let k = from; k < from + count; k++) {
    const d = await demo(k);
    let ex: SftExample;
    try {
      ex = template ? chatExample(template, d) : envExample(tokenizerFor(modelDir), d);
    } catch (e) {
      throw new Error(`demonstration ${k}: ${(e as Error).message}`);
    }
    if (ex.tokens.length > config.max_context) {
      throw new Error(`demonstration ${k} is ${ex.tokens.length} tokens, over max_context ${config.max_context}`);
    }
    examples.push(ex);
  }
  return examples;
}
