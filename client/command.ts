// What molt-client's commands share: the Temporal connection, the dotted recipe overrides, and the
// recipe keys' help generated from the zod schema.
import { Client, Connection } from '@temporalio/client';
import { temporalConfig } from '../infra/temporal-config';
import { z } from 'zod';
import { LIVE_SETTINGS } from '../agents/live-settings';
import { RecipeConfig } from '../agents/recipe';
import { UsageError } from './errors';

export interface Temporal { client: Client; connection: Connection; uiUrl: string }

// A local stack passes its address; otherwise Temporal's environment configuration says where
// (infra/temporal-config.ts: TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TLS, API key, TOML profiles).
export async function connect(address?: string, uiUrl = process.env.MOLT_TEMPORAL_UI ?? 'http://localhost:8233'): Promise<Temporal> {
  const { connectionOptions, namespace } = address ? { connectionOptions: { address }, namespace: 'default' } : temporalConfig();
  try {
    const connection = await Connection.connect(connectionOptions);
    return { client: new Client({ connection, namespace }), connection, uiUrl };
  } catch (err) {
    throw new Error(`cannot reach Temporal at ${connectionOptions.address} (set TEMPORAL_ADDRESS or a profile): ${(err as Error).message}`);
  }
}

// `--algo.lr 1e-4`, `--pool.inflight=8`, `--seed 3`: a flag that names a recipe key (its first
// part is a top-level key, or it has a dot) overrides recipe.json. These flags are taken out of argv
// before commander parses it, because commander treats every argument after an option it does not
// know as unknown too (a `--follow` after `--algo.lr 1e-4` would be lost), and `env.<key>` flags
// reach the agent's free-form settings, so they cannot all be declared options.
const TOP_LEVEL_KEYS = new Set(Object.keys(RecipeConfig.shape));
export function takeRecipeOverrides(args: string[]): { argv: string[]; overrides: Record<string, string> } {
  const argv: string[] = [];
  const overrides: Record<string, string> = {};
  for (let i = 0; i < args.length; i++) {
    if (args[i] === '--') { argv.push(...args.slice(i)); break; }
    const flag = /^--([A-Za-z_][\w-]*)((?:\.[\w-]+)*)(?:=([^]*))?$/.exec(args[i]);
    if (!flag || !(flag[2] || TOP_LEVEL_KEYS.has(flag[1]))) { argv.push(args[i]); continue; }
    const key = flag[1] + flag[2];
    const value = flag[3] ?? args[++i]; // the next argument even if it starts with '-' (e.g. -0.01)
    if (value === undefined) throw new UsageError(`--${key}: missing value`);
    overrides[key] = value;
  }
  return { argv, overrides };
}

interface JsonSchema {
  type?: string; enum?: unknown[]; anyOf?: JsonSchema[]; properties?: Record<string, JsonSchema>;
  items?: JsonSchema | false; prefixItems?: JsonSchema[]; additionalProperties?: JsonSchema | false; required?: string[]; default?: unknown;
  description?: string; minimum?: number; maximum?: number; exclusiveMinimum?: number; exclusiveMaximum?: number;
}

// Every recipe key with its type (bounds included), default and description, from the schema:
//   algo.lr                       number > 0; default 0.000001
export function recipeKeysHelp(): string {
  const rows: [string, string][] = [];
  const walk = (schema: JsonSchema, prefix: string, required: boolean) => {
    if (schema.properties) {
      for (const [key, child] of Object.entries(schema.properties)) {
        walk(child, prefix ? `${prefix}.${key}` : key, (schema.required ?? []).includes(key));
      }
      return;
    }
    const isRecord = schema.type === 'object' && schema.additionalProperties !== false;
    const facts = [
      describeType(schema),
      required ? 'required' : isRecord || schema.default === undefined ? '' : `default ${JSON.stringify(schema.default)}`,
      schema.description ?? '',
    ].filter(Boolean);
    rows.push([isRecord ? `${prefix}.<key>` : prefix, facts.join('; ')]);
  };
  walk(z.toJSONSchema(RecipeConfig, { io: 'input' }) as JsonSchema, '', false);
  return 'Recipe keys: recipe.json, overridden by --key value or --key=value '
    + `(numbers, true/false, null and JSON are parsed):\n${flagRows(rows)}`;
}

export const liveSettingsHelp = () => flagRows(Object.entries(LIVE_SETTINGS)
  .map(([key, schema]) => [key, describeType(z.toJSONSchema(schema) as JsonSchema)]));

function flagRows(rows: [string, string][]): string {
  const width = Math.max(...rows.map(([key]) => key.length)) + 4;
  return rows.map(([key, facts]) => `  --${key.padEnd(width)}${facts}`).join('\n');
}

const SAFE = Number.MAX_SAFE_INTEGER;
function describeType(s: JsonSchema): string {
  if (s.anyOf) return s.anyOf.map(describeType).join(' or ');
  if (s.enum) return s.enum.map((v) => String(v)).join('|');
  if (s.prefixItems) return `[${s.prefixItems.map(describeType).join(', ')}]`;
  if (s.type === 'array') return `JSON array of ${s.items ? describeType(s.items) : 'any'}`;
  if (s.type === 'object') return 'any JSON value';
  const bounds = [
    s.exclusiveMinimum !== undefined ? `> ${s.exclusiveMinimum}` : '',
    s.minimum !== undefined && s.minimum > -SAFE ? `>= ${s.minimum}` : '',
    s.exclusiveMaximum !== undefined ? `< ${s.exclusiveMaximum}` : '',
    s.maximum !== undefined && s.maximum < SAFE ? `<= ${s.maximum}` : '',
  ].filter(Boolean);
  return [s.type ?? 'any', ...bounds].join(' ');
}
