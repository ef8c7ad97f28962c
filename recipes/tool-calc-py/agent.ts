// The tool-calc agent in Python (agent.py beside this file), run as a command by Molt.
import * as path from 'node:path';
import { pythonChatAgent } from '../python/adapter';

export const AgentRunner = pythonChatAgent(path.join(__dirname, 'agent.py'));
