// The workflows the molt-control worker runs.
export { trainRun } from './train-run';
export { sftRun } from './sft-run';
export { rolloutShard } from './rollout-pool';
