// The TS tokenizer gives the same ids as Python `tokenizers` on the tiny model's tokenizer.json.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { TextTokenizer } from '../../agents/tokenizer';

const PYTHON = path.join(REPO_ROOT, '.venv', 'bin', 'python');
const MODEL = resolveModelDir('tiny');

beforeAll(() => {
  if (!fs.existsSync(path.join(MODEL, 'tokenizer.json'))) {
    execFileSync(PYTHON, ['gpu-services/make_tiny_model.py', '--out', MODEL], { cwd: REPO_ROOT });
  }
});

const texts = [
  'copy abc>',
  'Hello, world!  two spaces\nand a newline\ttab',
  'naïve café — 日本語 🙂',
  '<|im_start|>user\nhi<|im_end|>\n<|endoftext|>',
  'almost <|im_end| special',
];

test('encode matches Python tokenizers (no special tokens added), decode inverts it', () => {
  const script = `
import json, sys
from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[1])
print(json.dumps([t.encode(s, add_special_tokens=False).ids for s in json.loads(sys.argv[2])]))`;
  const expected = JSON.parse(execFileSync(PYTHON, ['-c', script, path.join(MODEL, 'tokenizer.json'), JSON.stringify(texts)], { encoding: 'utf8' }));
  const tok = TextTokenizer.load(MODEL);
  const ids = texts.map((s) => tok.encode(s));
  expect(ids).toEqual(expected);
  expect(ids[3]).toContain(257); // <|im_start|> is one special token
  for (let i = 0; i < texts.length; i++) expect(tok.decode(ids[i])).toBe(texts[i]);
  expect(tok.decode(ids[3], true)).toBe('user\nhi\n');
});

test('a missing model directory is a clear error', () => {
  expect(() => TextTokenizer.load('/nonexistent/model')).toThrow(/\/nonexistent\/model\/tokenizer.json does not exist/);
});
