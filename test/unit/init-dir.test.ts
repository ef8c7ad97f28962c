// The recipe key `init` (also `--init <dir>` on start/dev): a directory that is missing, is no HF
// model directory, or does not fit the recipe's model is an error naming it before anything starts.
// The run-side failure of a directory that slips through: test/e2e/init-run.test.ts.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { runCli } from '../helpers/cli';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const TINY = resolveModelDir('tiny');
let root: string;
beforeAll(() => { root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-init-dir-')); });
afterAll(() => fs.rmSync(root, { recursive: true, force: true }));

// A copy of the tiny model with its config changed by `edit`.
function variant(name: string, edit: (config: Record<string, unknown>) => void): string {
  const dir = path.join(root, name);
  fs.cpSync(TINY, dir, { recursive: true });
  const config = JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'));
  edit(config);
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify(config));
  return dir;
}

test('a fitting HF directory is accepted, as an absolute path', () => {
  const relative = path.relative(process.cwd(), TINY);
  expect(loadRecipe(RECIPE_DIR, { init: relative }).init).toBe(TINY);
  expect(loadRecipe(RECIPE_DIR).init).toBeUndefined();
});

test('a missing directory, one without config.json or safetensors, and one of another shape are named', () => {
  const missing = path.join(root, 'nope');
  expect(() => loadRecipe(RECIPE_DIR, { init: missing })).toThrow(`init: ${missing} is not a directory`);
  const noConfig = path.join(root, 'no-config');
  fs.mkdirSync(noConfig);
  fs.writeFileSync(path.join(noConfig, 'model.safetensors'), '');
  expect(() => loadRecipe(RECIPE_DIR, { init: noConfig })).toThrow(`init: ${noConfig} has no config.json`);
  const noWeights = path.join(root, 'no-weights');
  fs.mkdirSync(noWeights);
  fs.copyFileSync(path.join(TINY, 'config.json'), path.join(noWeights, 'config.json'));
  expect(() => loadRecipe(RECIPE_DIR, { init: noWeights })).toThrow(`init: ${noWeights} has no *.safetensors weights`);
  const vocab = variant('vocab', (c) => { c.vocab_size = (c.vocab_size as number) + 1; });
  expect(() => loadRecipe(RECIPE_DIR, { init: vocab })).toThrow(new RegExp(`init: ${vocab} does not fit model .*vocab_size`));
  const layers = variant('layers', (c) => { c.num_hidden_layers = 5; c.model_type = 'llama'; });
  expect(() => loadRecipe(RECIPE_DIR, { init: layers })).toThrow(/model_type "llama" \(model: "qwen3"\), num_hidden_layers 5/);
});

test('start --init <bad dir> exits 2 naming it, before anything starts', async () => {
  const missing = path.join(root, 'cli-nope');
  const r = await runCli(['start', 'recipes/copy', '--init', missing, '--dry-run']);
  expect(r.code).toBe(2);
  expect(r.stderr).toContain(`init: ${missing} is not a directory`);
});
