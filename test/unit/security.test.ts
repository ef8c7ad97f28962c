// Security of the agent boundary, with the real SDK clients and a real engine:
//   the loopback server is reachable over loopback only (binding: loopback-requests.test.ts; here:
//   a connection to the machine's other addresses is refused);
//   one chat session cannot read or write another's trajectory: each has its own unguessable id
//   (the URL) and api key, and the other's key gets 401 with nothing changed.
// Elsewhere: the engine and actor refuse a missing or wrong bearer token on every route
// (security-secrets.test.ts on the real stack; /health also in test/py/test_engine.py
// test_bad_requests_get_clear_errors_and_the_server_keeps_serving and test/py/test_actor.py), and the
// token never reaches workflow histories, logs or command lines (security-secrets.test.ts).
import * as net from 'node:net';
import * as os from 'node:os';
import Anthropic from '@anthropic-ai/sdk';
import OpenAI from 'openai';
import { ChatTemplate } from '../../agents/chat-template';
import type { GenerateFn } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';
import { EngineRouter } from '../../agents/router';
import { startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

let engine: Service;
let server: LoopbackServer;
let template: ChatTemplate;
beforeAll(async () => {
  engine = await startEngine(tinyModel());
  server = await LoopbackServer.start();
  template = ChatTemplate.load(tinyModel());
});
afterAll(async () => {
  await server?.close();
  await engine?.stop();
});

function open() {
  const router = new EngineRouter([engine.url], TOKEN);
  const calls: number[][] = [];
  const generate: GenerateFn = async (sessionId, ids, sampling) => {
    calls.push(ids);
    return router.generate(sessionId, { prompt_token_ids: ids, sampling });
  };
  const session = server.openSession({
    template, generate, maxContext: 256,
    defaults: { max_tokens: 4, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: template.endOfTurnIds() },
  });
  return { session, calls, ...server.urls(session) };
}

test('a session cannot be read or written with another session\'s api key', async () => {
  const a = open();
  const b = open();
  expect(a.session.id).toMatch(/^[0-9a-f]{32}$/);
  expect(new Set([a.session.id, b.session.id, a.session.apiKey, b.session.apiKey]).size).toBe(4);
  const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'hi>' }];
  await new OpenAI({ baseURL: b.openaiBaseURL, apiKey: b.session.apiKey, maxRetries: 0 }).chat.completions.create({ model: 'policy', messages });
  const bBefore = b.session.segments();
  expect(bBefore).toHaveLength(1);

  // Session a's agent, pointed at b's URLs with its own key: refused, nothing generated, b unchanged.
  const write = await new OpenAI({ baseURL: b.openaiBaseURL, apiKey: a.session.apiKey, maxRetries: 0 })
    .chat.completions.create({ model: 'policy', messages: [...messages, { role: 'assistant', content: 'x' }, { role: 'user', content: 'more>' }] }).catch((e) => e);
  expect(write).toBeInstanceOf(OpenAI.AuthenticationError);
  expect(write.message).toMatch(/wrong or missing api key for this session/);
  const viaAnthropic = await new Anthropic({ baseURL: b.anthropicBaseURL, apiKey: a.session.apiKey, maxRetries: 0 })
    .messages.create({ model: 'policy', max_tokens: 4, messages: [{ role: 'user', content: 'hi>' }] }).catch((e) => e);
  expect(viaAnthropic).toBeInstanceOf(Anthropic.AuthenticationError);
  const read = await fetch(`${b.openaiBaseURL}/models`, { headers: { authorization: `Bearer ${a.session.apiKey}` } });
  expect(read.status).toBe(401);
  const noKey = await fetch(`${b.openaiBaseURL}/chat/completions`, { method: 'POST', body: JSON.stringify({ model: 'policy', messages }) });
  expect(noKey.status).toBe(401);
  expect(b.calls).toHaveLength(1);
  expect(a.calls).toHaveLength(0);
  expect(b.session.segments()).toEqual(bBefore);
  // The session id is the capability in the URL: another one (a closed session's, a guess) is 404.
  server.closeSession(a.session);
  const closed = await fetch(`${a.openaiBaseURL}/models`, { headers: { authorization: `Bearer ${a.session.apiKey}` } });
  expect(closed.status).toBe(404);
});

test('the loopback server cannot be reached through the machine\'s other addresses', async () => {
  const others = Object.values(os.networkInterfaces()).flat().filter((i) => i && !i.internal && i.family === 'IPv4').map((i) => i!.address);
  if (!others.length) console.warn('no non-loopback IPv4 address on this machine: only the loopback half is checked');
  for (const address of others) {
    const outcome = await new Promise<string>((resolve) => {
      const socket = net.connect(server.port, address, () => { socket.destroy(); resolve('connected'); });
      socket.once('error', (e: NodeJS.ErrnoException) => resolve(e.code ?? 'error'));
    });
    expect([address, outcome]).toEqual([address, 'ECONNREFUSED']);
  }
  // ... while loopback is served.
  const res = await fetch(`http://127.0.0.1:${server.port}/s/none/v1/models`);
  expect(res.status).toBe(404);
});
