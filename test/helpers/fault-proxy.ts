// A pass-through HTTP proxy in front of a real service, for fault injection:
//   - it counts the tokens its /generate answers carry (plain JSON or streamed ndjson chunks);
//   - `once(route, hook)` runs `hook` before the next request to `route` is forwarded; the hook may do
//     something at that moment (kill a process) and answers 'reset' to reset the request's connection
//     before it reaches the service (the client sees ECONNRESET, as seen after an engine was SIGSTOPped
//     and continued) or 'forward' to pass it on.
// If the service is gone, the client's connection is dropped, as it would be by the service itself.
import * as http from 'node:http';
import { freePort } from '../../infra/stack';

export type Hook = () => Promise<'reset' | 'forward'>;
export interface FaultProxy {
  url: string; tokens: number; fired: number; once: (route: string, hook: Hook) => void; close: () => void;
}

export async function faultProxy(target: string): Promise<FaultProxy> {
  const upstream = new URL(target);
  const port = await freePort();
  const hooks = new Map<string, Hook>();
  const forward = (req: http.IncomingMessage, res: http.ServerResponse) => {
    const target = { host: upstream.hostname, port: upstream.port, path: req.url, method: req.method, headers: req.headers };
    const up = http.request(target, (answer) => {
      res.writeHead(answer.statusCode ?? 502, answer.headers);
      let body = '';
      answer.on('data', (chunk) => { if (req.url === '/generate') body += chunk; });
      answer.on('end', () => {
        for (const line of body.split('\n')) {
          try { proxy.tokens += (JSON.parse(line).token_ids ?? []).length; } catch { /* not a complete JSON line */ }
        }
      });
      answer.on('close', () => { if (!answer.complete) res.destroy(); }); // the service died mid-answer
      answer.pipe(res);
    });
    up.on('error', () => res.destroy());
    req.on('error', () => up.destroy());
    req.pipe(up);
  };
  const server = http.createServer((req, res) => {
    const hook = req.url ? hooks.get(req.url) : undefined;
    if (!hook) return forward(req, res);
    hooks.delete(req.url!);
    req.pause(); // hold the body until the hook has decided
    void hook().then((action) => {
      proxy.fired++;
      if (action === 'reset') req.socket.resetAndDestroy();
      else forward(req, res);
    });
  });
  const proxy: FaultProxy = {
    url: `http://127.0.0.1:${port}`, tokens: 0, fired: 0,
    once: (route, hook) => hooks.set(route, hook),
    close: () => { server.closeAllConnections(); server.close(); },
  };
  await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  return proxy;
}
