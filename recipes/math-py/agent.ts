// The math Env in Python (env.py beside this file), served over JSON lines on stdin/stdout.
import * as path from 'node:path';
import { pythonEnv } from '../python/adapter';

export const AgentRunner = pythonEnv(path.join(__dirname, 'env.py'));
