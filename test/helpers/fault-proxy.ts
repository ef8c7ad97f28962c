// A pass-through HTTP proxy in front of a real service that can break the next call to a route the
// way a network does: `resetNext('/resume')` resets the connection of the next such request before
// it reaches the service (the client sees ECONNRESET), as seen after an engine was SIGSTOPped and
// continued. Everything else is forwarded unchanged.
import * as http from 'node:http';
import { freePort } from '../../infra/stack';

export interface FaultProxy { url: string; resets: number; resetNext: (route: string) => void; close: () => void }

export async function faultProxy(target: string): Promise<FaultProxy> {
  const upstream = new URL(target);
  const port = await freePort();
  const armed = new Set<string>();
  const server = http.createServer((req, res) => {
    if (req.url && armed.delete(req.url)) {
      proxy.resets++;
      req.socket.resetAndDestroy();
      return;
    }
    const up = http.request({ host: upstream.hostname, port: upstream.port, path: req.url, method: req.method, headers: req.headers },
      (answer) => {
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        answer.on('close', () => { if (!answer.complete) res.destroy(); });
        answer.pipe(res);
      });
    up.on('error', () => res.destroy());
    req.on('error', () => up.destroy());
    req.pipe(up);
  });
  const proxy: FaultProxy = {
    url: `http://127.0.0.1:${port}`, resets: 0,
    resetNext: (route) => armed.add(route),
    close: () => { server.closeAllConnections(); server.close(); },
  };
  await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  return proxy;
}
