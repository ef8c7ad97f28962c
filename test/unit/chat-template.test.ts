// The TS chat template (@huggingface/jinja) and tokenizer render and tokenize exactly as Python
// transformers does, on the fixture written by test/fixtures/make_chat_fixture.py.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { ChatTemplate, type ChatMessage, type ToolSpec } from '../../agents/chat-template';
import { parseToolCalls } from '../../agents/tool-calls';

const MODEL = resolveModelDir('tiny');
const fixture = JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'test', 'fixtures', 'chat_fixture.json'), 'utf8'));

beforeAll(() => {
  if (!fs.existsSync(path.join(MODEL, 'tokenizer.json'))) {
    execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['gpu-services/make_tiny_model.py', '--out', MODEL], { cwd: REPO_ROOT });
  }
});

test('the tiny model carries the template the fixture was made with', () => {
  expect(ChatTemplate.load(MODEL).tokenizer.config.chat_template).toBe(fixture.chat_template);
});

test.each(fixture.cases.map((c: any) => [`${c.name} (generation prompt ${c.add_generation_prompt})`, c]) as [string, any][])(
  'render and tokenize equal transformers: %s', (_name, c) => {
    const template = ChatTemplate.load(MODEL);
    const text = template.render(c.messages as ChatMessage[], c.tools as ToolSpec[] | undefined, c.add_generation_prompt);
    expect(text).toBe(c.text);
    expect(template.tokenizer.encode(text)).toEqual(c.ids);
  });

test('end-of-turn ids are <|im_end|> and <|endoftext|>', () => {
  expect(ChatTemplate.load(MODEL).endOfTurnIds().sort()).toEqual([256, 258]);
});

describe('Hermes tool calls', () => {
  let n = 0;
  const id = () => `c${n++}`;
  test('well-formed calls become structured calls; the text around them is the content', () => {
    const r = parseToolCalls('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>', id);
    expect(r.content).toBe('Let me look.');
    expect(r.toolCalls.map((c) => [c.function.name, c.function.arguments])).toEqual([['get_weather', { city: 'Paris' }], ['add', { a: 2, b: 3 }]]);
  });
  test.each([
    ['bad JSON', '<tool_call>{"name": "f", "arguments": {</tool_call>'],
    ['no name', '<tool_call>{"arguments": {}}</tool_call>'],
    ['arguments not an object', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'],
    ['one good, one unclosed', '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"'],
  ])('malformed (%s) stays text', (_why, text) => {
    expect(parseToolCalls(text, id)).toEqual({ content: text, toolCalls: [] });
  });
  test('plain text has no calls', () => {
    expect(parseToolCalls('just text', id)).toEqual({ content: 'just text', toolCalls: [] });
  });
});
