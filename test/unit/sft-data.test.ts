// SFT demonstrations -> ids and loss mask (agents/sft-data.ts), with the tiny model's real chat template and
// tokenizer: the mask covers exactly the assistant turns (their end-of-turn token included, the template's
// generation prompt header excluded), the ids are those of the full render, and bad data names itself.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { ChatTemplate, type ChatMessage, type ToolSpec } from '../../agents/chat-template';
import { loadRecipe, RecipeError, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { chatExample, envExample, sftExamples } from '../../agents/sft-data';

const template = ChatTemplate.load(resolveModelDir('tiny'));
const tools: ToolSpec[] = [{ type: 'function', function: { name: 'calc', parameters: { type: 'object' } } }];
const messages: ChatMessage[] = [
  { role: 'system', content: 'Use the calculator.' },
  { role: 'user', content: 'What is 12*7?' },
  { role: 'assistant', content: '', tool_calls: [{ id: 'c1', type: 'function', function: { name: 'calc', arguments: { expr: '12*7' } } }] },
  { role: 'tool', content: '84', tool_call_id: 'c1' },
  { role: 'assistant', content: 'The answer is 84.' },
];

// The masked ids as contiguous runs, decoded.
function maskedRuns(tokens: number[], mask: number[]): string[] {
  const runs: number[][] = [];
  mask.forEach((m, i) => {
    if (m === 1 && (i === 0 || mask[i - 1] === 0)) runs.push([]);
    if (m === 1) runs[runs.length - 1].push(tokens[i]);
  });
  return runs.map((r) => template.tokenizer.decode(r));
}

test('the mask covers exactly the assistant turns, end-of-turn token included, generation header excluded', () => {
  const { tokens, mask } = chatExample(template, { messages, tools });
  expect(mask).toHaveLength(tokens.length);
  expect(maskedRuns(tokens, mask)).toEqual([
    '<tool_call>{"name": "calc", "arguments": {"expr": "12*7"}}</tool_call><|im_end|>',
    'The answer is 84.<|im_end|>',
  ]);
  // The ids are the full conversation as the template renders it, up to the last end-of-turn token.
  const full = template.render(messages, tools, false);
  expect(template.tokenizer.decode(tokens)).toBe(full.slice(0, full.lastIndexOf('<|im_end|>') + '<|im_end|>'.length));
  // Each assistant turn starts right after the generation prompt header, which is context.
  const starts = mask.flatMap((m, i) => (m === 1 && mask[i - 1] === 0 ? [i] : []));
  for (const at of starts) expect(template.tokenizer.decode(tokens.slice(0, at)).endsWith('<|im_start|>assistant\n')).toBe(true);
});

test('env form: the observation is context, the action is trained, as the env loop tokenizes them', () => {
  const { tokens, mask } = envExample(template.tokenizer, { messages: [{ role: 'user', content: 'copy abd>' }, { role: 'assistant', content: 'abd' }] });
  expect(tokens).toEqual(template.tokenizer.encode('copy abd>abd'));
  expect(mask).toEqual([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]);
});

test('a template that rewrites earlier turns is refused, naming the message', () => {
  const dropsReasoning = new ChatTemplate(
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|im_start|>assistant\n[earlier]<|im_end|>\n"
    + "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    + '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}', template.tokenizer);
  const twoTurns: ChatMessage[] = [{ role: 'user', content: 'a' }, { role: 'assistant', content: 'b' },
    { role: 'user', content: 'c' }, { role: 'assistant', content: 'd' }];
  expect(() => chatExample(dropsReasoning, { messages: twoTurns })).toThrow(/messages\[3\].*extension/);
});

test('copy recipes: demonstrations from the agent module; a JSONL file with a bad line names file and line', async () => {
  const copy = path.join(REPO_ROOT, 'recipes', 'copy');
  const [ex] = await sftExamples(copy, loadRecipe(copy), 5, 1);
  const text = template.tokenizer.decode(ex.tokens);
  expect(text).toMatch(/^copy ([a-d]{3})>\1$/);
  const chat = path.join(REPO_ROOT, 'recipes', 'copy-chat');
  const [c] = await sftExamples(chat, loadRecipe(chat), 5, 1);
  expect(maskedRuns(c.tokens, c.mask)).toEqual([`${text.slice(-3)}<|im_end|>`]); // the same demonstration 5

  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-sft-'));
  fs.writeFileSync(path.join(dir, 'recipe.json'), JSON.stringify({
    ...JSON.parse(fs.readFileSync(path.join(chat, 'recipe.json'), 'utf8')), agent: path.join(chat, 'agent.ts'),
    sft: { data: 'demos.jsonl', steps: 1 }, max_context: 1024,
  }));
  expect(() => loadRecipe(dir)).toThrow(new RecipeError(`recipe config: sft.data: ${path.join(dir, 'demos.jsonl')} does not exist`));
  fs.writeFileSync(path.join(dir, 'demos.jsonl'), `${JSON.stringify({ messages: messages.slice(1), tools })}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n`);
  const config = loadRecipe(dir);
  const [first] = await sftExamples(dir, config, 0, 1);
  expect(maskedRuns(first.tokens, first.mask)).toHaveLength(2);
  await expect(sftExamples(dir, config, 1, 1)).rejects.toThrow(`demos.jsonl:3: no assistant message to train on`);
  expect(() => loadRecipe(dir, { 'sft.steps': '0' })).toThrow(/sft\.steps: Too small/);
});
