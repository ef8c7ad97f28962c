// The Temporal UI as a user sees it, in headless Chromium (Debian `chromium`; another binary via
// MOLT_CHROMIUM): after two steps the workflow list filtered by Molt's search attributes shows the
// run, and its Search Attributes tab shows them. Screenshots go to $MOLT_UI_SCREENSHOTS if set.
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import { chromium, type Browser, type Page } from 'playwright-core';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { RecipeConfig } from '../../agents/recipe';
import { runStartOptions } from '../../client/start-options';
import { runWorkflowId, trainRun } from '../../workflows/train-run';
import { startTemporal, withWorkers } from '../helpers/temporal';

const CHROMIUM = process.env.MOLT_CHROMIUM ?? '/usr/bin/chromium';
const maybe = fs.existsSync(CHROMIUM) ? test : test.skip; // CI installs it: apt-get install -y chromium

const freePort = () => new Promise<number>((resolve) => {
  const server = net.createServer().listen(0, () => { const { port } = server.address() as net.AddressInfo; server.close(() => resolve(port)); });
});

let env: TestWorkflowEnvironment;
let uiPort: number;
let browser: Browser | undefined;
beforeAll(async () => {
  uiPort = await freePort();
  env = await startTemporal({ uiPort });
});
afterAll(async () => {
  await browser?.close();
  await env?.teardown();
});

const activities = {
  async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
    await Context.current().sleep(10);
    return { groupIndex: input.groupIndex, episodes: [0], segments: [1], rewards: [0.75], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0 };
  },
  async trainStep(input: TrainStepInput) { return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.25 } }; },
  async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
  async claimActor() { return { heldBy: null }; },
  async checkpoint(input: { step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
  async recordMetrics() { return { written: true }; },
  async writeRunConfig() {},
};

maybe('the UI lists the run by its search attributes and shows them', async () => {
  const config = RecipeConfig.parse({
    name: 'uirecipe', agent: 'agent.ts', model: 'tiny', group_size: 1, pool: { inflight: 2 }, batch: { groups: 1 },
    train: { steps: 2 }, checkpoint: { every: 10 }, sampling: { max_tokens: 4 }, algo: {},
  });
  await withWorkers(env, activities, async () => {
    const handle = await env.client.workflow.start(trainRun, { ...runStartOptions('/tmp/recipe', config, 'ui', true), workflowId: runWorkflowId('ui') });
    await handle.result();
  });
  browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  const ui = `http://localhost:${uiPort}/namespaces/default/workflows`;
  const query = `MoltRecipe = "uirecipe" AND MoltStep = 2 AND MoltReward > 0.7`;
  await page.goto(`${ui}?query=${encodeURIComponent(query)}`);
  await page.getByText('molt-ui', { exact: true }).first().waitFor({ timeout: 60_000 }); // visibility is eventually consistent
  expect(await page.innerText('body')).toContain('trainRun');
  await screenshot(page, 'workflow-list.png');

  const { runId } = await env.client.workflow.getHandle('molt-ui').describe();
  await page.goto(`${ui}/molt-ui/${runId}/search-attributes`);
  await page.getByText('MoltReward').first().waitFor({ timeout: 60_000 });
  const text = await page.innerText('body');
  for (const expected of ['MoltRecipe', 'uirecipe', 'MoltStep', 'MoltVersion', '0.75']) expect(text).toContain(expected);
  await screenshot(page, 'search-attributes.png');
});

async function screenshot(page: Page, name: string): Promise<void> {
  const dir = process.env.MOLT_UI_SCREENSHOTS;
  if (dir) { fs.mkdirSync(dir, { recursive: true }); await page.screenshot({ path: path.join(dir, name), fullPage: true }); }
}
