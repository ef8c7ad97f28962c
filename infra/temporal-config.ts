// Where the client and the workers find Temporal, the Temporal way (@temporalio/envconfig): a TOML
// profile (file TEMPORAL_CONFIG_FILE, default ~/.config/temporalio/temporal.toml; profile
// TEMPORAL_PROFILE, default "default") under the variables TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
// TEMPORAL_API_KEY and TEMPORAL_TLS_*. Temporal Cloud or a cluster with mTLS or an API key needs no
// code. MOLT_TEMPORAL_ADDRESS, the name Molt used before, still stands in for TEMPORAL_ADDRESS.
import { loadClientConnectConfig, type ClientConnectConfig } from '@temporalio/envconfig';

export function temporalConfig(env: NodeJS.ProcessEnv = process.env): Required<ClientConnectConfig> {
  const vars = { ...env, TEMPORAL_ADDRESS: env.TEMPORAL_ADDRESS ?? env.MOLT_TEMPORAL_ADDRESS } as Record<string, string>;
  let config: ClientConnectConfig;
  try {
    config = loadClientConnectConfig({ overrideEnvVars: vars });
  } catch (err) {
    throw new Error(`Temporal configuration (${env.TEMPORAL_CONFIG_FILE ?? 'the default profile file'}): ${(err as Error).message}`);
  }
  return {
    connectionOptions: { ...config.connectionOptions, address: config.connectionOptions.address ?? 'localhost:7233' },
    namespace: config.namespace ?? 'default',
  };
}
