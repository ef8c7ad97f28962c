// A hung engine (SIGSTOP) under the real router with two real engines (issue 15, item 6): the
// request pinned to it passes its deadline and fails over to the other engine with the same ids,
// new sessions avoid it while it hangs, and after SIGCONT it answers /health and is taken back.
// Before engine calls had a deadline, the pinned request waited for as long as the engine hung.
import { EngineRouter } from '../../agents/router';
import { startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

let engines: Service[] = [];
beforeAll(async () => {
  const model = tinyModel();
  engines = await Promise.all([startEngine(model), startEngine(model)]);
}, 300_000);
afterAll(async () => {
  for (const e of engines) e.proc.kill('SIGCONT');
  await Promise.all(engines.map((e) => e.stop()));
});

const body = (maxTokens: number, seed: number) => ({
  prompt_token_ids: [99, 111, 112, 121],
  sampling: { max_tokens: maxTokens, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [], seed },
});

test('a hung engine fails over like a dead one and is taken back once it answers again', async () => {
  const [a, b] = engines.map((e) => e.url);
  // A short deadline for the test: 3 s + 0.1 s per token (the default is 60 s + 0.25 s per token).
  const router = new EngineRouter([a, b], TOKEN, { baseMs: 3_000, perTokenMs: 100 });
  const first = await router.generate('s', body(4, 1));
  expect(router.engineFor('s')).toBe(a); // the least loaded, first in the list
  expect(first.token_ids).toHaveLength(4);

  engines[0].proc.kill('SIGSTOP');
  try {
    const moved = await router.generate('s', body(16, 2)); // pinned to the hung engine
    expect(router.engineFor('s')).toBe(b);
    expect(moved.token_ids).toHaveLength(16);
    for (let i = 0; i < 4; i++) { // new sessions go to the engine that answers
      await router.generate(`new-${i}`, body(4, 10 + i));
      expect(router.engineFor(`new-${i}`)).toBe(b);
    }
  } finally {
    engines[0].proc.kill('SIGCONT');
  }
  // Back in rotation once a probe finds it answering (at the others' version): a new session lands on it.
  let back = false;
  for (let i = 0; i < 120 && !back; i++) {
    await router.generate(`after-${i}`, body(2, 100 + i));
    back = router.engineFor(`after-${i}`) === a;
    if (!back) await new Promise((r) => setTimeout(r, 500));
  }
  expect(back).toBe(true);
}, 300_000);
