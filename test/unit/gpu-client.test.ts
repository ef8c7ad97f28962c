// The GPU-service client checks bodies against gpu-services/contract.schema.json before sending,
// and names the URL and the problem when a service cannot be reached.
import { callService } from '../../activities/gpu-client';
import { freePort } from './gpu-services';

let dead: string;
beforeAll(async () => { dead = `http://127.0.0.1:${await freePort()}`; });

const sampling = { max_tokens: 3, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };

test('a misspelled sampling field is refused before anything is sent', async () => {
  // The URL is dead: had the body passed validation, the error would be a connection failure.
  await expect(callService(dead, '/generate', 't', {
    body: { prompt_token_ids: [1], sampling: { ...sampling, temprature: 0.5 } }, request: 'GenerateRequest',
  })).rejects.toThrow(`request to ${dead}/generate: does not match GenerateRequest: /sampling must NOT have additional properties`);
});

test('nested models are checked through the schema\'s $defs', async () => {
  await expect(callService(dead, '/train_step', 't', {
    body: { run_id: 'r', step: 1, store_root: '/s', trajectories: ['a'], algo: { betas: [0.9] } }, request: 'TrainStepRequest',
  })).rejects.toThrow(/does not match TrainStepRequest: \/algo\/betas must NOT have fewer than 2 items/);
  await expect(callService(dead, '/train_step', 't', {
    body: { run_id: 'r', step: 0, store_root: '/s', trajectories: [] }, request: 'TrainStepRequest',
  })).rejects.toThrow(/\/step must be >= 1; \/trajectories must NOT have fewer than 1 items/);
});

test('a valid body to an unreachable service names the URL', async () => {
  await expect(callService(dead, '/generate', 't', { body: { prompt_token_ids: [1], sampling }, request: 'GenerateRequest' }))
    .rejects.toMatchObject({ name: 'ServiceError', status: undefined, message: expect.stringContaining(`POST ${dead}/generate failed`) });
});

test('an unknown contract model is a clear error', async () => {
  await expect(callService(dead, '/x', 't', { body: {}, request: 'NoSuchModel' })).rejects.toThrow(/contract.schema.json has no model NoSuchModel/);
});
