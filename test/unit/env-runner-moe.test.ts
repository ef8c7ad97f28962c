// MoE routing replay on the rollout side: with routedExperts the Env loop asks a real engine (tiny
// Qwen3-MoE) for each sampled token's experts and keeps them aligned with the tokens, -1 rows for
// observation tokens and for sampled tokens the engine returned no routing for; the store keeps them.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { loadAgentRunner } from '../../agents/contract';
import { deriveSeed, runEnvEpisode } from '../../agents/env-runner';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { tokenizerFor } from '../../agents/tokenizer';
import type { GenerateRequest, GenerateResponse } from '../../activities/gpu-client';
import { writeTrajectory } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import { PYTHON, startEngine, TOKEN, type Service } from './gpu-services';

let engine: Service;
let dir: string;
let model: string;
beforeAll(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-moe-'));
  model = path.join(dir, 'tiny-moe');
  execFileSync(PYTHON, ['gpu-services/make_tiny_model.py', '--out', model, '--moe'], { cwd: REPO_ROOT, stdio: 'pipe' });
  engine = await startEngine(model);
});
afterAll(async () => {
  await engine?.stop();
  fs.rmSync(dir, { recursive: true, force: true });
});

async function episode(routedExperts: boolean, dropRoutingOfCall?: number) {
  const runner = await loadAgentRunner(path.join(__dirname, 'fixtures', 'echo-agent.ts'));
  if (runner.kind !== 'env') throw new Error('echo-agent.ts is an Env agent');
  const router = new EngineRouter([engine.url], TOKEN);
  const calls: { req: GenerateRequest; res: GenerateResponse }[] = [];
  const config = RecipeConfig.parse(JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'recipes', 'copy', 'recipe.json'), 'utf8')));
  const result = await runEnvEpisode({
    env: runner.createEnv({}), tokenizer: tokenizerFor(model), maxContext: 256, runSeed: 5,
    task: { groupIndex: 0, episode: 1, seed: deriveSeed(5, 0) }, sampling: config.sampling, routedExperts,
    generate: async (req) => {
      const res = await router.generate('s', req);
      calls.push({ req, res });
      // as an engine that lost the routing of a preempted request (vLLM) answers
      return calls.length - 1 === dropRoutingOfCall ? { ...res, routed_experts: null } : res;
    },
  });
  return { t: result.trajectory, calls };
}

test('each sampled token keeps the experts the engine routed it through; other tokens get -1 rows', async () => {
  const { t, calls } = await episode(true);
  expect(calls.length).toBe(3);
  expect(calls.every((c) => c.req.return_routed_experts === true)).toBe(true);
  const rows = t.routedExperts!;
  expect(rows.length).toBe(t.tokens.length);
  expect(rows.filter((_, i) => t.lossMask[i])).toEqual(calls.flatMap((c) => c.res.routed_experts));
  expect(rows.filter((_, i) => !t.lossMask[i]).flat(2).every((e) => e === -1)).toBe(true);
  expect(rows.filter((_, i) => t.lossMask[i]).flat(2).every((e) => e >= 0 && e < 4)).toBe(true);
  expect(rows[0]).toEqual([[-1, -1], [-1, -1]]); // [layers][top_k] of the tiny MoE

  await writeTrajectory(dir, 'moe.safetensors', t, { run: 'r', group: 0, episode: 1, segment: 0, reward: 1, finish: 'terminated' });
  expect(readTrajectory(dir, 'moe.safetensors').trajectory.routedExperts).toEqual(rows);
});

test('tokens the engine returned no routing for are stored as -1 rows, not guessed', async () => {
  const { t, calls } = await episode(true, 1);
  const sampledRows = t.routedExperts!.filter((_, i) => t.lossMask[i]);
  const [n0, n1] = [calls[0].res.token_ids.length, calls[1].res.token_ids.length];
  expect(sampledRows.slice(0, n0)).toEqual(calls[0].res.routed_experts);
  expect(sampledRows.slice(n0, n0 + n1).flat(2).every((e) => e === -1)).toBe(true);
  expect(sampledRows.slice(n0 + n1)).toEqual(calls[2].res.routed_experts);
});

test('without routing replay nothing is asked or stored', async () => {
  const { t, calls } = await episode(false);
  expect(calls.every((c) => c.req.return_routed_experts === undefined && c.res.routed_experts == null)).toBe(true);
  expect(t.routedExperts).toBeUndefined();
});
