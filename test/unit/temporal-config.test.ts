// Where the client and the workers find Temporal (infra/temporal-config.ts, Temporal's environment
// configuration) and where the worker finds the services (a placement file, infra/worker.ts).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { temporalConfig } from '../../infra/temporal-config';
import { parsePools, readPlacement } from '../../infra/worker';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-tconf-'));
const toml = path.join(dir, 'temporal.toml');
fs.writeFileSync(toml, `
[profile.default]
address = "temporal.example:7233"
namespace = "research"

[profile.cloud]
address = "molt.a1b2c.tmprl.cloud:7233"
namespace = "molt.a1b2c"
api_key = "secret-key"
`);
afterAll(() => fs.rmSync(dir, { recursive: true, force: true }));

test('a TOML profile, chosen by TEMPORAL_PROFILE, gives address, namespace, API key (with TLS)', () => {
  expect(temporalConfig({ TEMPORAL_CONFIG_FILE: toml })).toMatchObject({
    connectionOptions: { address: 'temporal.example:7233' }, namespace: 'research',
  });
  const cloud = temporalConfig({ TEMPORAL_CONFIG_FILE: toml, TEMPORAL_PROFILE: 'cloud' });
  expect(cloud).toMatchObject({ connectionOptions: { address: 'molt.a1b2c.tmprl.cloud:7233', apiKey: 'secret-key', tls: true }, namespace: 'molt.a1b2c' });
});

test('TEMPORAL_* variables override the profile; MOLT_TEMPORAL_ADDRESS stands in for TEMPORAL_ADDRESS; defaults', () => {
  const env = { TEMPORAL_CONFIG_FILE: toml, TEMPORAL_ADDRESS: '10.0.0.2:7233', TEMPORAL_NAMESPACE: 'other', TEMPORAL_TLS: 'true' };
  expect(temporalConfig(env)).toMatchObject({ connectionOptions: { address: '10.0.0.2:7233', tls: {} }, namespace: 'other' });
  const none = path.join(dir, 'absent.toml');
  expect(temporalConfig({ TEMPORAL_CONFIG_FILE: none, MOLT_TEMPORAL_ADDRESS: '10.0.0.3:7233' }).connectionOptions.address).toBe('10.0.0.3:7233');
  expect(temporalConfig({ TEMPORAL_CONFIG_FILE: none })).toEqual({ connectionOptions: { address: 'localhost:7233' }, namespace: 'default' });
});

test('a placement file names the services; paths are relative to it; a bad field is named', () => {
  const file = path.join(dir, 'placement.json');
  fs.writeFileSync(file, JSON.stringify({ engines: ['http://10.0.0.5:8100'], actor: 'http://10.0.0.7:8200', store: 'runs', token_file: 'token' }));
  expect(readPlacement(file)).toEqual({
    engines: ['http://10.0.0.5:8100'], actor: 'http://10.0.0.7:8200', store: path.join(dir, 'runs'), token_file: path.join(dir, 'token'),
  });
  fs.writeFileSync(file, JSON.stringify({ engines: ['10.0.0.5:8100'] }));
  expect(() => readPlacement(file)).toThrow(`MOLT_PLACEMENT ${file}: engines.0:`);
  fs.writeFileSync(file, JSON.stringify({ engine: [] }));
  expect(() => readPlacement(file)).toThrow(/MOLT_PLACEMENT .*: .*engine/);
});

test("a recipe's other engine pools come from the placement file or MOLT_POOLS; a bad one is named", () => {
  const file = path.join(dir, 'placement-pools.json');
  fs.writeFileSync(file, JSON.stringify({ engines: ['http://10.0.0.5:8100'], pools: { judge: ['http://10.0.0.8:8100'] } }));
  expect(readPlacement(file).pools).toEqual({ judge: ['http://10.0.0.8:8100'] });
  fs.writeFileSync(file, JSON.stringify({ pools: { judge: ['10.0.0.8:8100'] } }));
  expect(() => readPlacement(file)).toThrow(`MOLT_PLACEMENT ${file}: pools.judge.0:`);
  expect(parsePools('{"teacher": ["http://10.0.0.9:8100"]}')).toEqual({ teacher: ['http://10.0.0.9:8100'] });
  expect(() => parsePools('{"teacher": "http://10.0.0.9:8100"}')).toThrow('MOLT_POOLS: expected JSON {"<pool>": ["http://...", ...]}');
  expect(() => parsePools('judge=http://10.0.0.9:8100')).toThrow('MOLT_POOLS: expected JSON');
});
