// Killing the engine a chat session is pinned to, mid-episode: the router sends the next turn with
// the accumulated ids to the other engine and the episode completes, token-exact before the kill.
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as path from 'node:path';
import OpenAI from 'openai';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { ChatTemplate } from '../../agents/chat-template';
import type { Generation, GenerateFn, Sampling } from '../../agents/chat-session';
import { LoopbackServer } from '../../agents/loopback';
import { runChatEpisode, type ChatAgent } from '../../agents/chat-runner';
import { EngineRouter } from '../../agents/router';

const PYTHON = path.join(REPO_ROOT, '.venv', 'bin', 'python');
const MODEL = resolveModelDir('tiny');
const engines: ChildProcess[] = [];

function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, '127.0.0.1', () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

async function startEngine(): Promise<string> {
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const proc = spawn(PYTHON, ['gpu-services/engine.py', '--model', MODEL, '--port', String(port), '--token', 't'], {
    cwd: REPO_ROOT, stdio: 'ignore', env: { ...process.env, OMP_NUM_THREADS: '1' },
  });
  engines.push(proc);
  for (let i = 0; ; i++) {
    if (await fetch(`${url}/health`, { headers: { authorization: 'Bearer t' } }).then((r) => r.ok, () => false)) return url;
    if (i > 600 || proc.exitCode !== null) throw new Error('engine did not come up');
    await new Promise((r) => setTimeout(r, 100));
  }
}

afterAll(() => engines.forEach((e) => e.kill()));

test('the session moves to the surviving engine with its accumulated ids', async () => {
  if (!fs.existsSync(path.join(MODEL, 'model.safetensors'))) {
    execFileSync(PYTHON, ['gpu-services/make_tiny_model.py', '--out', MODEL], { cwd: REPO_ROOT });
  }
  const urls = await Promise.all([startEngine(), startEngine()]);
  const router = new EngineRouter(urls, 't');
  const server = await LoopbackServer.start();
  const template = ChatTemplate.load(MODEL);
  const calls: { engine?: string; prompt: number[]; gen: Generation }[] = [];
  const generate: GenerateFn = async (sessionId, prompt, sampling) => {
    const gen = await router.generate(sessionId, { prompt_token_ids: prompt, sampling });
    calls.push({ engine: router.engineFor(sessionId), prompt, gen });
    return gen;
  };
  const agent: ChatAgent = {
    kind: 'chat',
    async run(ctx) {
      const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
      const messages = [...ctx.messages] as OpenAI.ChatCompletionMessageParam[];
      const r1 = await client.chat.completions.create({ model: ctx.model, messages });
      engines[urls.indexOf(calls[0].engine!)].kill('SIGKILL'); // the engine this session is pinned to dies
      messages.push(r1.choices[0].message as OpenAI.ChatCompletionMessageParam, { role: 'user', content: 'go on' });
      await client.chat.completions.create({ model: ctx.model, messages });
      return { reward: 1 };
    },
  };
  const sampling: Sampling = { max_tokens: 5, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] };
  const episode = await runChatEpisode({ server, agent, template, generate, prompt: { messages: [{ role: 'user', content: 'hi' }] }, sampling, maxContext: 1024 });
  await server.close();

  expect(calls).toHaveLength(2);
  expect(calls[1].engine).not.toBe(calls[0].engine);
  const [first, second] = calls;
  const glue = first.gen.token_ids[first.gen.token_ids.length - 1] === 258 ? '\n' : '<|im_end|>\n';
  const obs = template.tokenizer.encode(glue + '<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n');
  expect(second.prompt).toEqual([...first.prompt, ...first.gen.token_ids, ...obs]);
  expect(episode.segments).toHaveLength(1);
  expect(episode.segments[0].tokens).toEqual([...second.prompt, ...second.gen.token_ids]);
  expect(episode.segments[0].logprobs.slice(first.prompt.length, first.prompt.length + first.gen.token_ids.length)).toEqual(first.gen.logprobs);
});
