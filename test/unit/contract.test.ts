// Loading agent modules: the copy recipe loads; a module without AgentRunner, or with a wrong
// shape, is an error naming the module and what is missing.
import * as path from 'node:path';
import { checkEnv, loadAgentRunner } from '../../agents/contract';
import { REPO_ROOT } from '../../agents/recipe';

const fixture = (name: string) => path.join(__dirname, 'fixtures', name);

test('the copy recipe module is an Env AgentRunner', async () => {
  const modulePath = path.join(REPO_ROOT, 'recipes', 'copy', 'agent.ts');
  const runner = await loadAgentRunner(modulePath);
  if (runner.kind !== 'env') throw new Error(`expected an env runner, got ${runner.kind}`);
  const env = checkEnv(runner.createEnv({}), modulePath);
  expect(typeof env.reset).toBe('function');
});

test('a module without AgentRunner is named, with what it does export', async () => {
  const p = fixture('no-runner-agent.ts');
  await expect(loadAgentRunner(p)).rejects.toThrow(`agent module ${p} does not export an AgentRunner object (exports: Runner)`);
});

test('a wrong kind is named', async () => {
  const p = fixture('wrong-kind-agent.ts');
  await expect(loadAgentRunner(p)).rejects.toThrow(`agent module ${p}: AgentRunner.kind must be 'env' or 'chat', got "gym"`);
});

test('a missing module is named', async () => {
  await expect(loadAgentRunner('/nonexistent/agent.ts')).rejects.toThrow(/agent module \/nonexistent\/agent.ts could not be loaded/);
});

test('an Env without step() is named', () => {
  expect(() => checkEnv({ reset() { return { observation: 'x' }; } }, 'm.ts')).toThrow('agent module m.ts: the Env from createEnv lacks step()');
});
